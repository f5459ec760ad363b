"""``accelerate launch -m clusterlm.train`` works like ``torchrun -m clusterlm.train`` (issue 13).

accelerate's multi-process launch runs torch's launcher underneath (it sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), so the trainer joins the same gloo/nccl process group either way; the two runs
on the same plan, data and seed log the same losses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("accelerate", path=str(Path(sys.executable).parent)) is None,
                                reason="accelerate's launcher is not installed")


def _run(cmd: list[str], out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    args = json.loads((out / "args.json").read_text())
    assert args["world_size"] == 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("kind") == "train"]


def test_accelerate_launch_trains_like_torchrun(small_sft, tmp_path):
    bindir = Path(sys.executable).parent
    train = ["--plan", "random:0.5", "--model", "tiny-llama", "--data", str(small_sft.train), "--max-steps", "2",
             "--micro-batch-size", "2", "--no-progress", "--no-save-model", "--no-initial-eval"]
    acc = _run([str(bindir / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "clusterlm.train", *train,
                "--out", str(tmp_path / "acc")], tmp_path / "acc")
    tr = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "clusterlm.train", *train, "--out", str(tmp_path / "tr")], tmp_path / "tr")
    assert [r["loss"] for r in acc] == pytest.approx([r["loss"] for r in tr], rel=1e-6)
    assert [r["step_tokens"] for r in acc] == [r["step_tokens"] for r in tr]  # the same examples on each rank
    assert len(acc) == 2
