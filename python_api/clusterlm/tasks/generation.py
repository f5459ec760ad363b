"""Completions of prompts by the model in memory: :func:`generate`, and the text rules around it.

* Prompts are rendered as training renders prompt/response data (:mod:`clusterlm.data.tokens`): through the
  tokenizer's chat template as a user turn with the generation prompt when it has one (``chat_template=None``),
  else as ``bos + prompt``; the tokens of the rendered text are encoded without adding special tokens again.
* Generation is batched (prompts sorted by length, left-padded), KV-cached (``model.generate``), in eval mode
  without gradients, on the model's device with bf16 autocast on CUDA; greedy (``temperature == 0``) is
  deterministic, sampling draws from a generator seeded with ``seed`` and leaves the caller's random state as it
  was (:func:`preserved_rng`).
* Stop strings are searched in the generated text only (never in the prompt, nor across the boundary between
  the two); a row stops at its first stop string or end-of-sequence token, and the text is cut before the stop.
* :func:`extract_code` takes the code out of a chat-style answer (a fenced block).
"""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from clusterlm.engine.step import autocast

__all__ = ["GenerationSettings", "encode_prompt", "extract_code", "generate", "model_device", "preserved_rng",
           "truncate_at_stop", "uses_chat_template"]

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:\n[ \t]*```|\Z)", re.DOTALL)
_CODE_LANGUAGES = ("", "python", "py", "python3")


@dataclass(frozen=True)
class GenerationSettings:
    """How :func:`generate` completes prompts.

    Attributes:
        max_new_tokens: most tokens generated per prompt.
        temperature: 0: greedy; > 0: sampling at this temperature (no top-k or top-p cut).
        stop: stop strings, searched in the generated text only.
        batch_size: prompts per forward.
        seed: the sampling generator's seed.
        chat_template: render through the tokenizer's chat template (None: when it has one).
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    stop: tuple[str, ...] = ()
    batch_size: int = 8
    seed: int = 0
    chat_template: bool | None = None


def uses_chat_template(tokenizer: Any, chat_template: bool | None = None) -> bool:
    """Whether prompts go through the chat template (``None``: when the tokenizer has one).

    Raises:
        ValueError: ``chat_template=True`` and the tokenizer has none.
    """
    has = getattr(tokenizer, "chat_template", None) is not None
    if chat_template is True and not has:
        raise ValueError("generate: chat_template=True, but the tokenizer has no chat template.")
    return has if chat_template is None else bool(chat_template)


def encode_prompt(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    """The token ids of a prompt as training renders it (see the module docstring)."""
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    return ([] if bos is None else [int(bos)]) + list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def truncate_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` cut before the earliest stop string; ``(text, whether one was found)``."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


def extract_code(text: str) -> str | None:
    """The code of the first fenced block (```` ```python ```` or a bare fence; an unclosed last block counts) in
    a chat-style answer; None when there is none."""
    for match in _FENCE.finditer(text):
        if match.group(1).lower() in _CODE_LANGUAGES:
            return match.group(2)
    return None


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (the CPU for a model without parameters)."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


@contextlib.contextmanager
def preserved_rng(device: torch.device | None = None) -> Iterator[None]:
    """Leave Python's, NumPy's and torch's random states (CPU, and ``device`` if CUDA) as they were."""
    py_state, np_state = random.getstate(), np.random.get_state()
    devices = [device] if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    for value in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                  getattr(tokenizer, "eos_token_id", None)):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    return ids


class _StopOnText:
    """A ``StoppingCriteria``: a row is done when its generated text (after ``width`` prompt columns) holds a
    stop string."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], width: int) -> None:
        self.tokenizer, self.stops, self.width = tokenizer, [s for s in stops if s], width

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if self.stops:
            texts = self.tokenizer.batch_decode(input_ids[:, self.width :].tolist(), skip_special_tokens=True)
            done[:] = torch.tensor([truncate_at_stop(t, self.stops)[1] for t in texts], device=input_ids.device)
        return done


def _batch(ids: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, x in enumerate(ids):
        input_ids[row, width - len(x) :] = torch.tensor(x, dtype=torch.long)
        mask[row, width - len(x) :] = 1
    return input_ids.to(device), mask.to(device)


def _generate_batch(model: Any, tokenizer: Any, ids: list[list[int]], settings: GenerationSettings,
                    device: torch.device) -> list[str]:
    from transformers import GenerationConfig, StoppingCriteriaList

    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    input_ids, mask = _batch(ids, int(pad), device)
    sample = settings.temperature > 0
    config = GenerationConfig(max_new_tokens=settings.max_new_tokens, do_sample=sample, pad_token_id=int(pad),
                              eos_token_id=eos or None, use_cache=True,
                              **({"temperature": float(settings.temperature), "top_k": 0, "top_p": 1.0}
                                 if sample else {}))
    stop = _StopOnText(tokenizer, settings.stop, input_ids.shape[1])
    with autocast(device.type, torch.bfloat16 if device.type == "cuda" else None):
        out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config,
                             stopping_criteria=StoppingCriteriaList([stop]))
    new = out[:, input_ids.shape[1] :].tolist()
    texts = []
    for row in new:
        cut = next((i for i, t in enumerate(row) if t in eos), len(row))
        text = tokenizer.decode(row[:cut], skip_special_tokens=True)
        texts.append(truncate_at_stop(text, settings.stop)[0])
    return texts


def generate(model: Any, tokenizer: Any, prompts: Sequence[str], settings: GenerationSettings, *,
             device: torch.device | str | None = None, progress: bool = True, desc: str = "generate") -> list[str]:
    """One completion per prompt, in prompt order (see the module docstring).

    Args:
        model: a Hugging Face causal LM (its ``generate``); put in eval mode for the call, then restored.
        tokenizer: its tokenizer.
        prompts: the prompt texts.
        settings: :class:`GenerationSettings`.
        device: where the inputs go (default: the model's device).
        progress: a tqdm bar over the batches.
        desc: the bar's label.

    Returns:
        The generated texts, stop strings and end-of-sequence tokens cut off.
    """
    from tqdm.auto import tqdm

    device = model_device(model) if device is None else torch.device(device)
    chat = uses_chat_template(tokenizer, settings.chat_template)
    ids = [encode_prompt(tokenizer, p, chat) for p in prompts]
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))  # longest first: little padding per batch
    out: list[str | None] = [None] * len(ids)
    was_training = model.training
    model.eval()
    try:
        with preserved_rng(device), torch.inference_mode():
            torch.manual_seed(settings.seed)
            starts = range(0, len(order), settings.batch_size)
            for s in tqdm(starts, desc=desc, unit="batch", disable=not progress or len(starts) < 2, leave=False):
                rows = order[s : s + settings.batch_size]
                for i, text in zip(rows, _generate_batch(model, tokenizer, [ids[i] for i in rows], settings, device),
                                   strict=True):
                    out[i] = text
    finally:
        model.train(was_training)
    return [t or "" for t in out]
