"""Processes, as a careless user meets them (issue 15, classes 2 and 7, and class 4 for ``train``).

- The launcher of ``clusterlm train --nproc 2`` is SIGKILLed: torch's launcher and both ranks go with it
  within seconds (no rank trains on unsupervised), and the dead run's lock does not block the next run.
- A second run, a ``--resume`` or an ``--overwrite`` on the ``--out`` of a live run is refused at once, naming
  the PID that holds the run directory (and nothing of the live run is touched).
- ``--nproc 0`` / ``-1`` are refused before anything starts (train and select).
- One rank failing (a ``ValueError`` or a crash on rank 1 only) ends the run with that rank's one line, exit
  status 2 for a user error and 1 for a failure, no torchrun ``ChildFailedError`` block, no traceback, and the
  other rank does not hang.
- Every trainer argument and the output location are checked before any model is loaded.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_helpers import nonblank_lines, run_cli

from clusterlm.launch import launcher as launch
from clusterlm.launch.environment import AGENT_PID_ENV
from clusterlm.launch.failures import first_failure
from clusterlm.launch.launcher import spawn
from clusterlm.launch.ranks import rank_pids
from clusterlm.selection import pipeline
from clusterlm.training import model as train_model
from clusterlm.training import run as train_launch
from clusterlm.training.metrics import METRICS

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")




# ---------------------------------------------------------------------------------------------------
# /proc helpers: the process tree of a launcher
# ---------------------------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a process, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[19])


def _descendants(pid: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            parents[int(entry.name)] = st[1]
    found, frontier = [], [pid]
    while frontier:
        frontier = [p for p, pp in parents.items() if pp in frontier]
        found += frontier
    return found


def _alive(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z" and st[2] == start  # a zombie has exited; a new start time is another


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# ---------------------------------------------------------------------------------------------------
# A live 2-rank run (module-wide): the lock tests use it, the kill test ends it
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live_run(tiny, tmp_path_factory):
    """``clusterlm train --nproc 2`` for 100k steps, once both ranks train (metrics.jsonl has a record)."""
    root = tmp_path_factory.mktemp("live")
    out, log = root / "run", root / "launcher.log"
    cmd = [sys.executable, "-m", "clusterlm", "train",
           *tiny.argv(out, "--nproc", "2", "--max-steps", "100000", "--micro-batch-size", "1", "--log-every",
                      "100000")]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while not ((out / METRICS).is_file() and (out / METRICS).read_text().strip()):
            assert proc.poll() is None, f"the run ended before its first step:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no step after 240 s:\n{log.read_text()[-3000:]}"
            seen.update(_descendants(proc.pid))
            time.sleep(0.1)
        ranks = rank_pids(proc.pid)  # forked from the agent's fork server, named clusterlm-r<RANK>
        assert sorted(ranks) == [0, 1], {p: _cmdline(p) for p in _descendants(proc.pid)}
        assert all(_environ(p).get(AGENT_PID_ENV) for p in ranks.values())  # started by this run's agent
        yield SimpleNamespace(proc=proc, out=out, log=log, ranks=ranks, tiny=tiny)
    finally:
        _kill_all([*_descendants(proc.pid), *seen, proc.pid])
        proc.wait(timeout=30)


@pytest.mark.parametrize("extra", [[], ["--resume"], ["--overwrite"], ["--nproc", "2"]],
                         ids=["second-run", "resume", "overwrite", "second-launcher"])
def test_a_live_runs_out_is_refused_naming_its_pid(live_run, capfd, extra):
    metrics = live_run.out / METRICS
    before = len(metrics.read_text().splitlines())
    capfd.readouterr()
    t0 = time.perf_counter()
    rc = run_cli(["train", *live_run.tiny.argv(live_run.out, "--max-steps", "2", *extra)])
    elapsed = time.perf_counter() - t0
    err = capfd.readouterr().err
    assert rc == 2, err
    assert f"pid {live_run.ranks[0]}" in err and str(live_run.out) in err, err
    assert len(nonblank_lines(err)) == 1, err
    assert elapsed < 10, f"refused only after {elapsed:.1f} s"
    assert live_run.proc.poll() is None, "the live run died"
    assert len(metrics.read_text().splitlines()) >= before, "the live run's metrics were rewritten"


def test_killing_the_launcher_takes_every_rank_with_it(live_run, capfd):
    procs = {p: _stat(p)[2] for p in _descendants(live_run.proc.pid) if _stat(p) is not None}
    assert set(live_run.ranks.values()) <= set(procs)
    os.kill(live_run.proc.pid, signal.SIGKILL)
    live_run.proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(_alive(p, s) for p, s in procs.items()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {p: _cmdline(p) for p, s in procs.items() if _alive(p, s)}
    _kill_all(list(left))
    assert not left, f"processes outlived their launcher by 10 s: {left}"

    # The dead run's lock file is still there; it does not block the next run in that directory.
    capfd.readouterr()
    assert run_cli(["train", *live_run.tiny.argv(live_run.out, "--overwrite", "--max-steps", "1")]) == 0, \
        capfd.readouterr().err


# ---------------------------------------------------------------------------------------------------
# One failing rank
# ---------------------------------------------------------------------------------------------------

FAULTY_RANK = """
import os, sys
from clusterlm.cli import commands as cli
from clusterlm.training import loop as train_loop
if os.environ.get("RANK") == "1":
    def prepare(*args, **kwargs):
        raise {exc}("{message}")
    train_loop.prepare = prepare
sys.exit(cli.main(["train", *sys.argv[1:]]))
"""


@pytest.mark.parametrize(("exc", "code"), [("ValueError", 2), ("RuntimeError", 1)], ids=["user-error", "crash"])
def test_one_failing_rank_ends_the_run_with_its_own_line(tiny, tmp_path, capfd, exc, code):
    message = f"simulated {exc} on rank 1 only"
    (tmp_path / "faulty_rank.py").write_text(FAULTY_RANK.format(exc=exc, message=message))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)}
    capfd.readouterr()
    t0 = time.perf_counter()
    rc = spawn("faulty_rank", tiny.argv(tmp_path / "out", "--max-steps", "2"), 2, env=env)
    elapsed = time.perf_counter() - t0
    err = capfd.readouterr().err
    assert rc == code, err
    lines = nonblank_lines(err)
    assert len(lines) == 1 and message in lines[0] and "rank 1" in lines[0], err
    assert "Traceback" not in err and "ChildFailedError" not in err
    assert elapsed < 120, f"the other rank hung: {elapsed:.0f} s"


def _failure(exitcode: int, timestamp: int, report: dict | None = None) -> SimpleNamespace:
    """What torch's launcher knows of a failed rank (its ProcessFailure)."""
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp, pid=100 + timestamp,
                           signal_name=lambda: signal.Signals(-exitcode).name,
                           error_file="", error_file_data={"clusterlm": report} if report else {})


def test_the_first_reported_failure_is_the_one_reported():
    # rank 0 noticed the lost peer (gloo) after rank 1 failed; rank 2 was stopped by the launcher
    failures = {0: _failure(1, 5, {"line": "rank 0: connection closed by peer", "exit_code": 1, "time_ns": 5_000_002}),
                1: _failure(2, 5, {"line": "rank 1: bad data", "exit_code": 2, "time_ns": 5_000_001}),
                2: _failure(-15, 4)}
    # the first report, then that the others were stopped after it
    assert first_failure(failures) == ("rank 1: bad data; the other 2 failed rank(s) were stopped after it", 2)
    line, code = first_failure({0: _failure(-9, 7), 1: _failure(-15, 8)})  # nobody said why: the earliest
    assert code == 1 and line.startswith("clusterlm: rank 0 (pid 107) was killed by signal 9")


# ---------------------------------------------------------------------------------------------------
# Refused before anything starts
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "value"),
    [("train", "0"), ("train", "-1"), ("select", "0"), ("select", "-2")],
    ids=["train-0", "train-neg", "select-0", "select-neg"],
)
def test_non_positive_process_counts_are_refused_at_once(tiny, tmp_path, capfd, monkeypatch, command, value):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(train_model, "load_model", no_model)
    monkeypatch.setattr(pipeline, "load_model", no_model)  # load_model moved to the pipeline (issue 20)
    out = tmp_path / "out"
    if command == "train":
        argv = ["train", *tiny.argv(out, "--nproc", value)]
    else:
        argv = ["select", "--model", "tiny-llama", "--data", str(tiny.data), "--world-size", "2", "--ratio", "0.5",
                "--out", str(out), "--no-progress", "--nproc", value]
    t0 = time.perf_counter()
    assert run_cli(argv) == 2
    assert time.perf_counter() - t0 < 5
    err = capfd.readouterr().err
    assert "--nproc" in err and value in err, err
    assert not out.exists()


def _read_only_dir(tmp_path: Path, request) -> Path:
    d = tmp_path / "read-only"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        request.addfinalizer(lambda: d.chmod(0o755))
    elif shutil.which("chattr") and subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode == 0:
        request.addfinalizer(lambda: subprocess.run(["chattr", "-i", str(d)], check=False))
    else:
        pytest.skip("root without chattr: no directory is read-only")
    return d / "out"


def _case(tiny, tmp_path, request, name):
    """(argv, what the refusal must say) of one bad trainer command line."""
    out = tmp_path / "out"
    if name == "out-is-a-file":
        out.write_text("notes\n")
        return tiny.argv(out), "not a directory"
    if name == "out-under-a-file":
        (tmp_path / "file").write_text("notes\n")
        return tiny.argv(tmp_path / "file" / "out"), "not a directory"
    if name == "out-not-writable":
        return tiny.argv(_read_only_dir(tmp_path, request)), "not writable"
    flags = {
        "data-missing": (["--data", str(tmp_path / "nope.jsonl")], "--data"),
        "eval-data-missing": (["--eval-data", str(tmp_path / "nope.jsonl")], "--eval-data"),
        "plan-missing": (["--plan", str(tmp_path / "no-plan")], "--plan"),
        "resume-file-missing": (["--resume", str(tmp_path / "step_9.pt")], "step_9.pt"),
        "lr-zero": (["--lr", "0"], "--lr"),
        "lr-nan": (["--lr", "nan"], "--lr"),
        "warmup-ratio": (["--warmup-ratio", "1.5"], "--warmup-ratio"),
        "min-lr-ratio": (["--min-lr-ratio", "-0.1"], "--min-lr-ratio"),
        "beta2-one": (["--beta2", "1.0"], "--beta2"),
        "weight-decay": (["--weight-decay", "-1"], "--weight-decay"),
        "max-grad-norm": (["--max-grad-norm", "-1"], "--max-grad-norm"),
        "lora-dropout": (["--lora-r", "4", "--lora-dropout", "1.0"], "--lora-dropout"),
        "lora-alpha": (["--lora-r", "4", "--lora-alpha", "0"], "--lora-alpha"),
        "lora-targets": (["--lora-r", "4", "--lora-targets", " , "], "--lora-targets"),
    }
    extra, says = flags[name]
    argv = tiny.argv(out)
    for i in range(0, len(extra), 2):  # replace an option already there (--data, --plan), else add it
        if extra[i] in argv:
            argv[argv.index(extra[i]) + 1] = extra[i + 1]
        else:
            argv += extra[i: i + 2]
    return argv, says


BAD_TRAIN_ARGS = ["out-is-a-file", "out-under-a-file", "out-not-writable", "data-missing", "eval-data-missing",
                  "plan-missing", "resume-file-missing", "lr-zero", "lr-nan", "warmup-ratio", "min-lr-ratio",
                  "beta2-one", "weight-decay", "max-grad-norm", "lora-dropout", "lora-alpha", "lora-targets"]


# Every case in this process; a few through the launcher (--nproc 2), which must refuse before spawning.
CASES = [(name, 1) for name in BAD_TRAIN_ARGS] + [
    (name, 2) for name in ("out-is-a-file", "out-not-writable", "data-missing", "plan-missing", "lr-nan")]


@pytest.mark.parametrize(("name", "nproc"), CASES, ids=[f"{n}-nproc{k}" for n, k in CASES])
def test_bad_trainer_arguments_are_refused_before_any_model_loads(tiny, tmp_path, capfd, monkeypatch, request,
                                                                  name, nproc):
    argv, says = _case(tiny, tmp_path, request, name)

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    def no_processes(*args, **kwargs):
        raise AssertionError("processes were started")

    monkeypatch.setattr(train_model, "load_model", no_model)
    monkeypatch.setattr(train_launch, "spawn_with_config", no_processes)
    monkeypatch.setattr(launch, "spawn", no_processes)
    if nproc == 2:
        argv += ["--nproc", "2"]
    capfd.readouterr()
    t0 = time.perf_counter()
    rc = run_cli(["train", *argv])
    elapsed = time.perf_counter() - t0
    err = capfd.readouterr().err
    assert rc == 2, err
    assert len(nonblank_lines(err)) == 1 and err.startswith("clusterlm train: error:") and says in err, err
    assert elapsed < 3
