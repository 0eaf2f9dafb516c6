"""wsd's release, as ``wsd --version``, ``wsctl --version`` and ``wsd_build_info`` report it.

A module of the shared floor, so that the roles (the coordinator's metrics, the
clients) read the release without importing the package's front door, which
re-exports the manager and the loader.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
