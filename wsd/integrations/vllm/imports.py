"""Code that runs once a module has been imported, in the process that imports it.

vLLM loads its plugins in every process it starts: the API server, the engine
core and each worker. wsd's patches of the worker belong in the workers only:
checking them imports vLLM's GPU worker and model runner, about 600 modules and
half a second, in an API server that never uses them. ``when_imported`` lets
each part of the patches wait for the module it patches, and apply in the
processes that load it, and only there.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = ["when_imported"]

Hook = Callable[[ModuleType], None]

_hooks: dict[str, list[Hook]] = {}
_failed: dict[str, BaseException] = {}  # modules whose hook raised: never executed again
_lock = threading.Lock()


def when_imported(name: str, hook: Hook) -> None:
    """Call ``hook(module)`` once module ``name`` is imported: now if it is, else as soon as
    its code has run, before the import that loaded it returns.

    An exception from ``hook`` propagates out of that import, and out of every later import
    of that module, which never runs its code again (it would then run unhooked). A module
    already being imported (on another thread, or further up this one) counts as imported:
    the hook runs now, and finds it as it stands.
    """
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _hooks.setdefault(name, []).append(hook)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return
    hook(module)


class _Finder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` while hooks wait: finds a hooked module with the finders
    after it, and runs the hooks after its loader."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        failed = _failed.get(fullname)
        if failed is not None:
            return ModuleSpec(fullname, _Refused(failed))
        if fullname not in _hooks:
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    """The module's own loader, then its hooks. The module is given its own loader back
    before its code runs, so that nothing that inspects it (``inspect.getsource``, a
    ``reload``) sees this one; and anything asked of this one meanwhile (``get_code``,
    ``get_source``, ``get_data``, ``is_package``: ``runpy``, ``pkgutil``, coverage) is
    the module's own loader's answer."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create: Callable[[ModuleSpec], ModuleType | None] | None = getattr(self.loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        with _lock:
            hooks = _hooks.pop(module.__name__, [])
            if not _hooks and not _failed and _finder in sys.meta_path:
                sys.meta_path.remove(_finder)
        try:
            for hook in hooks:
                hook(module)
        except BaseException as e:
            with _lock:  # the import fails, now and every later time, without running it again
                _failed[module.__name__] = e
                if _finder not in sys.meta_path:
                    sys.meta_path.insert(0, _finder)
            raise


class _Refused(importlib.abc.Loader):
    """A module whose hook raised when it was first imported: every later import raises."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        raise ImportError(f"{module.__name__}: not imported again: wsd's hook failed when it was first imported "
                          f"({type(self.error).__name__}: {self.error})", name=module.__name__) from self.error


_finder = _Finder()
