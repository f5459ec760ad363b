"""ClusterSFTTrainer: TRL's ``SFTTrainer`` that trains every rank on its part of a clusterlm plan.

TRL declined per-example weights in SFT (huggingface/trl#5761), so this subclass provides them::

    from trl import SFTConfig
    from clusterlm.integrations.trl import ClusterSFTTrainer, sft_examples
    from clusterlm.models import compute_model_id

    args = SFTConfig(output_dir="run", per_device_train_batch_size=4, assistant_only_loss=True)
    # the plan is made from the data *as TRL tokenises it* for these args (select and train see the same tokens)
    examples = sft_examples(model, raw, args=args, processing_class=tokenizer)   # -> clusterlm.SFTDataset
    plan = clusterlm.select(model, examples, world_size=4, ratio=0.31, model_id=compute_model_id(model))
    trainer = ClusterSFTTrainer(model=model, args=args, train_dataset=raw, processing_class=tokenizer, plan=plan)
    # or select at train begin on rank 0 (the others load the plan from plan_dir):
    trainer = ClusterSFTTrainer(model=model, args=args, train_dataset=raw, processing_class=tokenizer,
                                select_kwargs={"ratio": 0.31})
    trainer.train()                       # torchrun --nproc-per-node 4 train.py

What it keeps from TRL: the whole data pipeline (``messages`` and ``prompt``/``completion`` data, chat
templates, ``completion_only_loss`` / ``assistant_only_loss``, truncation, its collator, ``padding_free``), the
fused LM head (no ``(B, T, V)`` logits), ``loss_type`` (``"nll"`` or ``"dft"``), PEFT, its metrics.

What it changes (with the mechanisms of :class:`clusterlm.integrations.hf.PlanTrainerMixin`, shared with
``ClusterTrainer``):

- Data. ``train_dataset`` is tokenised by TRL as usual; rank ``r`` then reads ``plan.indices(r)`` of the
  *tokenised* data set through a :class:`clusterlm.plan.sampler.PlanSampler` (one permutation per epoch shared by
  all ranks), and Accelerate's re-sharding of that loader is switched off. The plan weight travels with
  every item as ``"plan_weight"`` (kept through the Trainer's column removal) and TRL's collator pads the
  rest. ``train_dataset`` may also be an :class:`clusterlm.data.SFTDataset` or a list of dicts (converted
  to a ``datasets.Dataset``; TRL leaves ``input_ids``/``labels`` as they are).
- Loss. ``mean_b(w_b * loss_b)`` per rank, ``loss_b`` = example ``b``'s mean per-token loss over the tokens
  TRL trains (``-log p`` for ``loss_type="nll"``, DFT's ``-p log p`` with ``p`` detached for ``"dft"``),
  whatever ``num_items_in_batch`` / ``average_tokens_across_devices`` say (examples count equally, as the
  plan's weights assume). With ``padding_free=True`` the examples of the single packed row are told apart
  by TRL's ``seq_idx``.
- Checks before training: world size, the plan's fingerprint against the examples TRL produced (its
  ``input_ids`` and the labels it trains on, not the raw rows), and the plan's model id against the model
  (``allow_other_model=True`` to train another one). Refused at construction: ``packing=True`` (it merges
  examples into rows, so rows are no longer plan examples) and ``shuffle_dataset=True`` (it reorders the
  tokenised data set under the plan's indices); label smoothing and ``compute_loss_func``.

Resuming (``train(resume_from_checkpoint=...)``) continues the plan order (an epoch's order depends only on
the seed and the epoch, and the Trainer skips the batches already trained).

FSDP works as for ``ClusterTrainer`` (:mod:`clusterlm.integrations.hf`): selection at train begin and the model-id
check see the full model (before Accelerate shards it, or gathered from a model sharded already), and the sharded
gradient of the weighted loss is ``sum_k (n_k / N) g_k`` through TRL's fused LM head too (tested on 2 gloo ranks
with a model sharded by ``from_pretrained(distributed_config=...)``; Accelerate itself does not shard on CPUs).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping, Sequence
from typing import Any

import datasets
import torch
from transformers.utils import logging
from trl import SFTConfig, SFTTrainer

from clusterlm.data import SFTDataset, load_data
from clusterlm.engine.loss import weighted_loss
from clusterlm.integrations.export import as_hf_dataset
from clusterlm.integrations.hf import WEIGHT_KEY, PlanCollator, PlanTrainerMixin, check_plan_arguments
from clusterlm.plan import Plan

__all__ = ["ClusterSFTTrainer", "per_example_token_mean", "sft_examples", "to_trl_dataset", "tokenized_examples"]

logger = logging.get_logger(__name__)

_HOW_TO_PLAN = (
    "make the plan from the examples as TRL tokenises them for this trainer's args: "
    "clusterlm.integrations.trl.sft_examples(model, train_dataset, args=args, processing_class=tokenizer) returns "
    "them for clusterlm.select (TRL's tokenisation differs from clusterlm.load_data's), or pass select_kwargs= to "
    "select at train begin"
)


def to_trl_dataset(data: Any, who: str = "ClusterSFTTrainer") -> Any:
    """A ``datasets.Dataset`` TRL accepts, holding the same rows in the same order.

    Args:
        data: a ``datasets.Dataset`` (returned as is), an :class:`~clusterlm.data.SFTDataset` (its
            ``input_ids``/``labels``), or a list of dicts (raw records or tokenised examples).
        who: the caller, for messages.

    Raises:
        TypeError: an ``IterableDataset`` (a plan indexes a map-style data set), a ``DatasetDict`` (pick a
            split) or another type.
    """
    if isinstance(data, (datasets.Dataset, SFTDataset)):
        return as_hf_dataset(data)
    if isinstance(data, datasets.DatasetDict):
        raise TypeError(f"{who}: train_dataset is a DatasetDict with splits {list(data)}; pass one split, e.g. "
                        "dataset['train'].")
    if isinstance(data, datasets.IterableDataset):
        raise TypeError(f"{who}: a plan indexes a map-style data set; an IterableDataset has no indices. Load it "
                        "as a datasets.Dataset.")
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)) and all(isinstance(r, Mapping) for r in data):
        return as_hf_dataset(list(data))
    raise TypeError(f"{who}: train_dataset must be a datasets.Dataset, a clusterlm SFTDataset or a list of dicts, got "
                    f"{type(data).__name__}.")


def tokenized_examples(dataset: Any) -> SFTDataset:
    """The ``input_ids``/``labels`` of a TRL-prepared data set as an :class:`~clusterlm.data.SFTDataset`.

    Its :meth:`~clusterlm.data.SFTDataset.fingerprint` is the one :meth:`clusterlm.plan.Plan.verify` compares
    (the tokens and the label mask TRL trains on).

    Raises:
        ValueError: the data set has no ``input_ids``/``labels`` columns (it was not prepared by TRL), or an
            example without a trained token (named by index).
    """
    names = set(dataset.column_names or [])
    if not {"input_ids", "labels"} <= names:
        raise ValueError(f"tokenized_examples: expected TRL's prepared columns input_ids and labels, got "
                         f"{sorted(names)}.")
    return load_data(dataset.select_columns(["input_ids", "labels"]), max_length=None, progress=False)


def per_example_token_mean(per_token: torch.Tensor, label_mask: torch.Tensor, n_examples: int,
                           seq_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Each example's mean of a per-token loss over its trained tokens.

    Args:
        per_token: ``(B, T-1)`` per-token loss of TRL's fused LM head (zero where the label is -100).
        label_mask: ``(B, T-1)`` bool, the trained positions.
        n_examples: B, or the number of examples packed into the one row of a padding-free batch.
        seq_idx: ``(1, T)`` example index of every token of a padding-free batch (TRL's collator), else None.

    Returns:
        ``(n_examples,)`` per-example losses.

    Raises:
        ValueError: an example without a trained token (named by row).
    """
    mask = label_mask.to(per_token.dtype)
    if seq_idx is None:
        sums, counts = (per_token * mask).sum(dim=1), mask.sum(dim=1)
    else:
        # token t predicts label t + 1; t belongs to example seq_idx[t]. Padding after the last example reads as
        # further "examples" (position id 0) and is masked: fold it into the last one, where it adds zero.
        owner = seq_idx[0, : per_token.shape[1]].to(device=per_token.device, dtype=torch.long).clamp(max=n_examples - 1)
        zeros = per_token.new_zeros(n_examples)
        sums = zeros.index_add(0, owner, (per_token * mask)[0])
        counts = zeros.index_add(0, owner, mask[0])
    empty = (counts == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"ClusterSFTTrainer: examples {empty[:10]} of the batch have no trained token; their loss is "
                         "undefined. Check the masking flags (completion_only_loss / assistant_only_loss) and data.")
    return sums / counts


def _refuse_unsupported(args: SFTConfig, who: str) -> None:
    if getattr(args, "packing", False):
        raise ValueError(
            f"{who}: packing=True merges several examples into one training row, so a row is no longer one plan "
            "example: the per-rank example lists and the per-example weights cannot be applied. Set packing=False "
            "(padding_free=True keeps most of the speed-up: a batch is concatenated into one row, but every example "
            "keeps its own loss and weight)."
        )
    if getattr(args, "shuffle_dataset", False):
        raise ValueError(
            f"{who}: shuffle_dataset=True reorders the tokenised data set, so the plan's indices would point at other "
            "examples. Leave it False: the plan sampler reshuffles every epoch (the same way on all ranks)."
        )


class ClusterSFTTrainer(PlanTrainerMixin, SFTTrainer):
    """TRL ``SFTTrainer`` training every rank on its plan examples with plan weights (module docstring).

    Args:
        *args, **kwargs: as for ``trl.SFTTrainer``; ``train_dataset`` is what TRL tokenises (raw
            ``messages`` / ``prompt``-``completion`` / ``text`` rows, or tokenised ones), or an SFTDataset.
        plan: the :class:`~clusterlm.plan.Plan` to train on, made for the TRL-tokenised examples
            (:func:`sft_examples`).
        plan_dir: where a plan is read from when neither ``plan`` nor ``select_kwargs`` is given, and where
            a plan selected at train begin is saved (default ``args.output_dir/plan``).
        select_kwargs: keyword arguments of :func:`clusterlm.selection.select.select`: rank 0 selects at the start of
            :meth:`train` on the TRL-tokenised examples, saves to ``plan_dir``; the others load it.
        allow_other_model: train even when the plan's ``model_id`` names another model.

    Raises:
        TypeError: plan is not a Plan, select_kwargs not a dict, an unusable train_dataset type.
        ValueError: both plan and select_kwargs, packing, shuffle_dataset, label smoothing, compute_loss_func,
            a plan for another world size.
    """

    plan_trainer_name = "ClusterSFTTrainer"

    def __init__(self, *args: Any, plan: Plan | None = None, plan_dir: str | os.PathLike | None = None,
                 select_kwargs: Mapping[str, Any] | None = None, allow_other_model: bool = False,
                 **kwargs: Any) -> None:
        check_plan_arguments(self.plan_trainer_name, plan, select_kwargs)
        bound = inspect.signature(SFTTrainer.__init__).bind(self, *args, **kwargs)
        _refuse_unsupported(bound.arguments.get("args"), self.plan_trainer_name)
        if bound.arguments.get("train_dataset") is not None:
            bound.arguments["train_dataset"] = to_trl_dataset(bound.arguments["train_dataset"])
        super().__init__(*bound.args[1:], **bound.kwargs)
        self.data_collator = PlanCollator(self.data_collator)
        self._examples: tuple[int, SFTDataset] | None = None
        self.setup_plan(plan, plan_dir, select_kwargs, allow_other_model)

    def plan_examples(self) -> SFTDataset:
        """The training examples as TRL prepared them (``input_ids`` and trained labels), as an SFTDataset."""
        if self._examples is None or self._examples[0] != id(self.train_dataset):
            self._examples = (id(self.train_dataset), tokenized_examples(self.train_dataset))
        return self._examples[1]

    def prepare_plan(self, resuming: bool = False) -> Plan:
        """As :meth:`PlanTrainerMixin.prepare_plan`; a fingerprint mismatch says how to make a matching plan."""
        try:
            return super().prepare_plan(resuming=resuming)
        except ValueError as err:
            if str(err).startswith("Plan.verify:"):
                raise ValueError(f"{err} For {self.plan_trainer_name}, {_HOW_TO_PLAN}.") from None
            raise

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """Plan-weighted ``mean_b(w_b * loss_b)`` for plan batches; ``SFTTrainer.compute_loss`` otherwise."""
        if WEIGHT_KEY not in inputs:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        inputs = dict(inputs)
        weights = inputs.pop(WEIGHT_KEY)
        inputs["use_cache"] = False
        if self.aux_loss_enabled:
            inputs["output_router_logits"] = True
        outputs = model(**inputs, fused_lm_head=True)
        per_token = -outputs.log_probs
        if self.args.loss_type == "dft":  # DFT (arXiv 2508.05629): the token loss scaled by its detached probability
            per_token = per_token * outputs.log_probs.exp().detach()
        per_example = per_example_token_mean(per_token, outputs.label_mask, len(weights), inputs.get("seq_idx"))
        loss = weighted_loss(per_example, weights)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss
        self._record_metrics(outputs, inputs)
        return (loss, outputs) if return_outputs else loss

    def _record_metrics(self, outputs: Any, inputs: Mapping[str, Any]) -> None:
        """TRL's logged metrics of a training batch: entropy, mean token accuracy, tokens seen."""
        mode = "train" if self.model.training else "eval"
        gather = self.accelerator.gather_for_metrics
        valid = gather(outputs.label_mask.sum()).sum()
        for key, value in (("entropy", outputs.entropy), ("mean_token_accuracy", outputs.is_top1)):
            if value is not None:
                total = gather(value.detach().sum()).sum()
                self._metrics[mode][key].append((total / valid).item() if valid > 0 else 0.0)
        if mode == "train":
            if "attention_mask" in inputs:
                local = inputs["attention_mask"].sum()
            else:
                local = torch.tensor(inputs["input_ids"].numel(), device=inputs["input_ids"].device)
            self._total_train_tokens += gather(local).sum().item() // getattr(self, "_tp_size", 1)
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]


def sft_examples(model: Any, train_dataset: Any, args: SFTConfig | None = None, processing_class: Any = None,
                 formatting_func: Any = None) -> SFTDataset:
    """The examples TRL trains on for these arguments, as an :class:`~clusterlm.data.SFTDataset` for selection.

    Runs TRL's own preparation (chat template, masking flags, truncation) by building a
    :class:`ClusterSFTTrainer` without a plan, so ``clusterlm.select(model, sft_examples(...), ...)`` gives a
    plan whose fingerprint a :class:`ClusterSFTTrainer` with the same ``args`` accepts. Like any
    ``SFTTrainer``, this adds TRL's fused LM head to ``model`` (its outputs are unchanged unless called with
    ``fused_lm_head=True``). Under torchrun every rank must call it.

    Args:
        model, train_dataset, args, processing_class, formatting_func: as for ``trl.SFTTrainer``.

    Raises:
        ValueError / TypeError: as :class:`ClusterSFTTrainer` (packing, shuffle_dataset, data set types).
    """
    trainer = ClusterSFTTrainer(model=model, args=args, train_dataset=train_dataset,
                                processing_class=processing_class, formatting_func=formatting_func)
    return trainer.plan_examples()
