"""clusterlm.fileio: the one lock (FileLock, DirLock), locked temporary files of atomic writes, versioned JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from clusterlm import fileio as _io
from clusterlm.fileio import (
    DirLock,
    FileLock,
    LockedError,
    atomic_write,
    atomic_write_bytes,
    holder_record,
    lock_holder,
    read_versioned_json,
    remove_stale,
    remove_temporaries,
)

posix = pytest.mark.skipif(_io.fcntl is None, reason="POSIX flock")

# ---- FileLock ----------------------------------------------------------------------------------------------


@posix
def test_a_file_lock_is_exclusive_and_names_its_holder(tmp_path):
    a, b = FileLock(tmp_path / "x.claim"), FileLock(tmp_path / "x.claim")
    assert a.acquire() and a.held
    assert not b.acquire() and not b.held  # another open file: refused without waiting
    record = holder_record(tmp_path / "x.claim")
    assert record["pid"] == os.getpid() and record["host"] and record["since"] <= time.time()
    a.release()
    assert holder_record(tmp_path / "x.claim") is None  # the file stays, nobody holds it
    assert b.acquire()
    b.release()


@posix
def test_a_blocking_acquire_waits_and_a_removed_file_is_locked_anew(tmp_path):
    path = tmp_path / "shard_00001.claim"
    first = FileLock(path, remove=True)
    assert first.acquire()
    got: list[bool] = []
    waiter = FileLock(path, remove=True)
    t = threading.Thread(target=lambda: got.append(waiter.acquire(blocking=True)))
    t.start()
    time.sleep(0.2)
    assert not got  # still waiting
    first.release()  # removes the file, then unlocks: the waiter must not keep the lock of the removed file
    t.join(timeout=10)
    assert got == [True] and path.is_file()
    assert not FileLock(path).acquire()  # the file now at the path is the one the waiter holds
    waiter.release()
    assert not path.exists()


@posix
def test_a_directory_lock_serialises_and_creates_nothing(tmp_path):
    order: list[str] = []

    def second() -> None:
        with FileLock(tmp_path, directory=True):
            order.append("b")

    with FileLock(tmp_path, directory=True):
        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.2)
        order.append("a")
    t.join(timeout=10)
    assert order == ["a", "b"] and list(tmp_path.iterdir()) == []


@posix
def test_the_lock_of_a_killed_process_is_free(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, time, types
        pkg = types.ModuleType("clusterlm"); pkg.__path__ = [{str(Path(_io.__file__).parent)!r}]
        sys.modules["clusterlm"] = pkg
        from clusterlm.fileio import DirLock
        DirLock(sys.argv[1]).acquire()
        print("locked", flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        assert lock_holder(tmp_path) == f"pid {proc.pid}"
        with pytest.raises(LockedError, match=rf"in use by another run \(pid {proc.pid}\)"):
            DirLock(tmp_path).acquire()
    finally:
        proc.kill()
        proc.wait()
    assert lock_holder(tmp_path) is None
    with DirLock(tmp_path) as lock:
        assert lock.held


def test_an_older_holder_record_is_still_read(tmp_path):
    assert _io._describe(_io._record(b"1234 elsewhere\n")) == "pid 1234 on host elsewhere"
    assert _io._describe(_io._record(b"")) == "pid unknown"


# ---- atomic writes and clean-ups --------------------------------------------------------------------------


@posix
def test_a_live_writers_temporary_file_is_spared_by_clean_ups(tmp_path):
    seen: list[list[str]] = []

    def write(f):
        f.write(b"data")
        assert remove_temporaries(tmp_path) == []  # another process's clean-up, mid-write
        seen.append(sorted(p.name for p in tmp_path.iterdir()))

    atomic_write(tmp_path / "plan.npz", write)
    assert len(seen[0]) == 1 and seen[0][0].startswith(".plan.npz.") and seen[0][0].endswith(".tmp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.npz"]
    (tmp_path / ".plan.npz.dead.tmp").write_bytes(b"left by a killed writer")
    assert remove_temporaries(tmp_path) == [tmp_path / ".plan.npz.dead.tmp"]


@posix
def test_remove_stale_takes_only_unheld_files(tmp_path):
    held, stale = tmp_path / "a.claim", tmp_path / "b.claim"
    lock = FileLock(held)
    assert lock.acquire()
    stale.write_text("{}")
    assert not remove_stale(held) and held.exists()
    assert remove_stale(stale) and not stale.exists()
    assert not remove_stale(tmp_path / "missing.claim")
    lock.release()


def test_atomic_write_bytes_replaces_the_file(tmp_path):
    target = tmp_path / "x.json"
    atomic_write_bytes(target, b"one")
    atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two" and [p.name for p in tmp_path.iterdir()] == ["x.json"]


# ---- versioned JSON ---------------------------------------------------------------------------------------


def _read(path: Path, **kw):
    return read_versioned_json(path, "clusterlm.thing", (1, 2), who="Thing.load", what="clusterlm thing file",
                               fix="Make it again.", **kw)


def test_read_versioned_json_returns_the_object_and_its_version(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"format": "clusterlm.thing", "version": 2, "x": 1}))
    assert _read(p) == ({"format": "clusterlm.thing", "version": 2, "x": 1}, 2)
    p.write_text(json.dumps({"format": "clusterlm.thing/1", "x": 1}))  # version spelled in the format (version 1)
    assert _read(p)[1] == 1


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", r"t\.json is not valid JSON .*it is truncated or not a clusterlm thing file\. Make it again\."),
        ('{"format": "clusterlm.th', r"not valid JSON"),
        ("[1, 2]", r"t\.json is not a clusterlm thing file \(it holds a JSON list"),
        ('{"format": "other", "version": 1}', r"its format is 'other', 'clusterlm.thing' expected\)\. Make it again"),
        ('{"version": 1}', r"its format is None"),
        ('{"format": "clusterlm.thing/x"}', r"its format is 'clusterlm.thing/x'"),
        ('{"format": "clusterlm.thing", "version": 9}', r"format version 9; this clusterlm reads version 1 or 2: use"),
        ('{"format": "clusterlm.thing", "version": true}', r"format version True"),
        ('{"format": "clusterlm.thing/3"}', r"format version 3;"),
    ],
    ids=["empty", "truncated", "list", "foreign", "no-format", "bad-suffix", "version", "bool-version", "old-form"],
)
def test_read_versioned_json_refuses_in_one_line_naming_the_file(tmp_path, text, match):
    p = tmp_path / "t.json"
    p.write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        _read(p)
    assert str(err.value).startswith(f"Thing.load: {p}") and "\n" not in str(err.value)


def test_read_versioned_json_leaves_a_missing_file_to_the_caller(tmp_path):
    with pytest.raises(FileNotFoundError):
        _read(tmp_path / "none.json")
