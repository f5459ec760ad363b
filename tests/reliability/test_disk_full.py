"""A full disk (issue 15, class 5), as an unlucky user meets it: ENOSPC, EDQUOT, EFBIG, EIO.

Every write path of a training run is hit: the one atomic-write helper itself, a checkpoint, a metrics record,
summary.json, args.json, training.png and the baseline plan a run saves. Each must end in one line that says
what ran out and where (the target file, not its temporary sibling), leave no ``.tmp`` file behind, and leave
the previous checkpoint loadable so that ``--resume`` continues once there is space again. A real kernel-level
failure comes from ``RLIMIT_FSIZE`` (writes past the limit fail with EFBIG), in this process and in a 2-rank
run where rank 0 hits it at its first checkpoint: both ranks stop, with one line and no gloo traceback.

The "full disk" is simulated without root: files opened for writing under a directory (``os.fdopen``,
``open``) get a ``write`` that fails with the chosen errno once the disk's capacity is used up.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import nonblank_lines, run_cli

from clusterlm import fileio as _io
from clusterlm.config.training import LATEST
from clusterlm.engine.step import CKPT_DIR
from clusterlm.training.metrics import METRICS, SUMMARY

WHAT = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
        errno.EFBIG: "file size limit", errno.EIO: "I/O error"}




def _temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


# ---------------------------------------------------------------------------------------------------
# A full file system, simulated
# ---------------------------------------------------------------------------------------------------


class FullDisk:
    """Writes to files under ``root`` whose path contains ``match`` fail with ``code`` after ``room`` bytes.

    The first ``skip`` such files are written in full (e.g. a log's first records). ``stage="fsync"`` fails
    the fsync instead, ``"mkstemp"`` / ``"replace"`` the creation / the rename of a temporary file.
    """

    def __init__(self, monkeypatch, root: Path, *, match: str = "", code: int = errno.ENOSPC, room: int = 0,
                 skip: int = 0, stage: str = "write") -> None:
        self.root, self.match, self.code, self.room, self.skip = str(root), match, code, room, skip
        self.failures = 0
        real_fdopen, real_open, real_fsync = os.fdopen, builtins.open, os.fsync
        real_mkstemp, real_replace = _io.tempfile.mkstemp, os.replace

        def fdopen(fd, mode="r", *args, **kwargs):
            return self.wrap(real_fdopen(fd, mode, *args, **kwargs), os.readlink(f"/proc/self/fd/{fd}"), mode)

        def open_(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            return self.wrap(f, os.path.abspath(file), mode) if isinstance(file, (str, os.PathLike)) else f

        def fsync(fd):
            if stage == "fsync" and self.hit(os.readlink(f"/proc/self/fd/{fd}")):
                self.fail()
            return real_fsync(fd)

        def mkstemp(*args, dir=None, prefix=None, **kwargs):  # noqa: A002 - tempfile's name
            if stage == "mkstemp" and self.hit(os.path.join(str(dir), prefix or "")):
                self.fail()
            return real_mkstemp(*args, dir=dir, prefix=prefix, **kwargs)

        def replace(src, dst, *args, **kwargs):
            if stage == "replace" and self.hit(os.fspath(dst)):
                self.fail()
            return real_replace(src, dst, *args, **kwargs)

        if stage == "write":
            monkeypatch.setattr(os, "fdopen", fdopen)
            monkeypatch.setattr(builtins, "open", open_)
            monkeypatch.setattr(io, "open", open_)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(_io.tempfile, "mkstemp", mkstemp)
        monkeypatch.setattr(os, "replace", replace)

    def hit(self, path: str) -> bool:
        return path.startswith(self.root) and self.match in os.path.basename(path)

    def fail(self) -> None:
        self.failures += 1
        raise OSError(self.code, os.strerror(self.code))

    def wrap(self, f, path: str, mode: str):
        if not any(c in mode for c in "wax+") or not self.hit(path):
            return f
        if self.skip > 0:
            self.skip -= 1
            return f
        return _Filling(f, self)


class _Filling:
    """A file on a full disk: ``write`` stores what still fits, then fails."""

    def __init__(self, f, disk: FullDisk) -> None:
        self._f, self._disk = f, disk

    def write(self, data):
        size = len(data) if isinstance(data, str) else memoryview(data).nbytes
        if size <= self._disk.room:
            self._disk.room -= size
            return self._f.write(data)
        if self._disk.room > 0:
            self._f.write(data[: self._disk.room] if isinstance(data, str) else bytes(memoryview(data).cast("B"))[
                : self._disk.room])
            self._f.flush()
            self._disk.room = 0
        self._disk.fail()

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


# ---------------------------------------------------------------------------------------------------
# The atomic-write helper itself
# ---------------------------------------------------------------------------------------------------

DIRECT = [
    ("write", errno.ENOSPC, 100),
    ("write", errno.EDQUOT, 0),
    ("write", errno.EFBIG, 4096),
    ("fsync", errno.EIO, 0),
    ("mkstemp", errno.ENOSPC, 0),
    ("replace", errno.EIO, 0),
]


@pytest.mark.parametrize(("stage", "code", "room"), DIRECT,
                         ids=[f"{s}-{errno.errorcode[c]}" for s, c, _ in DIRECT])
def test_atomic_write_says_what_ran_out_and_where_and_leaves_no_temporary(tmp_path, monkeypatch, stage, code, room):
    target = tmp_path / "plan.npz"
    target.write_bytes(b"the previous version")
    data = os.urandom(200_000)
    FullDisk(monkeypatch, tmp_path, code=code, room=room, stage=stage)
    with pytest.raises(OSError) as err:
        _io.atomic_write_bytes(target, data)
    monkeypatch.undo()
    message = str(err.value)
    assert err.value.errno == code
    assert message.startswith(WHAT[code]) and f"writing {target}" in message, message
    if stage != "mkstemp":
        assert "200,000 bytes" in message, message  # how much it needed
    assert target.read_bytes() == b"the previous version"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.npz"]


def test_a_write_callback_that_fails_otherwise_is_passed_on_and_leaves_no_temporary(tmp_path):
    def write(f):
        f.write(b"half")
        raise ValueError("not a disk problem")

    with pytest.raises(ValueError, match="not a disk problem"):
        _io.atomic_write(tmp_path / "x.bin", write)
    assert list(tmp_path.iterdir()) == []


def _with_file_size_limit(limit: int, fn):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        return fn()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_real_file_size_limit_efbig_is_reported_like_a_full_disk(tmp_path):
    target = tmp_path / "ckpt.pt"
    with pytest.raises(OSError) as err:
        _with_file_size_limit(1 << 20, lambda: _io.atomic_write(target, lambda f: torch.save(torch.zeros(1 << 19), f)))
    assert err.value.errno == errno.EFBIG
    assert str(err.value).startswith(WHAT[errno.EFBIG]) and str(target) in str(err.value), str(err.value)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------
# A training run on a full disk (in this process, world size 1)
# ---------------------------------------------------------------------------------------------------

RUNS = {
    # name: (FullDisk options, the file the message names, extra trainer options)
    "checkpoint-ENOSPC": (dict(match="step_0000002.pt", room=1000), "ckpt/step_0000002.pt", []),
    "checkpoint-fsync-EIO": (dict(match="step_0000002.pt", code=errno.EIO, stage="fsync"), "ckpt/step_0000002.pt",
                             []),
    "metrics-ENOSPC": (dict(match="metrics.jsonl", skip=2, room=10), "metrics.jsonl", []),
    "metrics-EDQUOT": (dict(match="metrics.jsonl", skip=1, code=errno.EDQUOT), "metrics.jsonl", []),
    "summary-ENOSPC": (dict(match="summary.json", room=5), "summary.json", []),
    "args-ENOSPC": (dict(match="args.json"), "args.json", []),
    "curve-ENOSPC": (dict(match="training.png", room=100), "training.png", []),
    "plan-ENOSPC": (dict(match="plan.npz", room=64), "plan/plan.npz", []),
    "model-ENOSPC": (dict(match="config.json", room=0), "model", ["--save-model"]),
}


@pytest.fixture(scope="module")
def warm(tiny):
    """tiny-llama built (in this session's home) before any limit applies."""
    from clusterlm.models import load_model

    load_model("tiny-llama")
    return tiny


@pytest.mark.parametrize("name", list(RUNS))
def test_a_full_disk_during_training_is_one_line_and_resume_continues(warm, tmp_path, monkeypatch, capfd, name):
    options, names, extra = RUNS[name]
    out = tmp_path / "out"
    argv = warm.argv(out, "--max-steps", "3", "--save-every", "1")
    if extra == ["--save-model"]:
        argv.remove("--no-save-model")
    capfd.readouterr()
    with monkeypatch.context() as m:
        disk = FullDisk(m, out, **options)
        rc = run_cli(["train", *argv])
    err = capfd.readouterr().err
    assert disk.failures >= 1, "the simulated disk was never hit"
    code = options.get("code", errno.ENOSPC)
    assert rc == 1, err
    lines = nonblank_lines(err)
    assert len(lines) == 1 and lines[0].startswith("clusterlm train: error: " + WHAT[code]), err
    assert str(out / names) in lines[0], err
    assert "free" in lines[0] or code == errno.EIO, err
    assert not _temporaries(out), _temporaries(out)

    if (out / METRICS).exists():  # no cut-off last line
        records = [json.loads(line) for line in (out / METRICS).read_text().splitlines()]
        assert all(r["kind"] in ("train", "eval") for r in records)
    latest = out / CKPT_DIR / LATEST
    if latest.exists():  # what a checkpoint left is loadable, and a resume (with space again) finishes the run
        ckpt = torch.load(out / CKPT_DIR / latest.read_text().strip(), weights_only=False)
        assert ckpt["step"] >= 1
        assert run_cli(["train", *argv, "--resume"]) == 0, capfd.readouterr().err
        steps = [r["step"] for r in map(json.loads, (out / METRICS).read_text().splitlines())
                 if r["kind"] == "train"]
        assert steps == [1, 2, 3]
        assert (out / SUMMARY).is_file() and not _temporaries(out)


# ---------------------------------------------------------------------------------------------------
# A real limit in a 2-rank run: rank 0 fails at its first checkpoint, rank 1 must not hang
# ---------------------------------------------------------------------------------------------------


def test_a_file_size_limit_at_rank_0s_checkpoint_stops_both_ranks_with_one_line(warm, tmp_path):
    out = tmp_path / "out"
    limit = 4 << 20  # the checkpoint of tiny-llama (weights + AdamW moments) is ~22 MB; everything else fits

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    cmd = [sys.executable, "-m", "clusterlm", "train",
           *warm.argv(out, "--nproc", "2", "--max-steps", "3", "--save-every", "1")]
    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limited, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = nonblank_lines(proc.stderr)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert re.match(r"clusterlm train: error( \(rank 0 of 2\))?: file size limit", lines[0]), lines[0]
    assert str(out / "ckpt" / "step_0000001.pt") in lines[0], lines[0]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert not _temporaries(out) and not (out / CKPT_DIR / LATEST).exists()
