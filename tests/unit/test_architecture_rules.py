"""Three house rules, checked on the source (``ast``; nothing is imported):

- one settings reader: inside ``sp_kpool`` only ``sp_kpool/settings.py`` reads the process
  environment (``os.environ``, ``os.getenv``, ``os.path.expanduser``, ``Path.home``); the
  others take a :class:`~sp_kpool.settings.Settings`. The few test helpers that *set* a
  variable for the process they test are listed in :data:`ENV_WRITERS`, each with its reason;
- scripts and examples use the installed package: no file of ``sp_kpool/``, ``scripts/`` or
  ``examples/`` edits ``sys.path``;
- small rooms: no package module (``.py``, ``.cu``, ``.cuh``) is over :data:`MAX_LINES` lines
  (tests are exempt).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The most lines a package module may have.
MAX_LINES = 500

#: Files of the package that touch the environment, and why each may.
ENV_WRITERS = {
    "sp_kpool/settings.py": "the one settings reader",
    "sp_kpool/testing/fault_cases.py": "sets one rank's SP_KPOOL_* variables to test that every rank raises alike",
    "sp_kpool/testing/triton_interp.py": "sets TRITON_INTERPRET=1 for the interpreter process it runs in",
}

#: ``module.attribute`` reads of the environment (``os.environ[...]``, ``os.getenv(...)``, ...).
ENV_READS = {("os", "environ"), ("os", "getenv"), ("os", "environb"), ("os", "getenvb"), ("path", "expanduser"),
             ("Path", "home")}  # fmt: skip
#: Names that, imported from ``os`` / ``os.path``, read the environment.
ENV_NAMES = {"environ", "getenv", "environb", "getenvb", "expanduser"}


def env_reads(source: str) -> list[str]:
    """Where ``source`` reads the environment, as ``line N: text``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        hit = False
        if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute)):
            owner = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
            hit = (owner, node.attr) in ENV_READS
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "os.path", "posixpath"):
            hit = any(a.name in ENV_NAMES for a in node.names)
        if hit:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def sys_path_edits(source: str) -> list[str]:
    """Where ``source`` changes ``sys.path`` (a call of its methods, an assignment, ``+=``)."""
    found = []

    def is_sys_path(n: ast.AST) -> bool:
        return isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name) and n.value.id == "sys"

    for node in ast.walk(ast.parse(source)):
        hit = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value)) or (
            isinstance(node, (ast.Assign, ast.AugAssign))
            and any(is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value))
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))
        )  # fmt: skip
        if hit:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def _files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def test_only_settings_reads_the_environment():
    files = _files("sp_kpool")
    assert len(files) > 30 and ROOT / "sp_kpool/kernels/cuda_fp8_mqa.py" in files  # the walk found the package
    bad = {}
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        reads = env_reads(path.read_text())
        if reads and rel not in ENV_WRITERS:
            bad[rel] = reads
    assert not bad, f"only sp_kpool/settings.py reads the environment (add a Settings field), but: {bad}"
    for rel in ENV_WRITERS:  # each listed one is still there and still needs it
        assert env_reads((ROOT / rel).read_text()), f"{rel} is listed in ENV_WRITERS but reads no variable: drop it"


def test_scripts_examples_and_the_package_do_not_edit_sys_path():
    files = _files("sp_kpool", "scripts", "examples")
    assert ROOT / "scripts/output_digest.py" in files and ROOT / "sp_kpool/bench/replay.py" in files and ROOT / "examples/xtuner_sp.py" in files
    bad = {p.relative_to(ROOT).as_posix(): e for p in files if (e := sys_path_edits(p.read_text()))}
    assert not bad, f"scripts and examples use the installed package (pip install -e .), but these edit sys.path: {bad}"


def test_the_checks_see_what_they_forbid():
    """Each form the rules forbid is found (a check that finds nothing is no check)."""
    reads = ["import os\nx = os.environ.get('A')", "import os\nx = os.getenv('A')",
             "from os import environ", "import os\np = os.path.expanduser('~')", "from pathlib import Path\nPath.home()"]  # fmt: skip
    for src in reads:
        assert env_reads(src), src
    assert not env_reads("import os\np = os.path.join('a', 'b')\nx = settings.cuda_home")
    edits = ["import sys\nsys.path.insert(0, 'x')", "import sys\nsys.path.append('x')", "import sys\nsys.path = []",
             "import sys\nsys.path += ['x']", "import sys\nsys.path[0:0] = ['x']"]  # fmt: skip
    for src in edits:
        assert sys_path_edits(src), src
    assert not sys_path_edits("import sys\nprint(sys.path)")


def test_no_package_module_is_over_500_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for ext in ("py", "cu", "cuh") for p in (ROOT / "sp_kpool").rglob(f"*.{ext}")}  # fmt: skip
    assert len(sizes) > 50
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"split these modules along what a reader looks for (at most {MAX_LINES} lines): {over}"
