"""What a vLLM release offers, read from its live objects or from its source, and what wsd lacks of it.

Two readings of the same thing, so that one comparison serves both: ``live``
(``inspect``, in a process that imported vLLM) and ``source`` (``ast``, over a
release's ``.py`` files, which needs no CUDA and no import). An ``Api`` is the
public functions and classes a module defines, with each one's parameters and,
for a class, its public methods'. ``gaps`` lists what vLLM's workspace module
has that wsd's stand-in does not accept: a name missing, or a signature wsd's
cannot be called with. ``source_params`` finds one patch point in a release's
source.

Imports no vLLM and no torch.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["Api", "Params", "gaps", "live", "live_params", "source", "source_params"]


@dataclass(frozen=True)
class Params:
    """A callable's parameters as a caller sees them (``self`` left out)."""

    positional: tuple[str, ...]
    """Positional-or-keyword (and positional-only) names, in order."""
    keyword: frozenset[str] = frozenset()
    """Keyword-only names."""
    var_positional: bool = False
    var_keyword: bool = False

    def accepts(self, theirs: Params) -> bool:
        """Whether every call ``theirs`` allows is a call these parameters take."""
        if not self.var_positional:
            if self.positional[: len(theirs.positional)] != theirs.positional:
                return False
            if theirs.var_positional:
                return False
        if not self.var_keyword:
            if not theirs.keyword <= self.keyword | set(self.positional):
                return False
            if theirs.var_keyword:
                return False
        return True

    def __str__(self) -> str:
        names = [*self.positional, *(["*"] if self.var_positional else []), *sorted(self.keyword),
                 *(["**"] if self.var_keyword else [])]
        return f"({', '.join(names)})"


@dataclass(frozen=True)
class Api:
    """A module's own public functions and classes: name -> parameters; a class's are its
    constructor's, and its public methods are under ``methods[class name]``."""

    functions: dict[str, Params | None]
    """None: there, with parameters the reading could not tell (a class without its own
    ``__init__``, read from source)."""
    methods: dict[str, dict[str, Params]] = field(default_factory=dict)


# -- from live objects ---------------------------------------------------------------------


def live_params(obj: Any, *, method: bool) -> Params:
    """The parameters of a live callable (``method``: ``self`` left out)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return Params((), var_positional=True, var_keyword=True)  # a builtin: anything
    kinds = inspect.Parameter
    items = list(signature.parameters.values())
    if method and items and items[0].kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD):
        items = items[1:]  # self
    return Params(
        positional=tuple(p.name for p in items if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)),
        keyword=frozenset(p.name for p in items if p.kind is kinds.KEYWORD_ONLY),
        var_positional=any(p.kind is kinds.VAR_POSITIONAL for p in items),
        var_keyword=any(p.kind is kinds.VAR_KEYWORD for p in items),
    )


def live(module: ModuleType, *, own: str | None = None) -> Api:
    """The API of an imported ``module``: what it defines itself (``own``: the module name its
    objects must carry; default its own), public names only, and the public methods of its classes
    as their class attributes say (inherited ones included)."""
    own = own or module.__name__
    functions: dict[str, Params | None] = {}
    methods: dict[str, dict[str, Params]] = {}
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != own:
            continue
        if inspect.isclass(obj):
            functions[name] = live_params(obj.__init__, method=True)
            methods[name] = {
                attr: live_params(getattr(obj, attr), method=True) for attr in dir(obj)
                if not attr.startswith("_") and inspect.isfunction(getattr(obj, attr, None))
            }
        elif inspect.isfunction(obj):
            functions[name] = live_params(obj, method=False)
    return Api(functions, methods)


# -- from source ---------------------------------------------------------------------------------


def _ast_params(node: ast.FunctionDef | ast.AsyncFunctionDef, *, method: bool) -> Params:
    args = node.args
    positional = [a.arg for a in (*args.posonlyargs, *args.args)]
    if method and positional:
        positional = positional[1:]
    return Params(tuple(positional), frozenset(a.arg for a in args.kwonlyargs), args.vararg is not None,
                  args.kwarg is not None)


def _class_methods(node: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {n.name: n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def source(path: Path) -> Api:
    """The API of the module at ``path``, read from its source: its top-level public functions and
    classes (a class's own methods only: its bases are not followed)."""
    functions: dict[str, Params | None] = {}
    methods: dict[str, dict[str, Params]] = {}
    for node in _parse(path).body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        if isinstance(node, ast.ClassDef):
            own = _class_methods(node)
            init = own.get("__init__")
            functions[node.name] = None if init is None else _ast_params(init, method=True)
            methods[node.name] = {name: _ast_params(f, method=True) for name, f in own.items()
                                  if not name.startswith("_")}
        else:
            functions[node.name] = _ast_params(node, method=False)
    return Api(functions, methods)


def source_params(root: Path, module: str, path: str) -> Params | None:
    """The parameters of ``module``'s ``path`` (``name`` or ``Class.method``) in the release whose
    ``vllm/`` folder is under ``root``; a class's bases in the same module are followed. None for
    a module-level name that is assigned rather than defined (a context variable); LookupError
    naming what is not there. A name the module imports (``from x import name``) is followed
    to where it is defined."""
    file = root.joinpath(*module.split(".")).with_suffix(".py")
    if not file.is_file():
        raise LookupError(f"no module {module} ({file} is not there)")
    tree = _parse(file)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    first, _, attr = path.partition(".")
    if not attr:
        if first in functions:
            return _ast_params(functions[first], method=False)
        if first in classes:
            init = _class_methods(classes[first]).get("__init__")
            if init is None:
                raise LookupError(f"{module}.{first} defines no __init__")
            return _ast_params(init, method=True)
        assigned = any(isinstance(n, (ast.Assign, ast.AnnAssign)) and first in {
            t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
            for n in tree.body)
        if assigned:
            return None
        imported = _imported_from(tree, first)
        if imported is not None:
            return source_params(root, imported[0], imported[1])
        raise LookupError(f"no {module}.{first}")
    seen: set[str] = set()
    name: str | None = first
    while name is not None and name in classes and name not in seen:
        seen.add(name)
        method = _class_methods(classes[name]).get(attr)
        if method is not None:
            return _ast_params(method, method=True)
        bases = [b.id for b in classes[name].bases if isinstance(b, ast.Name)]
        name = next((b for b in bases if b in classes), None)
    if first not in classes:
        raise LookupError(f"no class {module}.{first}")
    raise LookupError(f"no {module}.{path} (not in the class nor in its bases in that module)")


def _imported_from(tree: ast.Module, name: str) -> tuple[str, str] | None:
    """(module, its name) where a top-level absolute ``from module import ...`` binds ``name``."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return node.module, alias.name
    return None


# -- the comparison -------------------------------------------------------------------------------


def gaps(theirs: Api, ours: Api) -> list[str]:
    """What ``theirs`` (vLLM's) offers that ``ours`` (wsd's stand-in) does not accept, one entry
    each: ``name``, ``Class.method``, or either with the signature wsd cannot be called as."""
    missing: list[str] = []
    for name, params in theirs.functions.items():
        if name not in ours.functions:
            missing.append(name)
            continue
        mine = ours.functions[name]
        if params is not None and mine is not None and not mine.accepts(params):
            missing.append(f"{name}{params}")
    for cls, methods in theirs.methods.items():
        mine_methods = ours.methods.get(cls, {})
        for name, params in methods.items():
            mine = mine_methods.get(name)
            if mine is None:
                missing.append(f"{cls}.{name}")
            elif not mine.accepts(params):
                missing.append(f"{cls}.{name}{params}")
    return sorted(missing)


# -- nesting: which wrapped methods reach which, read from source -------------------------------


def nestings(root: Path, module: str, cls: str, wrapped: frozenset[str]) -> set[tuple[str, str]]:
    """Each ``(outer, inner)`` pair of ``wrapped`` methods of ``module``'s class ``cls`` (its
    bases in the same module followed) where ``outer`` may reach ``inner`` in that release:
    calling ``self.inner(...)``, passing the bound ``self.inner`` on (vLLM's GPU warm-up hands
    ``self.execute_model`` to ``warmup_kernels``), or through ``self`` helpers that do.

    wsd wraps each such method; a wrapper reached from inside another must pass straight
    through (``wsd.integrations.vllm.install``), and the release checks prove it for every
    pair this finds. LookupError naming what is not there."""
    file = root.joinpath(*module.split(".")).with_suffix(".py")
    tree = _parse(file)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    if cls not in classes:
        raise LookupError(f"no class {cls} in {module}")
    methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
    pending = [classes[cls]]
    while pending:  # the class first: its own definitions win over its bases'
        node = pending.pop(0)
        for name, method in _class_methods(node).items():
            methods.setdefault(name, method)
        pending += [classes[b.id] for b in node.bases if isinstance(b, ast.Name) and b.id in classes]
    names = set(methods) | wrapped  # a wrapped method may be inherited from another module
    reaches = {name: _self_references(method, names) for name, method in methods.items()}
    pairs = set()
    for outer in wrapped & set(methods):  # the ones this class defines
        seen: set[str] = set()
        frontier = list(reaches[outer])
        while frontier:
            name = frontier.pop()
            if name in seen:
                continue
            seen.add(name)
            if name in wrapped:
                pairs.add((outer, name))
            frontier += reaches.get(name, ())  # on through a helper, or through the inner wrapped one
    return {(outer, inner) for outer, inner in pairs if outer != inner}


def _self_references(method: ast.FunctionDef | ast.AsyncFunctionDef, methods: set[str]) -> set[str]:
    """Which of ``methods`` ``method`` names through its first parameter (``self.name``), called
    or not."""
    if not method.args.args:
        return set()
    me = method.args.args[0].arg
    return {node.attr for node in ast.walk(method)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == me
            and node.attr in methods}
