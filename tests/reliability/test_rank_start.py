"""Ranks forked from the agent's preloaded fork server (clusterlm.launch.ranks): the preload never touches CUDA (a
fork server that did would hand every rank a CUDA driver it cannot use), and a rank behaves as the command
``python -m MODULE ARGS`` would: its arguments, its exit status, its exit handlers, its name and its own session.

The runs through it (2-rank training, restarts, preemption, a dead or hung rank) are in test_faults.py,
test_processes.py and the 2-rank tests of tests/clusterlm.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from clusterlm.launch.ranks import PRELOAD, RANK_NAME, rank_pids

CUDA_CALLS = ("is_available", "device_count", "init", "_lazy_init", "current_device", "set_device",
              "get_device_capability", "get_device_properties", "is_bf16_supported", "synchronize", "mem_get_info")


def test_the_fork_servers_preload_calls_no_cuda_function() -> None:
    code = textwrap.dedent(f"""
        import json, torch, torch.cuda
        calls = []
        for name in {CUDA_CALLS!r}:
            if hasattr(torch.cuda, name):
                def record(*a, _name=name, _f=getattr(torch.cuda, name), **k):
                    calls.append(_name)
                    return _f(*a, **k)
                setattr(torch.cuda, name, record)
        for module in {PRELOAD!r}:
            __import__(module)
        print(json.dumps(calls))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == []
    # what every rank of train and select imports
    assert {"clusterlm.cli.commands", "clusterlm.training.loop", "clusterlm.selection.pipeline"} <= set(PRELOAD)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("status", [0, 3])
def test_a_rank_runs_its_module_as_the_command_would(tmp_path: Path, status: int) -> None:
    (tmp_path / "rankmod.py").write_text(textwrap.dedent("""
        import atexit, json, multiprocessing, os, sys
        atexit.register(lambda: open("exit_handlers", "a").write("ran\\n"))
        json.dump({"argv": sys.argv[1:], "name": sys.argv[0], "main": __name__,
                   "comm": open(f"/proc/{os.getpid()}/comm").read().strip(),
                   "session_leader": os.getsid(0) == os.getpid(),
                   "start_method": multiprocessing.get_start_method()}, open("seen.json", "w"))
        sys.exit(int(sys.argv[1]))
    """), encoding="utf-8")
    argv = [str(status), "--config", "x.yaml"]
    code = textwrap.dedent(f"""
        import multiprocessing, os, sys
        from clusterlm.launch.ranks import rank_main
        os.environ["RANK"] = "7"
        rank = multiprocessing.get_context("forkserver").Process(target=rank_main, args=("rankmod", *{argv!r}))
        rank.start()
        rank.join()
        sys.exit(rank.exitcode)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == status, proc.stderr[-3000:]
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["argv"] == [str(status), "--config", "x.yaml"] and seen["main"] == "__main__"
    assert seen["name"].endswith("rankmod.py") and seen["comm"] == f"{RANK_NAME}7" and seen["session_leader"]
    assert (tmp_path / "exit_handlers").read_text() == "ran\n"  # once: run by rank_main, not again at exit
    assert seen["start_method"] == multiprocessing.get_context().get_start_method()  # the platform's default


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_rank_pids_finds_the_named_ranks_under_a_process() -> None:
    code = textwrap.dedent(f"""
        import subprocess, sys, time
        name = "import ctypes, sys, time; ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0); time.sleep(60)"
        ranks = [subprocess.Popen([sys.executable, "-c", name, f"{RANK_NAME}{{r}}"]) for r in (0, 1)]
        other = subprocess.Popen(["sleep", "60"])
        print(" ".join(str(p.pid) for p in ranks), flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        deadline = time.monotonic() + 30
        while rank_pids(parent.pid) != {0: pids[0], 1: pids[1]}:  # until both have named themselves
            assert time.monotonic() < deadline, rank_pids(parent.pid)
            time.sleep(0.05)
        assert rank_pids(pids[0]) == {}  # nothing named under a rank
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
