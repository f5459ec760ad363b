"""``clusterlm compare``'s evaluation sets: ``--eval-data name=path`` (given once or more), content hashes, and the
check that no evaluation example is also a training example.

Names. ``--eval-data code=heldout.jsonl`` names a set ``code``; a bare path is named after its file stem (the
characters other than letters, digits, ``_`` and ``-`` become ``_``; ``eval`` when nothing is left), so
``--eval-data heldout.jsonl`` is the set ``heldout``. A name is letters, digits, ``_`` and ``-``, starting with a
letter or ``_``; names are distinct. The first set is the primary one (``eval_loss``, the verdicts, the frontier).

Overlap. Every example of every set is hashed from its *raw record's text fields, whitespace-normalised*
(:func:`example_hashes`): the turns of the conversation the record stands for (prompt/response, TRL's
prompt/completion, Alpaca's instruction + input / output and chat ``messages`` all become ``(role, text)`` turns,
so the same example written in two formats is caught), each text with its runs of whitespace collapsed to one
space and stripped. Raw text rather than the rendered tokens because it needs no tokenizer (the check runs before
any model loads) and because the rendered tokens of two copies that differ only in spacing differ, while the
example does not. Tokenised records (``input_ids`` / ``labels``) hash their ids: they only match tokenised
records. :func:`check_overlap` refuses a set that shares any example with the training data (one line: the set,
the count, the first positions), and LESS's validation examples (the primary set's last ``--n-validation``)
that are also evaluated examples of any set.

Evaluation. With several sets the trainer evaluates them together from one tokenised file (:func:`eval_layout`);
:func:`set_losses` splits a run's per-example losses back by set, :func:`on_set` shows records as if one set were
their only one (so compare's interval functions serve every set), :func:`eval_set_tables` prints a table per set.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from clusterlm.config.eval_sets import DEFAULT_SET_NAME, EvalSet, eval_sets_of, parse_eval_set
from clusterlm.data import RawData, load_data, read_data
from clusterlm.fileio import atomic_write_text

__all__ = ["DEFAULT_SET_NAME", "EvalSet", "check_overlap", "content_hash", "eval_layout", "eval_losses_file",
           "eval_set_tables", "eval_sets_of", "example_hashes", "kept_positions", "on_set", "parse_eval_set",
           "read_eval_sets", "set_losses", "without_examples"]

_SHOWN = 5  # positions named in an overlap error


def _norm(text: Any) -> str:
    if isinstance(text, str):
        return " ".join(text.split())
    return json.dumps(text, sort_keys=True, default=str)


def _turns(messages: Any) -> list[list[str]]:
    if not isinstance(messages, (list, tuple)):
        return [["?", _norm(messages)]]
    return [[_norm(m.get("role")), _norm(m.get("content"))] if isinstance(m, Mapping) else ["?", _norm(m)]
            for m in messages]


def _record_turns(raw: RawData, i: int) -> list[list[str]]:
    """Record ``i`` as whitespace-normalised ``[role, text]`` turns (tokenised records: their ids)."""
    c, fmt = raw.columns, raw.format
    if fmt == "tokenized":
        return [[col, _norm([int(t) for t in c[col][i]])] for col in ("input_ids", "labels")]
    if fmt == "chat":
        return _turns(c["messages"][i])
    if fmt == "alpaca":
        extra = (c.get("input") or [None] * len(raw))[i]
        prompt = c["instruction"][i]
        if isinstance(prompt, str) and isinstance(extra, str) and extra.strip():
            prompt = prompt + "\n\n" + extra
        return [["user", _norm(prompt)], ["assistant", _norm(c["output"][i])]]
    answer = c["response" if fmt == "prompt-response" else "completion"][i]
    prompt = c["prompt"][i]
    if isinstance(prompt, (list, tuple)):  # TRL's conversational prompt/completion
        return _turns(prompt) + _turns(answer)
    return [["user", _norm(prompt)], ["assistant", _norm(answer)]]


def example_hashes(raw: RawData) -> list[str]:
    """One sha256 per record of ``raw``: its turns' whitespace-normalised text (see the module docstring)."""
    return [hashlib.sha256(json.dumps(_record_turns(raw, i)).encode()).hexdigest() for i in range(len(raw))]


def content_hash(raw: RawData) -> str:
    """sha256 of the records exactly as read (every column, every character): what a compare record is keyed by."""
    return hashlib.sha256(json.dumps(raw.columns, sort_keys=True, default=str).encode()).hexdigest()


def kept_positions(raw: RawData) -> list[int]:
    """Positions of the records :func:`clusterlm.data.load_data` keeps (those with answer text), in order: example
    ``j`` of the loaded set is record ``kept_positions(raw)[j]``."""
    empty = set(raw.empty_answers)
    return [i for i in range(len(raw)) if i not in empty]


def _shown(positions: Sequence[int]) -> str:
    more = ", ..." if len(positions) > _SHOWN else ""
    return "example" + "s" * (len(positions) > 1) + " " + ", ".join(map(str, positions[:_SHOWN])) + more


def read_eval_sets(sets: Sequence[EvalSet], data: str, *, n_validation: int = 0,
                   eval_max_examples: int | None = None) -> list[tuple[EvalSet, RawData]]:
    """Every evaluation set's records (:func:`clusterlm.data.read_data`: no tokenizer, no model), checked: the
    validation tail fits the primary set, and no evaluation example is a training example of ``data`` nor one of
    the validation examples (:func:`check_overlap`).

    Raises:
        ValueError: ``n_validation`` outside ``[0, primary set's size)``, an overlap, or a set
            :func:`clusterlm.data.read_data` refuses.
    """
    out = [(s, read_data(s.path)) for s in sets]
    n_kept = len(kept_positions(out[0][1]))
    if n_validation < 0 or n_validation >= n_kept:
        raise ValueError(f"compare: --n-validation must be in [0, {n_kept}) (the eval data's size), got "
                         f"{n_validation}.")
    check_overlap(read_data(data), out, n_validation=n_validation, eval_max_examples=eval_max_examples)
    return out


def check_overlap(train: RawData, sets: Sequence[tuple[EvalSet, RawData]], *, n_validation: int = 0,
                  eval_max_examples: int | None = None) -> None:
    """Refuse evaluation examples that are also training examples, and validation examples that are evaluated.

    Args:
        train: the training records.
        sets: every evaluation set and its records, the primary first.
        n_validation: LESS's validation examples: the primary set's last ``n_validation`` kept examples.
        eval_max_examples: the evaluated examples of each set are its first ones, at most this many (the
            primary's after its validation tail is held back).

    Raises:
        ValueError: one line naming the set, the count of overlapping examples and their first positions
            (0-based records of the set's file).
    """
    seen = set(example_hashes(train))
    hashes = {}
    for s, raw in sets:
        hashes[s.name] = example_hashes(raw)
        shared = [i for i, h in enumerate(hashes[s.name]) if h in seen]
        if shared:
            raise ValueError(
                f"compare: evaluation set {s.name!r} ({s.path}) shares {len(shared)} of its {len(raw)} examples with "
                f"the training data ({train.description}): {_shown(shared)} (0-based; same text up to whitespace); "
                "remove them from one of the files, so no method is evaluated on examples it may train on.")
    if not n_validation or not sets:
        return
    primary, kept0 = sets[0][0], kept_positions(sets[0][1])
    tail = kept0[len(kept0) - n_validation:] if 0 < n_validation < len(kept0) else []
    validation = {hashes[primary.name][i] for i in tail}
    for k, (s, raw) in enumerate(sets):
        kept = kept0[: len(kept0) - n_validation] if k == 0 else kept_positions(raw)
        evaluated = kept[:eval_max_examples] if eval_max_examples else kept
        shared = [i for i in evaluated if hashes[s.name][i] in validation]
        if shared:
            raise ValueError(
                f"compare: {len(shared)} evaluated example(s) of set {s.name!r} ({s.path}) are also among LESS's "
                f"{n_validation} validation examples (the last of {primary.name!r}): {_shown(shared)} (0-based; "
                "same text up to whitespace); remove the copies or lower --n-validation.")


def eval_layout(sets: Sequence[EvalSet], tokenizer: Any, primary: Any, n_eval: int, work: Path, *,
                max_length: int | None, eval_max_examples: int | None,
                chat_template: bool | None) -> tuple[str | None, tuple[tuple[str, int, int], ...]]:
    """What the trainer evaluates, and ``(name, start, stop)`` of each set's examples in its per-example losses.

    One set: its own file (None). Several: the evaluated examples of every set (the primary's first ``n_eval`` from
    ``primary``, its loaded examples; each other set's first ``eval_max_examples``, all without it), tokenised as
    the trainer would (``max_length``, ``chat_template``: :func:`clusterlm.data.load_data`), one set after the
    other in ``work/eval_sets/<hash>.jsonl`` as ``input_ids`` / ``labels`` records: one evaluation per run gives
    every set's per-example losses.
    """
    if len(sets) < 2:
        return None, ((sets[0].name if sets else DEFAULT_SET_NAME, 0, n_eval),)
    parts = [[primary[i] for i in range(n_eval)]]
    for s in sets[1:]:
        ds = load_data(s.path, tokenizer, max_length=max_length, progress=False, chat_template=chat_template)
        parts.append([ds[i] for i in range(min(len(ds), eval_max_examples or len(ds)))])
    bounds = np.cumsum([0, *map(len, parts)])
    slices = tuple((s.name, int(bounds[i]), int(bounds[i + 1])) for i, s in enumerate(sets))
    text = "".join(json.dumps({"input_ids": np.asarray(ex["input_ids"]).tolist(),
                               "labels": np.asarray(ex["labels"]).tolist()}) + "\n" for part in parts for ex in part)
    path = work / "eval_sets" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)
    print(f"   evaluation sets: {', '.join(f'{n} ({b - a} examples)' for n, a, b in slices)}; primary {sets[0].name}; "
          f"evaluated together from {path}")
    return str(path), slices


def set_losses(per_example: dict[str, Any], slices: tuple[tuple[str, int, int], ...]) -> dict[str, dict[str, Any]]:
    """A run's per-example losses split by evaluation set: per set its token-weighted loss, size and examples."""
    out = {}
    for name, a, b in slices:
        sums, tokens = per_example["loss_sums"][a:b], per_example["tokens"][a:b]
        n_tok = float(np.sum(tokens))
        out[name] = {"eval_loss": float(np.sum(sums)) / n_tok if n_tok else math.nan, "n_eval": b - a,
                     "eval_examples": {"loss_sums": sums, "tokens": tokens}}
    return out


def eval_set_tables(summary: dict[str, dict[str, Any]], eval_meta: list[dict[str, Any]]) -> list[str]:
    """Per evaluation set (the primary first), a table: every method's held-out loss on it with the 95 % interval,
    and its difference to random and to full data there with theirs."""

    def loss(v: dict[str, Any]) -> str:
        ci = v.get("ci95")
        return "-" if v.get("loss") is None else f"{v['loss']:.4f}" + (f" [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "")

    def delta(v: dict[str, Any], ref: str) -> str:
        ci = v.get(f"ci95_vs_{ref}")
        return "-" if ci is None else f"{v[f'delta_vs_{ref}']:+.4f} [{ci[0]:+.4f}, {ci[1]:+.4f}]"

    lines = []
    for meta in eval_meta:
        rows = [(m, r["eval_sets"][meta["name"]]) for m, r in summary.items() if meta["name"] in r.get("eval_sets", {})]
        before = next((v["initial_loss"] for _, v in rows if v.get("initial_loss") is not None), None)
        lines += ["", f"#### evaluation set {meta['name']}{' (primary)' if meta['primary'] else ''}: "
                  f"{meta.get('evaluated')} examples evaluated"
                  + (f"; before training {before:.4f}" if before is not None else ""), "",
                  "| method | held-out loss [95 %] | vs random [95 %] | vs full [95 %] |", "|---|---:|---:|---:|"]
        lines += [f"| {m} | {loss(v)} | {delta(v, 'random')} | {delta(v, 'full')} |" for m, v in rows]
    return lines


def eval_losses_file(records: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """``eval_losses.json``: every unit's per-example losses on the primary set, and on each other set."""
    return {"about": "per unit: summed token loss and answer tokens of every evaluation example (same order for all) "
                     "of the primary evaluation set; 'sets': the same for each other evaluation set",
            "eval_sets": names, "primary": names[0],
            "units": [{"ratio": r["ratio"], "method": r["method"], "seed": r["seed"], **(r.get("eval_examples") or {}),
                       **({"sets": {n: v.get("eval_examples") for n, v in r["eval_sets"].items()}}
                          if r.get("eval_sets") else {})} for r in records]}


def on_set(rs: list[dict[str, Any]], name: str, primary: str) -> list[dict[str, Any]]:
    """The records as if ``name`` were their only evaluation set (its loss, losses before training, examples); []
    when a record was not evaluated on it."""
    if name == primary:
        return rs
    if not all(name in (r.get("eval_sets") or {}) for r in rs):
        return []
    return [{**r, **r["eval_sets"][name]} for r in rs]


def without_examples(record: dict[str, Any]) -> dict[str, Any]:
    """A record without its per-example losses (also per evaluation set)."""
    out = {k: v for k, v in record.items() if k != "eval_examples"}
    if record.get("eval_sets"):
        out["eval_sets"] = {n: without_examples(v) for n, v in record["eval_sets"].items()}
    return out
