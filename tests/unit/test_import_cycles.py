"""Imports inside ``sp_kpool`` flow one way: the module-level imports form a DAG.

Every module of the package is parsed (``ast``, nothing is imported) and its imports of
other ``sp_kpool`` modules are sorted into module-level ones (run when the module is
imported; ``if TYPE_CHECKING:`` blocks excluded, they never run) and function-level ones
(lazy: run when the function is called). Imports by name count too: a call of
``importlib.import_module`` (or ``__import__``) with a constant name imports that module, and
a string that names a package module (``"sp_kpool.x"``, or an f-string ``f"sp_kpool.x.{n}"``:
every module under ``sp_kpool.x``) is a lazy import of it wherever it is written (it is
there to be imported by name); a call whose name is no constant must be one of
:data:`DYNAMIC_IMPORTS`. Module-level imports must form a DAG; a cycle fails the test,
naming it. Lazy imports are allowed and listed (``pytest -s
tests/unit/test_import_cycles.py``), as are the layers of the package; a lazy import that
closes a cycle (an import that points back up) must be one of :data:`LAZY_BACK_EDGES`,
each with its reason (there are none).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "sp_kpool"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

#: The lazy imports that point back up the layers, and why each is one (nothing else may
#: close a cycle, even lazily). None: where a lower module needs a service of a higher one,
#: the higher one gives it at its import (``sharding.register_collectives``,
#: ``capture.register_reader``; ``sp_kpool/__init__`` imports the givers).
LAZY_BACK_EDGES: dict[tuple[str, str], str] = {}

#: The modules that import by a name the walk cannot read (no constant), and why each may:
#: the names they import are counted where they are written.
DYNAMIC_IMPORTS = {
    "_probe": "the optional GPU packages by name (triton, tilelang, deep_gemm, lmdeploy): none of sp_kpool",
    "bench.record": "the optional GPU packages' versions for a benchmark record: none of sp_kpool",
    "bench.e2e": "the optional GPU packages imported before the record is written (CUDA runs): none of sp_kpool",
    "testing.triton_interp": "the kernel modules under the Triton interpreter, by the names its callers write "
                             "(counted there: testing.standins names sp_kpool.kernels.*)",
}  # fmt: skip


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")  # fmt: skip


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The ``sp_kpool`` modules that ``node`` (in ``module``) imports: ``from . import x``
    imports the submodule ``x`` when it is one, else the package itself."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == PACKAGE]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != PACKAGE:
        return []
    out = []
    for a in node.names:
        sub = f"{target}.{a.name}"
        out.append(sub if sub in known else target)
    return out


def _import_call(call: ast.Call, import_names: set[str]) -> bool:
    """Whether ``call`` imports a module by name: ``importlib.import_module(...)``,
    ``importlib.__import__(...)``, ``__import__(...)``, or a name ``from importlib import``
    bound (``import_names``)."""
    f = call.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        return f.value.id == "importlib" and f.attr in ("import_module", "__import__")
    return isinstance(f, ast.Name) and (f.id == "__import__" or f.id in import_names)


def _called_name(call: ast.Call, module: str, is_package: bool) -> str | None:
    """The absolute name an import call imports, or ``None`` when it is no constant (a
    relative name is resolved against a constant ``package``, ``__package__`` or ``__name__``)."""
    arg = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "name"), None)
    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
        return None
    name = arg.value
    if not name.startswith("."):
        return name
    pkg = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "package"), None)
    if isinstance(pkg, ast.Constant) and isinstance(pkg.value, str):
        base = pkg.value
    elif isinstance(pkg, ast.Name) and pkg.id in ("__package__", "__name__"):
        base = module if is_package or pkg.id == "__name__" else module.rpartition(".")[0]
    else:
        return None
    level = len(name) - len(name.lstrip("."))
    parts = base.split(".")
    parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([name.lstrip(".")] if name.lstrip(".") else []))


def _named_modules(node: ast.AST, known: set[str]) -> list[str]:
    """The package modules a string names: ``"sp_kpool.x"`` names ``sp_kpool.x``; an
    f-string that starts ``f"sp_kpool.x.{...}"`` names every module under ``sp_kpool.x``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
        return [node.value]
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        head = str(node.values[0].value)
        if head.startswith(PACKAGE + ".") and head.endswith(".") and len(node.values) > 1:
            return sorted(m for m in known if m.startswith(head))
    return []


def import_graph(root: Path = ROOT, dynamic: dict[str, list[int]] | None = None
                 ) -> tuple[dict[str, set[str]], dict[str, set[str]]]:  # fmt: skip
    """``(module_level, lazy)``: for each module of the package under ``root``, the package
    modules it imports at module level, and those it imports inside functions only (or
    names in a string: lazy). Importing ``a.b.c`` also runs ``a.b`` and ``a``: a
    module-level edge to each package on the way is added (a package ``__init__`` is a
    module like any other). ``dynamic``, if given, gets for each module the lines of its
    import calls whose name is no constant."""
    paths = sorted(root.rglob("*.py"))
    names = {_module_name(p, root): p for p in paths}
    known = set(names)
    top: dict[str, set[str]] = {m: set() for m in names}
    lazy: dict[str, set[str]] = {m: set() for m in names}

    def add(module: str, target: str, in_function: bool) -> None:
        chain = [".".join(target.split(".")[:i]) for i in range(1, target.count(".") + 2)]
        for m in chain:
            if m in known and m != module and not module.startswith(m + "."):
                (lazy if in_function else top)[module].add(m)

    def visit(node: ast.AST, module: str, is_package: bool, in_function: bool, import_names: set[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for c in child.orelse:  # the ``else`` of ``if TYPE_CHECKING`` runs
                    visit(ast.Module(body=[c], type_ignores=[]), module, is_package, in_function, import_names)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for t in _targets(child, module, is_package, known):
                    add(module, t, in_function)
                continue
            if isinstance(child, ast.Call) and _import_call(child, import_names):
                name = _called_name(child, module, is_package)
                if name is None and dynamic is not None:
                    dynamic.setdefault(module, []).append(child.lineno)
                elif name is not None and name.split(".")[0] == PACKAGE:
                    add(module, name, in_function)
            for named in _named_modules(child, known):  # named by a string: imported by name somewhere
                add(module, named, True)
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, module, is_package, inner, import_names)

    for module, path in names.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        import_names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                        and n.module == "importlib" for a in n.names if a.name in ("import_module", "__import__")}  # fmt: skip
        visit(tree, module, path.name == "__init__.py", False, import_names)
    for module in names:
        lazy[module] -= top[module]
    return top, lazy


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or ``None`` if it is a DAG."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = dfs(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = dfs(m)
            if found:
                return found
    return None


def layers(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules of a DAG by layer, bottom first: a module's layer is one above the
    highest layer it imports (0: imports no package module)."""
    level: dict[str, int] = {}

    def depth(m: str) -> int:
        if m not in level:
            level[m] = 1 + max((depth(n) for n in graph[m]), default=-1)
        return level[m]

    for m in graph:
        depth(m)
    out: list[list[str]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
    for m in sorted(level):
        out[level[m]].append(m)
    return out


def test_module_level_imports_form_a_dag():
    top, lazy = import_graph()
    assert len(top) > 30 and f"{PACKAGE}.config" in top  # the walk found the package
    cycle = find_cycle(top)
    assert cycle is None, "module-level import cycle in sp_kpool: " + " -> ".join(cycle)
    print("\nlayers of sp_kpool, bottom first (module-level imports):")
    for i, mods in enumerate(layers(top)):
        print(f"  {i}: {', '.join(m.removeprefix(PACKAGE + '.') for m in mods)}")
    print("function-level (lazy) imports:")
    for m in sorted(lazy):
        if lazy[m]:
            print(f"  {m} -> {', '.join(sorted(lazy[m]))}")


def test_lazy_imports_close_no_cycle_but_the_listed_ones():
    top, lazy = import_graph()
    allowed = {(f"{PACKAGE}.{a}", f"{PACKAGE}.{b}") for a, b in LAZY_BACK_EDGES}
    graph = {m: top[m] | {n for n in lazy[m] if (m, n) not in allowed} for m in top}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle through a lazy import in sp_kpool: " + " -> ".join(cycle)
    for a, b in allowed:  # each listed one is still there, and still lazy
        assert b in lazy[a], f"{a} -> {b} is listed in LAZY_BACK_EDGES but is no lazy import: drop it"


def test_imports_by_a_name_the_walk_cannot_read_are_listed():
    dynamic: dict[str, list[int]] = {}
    import_graph(dynamic=dynamic)
    listed = {f"{PACKAGE}.{m}" for m in DYNAMIC_IMPORTS}
    unlisted = {m: lines for m, lines in dynamic.items() if m not in listed}
    assert not unlisted, f"imports by a name that is no constant (list them in DYNAMIC_IMPORTS, with why): {unlisted}"
    gone = listed - set(dynamic)
    assert not gone, f"listed in DYNAMIC_IMPORTS but no import call by a variable name is left: drop {sorted(gone)}"


def test_the_low_modules_stay_low():
    """The leaves import nothing but leaves, and the backend interface sits below the
    pipeline (lazy imports included: a lazy import of the pipeline is still one)."""
    top, lazy = import_graph()

    def reach(m: str) -> set[str]:
        seen, todo = set(), [m]
        while todo:
            m = todo.pop()
            for n in (top[m] | lazy[m]) - seen:
                seen.add(n)
                todo.append(n)
        return seen

    leaves = {f"{PACKAGE}.{m}" for m in ("settings", "checks", "config", "layouts", "registry", "batch", "timing")}
    for leaf in leaves:
        assert reach(leaf) <= leaves, f"{leaf} imports {sorted(reach(leaf) - leaves)}"
    above = {f"{PACKAGE}.{m}" for m in ("pipeline", "agreement", "api", "indexer", "capture", "balance", "plan",
                                         "sharding", "comm", "scoring", "selection", "backends")}  # fmt: skip
    assert not reach(f"{PACKAGE}.backends.base") & above, sorted(reach(f"{PACKAGE}.backends.base") & above)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / PACKAGE / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root / PACKAGE


CYCLE = ["sp_kpool.a", "sp_kpool.b", "sp_kpool.a"]


@pytest.mark.parametrize("b_text, cycle, lazy_b", [
    ("from . import a\n", CYCLE, set()),
    ("from .a import X\n", CYCLE, set()),
    ("import sp_kpool.a\n", CYCLE, set()),
    ("def f():\n    from . import a\n", None, {"sp_kpool.a"}),  # lazy: allowed, listed
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import X\n", None, set()),  # type only
    # by name: importlib with a constant name, a relative one, __import__; a string naming a module
    ("import importlib\nA = importlib.import_module('sp_kpool.a')\n", CYCLE, set()),
    ("from importlib import import_module as im\nA = im('.a', __package__)\n", CYCLE, set()),
    ("def f():\n    return __import__('sp_kpool.a')\n", None, {"sp_kpool.a"}),
    ("import importlib\ndef f():\n    return importlib.import_module('.a', 'sp_kpool')\n", None, {"sp_kpool.a"}),
    ("NAME = 'sp_kpool.a'\n", None, {"sp_kpool.a"}),
    ("def f(n):\n    return f'sp_kpool.{n}'\n", None, {"sp_kpool.a"}),
    ("import importlib\ndef f(n):\n    return importlib.import_module(n)\n", None, set()),  # DYNAMIC_IMPORTS
])  # fmt: skip
def test_the_walk_finds_cycles_and_tells_lazy_imports_apart(tmp_path, b_text, cycle, lazy_b):
    root = _write(tmp_path, {"__init__.py": "", "a.py": "from .b import Y\nX = 1\n", "b.py": b_text})
    dynamic: dict[str, list[int]] = {}
    top, lazy = import_graph(root, dynamic)
    assert find_cycle(top) == cycle
    assert lazy["sp_kpool.b"] == lazy_b
    assert find_cycle({m: top[m] | lazy[m] for m in top}) == (None if cycle is None and not lazy_b else CYCLE)
    assert dynamic == ({"sp_kpool.b": [3]} if "import_module(n)" in b_text else {})


def test_a_package_init_is_part_of_the_graph(tmp_path):
    """``from .sub.x import Y`` runs ``sub/__init__``: a cycle through a package init counts."""
    root = _write(tmp_path, {"__init__.py": "", "a.py": "from .sub.x import Y\n", "sub/__init__.py": "from ..a import Z\n",
                             "sub/x.py": "Y = 1\n"})  # fmt: skip
    top, _ = import_graph(root)
    assert find_cycle(top) == ["sp_kpool.a", "sp_kpool.sub", "sp_kpool.a"]
