"""Text records to tokens: prompt/response pairs, chat templates, and which tokens are trained.

:func:`tokenize_text` tokenises the text records of a :class:`~clusterlm.data.formats.RawData` (the rendering and
tokenisation rules are in the :mod:`clusterlm.data` docstring): prompt and response separately and concatenated, or
conversations rendered through the tokenizer's chat template and cut into segments at the assistant turns, only the
answer segments trained. Calls to the tokenizer are batched.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cluster_kernels.lm_head_features import IGNORE_INDEX
from clusterlm.data.formats import RawData, is_conversational, source_line

__all__ = ["tokenize_text"]

_CHUNK = 1024  # texts per tokenizer call: large enough to batch well, small enough for a smooth progress bar
_PROGRESS_MIN = 2000  # no bar below this many examples (it would only flicker)


def tokenize_text(
    raw: RawData, tokenizer: Any, chat_template: bool | None, progress: bool
) -> tuple[list[np.ndarray], list[np.ndarray], bool]:
    """Tokenise text records; returns ``(input_ids, labels, rendered through the template)``."""
    columns, fmt, where = raw.columns, raw.format, raw.description
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if chat_template not in (None, True, False):
        raise TypeError(f"load_data: chat_template must be None, True or False, got {chat_template!r}.")
    if chat_template is True and not has_template:
        raise ValueError(
            "load_data: chat_template=True, but the tokenizer has no chat template. Set "
            "tokenizer.chat_template, or pass chat_template=False (plain prompt + response)."
        )
    conversational = fmt == "chat" or (fmt == "prompt-completion" and is_conversational(columns["prompt"]))
    use_template = conversational or (has_template if chat_template is None else chat_template)
    bar = _progress(len(raw), progress)
    try:
        if fmt == "chat":
            return (*_tokenize_chat(columns["messages"], tokenizer, bar, where=where), True)
        if conversational:  # TRL's conversational prompt/completion: only the completion's turns are trained
            conversations, starts = [], []
            for i, (p, c) in enumerate(zip(columns["prompt"], columns["completion"], strict=True)):
                if not isinstance(p, (list, tuple)) or not isinstance(c, (list, tuple)):
                    raise TypeError(
                        f"load_data: example {i}: conversational 'prompt'/'completion' must both be lists of "
                        f"{{'role', 'content'}} messages, got {type(p).__name__} and {type(c).__name__} "
                        f"({source_line(where, i)})."
                    )
                conversations.append([*p, *c])
                starts.append(len(p))
            return (*_tokenize_chat(conversations, tokenizer, bar, starts, where=where), True)
        prompts, responses = _prompts_responses(columns, fmt, where)
        if use_template:
            conversations = [[{"role": "user", "content": p}, {"role": "assistant", "content": r}]
                             for p, r in zip(prompts, responses, strict=True)]
            return (*_tokenize_chat(conversations, tokenizer, bar, where=where), True)
        return (*_tokenize_pairs(prompts, responses, tokenizer, bar), False)
    finally:
        bar.close()


def _progress(total: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=total, unit="ex", desc="tokenize", disable=not enabled or total < _PROGRESS_MIN, dynamic_ncols=True
    )


def _text(value: Any, column: str, index: int, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(
            f"load_data: example {index}: {column!r} must be a string, got {type(value).__name__} "
            f"({source_line(where, index)})."
        )
    return value


def _prompts_responses(columns: Mapping[str, list[Any]], fmt: str, where: str) -> tuple[list[str], list[str]]:
    if fmt in ("prompt-response", "prompt-completion"):
        answer = "response" if fmt == "prompt-response" else "completion"
        prompts = [_text(v, "prompt", i, where) for i, v in enumerate(columns["prompt"])]
        responses = [_text(v, answer, i, where) for i, v in enumerate(columns[answer])]
        return prompts, responses
    inputs = columns.get("input") or [None] * len(columns["instruction"])
    prompts = []
    for i, (instruction, extra) in enumerate(zip(columns["instruction"], inputs, strict=True)):
        instruction = _text(instruction, "instruction", i, where)
        extra = "" if extra is None else _text(extra, "input", i, where)
        prompts.append(instruction + "\n\n" + extra if extra.strip() else instruction)
    responses = [_text(v, "output", i, where) for i, v in enumerate(columns["output"])]
    return prompts, responses


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    out = tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    return [list(x) for x in out]


def _special_id(tokenizer: Any, name: str) -> list[int]:
    value = getattr(tokenizer, f"{name}_token_id", None)
    return [] if value is None else [int(value)]


def _tokenize_pairs(
    prompts: list[str], responses: list[str], tokenizer: Any, bar: Any
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    bos, eos = _special_id(tokenizer, "bos"), _special_id(tokenizer, "eos")
    input_ids, labels = [], []
    for start in range(0, len(prompts), _CHUNK):
        p_ids = _encode(tokenizer, prompts[start : start + _CHUNK])
        r_ids = _encode(tokenizer, responses[start : start + _CHUNK])
        for p, r in zip(p_ids, r_ids, strict=True):
            head = bos + p
            answer = r + eos
            input_ids.append(np.asarray(head + answer, dtype=np.int64))
            labels.append(np.asarray([IGNORE_INDEX] * len(head) + answer, dtype=np.int64))
        bar.update(len(p_ids))
    return input_ids, labels


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert isinstance(text, str), type(text)
    return text


def _chat_segments(tokenizer: Any, messages: Any, index: int, trained_from: int = 0,
                   where: str = "") -> list[tuple[str, bool]]:
    """The rendered conversation cut into ``(text, is_answer)`` segments at assistant-turn boundaries; assistant
    turns before message ``trained_from`` are not answers."""
    if not isinstance(messages, (list, tuple)) or not all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise TypeError(
            f"load_data: example {index}: 'messages' must be a list of {{'role': str, 'content': str}} dicts, "
            f"got {json.dumps(messages, default=str)[:200]} ({source_line(where, index)})."
        )
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    full = _render(tokenizer, messages, False)
    segments: list[tuple[str, bool]] = []
    pos = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < trained_from:
            continue
        before = _render(tokenizer, messages[:i], True)
        upto = _render(tokenizer, messages[: i + 1], False)
        if not (upto.startswith(before) and full.startswith(upto) and len(before) >= pos):
            raise ValueError(
                f"load_data: example {index}: the tokenizer's chat template does not render conversations "
                "prefix-consistently (the text of the first turns changes when later turns are added), so the "
                "assistant tokens cannot be located exactly. Use a template without such special cases, or "
                "convert the data to prompt/response."
            )
        segments.append((full[pos : len(before)], False))
        segments.append((upto[len(before) :], True))
        pos = len(upto)
    segments.append((full[pos:], False))
    return [(text, answer) for text, answer in segments if text]


def _tokenize_chat(
    conversations: list[Any], tokenizer: Any, bar: Any, trained_from: Sequence[int] | None = None, *, where: str = ""
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "load_data: chat data ('messages') needs a tokenizer with a chat_template; this tokenizer has none. "
            "Set tokenizer.chat_template, or convert the data to 'prompt'/'response' records."
        )
    input_ids, labels = [], []
    for start in range(0, len(conversations), _CHUNK):
        chunk = [_chat_segments(tokenizer, m, start + j, trained_from[start + j] if trained_from else 0, where)
                 for j, m in enumerate(conversations[start : start + _CHUNK])]
        flat = _encode(tokenizer, [text for segments in chunk for text, _ in segments])
        k = 0
        for segments in chunk:
            ids: list[int] = []
            lab: list[int] = []
            for _, is_answer in segments:
                ids += flat[k]
                lab += flat[k] if is_answer else [IGNORE_INDEX] * len(flat[k])
                k += 1
            input_ids.append(np.asarray(ids, dtype=np.int64))
            labels.append(np.asarray(lab, dtype=np.int64))
        bar.update(len(chunk))
    return input_ids, labels
