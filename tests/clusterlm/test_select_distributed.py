"""`clusterlm select --nproc 2` (sharded features + distributed K-means) writes the single-process plan."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from clusterlm.cli.commands import main
from clusterlm.plan import Plan


@pytest.mark.slow
def test_two_selection_processes_write_the_single_process_plan(demo, tmp_path):
    data = tmp_path / "small.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for rec in demo.records("train")[:90]:
            f.write(json.dumps(rec) + "\n")
    common = ["--model", "tiny-llama", "--data", str(data), "--world-size", "2", "--ratio", "0.3",
              "--max-length", "1024", "--no-progress", "--dim", "8x8"]
    assert main(["select", *common, "--out", str(tmp_path / "one")]) == 0
    assert os.environ.get("CLUSTERLM_HOME")  # the ranks inherit the fixture's demo home
    assert main(["select", *common, "--out", str(tmp_path / "two"), "--nproc", "2",
                 "--feature-store", str(tmp_path / "store")]) == 0
    one, two = Plan.load(tmp_path / "one"), Plan.load(tmp_path / "two")
    assert two.config["selection_processes"] == 2
    np.testing.assert_array_equal(one.cluster_labels, two.cluster_labels)
    for a, b in zip(one.rank_indices, two.rank_indices, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(one.weights, two.weights, rtol=0, atol=0)
    np.testing.assert_allclose(one.distances, two.distances, rtol=1e-5)
    assert one.fingerprint == two.fingerprint
    assert (tmp_path / "two" / "report.png").exists()
