"""Trainer integrations of clusterlm plans.

- :mod:`clusterlm.integrations.hf`: ``ClusterTrainer``, a Hugging Face ``transformers.Trainer`` that trains
  every rank on its part of a :class:`clusterlm.plan.Plan` with the plan's per-example weights.

Nothing is imported here, so ``import clusterlm.integrations`` does not import ``transformers``.
"""
