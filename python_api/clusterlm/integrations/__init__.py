"""Trainer integrations of clusterlm plans.

- :mod:`clusterlm.integrations.hf`: ``ClusterTrainer``, a Hugging Face ``transformers.Trainer`` that trains
  every rank on its part of a :class:`clusterlm.plan.Plan` with the plan's per-example weights.
- :mod:`clusterlm.integrations.trl`: ``ClusterSFTTrainer``, the same for TRL's ``SFTTrainer`` (TRL's data
  pipeline and fused LM head, per-example plan weights), and ``sft_examples`` to select on TRL's tokens.

Nothing is imported here, so ``import clusterlm.integrations`` does not import ``transformers`` or ``trl``.
"""
