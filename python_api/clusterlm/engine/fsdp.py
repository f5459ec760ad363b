"""FSDP2 for the reference trainer: sharding, precision, sharded checkpoints and the full model at the end.

``clusterlm train --fsdp`` shards the model with ``torch.distributed.fsdp.fully_shard`` (FSDP2): one unit per
decoder block (the modules whose classes the model's ``_no_split_modules`` attribute names, e.g.
``LlamaDecoderLayer``), then the root (embeddings, final norm, LM head). Every rank keeps ``1/K`` of every
parameter, gradient and optimizer state; a block's parameters are all-gathered for its forward and again for
its backward, and its gradients are reduce-scattered (averaged over the ranks, as DDP's all-reduce) after each
micro-batch's backward, so the gradients stay sharded through gradient accumulation. The training step is
:mod:`clusterlm.engine.step`'s, unchanged: each rank's loss is ``mean_b(w_b * loss_b)`` over its plan list, and the
sharded gradient is ``sum_k (n_k / N) g_k``, as under DDP.

Precision (:func:`shard_model`): with bf16 (``--bf16 on``, or ``auto`` on a CUDA GPU with bf16) the
mixed-precision policy all-gathers and computes in bfloat16 and reduce-scatters gradients in float32 (the sharded
master weights and optimizer state stay float32); without it everything is float32 (CPU by default).

Checkpoints (:func:`write_sharded_checkpoint`, :func:`load_sharded_checkpoint`): a directory ``step_<step>/``
holding ``torch.distributed.checkpoint`` shards of the model and optimizer (every rank writes its own) and
:data:`STATE_FILE` (rank 0: step, sampler, scheduler, generator states of every rank, metrics). It is written as
``.step_<step>.partial/`` and renamed into place by rank 0 once every rank's shards and the state file are
there, so a killed run leaves either the whole checkpoint or none. With LoRA only the trainable parameters are
saved. :func:`save_full_model` gathers the full state to rank 0 and writes a normal Hugging Face directory.

Adafactor: ``torch.optim.Adafactor`` updates its factored statistics in place, which sharded (DTensor) gradients
do not allow; :class:`ShardedAdafactor` is the same algorithm with out-of-place reductions (equal to it on plain
tensors, bit for bit), used when the parameters are sharded.

Imports: torch's FSDP2, distributed-checkpoint and DTensor modules are imported by the functions that use them, not
with this module: they cost about 0.7 s of CPU (sympy with them; ``import clusterlm.cli.commands`` 3.1 -> 2.4 CPU-s),
which
every process importing the package paid (the CLI, ``clusterlm --help``, a launcher); :func:`is_dtensor` and
:func:`is_sharded` answer without them.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

from clusterlm.fileio import atomic_write, fsync_dir, storage_errors
from clusterlm.launch.launcher import DistInfo, barrier

__all__ = [
    "BLOCKS_ATTRIBUTE", "CPU_ALLOCATOR_ENV", "PARTIAL_SUFFIX", "STATE_FILE", "ShardedAdafactor", "check_blocks",
    "checkpoint_kind", "decoder_blocks", "full_state_dict", "is_sharded", "load_sharded_checkpoint",
    "remove_partial_checkpoints", "save_full_model", "shard_model", "unsharded_copy", "write_sharded_checkpoint",
]

# The model attribute naming the classes of its decoder blocks (Hugging Face: e.g. {"LlamaDecoderLayer"}).
BLOCKS_ATTRIBUTE = "_no_split_modules"
# In a sharded checkpoint directory: what rank 0 saves besides the shards.
STATE_FILE = "trainer_state.pt"
# A sharded checkpoint being written: ``.step_0000040.partial``.
PARTIAL_SUFFIX = ".partial"
# Environment of CPU ranks (glibc): every allocation of 1 MiB or more is its own mapping, returned to the system when
# freed. FSDP all-gathers a block's parameters and frees them again, block after block; with glibc's default (a
# threshold that rises to the largest block freed) those buffers come from the heap, which then keeps them: a rank of
# SmolLM2-135M on 2 ranks peaked at 3.5 GB instead of 2.1 GB, no less than under DDP.
CPU_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


# ---------------------------------------------------------------------------------------------------
# Blocks and sharding
# ---------------------------------------------------------------------------------------------------


def _plain(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (PeftModel -> LoraModel -> model)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _block_classes(model: torch.nn.Module) -> list[str]:
    names = getattr(_plain(model), BLOCKS_ATTRIBUTE, None)
    if isinstance(names, str):
        return [names]
    return sorted(str(n) for n in names) if names else []


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder blocks of ``model`` (a block nested in another is not listed), in module order.

    Blocks are the modules whose class names the model's :data:`BLOCKS_ATTRIBUTE` (``_no_split_modules``)
    lists; a PEFT model is looked through to its base model.

    Raises:
        ValueError: the attribute is missing or empty, or names no module of the model (the message names the
            attribute, its value and the model class).
    """
    classes = set(_block_classes(model))
    blocks: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or module is model:
            continue
        if type(module).__name__ in classes:
            blocks.append(module)
            inside.update(id(m) for m in module.modules())
    if not blocks:
        kind = type(_plain(model)).__name__
        found = f"it lists {sorted(classes)}, and no module of the model has such a class" if classes else (
            "it has none" if getattr(_plain(model), BLOCKS_ATTRIBUTE, None) is None else "it is empty")
        raise ValueError(
            f"train: --fsdp shards one unit per decoder block, found through the model's {BLOCKS_ATTRIBUTE} "
            f"attribute (the block classes), but for {kind} {found}; train this model without --fsdp, or give its "
            f"class {BLOCKS_ATTRIBUTE} = ['<DecoderLayerClass>']."
        )
    return blocks


def check_blocks(spec: str) -> None:
    """Refuse ``--fsdp`` for a model whose decoder blocks cannot be found, before its weights load.

    The model is built from its ``config.json`` (a local directory or a cached hub id) on the meta device (no
    memory, no weights) and searched as :func:`decoder_blocks` searches the loaded one. A spec without a readable
    config (a built-in name, a GGUF file: Llama models) is left to ``load_model``.

    Raises:
        ValueError: from :func:`decoder_blocks`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    name = os.fspath(spec)
    if name.lower().endswith(".gguf"):
        return
    try:
        config = AutoConfig.from_pretrained(name, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError, TypeError, ImportError):
        return
    decoder_blocks(model)


def shard_model(model: torch.nn.Module, di: DistInfo, *, bf16: bool) -> torch.nn.Module:
    """``fully_shard`` every decoder block, then the root, over all ranks; the model (now an ``FSDPModule``).

    The parameters move to ``di.device`` as they are sharded (a block at a time), so a model loaded on the
    CPU never sits whole on the GPU.

    Args:
        model: the loaded model (PEFT adapters added, gradient checkpointing set), on the CPU or ``di.device``.
        di: this rank's place; needs a process group.
        bf16: bfloat16 parameters and compute with float32 gradient reduction; False: float32 throughout.

    Raises:
        ValueError: no process group (one process), or no decoder blocks (:func:`decoder_blocks`).
    """
    if not di.distributed:
        raise ValueError("train: --fsdp shards the model over the ranks and needs at least 2 processes (--nproc 2, "
                         "or torchrun); one process trains the whole model anyway: drop --fsdp.")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    blocks = decoder_blocks(model)
    mesh = init_device_mesh(di.device.type, (di.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else (
        MixedPrecisionPolicy())
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    """True when ``model`` or a submodule of it is FSDP2-sharded (``fully_shard``); imports no FSDP module (before
    torch's FSDP2 is imported, nothing can be sharded)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules())


def is_dtensor(value: Any) -> bool:
    """True when ``value`` is a ``DTensor`` (a sharded parameter, gradient or norm of an FSDP2 model); imports no
    DTensor module (before torch's DTensor is imported, no tensor can be one)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(value, dtensor.DTensor)


# ---------------------------------------------------------------------------------------------------
# Adafactor on sharded parameters
# ---------------------------------------------------------------------------------------------------


class ShardedAdafactor(torch.optim.Adafactor):
    """``torch.optim.Adafactor`` (same arguments, state and state dict) that also steps sharded (DTensor) parameters.

    The update is torch's single-tensor Adafactor written with out-of-place reductions: the row and column
    statistics of a sharded matrix need a reduction across ranks, which DTensor does only out of place. On
    plain tensors the result equals ``torch.optim.Adafactor``'s bit for bit.
    """

    @staticmethod
    def _state(state: dict[str, Any], grad: torch.Tensor) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        if grad.dim() > 1:
            state["row_var"] = grad.new_zeros([*grad.shape[:-1], 1])
            state["col_var"] = grad.new_zeros([*grad.shape[:-2], 1, grad.shape[-1]])
        else:
            state["variance"] = torch.zeros_like(grad, memory_format=torch.preserve_format)

    @staticmethod
    def _number(x: torch.Tensor) -> float:
        return float((x.full_tensor() if is_dtensor(x) else x).item())

    def _update(self, p: torch.nn.Parameter, group: dict[str, Any]) -> None:
        grad = -p.grad if group["maximize"] else p.grad
        state = self.state[p]
        if not state:
            self._state(state, grad)
        lr = float(group["lr"])
        eps1 = group["eps"][0] if group["eps"][0] is not None else torch.finfo(p.dtype).eps
        state["step"] += 1
        step = float(state["step"].item())
        decay = step ** group["beta2_decay"]
        # the same float expressions as torch's Adafactor, for equal results
        alpha = max(group["eps"][1], self._number(p.norm(2)) / (p.numel() ** 0.5)) * min(lr, 1 / (step**0.5))
        if group["weight_decay"] != 0:
            p.mul_(1 - lr * group["weight_decay"])
        if grad.dim() > 1:
            state["row_var"].lerp_(torch.norm(grad, dim=-1, keepdim=True).square() / grad.size(-1), decay)
            state["col_var"].lerp_(torch.norm(grad, dim=-2, keepdim=True).square() / grad.size(-2), decay)
            var = (state["row_var"] @ state["col_var"]) / state["row_var"].mean(dim=-2, keepdim=True).clamp(min=eps1)
        else:
            state["variance"].lerp_(grad * grad, decay)
            var = state["variance"].clone()
        update = var.clamp(min=eps1 * eps1).rsqrt() * grad
        denom = max(1.0, self._number(update.norm(2)) / ((update.numel() ** 0.5) * group["d"]))
        p.add_(update, alpha=-alpha / denom)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Adafactor step over the parameters with gradients."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss


# ---------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------


def checkpoint_kind(path: str | os.PathLike) -> str:
    """``"fsdp"`` for a sharded checkpoint (a directory), ``"ddp"`` for a single file."""
    return "fsdp" if Path(path).is_dir() else "ddp"


def _state_options(only_trainable: bool) -> StateDictOptions:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # LoRA: the frozen base is neither saved nor expected back (it comes from --model)
    return StateDictOptions(ignore_frozen_params=only_trainable, strict=not only_trainable)


def write_sharded_checkpoint(target: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             state: dict[str, Any] | None, only_trainable: bool, di: DistInfo) -> Path:
    """Write a sharded checkpoint directory ``target`` atomically; every rank calls it.

    Args:
        target: ``.../ckpt/step_<step>`` (must not be a file).
        model / optimizer: the sharded model and its optimizer.
        state: the trainer state rank 0 saves beside the shards (:data:`STATE_FILE`); ignored elsewhere.
        only_trainable: save only the trainable parameters (LoRA: the adapters).
        di: this rank's place.

    Raises:
        StorageError: the disk filled (or a quota, an I/O error); the partial directory is removed, ``target``
            and the checkpoints before it are untouched.
    """
    partial = target.parent / f".{target.name}{PARTIAL_SUFFIX}"
    if di.is_main:
        with storage_errors(partial):
            shutil.rmtree(partial, ignore_errors=True)  # what a killed run left
            partial.mkdir(parents=True)
    barrier()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_state_options(only_trainable))
    try:
        with storage_errors(partial):
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(partial))
        if di.is_main:
            atomic_write(partial / STATE_FILE, lambda f: torch.save(state, f))
            with storage_errors(target):
                if target.exists():  # an earlier run's checkpoint of this step; `latest` names an older one
                    shutil.rmtree(target)
                os.replace(partial, target)
                fsync_dir(target.parent)
    except BaseException:
        if di.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    return target


def load_sharded_checkpoint(path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            only_trainable: bool) -> None:
    """Load the shards of checkpoint directory ``path`` into ``model`` and ``optimizer``; every rank calls it.

    Raises:
        ValueError: the checkpoint lacks parameters of this model (other ``--model`` / ``--lora-*``).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    options = _state_options(only_trainable)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    try:
        dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(path))
    except (RuntimeError, KeyError) as err:
        line = " ".join(str(err).split())[:300]
        raise ValueError(f"train: cannot resume {path}: its shards do not fit this model and optimizer ({line}); "
                         "resume with the same --model, --lora-* and --optimizer.") from None
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=options)


def remove_partial_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Remove the ``.step_*.partial`` directories killed runs left in ``ckpt_dir`` (call it holding the lock)."""
    removed = []
    for p in sorted(ckpt_dir.glob(f".step_*{PARTIAL_SUFFIX}")) if ckpt_dir.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


# ---------------------------------------------------------------------------------------------------
# The full model
# ---------------------------------------------------------------------------------------------------


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on rank 0's CPU (empty on the other ranks); every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_full_model(model: torch.nn.Module, tokenizer: Any, out_dir: Path, di: DistInfo) -> None:
    """Gather the full weights to rank 0, which writes a Hugging Face directory (``save_pretrained``: the
    whole model, or the adapter with LoRA) and the tokenizer; every rank calls it.

    Raises:
        StorageError: the disk filled while writing (named).
    """
    state = full_state_dict(model)
    if di.is_main:
        with storage_errors(out_dir):
            model.save_pretrained(out_dir, state_dict=state)
            tokenizer.save_pretrained(out_dir)
    barrier()


def _unwrapped_class(model: torch.nn.Module) -> type:
    """The model's class before ``fully_shard`` (which subclasses it as ``FSDP<Class>``)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def unsharded_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain (unsharded) replica of a sharded Hugging Face model on the CPU of every rank; every rank calls it.

    The parameters are gathered one at a time (``full_tensor``) and moved to the CPU, so a GPU holds at most one
    whole parameter more than its shards. Used to select at train begin on the full model when the trainer's model
    is already sharded.

    Raises:
        TypeError: ``model`` is not a transformers ``PreTrainedModel`` (e.g. a sharded PEFT model): select
            before sharding it instead.
    """
    from transformers import PreTrainedModel

    cls = _unwrapped_class(model)
    if not issubclass(cls, PreTrainedModel):
        raise TypeError(f"cannot build an unsharded copy of a sharded {cls.__name__}: select the plan on the model "
                        "before it is sharded (clusterlm.select), and pass plan=.")
    state = {name: (t.full_tensor() if is_dtensor(t) else t).detach().to("cpu", copy=True)
             for name, t in model.state_dict().items()}
    with torch.device("meta"):
        copy = cls(model.config)
    copy.load_state_dict(state, strict=False, assign=True)
    for name, buffer in model.named_buffers():  # buffers are not sharded (and non-persistent ones not saved)
        owner, _, leaf = name.rpartition(".")
        setattr(copy.get_submodule(owner), leaf, buffer.detach().to("cpu", copy=True))
    if callable(getattr(copy, "tie_weights", None)):
        copy.tie_weights()
    missing = [n for n, p in _named_tensors(copy) if p.is_meta]
    if missing:
        raise TypeError(f"cannot build an unsharded copy of the sharded {cls.__name__}: the gathered state lacks "
                        f"{missing[:3]}; select the plan on the model before it is sharded, and pass plan=.")
    copy.train(model.training)
    return copy


def _named_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()
