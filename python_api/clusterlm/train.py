"""Reference DDP trainer that consumes a plan: every rank trains on its own plan list, with the plan's weights.

Launch::

    # one process (CPU, or one GPU)
    python -m clusterlm.train --plan runs/demo/plan --model tiny-llama --data train.jsonl --out runs/train

    # N processes on this machine: --nproc spawns torch's launcher (python -m torch.distributed.run)
    clusterlm train --plan runs/demo/plan --model tiny-llama --data train.jsonl --out runs/train --nproc 2
    # ... which is the same as
    torchrun --standalone --nproc-per-node 2 -m clusterlm.train --plan runs/demo/plan --model tiny-llama \\
        --data train.jsonl --out runs/train

    # 2 nodes x 8 GPUs: the same command on every node; the endpoint is host:port of one of them, --out
    # on a file system all nodes share (checkpoints are written by global rank 0, read by every rank)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29500 --rdzv-id run1 \\
        -m clusterlm.train --plan plan16/ --model /models/llama --data train.jsonl --out /shared/run1
    # ... or through the CLI on every node:
    clusterlm train --nproc 8 --nnodes 2 --rdzv-endpoint node0:29500 --rdzv-id run1 --plan plan16/ ...

    # baselines, through the same trainer (the plan is built on the fly and saved to OUT/plan)
    clusterlm train --plan full ...            # all data
    clusterlm train --plan random:0.31 ...     # uniform 31 % (random:5000 = 5000 examples)

Backend: nccl when CUDA is available (one GPU per local rank), gloo on CPU. The world size (processes
in all) must equal the plan's; a mismatch is refused before anything is loaded, naming both.

One optimizer step, per rank: the next ``micro_batch_size * grad_accum`` examples of the rank's plan
list (a :class:`clusterlm.sampler.PlanSampler`; the last step of an epoch may be shorter), in
micro-batches. Each micro-batch's loss is ``sum_b w_b * loss_b / n_step`` (``loss_b`` = mean answer-token
cross entropy, :func:`clusterlm.loss.per_example_loss`; ``n_step`` = examples in the step), so the
step's gradient is that of ``mean_b(w_b * loss_b)`` over the step — with full micro-batches exactly
``weighted_loss / grad_accum``. Gradients are synchronised once per step (``no_sync`` on the other
micro-batches) and DDP averages them over the K ranks: ``(1/K) sum_k mean_{b in k}(w_b g_b)``. With one
cluster per rank and ``w = K n_k / N`` (the plan's weights) that is ``sum_k (n_k / N) g_k``, the
full-data gradient with every cluster represented by its selected examples (DESIGN.md §4). Then
gradient clipping, the optimizer step and the learning-rate schedule (warm-up, then cosine / linear /
constant decay).

Files in ``--out``::

    args.json        the arguments, world size, plan, versions
    metrics.jsonl    one JSON record per line: {"kind": "train", "step", "epoch", "loss" (the weighted
                     objective, mean over ranks), "loss_unweighted", "lr", "grad_norm", "tokens" (answer +
                     prompt tokens so far, all ranks), "step_tokens" / "step_padded_tokens" / "step_time" /
                     "step_cpu_time" (per rank; CPU time excludes waiting for other ranks), "tokens_per_s",
                     "elapsed"}; and {"kind": "eval", "step", "eval_loss"
                     (token-weighted mean answer-token loss of --eval-data), "eval_tokens", "eval_time"}
    summary.json     wall time, tokens/s, first/last train loss (single steps, and means over the first/last
                     ``train_loss_window`` steps), held-out loss before/after, ...
    training.png     loss curve (train and held-out) and throughput
    ckpt/            step_0000040.pt ... (the last --keep-checkpoints) and ``latest`` (name of the newest)
    model/           the final weights (save_pretrained; the adapter only with LoRA) and tokenizer
    plan/            the plan, when --plan names a baseline

Checkpoints hold model (trainable parameters), optimizer, scheduler, sampler position (epoch,
position), step, the python / numpy / torch (and CUDA) RNG states of every rank and the metrics so
far. Global rank 0 writes them to a temporary file and renames it into place, then updates ``latest`` the
same way, so a run killed at any moment leaves a loadable checkpoint. ``--resume`` continues from
``latest`` (or a given file): metrics.jsonl is rewritten to the checkpoint's step and the run goes on
exactly as the uninterrupted one would have (on CPU with deterministic algorithms and a fixed number
of threads per rank, the loss curve matches step for step; the test kills both ranks with SIGKILL).

The plan is checked before the first step: world size, equal per-rank list lengths, and
:meth:`clusterlm.plan.Plan.verify` against the tokenised data (size and content hash) — so ``--max-length``
must be the one the plan was made with (the default takes it from the plan).

Precision. ``--bf16 on`` autocasts to bfloat16 over float32 weights; ``auto`` turns it on only on CUDA
GPUs with bf16. On a CPU without native bf16 instructions (no ``avx512_bf16`` / ``amx_bf16``) bf16
autocast is emulated and a step is about an order of magnitude slower than float32, so the trainer warns.
Pure low-precision weights (``--model-dtype bfloat16/float16``) are refused for full fine-tuning: AdamW
updates below the weights' resolution round away. With LoRA the frozen base may be bf16/fp16 (peft keeps
the adapters in float32).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cluster_kernels.lm_head_features import IGNORE_INDEX

__all__ = [
    "DistInfo",
    "MetricsLog",
    "add_train_args",
    "build_model",
    "build_optimizer",
    "build_parser",
    "cmd_train",
    "cpu_has_native_bf16",
    "evaluate",
    "fit_plan",
    "forward_backward",
    "launch",
    "load_plan",
    "loss_windows",
    "lr_factor",
    "main",
    "make_micro_batches",
    "plot_training",
    "resume",
    "save_checkpoint",
    "setup_distributed",
    "torchrun_command",
    "train",
    "train_demo",
    "validate_args",
]

CKPT_DIR = "ckpt"
LATEST = "latest"
CKPT_VERSION = 1
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CURVE = "training.png"
DEFAULT_MAX_LENGTH = 1024  # what `clusterlm select` uses when the plan does not record one
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
CPUINFO = "/proc/cpuinfo"
# x86 flags of native bf16 arithmetic (AVX512-BF16, AMX), and aarch64's BF16 extension ("Features" line).
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
# Half the relative spacing of representable values: smaller relative updates round to no change.
_WEIGHT_DTYPE_RESOLUTION = {"bfloat16": "2^-8 (0.4 %)", "float16": "2^-11 (0.05 %)"}
LOSS_WINDOW_MAX = 10


# ---------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value!r}")
    return n


def _non_negative_int(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {value!r}")
    return n


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
    g.add_argument("--eval-data", default=None, help="held-out data; its answer-token loss is reported")
    g.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto",
                   help="render prompt/response data through the tokenizer's chat template (auto: when it has one; "
                   "must match the plan's selection)")
    g.add_argument("--max-length", type=_positive_int, default=None,
                   help="truncate examples to this many tokens (default: the plan's, else 1024)")

    g = p.add_argument_group("processes")
    g.add_argument("--nproc", type=_positive_int, default=None,
                   help="processes on this node; > 1 spawns torch.distributed.run (default 1; ignored under torchrun)")
    g.add_argument("--nnodes", type=_positive_int, default=1, help="nodes (with --rdzv-endpoint)")
    g.add_argument("--rdzv-endpoint", default=None, help="host:port of the rendezvous for --nnodes > 1")
    g.add_argument("--rdzv-id", default="clusterlm", help="rendezvous id shared by the nodes of one run")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    g.add_argument("--threads", type=_positive_int, default=None,
                   help="torch CPU threads per rank (default 1 on CPU: deterministic and no oversubscription)")

    g = p.add_argument_group("schedule")
    g.add_argument("--epochs", type=_positive_int, default=1)
    g.add_argument("--max-steps", type=_positive_int, default=None, help="optimizer steps (overrides --epochs)")
    g.add_argument("--micro-batch-size", type=_positive_int, default=4, help="examples per rank and forward pass")
    g.add_argument("--grad-accum", type=_positive_int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--lr", type=float, default=2e-5, help="peak learning rate")
    g.add_argument("--lr-schedule", choices=("cosine", "linear", "constant"), default="cosine")
    g.add_argument("--warmup-steps", type=_non_negative_int, default=None, help="linear warm-up steps")
    g.add_argument("--warmup-ratio", type=float, default=0.0, help="warm-up as a fraction of all steps")
    g.add_argument("--min-lr-ratio", type=float, default=0.0, help="final learning rate / peak")
    g.add_argument("--optimizer", choices=("adamw", "adafactor"), default="adamw")
    g.add_argument("--weight-decay", type=float, default=0.0, help="decoupled decay of matrices (not biases/norms)")
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.999)
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: off)")
    g.add_argument("--seed", type=_non_negative_int, default=0)
    g.add_argument("--no-epoch-shuffle", action="store_true", help="visit the plan order every epoch")

    g = p.add_argument_group("model")
    g.add_argument("--bf16", choices=("auto", "on", "off"), default="auto", help="bf16 autocast (auto: on CUDA)")
    g.add_argument("--model-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="dtype the weights are loaded in")
    g.add_argument("--gradient-checkpointing", action="store_true")
    g.add_argument("--lora-r", type=_non_negative_int, default=0, help="LoRA rank (0: full fine-tuning)")
    g.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 * r)")
    g.add_argument("--lora-dropout", type=float, default=0.0)
    g.add_argument("--lora-targets", default="all-linear",
                   help="comma-separated module names for LoRA, or 'all-linear'")
    g.add_argument("--deterministic", choices=("auto", "on", "off"), default="auto",
                   help="torch.use_deterministic_algorithms (auto: on for CPU)")

    g = p.add_argument_group("evaluation, checkpoints, logging")
    g.add_argument("--eval-every", type=_non_negative_int, default=0,
                   help="evaluate every N steps (0: only before the first and after the last step)")
    g.add_argument("--no-initial-eval", action="store_true",
                   help="skip the held-out evaluation before the first step (e.g. when it is known already)")
    g.add_argument("--eval-batch-size", type=_positive_int, default=8)
    g.add_argument("--eval-max-examples", type=_positive_int, default=None, help="evaluate on the first N only")
    g.add_argument("--save-every", type=_non_negative_int, default=0,
                   help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--keep-checkpoints", type=_positive_int, default=2)
    g.add_argument("--resume", nargs="?", const=LATEST, default=None,
                   help="continue OUT's latest checkpoint (or the given .pt file)")
    g.add_argument("--overwrite", action="store_true", help="start afresh in an OUT that holds an earlier run")
    g.add_argument("--no-save-model", action="store_true", help="do not write OUT/model at the end")
    g.add_argument("--log-every", type=_positive_int, default=10, help="log line every N steps without a bar")
    g.add_argument("--no-progress", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m clusterlm.train``."""
    parser = argparse.ArgumentParser(prog="python -m clusterlm.train", description=__doc__.split("\n")[0])
    add_train_args(parser)
    return parser


# Options of the launching process only; torch's launcher would also reject them (--nproc is an ambiguous
# prefix of its --nproc-per-node), so they are not passed on to the ranks.
_LAUNCHER_DESTS = ("nproc", "nnodes", "rdzv_endpoint", "rdzv_id")


def _to_argv(args: argparse.Namespace, *, for_ranks: bool = False) -> list[str]:
    """The command line that parses back into ``args`` (without the launcher options when ``for_ranks``)."""
    argv: list[str] = []
    for action in build_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        if for_ranks and action.dest in _LAUNCHER_DESTS:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        opt = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(opt)
        elif action.nargs == "?" and value == action.const:
            argv.append(opt)
        else:
            argv += [opt, str(value)]
    return argv


# ---------------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------------


def _under_torchrun() -> bool:
    return all(k in os.environ for k in _TORCHRUN_ENV)


def torchrun_command(
    argv: Sequence[str], nproc: int, *, nnodes: int = 1, rdzv_endpoint: str | None = None, rdzv_id: str = "clusterlm"
) -> list[str]:
    """The ``python -m torch.distributed.run ... -m clusterlm.train ARGV`` command line.

    Args:
        argv: the trainer's arguments.
        nproc: processes on this node.
        nnodes: nodes; > 1 needs ``rdzv_endpoint`` (c10d rendezvous), 1 runs ``--standalone``.
        rdzv_endpoint: ``host:port`` of the rendezvous.
        rdzv_id: run id shared by the nodes.

    Raises:
        ValueError: ``nnodes > 1`` without an endpoint.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(int(nproc))]
    if nnodes > 1:
        if not rdzv_endpoint:
            raise ValueError(
                f"train: --nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (a node all others can reach), got none."
            )
        cmd += ["--nnodes", str(int(nnodes)), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                "--rdzv-id", rdzv_id]
    else:
        cmd.append("--standalone")
    return [*cmd, "-m", "clusterlm.train", *argv]


def launch(
    argv: Sequence[str],
    nproc: int,
    *,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "clusterlm",
    env: dict[str, str] | None = None,
) -> int:
    """Run the trainer with ``nproc`` processes on this node (one process: in this process).

    More than one process (or node) goes through torch's own launcher, ``python -m
    torch.distributed.run`` (what ``torchrun`` runs), in a subprocess; its exit status is returned.

    Args:
        argv: the trainer's arguments (``--nproc``, ``--nnodes`` and ``--rdzv-*`` in there are dropped).
        nproc: processes on this node.
        nnodes / rdzv_endpoint / rdzv_id: multi-node rendezvous (see :func:`torchrun_command`).
        env: extra environment variables for the ranks.

    Returns:
        The exit status (0 on success).
    """
    if nproc == 1 and nnodes == 1 and not env:
        return main(argv)
    argv = _to_argv(build_parser().parse_args(list(argv)), for_ranks=True)
    full_env = {**os.environ, **(env or {})}
    # torch's launcher sets OMP_NUM_THREADS=1 with a warning when unset; set it quietly (the trainer sets
    # torch's own thread count itself).
    full_env.setdefault("OMP_NUM_THREADS", "1")
    cmd = torchrun_command(argv, nproc, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id)
    return subprocess.run(cmd, env=full_env, check=False).returncode


def _plan_world_size(spec: str) -> int | None:
    """World size recorded in a plan directory's plan.json (None for baselines or unreadable plans)."""
    from clusterlm.baselines import is_baseline_spec

    if is_baseline_spec(spec):
        return None
    try:
        return int(json.loads((Path(spec) / "plan.json").read_text(encoding="utf-8"))["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # Plan.load in the ranks gives the precise error


def _world_size_error(plan_ws: int, world_size: int, how: str) -> ValueError:
    return ValueError(
        f"train: the plan is for world size {plan_ws} but this run has world size {world_size} ({how}); run "
        f"with {plan_ws} processes in all (--nproc {plan_ws}, or torchrun --nproc-per-node x --nnodes = {plan_ws}), "
        "or make a plan for this world size (clusterlm select --world-size)."
    )


def _run(args: argparse.Namespace) -> int:
    """Train in this process (under torchrun or alone), or spawn the ranks; returns the exit status."""
    nproc = args.nproc or 1
    validate_args(args)  # before any process is spawned: one error line instead of one per rank
    if not _under_torchrun() and (nproc > 1 or args.nnodes > 1):
        plan_ws = _plan_world_size(args.plan)
        if plan_ws is not None and plan_ws != nproc * args.nnodes:  # fail before starting processes
            raise _world_size_error(plan_ws, nproc * args.nnodes, f"--nproc {nproc} x --nnodes {args.nnodes}")
        return launch(_to_argv(args, for_ranks=True), nproc, nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint,
                      rdzv_id=args.rdzv_id)
    train(args)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """``clusterlm train``: run with a namespace that :func:`add_train_args` filled; returns the exit status.

    Argument errors (bad plan, world-size mismatch, data the plan was not made for, an out directory
    holding another run) print one line ``clusterlm train: error: ...`` (from rank 0) and return 2.
    """
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"clusterlm train: error: {e}", file=sys.stderr, flush=True)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m clusterlm.train`` and ``torchrun -m clusterlm.train``; exit status as :func:`cmd_train`."""
    return cmd_train(build_parser().parse_args(None if argv is None else list(argv)))


def validate_args(args: argparse.Namespace) -> None:
    """Refuse argument combinations that cannot train well; runs before anything is loaded.

    Raises:
        ValueError: ``--model-dtype bfloat16/float16`` without LoRA (full fine-tuning of low-precision weights).
    """
    dtype = getattr(args, "model_dtype", "float32")
    if dtype in _WEIGHT_DTYPE_RESOLUTION and not getattr(args, "lora_r", 0):
        raise ValueError(
            f"train: --model-dtype {dtype} without LoRA trains the weights themselves in {dtype}, where an update "
            f"smaller than about {_WEIGHT_DTYPE_RESOLUTION[dtype]} of a weight rounds away, as most AdamW steps at "
            "fine-tuning learning rates do, so the model barely learns; use --model-dtype float32 with --bf16 on "
            f"(bf16 autocast over float32 weights), or a LoRA run on the {dtype} base (--lora-r 16)."
        )


def cpu_has_native_bf16(cpuinfo: str | os.PathLike = CPUINFO) -> bool | None:
    """Whether this CPU does bf16 arithmetic natively, from the flags in ``/proc/cpuinfo``.

    Args:
        cpuinfo: the file to read (``/proc/cpuinfo``).

    Returns:
        True / False from the ``flags`` (x86) or ``Features`` (aarch64) lines; None when unknown (not
        Linux, the file is unreadable or has no flags line).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            flags.update(value.split())
    if not flags:
        return None
    return not flags.isdisjoint(_NATIVE_BF16_FLAGS)


def _use_bf16(mode: str, device: torch.device) -> bool:
    """--bf16: ``on``, ``off``, or ``auto`` = on for CUDA devices with bf16 (never on CPU)."""
    if mode == "auto":
        return device.type == "cuda" and torch.cuda.is_bf16_supported()
    return mode == "on"


def _bf16_cpu_warning(use_bf16: bool, device: torch.device, cpuinfo: str | os.PathLike = CPUINFO) -> str | None:
    """The warning for bf16 autocast on a CPU without native bf16 (None when it does not apply)."""
    if not use_bf16 or device.type != "cpu" or cpu_has_native_bf16(cpuinfo) is not False:
        return None
    return (
        "train: warning: --bf16 on autocasts to bfloat16 on a CPU without native bf16 (no avx512_bf16 / amx_bf16 "
        f"in {cpuinfo}), where bf16 is emulated and training is about an order of magnitude slower than float32 "
        "(measured: 12x for SmolLM2-135M on AVX2); use --bf16 off."
    )


def loss_windows(losses: Sequence[float]) -> tuple[float, float, int] | None:
    """Means of the first and the last ``w = min(10, max(1, steps // 5))`` step losses, and ``w``.

    Single steps are noisy (one micro-batch mix each); window means compare like with like.

    Returns:
        ``(first_mean, last_mean, w)``, or None without steps.
    """
    n = len(losses)
    if not n:
        return None
    w = min(LOSS_WINDOW_MAX, max(1, n // 5))
    values = np.asarray(losses, dtype=np.float64)
    return float(values[:w].mean()), float(values[-w:].mean()), w


# ---------------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------------


@dataclass
class DistInfo:
    """Where this process sits in the run.

    Attributes:
        rank / world_size / local_rank: torch.distributed coordinates (0 / 1 / 0 without torchrun).
        device: the torch device of this rank.
        distributed: a process group is initialised (world size > 1 or launched by torchrun).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    distributed: bool

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one that logs and writes files."""
        return self.rank == 0


def setup_distributed(args: argparse.Namespace) -> DistInfo:
    """Initialise the process group (nccl on CUDA, gloo on CPU), the device, threads and determinism."""
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.nproc is not None and _under_torchrun():
        expected = args.nproc * args.nnodes
        if expected != world_size:
            raise ValueError(
                f"train: --nproc {args.nproc} x --nnodes {args.nnodes} = {expected} differs from torchrun's world size "
                f"{world_size}; drop --nproc under torchrun or make them agree."
            )
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("train: --device cuda but torch sees no CUDA device; use --device cpu or auto.")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(args.threads or 1)
    deterministic = args.deterministic == "on" or (args.deterministic == "auto" and not use_cuda)
    if deterministic:
        if use_cuda:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    distributed = _under_torchrun()
    if distributed:
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    return DistInfo(rank, world_size, local_rank, device, distributed)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _check_out_dir(out: Path, args: argparse.Namespace, di: DistInfo) -> None:
    """Refuse to mix a new run into an old one's files; --overwrite clears them."""
    old = [p for p in (out / METRICS, out / CKPT_DIR, out / SUMMARY) if p.exists()]
    if not old or args.resume is not None:
        return
    if not args.overwrite:
        raise ValueError(
            f"train: {out} holds an earlier run ({', '.join(p.name for p in old)}); pass --resume to continue it, "
            "--overwrite to start afresh there, or another --out."
        )
    if di.is_main:
        import shutil

        for p in old:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


# ---------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------


def _max_length(args: argparse.Namespace) -> int:
    """--max-length, else the plan's recorded data max_length, else the select default."""
    if args.max_length is not None:
        return args.max_length
    from clusterlm.baselines import is_baseline_spec

    if not is_baseline_spec(args.plan):
        try:
            meta = json.loads((Path(args.plan) / "plan.json").read_text(encoding="utf-8"))
            recorded = (meta.get("config") or {}).get("data", {}).get("max_length")
            if recorded:
                return int(recorded)
        except (OSError, ValueError, AttributeError):
            pass
    return DEFAULT_MAX_LENGTH


def load_plan(args: argparse.Namespace, di: DistInfo) -> Any:
    """Read the plan of ``--plan`` (None for a baseline spec, built later from the data) and check its world size.

    Raises:
        FileNotFoundError / ValueError: a missing or damaged plan (:meth:`Plan.load`); a world size that
            differs from this run's.
    """
    from clusterlm.baselines import is_baseline_spec
    from clusterlm.plan import Plan

    if is_baseline_spec(args.plan):
        return None
    plan = Plan.load(args.plan)
    if plan.world_size != di.world_size:
        raise _world_size_error(plan.world_size, di.world_size, "processes started")
    return plan


def fit_plan(args: argparse.Namespace, plan: Any, dataset: Any, di: DistInfo, model_id: str) -> Any:
    """Build the baseline plan (``plan is None``) or verify ``plan`` against the tokenised data.

    Raises:
        ValueError: per-rank lists of unequal length; data the plan was not made for (:meth:`Plan.verify`).
    """
    from clusterlm.baselines import baseline_plan

    if plan is None:
        plan = baseline_plan(args.plan, dataset, di.world_size, seed=args.seed)
        plan.model_id = model_id
        if di.is_main:
            plan.save(Path(args.out) / "plan")
    counts = sorted({len(plan.indices(r)) for r in range(plan.world_size)})
    if len(counts) != 1:  # Plan validates this too; DDP would hang on it, so it is checked here again
        raise ValueError(f"train: every rank must visit the same number of examples, the plan has {counts}.")
    plan.verify(dataset, di.world_size)
    return plan


def make_micro_batches(
    dataset: Any, indices: Sequence[int], weights: np.ndarray, micro_batch_size: int, pad_id: int, device: torch.device
) -> list[dict[str, torch.Tensor]]:
    """Collate one step's examples into micro-batches.

    Args:
        dataset: indexable examples (``{"input_ids", "labels"}`` int64 arrays).
        indices: (n_step,) data-set indices of the step, in order.
        weights: (N,) per-example plan weights.
        micro_batch_size: examples per micro-batch (the last one may be smaller).
        pad_id: padding token id.
        device: where the tensors go.

    Returns:
        Micro-batches with ``input_ids``, ``attention_mask``, ``labels`` (B, T) int64 (right-padded, -100
        on padding) and ``weights`` (B,) float32.
    """
    from clusterlm.data import collate

    weights = np.asarray(weights)
    out = []
    for s in range(0, len(indices), micro_batch_size):
        idx = [int(i) for i in indices[s : s + micro_batch_size]]
        batch = collate([dataset[i] for i in idx], pad_id=pad_id)
        batch["weights"] = torch.as_tensor(weights[idx], dtype=torch.float32)
        out.append({k: v.to(device, non_blocking=True) for k, v in batch.items()})
    return out


def _example_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """:func:`per_example_loss`, with 0 (and no gradient) for rows without an answer token (e.g. truncated)."""
    from clusterlm.loss import per_example_loss

    has_answer = (labels[:, 1:] != IGNORE_INDEX).any(dim=1)
    if bool(has_answer.all()):
        return per_example_loss(logits, labels)
    losses = torch.zeros(labels.shape[0], dtype=torch.promote_types(logits.dtype, torch.float32),
                         device=logits.device)
    if bool(has_answer.any()):
        losses = losses.index_put((has_answer.nonzero().flatten(),),
                                  per_example_loss(logits[has_answer], labels[has_answer]))
    return losses


# ---------------------------------------------------------------------------------------------------
# Model and optimizer
# ---------------------------------------------------------------------------------------------------


def build_model(args: argparse.Namespace, di: DistInfo) -> tuple[torch.nn.Module, Any, str]:
    """Load the model (optionally with LoRA) on this rank's device; ``(model, tokenizer, model_id)``."""
    from clusterlm.models import load_model

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.model_dtype]
    torch.manual_seed(args.seed)  # the same LoRA initialisation on every rank (DDP broadcasts rank 0's anyway)
    model, tokenizer, model_id = load_model(args.model, dtype=dtype)
    if args.gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and DDP. transformers 5 renamed the call.
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.config.use_cache = False
    if args.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        targets: str | list[str] = args.lora_targets
        if targets != "all-linear":
            targets = [t.strip() for t in targets.split(",") if t.strip()]
        config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha or 2 * args.lora_r,
                            lora_dropout=args.lora_dropout, target_modules=targets, task_type="CAUSAL_LM")
        model = get_peft_model(model, config)
        low = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad and p.dtype != torch.float32})
        if low:  # validate_args allowed the low-precision base on the promise of float32 adapters
            raise ValueError(
                f"train: peft made the LoRA adapters {', '.join(low)} (--model-dtype {args.model_dtype}); they "
                "would barely learn. Use --model-dtype float32 (with --bf16 on), or a peft that keeps adapters in "
                "float32 (autocast_adapter_dtype)."
            )
    model.to(di.device)
    model.train()
    return model, tokenizer, model_id


def build_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW (decay on matrices only, as nanoGPT) or Adafactor over the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("train: the model has no trainable parameters (check --lora-targets).")
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if args.optimizer == "adafactor":
        return torch.optim.Adafactor(groups, lr=args.lr)
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2))


def lr_factor(step: int, total_steps: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Learning rate / peak at ``step`` (0-based): linear warm-up, then cosine/linear decay to ``min_ratio``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    if schedule == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------------------
# One step, evaluation
# ---------------------------------------------------------------------------------------------------


def _autocast(device_type: str, dtype: torch.dtype | None) -> Any:
    return torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def forward_backward(
    model: torch.nn.Module,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    *,
    n_step: int,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Forward and backward passes of one optimizer step on this rank (gradients accumulate in ``.grad``).

    Micro-batch loss ``sum_b w_b loss_b / n_step``; DDP gradient synchronisation (``no_sync``) only on the
    last micro-batch. After it, ``.grad`` on every rank holds the mean over ranks of each rank's
    ``grad mean_b(w_b * loss_b)`` (see the module docstring).

    Args:
        model: the (DDP-wrapped or plain) causal LM, in train mode.
        micro_batches: from :func:`make_micro_batches`.
        n_step: examples in the step on this rank (the sum of the micro-batch sizes).
        autocast_dtype: e.g. ``torch.bfloat16`` for autocast; None for none.

    Returns:
        ``{"loss": weighted objective, "loss_unweighted": mean per-example loss, "examples", "tokens"
        (attention-mask tokens), "padded_tokens"}``, for this rank.
    """
    from clusterlm.loss import weighted_loss

    assert n_step == sum(int(mb["input_ids"].shape[0]) for mb in micro_batches)
    device_type = micro_batches[0]["input_ids"].device.type
    no_sync: Callable[[], Any] = getattr(model, "no_sync", contextlib.nullcontext)
    # Summed on the device and read once at the end: a .item() per micro-batch would stall a GPU.
    sums = torch.zeros(3, dtype=torch.float64, device=micro_batches[0]["input_ids"].device)
    padded = 0
    for i, mb in enumerate(micro_batches):
        sync = i == len(micro_batches) - 1
        with contextlib.nullcontext() if sync else no_sync():
            with _autocast(device_type, autocast_dtype):
                logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
            losses = _example_losses(logits, mb["labels"])
            loss = weighted_loss(losses, mb["weights"]) * (losses.shape[0] / n_step)
            loss.backward()
        sums += torch.stack([loss.detach().double(), losses.detach().double().sum() / n_step,
                             mb["attention_mask"].sum().double()])
        padded += mb["attention_mask"].numel()
    loss_sum, plain, tokens = sums.tolist()
    return {"loss": loss_sum, "loss_unweighted": plain, "examples": n_step, "tokens": int(tokens),
            "padded_tokens": int(padded)}


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    dataset: Any,
    di: DistInfo,
    *,
    batch_size: int,
    pad_id: int,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[float, int]:
    """Held-out answer-token loss: token-weighted mean over the data set, sharded over ranks.

    Rank ``r`` evaluates examples ``r, r + K, ...`` (longest first, for little padding); the sums of
    token losses and answer tokens are all-reduced. Examples without answer tokens count nothing.

    Returns:
        ``(loss, answer_tokens)``; loss is nan when the set has no answer token.
    """
    import torch.distributed as dist

    from clusterlm.data import collate

    was_training = model.training
    model.eval()
    mine = list(range(di.rank, len(dataset), di.world_size))
    mine.sort(key=lambda i: -len(dataset[i]["input_ids"]))
    total = torch.zeros(2, dtype=torch.float64, device=di.device)  # [sum of token NLL, answer tokens]
    for s in range(0, len(mine), batch_size):
        batch = collate([dataset[i] for i in mine[s : s + batch_size]], pad_id=pad_id)
        batch = {k: v.to(di.device) for k, v in batch.items()}
        counts = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1)
        with _autocast(di.device.type, autocast_dtype):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        losses = _example_losses(logits, batch["labels"])
        total[0] += (losses.double() * counts.double()).sum()
        total[1] += counts.sum().double()
    if di.distributed:
        dist.all_reduce(total)
    model.train(was_training)
    n_tokens = int(total[1].item())
    return (float(total[0].item()) / n_tokens if n_tokens else float("nan")), n_tokens


# ---------------------------------------------------------------------------------------------------
# Checkpoints and metrics
# ---------------------------------------------------------------------------------------------------


def _trainable_state(model: torch.nn.Module, lora: bool) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if not lora:
        return state
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in trainable}


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _fsync_write(path: Path, write: Callable[[Any], None]) -> None:
    """Write through ``write(file)`` to a temporary sibling, fsync, rename over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(out: Path, state: dict[str, Any], step: int, keep: int) -> Path:
    """Atomically write ``ckpt/step_<step, 7 digits>.pt``, point ``ckpt/latest`` at it, keep the newest ``keep``."""
    ckpt_dir = out / CKPT_DIR
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"step_{step:07d}.pt"
    _fsync_write(path, lambda f: torch.save(state, f))
    _fsync_write(ckpt_dir / LATEST, lambda f: f.write((path.name + "\n").encode()))
    for old in sorted(ckpt_dir.glob("step_*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return path


def _find_checkpoint(out: Path, resume: str) -> Path | None:
    """The checkpoint to resume: ``resume`` itself, or ``latest`` in OUT/ckpt (None when there is none)."""
    if resume != LATEST:
        path = Path(resume)
        if not path.is_file():
            raise FileNotFoundError(f"train: --resume {resume}: no such checkpoint file.")
        return path
    ckpt_dir = out / CKPT_DIR
    pointer = ckpt_dir / LATEST
    if pointer.is_file():
        path = ckpt_dir / pointer.read_text(encoding="utf-8").strip()
        if path.is_file():
            return path
    found = sorted(ckpt_dir.glob("step_*.pt"))
    return found[-1] if found else None


def _plan_digest(plan: Any) -> str:
    h = hashlib.sha256()
    h.update(np.stack(plan.rank_indices).astype(np.int64).tobytes())
    h.update(np.ascontiguousarray(plan.weights, dtype=np.float64).tobytes())
    return h.hexdigest()


def resume(
    path: Path,
    setup: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    sampler: Any,
    di: DistInfo,
) -> tuple[int, int, list[dict[str, Any]], dict[str, Any]]:
    """Load a checkpoint into model, optimizer, scheduler, sampler and this rank's RNGs.

    Args:
        path: the checkpoint file.
        setup: this run's settings that decide the data order (must equal the checkpoint's).
        model / optimizer / scheduler / sampler: built as for a fresh run.
        di: this rank.

    Returns:
        ``(step, epoch, metrics records so far, counters)``.

    Raises:
        ValueError: the checkpoint was made with other settings, or lacks trainable parameters of the model.
    """
    # On CPU first: RNG states must stay CPU tensors; load_state_dict moves the rest where it belongs.
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    differs = [f"{k}: checkpoint {ckpt['setup'].get(k)!r}, now {v!r}" for k, v in setup.items()
               if ckpt["setup"].get(k) != v]
    if differs:
        raise ValueError(
            f"train: cannot resume {path}: it was made with other settings ({'; '.join(differs)}). Resume with the "
            "original plan and settings, or start afresh with --overwrite."
        )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if not trainable <= set(ckpt["model"]):
        raise ValueError(f"train: {path} lacks trainable parameters of this model, e.g. "
                         f"{sorted(trainable - set(ckpt['model']))[:3]}; resume with the same --model/--lora-*.")
    model.load_state_dict(ckpt["model"], strict=setup["lora_r"] == 0)
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    sampler.load_state_dict({"epoch": ckpt["sampler"]["epoch"], "position": ckpt["sampler"]["position"]})
    _set_rng_state(ckpt["rng"][di.rank], di.device)
    return int(ckpt["step"]), int(ckpt["sampler"]["epoch"]), list(ckpt["metrics"]), dict(ckpt["counters"])


class MetricsLog:
    """``metrics.jsonl`` (rank 0 only): every record is also kept, for checkpoints and the summary."""

    def __init__(self, path: Path, enabled: bool, records: list[dict[str, Any]] | None = None) -> None:
        self.path = path
        self.enabled = enabled
        self.records: list[dict[str, Any]] = list(records or [])
        if enabled:  # (re)write what the run holds so far: a resumed run drops steps after its checkpoint
            text = "".join(json.dumps(r) + "\n" for r in self.records)
            _fsync_write(path, lambda f: f.write(text.encode()))

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


def plot_training(records: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """``training.png``: training loss (raw and smoothed) with held-out loss, and tokens/s per step."""
    train_recs = [r for r in records if r.get("kind") == "train"]
    eval_recs = [r for r in records if r.get("kind") == "eval"]
    if not train_recs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.array([r["step"] for r in train_recs])
    loss = np.array([r["loss"] for r in train_recs])
    # Trailing mean over 4 % of the run: smooths micro-batch noise while lagging only 2 % behind.
    window = max(1, len(loss) // 25)
    csum = np.concatenate([[0.0], np.cumsum(loss)])
    starts = np.maximum(np.arange(1, len(loss) + 1) - window, 0)
    smooth = (csum[1:] - csum[starts]) / (np.arange(1, len(loss) + 1) - starts)
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
    if window > 1:
        ax0.plot(steps, loss, color="tab:blue", alpha=0.3, lw=0.8, label="train (weighted objective)")
        ax0.plot(steps, smooth, color="tab:blue", lw=1.6, label=f"train, mean of {window} steps")
    else:
        ax0.plot(steps, loss, color="tab:blue", lw=1.2, label="train (weighted objective)")
    if eval_recs:
        ax0.plot([r["step"] for r in eval_recs], [r["eval_loss"] for r in eval_recs], "o-", color="tab:red",
                 label="held-out (answer tokens)")
    ax0.set_xlabel("optimizer step")
    ax0.set_ylabel("loss")
    ax0.set_title("loss")
    ax0.grid(alpha=0.3)
    ax0.legend()
    ax1.plot(steps, [r["tokens_per_s"] for r in train_recs], color="tab:green", lw=0.8)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("tokens / s (all ranks)")
    ax1.set_title("throughput")
    ax1.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _all_gather_floats(values: Sequence[float], di: DistInfo) -> np.ndarray:
    """(world_size, len(values)) float64: every rank's values."""
    import torch.distributed as dist

    local = torch.tensor(list(values), dtype=torch.float64, device=di.device)
    if not di.distributed:
        return local.cpu().numpy()[None]
    gathered = [torch.empty_like(local) for _ in range(di.world_size)]
    dist.all_gather(gathered, local)
    return torch.stack(gathered).cpu().numpy()


def _all_gather_objects(obj: Any, di: DistInfo) -> list[Any]:
    import torch.distributed as dist

    if not di.distributed:
        return [obj]
    out: list[Any] = [None] * di.world_size
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------


def _steps(order: np.ndarray, per_step: int) -> Iterator[np.ndarray]:
    for s in range(0, len(order), per_step):
        yield order[s : s + per_step]


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    for dist_name in ("transformers", "peft", "cluster-kernels"):
        try:
            out[dist_name] = md.version(dist_name)
        except md.PackageNotFoundError:
            pass
    return out


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train one rank (call it in every process of the run); returns the summary (on every rank).

    Raises:
        ValueError / FileNotFoundError: bad arguments, a plan that does not fit the run or the data, an
            out directory holding another run, a checkpoint from a different setup.
    """
    import torch.distributed as dist

    t_start = time.perf_counter()
    validate_args(args)
    plan_ws = _plan_world_size(args.plan)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if plan_ws is not None and plan_ws != world_size:  # before any process group or model is made
        raise _world_size_error(plan_ws, world_size, "torchrun" if _under_torchrun() else "a single process")
    # Process-wide torch settings this function changes; restored at the end (train may run inside a caller).
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    di = setup_distributed(args)
    try:
        return _train(args, di, t_start)
    finally:
        if di.distributed and dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1], warn_only=saved[2])


def _train(args: argparse.Namespace, di: DistInfo, t_start: float) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from clusterlm.data import CHAT_TEMPLATE_MODES, load_data
    from clusterlm.sampler import PlanSampler

    out = Path(args.out)
    _check_out_dir(out, args, di)
    out.mkdir(parents=True, exist_ok=True)
    say: Callable[[str], None] = (lambda m: print(m, flush=True)) if di.is_main else (lambda m: None)
    progress = di.is_main and not args.no_progress

    # ---- plan, model, data ----------------------------------------------------------------------
    plan = load_plan(args, di)  # a damaged plan fails here, before the model is loaded
    _seed_everything(args.seed)
    model, tokenizer, model_id = build_model(args, di)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    max_length = _max_length(args)
    rendering = CHAT_TEMPLATE_MODES[args.chat_template]
    data = load_data(args.data, tokenizer, max_length=max_length, progress=progress, chat_template=rendering)
    plan = fit_plan(args, plan, data, di, model_id)
    weights = plan.weights
    sampler = PlanSampler(plan, di.rank, epoch_shuffle=not args.no_epoch_shuffle, seed=args.seed)
    eval_data = None
    if args.eval_data:
        eval_data = load_data(args.eval_data, tokenizer, max_length=max_length, progress=False,
                              chat_template=rendering)
        if args.eval_max_examples is not None and args.eval_max_examples < len(eval_data):
            eval_data = [eval_data[i] for i in range(args.eval_max_examples)]

    per_rank = plan.per_rank
    per_step = args.micro_batch_size * args.grad_accum
    steps_per_epoch = math.ceil(per_rank / per_step)
    total_steps = args.max_steps or args.epochs * steps_per_epoch
    warmup = args.warmup_steps if args.warmup_steps is not None else int(args.warmup_ratio * total_steps)
    use_bf16 = _use_bf16(args.bf16, di.device)
    autocast_dtype = torch.bfloat16 if use_bf16 else None
    bf16_warning = _bf16_cpu_warning(use_bf16, di.device)
    if bf16_warning:
        say(bf16_warning)

    ddp_model: torch.nn.Module = model
    if di.distributed:
        ddp_model = DDP(model, device_ids=[di.local_rank] if di.device.type == "cuda" else None)
    optimizer = build_optimizer(model, args)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, warmup, args.lr_schedule, args.min_lr_ratio)
    )
    setup = {"world_size": di.world_size, "micro_batch_size": args.micro_batch_size, "grad_accum": args.grad_accum,
             "seed": args.seed, "epoch_shuffle": not args.no_epoch_shuffle, "plan_digest": _plan_digest(plan),
             "lora_r": args.lora_r}

    # ---- resume ----------------------------------------------------------------------------------
    step, epoch, records, counters = 0, 0, [], {"tokens": 0, "train_time": 0.0}
    ckpt_path = _find_checkpoint(out, args.resume) if args.resume is not None else None
    if args.resume is not None and ckpt_path is None:
        say(f"--resume: no checkpoint in {out / CKPT_DIR}; starting from step 0")
    if ckpt_path is not None:
        step, epoch, records, counters = resume(ckpt_path, setup, model, optimizer, scheduler, sampler, di)
        say(f"resumed from {ckpt_path} (step {step}, epoch {epoch}, position {sampler.position})")
    else:
        torch.manual_seed(args.seed + di.rank)  # per-rank dropout streams (nanoGPT's seed offset)
    resumed_from = None if ckpt_path is None else str(ckpt_path)
    log = MetricsLog(out / METRICS, di.is_main, records)

    if di.is_main:
        info = {**{k: v for k, v in vars(args).items() if k != "func"}, "world_size": di.world_size,
                "max_length_used": max_length, "total_steps": total_steps, "steps_per_epoch": steps_per_epoch,
                "model_id": model_id, "plan_config": plan.config, "resumed_from": resumed_from,
                "versions": _versions(), "argv": sys.argv}
        (out / "args.json").write_text(json.dumps(info, indent=2, default=str) + "\n", encoding="utf-8")
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    say(f"train: {di.world_size} rank(s) on {di.device.type} ({'nccl' if di.device.type == 'cuda' else 'gloo'}"
        f"{'' if di.distributed else ', no process group'}), plan {args.plan}: {per_rank} examples per rank, "
        f"{per_step} per step ({args.micro_batch_size} x {args.grad_accum}), {total_steps} steps; "
        f"{n_trainable:,} trainable parameters{f' (LoRA r={args.lora_r})' if args.lora_r else ''}")

    def run_eval() -> None:
        if eval_data is None:
            return
        t0 = time.perf_counter()
        loss, n_tok = evaluate(model, eval_data, di, batch_size=args.eval_batch_size, pad_id=pad_id,
                               autocast_dtype=autocast_dtype)
        log.append({"kind": "eval", "step": step, "eval_loss": loss, "eval_tokens": n_tok,
                    "eval_time": time.perf_counter() - t0})
        say(f"step {step}: held-out loss {loss:.4f} ({n_tok} answer tokens)")

    def checkpoint() -> None:
        rng = _all_gather_objects(_rng_state(di.device), di)
        if di.is_main:
            state = {"version": CKPT_VERSION, "step": step, "setup": setup,
                     "sampler": {"epoch": sampler.epoch, "position": sampler.position},
                     "model": _trainable_state(model, args.lora_r > 0), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "rng": rng, "metrics": log.records, "counters": counters}
            save_checkpoint(out, state, step, args.keep_checkpoints)

    # ---- loop ------------------------------------------------------------------------------------
    if step == 0 and not args.no_initial_eval:
        run_eval()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", dynamic_ncols=True)
    while step < total_steps:
        sampler.set_epoch(epoch)
        for idx in _steps(np.fromiter(iter(sampler), dtype=np.int64), per_step):
            t0, c0 = time.perf_counter(), time.process_time()
            micro = make_micro_batches(data, idx, weights, args.micro_batch_size, pad_id, di.device)
            stats = forward_backward(ddp_model, micro, n_step=len(idx), autocast_dtype=autocast_dtype)
            grad_norm = float("nan")
            if args.max_grad_norm > 0:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(
                    [p for p in model.parameters() if p.requires_grad], args.max_grad_norm))
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if di.device.type == "cuda":
                torch.cuda.synchronize(di.device)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            sampler.advance(len(idx))
            step += 1
            record = _train_record(stats, dt, cpu, di, step, epoch + sampler.position / per_rank, lr, grad_norm,
                                   counters)
            log.append(record)
            if bar is not None:
                bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
                bar.update(1)
            elif step % args.log_every == 0 or step == total_steps:
                say(f"step {step}/{total_steps}  loss {record['loss']:.4f}  lr {lr:.3g}  "
                    f"{record['tokens_per_s']:,.0f} tok/s")
            if args.eval_every and step % args.eval_every == 0 and step < total_steps:
                run_eval()
            if (args.save_every and step % args.save_every == 0) or step == total_steps:
                checkpoint()
            if step >= total_steps:
                break
        if sampler.position >= per_rank:
            epoch += 1
    if bar is not None:
        bar.close()

    # ---- teardown --------------------------------------------------------------------------------
    if not any(r.get("kind") == "eval" and r["step"] == step for r in log.records):
        run_eval()
    summary = _summarize(log.records, counters, args, di, plan, total_steps, time.perf_counter() - t_start,
                         resumed_from)
    if di.is_main:
        if not args.no_save_model:
            model.save_pretrained(out / "model")
            tokenizer.save_pretrained(out / "model")
        plot_training(log.records, out / CURVE)
        _fsync_write(out / SUMMARY, lambda f: f.write((json.dumps(summary, indent=2) + "\n").encode()))
        say(_summary_text(summary, out))
    return summary


def _train_record(stats: dict[str, float], dt: float, cpu: float, di: DistInfo, step: int, epoch: float, lr: float,
                  grad_norm: float, counters: dict[str, Any]) -> dict[str, Any]:
    """The metrics record of a step, from every rank's numbers (one all-gather); updates ``counters``."""
    ranks = _all_gather_floats([stats["loss"], stats["loss_unweighted"], stats["tokens"], stats["padded_tokens"], dt,
                                cpu], di)
    step_tokens = int(ranks[:, 2].sum())
    slowest = max(float(ranks[:, 4].max()), 1e-9)  # the step ends when the slowest rank ends
    counters["tokens"] += step_tokens
    counters["train_time"] += slowest
    return {"kind": "train", "step": step, "epoch": epoch, "loss": float(ranks[:, 0].mean()),
            "loss_unweighted": float(ranks[:, 1].mean()), "lr": lr, "grad_norm": grad_norm,
            "tokens": counters["tokens"], "step_tokens": ranks[:, 2].astype(int).tolist(),
            "step_padded_tokens": ranks[:, 3].astype(int).tolist(), "step_time": ranks[:, 4].tolist(),
            "step_cpu_time": ranks[:, 5].tolist(),
            "tokens_per_s": step_tokens / slowest, "elapsed": counters["train_time"]}


def _summarize(records: list[dict[str, Any]], counters: dict[str, Any], args: argparse.Namespace, di: DistInfo,
               plan: Any, total_steps: int, wall: float, resumed_from: str | None) -> dict[str, Any]:
    train_recs = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    windows = loss_windows([r["loss"] for r in train_recs])
    tokens = np.array([r["step_tokens"] for r in train_recs], dtype=np.float64).reshape(len(train_recs), -1)
    padded = np.array([r["step_padded_tokens"] for r in train_recs], dtype=np.float64).reshape(len(train_recs), -1)
    times = np.array([r["step_time"] for r in train_recs], dtype=np.float64).reshape(len(train_recs), -1)

    def ratio(x: np.ndarray) -> float | None:
        if not len(x):
            return None
        return float(np.mean(x.max(1) / np.maximum(x.mean(1), 1e-9)))

    return {
        "steps": len(train_recs),
        "total_steps": total_steps,
        "world_size": di.world_size,
        "device": di.device.type,
        "plan": args.plan,
        "plan_method": plan.config.get("method"),
        "examples_per_rank": plan.per_rank,
        "examples_per_step": args.micro_batch_size * args.grad_accum * di.world_size,
        "tokens": int(counters["tokens"]),
        "train_time_s": float(counters["train_time"]),
        "wall_time_s": wall,
        "tokens_per_s": counters["tokens"] / max(counters["train_time"], 1e-9),
        "mean_step_time_s": float(times.max(1).mean()) if len(times) else None,
        "step_token_max_over_mean": ratio(tokens),
        "step_padded_token_max_over_mean": ratio(padded),
        "first_train_loss": train_recs[0]["loss"] if train_recs else None,
        "final_train_loss": train_recs[-1]["loss"] if train_recs else None,
        "train_loss_window": windows[2] if windows else None,
        "train_loss_first_window": windows[0] if windows else None,
        "train_loss_last_window": windows[1] if windows else None,
        "initial_eval_loss": evals[0]["eval_loss"] if evals and evals[0]["step"] == 0 else None,
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "resumed_from": resumed_from,
    }


def _summary_text(s: dict[str, Any], out: Path) -> str:
    lines = [
        "",
        f"trained {s['steps']} steps on {s['world_size']} rank(s) ({s['examples_per_step']} examples per step) in "
        f"{s['train_time_s']:.1f} s of steps, {s['wall_time_s']:.1f} s wall: {s['tokens']:,} tokens, "
        f"{s['tokens_per_s']:,.0f} tokens/s",
    ]
    if s.get("train_loss_window"):
        w = s["train_loss_window"]
        which = "first/last step" if w == 1 else f"mean of first/last {w} steps"
        lines.append(f"train loss (weighted, {which}): {s['train_loss_first_window']:.4f} -> "
                     f"{s['train_loss_last_window']:.4f}")
    if s["final_eval_loss"] is not None:
        before = f"{s['initial_eval_loss']:.4f} -> " if s["initial_eval_loss"] is not None else ""
        lines.append(f"held-out loss (answer tokens): {before}{s['final_eval_loss']:.4f}")
    if s["step_token_max_over_mean"] is not None:
        lines.append(f"per-step tokens across ranks, max/mean: {s['step_token_max_over_mean']:.3f} "
                     f"(padded {s['step_padded_token_max_over_mean']:.3f})")
    lines.append(f"metrics: {out / METRICS}\nsummary: {out / SUMMARY}\ncurve:   {out / CURVE}\n"
                 f"ckpt:    {out / CKPT_DIR}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Demo
# ---------------------------------------------------------------------------------------------------


def train_demo(
    plan_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    nproc: int = 2,
    max_steps: int = 40,
    micro_batch_size: int = 8,
    lr: float = 1e-3,
    eval_every: int = 20,
    eval_max_examples: int | None = 128,
    seed: int = 0,
    progress: bool = True,
    extra_args: Sequence[str] = (),
) -> dict[str, Any]:
    """Train the demo model on the demo data with a plan made by ``clusterlm demo``; returns the summary.

    Args:
        plan_dir: the plan (made on the demo train split for ``nproc`` ranks).
        out_dir: output directory (an earlier run there is overwritten).
        nproc: processes (CPU ranks with gloo, or GPUs).
        max_steps / micro_batch_size / lr / eval_every / eval_max_examples / seed: trainer options.
        progress: progress bar.
        extra_args: further trainer arguments.

    Raises:
        RuntimeError: the training processes failed.
    """
    from clusterlm.demo import demo_data

    demo = demo_data()
    argv = ["--plan", str(plan_dir), "--model", "tiny-llama", "--data", str(demo.train), "--eval-data",
            str(demo.heldout), "--out", str(out_dir), "--max-steps", str(max_steps), "--micro-batch-size",
            str(micro_batch_size), "--lr", str(lr), "--warmup-steps", str(max(1, max_steps // 10)),
            "--eval-every", str(eval_every), "--seed", str(seed), "--overwrite", "--no-save-model"]
    if eval_max_examples is not None:
        argv += ["--eval-max-examples", str(eval_max_examples)]
    if not progress:
        argv.append("--no-progress")
    argv += list(extra_args)
    rc = launch(argv, nproc) if nproc > 1 else main(argv)
    if rc != 0:
        raise RuntimeError(f"train_demo: the trainer exited with status {rc} (its output is above).")
    return json.loads((Path(out_dir) / SUMMARY).read_text(encoding="utf-8"))


if __name__ == "__main__":
    sys.exit(main())
