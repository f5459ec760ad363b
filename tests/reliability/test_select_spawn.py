"""`clusterlm select --nproc N` starts its ranks without Python's runpy warning (issue 25, item 7).

The ranks used to run ``python -m clusterlm.select``: the package ``clusterlm`` imports ``clusterlm.select``
first, so runpy printed ``RuntimeWarning: 'clusterlm.select' found in sys.modules ...`` on every run. They now
run the package entry ``python -m clusterlm select``. The test captures the command the pipeline starts and runs
that very module (with ``--help``, so no model loads) in a fresh interpreter, warnings as errors.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from clusterlm.config.files import checksum
from clusterlm.config.selection import SelectConfig
from clusterlm.launch import launcher as launch
from clusterlm.selection import pipeline


def test_the_ranks_start_without_a_runpy_warning(tmp_path, monkeypatch):
    started = {}

    def fake_spawn(module, argv, nproc, **kwargs):
        started.update(module=module, argv=list(argv), nproc=nproc, env=dict(kwargs.get("env") or {}))
        return 0

    monkeypatch.setattr(launch, "spawn", fake_spawn)  # what pipeline's spawn_with_config runs
    monkeypatch.setattr(pipeline.Plan, "load", staticmethod(lambda out: "plan"))
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"p{i}", "response": f"r{i}"}) for i in range(8)))
    job = pipeline.SelectJob(model="tiny-llama", data=str(data), out=Path(tmp_path / "out"), nproc=2,
                             config=SelectConfig(world_size=2, ratio=0.5))
    assert pipeline.run_select(job) == "plan"
    assert started["nproc"] == 2 and "--nproc" not in started["argv"]
    # the ranks read the job from the file the launcher wrote (checked by its sha256), not a rebuilt command line
    config_file = tmp_path / "out" / pipeline.SELECT_CONFIG
    assert started["argv"] == ["select", "--config", str(config_file)]
    assert started["env"][launch.CONFIG_SHA_ENV] == checksum(config_file.read_text(encoding="utf-8"))
    ranks_job = pipeline.SelectJob.load(config_file)
    assert ranks_job.config == job.config and ranks_job.nproc == 2 and ranks_job.data == str(data)
    cmd = [sys.executable, "-W", "error::RuntimeWarning", "-m", started["module"], started["argv"][0], "--help"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "RuntimeWarning" not in done.stderr and "found in sys.modules" not in done.stderr
    assert "--world-size" in done.stdout  # it is the select command's own help

