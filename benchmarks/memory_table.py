"""Per-GPU memory of ``select`` and ``train`` for Llama 7B / 13B / 70B, computed on the meta device.

Nothing here allocates real memory or needs a GPU: the models are built under ``torch.device("meta")`` from
``transformers.LlamaConfig`` (Llama-2 shapes), so parameter bytes are counted exactly, and one decoder layer of
each model is run on meta tensors to count what it keeps alive:

- saved for backward: every tensor autograd saves (``torch.autograd.graph.saved_tensors_hooks``), deduplicated
  by storage, parameters excluded; attention as flash/memory-efficient SDPA keeps it on a GPU (q, k, v, the
  output and the float32 log-sum-exp; the meta device would otherwise take the math path and its T x T matrix);
- the featurizer's hooks: with ``all-linear`` features every linear layer's input is held until its gradient
  arrives (union with the saved tensors, by storage);
- forward only (lm-head / paper features, no backward): the peak of live tensor bytes inside one layer, tracked
  op by op with a ``TorchDispatchMode``.

Training is the reference trainer's recipe (float32 weights, bf16 autocast, AdamW): ``F.linear`` is wrapped to cast
its input and weight to bfloat16 as autocast does, so the bf16 weight copies saved for backward are counted.
Activations scale linearly with tokens and layers: ``layers x (bytes per token of one layer) x tokens``.

Usage::

    python benchmarks/memory_table.py            # prints the markdown tables of docs/scaling.md section 4
"""

from __future__ import annotations

import argparse
import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

GIB = 1024**3
GB80 = 80 * 1000**3  # an "80 GB" H100/A100: 80 GB (decimal) of HBM, 74.5 GiB as torch reports it
MODELS = {  # Llama-2: hidden, intermediate, layers, heads, kv heads
    "Llama-2-7B": (4096, 11008, 32, 32, 32),
    "Llama-2-13B": (5120, 13824, 40, 40, 40),
    "Llama-2-70B": (8192, 28672, 80, 64, 8),
}
VOCAB = 32000
SELECT_TOKENS = 8192  # clusterlm.selection.features.DEFAULT_BATCH_TOKENS
TRAIN_TOKENS = 4 * 1024  # the trainer's defaults: micro-batch 4 x max length 1024
K_FEATURE = 32  # default projected feature 32 x 32
LOGIT_BYTES = 12  # per token and vocabulary entry at the loss: bf16 logits, fp32 copy and log-softmax, gradient
FSDP_RANKS = 8


def llama_config(name: str, layers: int | None = None) -> Any:
    from transformers import LlamaConfig

    hidden, inter, n_layers, heads, kv = MODELS[name]
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers or n_layers,
                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=VOCAB,
                      max_position_embeddings=4096, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def param_counts(name: str) -> dict[str, int]:
    """Exact parameter counts of the whole model, its embedding, its lm head and one decoder layer."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(name))
    return {
        "total": sum(p.numel() for p in model.parameters()),
        "embed": model.model.embed_tokens.weight.numel(),
        "head": model.lm_head.weight.numel(),
        "layer": sum(p.numel() for p in model.model.layers[0].parameters()),
        "layers": model.config.num_hidden_layers,
    }


class _FlashSDPA(torch.autograd.Function):
    """Stand-in for a GPU's fused SDPA: output shape of q, saves q, k, v, out and a float32 log-sum-exp."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    dt = torch.bfloat16  # autocast runs SDPA in bf16; bf16 models are bf16 already
    return _FlashSDPA.apply(q.to(dt), k.to(dt), v.to(dt))


@contextlib.contextmanager
def _patched(autocast_linear: bool, weight_casts: set[int] | None = None) -> Iterator[None]:
    """Flash-style SDPA, and (training) F.linear casting input and weight to bf16 as autocast does.

    The storages of the weights' bf16 copies are added to ``weight_casts``.
    """
    orig_sdpa, orig_linear = F.scaled_dot_product_attention, F.linear

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        dt = torch.bfloat16
        w16 = w.to(dt)
        if weight_casts is not None:
            weight_casts.add(w16.untyped_storage()._cdata)
        return orig_linear(x.to(dt), w16, None if b is None else b.to(dt))

    F.scaled_dot_product_attention = _sdpa
    if autocast_linear:
        F.linear = linear
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.linear = orig_sdpa, orig_linear


def _layer(name: str, dtype: torch.dtype, trainable: bool) -> tuple[Any, Any]:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(name, layers=1)).to(dtype)
    for p in model.parameters():
        p.requires_grad_(trainable)
    return model, model.model.layers[0]


def _run_layer(model: Any, layer: Any, tokens: int, dtype: torch.dtype, grad: bool) -> torch.Tensor:
    h = torch.empty(1, tokens, model.config.hidden_size, dtype=dtype, device="meta", requires_grad=grad)
    pos = torch.arange(tokens, device="meta")[None]
    cos, sin = model.model.rotary_emb(h, pos)
    return layer(h, attention_mask=None, position_ids=pos, position_embeddings=(cos.to(dtype), sin.to(dtype)))


def saved_bytes(name: str, *, train: bool, hold_linear_inputs: bool, tokens: int = 256) -> tuple[float, int]:
    """What one decoder layer keeps for its backward: bytes per token, and bytes of bf16 weight copies (training).

    Saved tensors plus, with ``hold_linear_inputs``, the linear layers' inputs the featurizer's hooks hold.
    """
    dtype = torch.float32 if train else torch.bfloat16
    model, layer = _layer(name, dtype, trainable=train)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    kept: dict[int, int] = {}
    casts: set[int] = set()

    refs: list[torch.Tensor] = []  # held, as the graph and the hooks hold them: no storage address is reused

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in params:
            kept[st._cdata] = st.nbytes()
            refs.append(t)
        return t

    def hold(module: Any, args: tuple, output: Any) -> None:
        pack(args[0])  # the featurizer's hook keeps the input until the layer's gradient arrives

    handles = []
    if hold_linear_inputs:
        for mod in layer.modules():
            if isinstance(mod, torch.nn.Linear):
                handles.append(mod.register_forward_hook(hold))
    with _patched(autocast_linear=train, weight_casts=casts), torch.autograd.graph.saved_tensors_hooks(pack,
                                                                                                      lambda t: t):
        _run_layer(model, layer, tokens, dtype, grad=True)
    for hd in handles:
        hd.remove()
    fixed = sum(b for k, b in kept.items() if k in casts)
    return (sum(kept.values()) - fixed) / tokens, fixed


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of live tensors produced by ops (views and in-place results not counted twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and id(t) not in self.live:
                    self.live[id(t)] = t.untyped_storage().nbytes()
                    weakref.finalize(t, self.live.pop, id(t), None)
        self.peak = max(self.peak, sum(self.live.values()))
        return out


def forward_peak_per_token(name: str, tokens: int = 256) -> float:
    """Peak live bytes inside one bf16 decoder layer's no-grad forward, per token (its input included)."""
    model, layer = _layer(name, torch.bfloat16, trainable=False)
    with torch.no_grad(), _patched(autocast_linear=False), _LiveBytes() as spy:
        _run_layer(model, layer, tokens, torch.bfloat16, grad=False)
    hidden = model.config.hidden_size * 2  # the input hidden state, created outside the mode
    return spy.peak / tokens + hidden


def rows_for(name: str) -> dict[str, Any]:
    """Every number of one model's rows (bytes)."""
    pc = param_counts(name)
    p, layers, hidden = pc["total"], pc["layers"], MODELS[name][0]
    fwd = forward_peak_per_token(name)
    sel_back, _ = saved_bytes(name, train=False, hold_linear_inputs=True)
    train_act, casts = saved_bytes(name, train=True, hold_linear_inputs=False)
    # select, bf16 weights: forward-only lm-head features (the default), or an activation backward (all-linear)
    head_feat = SELECT_TOKENS * (2 * hidden * 2 + 4 * (K_FEATURE + 2))  # h and its counted-token copy, read-out
    select_head = 2 * p + SELECT_TOKENS * fwd + head_feat
    lm_grad = SELECT_TOKENS * hidden * (2 + 4) + 2 * (1 << 22) * 4  # dL/dh (bf16 and fp32), two logits chunks
    select_all = 2 * p + SELECT_TOKENS * (layers * sel_back + fwd) + head_feat + lm_grad
    act = TRAIN_TOKENS * (layers * train_act + VOCAB * LOGIT_BYTES)
    ddp_states = 16 * p + 4 * p + layers * casts  # fp32 weights, grads, AdamW m and v; DDP's gradient buckets;
    # autocast's bf16 copy of every layer's weights, saved for backward
    # FSDP2 as clusterlm.engine.fsdp shards (MixedPrecisionPolicy: bf16 params, float32 reduce): the shards, two
    # gathered
    # bf16 blocks with their float32 gradients for the reduce-scatter, and the root (embedding, lm head) likewise
    fsdp_states = 16 * p / FSDP_RANKS + (2 * pc["layer"] + pc["embed"] + pc["head"]) * (2 + 4)
    return {
        "name": name, "params": p, "fwd_tok": fwd, "sel_back_tok": sel_back, "train_tok": train_act,
        "select_head": select_head, "select_all": select_all, "ddp": ddp_states + act, "ddp_states": ddp_states,
        "fsdp": fsdp_states + act, "fsdp_states": fsdp_states, "act": act, "layers": layers,
    }


def _gib(b: float) -> str:
    return f"{b / GIB:,.1f}"


def _fits(b: float) -> str:
    return "yes" if b <= GB80 * 0.95 else "no"


def render(rows: list[dict[str, Any]]) -> str:
    """The markdown of docs/scaling.md section 4 (the tables; the prose is in the doc)."""
    out = ["| model | parameters | weights bf16 (GiB) | layer, forward only (KiB / token) | layer, all-linear "
           "backward (KiB / token) | layer, training (KiB / token) |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['name']} | {r['params']:,} | {_gib(2 * r['params'])} | {r['fwd_tok'] / 1024:,.1f} | "
                   f"{r['sel_back_tok'] / 1024:,.1f} | {r['train_tok'] / 1024:,.1f} |")
    out += ["", f"| model | select, lm-head features, {SELECT_TOKENS} tokens (GiB) | fits 80 GB | select, all-linear, "
            f"{SELECT_TOKENS} tokens (GiB) | fits 80 GB | train DDP, {TRAIN_TOKENS} tokens (GiB) | fits 80 GB | "
            f"train FSDP x {FSDP_RANKS}, {TRAIN_TOKENS} tokens (GiB) | fits 80 GB |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['name']} | {_gib(r['select_head'])} | {_fits(r['select_head'])} | {_gib(r['select_all'])} | "
                   f"{_fits(r['select_all'])} | {_gib(r['ddp'])} | {_fits(r['ddp'])} | {_gib(r['fsdp'])} | "
                   f"{_fits(r['fsdp'])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    rows = [rows_for(name) for name in MODELS]
    print(render(rows))
    for r in rows:
        print(f"\n{r['name']}: DDP states {_gib(r['ddp_states'])} GiB + activations and logits {_gib(r['act'])} GiB; "
              f"FSDP x {FSDP_RANKS} states {_gib(r['fsdp_states'])} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
