"""LESS baseline: LoRA gradients with Adam preconditioning, cosine similarity to validation gradients.

Source: Xia, Malladi, Gururangan, Arora, Chen, "LESS: Selecting Influential Data for Targeted
Instruction Tuning", ICML 2024 (arXiv:2402.04333), §3-4 and the authors' code (``less/``).
Small-scale re-implementation, step by step:

1. *Warm-up training* (§4.1 step 1): LoRA (LESS: rank 128, alpha 512, dropout 0.1, on
   ``q_proj,k_proj,v_proj,o_proj``; ours: ``lora_r`` = 8, alpha ``4 r``, the same targets and dropout)
   on a random ``warmup_fraction`` = 5 % of the training data for ``warmup_epochs`` = 4 epochs, a
   checkpoint after every epoch (AdamW, linear schedule with 3 % warm-up, through the trainer's own
   optimizer and step: :func:`clusterlm.selection.baselines._training.train_loop`).
2. *Per-example LoRA gradients* at every checkpoint (§4.1 step 2), of the example's mean answer-token
   loss: for a LoRA matrix ``W`` (``lora_A`` or ``lora_B``, a linear layer) with token inputs ``x_t``
   and output gradients ``g_t`` the example's gradient is ``sum_t g_t x_t^T``; both are captured with
   hooks in one batched forward/backward and reduced per example by our kernel
   :func:`cluster_kernels.project_linear_grads.segment_outer_sum` (exact, no projection yet).
3. *Adam preconditioning* of training gradients (§3.2 eq. 4; ``obtain_gradients_with_adam`` in their
   code, no bias correction, ``eps`` inside the root): with the checkpoint's Adam moments ``m, v``,
   ``Gamma(g) = (b1 m + (1 - b1) g) / sqrt(b2 v + (1 - b2) g^2 + eps)``. Validation gradients stay plain
   (SGD) gradients, as in LESS.
4. *Random projection* (§4.1, TRAK's projector, d = 8192 for 7B models): each LoRA matrix's flattened
   gradient ``(D_p,)`` is multiplied by its own Rademacher matrix
   :func:`cluster_kernels.projection.random_projection` ``(D_p, dim)`` keyed by ``(seed, parameter
   name)`` and the blocks are summed (a block Johnson-Lindenstrauss projection of the concatenated
   gradient, ``E[<Pa, Pb>] = <a, b>``); ``dim`` = :data:`LESS_DIM` = 1024 by default (our LoRA gradients
   have ~3e4 entries for the 128-wide demo model, LESS's ~1e7 for 8192).
5. *Score* (§3.3 eq. 5-6, ``matching.py``): cosine similarity of every projected training gradient
   with every projected validation gradient, averaged over the validation examples (one target task),
   summed over checkpoints with weights = the mean learning rate of each epoch, normalised to sum 1.
6. *Top budget* by score. A token budget (``token_ratio`` / ``token_budget``) takes the examples by score until
   it is met, the cluster method's rule (:mod:`clusterlm.selection.baselines._plans`): within one example per rank.

The validation set is a small set of examples of the target distribution (``compare`` takes it from
the held-out split and evaluates on the rest). Selection time includes the warm-up, the gradient
passes over all training data at every checkpoint, the validation gradients and the scoring.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from cluster_kernels.project_linear_grads import segment_outer_sum
from cluster_kernels.projection import random_projection
from clusterlm.config.baselines import LESS_BATCH_TOKENS, LESS_DIM, LESS_TARGETS, LessConfig
from clusterlm.data import collate, lengths_of
from clusterlm.engine.loss import per_example_loss
from clusterlm.plan import Plan
from clusterlm.selection.baselines._plans import make_plan, resolve_amount
from clusterlm.selection.baselines._training import (
    length_batches,
    pad_id_of,
    stage,
    train_loop,
)

__all__ = [
    "LESS_BATCH_TOKENS", "LESS_DIM", "LESS_TARGETS", "LessConfig", "adam_precondition", "less_plan", "less_scores",
    "lora_gradient_features", "lora_model", "lora_params",
]

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
_STREAM_LESS = 0x1E55


def lora_model(model: torch.nn.Module, *, r: int = LessConfig.lora_r, alpha: float | None = None,
               dropout: float = LessConfig.lora_dropout, targets: str = LESS_TARGETS, seed: int = 0) -> torch.nn.Module:
    """A PEFT LoRA copy of ``model`` (``model`` itself is not changed).

    Raises:
        ValueError: no module matches ``targets`` (from PEFT).
    """
    from peft import LoraConfig, get_peft_model

    names = [t.strip() for t in targets.split(",") if t.strip()] if targets != "all-linear" else "all-linear"
    config = LoraConfig(r=r, lora_alpha=alpha if alpha is not None else 4 * r, lora_dropout=dropout,
                        target_modules=names, task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(copy.deepcopy(model), config)


def lora_params(peft_model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """``(parameter name, module)`` of every LoRA matrix (``lora_A`` / ``lora_B`` linear layers), in order."""
    out = []
    for name, module in peft_model.named_modules():
        if isinstance(module, torch.nn.Linear) and (".lora_A." in f"{name}." or ".lora_B." in f"{name}."):
            out.append((f"{name}.weight", module))
    return out


def adam_precondition(grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      betas: tuple[float, float] = ADAM_BETAS, eps: float = ADAM_EPS) -> torch.Tensor:
    """LESS's Adam update direction for gradient(s) ``grad`` (``(..., *shape)``) given moments ``(*shape)``.

    ``(b1 m + (1 - b1) g) / sqrt(b2 v + (1 - b2) g^2 + eps)`` (no bias correction, as in LESS's code).
    """
    b1, b2 = betas
    m = b1 * exp_avg + (1 - b1) * grad
    v = b2 * exp_avg_sq + (1 - b2) * grad.pow(2)
    return m / torch.sqrt(v + eps)


def less_scores(train_features: Sequence[np.ndarray], val_features: Sequence[np.ndarray], lr_weights: Sequence[float]
                ) -> tuple[np.ndarray, np.ndarray]:
    """Step 5: ``score_i = sum_c w_c mean_j cos(train_c[i], val_c[j])``, ``w`` = ``lr_weights`` normalised.

    Args:
        train_features: per checkpoint, (N, dim) unit-norm training gradient features.
        val_features: per checkpoint, (M, dim) unit-norm validation gradient features.
        lr_weights: per checkpoint, the mean learning rate of its epoch.

    Returns:
        ``(scores (N,) float64, normalised weights)``.
    """
    weights = np.asarray(lr_weights, dtype=np.float64)
    weights = weights / weights.sum() if weights.sum() > 0 else np.full(len(weights), 1.0 / len(weights))
    scores = np.zeros(len(train_features[0]), dtype=np.float64)
    for w, tr, va in zip(weights, train_features, val_features, strict=True):
        scores += w * (np.asarray(tr, np.float64) @ np.asarray(va, np.float64).T).mean(axis=1)
    return scores, weights


def lora_gradient_features(
    peft_model: torch.nn.Module,
    examples: Sequence[dict[str, np.ndarray]],
    *,
    dim: int = LESS_DIM,
    seed: int = 0,
    adam_state: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    batch_tokens: int = LESS_BATCH_TOKENS,
    pad_id: int | None = None,
    projections: dict[str, torch.Tensor] | None = None,
) -> np.ndarray:
    """Projected, L2-normalised per-example LoRA gradients (steps 2-4 of the module docstring).

    Args:
        peft_model: a PEFT LoRA model (eval mode is used: no dropout).
        examples: tokenised examples; the loss of each is its mean answer-token cross entropy.
        dim: projected dimension.
        seed: projection seed.
        adam_state: parameter name -> ``(exp_avg, exp_avg_sq)``: precondition (training gradients); None
            for plain gradients (validation).
        batch_tokens: padded tokens per forward/backward.
        pad_id: padding id (default the model's).
        projections: a cache name -> ``(D_p, dim)`` matrix, filled on first use (reuse it across calls).

    Returns:
        (N, dim) float32, unit rows (zero rows stay zero).
    """
    params = lora_params(peft_model)
    if not params:
        raise ValueError("less: the model has no LoRA layers; build it with lora_model().")
    projections = {} if projections is None else projections
    device = next(peft_model.parameters()).device
    pad = pad_id_of(peft_model, pad_id)
    captured: dict[str, list[torch.Tensor]] = {}

    def hook(name: str) -> Any:
        def fwd(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            slot = [inputs[0].detach(), None]
            captured[name] = slot  # type: ignore[assignment]

            def save_grad(grad: torch.Tensor) -> None:
                slot[1] = grad.detach()

            output.register_hook(save_grad)
        return fwd

    handles = [module.register_forward_hook(hook(name)) for name, module in params]
    lengths = np.array([len(examples[i]["input_ids"]) for i in range(len(examples))], dtype=np.int64)
    out = torch.zeros(len(examples), dim, dtype=torch.float32)
    was_training = peft_model.training
    peft_model.eval()
    try:
        for idx in length_batches(lengths, batch_tokens):
            batch = collate([examples[int(i)] for i in idx], pad_id=pad)
            batch = {k: v.to(device) for k, v in batch.items()}
            captured.clear()
            logits = peft_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            # Sum of per-example losses: each example's tokens get the gradient of its own mean loss.
            per_example_loss(logits, batch["labels"]).sum().backward()
            peft_model.zero_grad(set_to_none=True)
            mask = batch["attention_mask"].bool()
            cu = np.concatenate([[0], np.cumsum(mask.sum(1).cpu().numpy())]).astype(np.int64)
            feats = torch.zeros(len(idx), dim, dtype=torch.float32, device=device)
            for name, module in params:
                x, g = captured[name]
                d_out, d_in = module.weight.shape
                grads = torch.zeros(len(idx), d_out, d_in, dtype=torch.float32, device=device)
                segment_outer_sum(g[mask].float(), x[mask].float(), cu, grads)
                if adam_state is not None:
                    m, v = adam_state[name]
                    grads = adam_precondition(grads, m.to(device, torch.float32), v.to(device, torch.float32))
                if name not in projections:
                    projections[name] = random_projection(d_out * d_in, dim, seed=seed, name=f"less/{name}",
                                                          device=device)
                feats += grads.reshape(len(idx), -1) @ projections[name]
            out[torch.as_tensor(idx)] = feats.cpu()
    finally:
        for h in handles:
            h.remove()
        peft_model.train(was_training)
    norms = out.norm(dim=1, keepdim=True)
    return (out / torch.where(norms > 0, norms, torch.ones_like(norms))).numpy()


def less_plan(
    model: torch.nn.Module,
    dataset: Any,
    world_size: int,
    ratio: float | None = None,
    budget: int | None = None,
    config: LessConfig | None = None,
    *,
    validation: Sequence[dict[str, np.ndarray]],
    token_ratio: float | None = None,
    token_budget: int | None = None,
    model_id: str = "",
    **overrides: Any,
) -> Plan:
    """The LESS selection (module docstring), as a plan.

    Args:
        model: the target causal LM (copied; not changed).
        dataset: tokenised training examples.
        world_size: ranks K.
        ratio / budget: fraction or number of examples; rounded down to a multiple of K.
        config: the settings (:class:`LessConfig`); ``overrides`` (any of its fields, e.g. ``lr=1e-3, dim=256``)
            are applied on top.
        validation: a few tokenised examples of the target distribution.
        token_ratio / token_budget: fraction or number of tokens (prompt + answer) instead of ratio / budget: by
            score until the budget is met, within one example per rank (``stats["token_budget"]``). Exactly one of
            the four.
        model_id: recorded in the plan.

    Returns:
        The :class:`Plan`; ``config["method"] == "less"``; ``timings`` ``warmup``, ``train_gradients``,
        ``val_gradients``, ``score``, ``selection``; ``stats["checkpoint_weights"]``.

    Raises:
        ValueError: not exactly one budget, a bad budget / world size, an empty validation set, a bad
            ``warmup_fraction``.
        TypeError: an unknown setting (the message lists the settings).
    """
    c = LessConfig.merged(config, overrides)
    seed, dim, batch_tokens = c.seed, c.dim, c.batch_tokens
    t0 = time.perf_counter()
    n = len(dataset)
    lengths = lengths_of(dataset)
    amount = resolve_amount(lengths, world_size, ratio, budget, token_ratio, token_budget, "less_plan")
    if len(validation) == 0:
        raise ValueError("less_plan: validation must hold at least one example of the target distribution.")
    if not 0 < c.warmup_fraction <= 1:
        raise ValueError(f"less_plan: warmup_fraction must be in (0, 1], got {c.warmup_fraction!r}; LESS uses 0.05.")
    timings: dict[str, float] = {}
    with stage(timings, "warmup"):
        peft_model = lora_model(model, r=c.lora_r, alpha=c.lora_alpha, dropout=c.lora_dropout,
                                targets=c.lora_targets, seed=seed)
    rng = np.random.default_rng(np.random.SeedSequence([seed, _STREAM_LESS]))
    n_warm = max(1, round(c.warmup_fraction * n))
    warm = np.sort(rng.choice(n, size=n_warm, replace=False)).astype(np.int64)
    steps_per_epoch = -(-n_warm // c.micro_batch_size)
    marks = [steps_per_epoch * (e + 1) for e in range(c.warmup_epochs)]
    names = {id(p): name for name, p in peft_model.named_parameters()}
    projections: dict[str, torch.Tensor] = {}
    train_feats: list[np.ndarray] = []
    val_feats: list[np.ndarray] = []
    lr_weights: list[float] = []

    def checkpoint(step: int, mean_lr: float, optimizer: Any) -> None:
        state = {names[id(p)]: (s["exp_avg"].detach().clone(), s["exp_avg_sq"].detach().clone())
                 for p, s in optimizer.state.items()}
        with stage(timings, "train_gradients"):
            train_feats.append(lora_gradient_features(peft_model, dataset, dim=dim, seed=seed, adam_state=state,
                                                      batch_tokens=batch_tokens, projections=projections))
        with stage(timings, "val_gradients"):
            val_feats.append(lora_gradient_features(peft_model, validation, dim=dim, seed=seed, adam_state=None,
                                                    batch_tokens=batch_tokens, projections=projections))
        lr_weights.append(mean_lr)

    t_warm = time.perf_counter()
    train_loop(peft_model, dataset, warm, c.warmup(marks), on_checkpoint=checkpoint)
    timings["warmup"] += time.perf_counter() - t_warm - timings.get("train_gradients", 0.0) - timings.get(
        "val_gradients", 0.0)
    with stage(timings, "score"):
        scores, weights = less_scores(train_feats, val_feats, lr_weights)
        order = np.lexsort((np.arange(n), -scores))
        selected, stats = amount.take(order, lengths, world_size)
    stats.update({"checkpoint_weights": weights.tolist(), "warmup_examples": int(n_warm),
                  "score_selected_min": float(scores[selected].min()), "score_max": float(scores.max())})
    record = {"method": "less", **amount.record, "warmup_fraction": float(c.warmup_fraction),
              "warmup_epochs": int(c.warmup_epochs), "lr": float(c.lr), "lora_r": int(c.lora_r),
              "lora_alpha": float(c.lora_alpha if c.lora_alpha is not None else 4 * c.lora_r),
              "lora_targets": c.lora_targets, "dim": int(dim), "n_validation": len(validation),
              "source": "Xia et al., LESS, ICML 2024, sec. 3-4"}
    return make_plan(dataset, selected, world_size, seed=seed, config=record, stats=stats, timings=timings, t0=t0,
                     model_id=model_id, token_balance=c.token_balance)
