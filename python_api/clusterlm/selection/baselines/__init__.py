"""Baseline selections, as plans any trainer consumes (docs/design.md section 6).

Every baseline takes an example budget (``ratio`` / ``budget``) or a token budget (``token_ratio`` /
``token_budget``, prompt + answer tokens, met within one example per rank as the cluster method's;
:mod:`clusterlm.selection.baselines._plans`).

Each baseline lives in its own module and returns a :class:`clusterlm.plan.Plan`, so a comparison runs
every method through the same trainer and differs only in the data:

- :mod:`clusterlm.selection.baselines.random`: :func:`full_plan` (all data) and :func:`random_plan` (uniform
  sample at the same budget).
- :mod:`clusterlm.selection.baselines.longest`: :func:`longest_plan` (the examples with the most answer tokens at the
  same example budget: the length baseline).

- :mod:`clusterlm.selection.baselines.s2l`: :func:`s2l_plan` (loss trajectories of a small proxy, K-means, even
  sampling of clusters smallest first; Yang et al., NeurIPS 2024).
- :mod:`clusterlm.selection.baselines.ifd`: :func:`ifd_plan` (instruction-following difficulty; Li et al., NAACL 2024).
- :mod:`clusterlm.selection.baselines.less`: :func:`less_plan` (Adam-preconditioned LoRA gradients, cosine similarity
  to validation gradients; Xia et al., ICML 2024).

S2L and LESS take their settings as one frozen dataclass (:class:`S2LConfig`, :class:`LessConfig`), or as
keyword overrides of its fields (``less_plan(model, data, 2, ratio=0.3, validation=v, lr=1e-3)``).

:func:`baseline_plan` turns specs into plans: the trainer's ``--plan`` specs (``full``, ``random:0.31``,
``random:5000``, and token budgets ``random:tokens=0.31`` / ``random:tokens=2000000``; :func:`is_baseline_spec`),
and ``s2l:<ratio|count>``, ``ifd:...``, ``less:...`` (also ``...:tokens=<ratio|count>``), which need
the model (and LESS a validation set) and are therefore built before training (``clusterlm compare`` does,
and saves them as plan directories), not inside the trainer's ranks.
"""

from __future__ import annotations

from typing import Any

from clusterlm.config.baselines import BASELINE_SPECS, is_baseline_spec
from clusterlm.plan import Plan
from clusterlm.selection.baselines.ifd import ifd_plan
from clusterlm.selection.baselines.less import LessConfig, less_plan
from clusterlm.selection.baselines.longest import longest_plan
from clusterlm.selection.baselines.random import full_plan, random_plan
from clusterlm.selection.baselines.s2l import S2LConfig, s2l_plan

__all__ = [
    "BASELINE_SPECS", "MODEL_BASELINES", "LessConfig", "S2LConfig", "baseline_plan", "full_plan", "ifd_plan",
    "is_baseline_spec", "less_plan", "longest_plan", "random_plan", "s2l_plan",
]

# Baselines that need the model: spec "<name>:<ratio>" or "<name>:<count>", built with baseline_plan(..., model=).
MODEL_BASELINES = {"s2l": s2l_plan, "ifd": ifd_plan, "less": less_plan}


def _ratio_or_count(spec: str, value: str) -> dict[str, Any]:
    """The budget keyword of a spec's value: ``0.31`` -> ratio, ``5000`` -> budget, ``tokens=0.31`` ->
    token_ratio, ``tokens=2000000`` -> token_budget.

    Raises:
        ValueError: a value of none of these forms (the message shows them).
    """
    tokens = value.startswith("tokens=")
    number = value[len("tokens="):] if tokens else value
    try:
        if any(c in number for c in ".eE"):
            return {"token_ratio" if tokens else "ratio": float(number)}
        return {"token_budget" if tokens else "budget": int(number)}
    except ValueError:
        name = spec.split(":", 1)[0]
        raise ValueError(
            f"baseline_plan: spec {spec!r} must be {name}:<ratio> (e.g. {name}:0.31), {name}:<count> "
            f"(e.g. {name}:5000) or a token budget {name}:tokens=<ratio|count> (e.g. {name}:tokens=0.31), got the "
            f"value {value!r}."
        ) from None


def baseline_plan(
    spec: str,
    dataset: Any,
    world_size: int,
    *,
    seed: int = 0,
    token_balance: bool = True,
    model: Any = None,
    **options: Any,
) -> Plan:
    """Build the baseline plan named by ``spec``.

    Args:
        spec: ``"full"``; ``"random:<ratio>"`` with a decimal point (``random:0.31``, ``random:1.0``) for a
            fraction of the data; ``"random:<count>"`` with an integer (``random:5000``) for a number of
            examples; ``"random:tokens=<ratio|count>"`` (``random:tokens=0.31``, ``random:tokens=2000000``) for a
            token budget (prompt + answer tokens).
        dataset: the tokenised data set (:class:`clusterlm.data.SFTDataset` or a sequence of example dicts).
        world_size: number of ranks.
            ``"s2l:..."``, ``"ifd:..."``, ``"less:..."`` (same value forms) need ``model``.
        seed: seed of the sample and visit order.
        token_balance: see :mod:`clusterlm.selection.baselines.random`.
        model: the causal LM for S2L / IFD / LESS.
        **options: further keyword arguments of :func:`s2l_plan` / :func:`ifd_plan` / :func:`less_plan`
            (``less`` needs ``validation=``; S2L / LESS also take ``config=`` and their settings by name, ``seed``
            and ``token_balance`` above overriding the config's).

    Returns:
        The :class:`Plan`.

    Raises:
        ValueError: an unknown spec or a malformed ratio/count (plus the baselines' own argument errors).
    """
    if spec == "full":
        return full_plan(dataset, world_size, seed=seed, token_balance=token_balance)
    if spec.startswith("random:"):
        amount = _ratio_or_count(spec, spec.split(":", 1)[1])
        return random_plan(dataset, world_size, **amount, seed=seed, token_balance=token_balance)
    name = spec.split(":", 1)[0]
    if ":" in spec and name in MODEL_BASELINES:
        if model is None:
            raise ValueError(
                f"baseline_plan: {name} selects with the model; pass model= (e.g. from clusterlm.models.load_model), "
                f"or build the plan with clusterlm.selection.baselines.{name}_plan and pass its directory to the "
                "trainer."
            )
        amount = _ratio_or_count(spec, spec.split(":", 1)[1])
        return MODEL_BASELINES[name](model, dataset, world_size, **amount, seed=seed, token_balance=token_balance,
                                     **options)
    raise ValueError(
        f"baseline_plan: unknown baseline {spec!r}; expected one of {', '.join(BASELINE_SPECS)}, "
        f"{', '.join(f'{m}:<ratio|count>' for m in MODEL_BASELINES)} (with model=; also <name>:tokens=<ratio|count>), "
        "or a plan directory."
    )
