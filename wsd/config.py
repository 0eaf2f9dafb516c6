"""Configuration: one TOML file, overridden by ``WSD_*`` environment variables.

Each section of the file is a frozen, keyword-only dataclass with a docstring
under every field and validation at construction. ``load_config`` is the one
thin loader that turns a file and the environment into those objects; every
error it raises names the file (or variable), the key and what is allowed.

Environment variables are ``WSD_<SECTION>_<KEY>`` in upper case, for example
``WSD_WORKSPACE_NUM_UBATCHES=4``; they win over the file. ``WSD_CONFIG`` names
the file when no path is given. Any other ``WSD_*`` variable is refused at
start-up, as an unknown key in the file is, unless ``NOT_CONFIGURATION`` lists
it (a variable that some other part of wsd reads).

This module imports no torch: the coordinator and the clients load it too.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from wsd.errors import ConfigError
from wsd.security import SecurityConfig
from wsd.transport import check_endpoint

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

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
    "WorkerConfig",
    "WorkloadConfig",
    "WorkloadDtype",
    "WorkspaceConfig",
    "WsdConfig",
    "flag_number",
    "load_config",
    "parse_size",
    "read_toml",
]

MAX_UBATCHES = 64
"""Largest ``num_ubatches`` a manager accepts."""
MAX_LANES = 64
"""Largest ``num_lanes`` a manager accepts."""
MAX_EVENT_CAPACITY = 10_000_000
"""Largest ``event_capacity``: the most events a coordinator holds."""

NOT_CONFIGURATION: dict[str, str] = {
    "WSD_CONFIG": "the configuration file, when none is given on the command line",
    "WSD_ENDPOINT": "the coordinator's client endpoint, for wsctl and wsd_client",
    "WSD_CURVE_SERVER_KEY": "the coordinator's public certificate, for wsctl and wsd_client",
    "WSD_CURVE_CLIENT_KEY": "the client's secret certificate, for wsctl and wsd_client",
    "WSD_AGENT_TOKEN": "the registration secret a launcher hands its workers",
    "WSD_SOAK_RECORD": "the folder bench/soak.py's workers record into",
    "WSD_VLLM_SOURCE": "a vLLM checkout, for tests/vllm_peer",
    "WSD_HOSTILE_SEED": "the seed that replays the inputs of the hostile tests",
}
"""The ``WSD_*`` environment variables that are not ``WSD_<SECTION>_<KEY>``
overrides, and what reads each; ``load_config`` refuses any other."""

_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as ``"2MiB"``, ``"512 KB"``, ``"4096"``."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size in bytes, got {value!r}")
    if isinstance(value, int):
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(
            f"expected a size such as 4096, \"512KiB\" or \"2MiB\", got {value!r}"
        )
    return int(match.group(1)) * _UNITS[(match.group(2) or "").lower()]


def flag_number(kind: type[int | float], low: float, high: float, *, what: str,
                unit: str = "", above_low: bool = False) -> Callable[[str], Any]:
    """An argparse ``type`` for a command-line number: a ``kind`` from ``low`` (excluded if
    ``above_low``) to ``high``; otherwise a usage error that names the range."""

    def show(bound: float) -> str:
        return f"{bound:g}" if isinstance(bound, float) else str(bound)

    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        # NaN fails every comparison, so it is refused by the first test, as inf is by the last.
        if not (low < value if above_low else low <= value) or not value <= high:
            bounds = (f"more than {show(low)} and at most {show(high)}" if above_low
                      else f"between {show(low)} and {show(high)}")
            raise argparse.ArgumentTypeError(f"must be {bounds}{unit}, got {text}")
        return value

    return convert


def _size_field(default: int | None) -> Any:
    """A field that takes a byte size: an int, or a string with a unit."""
    return field(default=default, metadata={"size": True})


class GrowthPolicy(enum.Enum):
    """How a slot's buffer grows when a request does not fit."""

    EXACT = "exact"
    """To exactly the requested total, as vLLM does."""
    GRANULAR = "granular"
    """To the requested total rounded up to ``granularity`` bytes."""


class LockedGrowthPolicy(enum.Enum):
    """What a locked slot does with a request it cannot serve without growing."""

    RAISE = "raise"
    """Refuse it with ``WorkspaceLockedError`` (an ``AssertionError``), as vLLM does."""
    FALLBACK = "fallback"
    """Serve it from a one-off buffer outside the slot, counted and reported as a
    lock violation, so the engine keeps serving. Never during CUDA-graph capture."""


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value}")


def _coerce_enum(obj: Any, name: str, kind: type[enum.Enum]) -> None:
    """Turn a frozen dataclass's string field into its enum, or raise naming what is allowed."""
    value = getattr(obj, name)
    if isinstance(value, kind):
        return
    try:
        object.__setattr__(obj, name, kind(value))
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in kind)
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}") from None


@dataclass(frozen=True, kw_only=True)
class WorkspaceConfig:
    """``[workspace]``: the per-rank workspace manager."""

    num_ubatches: int = 1
    """Micro-batch slots per lane (vLLM's ``num_ubatches``; 1 to MAX_UBATCHES)."""
    num_lanes: int = 1
    """Independent slots per ubatch (1 to MAX_LANES)."""
    alignment: int = 256
    """Byte alignment of every view in a buffer: a power of two, 16 to 1 MiB."""
    growth: GrowthPolicy = GrowthPolicy.EXACT
    """``"exact"`` (vLLM's) or ``"granular"`` (round up to ``granularity``)."""
    granularity: int = _size_field(2 * 1024 * 1024)
    """Rounding of ``granular`` growth, in bytes: a multiple of ``alignment``."""
    max_slot_bytes: int | None = _size_field(None)
    """Largest buffer one slot may grow to; a larger request is refused. None: no limit."""
    on_locked_growth: LockedGrowthPolicy = LockedGrowthPolicy.RAISE
    """``"raise"`` (vLLM's: the request fails) or ``"fallback"`` (a one-off buffer
    serves it, and the violation is counted and reported)."""

    def __post_init__(self) -> None:
        _check_range("num_ubatches", self.num_ubatches, 1, MAX_UBATCHES)
        _check_range("num_lanes", self.num_lanes, 1, MAX_LANES)
        _check_range("alignment", self.alignment, 16, 2**20)
        if self.alignment & (self.alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {self.alignment}")
        _coerce_enum(self, "growth", GrowthPolicy)
        _check_range("granularity", self.granularity, self.alignment, 2**40)
        if self.granularity % self.alignment:
            raise ValueError(
                f"granularity must be a multiple of alignment ({self.alignment}), "
                f"got {self.granularity}"
            )
        if self.max_slot_bytes is not None:
            _check_range("max_slot_bytes", self.max_slot_bytes, 0, 2**50)
        _coerce_enum(self, "on_locked_growth", LockedGrowthPolicy)


def _check_positive(name: str, value: float, high: float = 86400.0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= high:
        raise ValueError(f"{name} must be a number of seconds in (0, {high:g}], got {value!r}")


def _check_endpoint(name: str, value: str, *, bind: bool) -> None:
    try:
        check_endpoint(value, bind=bind)
    except ValueError as e:
        raise ValueError(f"{name} {e}") from None


class CoordinatorMode(enum.Enum):
    """Who starts the coordinator the workers' agents connect to."""

    EXTERNAL = "external"
    """Someone else (``wsd coordinator``, ``wsd up``, a sidecar); agents connect to it."""
    EMBEDDED = "embedded"
    """The worker of global rank 0 starts it as its own process beside the job."""


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    """``[coordinator]``: the coordinator's sockets, timing and state."""

    mode: CoordinatorMode = CoordinatorMode.EXTERNAL
    """``"external"`` (agents connect to a running coordinator) or ``"embedded"``
    (global rank 0 starts one as a child process; the job's agents find it by itself)."""
    connect_endpoint: str | None = None
    """Where agents connect, when that differs from ``agent_endpoint`` (a coordinator
    bound to tcp://0.0.0.0:7600 is reached at tcp://HOST:7600). None: ``agent_endpoint``,
    or, when embedded, what rank 0's coordinator actually bound, on rank 0's host."""

    agent_endpoint: str = "tcp://127.0.0.1:7600"
    """Where agents connect (the coordinator binds it; use tcp://0.0.0.0:PORT across nodes)."""
    client_endpoint: str = "tcp://127.0.0.1:7601"
    """Where wsctl and clients connect; loopback unless you mean otherwise."""
    heartbeat_interval: float = 1.0
    """Seconds between heartbeats, both ways."""
    heartbeat_timeout: float = 5.0
    """Seconds without a heartbeat after which a rank (or the coordinator) is lost."""
    command_timeout: float = 10.0
    """Seconds a command waits for every live rank's acknowledgement."""
    stats_timeout: float = 2.0
    """Seconds a stats request waits for every live rank's snapshot."""
    state_file: str = "wsd-coordinator.state"
    """Desired state, sequence number and command log; written atomically."""
    world_size: int | None = None
    """Ranks expected; None: taken from the first rank that registers."""
    tp_size: int | None = None
    """Tensor-parallel group size expected; None: from the first registration."""
    max_message_bytes: int = _size_field(1 << 20)
    """Largest message accepted from a client (ZeroMQ MAXMSGSIZE)."""
    max_agent_message_bytes: int = _size_field(4 << 20)
    """Largest frame accepted from an agent; a larger one drops that agent's connection
    (ZeroMQ MAXMSGSIZE). A stats reply of 64 x 64 slots is about 30 KB (340 KB at worst):
    the default leaves ten times that for persistent buffers. Each message type has its
    own smaller bound besides (wsd.protocol.LIMITS)."""
    high_water_mark: int = 10_000
    """Messages queued per peer before sends to it are dropped."""
    event_capacity: int = 10_000
    """Events kept in the log; older ones are dropped first."""
    log_capacity: int = 4096
    """Commands kept for replay to agents that missed them."""
    metrics_port: int | None = None
    """TCP port of the Prometheus endpoint (``/metrics``); 0: any free port. None: no endpoint."""
    metrics_host: str = "127.0.0.1"
    """Address the Prometheus endpoint binds; loopback unless Prometheus scrapes from elsewhere."""
    metrics_refresh: float = 5.0
    """Seconds between the stats rounds that refresh the per-slot metrics (when the endpoint is on)."""
    resume_seq: int | None = None
    """Recovery after the state file was lost: number commands after this seq, the highest
    ``applied_seq`` that refused agents report (the events name it). No effect once the
    log is past it. None: agents reporting more than was issued are refused."""

    def __post_init__(self) -> None:
        _coerce_enum(self, "mode", CoordinatorMode)
        if self.connect_endpoint is not None:
            _check_endpoint("connect_endpoint", self.connect_endpoint, bind=False)
        _check_endpoint("agent_endpoint", self.agent_endpoint, bind=True)
        _check_endpoint("client_endpoint", self.client_endpoint, bind=True)
        _check_positive("heartbeat_interval", self.heartbeat_interval)
        _check_positive("heartbeat_timeout", self.heartbeat_timeout)
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout}) must be larger than "
                f"heartbeat_interval ({self.heartbeat_interval})"
            )
        _check_positive("command_timeout", self.command_timeout, 3600.0)
        _check_positive("stats_timeout", self.stats_timeout, 3600.0)
        if not isinstance(self.state_file, str) or not self.state_file:
            raise ValueError(f"state_file must be a path, got {self.state_file!r}")
        if self.world_size is not None:
            _check_range("world_size", self.world_size, 1, 1 << 20)
        if self.tp_size is not None:
            _check_range("tp_size", self.tp_size, 1, 1 << 20)
            if self.world_size is not None and self.world_size % self.tp_size:
                raise ValueError(
                    f"world_size ({self.world_size}) must be a multiple of tp_size ({self.tp_size})"
                )
        _check_range("max_message_bytes", self.max_message_bytes, 1024, 1 << 30)
        _check_range("max_agent_message_bytes", self.max_agent_message_bytes, 64 << 10, 1 << 30)
        _check_range("high_water_mark", self.high_water_mark, 1, 10_000_000)
        _check_range("event_capacity", self.event_capacity, 1, MAX_EVENT_CAPACITY)
        _check_range("log_capacity", self.log_capacity, 1, 10_000_000)
        if self.metrics_port is not None:
            _check_range("metrics_port", self.metrics_port, 0, 65535)
        if not isinstance(self.metrics_host, str) or not self.metrics_host:
            raise ValueError(f"metrics_host must be an address such as 127.0.0.1, got {self.metrics_host!r}")
        _check_positive("metrics_refresh", self.metrics_refresh, 3600.0)
        if self.resume_seq is not None:
            _check_range("resume_seq", self.resume_seq, 0, 2**62)


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """``[agent]``: the agent inside each worker process."""

    apply_every: int | None = None
    """Apply commands at every k-th ``step()`` (the TP group agrees then). None: the
    engine's default, 1 for the built-in engine loop, 16 in vLLM (whose idle or busy
    engine is also woken for one agreement step when a command waits)."""
    connect_timeout: float = 10.0
    """Seconds ``Agent.start`` waits for its I/O thread to come up."""

    def __post_init__(self) -> None:
        if self.apply_every is not None:
            _check_range("apply_every", self.apply_every, 1, 1_000_000)
        _check_positive("connect_timeout", self.connect_timeout, 3600.0)


class Backend(enum.Enum):
    """The ``torch.distributed`` backend of the workers' compute collectives."""

    AUTO = "auto"
    """nccl when CUDA is available, else gloo."""
    NCCL = "nccl"
    GLOO = "gloo"


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """``[worker]``: the worker process ``python -m wsd.worker`` run by torchrun."""

    tp_size: int | None = None
    """Ranks per tensor-parallel group, contiguous global ranks (0..tp_size-1 is group 0).
    None: LOCAL_WORLD_SIZE, one TP group per node. WORLD_SIZE must be a multiple of it."""
    backend: Backend = Backend.AUTO
    """``"auto"``, ``"nccl"`` (device cuda:LOCAL_RANK) or ``"gloo"`` (device cpu)."""
    collective_timeout: float = 300.0
    """Seconds a collective may wait for the other ranks before it fails."""
    coordinator_start_timeout: float = 30.0
    """Seconds rank 0 waits for an embedded coordinator to be ready."""

    def __post_init__(self) -> None:
        if self.tp_size is not None:
            _check_range("tp_size", self.tp_size, 1, 1 << 20)
        _coerce_enum(self, "backend", Backend)
        _check_positive("collective_timeout", self.collective_timeout)
        _check_positive("coordinator_start_timeout", self.coordinator_start_timeout, 3600.0)


class WorkloadDtype(enum.Enum):
    """Element type of the built-in workload's weights and activations."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    """``[workload]``: the built-in engine loop, a tensor-parallel MLP stack.

    Each step runs every ubatch slot in turn through ``layers`` column- then
    row-parallel MLP layers, with every intermediate buffer from the workspace.
    """

    hidden_size: int = 256
    """Model width: the replicated activations are ``tokens x hidden_size``."""
    ffn_size: int = 1024
    """MLP inner width, split across the TP group: a multiple of the TP size."""
    layers: int = 2
    """MLP layers per ubatch per step (one all_reduce over the TP group each)."""
    dtype: WorkloadDtype = WorkloadDtype.FLOAT32
    """``"float32"``, ``"bfloat16"`` or ``"float16"``."""
    max_tokens: int = 256
    """Largest token count of warm-up and steady steps."""
    warmup_steps: int = 8
    """Warm-up steps over rising token counts, the last at ``max_tokens``."""
    lock: bool = True
    """Lock the workspace after warm-up, as an engine does before CUDA-graph capture."""
    steps: int = 0
    """Steady steps after warm-up; 0: run until stopped."""
    pace: float = 0.05
    """Least seconds per step (a sleep fills the rest); 0: as fast as the machine goes."""
    oversize_chance: float = 0.0
    """Chance (0 to 1) that a steady step, while locked, asks for more tokens than
    warm-up reached, so that lock violations show in operation."""
    seed: int = 0
    """Seed of the token counts; every rank draws the same, as the TP collectives need."""

    def __post_init__(self) -> None:
        _check_range("hidden_size", self.hidden_size, 1, 1 << 20)
        _check_range("ffn_size", self.ffn_size, 1, 1 << 24)
        _check_range("layers", self.layers, 1, 1024)
        _coerce_enum(self, "dtype", WorkloadDtype)
        _check_range("max_tokens", self.max_tokens, 1, 1 << 24)
        _check_range("warmup_steps", self.warmup_steps, 1, 1_000_000)
        if self.warmup_steps > self.max_tokens:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) must not exceed max_tokens "
                f"({self.max_tokens}): each warm-up step must ask for more tokens"
            )
        if not isinstance(self.lock, bool):
            raise ValueError(f"lock must be true or false, got {self.lock!r}")
        _check_range("steps", self.steps, 0, 1 << 62)
        if isinstance(self.pace, bool) or not isinstance(self.pace, (int, float)) \
                or not 0 <= self.pace <= 3600:
            raise ValueError(f"pace must be a number of seconds in [0, 3600], got {self.pace!r}")
        if isinstance(self.oversize_chance, bool) or not isinstance(self.oversize_chance, (int, float)) \
                or not 0 <= self.oversize_chance <= 1:
            raise ValueError(f"oversize_chance must be a number in [0, 1], got {self.oversize_chance!r}")
        _check_range("seed", self.seed, 0, 2**63 - 1)


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
        return value
    if typing.get_origin(kind) is tuple:
        if from_env:
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"must be a list of strings, got {value!r}")
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


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The TOML document at ``path``; ConfigError naming the file if it cannot be read or parsed."""
    source = str(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{source}: configuration file not found") from None
    except OSError as e:
        raise ConfigError(f"{source}: cannot read configuration file: {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from e
    except UnicodeDecodeError as e:  # tomllib decodes the bytes itself, before parsing
        raise ConfigError(f"{source}: not valid TOML: not UTF-8 text ({e.reason} at byte {e.start})") from e


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
    for name, value in env.items():
        if not name.startswith("WSD_") or name in NOT_CONFIGURATION:
            continue
        section, _, key = name[4:].lower().partition("_")
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
