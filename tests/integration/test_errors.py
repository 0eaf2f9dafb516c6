"""One error vocabulary: every error wsd raises on purpose is declared in wsd/errors.py."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import wsd
import wsd_client
from wsd.errors import WsdError


def _subclasses(cls: type) -> set[type]:
    found: set[type] = set(cls.__subclasses__())
    for sub in list(found):
        found |= _subclasses(sub)
    return found


def test_every_error_class_is_declared_in_errors_py():
    """Seven of eighteen error classes lived beside their code; a newcomer could not see
    the whole vocabulary in one file. Modules that raise them import them from there."""
    for package in (wsd, wsd_client):
        for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            importlib.import_module(module.name)  # every class that could be declared anywhere
    declared = {cls.__qualname__: cls.__module__ for cls in _subclasses(WsdError)}
    assert {name: where for name, where in declared.items() if where != "wsd.errors"} == {}
    assert len(declared) >= 20
    # nor an error that is not a WsdError (RegistrationError lived so, in the registry)
    elsewhere = {
        f"{name}.{cls.__qualname__}"
        for name, module in sys.modules.items() if name.split(".")[0] in ("wsd", "wsd_client") and name != "wsd.errors"
        for cls in vars(module).values()
        if isinstance(cls, type) and issubclass(cls, BaseException) and cls.__module__ == name
    }
    assert elsewhere == set()
