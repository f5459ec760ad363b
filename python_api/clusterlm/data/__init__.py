"""Supervised fine-tuning data: load, tokenise, mask prompt tokens, fingerprint, collate.

An *example* is ``{"input_ids": int64 (T,), "labels": int64 (T,)}`` with ``labels == -100`` on every
token that is not trained (prompt, chat turns other than the assistant's) and ``labels[t] ==
input_ids[t]`` on answer tokens (the Hugging Face causal-LM convention: the model shifts internally).

Accepted sources (:func:`load_data`): a local ``.jsonl`` / ``.json`` / ``.parquet`` file (JSON read with the
standard library, so an error names the file and the 1-based line; Parquet with ``pyarrow``; nothing touches the
network or the user's HF cache), a directory written by ``Dataset.save_to_disk`` /
``DatasetDict.save_to_disk``, a list of dicts, a ``datasets.Dataset`` (or a ``DatasetDict`` with ``split``),
or already-tokenised example dicts. Record formats, detected from the columns:

- ``prompt`` / ``response`` ("prompt-response");
- ``prompt`` / ``completion`` ("prompt-completion", TRL's format): strings are read like prompt/response;
  conversational ones (lists of ``{"role", "content"}``) are the conversation ``prompt + completion``
  rendered like chat data, with only the completion's assistant turns trained;
- ``instruction`` / ``input`` (optional) / ``output`` ("alpaca"): prompt = instruction, plus
  ``"\\n\\n" + input`` when the input is non-empty;
- ``messages`` ("chat"): a list of ``{"role", "content"}`` rendered with the tokenizer's chat template;
  only assistant turns are trained;
- ``input_ids`` / ``labels`` ("tokenized"): used as given (truncated to ``max_length``).

Rendering. When the tokenizer has a chat template (an instruct model's), prompt/response and Alpaca
records are rendered through it by default, as the conversation ``[{"role": "user", "content": prompt},
{"role": "assistant", "content": response}]`` (so an instruct model is fine-tuned on the format it is used
with; only the assistant turn is trained, exactly like chat data). ``chat_template=False`` turns this off
(plain concatenation below); ``True`` requires a template. :attr:`SFTDataset.rendering` records which ran
(``"chat-template"`` or ``"plain"``).

How text is tokenised. Without a chat template, prompt and response are tokenised *separately*
(``add_special_tokens=False``) and concatenated as ``[bos] + prompt + response + [eos]`` (bos only if the
tokenizer has one, eos likewise), so the prompt/answer boundary is exact whatever the tokenizer merges across
it. The answer is ``response + [eos]``. Chat examples are cut into segments at the turn boundaries of the
rendered template: for assistant turn ``i`` the text added by ``messages[:i+1]`` over the generation prompt of
``messages[:i]`` (the content plus the template's end-of-turn marker, e.g. ``</s>``) is the answer, every
other segment (system/user turns, role headers, generation prompts) is masked. Each segment is tokenised on
its own, again for exact boundaries. Calls to the tokenizer are batched (thousands of examples per second with
a fast tokenizer).

Truncation. Sequences longer than ``max_length`` keep their head (so the prompt's beginning) and are
counted in ``SFTDataset.n_truncated``; nothing is dropped silently: an example left without an answer
token (after the causal shift, i.e. in ``labels[1:]``) raises a ``ValueError`` naming its index.

Empty answers. An example whose answer text is empty or only whitespace (the ``response``, ``completion`` or
``output``; every trained assistant turn of a conversation) has nothing to featurize or train on but an end-of-turn
token. When every example is such, :func:`read_data` refuses the data (naming the count and the first lines);
when some are, :func:`load_data` skips them with one ``UserWarning`` naming how many and where, and records them
in ``SFTDataset.n_empty`` / ``SFTDataset.empty_indices`` (their positions in the source). The data set, and so a
plan's indices and fingerprint, holds the other examples in source order; ``clusterlm train`` loads the file the
same way, so it trains exactly the plan's examples. ``SFTDataset.source_indices`` maps back to the source.

Modules: :mod:`~clusterlm.data.loading` (``load_data``, ``read_data``), :mod:`~clusterlm.data.sources` (files and
data set objects to columns), :mod:`~clusterlm.data.formats` (format detection, raw records, empty answers),
:mod:`~clusterlm.data.tokens` (text to tokens, chat templates) and :mod:`~clusterlm.data.dataset` (``SFTDataset``,
``fingerprint``, ``collate``).
"""

from typing import TYPE_CHECKING

from clusterlm.lazy import lazy_exports

if TYPE_CHECKING:  # the names for type checkers and the API reference (griffe); at run time: lazy_exports below
    from clusterlm.data.dataset import IGNORE_INDEX, SFTDataset, collate, fingerprint, lengths_of  # noqa: F401
    from clusterlm.data.formats import CHAT_TEMPLATE_MODES, FORMATS, RawData  # noqa: F401
    from clusterlm.data.loading import DEFAULT_MAX_LENGTH, load_data, read_data  # noqa: F401
    from clusterlm.data.sources import FILE_SUFFIXES, read_columns  # noqa: F401

# Each name is imported from its module on first use, as the top-level package's are: a process that only checks
# files or reads a plan (the ``clusterlm train --nproc N`` launcher) does not import torch for them.
_EXPORTS = {name: f"clusterlm.data.{module}" for module, names in {
    "dataset": ("IGNORE_INDEX", "SFTDataset", "collate", "fingerprint", "lengths_of"),
    "formats": ("CHAT_TEMPLATE_MODES", "FORMATS", "RawData"),
    "loading": ("DEFAULT_MAX_LENGTH", "load_data", "read_data"),
    "sources": ("FILE_SUFFIXES", "read_columns"),
}.items() for name in names}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
