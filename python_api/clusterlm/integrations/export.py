"""Portable export of a plan: one data set, in interleaved global order, with a weight column.

Any trainer whose distributed loader shards a data set *without shuffling* then hands every rank exactly
its plan list, in plan-sampler order, and only has to multiply each example's loss by its weight
(``mean_b(w_b * loss_b)`` per rank, ``loss_b`` = the example's mean cross entropy over its trained tokens)::

    from clusterlm.integrations.export import plan_to_dataset, save_export

    ds = plan_to_dataset(plan, data, batch_size=4, epochs=3)   # a datasets.Dataset
    save_export(ds, "export/", plan=plan, batch_size=4, epochs=3)
    # or the settings as one object: ExportConfig(batch_size=4, epochs=3), passed to each call

    clusterlm export --plan plan/ --data train.jsonl --out export/ --batch-size 4 --epochs 3 [--model M]

Layout. With K ranks, per-rank list length m, per-device batch size B and epochs E, the rows are the E
epochs back to back; inside epoch e, block j (``j = 0 .. m/B - 1``) holds, for r = 0 .. K-1 in turn, the B
examples at positions ``j*B .. j*B+B-1`` of rank r's epoch-e order (``PlanSampler(plan, r, seed=seed)
.order(e)``, or the plan order itself with ``shuffle=False``). So global batch ``i`` (rows ``i*B .. i*B+B-1``)
belongs to rank ``i mod K``, which is what

* Accelerate's default batch sharding gives rank r (``accelerator.prepare(DataLoader(ds, batch_size=B))``
  with a sequential sampler: rank r takes the r-th batch of every group of K; also with ``split_batches=True``
  and a loader batch of ``K*B``), so the Hugging Face ``Trainer`` with ``train_sampling_strategy="sequential"``
  and ``per_device_train_batch_size=B`` (gradient accumulation is fine: a rank's micro-batches are its
  consecutive batches);
* ``DistributedSampler(ds, shuffle=False)`` gives rank r when ``B = 1`` (it deals rows r, r+K, r+2K, ...;
  export with ``batch_size=1`` for it, whatever batch size the loader then uses).

Each epoch reshuffles inside every rank's list exactly as :class:`clusterlm.plan.sampler.PlanSampler` does (one
permutation of positions shared by all ranks, so the rank split and per-step token balance survive), so
train the export for one pass (``num_train_epochs=1``). ``m`` must be a multiple of ``B``, or ``drop_last=True``
drops each rank's last ``m mod B`` examples of every epoch.

Columns: the source's own columns (raw text columns such as ``messages`` for trainers that tokenise
themselves, and/or ``input_ids``/``labels``), plus ``weight`` (the plan weight, float64), ``plan_index`` (the
row in the source), ``plan_rank``, ``plan_epoch`` and ``plan_position`` (the position in the rank's epoch order).
When the source holds ``input_ids``/``labels`` the plan's fingerprint is verified against them; raw rows are
only checked for their number (``clusterlm export --model`` tokenises them and verifies).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from clusterlm.config.export import ExportConfig
from clusterlm.data import DEFAULT_MAX_LENGTH, SFTDataset, load_data, read_columns
from clusterlm.fileio import atomic_write_json
from clusterlm.models import load_model
from clusterlm.plan import Plan
from clusterlm.plan.sampler import PlanSampler

__all__ = ["EXPORT_COLUMNS", "EXPORT_FORMAT", "ExportConfig", "as_hf_dataset", "export_files", "export_order",
           "plan_to_dataset", "save_export"]

EXPORT_FORMAT = "clusterlm.export"  # the on-disk name in export.json: kept when the module moved
# Columns added to every exported row (besides the weight column).
EXPORT_COLUMNS = ("plan_index", "plan_rank", "plan_epoch", "plan_position")


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"plan export: {name} must be a positive int, got {value!r}.")
    return int(value)


def export_order(plan: Plan, config: ExportConfig | None = None, **overrides: Any) -> dict[str, np.ndarray]:
    """The global row order of an export (see the module docstring for the layout).

    Args:
        plan: the plan.
        config: the settings (:class:`ExportConfig`: ``batch_size``, ``epochs``, ``seed``, ``shuffle``,
            ``drop_last`` are read); ``overrides`` (any of its fields) are applied on top.

    Returns:
        ``{"plan_index", "plan_rank", "plan_epoch", "plan_position"}``: int64 arrays of length
        ``epochs * world_size * m'`` (``m'`` = m, or m rounded down to a multiple of B with ``drop_last``).

    Raises:
        ValueError: non-positive batch_size/epochs, or m not a multiple of B without ``drop_last``.
        TypeError: an unknown setting.
    """
    c = ExportConfig.merged(config, overrides)
    b, n_epochs, drop_last = _positive(c.batch_size, "batch_size"), _positive(c.epochs, "epochs"), c.drop_last
    k, m = plan.world_size, plan.per_rank
    used = m - m % b
    if used != m and not drop_last:
        raise ValueError(
            f"plan export: every rank has {m} examples per epoch, not a multiple of batch_size={b}, so the last batch "
            f"of a rank would mix with the next rank's or epoch's examples. Pick a batch size dividing {m}, or pass "
            f"drop_last=True (--drop-last) to drop each rank's last {m % b} examples per epoch."
        )
    if used == 0:
        raise ValueError(f"plan export: batch_size={b} exceeds the {m} examples per rank; use a smaller batch size.")
    samplers = [PlanSampler(plan, r, epoch_shuffle=c.shuffle, seed=c.seed) for r in range(k)]
    ranks = np.broadcast_to(np.arange(k, dtype=np.int64)[:, None], (k, used))
    positions = np.broadcast_to(np.arange(used, dtype=np.int64)[None, :], (k, used))

    def interleave(a: np.ndarray) -> np.ndarray:  # (K, m') -> blocks of B, rank after rank
        return a.reshape(k, used // b, b).transpose(1, 0, 2).reshape(-1)

    out: dict[str, list[np.ndarray]] = {name: [] for name in EXPORT_COLUMNS}
    for e in range(n_epochs):
        orders = np.stack([s.order(e)[:used] for s in samplers])
        out["plan_index"].append(interleave(orders))
        out["plan_rank"].append(interleave(ranks))
        out["plan_epoch"].append(np.full(k * used, e, dtype=np.int64))
        out["plan_position"].append(interleave(positions))
    return {name: np.concatenate(parts).astype(np.int64) for name, parts in out.items()}


def as_hf_dataset(dataset: Any, split: str | None = None) -> Any:
    """The rows of ``dataset`` as a ``datasets.Dataset``, in order (a ``datasets.Dataset`` is returned as is).

    Args:
        dataset: a ``datasets.Dataset``, an :class:`~clusterlm.data.SFTDataset` (its ``input_ids``/``labels``), or
            any source :func:`clusterlm.data.read_columns` accepts (file, ``save_to_disk`` directory,
            ``DatasetDict`` with ``split``, list of dicts).
        split: the split of a ``DatasetDict``.
    """
    import datasets

    if isinstance(dataset, datasets.Dataset):
        return dataset
    if isinstance(dataset, SFTDataset):
        rows = [dataset[i] for i in range(len(dataset))]
        return datasets.Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in rows],
                                           "labels": [r["labels"].tolist() for r in rows]})
    return datasets.Dataset.from_dict(read_columns(dataset, split))


def _check_source(plan: Plan, ds: Any, verify: bool) -> None:
    """Verify the plan against the source's tokens when it has them; raw rows: their number only."""
    if verify and {"input_ids", "labels"} <= set(ds.column_names):
        plan.verify(ds.select_columns(["input_ids", "labels"]))
        return
    if len(ds) != plan.n_examples:
        n_empty = int((plan.config.get("data") or {}).get("n_empty") or 0)
        if n_empty and len(ds) == plan.n_examples + n_empty:
            raise ValueError(
                f"plan export: the data set has {len(ds)} rows and the plan {plan.n_examples} examples: selection "
                f"skipped the {n_empty} rows with an empty answer; pass the model the plan was made with (--model / "
                "model=) so export tokenises the rows and skips the same ones."
            )
        raise ValueError(
            f"plan export: the plan was made for {plan.n_examples} examples, the data set has {len(ds)} rows; export "
            "the data the plan was made for (in the same order)."
        )


def plan_to_dataset(plan: Plan, dataset: Any, config: ExportConfig | None = None, *, verify: bool = True,
                    **overrides: Any) -> Any:
    """The plan as one ``datasets.Dataset`` in interleaved global order with a weight column.

    Args:
        plan: the plan.
        dataset: the data the plan indexes: an :class:`~clusterlm.data.SFTDataset`, a ``datasets.Dataset`` /
            ``DatasetDict`` (with ``split``), a ``save_to_disk`` directory, a ``.jsonl``/``.json``/``.parquet``
            file, or a list of dicts (raw records or tokenised examples).
        config: the settings (:class:`ExportConfig`: the layout, ``weight_column``, ``split``); ``overrides``
            (any of its fields, e.g. ``batch_size=4, epochs=3``) are applied on top.
        verify: check the plan's fingerprint against ``input_ids``/``labels`` when the source has them.

    Returns:
        A ``datasets.Dataset``: the source's columns plus ``weight_column`` and :data:`EXPORT_COLUMNS`.

    Raises:
        ValueError: a plan for other data (fingerprint or size), a column name already in the source, a bad
            layout (see :func:`export_order`).
        TypeError: an unknown setting.
    """
    c = ExportConfig.merged(config, overrides)
    weight_column = c.weight_column
    ds = as_hf_dataset(dataset, c.split)
    _check_source(plan, ds, verify)
    taken = [col for col in (weight_column, *EXPORT_COLUMNS) if col in ds.column_names]
    if taken:
        raise ValueError(f"plan export: the data set already has the column(s) {taken}; rename them or pass another "
                         "weight_column.")
    order = export_order(plan, c)
    out = ds.select(order["plan_index"])
    out = out.add_column(weight_column, plan.weights[order["plan_index"]].tolist())
    for name in EXPORT_COLUMNS:
        out = out.add_column(name, order[name].tolist())
    return out


def save_export(dataset: Any, out_dir: str | os.PathLike, config: ExportConfig | None = None, *, plan: Plan,
                verified: bool | None = None, **overrides: Any) -> dict[str, Path]:
    """Write an exported data set as ``save_to_disk`` directory, JSONL and a manifest.

    Files: ``out_dir/dataset/`` (``datasets.load_from_disk``), ``out_dir/train.jsonl`` (one row per line, in
    order) and ``out_dir/export.json`` (the layout, the plan's fingerprint and world size). The data set
    directory is written beside and moved into place, so a crash leaves no half-written export.

    Args:
        dataset: the exported ``datasets.Dataset`` (:func:`plan_to_dataset`).
        out_dir: where the files go.
        config: the settings the export was made with (:class:`ExportConfig`; the manifest records the layout and
            ``weight_column``); ``overrides`` (any of its fields) are applied on top.
        plan: the exported plan.
        verified: whether the plan's fingerprint was checked against the data (recorded).

    Returns:
        ``{"dataset", "jsonl", "manifest"}`` paths.

    Raises:
        TypeError: an unknown setting.
    """
    c = ExportConfig.merged(config, overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"dataset": out / "dataset", "jsonl": out / "train.jsonl", "manifest": out / "export.json"}
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=out))
    try:
        dataset.save_to_disk(str(tmp / "dataset"))
        dataset.to_json(str(tmp / "train.jsonl"), lines=True, force_ascii=False)
        if paths["dataset"].exists():
            shutil.rmtree(paths["dataset"])
        os.replace(tmp / "dataset", paths["dataset"])
        os.replace(tmp / "train.jsonl", paths["jsonl"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    atomic_write_json(paths["manifest"], {
        "format": EXPORT_FORMAT, "version": 1, "rows": len(dataset), "columns": list(dataset.column_names),
        "weight_column": c.weight_column, "world_size": plan.world_size, "per_rank": plan.per_rank,
        "batch_size": int(c.batch_size), "epochs": int(c.epochs), "seed": int(c.seed), "shuffle": bool(c.shuffle),
        "drop_last": bool(c.drop_last), "plan_fingerprint": dict(plan.fingerprint), "plan_model_id": plan.model_id,
        "content_verified": verified,
        "layout": "global batch i (rows i*B .. i*B+B-1) belongs to rank i mod world_size; epochs back to back; "
                  "train one pass with a sequential sampler and loss mean_b(weight_b * loss_b) per rank",
    })
    return paths


def export_files(plan_dir: str | os.PathLike, data: Any, out_dir: str | os.PathLike,
                 config: ExportConfig | None = None, *, model: str | None = None,
                 **overrides: Any) -> tuple[dict[str, Path], bool]:
    """``clusterlm export``: load a saved plan, export ``data`` in its order, write the files (:func:`save_export`).

    Args:
        plan_dir: a directory written by :meth:`Plan.save`.
        data: the data the plan was made for (any source :func:`plan_to_dataset` accepts).
        out_dir: where the files go.
        config: the settings (:class:`ExportConfig`: layout, ``weight_column``, ``split``, and ``max_length`` /
            ``chat_template`` for ``model``); ``overrides`` (any of its fields) are applied on top.
        model: a model spec for :func:`clusterlm.models.load_model`: its tokenizer tokenises raw rows as
            ``clusterlm select`` did, the plan's fingerprint is verified against them, and ``input_ids``/``labels``
            are exported next to the raw columns. None: raw rows are exported as they are (checked for their
            number only; tokenised sources are verified anyway).

    Returns:
        ``(paths, verified)``: the written files, and whether the plan's fingerprint was checked.

    Raises:
        TypeError: an unknown setting.
    """
    import datasets

    c = ExportConfig.merged(config, overrides)
    plan = Plan.load(plan_dir)
    source: Any = data
    if model is not None:
        _, tokenizer, _ = load_model(model)
        max_length = c.max_length
        if max_length is None:
            max_length = (plan.config.get("data") or {}).get("max_length", DEFAULT_MAX_LENGTH)
        tokens = load_data(data, tokenizer, max_length=max_length, split=c.split, progress=False,
                           chat_template=c.chat_template)
        keep = tokens.source_indices  # the rows load_data kept: examples with an empty answer are skipped
        columns = {name: [values[i] for i in keep] for name, values in read_columns(data, c.split).items()}
        columns["input_ids"] = [tokens[i]["input_ids"].tolist() for i in range(len(tokens))]
        columns["labels"] = [tokens[i]["labels"].tolist() for i in range(len(tokens))]
        source = datasets.Dataset.from_dict(columns)
    ds = plan_to_dataset(plan, source, c)
    verified = {"input_ids", "labels"} <= set(ds.column_names)
    paths = save_export(ds, out_dir, c, plan=plan, verified=verified)
    return paths, verified
