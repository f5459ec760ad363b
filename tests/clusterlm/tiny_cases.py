"""Small helpers shared by several clusterlm test modules: the tokenised examples of the baseline tests and
``clusterlm compare`` run on a parsed config. (The tiny Llama of the baseline tests is the ``tiny_model`` fixture
of conftest.py.)"""

from __future__ import annotations

import dataclasses

import numpy as np

import clusterlm.cli as cli
from clusterlm import compare_config
from clusterlm.compare_config import CompareConfig

IGNORE = -100


def baseline_examples(n: int = 48, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``n`` examples of 8..39 tokens (vocabulary 97), the first third of each a prompt (labels -100)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = int(rng.integers(8, 40))
        ids = rng.integers(1, 97, size=t).astype(np.int64)
        labels = ids.copy()
        labels[: t // 3] = IGNORE
        out.append({"input_ids": ids, "labels": labels})
    return out


def run_compare(config: CompareConfig) -> int:
    """``clusterlm compare`` (:func:`clusterlm.cli.cmd_compare`) on the parsed values of ``config``: its exit status.
    Checks first that those values parse back to ``config``."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(CompareConfig) if f.name != "train"}
    values |= {f.name: getattr(config.train, f.name) for f in dataclasses.fields(config.train)
               if f.name not in compare_config.TRAIN_PER_UNIT}
    assert cli.compare_config(values) == config
    return cli.cmd_compare(values, False)
