"""What the hostile suites share: the run's seed, the count of inputs tried, and its floor.

``tests/integration/test_hostile.py`` (malformed input on both endpoints, hostile configuration
files) and ``tests/integration/test_hostile_agents.py`` (well-formed but malicious agent
messages) count every input they try in ``tried(__file__)``, by category. At the
end of the session one line in pytest's terminal summary sums them up, with
the seed; ``WSD_HOSTILE_SEED=N`` runs the same inputs again (the
hypothesis tests and the seeded generators alike; what the coordinator's timing
decides, such as which frame a rate limit drops, may still differ).

The project asks for at least ``ENDPOINT_MINIMUM`` hostile inputs per run at the
two endpoints (configuration files do not count). Each file owns a share of it
(``FLOORS``); a file whose every test was selected and passed must have tried its
share, or the session fails. A run of a subset (``-k``, one test) is not checked.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import hypothesis
import pytest

ENDPOINT_MINIMUM = 20_000
"""Inputs at the client and agent endpoints per full run of the two files."""
FLOORS = {"test_hostile.py": 12_000, "test_hostile_agents.py": 8_000}
"""Each file's share of ``ENDPOINT_MINIMUM``: the endpoint inputs it must try."""
ENDPOINTS = ("client ", "agent ")
"""Categories that start with one of these count towards the floor."""

if sum(FLOORS.values()) < ENDPOINT_MINIMUM:
    raise RuntimeError(f"the files' floors {FLOORS} add up to less than {ENDPOINT_MINIMUM}")


def _seed() -> int:
    raw = os.environ.get("WSD_HOSTILE_SEED", "").strip()
    if not raw:
        return random.SystemRandom().randrange(2**32)
    try:
        return int(raw, 0)
    except ValueError:
        raise RuntimeError(f"WSD_HOSTILE_SEED must be an integer, got {raw!r}") from None


SEED = _seed()
"""The seed of this run: every hypothesis test and seeded generator starts from it."""

_TRIED: dict[str, Counter[str]] = {name: Counter() for name in FLOORS}

T = TypeVar("T", bound=Callable[..., Any])


def tried(path: str) -> Counter[str]:
    """The counter of inputs tried by the test file at ``path``, by category."""
    return _TRIED[Path(path).name]


def seeded(test: T) -> T:
    """A hypothesis test that draws from this run's seed."""
    return hypothesis.seed(SEED)(test)


def rng(salt: str) -> random.Random:
    """A generator seeded by this run's seed and ``salt`` (so that tests do not share draws)."""
    return random.Random(f"{SEED}:{salt}")


def _endpoint_inputs(counter: Counter[str]) -> int:
    return sum(n for category, n in counter.items() if category.startswith(ENDPOINTS))


def _fully_run(session: pytest.Session) -> set[str]:
    """The hostile files whose every test was selected, all of which passed."""
    if session.testsfailed or session.shouldstop or session.shouldfail:
        return set()
    selected: dict[str, set[str]] = {}
    modules: dict[str, Any] = {}
    for item in session.items:
        name = Path(str(item.path)).name
        if name in FLOORS and isinstance(item, pytest.Function):
            selected.setdefault(name, set()).add(item.originalname)
            modules[name] = item.module
    full = set()
    for name, module in modules.items():
        defined = {n for n, v in vars(module).items() if n.startswith("test_") and callable(v)}
        if defined <= selected[name]:
            full.add(name)
    return full


class _Report:
    """At the end of the session: the line that sums up the inputs tried, and the floor.

    The floor is checked in ``pytest_sessionfinish`` (as coverage's fail-under is), not
    in a fixture's teardown: that would be charged to whichever test ran last, and an
    expected failure there would swallow it.
    """

    def __init__(self) -> None:
        self.short: dict[str, tuple[int, int]] = {}

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        full = _fully_run(session)
        self.short = {name: (_endpoint_inputs(_TRIED[name]), FLOORS[name]) for name in sorted(full)
                      if _endpoint_inputs(_TRIED[name]) < FLOORS[name]}
        if self.short:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        total = Counter[str]()
        for counter in _TRIED.values():
            total.update(counter)
        terminalreporter.write_line(
            f"hostile inputs tried: {sum(total.values())}, {_endpoint_inputs(total)} at the endpoints "
            f"(seed {SEED}: WSD_HOSTILE_SEED={SEED} repeats them) "
            f"({', '.join(f'{k} {v}' for k, v in sorted(total.items()))})")
        if self.short:
            terminalreporter.write_line(
                f"FAILED: too few hostile inputs at the endpoints, (tried, floor) by file: {self.short}; "
                f"at least {ENDPOINT_MINIMUM} a run are asked for", red=True, bold=True)


@pytest.fixture(scope="session", autouse=True)
def hostile_inputs_counted(request: pytest.FixtureRequest) -> None:
    """Report the inputs tried, and check the floor, when the session ends.

    Imported by each hostile file (pytest sees one fixture per file): registered once.
    """
    manager = request.config.pluginmanager
    if not manager.has_plugin("wsd-hostile-report"):
        manager.register(_Report(), "wsd-hostile-report")
