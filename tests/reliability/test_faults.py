"""Faults of a multi-process run on 2 gloo ranks with the tiny model (issue 37): a killed rank with --max-restarts, a
stopped rank with --dist-timeout, the first failure named, select killed and restarted, and no litter after a failed
start. Preemption (a signal, then --resume) is tests/reliability/test_signals.py.

The uninterrupted runs the interrupted ones must equal are the session's (tests/reliability/conftest.py:
``train_reference``, ``select_reference``), shared with test_signals.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_helpers import (
    REFERENCE_SAVE_EVERY,
    assert_same_plan,
    checkpoint_weights,
    clusterlm_command,
    reference_train,
    train_losses,
)

from clusterlm.cli import commands as cli
from clusterlm.launch.environment import process_stopped
from clusterlm.launch.failures import first_failure
from clusterlm.launch.ranks import rank_pids
from clusterlm.selection.pipeline import STORE_KEY

pytestmark = pytest.mark.slow


def _wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended early ({proc.returncode}): {proc.stderr.read()[-2000:]}"
        try:
            if max(train_losses(out), default=0) >= step:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of training rank ``rank`` under ``launcher``."""
    pids = rank_pids(launcher)
    assert rank in pids, f"no rank {rank} under {launcher}: {pids}"
    return pids[rank]


def test_a_killed_rank_restarts_from_the_checkpoint_with_the_same_final_weights(tiny, train_reference, tmp_path):
    out = tmp_path / "restarted"
    proc = subprocess.Popen(reference_train(tiny, out, "--max-restarts", "1", "--dist-timeout", "60",
                                            "--preemption-grace", "10"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(out, REFERENCE_SAVE_EVERY + 2, proc)
    victim = _rank_pid(proc.pid, 1)
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-6000:]
    restart = [line for line in err.splitlines() if "restarting every rank" in line]
    assert len(restart) == 1, err[-3000:]
    assert f"rank 1 (pid {victim}) was killed by signal 9 (SIGKILL) first" in restart[0], restart[0]
    assert "(restart 1 of 1)" in restart[0]
    mine, ref = checkpoint_weights(out), checkpoint_weights(train_reference.out)
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
    assert train_losses(out) == train_reference.losses


def test_a_stopped_rank_fails_the_run_in_bounded_time_naming_it(tiny, tmp_path):
    out = tmp_path / "stopped"
    proc = subprocess.Popen(reference_train(tiny, out, "--dist-timeout", "10"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_for_step(out, 3, proc)
    victim = _rank_pid(proc.pid, 1)
    os.kill(victim, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        try:
            os.kill(victim, signal.SIGKILL)
        except OSError:
            pass
    took = time.monotonic() - t0
    assert proc.returncode != 0 and took < 30, (proc.returncode, took, err[-2000:])
    line = [s for s in err.splitlines() if "error" in s][-1]
    assert "rank 0 waited 10 s in" in line and "rank 1 (pid" in line and "stopped or hung" in line, err[-2000:]


class _Failure(SimpleNamespace):
    def signal_name(self) -> str:
        return signal.Signals(-self.exitcode).name


def test_the_first_failure_is_the_killed_rank_not_the_survivor_the_launcher_stopped(tmp_path):
    err_file = tmp_path / "1" / "error.json"
    err_file.parent.mkdir()
    (err_file.parent / "stderr.log").write_text("loading\nstep 7: out of memory\n", encoding="utf-8")
    survivor = {"clusterlm": {"line": "clusterlm train: error (rank 0 of 2): Connection closed by peer",
                              "exit_code": 1, "time_ns": 2_500_000_000}}  # it noticed the lost peer at 2.5 s
    failures = {0: _Failure(exitcode=1, pid=10, timestamp=1.0, error_file="", error_file_data=survivor),
                1: _Failure(exitcode=-9, pid=11, timestamp=2.0, error_file=str(err_file), error_file_data={})}
    line, code = first_failure(failures)
    assert line.startswith("clusterlm: rank 1 (pid 11) was killed by signal 9 (SIGKILL) first") and code == 1
    assert "step 7: out of memory" in line and line.endswith("the other 1 failed rank(s) were stopped after it")
    stopped = {0: _Failure(exitcode=-15, pid=10, timestamp=1.0, error_file="", error_file_data={}),
               1: failures[1]}
    assert first_failure(stopped)[0].startswith("clusterlm: rank 1 (pid 11)")  # SIGTERM is the launcher's own
    # the agent killed rank 1 itself, 30 s after rank 0 reported (it would not stop): rank 0's report is the cause
    forced = {0: failures[0], 1: _Failure(exitcode=-9, pid=11, timestamp=32.0, error_file="", error_file_data={})}
    assert first_failure(forced)[0].startswith("clusterlm train: error (rank 0 of 2): Connection closed")
    # the agent killed a stopped rank 1 at once (0.5 s after rank 0 reported): named as stopped by it, not the cause
    hung = {0: failures[0], 1: _Failure(exitcode=-9, pid=11, timestamp=3.0, error_file="", error_file_data={})}
    assert first_failure(hung)[0].startswith("clusterlm: rank 1 (pid 11) was killed by signal 9")
    assert first_failure(hung, stopped_by_launcher={11})[0].startswith("clusterlm train: error (rank 0 of 2)")
    reported = {0: failures[0], 1: _Failure(exitcode=1, pid=11, timestamp=0.5, error_file="", error_file_data={})}
    assert first_failure(reported)[0].startswith("clusterlm train: error (rank 0 of 2): Connection closed")


def test_select_killed_and_restarted_gives_the_same_plan(select_reference, tmp_path):
    out = tmp_path / "killed"
    proc = subprocess.Popen(clusterlm_command(*select_reference.argv, "--nproc", "2", "--out", str(out),
                                              "--max-restarts", "1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    # the feature store is set up (its key file written): the ranks featurize now; kill one mid-way (on the tiny data
    # the shards themselves can be stored and assembled faster than a poll sees them)
    while not (out / "features" / STORE_KEY).exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.01)
    os.kill(_rank_pid(proc.pid, 1), signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "restarting every rank" in err, err[-3000:]
    assert_same_plan(select_reference.out, out)


def test_a_failed_start_leaves_no_out_directory(tiny, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"  # found, but not JSON: the run fails after it made OUT, before any output
    bad.write_text("this is not json\n", encoding="utf-8")
    new = tmp_path / "new_out"
    assert cli.main(["train", *tiny.argv(new), "--data", str(bad)]) == 2
    assert not new.exists(), list(new.rglob("*"))
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine", encoding="utf-8")
    assert cli.main(["train", *tiny.argv(kept), "--data", str(bad)]) == 2
    assert (kept / "notes.txt").read_text(encoding="utf-8") == "mine"
    sel = tmp_path / "select_out"
    assert cli.main(["select", "--model", "tiny-llama", "--data", str(bad), "--world-size", "2", "--ratio", "0.5",
                     "--out", str(sel), "--no-progress"]) == 2
    assert not sel.exists(), list(sel.rglob("*"))
    assert "invalid JSON" in capsys.readouterr().err


def test_process_stopped_tells_a_stopped_process_from_a_running_one():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert not process_stopped(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not process_stopped(proc.pid):
            assert time.monotonic() < deadline, "SIGSTOP did not stop the process"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGCONT)
        while process_stopped(proc.pid):
            assert time.monotonic() < deadline, "SIGCONT did not continue the process"
            time.sleep(0.01)
    finally:
        proc.kill()
        proc.wait()
    assert not process_stopped(proc.pid)  # gone
