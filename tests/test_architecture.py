"""The shape of the code: imports point one way and no private name crosses a module boundary.

Every module of ``clusterlm`` and ``cluster_kernels`` is parsed with :mod:`ast` (never imported), so
imports inside functions, ``importlib.import_module("...")`` and ``__import__("...")`` calls all count.
Two rules (docs/architecture.md):

* the graph of imports between project modules has no cycle;
* a leading-underscore name defined in one module is never imported by another (what two modules share is
  public in the module that owns it). Private *modules* (``_checks``, ``_io``, ``_C``) are fine to import:
  the underscore there marks "internal to the package", not "internal to one file".
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"clusterlm": ROOT / "python_api" / "clusterlm", "cluster_kernels": ROOT / "cluster_kernels"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, path in PACKAGES.items():
        for file in sorted(path.rglob("*.py")):
            rel = file.relative_to(path).with_suffix("")
            parts = [pkg, *rel.parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = file
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module an imported dotted name lives in (the longest known prefix), or None."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in MODULES:
            return candidate
    return None


def _where(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    is_pkg = MODULES[module].name == "__init__.py"
    base = module.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` — code that runs only when the file is the ``-m`` entry point."""
    test = node.test if isinstance(node, ast.If) else None
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and len(test.comparators) == 1
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "__main__"
    )


def imports_of(module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in ``module``, nested ones too.

    A module-level ``if __name__ == "__main__":`` block is left out: when it runs, the file is the script
    ``__main__`` (``python -m clusterlm.train``), a different module object from ``clusterlm.train``, so
    its import of the CLI closes no cycle.
    """
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    tree.body = [stmt for stmt in tree.body if not _is_main_guard(stmt)]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name)
                if target:
                    found.append((target, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            for alias in node.names:
                sub = _resolve(f"{source}.{alias.name}")
                if sub and sub != _resolve(source):
                    found.append((sub, None, node.lineno))  # `from pkg import submodule`
                elif _resolve(source):
                    found.append((_resolve(source), alias.name, node.lineno))
        elif isinstance(node, ast.Call):
            func = node.func
            fname = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if fname in ("__import__", "import_module") and node.args and isinstance(node.args[0], ast.Constant):
                target = _resolve(str(node.args[0].value))
                if target:
                    found.append((target, None, node.lineno))
    return [(t, n, line) for t, n, line in found if t != module]


def import_graph() -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for module in MODULES:
        for target, _, _ in imports_of(module):
            # A package's __init__ re-exporting its submodules is not a dependency of the submodules on it.
            if not module.startswith(target + ".") or MODULES[target].name != "__init__.py":
                graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def private_imports() -> list[str]:
    bad = []
    for module in MODULES:
        for target, name, line in imports_of(module):
            if name and name.startswith("_") and not name.startswith("__"):
                bad.append(f"{_where(MODULES[module])}:{line} imports {target}.{name}")
    return bad


def test_every_module_parses():
    assert len(MODULES) > 20
    for module in MODULES:
        imports_of(module)


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (break them; see docs/architecture.md):\n" + "\n".join(
        " -> ".join(c) for c in found
    )


def test_no_private_name_crosses_a_module():
    bad = private_imports()
    assert not bad, "private names imported from another module (make them public where they live):\n" + "\n".join(
        bad
    )


@pytest.mark.parametrize(
    "source",
    [
        "import clusterlm.training.loop\n",
        "def f():\n    from clusterlm.training import loop\n",
        "def f():\n    return __import__('clusterlm.training.loop')\n",
        "import importlib\nx = importlib.import_module('clusterlm.training.loop')\n",
    ],
)
def test_the_checker_sees_every_import_form(source, tmp_path, monkeypatch):
    # The check must fail on a planted cycle, or it proves nothing.
    fake = tmp_path / "select_fake.py"
    fake.write_text(source)
    monkeypatch.setitem(MODULES, "clusterlm.select_fake", fake)
    train = MODULES["clusterlm.training.loop"]
    planted = tmp_path / "train_loop.py"
    planted.write_text(train.read_text() + "\ndef _planted():\n    import clusterlm.select_fake\n")
    monkeypatch.setitem(MODULES, "clusterlm.training.loop", planted)
    assert any("clusterlm.select_fake" in c for c in cycles(import_graph()))


def test_the_main_guard_is_the_only_exemption(tmp_path, monkeypatch):
    planted = tmp_path / "train_loop.py"
    guarded = 'if __name__ == "__main__":\n    from clusterlm.cli.commands import main\n'
    planted.write_text(MODULES["clusterlm.training.loop"].read_text() + "\n" + guarded)
    monkeypatch.setitem(MODULES, "clusterlm.training.loop", planted)
    assert ("clusterlm.cli.commands", "main") not in {(t, n) for t, n, _ in imports_of("clusterlm.training.loop")}
    guarded_not = "\nif True:\n    from clusterlm.cli.commands import main\n"
    planted.write_text(MODULES["clusterlm.training.loop"].read_text() + guarded_not)
    assert ("clusterlm.cli.commands", "main") in {(t, n) for t, n, _ in imports_of("clusterlm.training.loop")}


def test_the_checker_sees_a_private_import(tmp_path, monkeypatch):
    fake = tmp_path / "fake.py"
    fake.write_text("from clusterlm.selection.select import _private_helper\nfrom cluster_kernels import _backend\n")
    monkeypatch.setitem(MODULES, "clusterlm.fake", fake)
    bad = [b for b in private_imports() if "fake.py" in b]
    assert len(bad) == 1 and "_private_helper" in bad[0]


# ---------------------------------------------------------------------------------------------------
# Two more rules of docs/architecture.md: project imports at the top, short functions
# ---------------------------------------------------------------------------------------------------

MAX_FUNCTION_LINES = 80  # body lines without the docstring; Triton kernels (@triton.jit) are exempt


# The one exemption: the modules a process runs when it only parses, checks files and starts ranks (``clusterlm
# --help``, ``clusterlm train --nproc N``'s launcher) import the heavy project modules (torch, transformers behind
# them) where a command or a check needs them, so that process starts in a fraction of a second instead of ~2.5 s of
# a core; test_the_launch_path_imports_no_torch holds them to it. Their imports still count as arrows (cycles).
LAUNCH_PATH = {"clusterlm.cli.commands", "clusterlm.training.run", "clusterlm.training.checks", "clusterlm.plan.core"}


def nested_project_imports() -> list[str]:
    """Imports of project modules inside functions (optional third-party packages may be imported lazily), outside
    :data:`LAUNCH_PATH`."""
    bad = []
    for module, path in MODULES.items():
        if module in LAUNCH_PATH:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        tree.body = [stmt for stmt in tree.body if not _is_main_guard(stmt)]
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom):
                    source = _absolute(module, node)
                    names = [_resolve(f"{source}.{a.name}") or source for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                for name in names:
                    if _resolve(name):
                        bad.append(f"{_where(path)}:{node.lineno} ({fn.name}) imports {name}")
    return sorted(set(bad))


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[str]:
    out = []
    for path in MODULES.values():
        for fn in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if any("jit" in ast.unparse(d) for d in fn.decorator_list):
                continue
            body = fn.body
            first = body[1] if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str) else body[0]
            lines = fn.end_lineno - first.lineno + 1
            if lines > limit:
                out.append(f"{_where(path)}:{fn.lineno} {fn.name}: {lines} lines")
    return out


def test_project_modules_are_imported_at_the_top():
    bad = nested_project_imports()
    assert not bad, "imports of project modules inside functions (move them to the top of the module):\n" + "\n".join(
        bad
    )


def test_no_function_is_over_80_lines():
    bad = long_functions()
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines without their docstring (split them):\n" + "\n".join(
        bad
    )


def test_the_length_rule_sees_a_long_function(tmp_path, monkeypatch):
    fake = tmp_path / "long.py"
    fake.write_text("def f():\n    '''doc'''\n" + "    x = 1\n" * 81 + "\n\ndef g():\n" + "    x = 1\n" * 80)
    monkeypatch.setitem(MODULES, "clusterlm.long_fake", fake)
    assert [b.split()[-3] for b in long_functions() if "long.py" in b] == ["f:"]


def test_the_launch_path_imports_no_torch():
    """What the exemption buys: the CLI, the trainer's launcher and its checks import neither torch nor
    transformers (a fresh interpreter, so nothing this test session imported counts)."""
    code = ("import sys\n" + "".join(f"import {m}\n" for m in sorted(LAUNCH_PATH))
            + "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split()[-1] == "[]", out.stdout + out.stderr


def test_the_nested_import_rule_sees_a_planted_import(tmp_path, monkeypatch):
    fake = tmp_path / "nested.py"
    fake.write_text("def f():\n    import torch\n    from clusterlm import plan\n")
    monkeypatch.setitem(MODULES, "clusterlm.nested_fake", fake)
    bad = [b for b in nested_project_imports() if "nested.py" in b]
    assert len(bad) == 1 and "clusterlm.plan" in bad[0]  # third-party imports may stay lazy


# ---------------------------------------------------------------------------------------------------
# Settings travel as one config object; the command line only parses
# ---------------------------------------------------------------------------------------------------

MAX_PARAMETERS = 12


def _param_count(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Named parameters (``self`` / ``cls`` not counted; ``*args`` / ``**kwargs`` count one each)."""
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def wide_public_functions(limit: int = MAX_PARAMETERS) -> list[str]:
    """Public functions and methods of ``clusterlm`` taking more than ``limit`` parameters.

    Constructors (``__init__``) are config constructors and exempt, as is the kernel layer (``cluster_kernels``
    keeps its sklearn / faiss-style keyword APIs)."""
    out = []
    for module, path in MODULES.items():
        if not module.startswith("clusterlm"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        scopes = [tree, *(n for n in tree.body if isinstance(n, ast.ClassDef) and not n.name.startswith("_"))]
        for scope in scopes:
            for fn in scope.body:
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name.startswith("_"):
                    continue
                if _param_count(fn) > limit:
                    out.append(f"{_where(path)}:{fn.lineno} {fn.name}: {_param_count(fn)} parameters")
    return out


def test_no_public_function_takes_more_than_12_parameters():
    bad = wide_public_functions()
    assert not bad, "public functions with more than 12 parameters (pass a config object):\n" + "\n".join(bad)


def test_the_parameter_rule_sees_a_wide_function(tmp_path, monkeypatch):
    fake = tmp_path / "wide.py"
    args = ", ".join(f"a{i}" for i in range(13))
    fake.write_text(f"def wide({args}):\n    pass\n\n\ndef _private({args}):\n    pass\n\n\n"
                    f"class C:\n    def __init__(self, {args}):\n        pass\n\n    def method(self, *, {args}):\n"
                    "        pass\n")
    monkeypatch.setitem(MODULES, "clusterlm.wide_fake", fake)
    assert sorted(b.split()[1] for b in wide_public_functions() if "wide.py" in b) == ["method:", "wide:"]


# cli.py parses and maps errors to exit codes; the work is in library modules. Its functions are argument
# types (*_arg), parser builders (add_*_args, build_*parser, *_parser, the _Parser class), option -> settings
# mappings (*_config, *_job, _split: parsed values to a config class's fields), thin command entries (cmd_*: one
# call into a library module) and the error map (main, _config_file, _run, _fail, _user_message, error).
CLI_FUNCTION_FORMS = ("_arg", "add_", "build_", "_parser", "_config", "_job", "cmd_", "_args")
CLI_OPTION_MAPPING = {"_split"}
CLI_ERROR_MAP = {"main", "console_main", "_config_file", "_run", "_fail", "_user_message", "error"}
MAX_CMD_LINES = 25


def cli_work_functions(path: Path | None = None) -> list[str]:
    """Functions of cli.py that are neither parsing nor error mapping (or a cmd_* entry over 25 lines)."""
    path = path or MODULES["clusterlm.cli.commands"]
    out = []
    for fn in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        name = fn.name
        if name in CLI_ERROR_MAP or name in CLI_OPTION_MAPPING:
            continue
        if not any(name.endswith(f) or name.startswith(f) or f.strip("_") in name for f in CLI_FUNCTION_FORMS):
            out.append(f"{_where(path)}:{fn.lineno} {name}: not parsing or error mapping")
        elif name.startswith("cmd_") and fn.end_lineno - fn.lineno + 1 > MAX_CMD_LINES:
            size = fn.end_lineno - fn.lineno + 1
            out.append(f"{_where(path)}:{fn.lineno} {name}: a command entry doing work ({size} lines; move the work "
                       "into a library module)")
    return out


def test_cli_only_parses_and_maps_errors():
    bad = cli_work_functions()
    assert not bad, "cli.py functions that do work (move them into the library):\n" + "\n".join(bad)


def test_the_cli_rule_sees_work(tmp_path):
    fake = tmp_path / "cli.py"
    fake.write_text("def _ratio_arg(v):\n    return v\n\n\ndef feature_store_key(a):\n    return a\n\n\n"
                    "def cmd_big(a):\n" + "    x = 1\n" * 30)
    bad = cli_work_functions(fake)
    assert [b.split()[1] for b in bad] == ["feature_store_key:", "cmd_big:"]


# ------------------------------------------------------------------------------------------------------------------
# The C++/CUDA core (csrc): every file at most 600 lines, every function at most 80 (by brace matching), and the CPU
# and CUDA sides mirrored file for file.
# ------------------------------------------------------------------------------------------------------------------

CSRC = ROOT / "csrc"
CPP_SUFFIXES = {".h", ".cpp", ".cu", ".cuh"}
MAX_CPP_FILE_LINES = 600
MAX_CPP_FUNCTION_LINES = 80
_NOT_A_FUNCTION = ("namespace", "class", "struct", "union", "enum", "extern", "if", "for", "while", "switch", "do",
                   "else", "try", "catch")


def _cpp_sources(root: Path = CSRC) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in CPP_SUFFIXES)


def _strip_cpp(text: str) -> str:
    """The text with comments, string and character literals and preprocessor lines blanked (newlines kept), so
    that only code braces are left to match."""
    out, i, n = [], 0, len(text)
    while i < n:
        c, nxt = text[i], text[i + 1 : i + 2]
        if c == "/" and nxt == "/":
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif c == "/" and nxt == "*":
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(" ")
            i = j + 1
        elif c == "#" and (i == 0 or text[i - 1] == "\n"):
            j = i
            while True:  # a preprocessor line, with its continuations
                k = text.find("\n", j)
                if k < 0 or text[k - 1] != "\\":
                    break
                j = k + 1
            out.append("\n" * text.count("\n", i, n if k < 0 else k))
            i = n if k < 0 else k
        else:
            out.append(c)
            i += 1
    return "".join(out)


def cpp_functions(path: Path) -> list[tuple[str, int, int]]:
    """(header, first line, length in lines) of every outermost function body of a C++/CUDA file: a brace block
    whose header (the code since the last ``;``, ``{`` or ``}``) has a parameter list and is not a namespace, type or
    control statement. Lambdas and local classes count toward the function around them."""
    code = _strip_cpp(path.read_text())
    found, stack, last = [], [], 0  # stack: (is_function, header, first line) per open brace
    for i, c in enumerate(code):
        if c in ";":
            last = i + 1
        elif c == "{":
            header = code[last:i].strip()
            in_function = any(kind for kind, _, _ in stack)
            words = header.replace("(", " ").split()
            is_function = (not in_function and "(" in header and ")" in header and not header.endswith("=")
                           and not (words and words[0] in _NOT_A_FUNCTION))
            start = code.count("\n", 0, last + (len(code[last:i]) - len(code[last:i].lstrip()))) + 1
            stack.append((is_function, " ".join(header.split()), start))
            last = i + 1
        elif c == "}":
            if stack:
                is_function, header, start = stack.pop()
                if is_function:
                    found.append((header[-80:], start, code.count("\n", 0, i) + 1 - start + 1))
            last = i + 1
    return found


def long_cpp_files(limit: int = MAX_CPP_FILE_LINES, root: Path = CSRC) -> list[str]:
    return [f"{p.relative_to(root)}: {n} lines" for p in _cpp_sources(root)
            if (n := len(p.read_text().splitlines())) > limit]


def long_cpp_functions(limit: int = MAX_CPP_FUNCTION_LINES, root: Path = CSRC) -> list[str]:
    return [f"{p.relative_to(root)}:{start}: {lines} lines ({header})" for p in _cpp_sources(root)
            for header, start, lines in cpp_functions(p) if lines > limit]


def unmirrored_files(root: Path = CSRC) -> list[str]:
    """Files of cpu/ without a file of the same stem in cuda/ (and back) whose first line does not say why."""
    stems = {side: {p.stem for p in (root / side).glob("*") if p.suffix in CPP_SUFFIXES} for side in ("cpu", "cuda")}
    bad = []
    sides = (("cpu", "cuda", "// No CUDA counterpart: "), ("cuda", "cpu", "// No CPU counterpart: "))
    for side, other, reason in sides:
        for p in sorted((root / side).glob("*")):
            if p.suffix in CPP_SUFFIXES and p.stem not in stems[other] and not p.read_text().startswith(reason):
                bad.append(f"{side}/{p.name}: no {other}/{p.stem}.* and no first line '{reason}<why>'")
    return bad


def test_no_csrc_file_is_over_600_lines():
    assert not long_cpp_files(), "split these files (one class or mechanism per file):\n" + "\n".join(long_cpp_files())


def test_no_csrc_function_is_over_80_lines():
    found = long_cpp_functions()
    assert not found, "split these functions:\n" + "\n".join(found)


def test_cpu_and_cuda_mirror_each_other_file_for_file():
    found = unmirrored_files()
    assert not found, "\n".join(found)


def test_the_cpp_size_rules_see_planted_violations(tmp_path):
    side = tmp_path / "cpu"
    side.mkdir()
    (tmp_path / "cuda").mkdir()
    body = "\n".join(f'  x += {i};  // {{ "}}" brace-like text is not code' for i in range(80))
    (side / "long.cpp").write_text(f"namespace ns {{\nint long_one(int x) {{\n{body}\n  return x;\n}}\n}}\n")
    (side / "short.cpp").write_text("struct S {\n  int f() const { return '{'; }\n};\nint g() {\n  return 1;\n}\n")
    (side / "big.h").write_text("// No CUDA counterpart: a planted file.\n" + "int v;\n" * MAX_CPP_FILE_LINES)
    assert [line.split(":")[0] for line in long_cpp_functions(root=tmp_path)] == ["cpu/long.cpp"]
    assert [line.split(":")[0] for line in long_cpp_files(root=tmp_path)] == ["cpu/big.h"]
    assert cpp_functions(side / "short.cpp") == [("int f() const", 2, 1), ("int g()", 4, 3)]
    assert sorted(line.split(":")[0] for line in unmirrored_files(tmp_path)) == ["cpu/long.cpp", "cpu/short.cpp"]


# ---------------------------------------------------------------------------------------------------
# Size and settings rules (issue 35): modules of one job, settings as typed configs
# ---------------------------------------------------------------------------------------------------

MAX_MODULE_LINES = 600
NAMESPACE_ALLOWED = {"clusterlm.cli.commands"}  # the one module that may hold an argparse namespace (report)


def long_modules(modules: dict[str, Path], limit: int = MAX_MODULE_LINES) -> list[tuple[str, int]]:
    """(module, lines) of every module longer than ``limit`` lines."""
    out = []
    for name, path in modules.items():
        n = len(path.read_text().splitlines())
        if n > limit:
            out.append((name, n))
    return out


def namespace_uses(path: Path) -> list[tuple[int, str]]:
    """(line, what) of every ``argparse.Namespace`` (attribute, import or annotation) and every ``args: Any``
    parameter in a file: settings travel as typed configs outside cli.py."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "Namespace":
            found.append((node.lineno, "argparse.Namespace"))
        elif isinstance(node, ast.ImportFrom) and node.module == "argparse":
            found += [(node.lineno, "from argparse import Namespace") for a in node.names if a.name == "Namespace"]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):  # (``*args: Any`` is a vararg, not args)
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
                text = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if arg.arg == "args" and (text in ("Any", "typing.Any") or "Namespace" in text):
                    found.append((arg.lineno, f"args: {text}"))
    return found


def test_no_module_is_longer_than_600_lines():
    assert long_modules(MODULES) == [], "split these modules along their seams (docs/architecture.md)"


def test_the_size_rule_catches_a_planted_long_module(tmp_path):
    planted = tmp_path / "long.py"
    planted.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert long_modules({"clusterlm.planted": planted}) == [("clusterlm.planted", MAX_MODULE_LINES + 1)]
    planted.write_text("x = 1\n" * MAX_MODULE_LINES)
    assert long_modules({"clusterlm.planted": planted}) == []


def test_no_argparse_namespace_outside_cli():
    bad = {m: namespace_uses(p) for m, p in MODULES.items() if m not in NAMESPACE_ALLOWED}
    assert {m: uses for m, uses in bad.items() if uses} == {}, "pass a typed config (TrainConfig, CompareConfig)"


def test_the_namespace_rule_catches_planted_violations(tmp_path):
    planted = tmp_path / "bad.py"
    planted.write_text("import argparse\nfrom typing import Any\n\n\ndef f(args: Any) -> None:\n    pass\n\n\n"
                       "def g(x: argparse.Namespace) -> None:\n    pass\n\n\nfrom argparse import Namespace\n")
    assert sorted(w for _, w in namespace_uses(planted)) == ["argparse.Namespace", "args: Any",
                                                             "from argparse import Namespace"]
    planted.write_text("def f(config: 'TrainConfig', args: list[str], *args2: Any) -> None:\n    pass\n\n\n"
                       "def g(*args: Any) -> None:\n    pass\n")
    assert namespace_uses(planted) == []


def test_the_longest_modules_named_for_the_test_order_exist():
    """tests/conftest.py orders the longest modules first for the two xdist workers: a renamed one must follow."""
    tree = ast.parse((ROOT / "tests" / "conftest.py").read_text(encoding="utf-8"))
    named = next(ast.literal_eval(node.value) for node in tree.body
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "LONGEST_MODULES")
    missing = [m for m in named if not (ROOT / m).is_file()]
    assert named and not missing, f"tests/conftest.py LONGEST_MODULES names modules that do not exist: {missing}"


# ------------------------------------------------------------------------------------------------------------------
# Subpackages by job, in layers (docs/architecture.md): a module imports its own subpackage and those below it only;
# the configs at the bottom import neither torch nor transformers; the job functions stay functions.
# ------------------------------------------------------------------------------------------------------------------

LAYERS = (  # top to bottom
    ("clusterlm.cli", "clusterlm.__main__", "clusterlm.train"),
    ("clusterlm.comparison",),
    ("clusterlm.integrations",),
    ("clusterlm.training",),
    ("clusterlm.tasks",),
    ("clusterlm.selection",),
    ("clusterlm.models",),
    ("clusterlm.engine",),
    ("clusterlm.plan",),
    ("clusterlm.data",),
    ("clusterlm.launch",),
    ("clusterlm.config",),
    ("clusterlm.fileio", "clusterlm.lazy"),
    ("cluster_kernels",),
)
FACADE = "clusterlm"  # the package __init__: public names loaded lazily, by name, from any layer
MAX_ROOT_MODULES = 12
MAX_SUBPACKAGE_MODULES = 15


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of the entry that holds ``module`` (the longest matching prefix)."""
    best, found = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), i
    assert found is not None, f"{module} is in no layer of LAYERS: add its subpackage (docs/architecture.md)"
    return found


def upward_imports() -> list[str]:
    bad = []
    for module in MODULES:
        if module == FACADE:
            continue
        for target, _, line in imports_of(module):
            if target != FACADE and layer_of(target) < layer_of(module):
                bad.append(f"{_where(MODULES[module])}:{line} ({LAYERS[layer_of(module)][0]}) imports {target} "
                           f"({LAYERS[layer_of(target)][0]}, a layer above)")
    return bad


def test_every_module_is_in_a_layer_and_imports_point_down():
    bad = upward_imports()
    assert not bad, "imports up the layers (move the shared code down; docs/architecture.md):\n" + "\n".join(bad)


def test_the_layer_rule_sees_a_planted_upward_import(tmp_path, monkeypatch):
    planted = tmp_path / "training.py"
    planted.write_text(MODULES["clusterlm.config.training"].read_text() + "\nimport clusterlm.training.loop\n")
    monkeypatch.setitem(MODULES, "clusterlm.config.training", planted)
    bad = [b for b in upward_imports() if "clusterlm.training.loop" in b]
    assert len(bad) == 1 and "(clusterlm.config)" in bad[0]


def package_sizes() -> dict[str, int]:
    """Modules (``.py`` files but ``__init__``) directly in the package root and in each subpackage."""
    root = PACKAGES["clusterlm"]
    sizes = {"clusterlm": len([p for p in root.glob("*.py") if p.name != "__init__.py"])}
    for init in root.rglob("__init__.py"):
        if init.parent != root:
            sizes[".".join(("clusterlm", *init.parent.relative_to(root).parts))] = len(
                [p for p in init.parent.glob("*.py") if p.name != "__init__.py"])
    return sizes


def test_the_root_and_every_subpackage_stay_small():
    sizes = package_sizes()
    assert sizes["clusterlm"] <= MAX_ROOT_MODULES, f"{sizes['clusterlm']} modules at the package root"
    big = {name: n for name, n in sizes.items() if name != "clusterlm" and n > MAX_SUBPACKAGE_MODULES}
    assert not big, f"subpackages over {MAX_SUBPACKAGE_MODULES} modules (split them by job): {big}"


CONFIG_MODULES = sorted(m for m in MODULES if m.startswith("clusterlm.config"))


def test_configs_import_neither_torch_nor_transformers():
    # A fresh interpreter: this one has torch loaded already.
    code = ("import sys, importlib\nimport clusterlm\n"
            f"for m in {CONFIG_MODULES!r}:\n    importlib.import_module(m)\n"
            "for name in ('SelectConfig', 'TrainConfig', 'CompareConfig', 'ExportConfig'):\n"
            "    getattr(clusterlm, name)\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"importing the configs loaded {done.stdout.strip()}"
    assert len(CONFIG_MODULES) > 5


def test_the_job_functions_stay_functions_whatever_is_imported():
    code = ("import types, importlib\nimport clusterlm\n"
            "for m in ('clusterlm.train', 'clusterlm.selection.select', 'clusterlm.comparison.run', "
            "'clusterlm.training.run'):\n    importlib.import_module(m)\n"
            "print([type(getattr(clusterlm, n)).__name__ for n in ('select', 'train', 'compare')])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['function', 'function', 'function']", done.stdout


def test_no_stand_in_package_module():
    """No code puts a substitute ``clusterlm`` module into ``sys.modules`` (the package imports nothing heavy)."""
    bad = [f"{_where(p)}" for m, p in MODULES.items() if m.startswith("clusterlm")
           and ("sys.modules['clusterlm']" in p.read_text() or 'sys.modules["clusterlm"]' in p.read_text())]
    assert not bad, f"stand-in package modules in {bad}"
