"""clusterlm.launch.exiting: the command-line entries end as ``sys.exit(main())`` would — status, ``atexit`` handlers,
threads that are not daemons, buffered output — only without the interpreter's teardown; a process that
multiprocessing started ends through multiprocessing (its parent gets its result)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from clusterlm.launch.exiting import exit_status


def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(code), encoding="utf-8")
    return subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=60)


PROGRAM = """
    import atexit, concurrent.futures, sys, threading, time
    from pathlib import Path
    from clusterlm.launch.exiting import run_and_exit

    out = Path(sys.argv[1])
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    pool = concurrent.futures.ThreadPoolExecutor(2)  # idle workers (not daemons): they are told to stop, not waited on
    pool.submit(lambda: None).result()

    def late():
        time.sleep(0.3)
        (out / "thread").write_text("joined")

    def main():
        threading.Thread(target=late).start()
        print("buffered, never flushed by the program", end="")
        {ending}

    run_and_exit(main)
"""


@pytest.mark.parametrize(("ending", "status", "stderr"), [
    ("return 3", 3, ""),
    ("return None", 0, ""),
    ("raise SystemExit(2)", 2, ""),
    ("raise SystemExit('a message')", 1, "a message"),
])
def test_run_and_exit_ends_as_sys_exit_would(ending, status, stderr, tmp_path):
    proc = _run(PROGRAM.format(ending=ending), tmp_path)
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == "buffered, never flushed by the program"
    assert proc.stderr.strip() == stderr
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "joined"


def test_an_uncaught_exception_keeps_its_traceback_and_status(tmp_path):
    proc = _run("""
        from clusterlm.launch.exiting import run_and_exit

        def main():
            raise RuntimeError("boom")

        run_and_exit(main)
    """, tmp_path)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "RuntimeError: boom" in proc.stderr


def test_a_multiprocessing_child_ends_through_multiprocessing(tmp_path):
    """A rank forked by the agent's fork server runs the command's module: its result must reach torch's launcher,
    which waits for it (an os._exit in the child would leave the launcher waiting for ever)."""
    proc = _run("""
        import multiprocessing as mp
        from clusterlm.launch.exiting import run_and_exit

        def child(queue):
            try:
                run_and_exit(lambda: 4)
            except SystemExit as e:  # what a rank's runpy wrapper sees
                queue.put(("SystemExit", e.code))

        if __name__ == "__main__":
            ctx = mp.get_context("forkserver")
            queue = ctx.Queue()
            p = ctx.Process(target=child, args=(queue,))
            p.start()
            print(queue.get(timeout=30))
            p.join(30)
            print(p.exitcode)
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["('SystemExit', 4)", "0"]


def test_exit_status_follows_sys_exit(capsys):
    assert (exit_status(None), exit_status(0), exit_status(75)) == (0, 0, 75)
    assert exit_status("no such file") == 1 and capsys.readouterr().err == "no such file\n"
