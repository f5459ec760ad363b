"""The docs site's hooks: the docstrings' reST read as Markdown in the API reference.

Two entry points, both named in mkdocs.yml:

* :class:`ApiDocstrings`, a Griffe extension (``mkdocstrings`` ... ``extensions:``), rewrites every docstring of
  the documented packages before mkdocstrings parses it:

  - reST roles become cross-references: ``:class:`~clusterlm.plan.Plan``` links to the object's entry in the
    reference, shown as ``Plan`` (``~``: the last part of the name), or as plain code where the reference has no
    entry for it (a private module, torch);
  - a ``::`` literal block becomes a fenced code block (Python, shell or text), as does an indented block in
    running text;
  - a ``<placeholder>`` outside code (``'random:<ratio>'``) is escaped, not swallowed as an HTML tag;
  - a dataclass field documented under ``Attributes:`` gets its default, the one the signature shows.

* MkDocs hooks (``hooks:``): :func:`on_page_content` removes any reST role left in a page's HTML and checks
  every page of the reference (:func:`reference_problems`: a problem is a warning, so ``--strict`` fails);
  :func:`on_files` and :func:`on_page_markdown` show the repository's ``BENCHMARKS.md`` as the page
  ``benchmarks.md``, which the guides link as ``../BENCHMARKS.md`` (the link that works on GitHub too).

tests/test_docs.py (``test_mkdocs_site_builds_strict``) runs the same check on the built site.
"""

from __future__ import annotations

import ast
import logging
import re
import textwrap
from html import unescape
from pathlib import Path
from typing import Any

try:  # griffe is there wherever mkdocstrings is; MkDocs loads this file as a hook module too
    import griffe
    _Extension: type = griffe.Extension
except ImportError:  # pragma: no cover
    griffe = None
    _Extension = object

_log = logging.getLogger("mkdocs.hooks.api_reference")

# the packages the reference documents: a cross-reference into them links, anything else is plain code
DOCUMENTED = ("clusterlm", "cluster_kernels")

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const|ref|term):(?=<code>)")
# a role and its target (`title <target>` allowed), or a code span (any number of backticks), or a raw tag
_INLINE = re.compile(r":(?:py:)?(?P<role>[a-z]+):`(?P<target>[^`]+)`"
                     r"|(?P<ticks>`+)(?P<code>.+?)(?P=ticks)", re.S)
_TAG = re.compile(r"<(?![a-z][a-z0-9+.-]*://)(?=[A-Za-z/!?])")  # not an autolink <https://...>
_SECTION = re.compile(r"^[A-Z][A-Za-z ]*:\s*$")  # Args:, Returns:, Attributes:, ...
_BULLET = re.compile(r"^(?:[-*+]|\d+\.)\s")
_SHELL = ("clusterlm", "torchrun", "python", "pip", "make", "bash", "accelerate", "srun", "sbatch", "export",
          "CUDA_VISIBLE_DEVICES", "CLUSTER", "TRITON", "$", "axolotl", "llamafactory-cli", "cd", "ls")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _language(code: str) -> str:
    """The language of a literal block: Python if it parses as statements that do something, shell if every line
    starts with a command, else plain text (a file layout, a formula)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        tree = None
    if tree is not None and any(not isinstance(node, ast.Expr) or isinstance(node.value, ast.Call)
                                for node in tree.body):
        return "python"
    lines = [line.strip() for line in code.splitlines() if line.strip() and not line.strip().startswith("#")]
    if lines and all(line.split()[0].split("=")[0] in _SHELL or "=" in line.split()[0] or line.startswith("--")
                     for line in lines):
        return "bash"
    return "text"


def _fence(block: list[str], indent: int) -> list[str]:
    code = textwrap.dedent("\n".join(block)).strip("\n")
    pad = " " * indent
    body = [pad + line if line.strip() else "" for line in code.splitlines()]
    return ["", f"{pad}```{_language(code)}", *body, f"{pad}```", ""]


def literal_blocks(text: str) -> str:
    """``text::`` + an indented block -> ``text:`` + a fenced block; an indented block that follows a paragraph of
    running text (not a section's items, not a list item) -> a fenced block too. Fences already there stay."""
    lines = text.splitlines()
    out: list[str] = []
    i, fenced = 0, False
    while i < len(lines):
        line = lines[i]
        if line.strip().startswith("```"):
            fenced = not fenced
        if fenced:
            out.append(line)
            i += 1
            continue
        bullet = _BULLET.match(line.lstrip())
        # a list item's text starts after its marker: its block is what is indented further than that
        base = _indent(line) + (len(bullet.group(0)) if bullet else 0)
        literal = line.rstrip().endswith("::")
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        running_text = (base == 0 and line.strip() and not _SECTION.match(line)
                        and j > i + 1 and j < len(lines) and _indent(lines[j]) >= 4
                        and not any(_BULLET.match(p) or _SECTION.match(p) for p in _paragraph(lines, i)))
        if not (literal or running_text) or j >= len(lines) or _indent(lines[j]) <= base:
            out.append(line)
            i += 1
            continue
        k = j
        while k < len(lines) and (not lines[k].strip() or _indent(lines[k]) > base):
            k += 1
        while k > j and not lines[k - 1].strip():
            k -= 1
        if literal:
            stripped = line.rstrip()
            if stripped.strip() == "::":
                line = ""
            elif stripped.endswith(" ::"):
                line = stripped[:-3]
            else:
                line = stripped[:-1]
        out.append(line)
        if not (bullet or _in_item(lines, i)):
            out.extend(_fence(lines[j:k], _indent(line)))
            i = k
            continue
        # inside a list item Python-Markdown wants the item's blocks 4 columns in: the fence, and the item's
        # paragraphs after it (indented less than 4, up to the next item)
        item = _indent(line) if not bullet else _indent(line) + len(bullet.group(0))
        out.extend(_fence(lines[j:k], max(4, item)))
        i = k
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) >= item):
            out.append(" " * max(0, 4 - _indent(lines[i])) + lines[i] if lines[i].strip() else lines[i])
            i += 1
        out.append("")  # the next item starts a new block, not a lazy line of this one's last paragraph
    return "\n".join(out)


def _in_item(lines: list[str], i: int) -> bool:
    """Whether line ``i`` continues a list item's text (an indented line of a paragraph that starts with one)."""
    return _indent(lines[i]) > 0 and any(_BULLET.match(p) for p in _paragraph(lines, i))


def _paragraph(lines: list[str], i: int) -> list[str]:
    start = i
    while start > 0 and lines[start - 1].strip():
        start -= 1
    return lines[start: i + 1]


class ApiDocstrings(_Extension):
    """The Griffe extension: every docstring of a loaded package rewritten once the package is complete."""

    def on_package(self, *, pkg: Any, loader: Any = None, **kwargs: Any) -> None:
        self.collection = loader.modules_collection if loader is not None else None
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = self.markdown(obj.docstring.value, obj)
                obj.docstring.__dict__.pop("parsed", None)  # parsed again from the new text
        for obj in _walk(pkg):
            if obj.is_class and obj.docstring is not None:
                _attribute_defaults(obj)

    # -- text -------------------------------------------------------------------------------------------------

    def markdown(self, text: str, obj: Any) -> str:
        parts, fenced = [], False
        for chunk in re.split(r"(^\s*```.*$)", literal_blocks(text), flags=re.M):
            if chunk.lstrip().startswith("```"):
                fenced = not fenced
                parts.append(chunk)
            elif fenced:
                parts.append(chunk)
            else:
                parts.append(self.inline(chunk, obj))
        return "".join(parts)

    def inline(self, text: str, obj: Any) -> str:
        out, pos = [], 0
        for m in _INLINE.finditer(text):
            out.append(_TAG.sub("&lt;", text[pos: m.start()]))
            if m.group("role"):
                out.append(self.reference(m.group("role"), m.group("target"), obj))
            else:
                out.append(m.group(0))
            pos = m.end()
        out.append(_TAG.sub("&lt;", text[pos:]))
        return "".join(out)

    def reference(self, role: str, target: str, obj: Any) -> str:
        """A role as a link to the reference's entry (optional: plain code where there is none)."""
        title = None
        m = re.fullmatch(r"(?s)(.+?)\s*<([^<>]+)>", target)
        if m:
            title, target = m.group(1), m.group(2)
        target = target.strip().lstrip("!")
        short = target.startswith("~")
        target = target.lstrip("~.")
        shown = title or (target.rsplit(".", 1)[-1] if short else target)
        code = f"<code>{_html(shown)}</code>"
        path = self.resolve(target, obj)
        if path is None:
            return code
        return f'<autoref identifier="{_html(path)}" optional hover>{code}</autoref>'

    def resolve(self, target: str, obj: Any) -> str | None:
        """The canonical path of ``target`` as written in ``obj``'s docstring, or None outside the documented
        packages (or when it names nothing)."""
        head, _, rest = target.partition(".")
        if head not in DOCUMENTED:
            try:
                head = obj.resolve(head)
            except Exception:  # noqa: BLE001 - any failure: not a name griffe knows here
                return None
            target = f"{head}.{rest}" if rest else head
        if not target.startswith(DOCUMENTED):
            return None
        target = _public(target)
        try:
            found = self.collection[target] if self.collection is not None else None
        except Exception:  # noqa: BLE001 - not loaded, or an alias that cannot be resolved
            return target
        if found is None:
            return target
        try:
            return found.canonical_path
        except Exception:  # noqa: BLE001
            return target


def _public(path: str) -> str:
    """``clusterlm.select`` (a name the package loads lazily) -> the path of its definition."""
    parts = path.split(".")
    if len(parts) >= 2 and parts[0] == "clusterlm":
        try:
            import clusterlm
            module = clusterlm._PUBLIC.get(parts[1])
        except (ImportError, AttributeError):
            module = None
        if module:
            return ".".join([module, *parts[1:]])
    return path


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _walk(obj: Any):
    yield obj
    for member in list(obj.members.values()):
        if member.is_alias:
            continue
        yield from _walk(member)


def _attribute_defaults(cls: Any) -> None:
    """A dataclass's ``Attributes:`` entries end with the default of their field, as its signature shows it."""
    try:
        parameters = {p.name: p for p in cls.parameters}
    except Exception:  # noqa: BLE001 - no __init__ griffe can read
        return
    if "dataclass" not in cls.labels:
        return
    for section in cls.docstring.parsed:
        if section.kind.value != "attributes":
            continue
        for item in section.value:
            parameter = parameters.get(item.name)
            if parameter is None or parameter.default is None:  # not a field, or one without a default
                continue
            item.value = parameter.default
            shown = f"`{parameter.default}`"
            constant = _constant(cls, parameter.default)
            if constant is not None:
                shown += f" (`{constant}`)"
            item.description = f"{item.description.rstrip()}\n\n*Default:* {shown}"


def _constant(cls: Any, default: Any) -> str | None:
    """The value of a default that names a module constant (``METHODS``), when it is short enough to show."""
    if griffe is None or not isinstance(default, griffe.ExprName):
        return None
    try:
        value = cls.modules_collection[default.canonical_path].value
    except Exception:  # noqa: BLE001 - not a constant griffe can see
        return None
    text = str(value) if value is not None else ""
    return text if text and len(text) <= 160 and text != str(default) else None


# --------------------------------------------------------------------------------------------------
# The check of the rendered reference (run on every page by the build, and on the built site by tests/test_docs.py)

RAW_REST = {
    "a reST role": re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const|ref|term):"),
    "a reST ~short reference": re.compile(r"~(?:clusterlm|cluster_kernels)\."),
    "a reST literal-block marker '::'": re.compile(r"\S::(?=\s|$)"),
}
# the elements Markdown, mkdocstrings and Material write; any other tag is text a browser would swallow
HTML_TAGS = set("""a abbr autoref b blockquote br button caption code col colgroup dd del details div dl dt em
    figcaption figure h1 h2 h3 h4 h5 h6 hr i img input ins kbd label li mark nav ol p path pre s samp section
    small span strong sub summary sup svg table tbody td tfoot th thead tr u ul var""".split())
# first words of a sentence that "name: description" parsing takes for the returned value's name
_NOT_A_NAME = {"the", "a", "an", "one", "each", "every", "its", "their", "this", "that", "true", "false", "none"}
_HEADING = re.compile(r'<h[1-6] id="([^"]+)" class="doc doc-heading">')
_SIGNATURE = re.compile(r'<div class="doc-signature highlight"><pre>(.*?)</pre>', re.S)
_PRIVATE = re.compile(r"(?<![\w.])_[A-Za-z]\w*")


def _text(html: str) -> str:
    return unescape(re.sub(r"<[^>]+>", "", html))


def _section(segment: str, title: str) -> list[tuple[list[str], list[list[str]]]]:
    """The tables of a docstring section (``Returns:``) in ``segment``: (header cells, rows of cell HTML)."""
    out = []
    for m in re.finditer(rf'<span class="doc-section-title">{title}:</span></p>\s*<table>(.*?)</table>', segment, re.S):
        header = [_text(c).strip() for c in re.findall(r"<th>(.*?)</th>", m.group(1), re.S)]
        rows = [re.findall(r"<td>(.*?)</td>", r, re.S)
                for r in re.findall(r'<tr class="doc-section-item">(.*?)</tr>', m.group(1), re.S)]
        out.append((header, rows))
    return out


def _signature_defaults(signature: str) -> dict[str, str] | None:
    """``name(a: int = 1, b=2) -> X`` -> {"a": "1", "b": "2"}; None when it is not a call signature."""
    m = re.match(r"\s*[\w.]+\((.*)\)(?:\s*->.*)?\s*$", signature, re.S)
    if not m:
        return None
    source = f"def f({m.group(1)}): pass"
    try:
        args = ast.parse(source).body[0].args
    except SyntaxError:
        return None
    out = {}
    positional = args.posonlyargs + args.args
    for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults, strict=True):
        out[arg.arg] = ast.get_source_segment(source, default)
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        if default is not None:
            out[arg.arg] = ast.get_source_segment(source, default)
    return out


def _expression(source: str) -> str:
    """A default as written, compared up to quotes and spaces (the signature is formatted, the table is not)."""
    try:
        return ast.dump(ast.parse(source.strip(), mode="eval"))
    except SyntaxError:
        return re.sub(r"\s", "", source)


def reference_problems(html: str) -> list[str]:
    """What is wrong in one rendered page of the API reference: raw reST, a swallowed ``<placeholder>``, a
    mis-parsed ``Returns`` section, a default that is a private helper call or absent."""
    problems = []
    article = re.search(r"<article\b[^>]*>(.*)</article>", html, re.S)  # a whole page: its content
    html = article.group(1) if article else html
    prose = _text(re.sub(r"<pre\b.*?</pre>", "", html, flags=re.S))
    for what, pattern in RAW_REST.items():
        for m in pattern.finditer(prose):
            problems.append(f"{what}: ...{prose[max(0, m.start() - 60): m.end() + 30]!r}...")
    for tag in sorted({t.lower() for t in re.findall(r"</?([A-Za-z][\w-]*)", re.sub(r"<script\b.*?</script>", "",
                                                                                      html, flags=re.S))}
                      - HTML_TAGS):
        problems.append(f"<{tag}> in the HTML: a placeholder in a docstring swallowed as a tag (escape it)")
    parts = _HEADING.split(html)
    for path, segment in zip(parts[1::2], parts[2::2], strict=True):
        for title in ("Returns", "Yields"):
            for header, rows in _section(segment, title):
                if len(rows) > 1:
                    problems.append(f"{path}: {title} has {len(rows)} rows: a wrapped line read as another value")
                if "Name" in header:
                    for row in rows:
                        name = _text(row[header.index("Name")]).strip()
                        if not re.fullmatch(r"[a-z_][a-z0-9_]*", name) or name in _NOT_A_NAME:
                            problems.append(f"{path}: {title} names its value {name!r}: the first word of the "
                                            "description followed by a colon, read as a name")
        signature = _SIGNATURE.search(segment)
        defaults = _signature_defaults(_text(signature.group(1))) if signature else None
        for name, default in (defaults or {}).items():
            if _PRIVATE.search(default):
                problems.append(f"{path}: the default of {name} is {default!r}: a private name, not a value")
        for header, rows in _section(segment, "Parameters"):
            if "Default" in header:
                for row in rows:
                    shown = _text(row[header.index("Default")]).strip()
                    if _PRIVATE.search(shown):
                        problems.append(f"{path}: parameter {_text(row[0]).strip()} defaults to {shown!r}: a "
                                        "private name, not a value")
        if 'doc-label-dataclass"' in segment.split("doc-contents", 1)[0] and defaults:
            for _, rows in _section(segment, "Attributes"):
                for row in rows:
                    name = _text(row[0]).strip()
                    if name in defaults:
                        m = re.search(r"Default:</em>\s*<code>(.*?)</code>", row[-1], re.S)
                        if not m or _expression(_text(m.group(1))) != _expression(defaults[name]):
                            problems.append(f"{path}: attribute {name} does not show its default "
                                            f"{defaults[name]!r}")
    return problems


# --------------------------------------------------------------------------------------------------
# Repository files shown as pages of the site

REPO = Path(__file__).resolve().parents[1]
# a file of the repository outside docs/ -> its page on the site; the guides link the file (../BENCHMARKS.md), which
# also works on GitHub, and the site links the page
REPOSITORY_PAGES = {"BENCHMARKS.md": "benchmarks.md"}
_REPO_LINK = re.compile(r"\]\(\.\./(" + "|".join(re.escape(k) for k in REPOSITORY_PAGES) + r")(#[^)\s]*)?\)")


def on_files(files: Any, config: Any, **kwargs: object) -> Any:
    """``BENCHMARKS.md`` (generated by benchmarks/render_benchmarks.py at the repository root) as the page
    ``benchmarks.md``."""
    from mkdocs.structure.files import File

    for source, page in REPOSITORY_PAGES.items():
        files.append(File.generated(config, page, abs_src_path=str(REPO / source)))
    return files


def on_page_markdown(markdown: str, page: Any = None, **kwargs: object) -> str:
    """A link from docs/ to ``../BENCHMARKS.md`` leads to its page on the site."""
    if page is None or "/" in page.file.src_uri:
        return markdown
    return _REPO_LINK.sub(lambda m: f"]({REPOSITORY_PAGES[m.group(1)]}{m.group(2) or ''})", markdown)


def on_page_content(html: str, page: Any = None, **kwargs: object) -> str:
    """Any reST role the extension did not turn into a link (``:func:<code>x</code>``): the code stays. On a page of
    the API reference, every problem :func:`reference_problems` finds is a warning (``--strict``: an error)."""
    html = _ROLE.sub("", html)
    if page is not None and page.file.src_uri.startswith("reference/"):
        for problem in reference_problems(html):
            _log.warning("%s: %s", page.file.src_uri, problem)
    return html
