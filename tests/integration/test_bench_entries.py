"""Every benchmark of ``python -m bench`` can start: a move of a file it runs cannot break one silently.

``bench/bench_vllm.py`` once looked for ``tests/vllm_driver.py`` after the tiers moved it
to ``tests/vllm/``, and ``python -m bench --only vllm`` failed on main unnoticed. This
imports each benchmark module that ``python -m bench`` runs (nothing is measured) and
checks that every file of the checkout a module names at module level exists.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

import bench.__main__ as bench_main

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> list[str]:
    names: set[str] = set()
    for entry in bench_main.BENCHES.values():
        names.update(part.split('"')[1] for part in inspect.getsource(entry).split("_module(")[1:])
    return sorted(names)


def test_every_benchmark_entry_names_a_module():
    assert len(_modules()) >= len(bench_main.BENCHES) - 1  # "vllm" is there only with vllm installed
    assert "bench_wrapper" in _modules()


@pytest.mark.parametrize("name", _modules())
def test_each_benchmark_module_imports_and_every_file_it_names_exists(name):
    module = importlib.import_module(f"bench.{name}")
    assert callable(getattr(module, "run", None)), f"bench.{name} has no run()"
    for attribute, value in vars(module).items():
        if isinstance(value, str) and value.endswith(".py") and value.startswith(str(ROOT)):
            assert Path(value).is_file(), f"bench.{name}.{attribute} names {value}, which is not there"
