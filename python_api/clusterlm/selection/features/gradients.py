"""The features of one batch: the hooks, the forward pass, the lm-head gradient and the activation-only backward.

:class:`BatchGradients` is the part of :class:`clusterlm.selection.features.GradientFeaturizer` that computes the
features of
one packed batch of checked examples (the module docstring of :mod:`clusterlm.selection.features` gives the maths): a
pre-hook
on the lm head keeps its input hidden states and hands the model empty logits, forward hooks on the chosen layers
project each layer's gradient as soon as it arrives (:func:`cluster_kernels.project_linear_grads`), and the lm head's
gradient is computed in token chunks (no ``(B, T, V)`` logits tensor). The random projections are cached per
``(layer, side, device)``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from cluster_kernels.lm_head_features import IGNORE_INDEX, example_mean_nll, lm_head_features
from cluster_kernels.project_linear_grads import project_linear_grads
from cluster_kernels.projection import random_projection
from clusterlm.selection.features.batching import PackedBatch, pack_batch
from clusterlm.selection.features.layers import Layer

__all__ = ["BatchGradients", "BatchOutput"]


class BatchOutput(NamedTuple):
    """What one batch gives: the features and, per example, the two signals that come with them for free.

    ``features``: (B, D) float32, L2-normalised when the featurizer normalises; ``norms``: (B,) float64, the L2 norm
    of each example's feature before that normalisation (the size of its projected gradient); ``losses``: (B,)
    float64, each example's mean answer-token cross-entropy in its feature window, from the forward pass that
    computed the feature (no second pass). All on the model's device.
    """

    features: torch.Tensor
    norms: torch.Tensor
    losses: torch.Tensor


class BatchGradients:
    """Features of one batch of checked examples, on the model's device (a base of ``GradientFeaturizer``).

    The featurizer sets what these methods read: ``model``, ``mode`` (``"paper"`` or ``"projected"``), ``k_o`` /
    ``k_i``, ``seed``, ``projection``, ``dtype``, ``normalize``, ``backend``, ``max_chunk_elems``, the lm head
    (``_lm_head``, ``_lm_head_name``, ``_include_head``), the other layers (``_layers``), the input embeddings
    (``_embeddings``), the projection cache (``_projections``), and the ``device`` / ``needs_backward`` properties.
    """

    def _projection(self, name: str, side: str, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        key = (name, side, str(device))
        if key not in self._projections:
            self._projections[key] = random_projection(
                rows, cols, seed=self.seed, name=f"{name}/{side}", kind=self.projection, device=device
            )
        return self._projections[key]

    # ---- model state --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _extraction_state(self) -> Iterator[None]:
        """Eval mode and frozen weights during extraction; the model's own state restored afterwards."""
        model = self.model
        if any(
            getattr(m, attr, False) is True
            for m in model.modules()
            for attr in ("gradient_checkpointing", "activation_checkpointing")
        ):
            raise ValueError(
                "GradientFeaturizer: gradient checkpointing is enabled; it re-runs forwards during "
                "backward, which the layer hooks cannot follow. Call "
                "model.gradient_checkpointing_disable() before featurizing."
            )
        training = {m: m.training for m in model.modules()}
        requires = {p: p.requires_grad for p in model.parameters()}
        try:
            model.eval()
            for p in requires:
                p.requires_grad_(False)  # activation-only backward: no weight-gradient GEMMs
            yield
        finally:
            for p, flag in requires.items():
                p.requires_grad_(flag)
            for m, flag in training.items():
                m.training = flag

    # ---- one batch ----------------------------------------------------------------------------------

    def _run_batch(self, batch: list[tuple[np.ndarray, np.ndarray]]) -> BatchOutput:
        """Features of checked examples, with their norms and losses; must run inside ``_extraction_state``."""
        if self.needs_backward and self._embeddings is None:
            raise ValueError(
                "GradientFeaturizer: the model has no get_input_embeddings(); the backward pass needs it "
                "to start gradients at the embeddings."
            )
        device = self.device
        batch_t = pack_batch(batch, device)
        n_ex, max_len = batch_t.input_ids.shape
        feats = torch.zeros(n_ex, self.k_o, self.k_i, dtype=torch.float32, device=device)
        losses = torch.zeros(n_ex, dtype=torch.float64, device=device)
        ctx = {"flat_idx": batch_t.flat_idx, "cu": batch_t.cu, "out": feats, "shape": (n_ex, max_len), "seen": set()}
        handles = []
        try:
            captured = self._capture_head_input(handles)
            if self.needs_backward:
                # Weights are frozen, so gradients must start at the embeddings' output.
                handles.append(self._embeddings.register_forward_hook(lambda m, a, out: out.requires_grad_(True)))
                for layer in self._layers:
                    handles.append(layer.module.register_forward_hook(self._make_layer_hook(layer, ctx, device)))
            with torch.enable_grad() if self.needs_backward else torch.no_grad():
                h = self._forward_hidden(batch_t, captured)
                h_packed = h.detach().reshape(-1, h.shape[-1]).index_select(0, batch_t.flat_idx)
                if self.needs_backward:
                    self._backward(h, h_packed, batch_t, feats, losses)
                else:
                    self._head_only(h_packed, batch_t, feats, losses)
        finally:
            for hd in handles:
                hd.remove()
        missing = [layer.name for layer in self._layers if layer.name not in ctx["seen"]]
        if missing:
            warnings.warn(
                f"GradientFeaturizer: no gradient reached layers {missing[:5]} (not on the path to the "
                "loss); they contribute zero.",
                RuntimeWarning,
                stacklevel=3,
            )
        out = feats.reshape(n_ex, -1)
        norms = out.double().norm(dim=1)  # before the normalisation: the size of the projected gradient
        if self.normalize:
            out = out / out.norm(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        return BatchOutput(out, norms, losses)

    def _capture_head_input(self, handles: list[Any]) -> dict[str, torch.Tensor]:
        """Hook the lm head: keep its input hidden states and hand the model empty logits instead."""
        captured: dict[str, torch.Tensor] = {}

        def head_pre_hook(module: nn.Module, args: tuple) -> tuple:
            if not args:
                raise RuntimeError("GradientFeaturizer: the lm head was called without positional hidden states.")
            captured["h"] = args[0]
            return (args[0][..., :0, :], *args[1:])  # the model gets empty logits: no (B, T, V) tensor

        handles.append(self._lm_head.register_forward_pre_hook(head_pre_hook))
        return captured

    def _forward_hidden(self, batch_t: PackedBatch, captured: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run the model; the (B, T, d) hidden states its lm head received."""
        autocast = (
            torch.autocast(device_type=batch_t.input_ids.device.type, dtype=self.dtype)
            if self.dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            self.model(input_ids=batch_t.input_ids, attention_mask=batch_t.attention_mask, use_cache=False)
        if "h" not in captured:
            raise RuntimeError(
                f"GradientFeaturizer: the lm head {self._lm_head_name!r} was not called during "
                "the forward pass; this model computes its logits another way."
            )
        h = captured.pop("h")
        if h.dim() != 3 or tuple(h.shape[:2]) != tuple(batch_t.input_ids.shape):
            raise RuntimeError(
                f"GradientFeaturizer: the lm head received hidden states of shape "
                f"{tuple(h.shape)}, expected (batch, seq, hidden)=({', '.join(map(str, batch_t.input_ids.shape))}, d)."
            )
        return h

    def _make_layer_hook(self, layer: Layer, ctx: dict[str, Any], device: torch.device) -> Any:
        p_in = self._projection(layer.name, "in", layer.d_in, self.k_i, device)
        p_out = self._projection(layer.name, "out", layer.d_out, self.k_o, device)

        def forward_hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not isinstance(output, torch.Tensor) or not output.requires_grad or not args:
                return
            x = args[0]
            if tuple(x.shape[:-1]) != ctx["shape"]:
                raise RuntimeError(
                    f"GradientFeaturizer: layer {layer.name!r} received inputs of shape "
                    f"{tuple(x.shape)}, not (batch, seq, features)={ctx['shape'] + ('d',)}; layers "
                    "that reshuffle tokens (e.g. MoE experts) are not supported."
                )

            def grad_hook(grad: torch.Tensor) -> None:
                xs = x.detach().reshape(-1, layer.d_in).index_select(0, ctx["flat_idx"])
                gs = grad.reshape(-1, layer.d_out).index_select(0, ctx["flat_idx"]).to(xs.dtype)
                project_linear_grads(xs, gs, ctx["cu"], p_in, p_out, out=ctx["out"], backend=self.backend)
                ctx["seen"].add(layer.name)

            output.register_hook(grad_hook)

        return forward_hook

    def _head_parameters(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The lm head's weight and bias (None without one), detached."""
        weight, bias = self._lm_head.weight.detach(), self._lm_head.bias
        return weight, bias.detach() if bias is not None else None

    def _head_only(self, h_packed: torch.Tensor, batch_t: PackedBatch, feats: torch.Tensor,
                   losses: torch.Tensor) -> None:
        """The lm head's feature from one vocabulary pass (no backward); ``losses`` gets each example's mean loss
        from the same pass."""
        tgt, token_w, cu = batch_t.targets, batch_t.token_weights, batch_t.cu
        weight, bias = self._head_parameters()
        device = h_packed.device
        if self.mode == "paper":
            res = lm_head_features(
                h_packed,
                weight,
                tgt,
                cu,
                mode="paper",
                bias=bias,
                backend=self.backend,
                max_chunk_elems=self.max_chunk_elems,
                losses=losses,
            )
            feats[:, 0, :] = res
            return
        p_in = self._projection(self._lm_head_name, "in", weight.shape[1], self.k_i, device)
        p_out = self._projection(self._lm_head_name, "out", weight.shape[0], self.k_o, device)
        lm_head_features(
            h_packed,
            weight,
            tgt,
            cu,
            p_in=p_in,
            p_out=p_out,
            mode="projected",
            bias=bias,
            token_weights=token_w,
            out=feats,
            backend=self.backend,
            max_chunk_elems=self.max_chunk_elems,
            losses=losses,
        )

    def _backward(self, h: torch.Tensor, h_packed: torch.Tensor, batch_t: PackedBatch, feats: torch.Tensor,
                  losses: torch.Tensor) -> None:
        """dL/dh from the lm head in token chunks (with each example's mean loss), the head's own feature, then the
        activation-only backward."""
        flat_idx, tgt, token_w, cu = batch_t.flat_idx, batch_t.targets, batch_t.token_weights, batch_t.cu
        weight, bias = self._head_parameters()
        device = h.device
        valid = (tgt != IGNORE_INDEX).nonzero().squeeze(1)
        hv, yv, wv = h_packed.index_select(0, valid), tgt.index_select(0, valid), token_w.index_select(0, valid)
        p_out = None
        if self._include_head:
            p_out = self._projection(self._lm_head_name, "out", weight.shape[0], self.k_o, device)
        grad_hv, g_proj, nll = _lm_head_backward(hv, weight, bias, yv, wv, p_out, self.max_chunk_elems)
        counts = torch.bincount(torch.searchsorted(cu[1:], valid, right=True), minlength=len(cu) - 1)
        cu_v = torch.cat([cu.new_zeros(1), torch.cumsum(counts, 0)])
        losses.copy_(example_mean_nll(nll, torch.zeros_like(nll), cu_v.cpu().numpy()))
        if self._include_head:
            p_in = self._projection(self._lm_head_name, "in", weight.shape[1], self.k_i, device)
            eye = torch.eye(self.k_o, dtype=torch.float32, device=device)
            project_linear_grads(hv.float(), g_proj, cu_v, p_in, eye, out=feats, backend=self.backend)
        grad_h = torch.zeros(h.shape[0] * h.shape[1], h.shape[2], dtype=h.dtype, device=device)
        grad_h.index_copy_(0, flat_idx.index_select(0, valid), grad_hv.to(h.dtype))
        torch.autograd.backward(h, grad_h.view_as(h))


def _lm_head_backward(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    token_w: torch.Tensor,
    p_out: torch.Tensor | None,
    max_chunk_elems: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``dL/dh_t = w_t W^T (p_t - e_{y_t})``, with ``p_out`` also ``w_t P_out^T (p_t - e_{y_t})`` (else None), and
    each token's cross-entropy ``lse_t - z_t[y_t]`` from the same logits; float32.

    Logits exist only for ``max_chunk_elems // V`` tokens at a time. Low-precision weights are multiplied
    in their own dtype (fp32 accumulation inside the GEMM) rather than copied to fp32.
    """
    n_tok, vocab = h.shape[0], weight.shape[0]
    chunk = max(1, max_chunk_elems // vocab)
    grad_h = torch.empty(n_tok, h.shape[1], dtype=torch.float32, device=h.device)
    g_proj = torch.empty(n_tok, p_out.shape[1], dtype=torch.float32, device=h.device) if p_out is not None else None
    nll = torch.empty(n_tok, dtype=torch.float32, device=h.device)
    for s in range(0, n_tok, chunk):
        e = min(n_tok, s + chunk)
        logits = (h[s:e].to(weight.dtype) @ weight.T).float()
        if bias is not None:
            logits += bias.float()
        nll[s:e] = torch.logsumexp(logits, dim=-1) - logits.gather(1, targets[s:e, None].long())[:, 0]
        d_logits = torch.softmax(logits, dim=-1)
        d_logits[torch.arange(e - s, device=h.device), targets[s:e]] -= 1.0
        d_logits *= token_w[s:e, None]
        grad_h[s:e] = (d_logits.to(weight.dtype) @ weight).float()
        if g_proj is not None:
            g_proj[s:e] = d_logits @ p_out
    return grad_h, g_proj, nll
