"""``[coordinator]``: the coordinator's sockets, timing, state and metrics endpoint. No torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from wsd.fieldchecks import check_endpoint, check_positive, check_range, coerce_enum, size_field
from wsd.names import DEFAULT_ENGINE, engine_name_problem

__all__ = ["MAX_EVENT_CAPACITY", "CoordinatorConfig", "CoordinatorMode"]

MAX_EVENT_CAPACITY = 10_000_000
"""Largest ``event_capacity``: the most events a coordinator holds."""


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
    stats_interval: float | None = None
    """Seconds between an agent's looks at its snapshot: it pushes what changed since the
    coordinator last acknowledged (at once, too, after a command or a lock violation), or
    else confirms the snapshot is still current. None: ``heartbeat_interval``."""
    stats_stale_after: float | None = None
    """Seconds after which a rank's remembered snapshot is shown stale (in ``wsctl``, the
    JSON and the metrics). None: three ``stats_interval``."""
    stats_timeout: float = 2.0
    """Seconds a fresh stats request (``wsctl stats --fresh``) waits for every live rank's snapshot."""
    stall_after: float = 60.0
    """Seconds inside one engine step after which a live rank is stalled (its agent sends its
    threads' stacks once); an engine idle between steps is never stalled."""
    state_file: str = "wsd-coordinator.state"
    """Desired state, sequence number and command log; written atomically."""
    world_size: int | None = None
    """Ranks expected; None: taken from the first rank that registers (at most 4,096 ranks that way)."""
    tp_size: int | None = None
    """Tensor-parallel group size expected; None: from the first registration."""
    max_message_bytes: int = size_field(1 << 20)
    """Largest message accepted from a client (ZeroMQ MAXMSGSIZE)."""
    max_agent_message_bytes: int = size_field(4 << 20)
    """Largest frame accepted from an agent; a larger one drops that agent's connection
    (ZeroMQ MAXMSGSIZE). A stats reply of 64 x 64 slots is about 30 KB (340 KB at worst):
    the default leaves ten times that for persistent buffers. Each message type has its
    own smaller bound besides (wsd.wire.protocol.LIMITS)."""
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
    metrics_refresh: float = 1.0
    """Seconds between copies of the remembered snapshots for the per-slot metrics (when the
    endpoint is on); a scrape never asks the ranks."""
    metrics_slots: bool = True
    """Export the per-slot families (``wsd_slot_*``, four samples in five of a scrape at
    scale); false keeps every per-rank and per-group family and drops those."""
    metrics_certfile: str | None = None
    """PEM certificate (chain) of the metrics endpoint: with ``metrics_keyfile``, it serves
    HTTPS (prometheus_client's ``certfile``). None: plain HTTP."""
    metrics_keyfile: str | None = None
    """PEM private key of ``metrics_certfile`` (prometheus_client's ``keyfile``)."""
    metrics_client_cafile: str | None = None
    """PEM file of the CAs that client certificates are checked against (prometheus_client's
    ``client_cafile``); only with ``metrics_client_auth_required``."""
    metrics_client_capath: str | None = None
    """Folder of hashed CA certificates, as ``openssl rehash`` writes it (``client_capath``);
    only with ``metrics_client_auth_required``."""
    metrics_client_auth_required: bool = False
    """Refuse a scraper without a client certificate that ``metrics_client_cafile`` or
    ``metrics_client_capath`` (one of them required) vouch for, never the system's CAs
    (``client_auth_required``); false: client certificates are not asked for."""
    engine: str = DEFAULT_ENGINE
    """The name of this coordinator's default engine: that of every agent that names none
    (``[agent] engine``), whose command log is ``state_file``; another engine's is
    ``STATE_FILE@NAME``. ``wsd up`` names it after its cluster."""
    max_engines: int = 64
    """Engines served at most: a registration that would add one more is refused."""
    max_profile_slot_bytes: int = 32 << 30
    """The most a sizing profile learns for one slot (a slot's size beyond it is cut to it):
    what a rank pushes is a claim, and a profile is handed to every engine of its model."""
    resume_seq: int | None = None
    """Recovery after the state file was lost: number commands after this seq, the highest
    ``applied_seq`` that refused agents report (the events name it). No effect once the
    log is past it. None: agents reporting more than was issued are refused."""

    def __post_init__(self) -> None:
        coerce_enum(self, "mode", CoordinatorMode)
        if self.connect_endpoint is not None:
            check_endpoint("connect_endpoint", self.connect_endpoint, bind=False)
        check_endpoint("agent_endpoint", self.agent_endpoint, bind=True)
        check_endpoint("client_endpoint", self.client_endpoint, bind=True)
        check_positive("heartbeat_interval", self.heartbeat_interval)
        check_positive("heartbeat_timeout", self.heartbeat_timeout)
        check_positive("stall_after", self.stall_after, 86400.0)
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout}) must be larger than "
                f"heartbeat_interval ({self.heartbeat_interval})"
            )
        check_positive("command_timeout", self.command_timeout, 3600.0)
        if self.stats_interval is not None:
            check_positive("stats_interval", self.stats_interval, 3600.0)
        if self.stats_stale_after is not None:
            check_positive("stats_stale_after", self.stats_stale_after, 86400.0)
            if self.stats_stale_after <= self.pushed_interval:
                raise ValueError(f"stats_stale_after ({self.stats_stale_after}) must be larger than "
                                 f"stats_interval ({self.pushed_interval})")
        check_positive("stats_timeout", self.stats_timeout, 3600.0)
        if not isinstance(self.state_file, str) or not self.state_file:
            raise ValueError(f"state_file must be a path, got {self.state_file!r}")
        if self.world_size is not None:
            check_range("world_size", self.world_size, 1, 1 << 20)
        if self.tp_size is not None:
            check_range("tp_size", self.tp_size, 1, 1 << 20)
            if self.world_size is not None and self.world_size % self.tp_size:
                raise ValueError(
                    f"world_size ({self.world_size}) must be a multiple of tp_size ({self.tp_size})"
                )
        check_range("max_message_bytes", self.max_message_bytes, 1024, 1 << 30)
        check_range("max_agent_message_bytes", self.max_agent_message_bytes, 64 << 10, 1 << 30)
        check_range("high_water_mark", self.high_water_mark, 1, 10_000_000)
        check_range("event_capacity", self.event_capacity, 1, MAX_EVENT_CAPACITY)
        check_range("log_capacity", self.log_capacity, 1, 10_000_000)
        if self.metrics_port is not None:
            check_range("metrics_port", self.metrics_port, 0, 65535)
        if not isinstance(self.metrics_host, str) or not self.metrics_host:
            raise ValueError(f"metrics_host must be an address such as 127.0.0.1, got {self.metrics_host!r}")
        check_positive("metrics_refresh", self.metrics_refresh, 3600.0)
        self._check_metrics_tls()
        problem = engine_name_problem(self.engine)
        if problem is not None:
            raise ValueError(f"engine: {problem}")
        check_range("max_engines", self.max_engines, 1, 4096)
        check_range("max_profile_slot_bytes", self.max_profile_slot_bytes, 1, 1 << 40)
        if self.resume_seq is not None:
            check_range("resume_seq", self.resume_seq, 0, 2**62)

    def _check_metrics_tls(self) -> None:
        """The switches are booleans, the paths strings, and TLS is all or nothing: a
        certificate without its key (or a client option without either) would otherwise
        serve plain HTTP while the operator believes it is HTTPS."""
        for name in ("metrics_slots", "metrics_client_auth_required"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        paths = ("metrics_certfile", "metrics_keyfile", "metrics_client_cafile", "metrics_client_capath")
        for name in paths:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a path, got {value!r}")
        if (self.metrics_certfile is None) != (self.metrics_keyfile is None):
            raise ValueError("metrics_certfile and metrics_keyfile go together: set both for HTTPS, or neither")
        client = [n for n in paths[2:] if getattr(self, n) is not None]
        if self.metrics_client_auth_required:
            client.append("metrics_client_auth_required")
        if client and self.metrics_certfile is None:
            raise ValueError(f"{', '.join(client)} need(s) HTTPS: set metrics_certfile and metrics_keyfile")
        # Client certificates are checked against the CAs given here, never the system's:
        # those would let in any certificate a public CA signed.
        cas = [n for n in paths[2:] if getattr(self, n) is not None]
        if self.metrics_client_auth_required and not cas:
            raise ValueError("metrics_client_auth_required needs metrics_client_cafile or metrics_client_capath: "
                             "the CAs that sign the scrapers' client certificates (the system's CAs would "
                             "accept any certificate a public CA signed)")
        if cas and not self.metrics_client_auth_required:
            raise ValueError(f"{' and '.join(cas)} would check nothing without metrics_client_auth_required = true: "
                             f"set it to require client certificates those CAs signed, or remove "
                             f"{'them' if len(cas) > 1 else 'it'}")

    @property
    def pushed_interval(self) -> float:
        """Seconds between an agent's looks at its snapshot (``stats_interval`` or its default)."""
        return self.heartbeat_interval if self.stats_interval is None else self.stats_interval

    @property
    def stale_after(self) -> float:
        """Seconds after which a remembered snapshot is stale (``stats_stale_after`` or its default)."""
        return 3 * self.pushed_interval if self.stats_stale_after is None else self.stats_stale_after
