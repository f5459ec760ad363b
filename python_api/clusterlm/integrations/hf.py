"""ClusterTrainer: a Hugging Face ``transformers.Trainer`` that trains on a clusterlm plan.

Launch (one process per GPU; the plan's world size must equal the number of processes)::

    torchrun --nproc-per-node 4 train.py                     # GPUs (nccl)
    torchrun --nproc-per-node 2 train.py --use_cpu           # CPU (gloo)

with ``train.py`` doing::

    from clusterlm.integrations.hf import ClusterTrainer
    trainer = ClusterTrainer(model=model, args=args, train_dataset=data, plan=Plan.load("plan/"))
    # or select at train begin (rank 0 selects and saves to plan_dir, the others load it):
    trainer = ClusterTrainer(model=model, args=args, train_dataset=data,
                             select_kwargs={"ratio": 0.31, "preset": "default"})
    trainer.train()

What it changes in ``Trainer``:

- Data. Rank ``r`` reads ``plan.indices(r)`` through a :class:`clusterlm.plan.sampler.PlanSampler`
  (``seed = args.data_seed`` or else ``args.seed``; positions reshuffled per epoch with one permutation
  shared by all ranks). Accelerate's per-process sharding of the batches is switched off for this loader:
  the sampler is already per rank (sharding it again would silently drop examples). Every item carries
  its plan weight under the key ``"plan_weight"``; the collator pads with :func:`clusterlm.data.collate`
  (or the ``data_collator`` you pass, which then receives the items without the weight) and adds a
  ``(B,)`` float32 ``"plan_weight"`` tensor.
- Loss. ``compute_loss`` runs the model without labels and returns
  ``weighted_loss(per_example_loss(logits, labels), plan_weight)`` = ``mean_b(w_b * loss_b)``, with
  ``loss_b`` example ``b``'s mean cross entropy over its answer tokens. ``num_items_in_batch`` is ignored
  (examples count equally, whatever their token counts) and the loss is marked as not yet scaled for
  gradient accumulation, so the Trainer divides it by the number of accumulated micro-batches.
- Effective objective of one optimizer step with K ranks, G accumulated micro-batches of B_j examples::

      (1/K) sum_ranks (1/G) sum_j (1/B_j) sum_{b in micro-batch j} w_b * loss_b

  i.e. the mean of ``w_b * loss_b`` over the step's ``K * G * B`` examples when micro-batches are full
  (DDP averages gradients over ranks). With the plan's weights this estimates the full-data objective
  ``sum_c (n_c / N) * mean loss of cluster c``. The logged ``loss`` is this quantity averaged over
  the logging interval.
- Before training: the plan's world size must equal ``args.world_size``, ``plan.verify`` must accept
  ``train_dataset`` (same size and content hash), and the plan's ``model_id`` must name the model being
  trained (:func:`clusterlm.models.check_model_id`: same weights and config, however the model was loaded;
  ``allow_other_model=True`` trains on another model anyway), else ``ValueError``.
- Evaluation is unchanged (items without ``plan_weight`` go through ``Trainer.compute_loss``).

Resuming (``train(resume_from_checkpoint=...)``) works through the Trainer's own batch skipping: an
epoch's order depends only on the seed and the epoch. A plan selected at train begin is reused from
``plan_dir`` when resuming, so a resumed run trains on the same plan.

FSDP. Under Accelerate's FSDP configuration (``fsdp_version: 2``, GPUs) the Trainer shards the model when
training starts, after :meth:`PlanTrainerMixin.prepare_plan`: the plan is selected (and the model id checked)
on the full, unsharded model, and FSDP2 averages the gradients over the ranks as DDP does, so the loss contract
holds unchanged. A model that is already sharded when training starts (``from_pretrained(distributed_config=
DistributedConfig(fsdp_size=K))``, ``fully_shard`` by hand, a second ``train()``) is gathered into an unsharded
copy on the CPU of every rank, one parameter at a time, for the selection and the check
(:func:`clusterlm.engine.fsdp.unsharded_copy`). Either way rank 0 selects on its accelerator (the model, or the copy,
is moved there for the selection and back). Ranks that hold no weights (Accelerate's
``cpu_ram_efficient_loading`` loads them on rank 0 only) skip the model-id check.
Accelerate does not shard on CPUs: a CPU run (``MULTI_CPU``, gloo) ignores its FSDP settings and trains as DDP.

The plan mechanisms (obtaining, checking, per-rank loader, weights through the column filter) live in
:class:`PlanTrainerMixin`, which :class:`clusterlm.integrations.trl.ClusterSFTTrainer` shares.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import Trainer
from transformers.utils import logging

from clusterlm.data import collate
from clusterlm.engine.fsdp import is_sharded, unsharded_copy
from clusterlm.engine.loss import per_example_loss, weighted_loss
from clusterlm.models import check_model_id, compute_model_id
from clusterlm.plan import Plan
from clusterlm.plan.sampler import PlanSampler
from clusterlm.selection.select import select

__all__ = ["WEIGHT_KEY", "ClusterTrainer", "PlanCollator", "PlanTrainerMixin", "PlanWeightedDataset",
           "check_plan_arguments", "unshard_dataloader"]

logger = logging.get_logger(__name__)

WEIGHT_KEY = "plan_weight"


class PlanWeightedDataset(Dataset):
    """A data set whose items are the original items plus their plan weight under ``"plan_weight"``.

    Args:
        dataset: map-style data set of dict items (e.g. :class:`clusterlm.data.SFTDataset`), indexed
            like the plan (the plan's ``fingerprint`` is of this data set).
        weights: (N,) float64 plan weights (``plan.weights``).
        sampler: optional sampler to forward :meth:`set_epoch` to (Accelerate calls the data set's
            ``set_epoch`` when it cannot reach the sampler through its wrappers).

    Raises:
        ValueError: ``len(dataset)`` differs from ``len(weights)``.
    """

    def __init__(self, dataset: Any, weights: np.ndarray, sampler: PlanSampler | None = None) -> None:
        weights = np.asarray(weights, dtype=np.float64)
        if len(dataset) != len(weights):
            raise ValueError(
                f"PlanWeightedDataset: the data set has {len(dataset)} examples but the plan has {len(weights)} "
                "weights; use the data set the plan was made for."
            )
        self.dataset = dataset
        self.weights = weights
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = self.dataset[int(index)]
        if not isinstance(item, Mapping):
            raise TypeError(
                f"PlanWeightedDataset: items must be dicts with input_ids and labels, item {index} is "
                f"{type(item).__name__}."
            )
        out = dict(item)
        out[WEIGHT_KEY] = float(self.weights[index])
        return out

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the plan sampler (no-op without one)."""
        if self.sampler is not None:
            self.sampler.set_epoch(int(epoch))


def _default_collate(features: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    return collate(features, pad_id=pad_id)


class PlanCollator:
    """Pads a batch and keeps the plan weights.

    Args:
        collate_fn: collator for the items without their weight; default :func:`clusterlm.data.collate`
            (right padding, ``labels`` -100 on padding, int64 ``input_ids``/``attention_mask``/``labels``).
        pad_id: padding token id for the default collator.

    Returns (when called on a list of items): the collator's dict plus ``"plan_weight"``, a (B,) float32
    tensor, when the items carry weights.

    Raises:
        ValueError: some items of a batch carry a weight and others do not.
    """

    def __init__(self, collate_fn: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None, *,
                 pad_id: int = 0) -> None:
        self.collate_fn = collate_fn
        self.pad_id = int(pad_id)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        has = [WEIGHT_KEY in f for f in features]
        if any(has) and not all(has):
            raise ValueError(
                f"PlanCollator: {sum(has)} of {len(has)} items carry {WEIGHT_KEY!r}; a batch must be all plan items "
                "or none."
            )
        rest = [{k: v for k, v in f.items() if k != WEIGHT_KEY} for f in features]
        batch = self.collate_fn(rest) if self.collate_fn is not None else _default_collate(rest, self.pad_id)
        if has and all(has):
            batch = dict(batch)
            batch[WEIGHT_KEY] = torch.tensor([float(f[WEIGHT_KEY]) for f in features], dtype=torch.float32)
        return batch


def unshard_dataloader(dataloader: Any, who: str = "ClusterTrainer") -> None:
    """Make Accelerate's per-process batch sharding a pass-through: the PlanSampler is already per rank.

    Raises:
        ValueError: the loader is Accelerate's dispatcher (rank 0 reads every batch and sends slices).
    """
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher

    if isinstance(dataloader, DataLoaderDispatcher):
        raise ValueError(
            f"{who}: Accelerate's dispatch_batches mode (rank 0 reads and sends every batch) cannot give "
            "each rank its own plan examples; set TrainingArguments(accelerator_config={'dispatch_batches': False})."
        )
    for attr in ("batch_sampler", "sampler"):
        shard = getattr(dataloader, attr, None)
        if isinstance(shard, BatchSamplerShard):
            shard.num_processes = 1
            shard.process_index = 0
            # every rank has the same number of examples, so there is nothing to even out; evening would
            # pad the last batch with examples from the start of the epoch
            shard.even_batches = False


def check_plan_arguments(who: str, plan: Any, select_kwargs: Any) -> None:
    """The constructor checks of a plan trainer: a Plan or select_kwargs (a dict without return_features), not both.

    Raises:
        TypeError: plan is not a Plan, select_kwargs not a dict.
        ValueError: both given, or select_kwargs asks for return_features.
    """
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"{who}: plan must be a clusterlm.plan.Plan, got {type(plan).__name__}.")
    if plan is not None and select_kwargs is not None:
        raise ValueError(f"{who}: pass either plan= (a finished plan) or select_kwargs= (select at train begin), not "
                         "both.")
    if select_kwargs is not None and not isinstance(select_kwargs, Mapping):
        raise TypeError(f"{who}: select_kwargs must be a dict of clusterlm.selection.select.select arguments, got "
                        f"{type(select_kwargs).__name__}.")
    if select_kwargs is not None and select_kwargs.get("return_features"):
        raise ValueError(f"{who}: select_kwargs may not set return_features; the trainer needs the plan only.")


class PlanTrainerMixin:
    """The plan side of a ``transformers.Trainer`` subclass: put it before the Trainer class in the bases.

    Provides obtaining the plan (given, loaded from ``plan_dir`` or selected on rank 0 at train begin), the
    checks before training (world size, data fingerprint, model id), the per-rank :class:`PlanSampler` loader
    with Accelerate's re-sharding switched off, the weight kept through the column filter, and ``train``.
    The subclass calls :meth:`setup_plan` at the end of its ``__init__`` and computes the loss itself.
    :meth:`plan_examples` is what the plan indexes (default ``train_dataset``).
    """

    # compute_loss returns a per-micro-batch mean; the Trainer divides it by the accumulation steps.
    loss_is_scaled_for_ga = False
    plan_trainer_name = "ClusterTrainer"

    def setup_plan(self, plan: Plan | None, plan_dir: str | os.PathLike | None,
                   select_kwargs: Mapping[str, Any] | None, allow_other_model: bool = False) -> None:
        """Store the plan settings and check what the Trainer was given (called after ``Trainer.__init__``).

        Raises:
            ValueError: label smoothing, a ``compute_loss_func``, or a plan for another world size.
        """
        who = self.plan_trainer_name
        if self.args.label_smoothing_factor:
            raise ValueError(
                f"{who}: label_smoothing_factor={self.args.label_smoothing_factor} is not supported; the "
                "loss is the plan-weighted per-example cross entropy. Set it to 0."
            )
        if self.compute_loss_func is not None:
            raise ValueError(f"{who}: compute_loss_func cannot be combined with the plan-weighted loss.")
        # The weighted loss needs no token count: skip the Trainer's per-step count (and its all-gather).
        self.model_accepts_loss_kwargs = False
        self.plan = plan
        self.plan_dir = Path(plan_dir) if plan_dir is not None else Path(self.args.output_dir) / "plan"
        self.select_kwargs = dict(select_kwargs) if select_kwargs is not None else None
        self.allow_other_model = bool(allow_other_model)
        self._plan_sampler: PlanSampler | None = None
        if plan is not None:
            self._check_world_size(plan)
        if self.args.train_sampling_strategy != "random":
            logger.warning(
                f"{who}: train_sampling_strategy={self.args.train_sampling_strategy!r} is ignored; the plan "
                "decides which examples each rank visits and in which order."
            )

    # ---- plan ---------------------------------------------------------------------------------------

    def plan_examples(self) -> Any:
        """The examples the plan indexes and fingerprints (``train_dataset``; subclasses may convert it)."""
        return self.train_dataset

    def _check_world_size(self, plan: Plan) -> None:
        if plan.world_size != self.args.world_size:
            raise ValueError(
                f"{self.plan_trainer_name}: the plan is for world size {plan.world_size}, but this run has "
                f"args.world_size={self.args.world_size} processes; launch {plan.world_size} processes "
                f"(torchrun --nproc-per-node {plan.world_size}) or make a plan with world_size={self.args.world_size}."
            )

    def full_model(self) -> torch.nn.Module:
        """The trainer's model unwrapped; a sharded (FSDP2) one gathered into an unsharded copy (every rank calls
        it then: the gathering is collective)."""
        model = self.accelerator.unwrap_model(self.model)
        return unsharded_copy(model) if is_sharded(model) else model

    def _select_plan(self, model: torch.nn.Module) -> Plan:
        kwargs = dict(self.select_kwargs or {})
        given = kwargs.pop("world_size", self.args.world_size)
        if given != self.args.world_size:
            raise ValueError(
                f"{self.plan_trainer_name}: select_kwargs['world_size']={given} differs from args.world_size="
                f"{self.args.world_size}; leave it out (the trainer sets it)."
            )
        kwargs.setdefault("progress", not self.args.disable_tqdm)
        if "model_id" not in kwargs:  # not setdefault: that would hash every weight even when an id is given
            kwargs["model_id"] = compute_model_id(model)
        was_training = model.training
        # Under FSDP the Trainer places the model only when it shards it, and a gathered copy is on the CPU: features
        # are computed on this rank's accelerator all the same (the other ranks wait).
        device = self.args.device
        unplaced = getattr(self, "is_fsdp_enabled", False) or model is not self.accelerator.unwrap_model(self.model)
        move = unplaced and device.type != "cpu" and next(model.parameters()).device.type == "cpu"
        try:
            if move:
                model.to(device)
            return select(model, self.plan_examples(), world_size=self.args.world_size, **kwargs)
        finally:
            model.train(was_training)
            if move:
                model.to("cpu")

    def _obtain_plan(self, resuming: bool, model: torch.nn.Module) -> Plan:
        saved = (self.plan_dir / "plan.json").is_file()
        if self.select_kwargs is None:
            if not saved:
                raise ValueError(
                    f"{self.plan_trainer_name}: no plan: pass plan=Plan.load(dir), plan_dir= a directory holding a "
                    f"saved plan (found no plan.json in {self.plan_dir}), or select_kwargs= to select at train begin."
                )
            return Plan.load(self.plan_dir)
        reuse = resuming and saved
        # Rank 0 selects and saves; the others wait at the barrier, then read the saved plan.
        with self.args.main_process_first(local=False, desc="clusterlm plan selection"):
            if self.args.process_index == 0 and not reuse:
                plan = self._select_plan(model)
                plan.save(self.plan_dir)
                logger.info(f"clusterlm plan saved to {self.plan_dir}:\n{plan.summary()}")
            else:
                plan = Plan.load(self.plan_dir)
        return plan

    def prepare_plan(self, resuming: bool = False) -> Plan:
        """Obtain the plan (given, loaded or selected), then check world size, data fingerprint and model id.

        Called by :meth:`train`; call it yourself to inspect the plan before training.

        Args:
            resuming: reuse a plan saved in ``plan_dir`` instead of selecting again.

        Returns:
            The plan (also ``self.plan``).

        Raises:
            ValueError: no train_dataset, no plan available, a plan for another world size, data set or model
                (unless ``allow_other_model``).
        """
        if self.train_dataset is None:
            raise ValueError(f"{self.plan_trainer_name}: training needs train_dataset (the data set the plan was made "
                             "for).")
        model = self.full_model()  # unsharded: the features and the model id are the whole model's
        if self.plan is None:
            self.plan = self._obtain_plan(resuming, model)
        self._check_world_size(self.plan)
        self.plan.verify(self.plan_examples())
        if any(p.is_meta for p in model.parameters()):  # weights on rank 0 only (cpu_ram_efficient_loading)
            return self.plan
        if not check_model_id(self.plan.model_id, model, who=self.plan_trainer_name,
                              allow_other_model=self.allow_other_model) and self.plan.model_id:
            logger.warning(f"{self.plan_trainer_name}: the plan's model_id {self.plan.model_id!r} carries no weights "
                           "hash, so the model it was selected with cannot be checked.")
        return self.plan

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        """``Trainer.train`` after :meth:`prepare_plan` (see the module docstring)."""
        self.prepare_plan(resuming=bool(resume_from_checkpoint))
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                             ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)

    # ---- data ---------------------------------------------------------------------------------------

    def _get_train_sampler(self, train_dataset: Any = None) -> PlanSampler:
        if self.plan is None:
            raise ValueError(f"{self.plan_trainer_name}: no plan yet; call train() or prepare_plan() first, or pass "
                             "plan=.")
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        self._plan_sampler = PlanSampler(self.plan, rank=self.args.process_index, seed=seed)
        return self._plan_sampler

    def get_train_dataloader(self) -> Any:
        """The training DataLoader: this rank's plan examples, with weights, unsharded by Accelerate.

        Raises:
            ValueError: no plan or no train_dataset yet; Accelerate configured with dispatch_batches.
        """
        if self.plan is None:
            raise ValueError(f"{self.plan_trainer_name}: no plan yet; call train() or prepare_plan() first, or pass "
                             "plan=.")
        if self.train_dataset is None:
            raise ValueError(f"{self.plan_trainer_name}: training needs train_dataset (the data set the plan was made "
                             "for).")
        original = self.train_dataset
        wrapped = PlanWeightedDataset(original, self.plan.weights)
        self.train_dataset = wrapped
        try:
            loader = super().get_train_dataloader()
        finally:
            self.train_dataset = original
        wrapped.sampler = self._plan_sampler
        unshard_dataloader(loader, self.plan_trainer_name)
        return loader

    def num_examples(self, dataloader: Any) -> int:
        """Examples per epoch: the plan's selection for the training loader, else as ``Trainer``."""
        if isinstance(getattr(dataloader, "dataset", None), PlanWeightedDataset) and self.plan is not None:
            return self.plan.n_selected
        return super().num_examples(dataloader)

    def _set_signature_columns_if_needed(self) -> None:
        # Keep the weight through the Trainer's removal of columns the model's forward does not take.
        super()._set_signature_columns_if_needed()
        if WEIGHT_KEY not in self._signature_columns:
            self._signature_columns.append(WEIGHT_KEY)


class ClusterTrainer(PlanTrainerMixin, Trainer):
    """``transformers.Trainer`` training every rank on its plan examples with plan weights (module docstring).

    Args:
        *args, **kwargs: as for ``transformers.Trainer``; ``train_dataset`` must be the data set the plan
            was made for (an :class:`clusterlm.data.SFTDataset` or a sequence of example dicts).
        plan: the :class:`~clusterlm.plan.Plan` to train on.
        plan_dir: where a plan is read from when neither ``plan`` nor ``select_kwargs`` is given, and where
            a plan selected at train begin is saved (default ``args.output_dir/plan``).
        select_kwargs: keyword arguments of :func:`clusterlm.selection.select.select` (``ratio`` or ``budget``,
            ``preset``, ...): the plan is selected at the start of :meth:`train` on rank 0 with the
            trainer's model and ``train_dataset``, saved to ``plan_dir``, and loaded by the other ranks.
            ``world_size`` is taken from ``args``; ``model_id`` defaults to
            :func:`clusterlm.models.compute_model_id` of the model.
        allow_other_model: train even when the plan's ``model_id`` names another model.

    Raises:
        TypeError: plan is not a Plan, select_kwargs not a dict.
        ValueError: both plan and select_kwargs, a plan for another world size, label smoothing or a
            ``compute_loss_func`` (the loss is the plan-weighted loss).
    """

    def __init__(self, *args: Any, plan: Plan | None = None, plan_dir: str | os.PathLike | None = None,
                 select_kwargs: Mapping[str, Any] | None = None, allow_other_model: bool = False,
                 **kwargs: Any) -> None:
        check_plan_arguments(self.plan_trainer_name, plan, select_kwargs)
        bound = inspect.signature(Trainer.__init__).bind_partial(self, *args, **kwargs).arguments
        processing_class = bound.get("processing_class")
        pad_id = getattr(processing_class, "pad_token_id", None)
        collator = PlanCollator(bound.get("data_collator"), pad_id=0 if pad_id is None else pad_id)
        if len(args) >= 3:
            args = (*args[:2], collator, *args[3:])
        else:
            kwargs["data_collator"] = collator
        super().__init__(*args, **kwargs)
        self.setup_plan(plan, plan_dir, select_kwargs, allow_other_model)

    # ---- loss ---------------------------------------------------------------------------------------

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """Plan-weighted loss ``mean_b(w_b * loss_b)`` for plan batches; ``Trainer.compute_loss`` otherwise.

        Raises:
            ValueError: a plan batch without ``labels``; examples without answer tokens (named by row).
        """
        if WEIGHT_KEY not in inputs:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        inputs = dict(inputs)
        weights = inputs.pop(WEIGHT_KEY)
        labels = inputs.pop("labels", None)
        if labels is None:
            raise ValueError("ClusterTrainer: plan batches need 'labels' (-100 on prompt and padding tokens).")
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        loss = weighted_loss(per_example_loss(logits, labels), weights)
        return (loss, outputs) if return_outputs else loss
