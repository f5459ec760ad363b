"""Small helpers shared by several clusterlm test modules: the tokenised examples of the baseline tests and
``clusterlm compare`` run on a parsed config. (The tiny Llama of the baseline tests is the ``tiny_model`` fixture
of conftest.py.)"""

from __future__ import annotations

import dataclasses

import numpy as np

import clusterlm.cli.commands as cli
from clusterlm.config import comparison as compare_config
from clusterlm.config.comparison import CompareConfig

IGNORE = -100


def random_examples(n: int, seed: int = 0, *, lengths: tuple[int, int] = (8, 40), ids: tuple[int, int] = (1, 97),
                    prompt_div: int = 3) -> list[dict[str, np.ndarray]]:
    """``n`` tokenised examples of random lengths in ``[lengths)`` and token ids in ``[ids)``; the first
    ``1 / prompt_div`` of each is the prompt (labels -100)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = int(rng.integers(*lengths))
        tokens = rng.integers(*ids, size=t).astype(np.int64)
        labels = tokens.copy()
        labels[: t // prompt_div] = IGNORE
        out.append({"input_ids": tokens, "labels": labels})
    return out


def baseline_examples(n: int = 48, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``n`` examples of 8..39 tokens (vocabulary 97), the first third of each a prompt (labels -100)."""
    return random_examples(n, seed)


def run_compare(config: CompareConfig) -> int:
    """``clusterlm compare`` (:func:`clusterlm.cli.commands.cmd_compare`) on the parsed values of ``config``: its exit
    status.
    Checks first that those values parse back to ``config``."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(CompareConfig) if f.name != "train"}
    values |= {f.name: getattr(config.train, f.name) for f in dataclasses.fields(config.train)
               if f.name not in compare_config.TRAIN_PER_UNIT and f.metadata.get("cli", True)}
    values |= {f.name: getattr(config.train.tasks, f.name) for f in dataclasses.fields(config.train.tasks)}
    assert cli.compare_config(values) == config
    return cli.cmd_compare(values, False)
