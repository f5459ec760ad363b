"""Every setting of a comparison in one object: :class:`CompareConfig` (what ``clusterlm compare`` takes), and the
``--methods`` entries (:class:`MethodSpec`: a method, or a cluster method with selection settings).

``clusterlm compare``'s options are generated from :class:`CompareConfig`'s fields and from the training settings
of its nested :class:`clusterlm.TrainConfig` (``--lr``, ``--micro-batch-size``, ...: every unit trains with them);
a ``--config cmp.yaml`` holds the same names (the training ones flat, or under ``train:``); the resolved config is
written to ``OUT/compare_config.yaml``.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

from clusterlm.config.base import Config
from clusterlm.config.eval_sets import parse_eval_set
from clusterlm.config.files import check_keys, from_dict
from clusterlm.config.readers import positive_int_arg, ratios_arg, seeds_arg
from clusterlm.config.selection import SelectConfig
from clusterlm.config.training import TrainConfig

__all__ = ["BUDGETS", "CLUSTER_METHODS", "COMPARE_CONFIG", "COMPARE_SETS", "METHODS", "N_VALIDATION", "TOKEN_BUDGETS",
           "TRAIN_PER_UNIT", "CompareConfig", "MethodSpec", "budget_of", "check_token_budget", "check_variant",
           "compare_train_defaults", "eval_data_arg", "method_config", "methods_arg", "parse_method", "parse_methods"]

METHODS = ("full", "random", "longest", "cluster", "cluster-tokens", "cluster-whole", "cluster-paper",
           "cluster-paper-exact", "s2l", "ifd", "less")
CLUSTER_METHODS = {  # compare method -> select() arguments besides the budget
    "cluster": {},
    "cluster-tokens": {},
    "cluster-whole": {"feature_tokens": "all"},
    "cluster-paper": {"preset": "paper"},
    "cluster-paper-exact": {"preset": "paper", "clustering": "exact"},
}
# Settings compare itself gives every selection: a method variant may not set them.
COMPARE_SETS = ("world_size", "ratio", "budget", "seed")
# A method's own token budget (any method: random[token_ratio=0.31]); it replaces compare's budget for that method.
TOKEN_BUDGETS = ("token_ratio", "token_budget")
BUDGETS = ("examples", "tokens")  # --budget: every method at ratio x examples, or at ratio x tokens
N_VALIDATION = 32  # LESS's validation examples (the tail of the held-out data) when --n-validation is not given
COMPARE_CONFIG = "compare_config.yaml"  # in OUT: the resolved config
# TrainConfig fields compare sets per unit (plan, data, seed, ...) or holds itself (model, dtype): not its options.
TRAIN_PER_UNIT = tuple(f.name for f in fields(TrainConfig) if f.metadata.get("per_run"))


@dataclass(frozen=True)
class MethodSpec:
    """One ``--methods`` entry: a method name and, for the cluster methods, selection settings.

    Attributes:
        label: the entry as written (``cluster[feature_tokens=32]``): its name in every table.
        base: the method (:data:`METHODS`).
        overrides: :class:`clusterlm.SelectConfig` settings on top of the method's own (cluster methods), or a token
            budget (``token_ratio`` / ``token_budget``, any method but full).
    """

    label: str
    base: str
    overrides: tuple[tuple[str, Any], ...] = ()

    @property
    def token_budget(self) -> dict[str, Any]:
        """The method's own token budget (``{"token_ratio": 0.31}``), {} when it has none."""
        return {k: v for k, v in self.overrides if k in TOKEN_BUDGETS}

    @property
    def slug(self) -> str:
        """The label as a file name (run directories)."""
        return re.sub(r"[^A-Za-z0-9._-]+", "_", self.label).strip("_")


def _split_top(value: str, sep: str = ",") -> list[str]:
    """Split at ``sep`` outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in value:
        depth += (ch == "[") - (ch == "]")
        if ch == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


def _setting_value(text: str) -> Any:
    """``32`` -> 32, ``0.5`` -> 0.5, ``true``/``false`` -> bool, ``none`` -> None, anything else the string."""
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_method(spec: str) -> MethodSpec:
    """``name`` or ``name[key=value,...]`` as a :class:`MethodSpec`; the settings are checked by
    :class:`clusterlm.SelectConfig` (names and values) without any data.

    Raises:
        ValueError: an unknown method, settings on a method that is not a cluster method, a malformed setting,
            a setting compare gives itself (budget, world size, seed), or a value the selection refuses.
        TypeError: an unknown setting name.
    """
    label = spec.strip()
    m = re.fullmatch(r"([A-Za-z0-9_-]+)(?:\[(.*)\])?", label)
    if m is None or m.group(1) not in METHODS:
        raise ValueError(f"compare: unknown method {label!r}; choose from {', '.join(METHODS)}, optionally with "
                         "selection settings: cluster[feature_tokens=32].")
    base, body = m.group(1), m.group(2)
    if body is None:
        return MethodSpec(label, base)
    overrides: dict[str, Any] = {}
    for item in (i.strip() for i in _split_top(body.replace(";", ","))):
        key, eq, text = item.partition("=")
        if not eq or not key.strip() or not text.strip():
            raise ValueError(f"compare: method {label!r}: settings are key=value, got {item!r}; e.g. "
                             "cluster[feature_tokens=32,within_cluster=kcenter].")
        overrides[key.strip()] = _setting_value(text.strip())
    fixed = sorted(set(overrides) & set(COMPARE_SETS))
    if fixed:
        raise ValueError(f"compare: method {label!r} sets {', '.join(fixed)}, which compare sets for every method; "
                         "use --ratio/--ratios, --world-size, --seeds instead (a token budget: token_ratio= or "
                         "token_budget=).")
    if base == "full" or (base not in CLUSTER_METHODS and set(overrides) - set(TOKEN_BUDGETS)):
        what = "no settings (it trains on all data)" if base == "full" else "only a token budget in brackets"
        raise ValueError(f"compare: method {label!r}: {base} takes {what}, e.g. {base}[token_ratio=0.31]; the "
                         f"cluster methods ({', '.join(CLUSTER_METHODS)}) also take selection settings.")
    if len(set(overrides) & set(TOKEN_BUDGETS)) > 1:
        raise ValueError(f"compare: method {label!r}: give token_ratio= or token_budget=, not both.")
    out = MethodSpec(label, base, tuple(sorted(overrides.items())))
    check_variant(out, 1, 0.5)  # names (TypeError) and values, before any data or model
    return out


def check_variant(spec: MethodSpec, world_size: int, ratio: float, budget: str = "examples") -> None:
    """The variant's settings as :class:`SelectConfig` checks them (errors name the method as written)."""
    if spec.base not in CLUSTER_METHODS:
        check_token_budget(spec)
        return
    try:
        method_config(spec, world_size, ratio, 0, budget).check()
    except (TypeError, ValueError) as e:
        raise type(e)(f"compare: method {spec.label!r}: {str(e).removeprefix('select: ')}") from None


def parse_methods(value: str) -> list[str]:
    """A ``--methods`` value (comma list, commas inside brackets belong to a method's settings) as labels.

    Raises:
        ValueError / TypeError: an empty list, a method given twice, or a bad entry (:func:`parse_method`).
    """
    items = _split_top(value)
    if not value.strip():
        raise ValueError(f"compare: --methods needs at least one method, got {value!r}.")
    if not all(v.strip() for v in items):
        raise ValueError(f"compare: --methods {value!r} has an empty item (two commas in a row, or a comma at an end); "
                         "separate the methods with single commas, e.g. random,cluster.")
    labels = [parse_method(v).label for v in items]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise ValueError(f"compare: --methods lists {', '.join(twice)} more than once.")
    return labels


def check_token_budget(spec: MethodSpec) -> None:
    """A non-cluster method's own token budget: a fraction in (0, 1] or a count >= 1.

    Raises:
        ValueError: another value, naming the method as written.
    """
    for key, value in spec.token_budget.items():
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and (0 < value <= 1 if key == "token_ratio" else isinstance(value, int) and value >= 1))
        if not ok:
            want = "a fraction in (0, 1]" if key == "token_ratio" else "an int >= 1"
            raise ValueError(f"compare: method {spec.label!r}: {key} must be {want}, got {value!r}.")


def budget_of(spec: MethodSpec, ratio: float, budget: str = "examples") -> dict[str, Any]:
    """The budget a method selects at compare's ``ratio``: its own token budget when it has one, else ``ratio`` of
    the tokens (``budget="tokens"``, or the cluster-tokens method) or of the examples; {} for full data."""
    if spec.base == "full":
        return {}
    if spec.token_budget:
        return dict(spec.token_budget)
    return {"token_ratio": ratio} if budget == "tokens" or spec.base == "cluster-tokens" else {"ratio": ratio}


def method_config(spec: MethodSpec, world_size: int, ratio: float, seed: int, budget: str = "examples"
                  ) -> SelectConfig:
    """The :class:`SelectConfig` of a cluster method at this budget (:func:`budget_of`) and seed."""
    settings = {k: v for k, v in spec.overrides if k not in TOKEN_BUDGETS}
    return SelectConfig(world_size=world_size, seed=seed, **CLUSTER_METHODS[spec.base],
                        **budget_of(spec, ratio, budget)).replace(**settings)


def methods_arg(value: str) -> tuple[str, ...]:
    """``--methods``: method names or variants with selection settings (``random,cluster[feature_tokens=32]``)."""
    try:
        return tuple(parse_methods(value))
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("compare: ")) from None


def eval_data_arg(value: str) -> str:
    """``--eval-data``: ``name=path`` or a bare path (named after its file stem); kept as written."""
    try:
        parse_eval_set(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("compare: ")) from None
    return value


def compare_train_defaults() -> TrainConfig:
    """The training settings compare starts from: a short warm-up, one thread per rank."""
    # compare's training defaults: a short warm-up, one thread per rank (the selection gets world_size threads), and
    # log lines rather than a progress bar per unit (--progress shows the bars)
    return TrainConfig(warmup_ratio=0.03, threads=1, progress=False)


@dataclass(frozen=True)
class CompareConfig(Config):
    """Every setting of ``clusterlm compare`` (:func:`clusterlm.compare`): the methods, budgets, seeds, data, and the
    training settings every unit shares (:attr:`train`).

    Attributes:
        data: training data (.jsonl/.json/.parquet); default: the demo train split.
        eval_data: held-out data: one or more NAME=PATH (a bare path is named after its file stem; repeat the option
            for several sets); the first is primary (eval_loss, verdicts, frontier); none may share an example with
            data; default: the demo held-out split.
        model: built-in name (e.g. smollm2-135m-instruct), a .gguf file, or a local HF model directory; the selection
            and the training use it.
        ratio: fraction of the data every method keeps.
        ratios: several budgets (a cost/quality frontier), e.g. 0.1,0.2,0.31,0.5; every method runs at each (full
            data once); the first is the primary one; replaces ratio.
        world_size: training ranks (processes / GPUs).
        budget: what the ratio is a share of, for every method: examples (the default), or tokens (prompt + answer;
            every method token-matched: its selected tokens meet ratio x the data's tokens up to one example per
            cluster or rank); a method's own token budget, e.g. random[token_ratio=0.31], holds either way.
        methods: comma list of full, random, longest, cluster, cluster-tokens, cluster-whole, cluster-paper,
            cluster-paper-exact, s2l, ifd, less; any method but full may carry a token budget, e.g.
            random[token_ratio=0.31] or longest[token_budget=50000], and a cluster method selection settings, e.g.
            cluster[feature_tokens=32] or cluster[within_cluster=kcenter,features=all-linear] (its label).
        seeds: a count (3 = seeds 0,1,2) or a comma list of seeds (0,5,7); one chosen seed: a trailing comma (5, =
            seed 5 only).
        out: output directory (resumable).
        n_validation: last examples of the eval data used as LESS's validation set, excluded from evaluation for
            every method (default: 32 when less runs, else 0).
        dtype: the selection model's weights (features, S2L/LESS proxies): auto (bfloat16 on a CUDA device that
            supports it, else float32), float32, bfloat16, float16; training keeps bf16.
        s2l_clusters: S2L's K-means clusters of loss trajectories.
        s2l_epochs: epochs of S2L's proxy training.
        less_epochs: epochs of LESS's LoRA warm-up.
        less_dim: LESS's projected gradient dimension.
        decide_by: the metric the verdicts, the frontier and compare.png's interval panel use: loss (the held-out
            answer-token loss) or a task metric NAME/METRIC of --eval-task (humaneval/pass@1, mytask/acc); default:
            the first task metric, else loss.
        train: the training settings of every unit (clusterlm train's; plan, data, out, seed and the evaluation
            set are compare's per unit): a mapping over compare's defaults (:func:`compare_train_defaults`;
            ``{"max_steps": 5}`` is ``--max-steps 5``), or a whole :class:`TrainConfig`, used as it is.
    """

    data: str | None = None
    eval_data: tuple[str, ...] | None = field(default=None, metadata={
        "parse": eval_data_arg, "action": "append", "metavar": "[NAME=]PATH"})
    model: str = "tiny-llama"
    ratio: float = 0.31
    ratios: tuple[float, ...] | None = field(default=None, metadata={"parse": ratios_arg})
    world_size: int = field(default=2, metadata={"parse": positive_int_arg})
    budget: Literal["examples", "tokens"] = "examples"
    methods: tuple[str, ...] = field(default=METHODS, metadata={"parse": methods_arg})
    seeds: tuple[int, ...] = field(default=(0, 1, 2), metadata={"parse": seeds_arg})
    out: str = "runs/compare"
    n_validation: int | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    s2l_clusters: int = 100
    s2l_epochs: int = 1
    less_epochs: int = 4
    less_dim: int = 1024
    decide_by: str | None = field(default=None, metadata={"metavar": "loss|NAME/METRIC"})
    train: TrainConfig = field(default_factory=compare_train_defaults, metadata={"cli": False})

    COMMAND: ClassVar[str] = "compare"

    def __post_init__(self) -> None:
        # Lists (YAML, Python) become tuples; a --methods string is parsed: the config stays frozen and hashable.
        for name in ("eval_data", "ratios", "methods", "seeds"):
            value = getattr(self, name)
            if isinstance(value, str) and name == "methods":
                object.__setattr__(self, name, tuple(parse_methods(value)))
            elif isinstance(value, str) and name == "eval_data":
                object.__setattr__(self, name, (value,))
            elif isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if isinstance(self.train, dict):
            check_keys(self.train, TrainConfig, "CompareConfig.train")
            object.__setattr__(self, "train", compare_train_defaults().replace(**self.train))

    @property
    def all_ratios(self) -> list[float]:
        """``ratios``, else ``[ratio]``."""
        return [float(r) for r in (self.ratios or (self.ratio,))]

    def to_dict(self) -> dict[str, Any]:
        """Plain data, ``train`` without the settings compare gives every unit itself (:data:`TRAIN_PER_UNIT`:
        plan, data, out, seed, ...), so that the file reads back through ``clusterlm compare --config``."""
        data = super().to_dict()
        data["train"] = {k: v for k, v in data["train"].items() if k not in TRAIN_PER_UNIT}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "CompareConfig") -> CompareConfig:  # type: ignore[override]
        """The config of a mapping (``train`` a nested mapping over compare's training defaults; an unknown name is
        refused, naming the closest)."""
        data = dict(data)
        if isinstance(data.get("train"), dict):
            check_keys(data["train"], TrainConfig, f"{where} (train)")
            data["train"] = compare_train_defaults().replace(**data["train"])
        return from_dict(cls, data, where)

    def check(self) -> None:
        """Refuse bad settings before any model work (data files are checked when read).

        Raises:
            ValueError / TypeError: the first bad setting, named.
        """
        ratios = list(self.ratios or (self.ratio,))
        bad = [r for r in ratios if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1]
        if bad or len(set(ratios)) != len(ratios):
            flag = "--ratios" if self.ratios else "--ratio"
            raise ValueError(f"compare: {flag} must be distinct fractions in (0, 1], got {ratios}; e.g. --ratios "
                             "0.2,0.31.")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"compare: --world-size must be >= 1, got {self.world_size}.")
        if self.budget not in BUDGETS:
            raise ValueError(f"compare: --budget must be one of {', '.join(BUDGETS)}, got {self.budget!r}.")
        if not self.methods:
            raise ValueError("compare: --methods needs at least one method.")
        parse_methods(",".join(self.methods))
        if not self.seeds or min(self.seeds) < 0 or len(set(self.seeds)) < len(self.seeds):
            raise ValueError(f"compare: --seeds must be distinct seeds >= 0, got {list(self.seeds)}.")
        if self.train.max_steps and "full" in self.methods:
            raise ValueError(
                f"compare: --max-steps {self.train.max_steps} with method 'full' would train full data for as many "
                "steps as the subsets, so 'total vs full' would mean nothing; drop --max-steps (use a smaller --data) "
                "or drop 'full'."
            )
        self._check_decide_by()
        for label in self.methods:  # variants' settings against this world size and budget, before any model work
            spec = parse_method(label)
            for ratio in ratios if spec.base in CLUSTER_METHODS else (ratios[0],):
                check_variant(spec, self.world_size, ratio, self.budget)

    def _check_decide_by(self) -> None:
        value = self.decide_by
        if value is None or value == "loss":
            return
        tasks = [s.name for s in self.train.tasks.tasks]
        name = str(value).partition("/")[0]
        if not isinstance(value, str) or "/" not in value or name not in tasks:
            known = ", ".join(f"{n}/METRIC" for n in tasks) or "no --eval-task given"
            raise ValueError(f"compare: --decide-by {value!r}: expected loss or a task metric NAME/METRIC of an "
                             f"--eval-task ({known}), e.g. --decide-by humaneval/pass@1.")
