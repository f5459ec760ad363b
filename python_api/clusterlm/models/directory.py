"""A model and its tokenizer written as a ``save_pretrained`` directory by the process that calls it, on any rank.

Once ``torch.distributed`` is initialised, transformers' ``save_pretrained`` writes the model's files only on rank 0
(``should_save_on_this_rank``): right for a checkpoint that every rank saves together, wrong for a directory that one
process builds for itself under a file lock, such as a built-in model or a converted GGUF file
(:func:`clusterlm.models.builtin.build_once`). Whichever rank takes that lock first builds; when that was rank 1 the
directory came out with the tokenizer and without ``config.json`` or weights, and every rank failed to load it
(``clusterlm train --nproc 2`` on a fresh cache of a busy machine: 3 runs of 12). :func:`save_model_dir` writes the
whole directory on the rank that calls it and checks that it did.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["save_model_dir"]


def save_model_dir(model: torch.nn.Module, tokenizer: Any, out_dir: str | os.PathLike[str]) -> None:
    """``model.save_pretrained(out_dir)`` and ``tokenizer.save_pretrained(out_dir)``, written by this process whatever
    its rank in an initialised process group.

    Args:
        model: a transformers ``PreTrainedModel`` (unsharded).
        tokenizer: its tokenizer (anything with ``save_pretrained``).
        out_dir: the directory to write (created if missing).

    Raises:
        RuntimeError: the directory lacks ``config.json`` or the weights afterwards (a transformers release that skips
            the write some other way): loading it would fail later with a less helpful message.
    """
    out = Path(out_dir)
    # this process's own directory, not a shard of a distributed checkpoint: write it here (an instance attribute,
    # so no other model and no other thread is affected; a transformers without the method ignores it)
    model.should_save_on_this_rank = lambda is_main_process=True: is_main_process
    try:
        model.save_pretrained(str(out))
    finally:
        del model.should_save_on_this_rank
    tokenizer.save_pretrained(str(out))
    if not (out / "config.json").is_file() or not any(out.glob("model*.safetensors")):
        raise RuntimeError(f"save_model_dir: transformers wrote no config.json or weights into {out} (files: "
                           f"{sorted(p.name for p in out.iterdir())}); this transformers release skips the write "
                           "on this process: build the model before torch.distributed.init_process_group.")
