"""wsd's layers, declared once: every module's floor, and what each floor may import.

DESIGN.md's table, as data that ``tests/unit/test_layers.py`` holds against the
code's own imports. A module imports only from floors below its own, and from
its own floor where that floor allows it; there is no import cycle.

    5 process tops   the ``wsd`` CLI, ``wsd up``, the launchers, ``python -m wsd.worker``,
                     and the package's front door (``wsd``, which re-exports the manager)
    4 roles          coordinator, agent, manager, worker, clients, engine integrations:
                     each its own; one role uses another only as ``ROLE_USES`` lists
    3 loader         reading TOML and ``WSD_*`` into the sections
    2 sections       each role's configuration section, beside its role
    1 wire           message schemas, encode/decode, transport, CURVE
    0 shared floor   the command table, the slot-stats schema, errors and their codes,
                     pure field checks, formatting: imports nothing of wsd's above it

A new module is declared here before the test passes: under a package that
``FLOORS`` names with ``.*`` it takes that package's floor (and role); anywhere
else (the package's root, a new subpackage) it needs a line of its own.
"""

from __future__ import annotations

from collections.abc import Mapping

FLOOR_NAMES = {0: "the shared floor", 1: "the wire", 2: "the sections", 3: "the loader", 4: "the roles",
               5: "the process tops"}

FLOORS: dict[str, int] = {
    # 0: the shared floor. What every other floor reads; imports nothing of wsd's but itself.
    "wsd.commands": 0,  # the command table
    "wsd.slotstats": 0,  # the slot-stats schema and the snapshots a manager gives out
    "wsd.errors": 0,  # the exceptions, the wire's error codes, the exit codes
    "wsd.names": 0,  # engine names
    "wsd.endpoints": 0,  # an endpoint, checked as text
    "wsd.fieldchecks": 0,  # the field checks every section is built from
    "wsd.files": 0,  # reading a file wsd trusts
    "wsd.placement": 0,  # the labels that place a rank
    "wsd.families": 0,  # the Prometheus families, their types, labels and help
    "wsd.fmt": 0,  # formatting for terminals and logs
    "wsd.version": 0,  # the release
    "wsd.rankrow": 0,  # a rank's reported manager state and its row in ``ranks``
    # 1: the wire.
    "wsd.wire.*": 1,
    # 2: the sections, each beside its role (a more specific line wins over its package's).
    "wsd.manager.config": 2,
    "wsd.coordinator.config": 2,
    "wsd.agent.config": 2,
    "wsd.worker.config": 2,
    "wsd.security": 2,  # [security], and the agent token's proofs
    # 3: the loader.
    "wsd.config": 3,
    "wsd.tomlread": 3,
    # 4: the roles.
    "wsd.coordinator.*": 4,
    "wsd.agent.*": 4,
    "wsd.manager.*": 4,
    "wsd.worker.*": 4,
    "wsd.integrations.*": 4,
    "wsd_client.*": 4,
    # 5: the process tops.
    "wsd": 5,  # the package's front door: the manager's and the loader's names, on first use
    "wsd.programs.*": 5,  # every program's main, in one place (wsd.programs' docstring lists them)
    "wsd.worker.__main__": 5,  # python -m wsd.worker: wsd.programs.worker's main
}

ROLES: dict[str, str] = {
    "wsd.coordinator.*": "coordinator",
    "wsd.agent.*": "agent",
    "wsd.manager.*": "manager",
    "wsd.worker.*": "worker",
    "wsd.integrations.*": "integrations",
    "wsd_client.*": "clients",
}
"""The role of each module of floor 4, by the same patterns as ``FLOORS``."""

ROLE_USES: dict[tuple[str, str], str] = {
    ("agent", "manager"): "the agent applies commands to its rank's manager and reads its snapshots",
    ("integrations", "manager"): "an engine integration puts the manager in the engine",
    ("integrations", "agent"): "an engine integration starts the agent beside the manager",
    ("worker", "manager"): "the built-in worker is wsd's own engine: it uses the manager as an integration does",
    ("worker", "agent"): "the built-in worker is wsd's own engine: it starts the agent as an integration does",
}
"""The roles that may import another role, and why: every other pair talks through the wire.
The coordinator and the clients never import the manager: what they read of it is
the slot-stats schema, on the shared floor."""

SAME_FLOOR = {0: True, 1: True, 2: False, 3: True, 4: False, 5: True}
"""Whether a floor's modules may import each other. The sections may not (each is its
role's alone; what they share is the shared floor's), and the roles only within one
role (``ROLES``) or as ``ROLE_USES`` says."""


def _match(module: str, table: Mapping[str, object]) -> str | None:
    """The most specific pattern of ``table`` that names ``module``: itself, or ``pkg.*``
    for ``pkg`` and everything under it."""
    if module in table:
        return module
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        pattern = ".".join(parts[:end]) + ".*"
        if pattern in table:
            return pattern
    return None


def floor_of(module: str) -> int | None:
    """``module``'s floor, or None where ``FLOORS`` does not declare it."""
    pattern = _match(module, FLOORS)
    return None if pattern is None else FLOORS[pattern]


def role_of(module: str) -> str | None:
    """``module``'s role (floor 4 only), or None."""
    pattern = _match(module, ROLES)
    return None if pattern is None or floor_of(module) != 4 else ROLES[pattern]
