"""Preemption signals as a scheduler or a terminal sends them (issue 52): to the whole process group of
``clusterlm train --nproc 2`` (launcher, agent, fork server, resource tracker: SLURM's and Ctrl-C's way), to one
rank only (what ``srun`` does to its tasks), or to the launching process only (``kill PID``). Each is one
preemption: exit 75 within a minute, the step checkpointed, one line saying how to resume, no traceback, no per-rank
progress file left; ``--resume`` then gives the losses and the final weights of an uninterrupted run.
``clusterlm select --nproc 2`` signalled as a group keeps its stored shards, and its rerun writes the plan of an
uninterrupted selection.

A second signal more than the duplicate window after the first, or a grace that runs out, ends a process at once
(the watch alone, in a small process).

The preemptions are chained on one run (each stop is resumed, and the next signal stops the resumed run), so 6
runs, not 10, give the 5 signals and their resumes; the uninterrupted 2-rank run and selection they must equal are
the session's (tests/reliability/conftest.py: ``train_reference``, ``select_reference``, shared with
test_faults.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_helpers import (
    REFERENCE_STEPS,
    assert_same_plan,
    checkpoint_weights,
    clusterlm_command,
    reference_train,
    train_losses,
)

from clusterlm.launch.hangs import PROGRESS_DIR
from clusterlm.launch.preemption import PREEMPTED, PREEMPTED_EXIT
from clusterlm.launch.ranks import rank_pids
from clusterlm.selection.pipeline import STORE_KEY

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

def _signalled(cmd: list[str], ready, send, timeout: float = 240) -> SimpleNamespace:
    """Run ``cmd`` in a session of its own; once ``ready()``, ``send(proc)``; wait for the end (every process of the
    run is killed should anything fail or hang). Returns the status, stderr and the seconds from the signal."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert proc.poll() is None, f"the run ended before the signal ({proc.returncode}): {proc.stderr.read()}"
            assert time.monotonic() < deadline, "the run was not ready in time"
            seen.update(rank_pids(proc.pid).values())
            time.sleep(0.02)
        seen.update(rank_pids(proc.pid).values())
        t0 = time.monotonic()
        send(proc)
        _, err = proc.communicate(timeout=120)
        return SimpleNamespace(rc=proc.returncode, err=err, took=time.monotonic() - t0)
    finally:
        for pid in [*seen, *rank_pids(proc.pid).values()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait(timeout=30)


def _group(signum: int):
    return lambda proc: os.killpg(proc.pid, signum)


def _rank1(signum: int):
    return lambda proc: os.kill(rank_pids(proc.pid)[1], signum)


def test_every_preemption_signal_stops_the_run_once_and_resume_equals_an_uninterrupted_run(tiny, train_reference,
                                                                                          tmp_path):
    out = tmp_path / "run"
    stops = []
    for how, send in [("SIGTERM to the launching process only", lambda proc: proc.send_signal(signal.SIGTERM)),
                      ("SIGTERM to the process group", _group(signal.SIGTERM)),
                      ("SIGUSR1 to the process group", _group(signal.SIGUSR1)),
                      ("SIGINT to the process group", _group(signal.SIGINT)),
                      ("SIGTERM to rank 1 only", _rank1(signal.SIGTERM))]:
        after = max(train_losses(out), default=0) + 2  # a step of this (resumed) run, not only the restored records
        cmd = reference_train(tiny, out, *(["--resume"] if stops else []))
        run = _signalled(cmd, lambda after=after: max(train_losses(out), default=0) >= after, send)
        assert run.rc == PREEMPTED_EXIT, (how, run.rc, run.err[-3000:])
        lines = [line for line in run.err.splitlines() if line.strip()]
        assert len(lines) == 1 and "preempted (SIG" in lines[0], (how, run.err[-3000:])
        assert "resume with: clusterlm train --config" in lines[0] and "--resume" in lines[0], (how, lines[0])
        assert run.took < 60, (how, run.took)
        stopped = json.loads((out / PREEMPTED).read_text(encoding="utf-8"))
        assert Path(stopped["checkpoint"]).name == f"step_{stopped['step']:07d}.pt", (how, stopped)
        assert after <= stopped["step"] < REFERENCE_STEPS and Path(stopped["checkpoint"]).is_file(), (how, stopped)
        assert not list(out.rglob("*.tmp*")) and not (out / PROGRESS_DIR).exists(), (how, list(out.rglob("*")))
        assert {s: v for s, v in train_reference.losses.items() if s <= stopped["step"]} == train_losses(out), how
        stops.append(stopped["step"])
    assert stops == sorted(set(stops)), stops
    resumed = subprocess.run(clusterlm_command("train", "--config", str(out / "train_config.yaml"), "--resume"),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert train_losses(out) == train_reference.losses  # every step's loss, across 5 stops and resumes
    mine, ref = checkpoint_weights(out), checkpoint_weights(train_reference.out)
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)


def test_select_signalled_as_a_group_keeps_its_shards_and_the_rerun_writes_the_same_plan(select_reference,
                                                                                         tmp_path):
    out = tmp_path / "signalled"
    cmd = clusterlm_command(*select_reference.argv, "--nproc", "2", "--out", str(out))
    run = _signalled(cmd, lambda: (out / "features" / STORE_KEY).exists(), _group(signal.SIGTERM))
    assert run.rc == PREEMPTED_EXIT, run.err[-3000:]
    lines = [line for line in run.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "clusterlm select: preempted" in lines[0] and "resume with:" in lines[0], run.err
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert_same_plan(select_reference.out, out)


def test_a_signal_again_within_the_window_is_the_same_one_a_later_one_or_the_grace_ends_the_process():
    code = textwrap.dedent("""
        import os, signal, sys, time
        from clusterlm.launch.preemption import PreemptionWatch
        watch = PreemptionWatch(float(sys.argv[1]), window=0.5)
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a forwarded copy: the same preemption
        print("noted", watch.signal_name, flush=True)
        time.sleep(2)
        print("alive", flush=True)
        os.kill(os.getpid(), signal.SIGINT)  # a second signal: no more grace
        time.sleep(5)
        print("not ended", flush=True)
    """)
    second = subprocess.run([sys.executable, "-c", code, "30"], capture_output=True, text=True, timeout=120)
    assert (second.returncode, second.stdout.split()) == (128 + signal.SIGINT, ["noted", "SIGUSR1", "alive"])
    t0 = time.monotonic()
    grace = subprocess.run([sys.executable, "-c", code, "1"], capture_output=True, text=True, timeout=120)
    assert (grace.returncode, grace.stdout.split()) == (128 + signal.SIGUSR1, ["noted", "SIGUSR1"])
    assert time.monotonic() - t0 < 60, grace.stderr
