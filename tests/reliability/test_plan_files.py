"""A damaged or misnamed plan as ``clusterlm train`` and ``Plan.load`` meet it (issue 25, items 4, 5, "also seen").

* ``"world_size": 0`` (or any hand-edited world size) in plan.json: the invalid field or the checksum mismatch is
  reported first, never the advice to start that many processes.
* ``--plan out/plan.npz`` (a file of the plan instead of its directory): the message says to pass ``out/``.
* An extra array inside plan.npz whose checksums match: one warning naming it (it is ignored).
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import nonblank_lines, run_cli

from clusterlm.plan import Plan
from clusterlm.selection.allocation import selection_weights

N = 16


def _plan(world_size: int = 2, per_rank: int = 4) -> Plan:
    labels = np.arange(N) % 2
    picked = np.arange(world_size * per_rank, dtype=np.int64)
    return Plan(world_size=world_size, rank_indices=list(picked.reshape(world_size, per_rank)),
                weights=selection_weights(labels, picked, 2), cluster_labels=labels, distances=np.zeros(N),
                cluster_sizes=np.bincount(labels), lengths=np.full(N, 5), fingerprint={"size": N, "sha256": "0" * 64},
                model_id="tiny-llama@0123456789ab")


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return _plan().save(tmp_path / "out")


def _edit(plan_dir: Path, **fields) -> None:
    meta = json.loads((plan_dir / "plan.json").read_text())
    meta.update(fields)
    (plan_dir / "plan.json").write_text(json.dumps(meta, indent=2))


def _train(tiny, plan: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--plan", str(plan), "--model", "tiny-llama", "--data", str(tiny.data), "--out", str(out),
            "--no-progress", "--no-save-model", *extra]


def _one_error_line(rc: int, err: str) -> str:
    lines = nonblank_lines(err)
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err)
    assert lines[0].startswith("clusterlm train: error: "), lines[0]
    return lines[0]


NPROC = {"one-process": [], "nproc-2": ["--nproc", "2"]}


@pytest.mark.parametrize("extra", list(NPROC.values()), ids=list(NPROC))
def test_train_on_a_plan_with_world_size_0_names_the_field_not_a_process_count(tiny, saved, tmp_path, capsys, extra):
    _edit(saved, world_size=0)
    line = _one_error_line(run_cli(_train(tiny, saved, tmp_path / "run", *extra)), capsys.readouterr().err)
    assert "processes" not in line and "--nproc 0" not in line, line
    assert str(saved / "plan.json") in line and "'world_size'" in line and "got 0" in line, line


@pytest.mark.parametrize("extra", list(NPROC.values()), ids=list(NPROC))
def test_train_on_a_hand_edited_world_size_reports_the_checksum_first(tiny, saved, tmp_path, capsys, extra):
    _edit(saved, world_size=3)  # valid, but not what was saved: the integrity failure is the real cause
    line = _one_error_line(run_cli(_train(tiny, saved, tmp_path / "run", *extra)), capsys.readouterr().err)
    assert "processes in all" not in line, line
    assert str(saved / "plan.json") in line and "'world_size' was changed after the plan was saved" in line, line
    assert "clusterlm select" in line  # the fix


@pytest.mark.parametrize("name", ["plan.npz", "plan.json"])
def test_train_with_a_plan_file_instead_of_its_directory_says_to_pass_the_directory(tiny, saved, tmp_path, capsys,
                                                                                  name):
    line = _one_error_line(run_cli(_train(tiny, saved / name, tmp_path / "run")), capsys.readouterr().err)
    assert f"pass the directory {saved}/ that holds plan.json and plan.npz" in line, line
    assert f"--out {saved / name}" not in line, line  # not: "make one with clusterlm select --out out/plan.npz"


def test_plan_load_of_plan_npz_says_to_pass_the_directory(saved):
    with pytest.raises(FileNotFoundError, match=rf"pass the directory {saved}/ that holds plan\.json and plan\.npz"):
        Plan.load(saved / "plan.npz")


def test_an_extra_array_in_plan_npz_is_named_in_one_warning(saved):
    with np.load(saved / "plan.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    buf = io.BytesIO()
    np.savez(buf, **arrays, notes=np.arange(3))
    (saved / "plan.npz").write_bytes(buf.getvalue())
    meta = json.loads((saved / "plan.json").read_text())
    meta["arrays"]["sha256"] = hashlib.sha256(buf.getvalue()).hexdigest()  # the per-array checksums still match
    (saved / "plan.json").write_text(json.dumps(meta, indent=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = Plan.load(saved)
    extra = [w for w in caught if "'notes'" in str(w.message)]
    assert len(extra) == 1 and len(caught) == 1, [str(w.message) for w in caught]
    assert str(saved / "plan.npz") in str(extra[0].message) and "ignored" in str(extra[0].message)
    np.testing.assert_array_equal(plan.weights, _plan().weights)
