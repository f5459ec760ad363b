"""GradientFeaturizer against an independent oracle: batch-size-1 autograd, projected in float64."""

import numpy as np
import peft
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import clusterlm.selection.features as features_mod
import clusterlm.selection.features.gradients as gradients_mod
from cluster_kernels.projection import random_projection
from clusterlm.selection.features import GradientFeaturizer

VOCAB = 61


def tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        return LlamaForCausalLM(cfg)
    if arch == "gpt2":
        cfg = GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
        )
        return GPT2LMHeadModel(cfg)
    if arch == "qwen2":
        cfg = Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        return Qwen2ForCausalLM(cfg)
    raise AssertionError(arch)


def make_examples(lengths, seed=0, prompt_frac=0.5):
    rng = np.random.default_rng(seed)
    out = []
    for length in lengths:
        ids = rng.integers(0, VOCAB, length)
        labels = ids.copy()
        labels[: max(1, int(length * prompt_frac))] = -100  # prompt tokens do not count
        labels[-1] = ids[-1]
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def oracle(model, examples, layer_names, k_o, k_i, *, seed=0, normalize=True):
    """Per-example gradients one example at a time with ordinary autograd, projected explicitly in float64."""
    head = model.get_output_embeddings()
    head_name = next(n for n, m in model.named_modules() if m is head)
    modules = dict(model.named_modules())
    was_training = model.training
    model.eval()
    rows = []
    for ex in examples:
        captured = {}
        hook = head.register_forward_pre_hook(lambda m, a, c=captured: c.__setitem__("h", a[0]))
        model(input_ids=torch.tensor(ex["input_ids"])[None])
        hook.remove()
        h = captured["h"][0]
        w_head = head.weight.detach().clone().requires_grad_(True)  # own leaf: GPT-2 ties it to the embeddings
        logits = h @ w_head.T + (head.bias if head.bias is not None else 0)
        loss = F.cross_entropy(logits[:-1], torch.tensor(ex["labels"])[1:], ignore_index=-100)
        names = [n for n in layer_names if n != head_name] + [n for n in layer_names if n == head_name]
        params = [w_head if n == head_name else modules[n].weight for n in names]
        grads = torch.autograd.grad(loss, params)
        phi = torch.zeros(k_o, k_i, dtype=torch.float64)
        for name, grad in zip(names, grads, strict=True):
            grad = grad.double()
            if type(modules[name]).__name__ == "Conv1D":  # stores W as (d_in, d_out)
                grad = grad.T
            p_in = random_projection(grad.shape[1], k_i, seed=seed, name=f"{name}/in", dtype=torch.float64)
            p_out = random_projection(grad.shape[0], k_o, seed=seed, name=f"{name}/out", dtype=torch.float64)
            phi += p_out.T @ grad @ p_in
        v = phi.flatten()
        rows.append(v / v.norm() if normalize else v)
    model.train(was_training)
    return torch.stack(rows).numpy()


def paper_oracle(model, examples, normalize=True):
    head = model.get_output_embeddings()
    rows = []
    model.eval()
    with torch.no_grad():
        for ex in examples:
            captured = {}
            hook = head.register_forward_pre_hook(lambda m, a, c=captured: c.__setitem__("h", a[0]))
            logits = model(input_ids=torch.tensor(ex["input_ids"])[None]).logits[0].double()
            hook.remove()
            h = captured["h"][0].double()
            y = torch.tensor(ex["labels"])[1:]
            keep = y != -100
            p_y = torch.softmax(logits[:-1][keep], dim=-1)[torch.arange(int(keep.sum())), y[keep]]
            v = ((p_y - 1)[:, None] * h[:-1][keep]).mean(0)
            rows.append(v / v.norm() if normalize else v)
    return torch.stack(rows).numpy()


EXAMPLES = make_examples([5, 9, 3, 12, 1 + 6, 2])


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("layers", ["all-linear", "lm_head"])
def test_features_match_per_example_autograd_oracle(arch, layers):
    model = tiny_model(arch)
    feat = GradientFeaturizer(model, features=layers, dim=(8, 6), seed=3)
    got = feat.featurize(EXAMPLES, batch_tokens=30, progress=False)
    assert got.dtype == np.float32 and got.shape == (len(EXAMPLES), 48)
    ref = oracle(model, EXAMPLES, feat.layer_names, 8, 6, seed=3)
    np.testing.assert_allclose(got, ref, atol=2e-6, rtol=0)


def test_explicit_layer_list_and_unnormalised_features_match_oracle():
    model = tiny_model("llama")
    names = ["model.layers.1.mlp.down_proj", "model.layers.0.self_attn.q_proj", "lm_head"]
    feat = GradientFeaturizer(model, features=names, dim=12, normalize=False)
    assert (feat.k_o, feat.k_i) == (3, 4)
    got = feat.featurize(EXAMPLES, progress=False)
    ref = oracle(model, EXAMPLES, feat.layer_names, 3, 4, normalize=False)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7 * np.abs(ref).max())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_paper_preset_is_the_authors_proxy(arch):
    model = tiny_model(arch)
    feat = GradientFeaturizer(model, features="paper")
    assert feat.feature_dim == 32 and not feat.needs_backward
    got = feat.featurize(EXAMPLES, progress=False)
    np.testing.assert_allclose(got, paper_oracle(model, EXAMPLES), atol=2e-6, rtol=0)
    raw = GradientFeaturizer(model, features="paper", normalize=False).featurize(EXAMPLES, progress=False)
    ref = paper_oracle(model, EXAMPLES, normalize=False)
    np.testing.assert_allclose(raw, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def test_lora_preset_projects_the_lora_a_and_b_gradients():
    base = tiny_model("llama")
    cfg = peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.5, init_lora_weights=False
    )  # B != 0, so A has a gradient too
    model = peft.get_peft_model(base, cfg)
    model.train()  # dropout active in training mode: the featurizer must switch it off
    feat = GradientFeaturizer(model, features="lora", dim=(5, 4))
    assert len(feat.layer_names) == 2 * 2 * 3 and all(".lora_A." in n or ".lora_B." in n for n in feat.layer_names)
    got = feat.featurize(EXAMPLES, batch_tokens=20, progress=False)
    assert model.training
    ref = oracle(model, EXAMPLES, feat.layer_names, 5, 4)
    np.testing.assert_allclose(got, ref, atol=2e-6, rtol=0)


def test_an_examples_features_do_not_depend_on_its_batch():
    model = tiny_model("qwen2")
    feat = GradientFeaturizer(model, features="all-linear", dim=(6, 6))
    alone = np.stack([feat.featurize([ex], progress=False)[0] for ex in EXAMPLES])
    together = feat.featurize(EXAMPLES, batch_tokens=10_000, progress=False)
    other_mix = feat.featurize(EXAMPLES[::-1] + make_examples([20, 4], seed=9), batch_tokens=25, progress=False)
    np.testing.assert_allclose(together, alone, atol=1e-5, rtol=0)
    np.testing.assert_allclose(other_mix[: len(EXAMPLES)][::-1], alone, atol=1e-5, rtol=0)


def test_model_state_is_restored_and_no_weight_gradient_is_computed():
    model = tiny_model("llama")
    model.train()
    model.model.layers[0].eval()  # mixed training flags must come back as they were
    model.model.layers[1].mlp.up_proj.weight.requires_grad_(False)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    training = {n: m.training for n, m in model.named_modules()}
    seen = {}

    def spy(module, args, output):
        seen["requires_grad"] = module.weight.requires_grad
        seen["training"] = module.training

    spy_handle = model.model.layers[1].mlp.down_proj.register_forward_hook(spy)
    GradientFeaturizer(model, features="all-linear", dim=4).featurize(EXAMPLES, progress=False)
    spy_handle.remove()
    assert seen == {"requires_grad": False, "training": False}
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert {n: m.training for n, m in model.named_modules()} == training
    assert all(p.grad is None for p in model.parameters())  # activation-only backward
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks


def test_model_state_is_restored_on_error(monkeypatch):
    model = tiny_model("gpt2")
    model.train()

    def boom(*args, **kwargs):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(gradients_mod, "project_linear_grads", boom)
    with pytest.raises(RuntimeError, match="kernel failed"):
        GradientFeaturizer(model, features="all-linear", dim=4).featurize(EXAMPLES, progress=False)
    assert model.training and all(p.requires_grad for p in model.parameters())
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


@pytest.mark.parametrize("layers", ["paper", "lm_head"])
def test_head_presets_run_forward_only_and_never_build_logits(layers):
    model = tiny_model("llama")
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: seen.append((torch.is_grad_enabled(), out.shape)))
    feat = GradientFeaturizer(model, features=layers, dim=None if layers == "paper" else 16)
    feat.featurize(EXAMPLES, progress=False)
    hook.remove()
    assert seen and all(grad is False and shape[-2] == 0 for grad, shape in seen)


def test_all_linear_never_builds_full_logits():
    model = tiny_model("llama")
    shapes = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    GradientFeaturizer(model, features="all-linear", dim=4).featurize(EXAMPLES, progress=False)
    hook.remove()
    assert shapes and all(s[-2] == 0 for s in shapes)


def test_data_formats_give_identical_features():
    import datasets

    model = tiny_model("llama")
    feat = GradientFeaturizer(model, features="lm_head", dim=(4, 4))
    ref = feat.featurize(EXAMPLES, progress=False)
    ds = datasets.Dataset.from_list(EXAMPLES)
    np.testing.assert_array_equal(feat.featurize(ds, progress=False), ref)
    loader = torch.utils.data.DataLoader(EXAMPLES, batch_size=None)
    np.testing.assert_array_equal(feat.featurize(loader, progress=False), ref)

    def collate(batch):  # right-padded 2-D tensors with a mask, like a training collator
        width = max(len(ex["input_ids"]) for ex in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for r, ex in enumerate(batch):
            n = len(ex["input_ids"])
            ids[r, :n], labels[r, :n], mask[r, :n] = torch.tensor(ex["input_ids"]), torch.tensor(ex["labels"]), 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    batched = torch.utils.data.DataLoader(EXAMPLES, batch_size=4, collate_fn=collate)
    np.testing.assert_array_equal(feat.featurize(batched, progress=False), ref)


def test_batch_budget_does_not_change_features_beyond_rounding():
    model = tiny_model("gpt2")
    feat = GradientFeaturizer(model, features="all-linear", dim=(4, 8))
    a = feat.featurize(EXAMPLES, batch_tokens=1, progress=False)  # one example per batch
    b = feat.featurize(EXAMPLES, batch_tokens=100_000, shard_size=4, progress=False)
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_autocast_dtype_gives_close_features():
    model = tiny_model("llama")
    ref = GradientFeaturizer(model, features="all-linear", dim=(8, 8)).featurize(EXAMPLES, progress=False)
    low = GradientFeaturizer(model, features="all-linear", dim=(8, 8), dtype=torch.bfloat16).featurize(
        EXAMPLES, progress=False
    )
    cosine = (ref * low).sum(1) / np.linalg.norm(low, axis=1)
    assert cosine.min() > 0.98


def test_progress_bar_reports_examples_and_tokens_per_second(capsys):
    model = tiny_model("llama")
    GradientFeaturizer(model, features="lm_head", dim=4).featurize(EXAMPLES, progress=True)
    err = capsys.readouterr().err
    assert "ex/s" in err and "tok/s" in err and f"{len(EXAMPLES)}/{len(EXAMPLES)}" in err


def test_empty_data_gives_an_empty_array():
    feat = GradientFeaturizer(tiny_model("llama"), features="lm_head", dim=(2, 3))
    out = feat.featurize([], progress=False)
    assert out.shape == (0, 6) and out.dtype == np.float32


# ---- bad input -------------------------------------------------------------------------------------


def test_example_without_answer_tokens_is_refused_naming_its_index():
    data = make_examples([5, 6, 7])
    data[2]["labels"] = [-100] * 6 + [3]  # only labels[0] would count, and it predicts nothing
    data[2]["labels"][0] = 5
    data[2]["labels"][-1] = -100
    feat = GradientFeaturizer(tiny_model("llama"), features="lm_head", dim=4)
    with pytest.raises(ValueError, match="example 2 has no answer token"):
        feat.featurize(data, progress=False)


@pytest.mark.parametrize(
    ("example", "match"),
    [
        ({"input_ids": [1, 2, 3], "labels": [1, 2]}, "input_ids has 3 tokens but labels has 2"),
        ({"input_ids": [1, 2, VOCAB], "labels": [1, 2, 3]}, r"input_ids must be in \[0, 61\)"),
        ({"input_ids": [1, 2, 3], "labels": [1, 2, 99]}, r"labels must be in \[0, 61\) or -100"),
        ({"input_ids": [[1, 2]], "labels": [[1, 2]]}, "must be a 1-D sequence of ints"),
        ({"input_ids": [1, 2, 3]}, "must be a dict with 'input_ids' and 'labels'"),
    ],
)
def test_malformed_examples_are_refused_naming_the_index(example, match):
    feat = GradientFeaturizer(tiny_model("llama"), features="lm_head", dim=4)
    with pytest.raises((ValueError, TypeError), match=match):
        feat.featurize(make_examples([4]) + [example], progress=False)


def test_unknown_layer_names_list_the_available_ones():
    with pytest.raises(
        ValueError,
        match=r"no linear layer named 'model.layers.9.mlp'.*Available layers: lm_head, "
        r"model.layers.0.self_attn.q_proj",
    ):
        GradientFeaturizer(tiny_model("llama"), features=["model.layers.9.mlp", "lm_head"])


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(features="paper", dim=16), ValueError, "dimension is the hidden size"),
        (dict(features="everything"), ValueError, "layers must be one of"),
        (dict(features="lora"), ValueError, "has no LoRA layers"),
        (dict(features=[]), TypeError, "non-empty list of module names"),
        (dict(features=["lm_head", "lm_head"]), ValueError, "lists a name twice"),
        (dict(features="lm_head", dim=(0, 4)), ValueError, "must be positive"),
        (dict(features="lm_head", dim="64"), TypeError, "dim must be None, an int"),
        (dict(features="lm_head", projection="sparse"), ValueError, "projection must be one of"),
        (dict(layers="lm_head", dtype=torch.int8), TypeError, "dtype must be None or a floating"),
    ],
)
def test_bad_configuration_is_refused(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        GradientFeaturizer(tiny_model("llama"), **kwargs)


def test_models_without_an_lm_head_are_refused():
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with pytest.raises(ValueError, match="has no lm head"):
        GradientFeaturizer(LlamaModel(cfg))
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        GradientFeaturizer("gpt2")


def test_gradient_checkpointing_is_refused_with_the_fix():
    model = tiny_model("llama")
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
        GradientFeaturizer(model, features="all-linear", dim=4).featurize(EXAMPLES, progress=False)


def test_featurize_batch_equals_the_rows_of_featurize():
    feat = GradientFeaturizer(tiny_model("gpt2"), features="all-linear", dim=(4, 4))
    rows = feat.featurize(EXAMPLES, batch_tokens=10_000, progress=False)
    batch = feat.featurize_batch(EXAMPLES)
    assert isinstance(batch, torch.Tensor) and batch.dtype == torch.float32
    np.testing.assert_allclose(batch.numpy(), rows, atol=1e-6, rtol=0)
    assert feat.featurize_batch([]).shape == (0, 16)


# ---- feature window ----------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.integers(1, 40), answer=st.integers(1, 40), max_tokens=st.integers(2, 50), holes=st.booleans()
)
def test_feature_window_keeps_the_answer_start_and_its_length(prompt, answer, max_tokens, holes):
    labels = np.array([-100] * prompt + list(range(answer)), dtype=np.int64)
    if holes and answer > 2:
        labels[prompt + 1] = -100  # masked tokens inside the answer (multi-turn chats)
    lo, hi = features_mod.feature_window(labels, max_tokens)
    t = len(labels)
    assert 0 <= lo < hi <= t and hi - lo == min(t, max_tokens)
    assert (labels[lo + 1 : hi] != -100).any()  # at least one answer token is predicted inside
    if t > max_tokens:
        assert lo < prompt <= hi - 1  # the window holds the first answer token
        assert prompt - lo <= max(1, max_tokens // 4) or hi == t  # more context only when the answer ran out


def test_max_tokens_features_equal_the_features_of_the_cut_examples():
    model = tiny_model("llama")
    data = make_examples([30, 9, 17, 41, 6], seed=3, prompt_frac=0.4)
    cut = []
    for ex in data:
        lo, hi = features_mod.feature_window(np.asarray(ex["labels"]), 12)
        cut.append({"input_ids": ex["input_ids"][lo:hi], "labels": ex["labels"][lo:hi]})
    windowed = GradientFeaturizer(model, features="lm_head", dim=(4, 4), feature_tokens=12)
    whole = GradientFeaturizer(model, features="lm_head", dim=(4, 4))
    a = windowed.featurize(data, progress=False)
    np.testing.assert_allclose(a, whole.featurize(cut, progress=False), atol=1e-6, rtol=0)
    assert np.abs(a - whole.featurize(data, progress=False)).max() > 1e-3  # the window does change long examples
    assert windowed.config()["max_tokens"] == 12 and whole.config()["max_tokens"] is None


@pytest.mark.parametrize("bad", [0, 1, 2.5, True, "64"])
def test_bad_max_tokens_is_refused(bad):
    with pytest.raises(ValueError, match="feature_tokens must be None"):  # renamed from max_tokens (issue 20)
        GradientFeaturizer(tiny_model("llama"), features="lm_head", dim=4, feature_tokens=bad)
