"""The documentation is tested: code blocks run, references resolve, the site builds, the generated files are current.

Code blocks. Every ```python / ```bash block of ``README.md`` and ``docs/*.md`` is marked on the line before its
fence, visibly in the source:

* ``<!-- runnable -->``: run here, on the built-in tiny model and a slice of the demo data;
* ``<!-- illustrative -->``: shown only (GPUs, other models, hours of compute, a model path of the reader's).

The runnable blocks of one file run in order in one fresh process (Python blocks share one namespace, as in a
reader's session; shell blocks run with ``bash -euo pipefail``), forked from a process that imported torch,
transformers' model code and clusterlm once for the whole module (:class:`DocRunner`: the blocks' own imports then
cost nothing, 3-4 s less per file), all files in one shared working directory in
the order of :data:`DOC_FILES`, so a guide can use the plan or the run an earlier page made. A shell block
whose exact text already ran there is not run again (the same command gives the same files). The working
directory starts with ``train.jsonl`` / ``heldout.jsonl`` from the README's data block, so each file also runs
on its own (``pytest tests/test_docs.py -k training``).

References. Every ``docs/<page>.md`` named in the code, the docs and the benchmarks exists, and so does every
section it cites ("docs/scaling.md section 4", "§4", ``page.md#anchor``); every repository path quoted in the
README and the guides exists; nothing cites a file outside the repository.

Site. ``mkdocs build --strict`` (the ``docs`` extra, also in ``test``): a broken link, a missing page or an
object mkdocstrings cannot find fails, and so does a fault in the rendered API reference, which the build's hook
(docs/mkdocs_hooks.py, ``reference_problems``) reports and this file checks again on the built HTML: raw reST (a
``:class:`` role, a ``~clusterlm.`` short reference, a ``::`` literal-block marker), a ``<placeholder>`` swallowed
as an HTML tag, a ``Returns`` section whose value got a name ("The") or was split at a wrapped line, a default
that is a private helper call (``_opt(...)``), a dataclass attribute that does not show its field's default.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = ["README.md", "docs/index.md", "docs/selection.md", "docs/training.md", "docs/integrations.md",
             "docs/compare.md", "docs/kmeans.md", "docs/gpu.md", "docs/design.md", "docs/scaling.md",
             "docs/architecture.md"]
RUNNABLE, ILLUSTRATIVE = "<!-- runnable -->", "<!-- illustrative -->"
EXECUTED = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash", "console": "bash"}
FENCE = re.compile(r"^(\s*)```\s*([A-Za-z0-9_+-]*)\s*$")
BLOCK_TIMEOUT_S = 900


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # 1-based line of the opening fence
    lang: str  # as written after the fence
    code: str
    mark: str | None  # "runnable", "illustrative" or None

    @property
    def kind(self) -> str | None:
        return EXECUTED.get(self.lang.lower())

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a markdown file, each with the marker on the nearest non-blank line above it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    rel = str(path.relative_to(REPO))
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        code = textwrap.dedent("\n".join(line[len(indent):] if line.startswith(indent) else line
                                         for line in lines[i + 1: j]))
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        above = lines[k].strip() if k >= 0 else ""
        mark = {RUNNABLE: "runnable", ILLUSTRATIVE: "illustrative"}.get(above)
        blocks.append(Block(rel, start + 1, lang, code + "\n", mark))
        i = j + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for name in DOC_FILES for b in parse_blocks(REPO / name)]


# --------------------------------------------------------------------------------------------------
# Markers


def test_every_executable_block_is_marked() -> None:
    """A python or shell block says whether it runs; a marker stands only before a code block."""
    unmarked = [b.where() for b in all_blocks() if b.kind and b.mark is None]
    assert not unmarked, (f"code blocks without {RUNNABLE} or {ILLUSTRATIVE} on the line before the fence: "
                          f"{unmarked}")
    for name in DOC_FILES:
        lines = (REPO / name).read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines):
            if line.strip() in (RUNNABLE, ILLUSTRATIVE):
                nxt = next((x for x in lines[n + 1:] if x.strip()), "")
                assert FENCE.match(nxt), f"{name}:{n + 1}: {line.strip()} is not followed by a code block"


def test_readme_starts_with_the_two_commands_and_is_short() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200, "README.md: at most 200 lines; details go to docs/"
    first = parse_blocks(REPO / "README.md")[0]
    commands = [line.split("#")[0].strip() for line in first.code.splitlines() if line.strip()]
    assert commands[:2] == ["make demo", "make test"], commands


# --------------------------------------------------------------------------------------------------
# Running the runnable blocks

DRIVER = r'''
import json, os, subprocess, sys, traceback, hashlib
blocks = json.load(open(sys.argv[1]))
done_path = ".doc_blocks_done"
done = set(open(done_path).read().split()) if os.path.exists(done_path) else set()
namespace = {"__name__": "__main__"}
for b in blocks:
    print(f"\n===== {b['where']} ({b['kind']}) =====", flush=True)
    if b["kind"] == "bash":
        key = hashlib.sha256(b["code"].encode()).hexdigest()
        if key in done:
            print("(ran already in this directory)", flush=True)
            continue
        rc = subprocess.run(["bash", "-euo", "pipefail", "-c", b["code"]]).returncode
        if rc != 0:
            print(f"BLOCK FAILED: {b['where']}: exit status {rc}", flush=True)
            sys.exit(1)
        with open(done_path, "a") as f:
            f.write(key + "\n")
    else:
        try:
            exec(compile(b["code"], b["where"], "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            print(f"BLOCK FAILED: {b['where']}", flush=True)
            sys.exit(1)
print("\nALL BLOCKS PASSED", flush=True)
'''


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env["CLUSTERLM_HOME"] = str(home)
    env.setdefault("MPLBACKEND", "Agg")
    env["PYTHONUNBUFFERED"] = "1"
    env["TQDM_DISABLE"] = "1"
    return env


# Imports a doc file's blocks make, done once in the runner before it forks a child per file (nothing else runs
# there before a fork: no thread pool, no CUDA, as in clusterlm's own fork server)
PRELOAD = ("torch", "transformers.modeling_utils", "clusterlm", "clusterlm.cli.commands", "clusterlm.models",
           "clusterlm.training.loop", "clusterlm.selection.pipeline", "clusterlm.comparison.run", "matplotlib.pyplot")

RUNNER = r'''
import importlib, json, os, runpy, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
print("ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:  # a fresh process for one doc file: its output to a file, the driver in its working directory
        fd = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(request["workdir"])
        sys.argv = [request["driver"], request["spec"]]
        code = 0
        try:
            runpy.run_path(request["driver"], run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)
'''


class DocRunner:
    """One process with :data:`PRELOAD` imported, in the docs' environment (``CLUSTERLM_HOME`` = ``home``), that
    runs each doc file's blocks in a child it forks (:data:`DRIVER`, as ``python .doc_driver.py SPEC`` would)."""

    def __init__(self, home: Path, workdir: Path) -> None:
        self.workdir = workdir
        self.proc = subprocess.Popen([sys.executable, "-c", RUNNER, json.dumps(PRELOAD)], cwd=workdir,
                                     env=_env(home), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._line(120) == "ready", "the doc runner did not start"

    def _line(self, timeout: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return ""
        return self.proc.stdout.readline().strip()

    def run(self, blocks: list[Block]) -> subprocess.CompletedProcess:
        """Run ``blocks`` in order in a fresh child; its exit status and everything it printed (as stdout)."""
        key = hashlib.sha256(repr(blocks).encode()).hexdigest()[:12]
        spec, output = self.workdir / f".blocks_{key}.json", self.workdir / f".blocks_{key}.out"
        spec.write_text(json.dumps([{"where": b.where(), "kind": b.kind, "code": b.code} for b in blocks]))
        driver = self.workdir / ".doc_driver.py"
        driver.write_text(DRIVER)
        request = {"spec": str(spec), "output": str(output), "driver": str(driver), "workdir": str(self.workdir)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = json.loads(self._line(60))["pid"]
        answer = self._line(BLOCK_TIMEOUT_S)
        if not answer:  # the blocks hang: end them (and what they started in their process group)
            os.kill(pid, signal.SIGKILL)
            self._line(60)
            status = -9
        else:
            status = json.loads(answer)["status"]
        return subprocess.CompletedProcess(["doc blocks", str(spec)], status, output.read_text(errors="replace"), "")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _check(proc: subprocess.CompletedProcess) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ALL BLOCKS PASSED" in proc.stdout, out[-6000:]


@pytest.fixture(scope="session")
def doc_runner(tmp_path_factory: pytest.TempPathFactory, demo) -> Iterator[DocRunner]:
    """The :class:`DocRunner` of one working directory for every doc file, with the README's data block run
    (train.jsonl, heldout.jsonl), in the session's ``CLUSTERLM_HOME`` (tests/conftest.py: the demo data and built-in
    models built once)."""
    home = Path(os.environ["CLUSTERLM_HOME"])
    workdir = tmp_path_factory.mktemp("doc_blocks")
    data_block = next(b for b in parse_blocks(REPO / "README.md")
                      if b.mark == "runnable" and b.kind == "python" and "demo_data" in b.code)
    runner = DocRunner(home, workdir)
    try:
        _check(runner.run([data_block]))
        yield runner
    finally:
        runner.close()


def _runnable(name: str) -> list[Block]:
    return [b for b in parse_blocks(REPO / name) if b.mark == "runnable" and b.kind]


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in DOC_FILES if _runnable(n)])
def test_runnable_blocks(name: str, doc_runner: DocRunner) -> None:
    """Every runnable block of ``name`` runs, in order, in the shared working directory."""
    _check(doc_runner.run(_runnable(name)))


# --------------------------------------------------------------------------------------------------
# References

TEXT_SUFFIXES = {".py", ".md", ".sh", ".cpp", ".h", ".cu", ".cuh", ".toml", ".yml", ".yaml", ".txt", ".cfg"}
SKIP_DIRS = {".venv", ".git", "build", "site", "__pycache__", ".pytest_cache", "node_modules", "runs"}
DOC_REF = re.compile(r"docs/([A-Za-z0-9_/-]+\.md)(?:#([A-Za-z0-9_-]+))?"
                     r"(?:`{0,2},?\s*(?:section|§)\s*(\d+)|\s*§\s*(\d+))?")
MD_LINK = re.compile(r"\]\(([^)\s]+?\.md)(?:#([A-Za-z0-9_-]+))?\)")
REPO_PATH = re.compile(r"`((?:tests|benchmarks|python_api|cluster_kernels|csrc|docs)/[A-Za-z0-9_./*-]+)`")


def _text_files() -> list[Path]:
    out = []
    for p in REPO.rglob("*"):
        rel = p.relative_to(REPO)
        if p.is_file() and p.suffix in TEXT_SUFFIXES and not (set(rel.parts[:-1]) & SKIP_DIRS) \
                and rel.parts[0] not in SKIP_DIRS:
            out.append(p)
    return out


def slugify(heading: str) -> str:
    """The anchor of a markdown heading (Python-Markdown's toc, as MkDocs and GitHub agree on for these)."""
    text = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    heads = [m.group(1) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", page.read_text(encoding="utf-8"), re.M)]
    return {slugify(h) for h in heads}


def _sections(page: Path) -> set[str]:
    return set(re.findall(r"^#{2,3}\s+(\d+)\.", page.read_text(encoding="utf-8"), re.M))


def test_docs_references_resolve() -> None:
    """Every docs/<page>.md cited anywhere exists, with the section or anchor it names."""
    problems = []
    for path in _text_files():
        if path.name == "test_docs.py":
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        rel = path.relative_to(REPO)
        for m in DOC_REF.finditer(text):
            page = REPO / "docs" / m.group(1)
            if not page.is_file():
                problems.append(f"{rel}: docs/{m.group(1)} does not exist")
                continue
            if m.group(2) and m.group(2) not in _anchors(page):
                problems.append(f"{rel}: docs/{m.group(1)}#{m.group(2)}: no such heading")
            section = m.group(3) or m.group(4)
            if section and section not in _sections(page):
                problems.append(f"{rel}: docs/{m.group(1)} section {section}: no heading '## {section}.'")
    assert not problems, "\n".join(problems)


def test_markdown_links_resolve() -> None:
    """Relative links between the README, the guides and BENCHMARKS.md point at files and headings that exist."""
    problems = []
    for name in DOC_FILES + ["docs/index.md", "BENCHMARKS.md", "benchmarks/README.md"]:
        page = REPO / name
        for m in MD_LINK.finditer(page.read_text(encoding="utf-8")):
            target = (page.parent / m.group(1)).resolve()
            if "://" in m.group(1):
                continue
            if not target.is_file():
                problems.append(f"{name}: link to {m.group(1)}: no such file")
            elif m.group(2) and m.group(2) not in _anchors(target):
                problems.append(f"{name}: link to {m.group(1)}#{m.group(2)}: no such heading")
    assert not problems, "\n".join(problems)


def test_quoted_repository_paths_exist() -> None:
    """`tests/...`, `benchmarks/...` and other repository paths quoted in the README and the guides exist."""
    problems = []
    for name in DOC_FILES + ["docs/index.md"]:
        for m in REPO_PATH.finditer((REPO / name).read_text(encoding="utf-8")):
            quoted = m.group(1).rstrip(".")
            if "<" in quoted:
                continue
            if not (list(REPO.glob(quoted)) if "*" in quoted else (REPO / quoted).exists()):
                # outputs the benchmarks write (results/gpu_*.json) and ptxas.md are generated: allowed if listed
                if not quoted.startswith("benchmarks/results/gpu_"):
                    problems.append(f"{name}: `{quoted}` does not exist")
    assert not problems, "\n".join(problems)


# The team notes file outside the repository that code once cited (built from parts: this test is not a citation).
OUTSIDE_NOTES = "DESIGN" + ".md"


def test_nothing_cites_a_file_outside_the_repository() -> None:
    """The design lives in docs/design.md; no code or doc cites the notes file the project once pointed at."""
    offenders = [str(p.relative_to(REPO)) for p in _text_files()
                 if OUTSIDE_NOTES in p.read_text(encoding="utf-8", errors="replace")]
    offenders += [str(p.relative_to(REPO)) for p in (REPO / "benchmarks" / "results").glob("*.json")
                  if OUTSIDE_NOTES in p.read_text(encoding="utf-8")]
    assert not offenders, f"cite docs/design.md instead of {OUTSIDE_NOTES}: {offenders}"


# --------------------------------------------------------------------------------------------------
# Generated files and the site


def test_benchmarks_md_is_current_and_short() -> None:
    """BENCHMARKS.md and the detail files are what render_benchmarks.py makes of the results; at most 420 lines (long
    tables go to the detail files)."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "render_benchmarks.py"), "--check"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 420
    assert text.split("\n## ")[1].startswith("Summary")


@pytest.mark.slow
def test_mkdocs_site_builds_strict(tmp_path: Path) -> None:
    """The site (guides + the API reference from the docstrings) builds with no warning (``make docs``)."""
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError:
        pytest.fail("the docs build needs the `docs` extra: pip install -e '.[docs]' (the `test` extra has it)")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    site = tmp_path / "site"
    assert (site / "reference" / "clusterlm" / "index.html").is_file()
    assert (site / "benchmarks" / "index.html").is_file(), "BENCHMARKS.md is a page of the site"
    # the check the build ran on every reference page, again on the HTML as written (links resolved)
    hooks = _mkdocs_hooks()
    pages = sorted((site / "reference").glob("*/index.html"))
    problems = [f"{p.parent.name}: {problem}" for p in pages
                for problem in hooks.reference_problems(p.read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems)
    html = "".join(p.read_text(encoding="utf-8") for p in pages)
    # what the check reads is there: tables of Returns, dataclass attributes with their defaults, signatures
    assert html.count('doc-section-title">Returns:') >= 20
    assert html.count("<em>Default:</em>") >= 50 and html.count('class="doc-signature highlight"') >= 50
    home = (site / "index.html").read_text(encoding="utf-8")
    assert 'href="benchmarks/#summary"' in home
    for text in ("pip install -e .", "clusterlm.select(", "clusterlm.train(", "clusterlm.compare(", "Is it worth it?"):
        assert text in hooks._text(home), f"the home page has no {text!r}"


def _mkdocs_hooks():
    spec = importlib.util.spec_from_file_location("clusterlm_mkdocs_hooks", REPO / "docs" / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _object(path: str, body: str, *, dataclass: bool = False, signature: str | None = None) -> str:
    """One object of the API reference as mkdocstrings writes it (the parts the check reads)."""
    label = '<small class="doc doc-label doc-label-dataclass"><code>dataclass</code></small>' if dataclass else ""
    sig = (f'<div class="doc-signature highlight"><pre><span></span><code>{signature}</code></pre></div>'
           if signature else "")
    return f'<h2 id="{path}" class="doc doc-heading">{path.rsplit(".", 1)[-1]}{label}</h2>{sig}' \
           f'<div class="doc doc-contents">{body}</div>'


def _table(title: str, header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join('<tr class="doc-section-item">' + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return (f'<p><span class="doc-section-title">{title}:</span></p>\n<table><thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>")


def test_reference_check_finds_each_fault() -> None:
    """The check of the rendered reference (docs/mkdocs_hooks.py) finds each fault it is for, and passes the same
    objects rendered right."""
    check = _mkdocs_hooks().reference_problems
    returns = ["Type", "Description"]
    good = [
        _object("m.select", _table("Returns", returns, [["<code>Plan</code>", "<p>The plan.</p>"]])),
        _object("m.TrainConfig", _table("Attributes", ["Name", "Type", "Description"], [
            ["<code>lr</code>", "<code>float</code>",
             "<p>peak learning rate.</p><p><em>Default:</em> <code>2e-05</code></p>"]]),
            dataclass=True, signature="TrainConfig(\n    lr: float = 2e-05,\n)"),
        _object("m.f", '<p>A <a href="#m.Plan"><code>Plan</code></a>, <code>a[::2]</code>, std::vector</p>'
                       "<pre><code>x = y  # :class: :: ~clusterlm.z</code></pre>"),
    ]
    assert check("".join(good)) == []
    faults = {
        "names its value 'The'": _object("m.select", _table("Returns", ["Name", *returns], [
            ["<code>The</code>", "<code>Plan</code>", "<p>class:<code>Plan</code>.</p>"]])),
        "Returns has 2 rows": _object("m.load", _table("Returns", returns, [
            ["<code>Any</code>", "<p>(model, tokenizer): the model</p>"], ["<code>Any</code>", "<p>and more</p>"]])),
        "a reST role": _object("m.f", "<p>the :class:<code>Plan</code></p>"),
        "a reST ~short reference": _object("m.f", "<p>the <code>~clusterlm.plan.Plan</code></p>"),
        "literal-block marker": _object("m.f", "<p>Run, from Python::</p><pre><code>run()</code></pre>"),
        "<ratio> in the HTML": _object("m.f", "<p>'random:<ratio>' (random:0.31)</p>"),
        "default of lr is '_opt(_SCHED)'": _object("m.C", "", signature="C(lr: float = _opt(_SCHED))"),
        "defaults to '_int(1)'": _object("m.f", _table("Parameters", ["Name", "Type", "Description", "Default"], [
            ["<code>n</code>", "<code>int</code>", "<p>count</p>", "<code>_int(1)</code>"]])),
        "attribute lr does not show its default '2e-05'": _object(
            "m.TrainConfig", _table("Attributes", ["Name", "Type", "Description"], [
                ["<code>lr</code>", "<code>float</code>", "<p>peak learning rate.</p>"]]),
            dataclass=True, signature="TrainConfig(lr: float = 2e-05)"),
    }
    for what, html in faults.items():
        problems = check(html)
        assert any(what in p for p in problems), (what, problems)


def test_docstrings_read_as_markdown() -> None:
    """The docs' Griffe extension turns a docstring's reST into Markdown: roles into cross-references, ``::`` blocks
    into fenced code, placeholders into text; code spans stay as written."""
    hooks = _mkdocs_hooks()
    if hooks.griffe is None:
        pytest.skip("griffe (the docs extra) is not installed")
    ext = hooks.ApiDocstrings()
    ext.collection = None
    text = textwrap.dedent("""\
        Run, from Python::

            import clusterlm
            plan = clusterlm.select(model, data)

        or from the shell::

            clusterlm select --model tiny-llama --out plan/

        - Effective objective::

              (1/K) sum_ranks w_b * loss_b

          i.e. the mean.
        - Next item.

        A :class:`~clusterlm.plan.Plan` or :func:`torch.compile`; 'random:<ratio>'; ``a <b>`` stays.""")
    out = ext.markdown(text, obj=None)
    assert "::" not in out
    assert "Run, from Python:\n\n```python\nimport clusterlm\n" in out
    assert "or from the shell:\n\n```bash\nclusterlm select" in out
    assert "- Effective objective:\n\n    ```text\n    (1/K) sum_ranks w_b * loss_b\n    ```" in out
    assert "\n    i.e. the mean.\n\n- Next item." in out
    assert '<autoref identifier="clusterlm.plan.Plan" optional hover><code>Plan</code></autoref>' in out
    assert "<code>torch.compile</code>" in out and "autoref identifier=\"torch" not in out
    assert "'random:&lt;ratio>'" in out and "``a <b>`` stays" in out
