"""Hostile programs in the sandbox of clusterlm.tasks.sandbox: each is failed or timed out within its limits, leaves
no process and no directory behind, and the next program still runs.

The operating-system layers (network and PID namespaces, the ``nobody`` user) are tested where this machine has
them (:func:`sandbox_support`); the guard and the verdict protocol everywhere on POSIX.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from clusterlm.tasks.sandbox import WORKDIR_PREFIX, execute_program, sandbox_support

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the sandbox needs POSIX")

ADD = "def add(a, b):\n    return a + b\n"
ADD_TEST = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"
SUPPORT = sandbox_support()


def run(program: str, tmp_path: Path, **kwargs):
    kwargs.setdefault("timeout", 5.0)
    return execute_program(textwrap.dedent(program), tmp_dir=tmp_path / "sandbox", **kwargs)


def checked(program: str, tmp_path: Path, **kwargs):
    """Run ``program`` (which defines add) against ADD_TEST."""
    return run(program, tmp_path, test=ADD_TEST, entry_point="add", **kwargs)


def sandbox_processes(marker: str | None = None) -> list[str]:
    """Live processes of a sandbox: the harness (its payload argument) or a child named with ``marker``."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if ".payload.json" in cmdline or (marker and marker in cmdline):
            found.append(f"{entry}: {cmdline[:80]}")
    return found


@pytest.fixture(autouse=True)
def nothing_left(tmp_path: Path):
    (tmp_path / "sandbox").mkdir()
    before = set(Path(tempfile.gettempdir()).glob(WORKDIR_PREFIX + "*"))
    yield
    assert list((tmp_path / "sandbox").iterdir()) == [], "a working directory was left behind"
    assert set(Path(tempfile.gettempdir()).glob(WORKDIR_PREFIX + "*")) <= before
    assert sandbox_processes() == []
    after = run(ADD, tmp_path, test=ADD_TEST, entry_point="add")  # the next program still runs
    assert after.status == "passed", after


def test_a_correct_program_passes_and_a_wrong_one_fails(tmp_path):
    assert checked(ADD, tmp_path).status == "passed"
    wrong = checked("def add(a, b):\n    return a - b\n", tmp_path)
    assert wrong.status == "failed" and wrong.detail == "AssertionError"
    missing = run("x = 1\n", tmp_path, test=ADD_TEST, entry_point="add")
    assert missing.status == "failed" and "add" in missing.detail
    syntax = checked("def add(a, b)\n    return a + b\n", tmp_path)
    assert syntax.status == "failed" and syntax.detail.startswith("SyntaxError")
    mbpp = run(ADD, tmp_path, test="assert add(2, 2) == 4\n", entry_point="add")  # top-level asserts, no check
    assert mbpp.status == "passed"
    assert run(ADD, tmp_path, test="assert add(2, 2) == 5\n", entry_point="add").status == "failed"


def test_an_infinite_loop_times_out_within_its_limit(tmp_path):
    start = time.monotonic()
    result = checked("def add(a, b):\n    while True:\n        pass\n", tmp_path, timeout=1.0)
    assert result.status == "timed out" and 1.0 <= result.seconds < 4.0, result
    assert time.monotonic() - start < 6.0
    sleeper = run("import time\ntime.sleep(60)\n", tmp_path, timeout=1.0)  # no CPU used: the wall clock ends it
    assert sleeper.status == "timed out" and sleeper.seconds < 4.0


def test_an_output_flood_is_bounded(tmp_path):
    result = run("while True:\n    print('x' * 10000)\n", tmp_path, timeout=1.0)
    assert result.status == "timed out" and len(result.output) <= 2 * 4096 + 1


def test_a_memory_bomb_fails_at_its_limit(tmp_path):
    big = run("x = bytearray(8 << 30)\n", tmp_path, memory_mb=256)
    assert big.status == "failed" and "MemoryError" in big.detail
    start = time.monotonic()
    growing = run("x = []\nwhile True:\n    x.append(b'y' * (1 << 20))\n", tmp_path, memory_mb=256)
    assert growing.status == "failed" and "MemoryError" in growing.detail and time.monotonic() - start < 10


@pytest.mark.parametrize("how", ["fork", "subprocess", "system", "posix_spawn"])
def test_starting_processes_is_refused(tmp_path, how):
    marker = f"30.{uuid.uuid4().int % 10**8:08d}"
    witness = tmp_path / "started"
    program = {
        "fork": "import os\nif os.fork() == 0:\n    os.execvp('sleep', ['sleep', '{m}'])\n",
        "subprocess": "import subprocess\nsubprocess.Popen(['sleep', '{m}'])\n",
        "system": "import os\nos.system('touch {w}; sleep {m}')\n",
        "posix_spawn": "import os\nos.posix_spawnp('sleep', ['sleep', '{m}'], dict(os.environ))\n",
    }[how].format(m=marker, w=witness)
    result = run(program, tmp_path)
    assert result.status == "failed" and "PermissionError" in result.detail, result
    assert sandbox_processes(marker) == [] and not witness.exists()


def test_the_low_level_process_calls_are_refused_too(tmp_path):
    program = """
        import _posixsubprocess, os
        r, w = os.pipe()
        _posixsubprocess.fork_exec(['/bin/true'], [b'/bin/true'], True, (), None, None, -1, -1, -1, -1, -1, -1,
                                   r, w, False, False, -1, None, None, None, -1, None)
    """
    assert "PermissionError" in run(program, tmp_path).detail
    again = "import sys\ndel sys.modules['_posixsubprocess']\nimport _posixsubprocess\n"
    assert "PermissionError" in run(again, tmp_path).detail
    imports = "import subprocess, socket, asyncio, multiprocessing\n"  # importing them is fine; using them is not
    assert run(imports, tmp_path).status == "passed"
    ctypes = "import ctypes\nctypes.CDLL(None).system(b'true')\n"
    assert run(ctypes, tmp_path).status == "failed"


@pytest.mark.parametrize("escape", [False, True])
def test_children_that_outlive_the_program_are_killed(tmp_path, escape):
    """Without the guard (the operating-system layer alone): two children that keep sleeping after the program
    ended; with ``escape`` they leave the process group first (setsid), which only a PID namespace catches."""
    if escape and not SUPPORT.namespaces:
        pytest.skip("no PID namespace here: a child that leaves the process group is not caught")
    marker = f"30.{uuid.uuid4().int % 10**8:08d}"
    program = f"""
        import os
        for _ in range(2):
            if os.fork() == 0:
                if {escape}:
                    os.setsid()
                os.execvp('sleep', ['sleep', '{marker}'])
    """
    result = run(program, tmp_path, guard=False)
    assert result.status == "passed", result  # the program itself ran to its end
    deadline = time.monotonic() + 5
    while sandbox_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes(marker) == []


def test_a_child_still_running_at_the_timeout_is_killed(tmp_path):
    marker = f"30.{uuid.uuid4().int % 10**8:08d}"
    program = f"import os, time\nif os.fork() == 0:\n    os.execvp('sleep', ['sleep', '{marker}'])\ntime.sleep(60)\n"
    result = run(program, tmp_path, guard=False, timeout=1.0)
    assert result.status == "timed out"
    deadline = time.monotonic() + 5
    while sandbox_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes(marker) == []


def test_files_outside_the_working_directory_are_untouched(tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text("intact")
    before = sorted(p.name for p in tmp_path.iterdir())
    attempts = [
        f"open({str(canary)!r}, 'w').write('pwned')",
        f"open({str(canary)!r}, 'a').write('pwned')",
        f"import os\nos.remove({str(canary)!r})",
        f"import pathlib\npathlib.Path({str(canary)!r}).unlink()",
        f"import os\nos.rename({str(canary)!r}, 'stolen')",
        f"import os\nos.chmod({str(canary)!r}, 0)",
        f"open({str(tmp_path / 'new.txt')!r}, 'w').write('x')",
        f"import os\nos.mkdir({str(tmp_path / 'newdir')!r})",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
        f"import os\nos.symlink({str(canary)!r}, 'link')\nopen('link', 'w').write('pwned')",
        f"import os\nos.chdir({str(tmp_path)!r})\nopen('canary.txt', 'w').write('pwned')",
        f"import os\nfd = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
        "os.open('canary.txt', os.O_WRONLY | os.O_TRUNC, dir_fd=fd)",
        f"import os\nos.truncate({str(canary)!r}, 0)",
        f"import os\nos.fchmod(os.open({str(canary)!r}, os.O_RDONLY), 0)",
    ]
    for program in attempts:
        result = run(program, tmp_path)
        assert result.status == "failed" and "PermissionError" in result.detail, (program, result)
    assert canary.read_text() == "intact" and sorted(p.name for p in tmp_path.iterdir()) == before
    inside = run("import os\nopen('a.txt', 'w').write('x')\nos.mkdir('d')\nos.rename('a.txt', 'd/b.txt')\n"
                 "os.remove('d/b.txt')\nos.rmdir('d')\nimport tempfile\ntempfile.mkstemp()\n", tmp_path)
    assert inside.status == "passed", inside  # its own directory is its to use


def test_no_network_connection(tmp_path):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.3)
    port = listener.getsockname()[1]
    program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'x')\n"
    try:
        guarded = run(program, tmp_path)
        assert guarded.status == "failed" and "PermissionError" in guarded.detail, guarded
        if SUPPORT.namespaces:  # the network namespace alone: no route even to this machine's loopback
            bare = run(program, tmp_path, guard=False)
            assert bare.status == "failed" and ("unreachable" in bare.detail or "refused" in bare.detail), bare
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody connected
    finally:
        listener.close()


@pytest.mark.parametrize("program", [
    "import sys\nsys.exit(0)\n" + ADD,
    "import os\nos._exit(0)\n" + ADD,
    "raise SystemExit(0)\n",
    "def add(a, b):\n    raise SystemExit(0)\n",
    "def add(a, b):\n    import os\n    os._exit(0)\n",
    "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    return 0\n",
    "print('passed')\nprint('ready')\ndef add(a, b):\n    return 0\n",
    "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'ready\\n' + b'0' * 32 + b':passed\\n')\n"
    "    except OSError:\n        pass\ndef add(a, b):\n    return 0\n",
], ids=["sys.exit", "os._exit", "SystemExit", "exit-in-candidate", "os._exit-in-candidate", "atexit",
        "print-passed", "forged-verdict"])
def test_an_early_exit_or_a_forged_verdict_fails(tmp_path, program):
    result = checked(program, tmp_path)
    assert result.status == "failed", result


@pytest.mark.parametrize("program", [
    "def add(a, b):\n    return 0\ndef check(candidate):\n    pass\n",
    "import builtins\nbuiltins.check = lambda candidate: None\ndef add(a, b):\n    return 0\n",
    "import builtins\nbuiltins.exec = lambda *a, **k: None\ndef add(a, b):\n    return 0\n",
    "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\ndef add(a, b):\n    return 0\n",
    "import sys\nsys.settrace(lambda *a: None)\ndef add(a, b):\n    return 0\n",
    "import threading, time\ng = globals()\ndef swap():\n    while True:\n        if 'check' in g:\n"
    "            g['check'].__code__ = (lambda candidate: None).__code__\n            return\n"
    "threading.Thread(target=swap, daemon=True).start()\ndef add(a, b):\n    time.sleep(0.5)\n    return 0\n",
    "import threading\ng = globals()\ndef swap():\n    while True:\n        g['check'] = lambda candidate: None\n"
    "threading.Thread(target=swap, daemon=True).start()\ndef add(a, b):\n    return 0\n",
], ids=["redefine-check", "builtins-check", "builtins-exec", "assertion-error", "settrace", "code-swap-thread",
        "rebind-thread"])
def test_monkeypatching_the_checker_fails(tmp_path, program):
    result = checked(program, tmp_path)
    assert result.status in ("failed", "timed out"), result


@pytest.mark.parametrize("program", [
    "import sys\nf = sys._getframe(1)\n",
    "import inspect\nf = inspect.stack()\n",
    "try:\n    raise ValueError\nexcept ValueError as e:\n    f = e.__traceback__.tb_frame\n",
    "def g():\n    yield 1\nf = g().gi_frame\n",
    "import gc\nobjs = gc.get_objects()\n",
    "import sys\nframes = sys._current_frames()\n",
    "open('/proc/self/mem', 'rb')\n",
    "import os\nfd = os.open('/proc/self', os.O_RDONLY)\nos.open('mem', os.O_RDONLY, dir_fd=fd)\n",
    "import _imp\nd = _imp.create_builtin.__kwdefaults__\n",
    "import _signal\nd = _signal.signal.__kwdefaults__\n",
    "import _imp\nclass Name(str):\n    def __hash__(self):\n        return 1\n    def __eq__(self, other):\n"
    "        return False\nclass Spec:\n    name, loader, origin = Name('_signal'), None, None\n"
    "_imp.create_builtin(Spec())\n",
], ids=["_getframe", "inspect", "tb_frame", "gi_frame", "gc", "current_frames", "proc-mem", "dir_fd", "kwdefaults",
        "signal-kwdefaults", "fake-spec"])
def test_reaching_the_harness_memory_is_refused(tmp_path, program):
    result = checked(program + ADD, tmp_path)
    assert result.status == "failed" and ("PermissionError" in result.detail or "ValueError" in result.detail), result


def test_the_guard_does_not_lean_on_what_the_program_can_change(tmp_path):
    """Rebinding builtins does not switch the checks off; the harness's module is out of reach; a native module
    the program writes cannot be loaded."""
    canary = tmp_path / "canary.txt"
    patched = f"import builtins\nbuiltins.isinstance = lambda *a: False\nbuiltins.any = lambda *a: False\n" \
              f"builtins.len = lambda *a: 0\nopen({str(canary)!r}, 'w').write('pwned')\n"
    assert "PermissionError" in run(patched, tmp_path).detail and not canary.exists()
    hidden = "import sys\nassert not hasattr(sys.modules['__main__'], 'install_guard')\n"
    assert run(hidden, tmp_path).status == "passed"
    native = next(Path(sys.base_prefix).glob("lib/python3*/lib-dynload/_json*.so"), None)
    if native is not None:
        program = f"import shutil, importlib.util\nshutil.copy({str(native)!r}, 'evil.so')\n" \
                  "importlib.util.module_from_spec(importlib.util.spec_from_file_location('_json', 'evil.so'))\n"
        result = run(program, tmp_path)
        assert result.status == "failed" and "native module" in result.detail, result


def test_a_signal_handler_gets_no_frame_to_walk(tmp_path):
    """A Python signal handler is called with the interrupted frame, whose f_back chain leads to the harness's
    locals (the token): the guard installs no handler, so the forged verdict never comes."""
    program = """
        import os, signal, sys, time
        found = []
        def handler(signum, frame):
            while frame is not None:
                if "nonce" in frame.f_locals:
                    found.append(frame.f_locals["nonce"])
                frame = frame.f_back
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, 0.01)
        start = time.time()
        while not found and time.time() - start < 0.5:
            pass
        if found:
            os.write(int(sys.argv[3]), found[0] + b":passed\\n")
            os._exit(0)
        def add(a, b):
            return 0
    """
    assert checked(program, tmp_path).status == "failed"
    runs_asyncio = "import asyncio\nasync def f():\n    return 3\nassert asyncio.run(f()) == 3\n"
    assert run(runs_asyncio, tmp_path).status == "passed"  # asyncio's own SIGINT handler is simply not installed


def test_the_environment_is_scrubbed(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "secret-token")
    program = "import os\nassert 'HF_TOKEN' not in os.environ, os.environ\nassert os.getcwd() == os.environ['HOME']\n"
    assert run(program, tmp_path).status == "passed"


@pytest.mark.skipif(not Path("/usr/bin/python3").is_file(), reason="no system interpreter readable by nobody")
def test_as_root_the_program_runs_as_nobody_where_possible(tmp_path):
    support = sandbox_support("/usr/bin/python3")
    if not support.nobody:
        pytest.skip("cannot run programs as nobody here (not root, or no unshare)")
    canary = Path(tempfile.gettempdir()) / f"clusterlm-canary-{uuid.uuid4().hex}"
    canary.write_text("intact")
    try:
        program = f"import os\nassert os.getuid() == 65534\nopen({str(canary)!r}, 'w').write('pwned')\n"
        result = execute_program(program, 5.0, guard=False, python="/usr/bin/python3")  # the OS alone
        assert result.status == "failed" and "PermissionError" in result.detail, result
        assert canary.read_text() == "intact"
    finally:
        canary.unlink()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="timeout"):
        execute_program("pass", 0)
    with pytest.raises(ValueError, match="memory_mb"):
        execute_program("pass", 1.0, memory_mb=0)


def test_a_missing_interpreter_is_an_error(tmp_path):
    result = run("pass", tmp_path, python=str(tmp_path / "no-python"))
    assert result.status == "error", result


def test_the_public_name():
    import clusterlm

    assert clusterlm.execute_program is execute_program
    assert sys.modules["clusterlm.tasks.sandbox"].execute_program is execute_program
