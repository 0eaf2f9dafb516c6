"""The layers of ``tests/layers.py`` held against the code's own imports, and the size of its parts.

Every ``.py`` under ``wsd/`` and ``clients/wsd_client/`` is parsed (``ast``: no
module is imported, so neither torch nor a socket is needed) and every import
statement in it counted: at module level, inside functions, under ``if
TYPE_CHECKING``, relative ones, and ``importlib.import_module`` of a literal
name. Without this test a convenient import upward (a role reaching into
another, the wire into a section) or a cycle comes back unnoticed, and with
it the start-up cost and the tangle the layers exist to prevent.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import layers
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"wsd": ROOT / "wsd", "wsd_client": ROOT / "clients" / "wsd_client"}

MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 450
# Modules allowed past MAX_MODULE_LINES (and their classes past MAX_CLASS_LINES) for now, each
# with the reason; test_modules_allowed_past_the_limit_still_need_it says when a line can go.
TOO_LONG_FOR_NOW: set[str] = set()


@dataclass(frozen=True)
class Import:
    """One import of a module of wsd's, where it is written."""

    source: str
    target: str
    path: Path
    line: int

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _modules() -> dict[str, tuple[Path, bool]]:
    """{dotted name: (its file, whether it is a package's ``__init__``)} of both packages."""
    out = {}
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


MODULES = _modules()


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _targets(module: str, is_package: bool, node: ast.AST) -> Iterator[str]:
    """The modules of ours that ``node`` imports: for ``from X import y``, ``X.y`` where that
    is a module, else ``X``."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[:len(package) - (node.level - 1)]
            base = ".".join([*package, *([node.module] if node.module else [])])
        for alias in node.names:
            yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
          and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        yield node.args[0].value


def _imports() -> list[Import]:
    found = []
    for module, (path, is_package) in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(module, is_package, node):
                if _ours(target):
                    found.append(Import(module, target, path, getattr(node, "lineno", 0)))
    return found


IMPORTS = _imports()


def _floor(module: str) -> str:
    floor = layers.floor_of(module)
    return f"floor {floor} ({layers.FLOOR_NAMES[floor]})" if floor is not None else "no floor"


def _broken(imp: Import) -> str | None:
    """What rule ``imp`` breaks and what to do instead, or None."""
    source, target = layers.floor_of(imp.source), layers.floor_of(imp.target)
    assert source is not None and target is not None  # test_every_module_has_a_floor says which
    what = f"{imp.where()}: {imp.source} ({_floor(imp.source)}) imports {imp.target} ({_floor(imp.target)})"
    if target > source:
        return (f"{what}: upward. Move what it needs down to a floor below {imp.source}'s "
                f"(the shared floor for vocabulary, schemas and checks), or pass it in from above.")
    if target < source or imp.source == imp.target:
        return None
    if not layers.SAME_FLOOR[source]:
        role, other = layers.role_of(imp.source), layers.role_of(imp.target)
        if source == 4 and role == other:
            return None
        if source == 4 and (role, other) in layers.ROLE_USES:
            return None
        if source == 4:
            return (f"{what}: role {role} imports role {other}. Talk through the wire, or move what both "
                    f"need to the shared floor; if {role} truly uses {other} as the agent uses the manager, "
                    f"add ({role!r}, {other!r}) with its reason to ROLE_USES in tests/layers.py.")
        return (f"{what}: sideways on {_floor(imp.source)}, which does not import itself. "
                f"Move what both need to the shared floor.")
    return None


def test_every_module_has_a_floor():
    """A module no floor declares would be held to no rule: it is declared before it lands."""
    missing = sorted(m for m in MODULES if layers.floor_of(m) is None)
    assert not missing, (f"modules with no floor: {', '.join(missing)}. Give each its floor in FLOORS "
                         f"(tests/layers.py), by the table in its docstring.")


def test_every_import_names_a_module_that_exists():
    """An import of ours that resolves to no file is a path left behind by a move."""
    unknown = [f"{i.where()}: {i.source} imports {i.target}, which is no module of wsd's"
               for i in IMPORTS if i.target not in MODULES]
    assert not unknown, "\n".join(unknown)


def test_every_declared_pattern_names_a_module():
    """A line of FLOORS or ROLES that matches nothing is a module gone, or a typo."""
    for table in (layers.FLOORS, layers.ROLES):
        stale = [p for p in table
                 if not any(m == p or (p.endswith(".*") and (m + ".").startswith(p[:-1])) for m in MODULES)]
        assert not stale, f"tests/layers.py names no module: {', '.join(stale)}; remove or correct them"


def test_imports_go_down_the_floors():
    """Each floor imports only the floors below it, and itself as ``SAME_FLOOR`` allows; the
    roles one another only as ``ROLE_USES`` says."""
    broken = [b for b in map(_broken, (i for i in IMPORTS if i.target in MODULES)) if b]
    assert not broken, f"{len(broken)} imports against the layers:\n" + "\n".join(broken)


def test_shared_floor_imports_nothing_above_it():
    """Named apart, the rule the others rest on: the shared floor loads no wire, no section and
    no role, so that importing the command table or an error costs nothing else."""
    above = [f"{i.where()}: {i.source} imports {i.target} ({_floor(i.target)})" for i in IMPORTS
             if layers.floor_of(i.source) == 0 and layers.floor_of(i.target) != 0]
    assert not above, "\n".join(above)


def _cycle() -> list[str] | None:
    """One import cycle between modules of ours, as the modules around it, or None."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in IMPORTS:
        if i.target in MODULES and i.target != i.source:
            graph[i.source].add(i.target)
    state: dict[str, int] = {}  # 1 on the path being walked, 2 done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target):], target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_import_cycle():
    """Not one cycle, counting every import statement: a cycle is a layer rule broken
    somewhere, and an order of imports that works only by luck."""
    cycle = _cycle()
    if cycle:
        lines = [next(i.where() for i in IMPORTS if i.source == a and i.target == b) for a, b in pairwise(cycle)]
        pytest.fail("an import cycle: " + " -> ".join(cycle) + "\n  at " + ", ".join(lines)
                    + "\nMove what the lower module needs from the higher one down to the lower one's floor.")


def test_the_checker_sees_every_kind_of_import():
    """The rules hold only if the walk counts what it claims to: a checker that missed
    function-level or TYPE_CHECKING imports would pass a broken tree."""
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from wsd.config import WsdConfig\n"
              "def f():\n    import wsd.programs.up\n    from . import fmt\n    from .wire import protocol\n"
              "importlib.import_module('wsd.manager.core')\n")
    found = {t for node in ast.walk(ast.parse(source)) for t in _targets("wsd.errors", False, node)}
    assert {"wsd.config", "wsd.programs.up", "wsd.fmt", "wsd.wire.protocol", "wsd.manager.core"} <= found


# -- size ----------------------------------------------------------------------------------------


def test_modules_and_classes_stay_small_enough_to_read():
    """A module past 500 lines or a class past 450 is more than one reader holds in mind
    (STYLE.md): split it by responsibility, not by moving halves."""
    too_long = []
    for path, _ in MODULES.values():
        name = str(path.relative_to(ROOT))
        if name in TOO_LONG_FOR_NOW:
            continue
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{name}: {lines} lines, more than {MAX_MODULE_LINES}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    too_long.append(f"{name}:{node.lineno}: class {node.name} is {size} lines, "
                                    f"more than {MAX_CLASS_LINES}")
    assert not too_long, "split these by responsibility:\n" + "\n".join(too_long)


def test_modules_allowed_past_the_limit_still_need_it():
    """An exception outlives its reason unnoticed: once the module is short, its line goes."""
    for name in TOO_LONG_FOR_NOW:
        path = ROOT / name
        assert path.exists() and len(path.read_text().splitlines()) > MAX_MODULE_LINES, (
            f"{name} is within {MAX_MODULE_LINES} lines (or gone): remove it from TOO_LONG_FOR_NOW")
