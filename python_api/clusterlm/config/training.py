"""Every setting of a training run in one object: :class:`TrainConfig` (what ``clusterlm train`` takes).

``clusterlm train``'s options are generated from its fields (:mod:`clusterlm.cli.options`), a ``--config run.yaml``
holds the same names, and the resolved config is written to ``OUT/train_config.yaml`` (:meth:`TrainConfig.load`
reads it back). :meth:`TrainConfig.check` refuses what cannot train before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from clusterlm.config.base import Config, meta
from clusterlm.config.defaults import LATEST
from clusterlm.config.files import field_help
from clusterlm.config.readers import string_list_arg
from clusterlm.config.tasks import TaskConfig

__all__ = ["LATEST", "REPORT_INSTALL", "REPORT_TO", "TRAIN_CONFIG", "TrainConfig", "WEIGHT_DTYPE_RESOLUTION"]

TRAIN_CONFIG = "train_config.yaml"  # the resolved config, next to the run's outputs
REPORT_TO = ("none", "tensorboard", "wandb")
# report_to -> (the module it needs, what installs it)
REPORT_INSTALL = {
    "tensorboard": ("tensorboard", "pip install tensorboard  (or: pip install 'cluster-kernels[tensorboard]')"),
    "wandb": ("wandb", "pip install wandb  (or: pip install 'cluster-kernels[wandb]')"),
}
# Half the relative spacing of representable values: smaller relative updates round to no change.
WEIGHT_DTYPE_RESOLUTION = {"bfloat16": "2^-8 (0.4 %)", "float16": "2^-11 (0.05 %)"}

# The --help sections of the options
WHAT, PROC, SCHED, MODEL, LOG = ("what to train", "processes", "schedule", "model", "evaluation, checkpoints, logging")
# Ranges of numeric settings (low, high, low allowed, high allowed), checked by TrainConfig.check
POSITIVE = (0.0, math.inf, False, False)
NON_NEGATIVE = (0.0, math.inf, True, False)
FRACTION = (0.0, 1.0, True, False)
CLOSED_FRACTION = (0.0, 1.0, True, True)


@dataclass(frozen=True)
class TrainConfig(Config):
    """Every setting of ``clusterlm train`` (:func:`clusterlm.train`); the command-line options are these fields.

    Attributes:
        plan: plan directory (clusterlm select), or a baseline: 'full', 'random:<ratio>' (random:0.31),
            'random:<count>'.
        model: built-in name (tiny-llama, tiny-llama-pretrained, smollm2-135m-instruct), a .gguf file, or a local
            HF model directory.
        data: training data the plan was made for (.jsonl/.json/.parquet).
        out: output directory (metrics, checkpoints, summary, model, train_config.yaml).
        allow_other_model: train even when the plan was selected with another model (its model id differs).
        eval_data: held-out data; its answer-token loss is reported.
        chat_template: render prompt/response data through the tokenizer's chat template (auto: when it has one;
            must match the plan's selection).
        max_length: truncate examples to this many tokens (default: the plan's, else 1024).
        nproc: processes on this node; > 1 spawns torch.distributed.run (default 1; ignored under torchrun).
        nnodes: nodes (with rdzv_endpoint).
        rdzv_endpoint: host:port of the rendezvous for nnodes > 1.
        rdzv_id: rendezvous id shared by the nodes of one run.
        device: auto (CUDA when present), cpu or cuda.
        threads: torch CPU threads per rank (default 1 on CPU: deterministic and no oversubscription).
        max_restarts: after a rank fails, restart every rank up to N times, each continuing from the latest
            complete checkpoint (torchrun's elastic agent; set save_every so that there is one).
        dist_timeout: seconds a collective may wait for the other ranks; then the run fails, naming the rank that is
            behind and the operation (default: torch's 30 minutes).
        preemption_grace: seconds the ranks get after SIGTERM or SIGUSR1 to finish the step and checkpoint it
            before they are killed (a second signal ends them at once).
        epochs: passes over each rank's plan list.
        max_steps: optimizer steps (overrides epochs).
        micro_batch_size: examples per rank and forward pass.
        grad_accum: micro-batches per optimizer step.
        lr: peak learning rate.
        lr_schedule: decay after the warm-up: cosine, linear or constant.
        warmup_steps: linear warm-up steps (overrides warmup_ratio).
        warmup_ratio: warm-up as a fraction of all steps.
        min_lr_ratio: final learning rate / peak.
        optimizer: adamw or adafactor.
        weight_decay: decoupled decay of matrices (not biases/norms).
        beta1: AdamW's first-moment decay.
        beta2: AdamW's second-moment decay.
        max_grad_norm: gradient clipping (0: off).
        seed: seeds the model's LoRA init, dropout and the per-epoch visit order.
        epoch_shuffle: reshuffle each rank's plan order every epoch (--no-epoch-shuffle: the plan order every epoch).
        bf16: bf16 autocast (auto: on CUDA).
        dtype: weights' dtype on the device (auto: float32 for full fine-tuning, a bfloat16 LoRA base on CUDA;
            compute precision is bf16; --model-dtype: older name).
        gradient_checkpointing: recompute activations in the backward pass (less memory, more time).
        fsdp: shard parameters, gradients and optimizer state over the ranks (FSDP2, one unit per decoder block;
            bf16 compute with float32 reduction when bf16 is on): for models whose DDP replica with its gradients
            and optimizer state does not fit one GPU.
        lora_r: LoRA rank (0: full fine-tuning).
        lora_alpha: LoRA alpha (default 2 * r).
        lora_dropout: dropout of the LoRA inputs.
        lora_targets: comma-separated module names for LoRA, or 'all-linear'.
        deterministic: torch.use_deterministic_algorithms (auto: on for CPU).
        eval_every: evaluate every N steps (0: only before the first and after the last step).
        initial_eval: evaluate before the first step (--no-initial-eval skips it, e.g. when it is known already).
        eval_batch_size: examples per evaluation forward.
        eval_max_examples: evaluate on the first N held-out examples only.
        save_every: checkpoint every N steps (0: only at the end).
        keep_checkpoints: checkpoints kept (the newest).
        resume: continue OUT's latest checkpoint (--resume alone), or the given .pt file.
        overwrite: start afresh in an OUT that holds an earlier run.
        save_model: write OUT/model at the end (--no-save-model: do not).
        log_every: a log line every N steps when there is no progress bar.
        progress: a progress bar (--no-progress: log lines instead).
        report_to: where rank 0 also logs the scalars of metrics.jsonl: none, tensorboard, wandb (comma-separated
            for several; OUT/tensorboard, or a W&B run named after OUT).
        tasks: task metrics after training (and before, with initial_task_eval): code pass@k and lm-eval tasks
            (:class:`clusterlm.config.tasks.TaskConfig`; its options sit beside these on the command line).
    """

    plan: str | None = field(default=None, metadata=meta(WHAT, per_run=True))
    model: str | None = field(default=None, metadata=meta(WHAT, per_run=True))
    data: str | None = field(default=None, metadata=meta(WHAT, per_run=True))
    out: str | None = field(default=None, metadata=meta(WHAT, per_run=True))
    allow_other_model: bool = field(default=False, metadata=meta(WHAT, per_run=True))
    eval_data: str | None = field(default=None, metadata=meta(WHAT, per_run=True))
    chat_template: Literal["auto", "on", "off"] = field(default="auto", metadata=meta(WHAT))
    max_length: int | None = field(default=None, metadata=meta(WHAT, low=1))
    nproc: int | None = field(default=None, metadata=meta(PROC, low=1, per_run=True))
    nnodes: int = field(default=1, metadata=meta(PROC, low=1, per_run=True))
    rdzv_endpoint: str | None = field(default=None, metadata=meta(PROC, per_run=True))
    rdzv_id: str = field(default="clusterlm", metadata=meta(PROC, per_run=True))
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata=meta(PROC))
    threads: int | None = field(default=None, metadata=meta(PROC, low=1))
    max_restarts: int = field(default=0, metadata=meta(PROC, low=0))
    dist_timeout: float | None = field(default=None, metadata=meta(PROC))
    preemption_grace: float = field(default=60.0, metadata=meta(PROC, bounds=NON_NEGATIVE))
    epochs: int = field(default=1, metadata=meta(SCHED, low=1))
    max_steps: int | None = field(default=None, metadata=meta(SCHED, low=1))
    micro_batch_size: int = field(default=4, metadata=meta(SCHED, low=1))
    grad_accum: int = field(default=1, metadata=meta(SCHED, low=1))
    lr: float = field(default=2e-5, metadata=meta(SCHED, bounds=POSITIVE))
    lr_schedule: Literal["cosine", "linear", "constant"] = field(default="cosine", metadata=meta(SCHED))
    warmup_steps: int | None = field(default=None, metadata=meta(SCHED, low=0))
    warmup_ratio: float = field(default=0.0, metadata=meta(SCHED, bounds=FRACTION))
    min_lr_ratio: float = field(default=0.0, metadata=meta(SCHED, bounds=CLOSED_FRACTION))
    optimizer: Literal["adamw", "adafactor"] = field(default="adamw", metadata=meta(SCHED))
    weight_decay: float = field(default=0.0, metadata=meta(SCHED, bounds=NON_NEGATIVE))
    beta1: float = field(default=0.9, metadata=meta(SCHED, bounds=FRACTION))
    beta2: float = field(default=0.999, metadata=meta(SCHED, bounds=FRACTION))
    max_grad_norm: float = field(default=1.0, metadata=meta(SCHED, bounds=NON_NEGATIVE))
    seed: int = field(default=0, metadata=meta(SCHED, low=0, per_run=True))
    epoch_shuffle: bool = field(default=True, metadata=meta(SCHED))
    bf16: Literal["auto", "on", "off"] = field(default="auto", metadata=meta(MODEL))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        default="auto", metadata=meta(MODEL, per_run=True, aliases=["--model-dtype"]))
    gradient_checkpointing: bool = field(default=False, metadata=meta(MODEL))
    fsdp: bool = field(default=False, metadata=meta(MODEL))
    lora_r: int = field(default=0, metadata=meta(MODEL, low=0))
    lora_alpha: float | None = field(default=None, metadata=meta(MODEL))
    lora_dropout: float = field(default=0.0, metadata=meta(MODEL, bounds=FRACTION))
    lora_targets: str = field(default="all-linear", metadata=meta(MODEL))
    deterministic: Literal["auto", "on", "off"] = field(default="auto", metadata=meta(MODEL))
    eval_every: int = field(default=0, metadata=meta(LOG, low=0))
    initial_eval: bool = field(default=True, metadata=meta(LOG, per_run=True))
    eval_batch_size: int = field(default=8, metadata=meta(LOG, low=1))
    eval_max_examples: int | None = field(default=None, metadata=meta(LOG, low=1))
    save_every: int = field(default=0, metadata=meta(LOG, low=0))
    keep_checkpoints: int = field(default=2, metadata=meta(LOG, low=1, per_run=True))
    resume: str | None = field(
        default=None, metadata=meta(LOG, per_run=True, nargs="?", const=LATEST, metavar="CHECKPOINT"))
    overwrite: bool = field(default=False, metadata=meta(LOG, per_run=True))
    save_model: bool = field(default=True, metadata=meta(LOG, per_run=True))
    log_every: int = field(default=10, metadata=meta(LOG, low=1))
    progress: bool = field(default=True, metadata=meta(LOG))
    report_to: tuple[str, ...] = field(
        default=(), metadata=meta(LOG, metavar="none|tensorboard|wandb", parse=string_list_arg))
    tasks: TaskConfig = field(default_factory=TaskConfig, metadata={"cli": False})

    COMMAND: ClassVar[str] = "train"

    def __post_init__(self) -> None:
        # A list (from YAML or Python) becomes a tuple, a comma string a tuple: the config stays hashable and frozen.
        if isinstance(self.report_to, (str, list)):
            object.__setattr__(self, "report_to", string_list_arg(self.report_to))
        if isinstance(self.tasks, dict):  # a config file's or a caller's mapping of task settings
            object.__setattr__(self, "tasks", TaskConfig.from_dict(self.tasks, "TrainConfig.tasks"))

    # -- checks --------------------------------------------------------------------------------------------

    def check(self) -> None:
        """Refuse settings that cannot train (or not well); runs before anything is loaded.

        Raises:
            ValueError: a missing plan/model/data/out, a number out of range (lr not > 0, a ratio outside [0, 1),
                a beta outside [0, 1), negative decay or clipping, lora_alpha not > 0, ...), LoRA without target
                modules, an unknown report_to, dtype bfloat16/float16 without LoRA (full fine-tuning of
                low-precision weights), fsdp with fewer than 2 processes.
            TypeError: a setting of the wrong type.
            ImportError: report_to names a package that is not installed (the message names its install).
        """
        missing = [f"--{n.replace('_', '-')}" for n in ("plan", "model", "data", "out") if getattr(self, n) is None]
        if missing:
            raise ValueError(f"train: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required (an option, "
                             "or a field of the --config file).")
        self._check_types()
        helps = field_help(TrainConfig)
        for f in dataclasses.fields(self):
            if "bounds" not in f.metadata:
                continue
            name, value, (low, high, low_ok, high_ok) = f.name, getattr(self, f.name), f.metadata["bounds"]
            what = helps.get(name, name).rstrip(".")
            inside = (value >= low if low_ok else value > low) and (value <= high if high_ok else value < high)
            if not (math.isfinite(value) and inside):
                bounds = [f"{'>=' if low_ok else '>'} {low:g}", "finite" if math.isinf(high) else
                          f"{'<=' if high_ok else '<'} {high:g}"]
                raise ValueError(f"train: --{name.replace('_', '-')} {value!r} is out of range: it must be "
                                 f"{' and '.join(bounds)} ({what}).")
        if self.dist_timeout is not None and not (isinstance(self.dist_timeout, (int, float))
                                                  and math.isfinite(self.dist_timeout) and self.dist_timeout > 0):
            raise ValueError(f"train: --dist-timeout {self.dist_timeout!r} is out of range: it must be > 0 seconds "
                             "(or unset: torch's default of 30 minutes).")
        self._check_lora()
        self._check_report_to()
        self._check_fsdp()
        if not isinstance(self.tasks, TaskConfig):
            raise TypeError(f"train: tasks must be a TaskConfig (or a mapping of its settings), got "
                            f"{type(self.tasks).__name__}.")
        self.tasks.check()
        if self.tasks.eval_task and self.fsdp:
            raise ValueError("train: --eval-task generates with the whole model on rank 0, which --fsdp shards over "
                             "the ranks; evaluate the saved model (OUT/model) in a separate run, or train without "
                             "--fsdp.")
        if self.dtype in WEIGHT_DTYPE_RESOLUTION and not self.lora_r:
            raise ValueError(
                f"train: --dtype {self.dtype} without LoRA trains the weights themselves in {self.dtype}, where an "
                f"update smaller than about {WEIGHT_DTYPE_RESOLUTION[self.dtype]} of a weight rounds away, as most "
                "AdamW steps at fine-tuning learning rates do, so the model barely learns; use --dtype float32 (or "
                f"auto) with --bf16 on (bf16 autocast over float32 weights), or a LoRA run on the {self.dtype} base "
                "(--lora-r 16)."
            )

    def _check_types(self) -> None:
        for f in dataclasses.fields(self):
            if "low" not in f.metadata:
                continue
            name, low, value = f.name, f.metadata["low"], getattr(self, f.name)
            if value is None and f.default is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"train: {name} must be an int >= {low}, got {value!r}.")
            if value < low:
                raise ValueError(f"train: --{name.replace('_', '-')} {value!r} is out of range: it must be an int "
                                 f">= {low}.")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if "bounds" in f.metadata and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise TypeError(f"train: {f.name} must be a number, got {value!r}.")

    def _check_report_to(self) -> None:
        bad = [r for r in self.report_to if r not in REPORT_TO]
        if bad or ("none" in self.report_to and len(self.report_to) > 1):
            raise ValueError(f"train: --report-to {','.join(self.report_to)}: expected none, or one or more of "
                             "tensorboard, wandb (comma-separated).")
        for name in self.report_to:
            if name in REPORT_INSTALL and importlib.util.find_spec(REPORT_INSTALL[name][0]) is None:
                raise ImportError(f"train: --report-to {name} needs the {REPORT_INSTALL[name][0]} package, which is "
                                  f"not installed; install it with: {REPORT_INSTALL[name][1]}")

    def _check_fsdp(self) -> None:
        # under torchrun the processes are torchrun's (WORLD_SIZE); otherwise the ones this run starts
        world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else (self.nproc or 1) * self.nnodes
        if self.fsdp and world < 2:
            raise ValueError("train: --fsdp shards the model over the ranks and needs at least 2 processes (--nproc "
                             "2, or torchrun); one process trains the whole model anyway: drop --fsdp.")

    def _check_lora(self) -> None:
        if not self.lora_r:
            return
        alpha = self.lora_alpha
        if alpha is not None and not (math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"train: --lora-alpha {alpha!r} is out of range: it must be > 0 and finite (the LoRA "
                             "scale is alpha / r; the default is 2 * r).")
        targets = self.lora_targets
        if targets != "all-linear" and not [t for t in str(targets).split(",") if t.strip()]:
            raise ValueError(f"train: --lora-targets {targets!r} names no module; give comma-separated module names "
                             "(q_proj,v_proj) or all-linear.")
