"""The built-in demo data set: code instructions made from the Python standard library, offline.

``demo_data()`` builds (once) and returns a small but real supervised fine-tuning set plus everything a
demo run needs, from nothing but the interpreter's own standard library:

- ``train.jsonl`` / ``heldout.jsonl``: records ``{"prompt": ..., "response": ...}``. Every function or
  method with a docstring becomes one example: the prompt is
  ``Write a Python function `name(args) -> ret` that: <docstring>`` (methods add
  ``(a method of class `Cls`)``, coroutines say ``async function``), and the response is the function's
  own source (decorators included, dedented, comments kept) **with the docstring removed**, so the
  answer is not a copy of the prompt. Functions whose body is only the docstring (or only ``pass`` /
  ``...`` besides it) are dropped: without the docstring nothing would be left to learn. So are nested
  functions (closures need their enclosing scope), docstrings sharing a line with other code, answers
  outside ``80..1500`` characters and docstrings outside ``10..1200`` characters. Duplicates (same
  answer up to formatting and comments, i.e. same ``ast.dump``, or the same prompt) are removed,
  keeping the first in (file path, line) order.
- The held-out split is made of whole *files*: files are ordered by a hash of their relative path and
  the first ones go to held-out until it holds ~9 % of all examples (capped at ``MAX_HELDOUT``); the
  following files go to train (capped at ``MAX_TRAIN``). Held-out functions therefore never come from a
  file that train examples come from. Each split is then ordered by a hash of (path, qualified name): a
  fixed, well-mixed order.
- ``pretrain.txt``: the source of standard-library files used by neither split (no example taken from
  them and no function in them that duplicates a selected answer), ``# file: <path>`` headers between
  files, at most ``PRETRAIN_MAX_CHARS`` characters; for a later pre-training run.
- ``tokenizer/``: a byte-level BPE tokenizer (``VOCAB_SIZE`` tokens; special tokens ``<s> </s> <pad>
  <unk>``) trained with Hugging Face ``tokenizers`` on the train split and ``pretrain.txt`` (never on
  held-out), saved as a ``transformers.PreTrainedTokenizerFast`` with bos/eos/pad/unk and a simple chat
  template whose assistant turns end with ``</s>``.
- ``splits.json``: provenance: ``[path, qualified name, line]`` of every train / held-out example (line
  ``i`` of the JSONL file is entry ``i``) and the files making up ``pretrain.txt``.
- ``stats.json``: counts, character sizes and token lengths (as ``clusterlm.data.load_data`` tokenises
  the records: ``<s>`` + prompt + response + ``</s>``).
- ``manifest.json``: format version, Python version, build time. It is written last; a directory whose
  manifest is missing or names another version / Python is rebuilt.

Directory: ``root`` if given, else ``$CLUSTERLM_HOME/demo-v1`` or ``~/.cache/clusterlm/data/demo-v1``. The
build happens in a temporary sibling directory under an inter-process file lock and is moved into place
with ``os.replace``, so concurrent first calls build once and nobody ever sees a half-written set.
Everything is deterministic: two builds with the same interpreter give byte-identical files (the
manifest's timing aside). Different Python versions have different standard libraries, hence
different (but each deterministic) demo sets.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import textwrap
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clusterlm.data import load_data

__all__ = [
    "DEMO_VERSION",
    "DemoData",
    "default_root",
    "demo_data",
    "extract_functions",
]

DEMO_VERSION = 1
DEMO_SUBDIR = f"demo-v{DEMO_VERSION}"
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "encodings", "__pycache__"})
MIN_RESPONSE_CHARS, MAX_RESPONSE_CHARS = 80, 1500
MIN_DOC_CHARS, MAX_DOC_CHARS = 10, 1200
HELDOUT_FRACTION = 0.09
MAX_TRAIN, MAX_HELDOUT = 4000, 400
PRETRAIN_MAX_CHARS = 2_000_000
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<unk>")
# Plain-text role markers (not special tokens) so the template works with any byte-level vocabulary; the
# assistant turn ends with eos so a model fine-tuned on chat data learns to stop.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ message['content'] + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
_HASH_SALT = "clusterlm-demo"
_MANIFEST = "manifest.json"
_FILES = ("train.jsonl", "heldout.jsonl", "pretrain.txt", "splits.json", "stats.json")


@dataclass(frozen=True)
class DemoData:
    """Paths of a built demo data set (see the module docstring for what each file holds).

    Attributes:
        root: the demo directory.
        train: ``train.jsonl`` (records ``{"prompt", "response"}``).
        heldout: ``heldout.jsonl`` (same format, functions from other files than train's).
        pretrain: ``pretrain.txt`` (standard-library source used by neither split).
        tokenizer_dir: a ``transformers`` tokenizer directory (``AutoTokenizer.from_pretrained``).
        stats: ``stats.json``.
        splits: ``splits.json`` (where every example and the pre-training text came from).
    """

    root: Path
    train: Path
    heldout: Path
    pretrain: Path
    tokenizer_dir: Path
    stats: Path
    splits: Path

    @classmethod
    def at(cls, root: str | os.PathLike[str]) -> DemoData:
        """The paths of a demo set in directory ``root`` (nothing is checked or built)."""
        root = Path(root)
        return cls(
            root=root,
            train=root / "train.jsonl",
            heldout=root / "heldout.jsonl",
            pretrain=root / "pretrain.txt",
            tokenizer_dir=root / "tokenizer",
            stats=root / "stats.json",
            splits=root / "splits.json",
        )

    def load_tokenizer(self) -> Any:
        """The demo tokenizer, a ``transformers.PreTrainedTokenizerFast`` (loaded from local files only)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.tokenizer_dir), local_files_only=True)

    def read_stats(self) -> dict[str, Any]:
        """``stats.json`` as a dict."""
        return json.loads(self.stats.read_text(encoding="utf-8"))

    def read_splits(self) -> dict[str, list[Any]]:
        """``splits.json``: ``{"train": [[path, qualname, line], ...], "heldout": [...], "pretrain": [path, ...]}``."""
        return json.loads(self.splits.read_text(encoding="utf-8"))

    def records(self, split: str = "train") -> list[dict[str, str]]:
        """The records of ``split`` (``"train"`` or ``"heldout"``) as a list of ``{"prompt", "response"}``.

        Raises:
            ValueError: ``split`` is not ``"train"`` or ``"heldout"``.
        """
        if split not in ("train", "heldout"):
            raise ValueError(f"DemoData.records: split must be 'train' or 'heldout', got {split!r}.")
        path = self.train if split == "train" else self.heldout
        with path.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f]


def default_root() -> Path:
    """``$CLUSTERLM_HOME/demo-v1`` if the variable is set, else ``~/.cache/clusterlm/data/demo-v1``."""
    home = os.environ.get("CLUSTERLM_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "clusterlm"
    return base / DEMO_SUBDIR


def _python_id() -> str:
    return f"{sys.implementation.name}-{'.'.join(map(str, sys.version_info[:3]))}"


def _manifest_ok(root: Path) -> bool:
    try:
        manifest = json.loads((root / _MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if manifest.get("version") != DEMO_VERSION or manifest.get("python") != _python_id():
        return False
    return all((root / name).is_file() for name in _FILES) and (root / "tokenizer" / "tokenizer.json").is_file()


def demo_data(root: str | os.PathLike[str] | None = None, *, verbose: bool = True) -> DemoData:
    """Build the demo data set on first use (a few seconds) and return its paths; reuse it afterwards.

    Args:
        root: the demo directory; default :func:`default_root` (``$CLUSTERLM_HOME`` or
            ``~/.cache/clusterlm``, subdirectory ``demo-v1``).
        verbose: print what is built and how long it took (stderr).

    Returns:
        :class:`DemoData` with the paths of ``train.jsonl``, ``heldout.jsonl``, ``pretrain.txt``, the
        tokenizer directory and ``stats.json``.

    Raises:
        TimeoutError: another process held the build lock for more than 10 minutes.
        RuntimeError: the standard library yielded no usable function (a stripped interpreter).
    """
    root = Path(root).expanduser() if root is not None else default_root()
    if _manifest_ok(root):
        return DemoData.at(root)
    from filelock import FileLock

    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root.parent / f".{root.name}.lock"), timeout=600):
        if not _manifest_ok(root):  # another process may have finished while we waited
            _build(root, verbose=verbose)
    return DemoData.at(root)


# --------------------------------------------------------------------------------------------------
# Extraction


@dataclass(frozen=True)
class FunctionExample:
    """One function of the standard library turned into an instruction example.

    Attributes:
        path: file path relative to the standard library directory (POSIX separators).
        lineno: line of the ``def`` (or of its first decorator).
        qualname: ``name`` or ``Class.name``.
        prompt: the instruction.
        response: the function source without its docstring.
        key: sha256 of ``ast.dump`` of the function without its docstring (equal for sources that differ
            only in layout and comments).
    """

    path: str
    lineno: int
    qualname: str
    prompt: str
    response: str
    key: str


def _stdlib_files(stdlib: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        # _sysconfigdata_* is generated per installation (build paths and flags), not code anyone wrote.
        files.extend(
            Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py") and not f.startswith("_sysconfigdata")
        )
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())


def _is_trivial(body: list[ast.stmt]) -> bool:
    def trivial(stmt: ast.stmt) -> bool:
        return isinstance(stmt, ast.Pass) or (
            isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and stmt.value.value is Ellipsis
        )

    return all(trivial(s) for s in body)


def _function_example(
    node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str], rel: str, cls: str | None
) -> FunctionExample | None:
    doc = ast.get_docstring(node, clean=True)
    if not doc or not (MIN_DOC_CHARS <= len(doc) <= MAX_DOC_CHARS) or _is_trivial(node.body[1:]):
        return None
    doc_node = node.body[0]
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    # The docstring must sit on lines of its own (not on the ``def`` line, nothing after it), so that
    # deleting those lines removes exactly the docstring.
    first, last = lines[doc_node.lineno - 1].encode(), lines[doc_node.end_lineno - 1].encode()
    if first[: doc_node.col_offset].strip() or last[doc_node.end_col_offset :].strip():  # offsets count bytes
        return None
    if isinstance(node.body[1], ast.Expr) and isinstance(node.body[1].value, ast.Constant):
        return None  # a second string literal would read as the docstring once the first is gone
    kept = lines[start - 1 : doc_node.lineno - 1]
    after = lines[doc_node.end_lineno : node.end_lineno]
    while after and not after[0].strip():  # the blank line(s) that separated docstring and code
        after = after[1:]
    response = textwrap.dedent("".join(kept + after)).rstrip() + "\n"
    if not (MIN_RESPONSE_CHARS <= len(response) <= MAX_RESPONSE_CHARS):
        return None
    if response[0].isspace():
        return None  # dedent failed: a multi-line string is less indented than the def
    signature = ast.unparse(node.args)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    kind = "async function" if isinstance(node, ast.AsyncFunctionDef) else "function"
    where = f" (a method of class `{cls}`)" if cls else ""
    prompt = f"Write a Python {kind} `{node.name}({signature}){returns}`{where} that: {doc}"
    body = node.body
    node.body = body[1:]  # the answer's AST: equal for sources differing only in layout and comments
    try:
        key = hashlib.sha256(ast.dump(node).encode()).hexdigest()
    finally:
        node.body = body
    qualname = f"{cls}.{node.name}" if cls else node.name
    return FunctionExample(rel, start, qualname, prompt, response, key)


def _file_examples(tree: ast.Module, lines: list[str], rel: str) -> list[FunctionExample]:
    out = []

    def visit(body: list[ast.stmt], cls: str | None) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                example = _function_example(node, lines, rel, cls)
                if example is not None:
                    out.append(example)
            elif isinstance(node, ast.ClassDef):
                visit(node.body, f"{cls}.{node.name}" if cls else node.name)

    visit(tree.body, None)
    return out


def extract_functions(
    stdlib: str | os.PathLike[str] | None = None,
) -> tuple[dict[str, list[FunctionExample]], dict[str, str], dict[str, int]]:
    """Every usable documented function of the standard library, before deduplication and splitting.

    Args:
        stdlib: the standard library directory; default ``sysconfig.get_paths()["stdlib"]``.

    Returns:
        ``(examples, sources, counts)``: examples per relative file path (in line order), the source of
        every parsed file, and counters (files seen / unparsable).
    """
    stdlib = Path(stdlib if stdlib is not None else sysconfig.get_paths()["stdlib"])
    examples: dict[str, list[FunctionExample]] = {}
    sources: dict[str, str] = {}
    counts = {"files": 0, "files_unparsable": 0}
    for path in _stdlib_files(stdlib):
        counts["files"] += 1
        rel = path.relative_to(stdlib).as_posix()
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source, filename=rel)
        except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
            counts["files_unparsable"] += 1
            continue
        sources[rel] = source
        # Split on "\n" only: str.splitlines also splits on form feeds (present in the stdlib) and other
        # characters the parser does not count as line ends, which would shift line numbers.
        examples[rel] = _file_examples(tree, [line + "\n" for line in source.split("\n")], rel)
    return examples, sources, counts


def _hash_order(text: str) -> str:
    return hashlib.sha256(f"{_HASH_SALT}:{text}".encode()).hexdigest()


def _split(
    examples: dict[str, list[FunctionExample]], sources: dict[str, str], counts: dict[str, int]
) -> tuple[list[FunctionExample], list[FunctionExample], list[str]]:
    """Deduplicate, split by file, order; returns ``(train, heldout, pretrain_files)``, fills ``counts``."""
    seen_keys: set[str] = set()
    seen_prompts: set[str] = set()
    unique: dict[str, list[FunctionExample]] = {}
    for rel in sorted(examples):  # first occurrence in (path, line) order wins
        kept = []
        for ex in examples[rel]:
            if ex.key in seen_keys or ex.prompt in seen_prompts:
                continue
            seen_keys.add(ex.key)
            seen_prompts.add(ex.prompt)
            kept.append(ex)
        unique[rel] = kept
    total = sum(len(v) for v in unique.values())
    counts["unique"] = total
    heldout_target = min(MAX_HELDOUT, round(HELDOUT_FRACTION * total))
    heldout: list[FunctionExample] = []
    train: list[FunctionExample] = []
    used: set[str] = set()
    for rel in sorted(unique, key=_hash_order):
        if not unique[rel]:
            continue
        if len(heldout) < heldout_target:
            heldout.extend(unique[rel][: MAX_HELDOUT - len(heldout)])
        elif len(train) < MAX_TRAIN:
            train.extend(unique[rel][: MAX_TRAIN - len(train)])
        else:
            continue
        used.add(rel)
    selected = {ex.key for ex in train + heldout}
    pretrain_files = []
    n_chars = 0
    for rel in sorted(sources, key=_hash_order):
        # A file whose functions were all deduplicated away may still hold a copy of a selected answer.
        if rel in used or any(ex.key in selected for ex in examples.get(rel, ())):
            continue
        if n_chars + len(sources[rel]) > PRETRAIN_MAX_CHARS:
            continue
        pretrain_files.append(rel)
        n_chars += len(sources[rel])

    def order(items: list[FunctionExample]) -> list[FunctionExample]:
        return sorted(items, key=lambda ex: _hash_order(f"{ex.path}:{ex.qualname}:{ex.lineno}"))

    return order(train), order(heldout), sorted(pretrain_files)


def _write_jsonl(path: Path, records: Iterable[dict[str, str]]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")


def _train_tokenizer(texts: list[str], out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def _describe(values: Iterable[int]) -> dict[str, float]:
    arr = np.asarray(list(values), dtype=np.int64)
    if arr.size == 0:
        return {"n": 0}
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {
        "n": int(arr.size),
        "min": int(arr.min()),
        "mean": round(float(arr.mean()), 2),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": int(arr.max()),
        "sum": int(arr.sum()),
    }


def _stats(root: Path, splits: dict[str, list[FunctionExample]], pretrain_chunks: list[str], counts: dict) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(root / "tokenizer"), local_files_only=True)
    stats: dict[str, Any] = {
        "version": DEMO_VERSION,
        "python": _python_id(),
        "sources": counts,
        "vocab_size": len(tokenizer),
    }
    for name, items in splits.items():
        records = [{"prompt": ex.prompt, "response": ex.response} for ex in items]
        data = load_data(records, tokenizer, max_length=None, progress=False)
        answer = [int((data[i]["labels"] != -100).sum()) for i in range(len(data))]
        stats[name] = {
            "examples": len(items),
            "files": len({ex.path for ex in items}),
            "prompt_chars": _describe(len(ex.prompt) for ex in items),
            "response_chars": _describe(len(ex.response) for ex in items),
            "tokens": _describe(data.lengths),
            "answer_tokens": _describe(answer),
        }
    pretrain_text = "\n".join(pretrain_chunks)
    stats["pretrain"] = {
        "files": len(pretrain_chunks),
        "chars": len(pretrain_text),
        "bytes": len(pretrain_text.encode("utf-8")),
        # Tokenised file by file (the joining newlines aside), as a pre-training run would read it.
        "tokens": sum(len(x) for x in tokenizer(pretrain_chunks, add_special_tokens=False, verbose=False)["input_ids"]),
    }
    return stats


def _build(root: Path, *, verbose: bool) -> None:
    def say(msg: str) -> None:
        if verbose:
            print(f"[clusterlm.data.demo] {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    stdlib = sysconfig.get_paths()["stdlib"]
    say(f"building the demo data set in {root} from the standard library at {stdlib} (once) ...")
    examples, sources, counts = extract_functions(stdlib)
    counts["candidates"] = sum(len(v) for v in examples.values())
    train, heldout, pretrain_files = _split(examples, sources, counts)
    counts["pretrain_files"] = len(pretrain_files)
    if not train or not heldout:
        raise RuntimeError(
            f"demo_data: the standard library at {stdlib} gave {len(train)} train and {len(heldout)} held-out "
            "examples; this interpreter's standard library seems stripped (no sources). Use a full CPython."
        )
    t_extract = time.perf_counter() - t0
    pretrain_chunks = [f"# file: {rel}\n{sources[rel]}" for rel in pretrain_files]
    pretrain_text = "\n".join(pretrain_chunks)

    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared by several users
        _write_jsonl(tmp / "train.jsonl", ({"prompt": e.prompt, "response": e.response} for e in train))
        _write_jsonl(tmp / "heldout.jsonl", ({"prompt": e.prompt, "response": e.response} for e in heldout))
        provenance = {
            "train": [[e.path, e.qualname, e.lineno] for e in train],
            "heldout": [[e.path, e.qualname, e.lineno] for e in heldout],
            "pretrain": pretrain_files,
        }
        (tmp / "splits.json").write_text(json.dumps(provenance, indent=1) + "\n", encoding="utf-8")
        (tmp / "pretrain.txt").write_text(pretrain_text, encoding="utf-8", newline="\n")
        t1 = time.perf_counter()
        texts = [t for e in train for t in (e.prompt, e.response)] + [sources[rel] for rel in pretrain_files]
        _train_tokenizer(texts, tmp / "tokenizer")
        t_tok = time.perf_counter() - t1
        stats = _stats(tmp, {"train": train, "heldout": heldout}, pretrain_chunks, counts)
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        seconds = time.perf_counter() - t0
        manifest = {
            "version": DEMO_VERSION,
            "python": _python_id(),
            "stdlib": stdlib,
            "build_seconds": {"extract": round(t_extract, 3), "tokenizer": round(t_tok, 3), "total": round(seconds, 3)},
        }
        (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        _replace_dir(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(
        f"built {len(train)} train / {len(heldout)} held-out examples, pretrain.txt "
        f"{stats['pretrain']['chars'] / 1e6:.2f} M chars ({len(pretrain_files)} files), tokenizer "
        f"{stats['vocab_size']} tokens in {seconds:.1f} s (extract {t_extract:.1f} s, tokenizer {t_tok:.1f} s)"
    )


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished directory ``src`` to ``dst``, replacing a stale ``dst`` (caller holds the lock)."""
    if dst.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        os.replace(dst, trash / dst.name)
        os.replace(src, dst)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(src, dst)
