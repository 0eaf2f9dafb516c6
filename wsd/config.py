"""Configuration: one TOML file, overridden by ``WSD_*`` environment variables.

Each section of the file is a frozen, keyword-only dataclass with a docstring
under every field and validation at construction, defined beside the component
it configures (``[workspace]`` in ``wsd.manager.config``, ``[coordinator]`` in
``wsd.coordinator.config``, ``[agent]`` in ``wsd.agent.config``, ``[worker]``
and ``[workload]`` in ``wsd.worker.config``, ``[security]`` in
``wsd.security``) and named again here, the one place that lists them all.
``load_config`` is the one thin loader that turns a file and the environment
into those objects; every error it raises names the file (or variable), the key
and what is allowed.

Environment variables are ``WSD_<SECTION>_<KEY>`` in upper case, for example
``WSD_WORKSPACE_NUM_UBATCHES=4``; they win over the file. ``WSD_CONFIG`` names
the file when no path is given. Any other ``WSD_*`` variable is refused at
start-up, as an unknown key in the file is, unless ``NOT_CONFIGURATION`` lists
it (a variable that some other part of wsd reads) or it is one of the variables
Kubernetes gives every pod for each Service of its namespace (``is_service_link``):
a Service named ``wsd-coordinator`` yields ``WSD_COORDINATOR_PORT=tcp://...``,
which names no key and must not stop a pod from starting.

This module imports no torch: the coordinator and the clients load it too.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from wsd.agent.config import AgentConfig
from wsd.coordinator.config import MAX_EVENT_CAPACITY, CoordinatorConfig, CoordinatorMode
from wsd.errors import ConfigError
from wsd.fieldchecks import flag_number, parse_size
from wsd.manager.config import MAX_LANES, MAX_UBATCHES, GrowthPolicy, LockedGrowthPolicy, Presize, WorkspaceConfig
from wsd.security import SecurityConfig
from wsd.tomlread import parse_toml, read_toml
from wsd.worker.config import Backend, WorkerConfig, WorkloadConfig, WorkloadDtype

__all__ = [
    "MAX_EVENT_CAPACITY",
    "MAX_LANES",
    "MAX_UBATCHES",
    "NOT_CONFIGURATION",
    "AgentConfig",
    "Backend",
    "CoordinatorConfig",
    "CoordinatorMode",
    "GrowthPolicy",
    "LockedGrowthPolicy",
    "Presize",
    "WorkerConfig",
    "WorkloadConfig",
    "WorkloadDtype",
    "WorkspaceConfig",
    "WsdConfig",
    "flag_number",
    "is_service_link",
    "load_config",
    "parse_size",
    "parse_toml",
    "read_toml",
]

NOT_CONFIGURATION: dict[str, str] = {
    "WSD_CONFIG": "the configuration file, when none is given on the command line",
    "WSD_ENDPOINT": "the coordinator's client endpoint, for wsctl and wsd_client",
    "WSD_CURVE_SERVER_KEY": "the coordinator's public certificate, for wsctl and wsd_client",
    "WSD_CURVE_CLIENT_KEY": "the client's secret certificate, for wsctl and wsd_client",
    "WSD_AGENT_TOKEN": "the registration secret a launcher hands its workers",
    "WSD_ENGINE": "the engine a worker's rank belongs to: the short name of WSD_AGENT_ENGINE, which wins",
    "WSD_LAUNCHER_PARENT_PID": "the process whose death ends torchrun as wsd up starts it (wsd.programs.torchrun)",
    "WSD_SOAK_RECORD": "the folder bench/soak.py's workers record into",
    "WSD_VLLM_SOURCE": "a vLLM checkout, for tests/vllm/vllm_peer",
    "WSD_HOSTILE_SEED": "the seed that replays the inputs of the hostile tests",
    "WSD_VLLM": "standalone: the vLLM plugin runs with no coordinator; off: it stays off, whatever is configured",
    "WSD_VLLM_STRICT": "1: a wsd error in the vLLM plugin stops vLLM, instead of turning wsd off",
    "WSD_VLLM_METRICS_DIR": "where vLLM's workers leave their figures for its /metrics (set by the plugin)",
    "WSD_VLLM_ENGINE_CORE": "the pid of the vLLM engine core that drives a worker's rounds (set by the plugin)",
    "WSD_VLLM_UNVERIFIED": "1: the vLLM plugin runs on a vLLM release wsd was not verified with",
    "WSD_VLLM_SNAPSHOT": "1: this vLLM engine is being snapshotted (vllm snapshot create; set by the plugin)",
    "WSD_VLLM_RELEASES": "where .ci/vllm-releases keeps the verified vLLM releases' sources, for the tests",
}
"""The ``WSD_*`` environment variables that are not ``WSD_<SECTION>_<KEY>``
overrides, and what reads each; ``load_config`` refuses any other."""

# What kubelet sets for a Service named <name> (upper case, '-' as '_'), from
# Kubernetes' pkg/kubelet/envvars: <NAME>_SERVICE_HOST, <NAME>_SERVICE_PORT,
# <NAME>_SERVICE_PORT_<PORT NAME>, and the Docker-link style <NAME>_PORT=tcp://...,
# <NAME>_PORT_<n>_<PROTO>, with _PROTO, _PORT and _ADDR after that.
_SERVICE_LINK_NAME = re.compile(
    r"[A-Z0-9_]*_SERVICE_(HOST|PORT(_[A-Z0-9_]+)?)|[A-Z0-9_]*_PORT_[0-9]+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?")
_SERVICE_LINK_PORT = re.compile(r"[A-Z0-9_]*_PORT")
_SERVICE_LINK_URL = re.compile(r"(tcp|udp|sctp)://\S*")


def is_service_link(name: str, value: str) -> bool:
    """True for a variable of the shapes kubelet sets for a Service (see above).

    Only for names that are no configuration key: ``load_config`` asks this of a
    variable it would otherwise refuse.
    """
    return bool(_SERVICE_LINK_NAME.fullmatch(name)
                or (_SERVICE_LINK_PORT.fullmatch(name) and _SERVICE_LINK_URL.fullmatch(value)))


@dataclass(frozen=True, kw_only=True)
class WsdConfig:
    """The whole file: one attribute per section."""

    workspace: WorkspaceConfig = field(default_factory=WorkspaceConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    source: str = "<defaults>"
    """Where the configuration came from, for messages."""


_SECTIONS: dict[str, type] = {
    "workspace": WorkspaceConfig,
    "coordinator": CoordinatorConfig,
    "agent": AgentConfig,
    "worker": WorkerConfig,
    "workload": WorkloadConfig,
    "security": SecurityConfig,
}


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, kind: Any, f: dataclasses.Field, from_env: bool) -> Any:
    """Turn a TOML or environment value into the field's type, or raise ValueError."""
    optional = False
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        optional = len(args) < len(typing.get_args(kind))
        kind = args[0]
    if from_env and optional and value.strip().lower() in ("", "none"):
        return None
    if f.metadata.get("size"):
        return parse_size(value)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        allowed = ", ".join(repr(m.value) for m in kind)
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"must be one of {allowed}, got {value!r}") from None
    if kind is bool:
        if from_env:
            lowered = value.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
        elif isinstance(value, bool):
            return value
        raise ValueError(f"must be true or false, got {value!r}")
    if kind is int:
        if from_env:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"must be an integer, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer, got {value!r}")
        return value
    if kind is float:
        if from_env:
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"must be a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"must be a number, got {value!r}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ValueError(f"must be a string, got {value!r}")
        if "\0" in value:  # a path or name with one fails later, in open() or bind()
            raise ValueError(f"must not contain a NUL character, got {value!r}")
        return value
    if typing.get_origin(kind) is tuple:
        if from_env:
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"must be a list of strings, got {value!r}")
        if any("\0" in v for v in value):
            raise ValueError(f"must not contain a NUL character, got {value!r}")
        return tuple(value)
    raise TypeError(f"unsupported configuration field type {kind!r}")  # a bug here


def _build(cls: type, raw: Mapping[str, tuple[Any, str, bool]], section: str) -> Any:
    """Build a section from {key: (value, where, from_env)}, naming where on error."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = _field_types(cls)
    kwargs: dict[str, Any] = {}
    for key, (value, where, from_env) in raw.items():
        if key not in fields:
            allowed = ", ".join(sorted(fields))
            raise ConfigError(
                f"{where}: unknown key [{section}] {key!r}; allowed keys: {allowed}"
            )
        try:
            kwargs[key] = _coerce(value, hints[key], fields[key], from_env)
        except ValueError as e:
            raise ConfigError(f"{where}: [{section}] {key} {e}") from None
    try:
        return cls(**kwargs)
    except ValueError as e:
        where = ", ".join(sorted({w for _, w, _ in raw.values()})) or "<defaults>"
        raise ConfigError(f"{where}: [{section}] {e}") from None


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> WsdConfig:
    """Load the TOML file at ``path`` (or ``$WSD_CONFIG``; none: defaults) and the environment.

    Raises ConfigError naming the file or variable, the key and what is allowed.
    """
    env = os.environ if env is None else env
    if path is None and env.get("WSD_CONFIG"):
        path = env["WSD_CONFIG"]
    raw: dict[str, dict[str, tuple[Any, str, bool]]] = {s: {} for s in _SECTIONS}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        for section, body in read_toml(path).items():
            if section not in _SECTIONS:
                allowed = ", ".join(f"[{s}]" for s in _SECTIONS)
                raise ConfigError(
                    f"{source}: unknown section [{section}]; allowed sections: {allowed}"
                )
            if not isinstance(body, dict):
                raise ConfigError(f"{source}: {section} must be a [{section}] table")
            raw[section].update({k: (v, source, False) for k, v in body.items()})
    if "WSD_ENGINE" in env:  # the short name of WSD_AGENT_ENGINE, which wins where both are set
        raw["agent"]["engine"] = (env["WSD_ENGINE"], "environment variable WSD_ENGINE", True)
    for name, value in env.items():
        if not name.startswith("WSD_") or name in NOT_CONFIGURATION:
            continue
        section, _, key = name[4:].lower().partition("_")
        known = section in _SECTIONS and key in {f.name for f in dataclasses.fields(_SECTIONS[section])}
        if not known and is_service_link(name, value):
            continue  # kubelet's, for a Service of the pod's namespace: not ours
        if section not in _SECTIONS:
            allowed = ", ".join(s.upper() for s in _SECTIONS)
            raise ConfigError(
                f"environment variable {name}: unknown section {section!r}; allowed: "
                f"WSD_<SECTION>_<KEY> with SECTION one of {allowed}, or one of "
                f"{', '.join(sorted(NOT_CONFIGURATION))}, which are not configuration"
            )
        if not key:
            raise ConfigError(f"environment variable {name}: names no key")
        raw[section][key] = (value, f"environment variable {name}", True)
    sections = {s: _build(cls, raw[s], s) for s, cls in _SECTIONS.items()}
    return WsdConfig(source=source, **sections)
