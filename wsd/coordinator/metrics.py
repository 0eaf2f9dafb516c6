"""The coordinator's Prometheus metrics: the families, what the core publishes, the endpoint.

Two threads meet here. The coordinator's core runs on its loop thread and
owns the live registry and counters; it never shares them. Instead it
*publishes*: it builds immutable views (``CoreView`` from the registry and
counters at every pulse, ``StatsView`` from each finished stats round) and
replaces one reference, ``CoordinatorCore.published``, with a new
``Published``. The HTTP server's threads only read that reference: at each
scrape ``Collector`` builds every family afresh from the latest views, so a
rank that left or a slot that ``set_ubatches`` removed is gone from the next
scrape, with no stale label set left in a registry.

The per-slot figures come from the coordinator's own stats rounds, one every
``[coordinator] metrics_refresh`` seconds; ``wsd_stats_age_seconds`` says how
old the last one is. Imports no torch.
"""

from __future__ import annotations

import bisect
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any, NamedTuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import msgpack
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from wsd.coordinator.registry import RankState, Registry
from wsd.errors import WsdError
from wsd.manager.stats import SLOT_NUMBERS
from wsd.wire.protocol import StrEnum
from wsd.wire.transport import BindError

__all__ = ["COMMAND_BUCKETS", "FAMILIES", "Collector", "CommandOutcome", "CommandStats", "CoreView",
           "MetricsServer", "Published", "RankRow", "StatsView", "core_view"]

logger = logging.getLogger(__name__)

_SLOT = ("rank", "tp_group", "ubatch", "lane")
_RANK = ("rank", "tp_group", "host")
_GROUP = ("tp_group",)

FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    **{n.metric: ("counter" if n.counter else "gauge", _SLOT) for n in SLOT_NUMBERS},
    "wsd_rank_up": ("gauge", _RANK),
    "wsd_rank_locked": ("gauge", _RANK),
    "wsd_rank_ubatches": ("gauge", _RANK),
    "wsd_rank_last_step": ("gauge", _RANK),
    "wsd_rank_workspace_bytes": ("gauge", _RANK),
    "wsd_group_workspace_bytes": ("gauge", _GROUP),
    "wsd_group_skew_bytes": ("gauge", _GROUP),
    "wsd_group_consistent": ("gauge", _GROUP),
    "wsd_command_duration_seconds": ("histogram", ("action",)),
    "wsd_commands_total": ("counter", ("action", "result")),
    "wsd_ranks": ("gauge", ("state",)),
    "wsd_heartbeats_total": ("counter", ()),
    "wsd_agent_refusals_total": ("counter", ("reason",)),
    "wsd_command_seq": ("gauge", ()),
    "wsd_stats_age_seconds": ("gauge", ()),
}
"""Every family the coordinator exports: name -> (type, label names). The contract that
deploy/grafana and deploy/prometheus are checked against (tests/test_deploy.py)."""

_HELP = {
    **{n.metric: n.help for n in SLOT_NUMBERS},
    "wsd_rank_up": "1 if the rank is live, 0 if lost, stopped or never registered (host empty then).",
    "wsd_rank_locked": "1 if the rank's workspace is locked, as its last heartbeat said.",
    "wsd_rank_ubatches": "Micro-batch slots per lane of the rank's workspace, as its last heartbeat said.",
    "wsd_rank_last_step": "The last engine step the rank reported.",
    "wsd_rank_workspace_bytes": "Total bytes of the rank's workspace (scratch and persistent).",
    "wsd_group_workspace_bytes": "Workspace bytes summed over the TP group's reporting ranks.",
    "wsd_group_skew_bytes": "Largest minus smallest rank workspace total in the TP group.",
    "wsd_group_consistent": "1 if the TP group's live ranks agree on lock state and slot count.",
    "wsd_command_duration_seconds": "Seconds from numbering a command to its result.",
    "wsd_commands_total": "Commands finished, by action and result (complete, partial, failed).",
    "wsd_ranks": "Expected ranks by state (live, lost, stopped, never_registered).",
    "wsd_heartbeats_total": "Heartbeats received from agents.",
    "wsd_agent_refusals_total": "Agent frames and registrations refused, by reason (an impostor, a flood, "
                                "claims beyond the issued seq).",
    "wsd_command_seq": "The last command sequence number handed out.",
    "wsd_stats_age_seconds": "Seconds since the stats round the wsd_slot_* figures come from.",
}

COMMAND_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Upper bounds (seconds) of the command latency histogram: a step-synchronised command
takes a few engine steps; one that waits for a lost rank takes the command timeout."""

# A scrape's stop() waits this long for the server's loop to notice shutdown.
_POLL_INTERVAL = 0.1


class CommandOutcome(StrEnum):
    COMPLETE = "complete"
    """Every expected rank of the target acknowledged it applied."""
    PARTIAL = "partial"
    """Some ranks were pending, lost or missing when it finished."""
    FAILED = "failed"
    """At least one rank reported it could not apply it."""


class CommandStats:
    """Commands by action and outcome, and their latency per action.

    Owned by the coordinator's loop thread (mutable); ``snapshot`` gives the
    immutable copy that is published.
    """

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], int] = {}
        # action -> [count per bucket (one past the last bound: +Inf), sum of seconds]
        self._latency: dict[str, tuple[list[int], list[float]]] = {}

    def record(self, action: str, outcome: CommandOutcome, seconds: float) -> None:
        key = (action, str(outcome))
        self._counts[key] = self._counts.get(key, 0) + 1
        buckets, total = self._latency.setdefault(action, ([0] * (len(COMMAND_BUCKETS) + 1), [0.0]))
        buckets[bisect.bisect_left(COMMAND_BUCKETS, seconds)] += 1
        total[0] += seconds

    def snapshot(self) -> tuple[tuple[tuple[tuple[str, str], int], ...],
                                tuple[tuple[str, tuple[int, ...], float], ...]]:
        """(((action, outcome), count), ...), ((action, per-bucket counts, sum), ...)."""
        latency = tuple((a, tuple(b), s[0]) for a, (b, s) in sorted(self._latency.items()))
        return tuple(sorted(self._counts.items())), latency


class RankRow(NamedTuple):
    """One expected rank as the registry knows it."""

    rank: int
    tp_group: int
    host: str
    up: bool
    locked: bool | None
    num_ubatches: int | None
    step: int | None


@dataclass(frozen=True)
class CoreView:
    """The registry and counters at one moment, for the metrics (immutable)."""

    seq: int
    heartbeats: int
    ranks: tuple[RankRow, ...]
    states: tuple[tuple[str, int], ...]
    consistent: tuple[tuple[int, bool], ...]
    commands: tuple[tuple[tuple[str, str], int], ...]
    latency: tuple[tuple[str, tuple[int, ...], float], ...]
    refused: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class StatsView:
    """The last finished metrics stats round: its wall-clock time and its encoded answer."""

    time: float
    result: bytes
    """The ``stats`` answer as the coordinator encodes it for clients (msgpack); decoded
    by the collector at scrape time, off the coordinator's loop thread."""


@dataclass(frozen=True)
class Published:
    """What the collector reads; the core replaces it whole, never changes it."""

    core: CoreView | None = None
    stats: StatsView | None = None


def core_view(registry: Registry, *, seq: int, heartbeats: int, inconsistent: set[int],
              commands: CommandStats, refused: dict[str, int] | None = None) -> CoreView:
    """Copy what the metrics need of the registry and counters (on the loop thread)."""
    rows = [RankRow(i.rank, i.tp_group, i.host, i.state is RankState.LIVE, i.manager_state.get("locked"),
                    i.manager_state.get("num_ubatches"), i.step) for i in registry.ranks.values()]
    never = [RankRow(rank, g, "", False, None, None, None)
             for g in registry.groups() for rank in registry.expected(g) if rank not in registry.ranks]
    states = tuple(registry.counts().items())  # the same counts by state as ``status`` shows
    counts, latency = commands.snapshot()
    return CoreView(seq=seq, heartbeats=heartbeats, ranks=tuple(sorted(rows + never)), states=states,
                    consistent=tuple((g, g not in inconsistent) for g in registry.groups()),
                    commands=counts, latency=latency, refused=tuple(sorted((refused or {}).items())))


# A gauge's or a counter's sample is add_metric(labels, value); a histogram's
# is add_metric(labels, buckets, sum): they are kept apart so that each call is
# checked against its own signature.
_Sampled = GaugeMetricFamily | CounterMetricFamily


class _Families(NamedTuple):
    """One scrape's families by name, fresh and empty: gauges and counters, and histograms."""

    sampled: dict[str, _Sampled]
    histograms: dict[str, HistogramMetricFamily]

    @classmethod
    def fresh(cls) -> _Families:
        families = cls({}, {})
        for name, (kind, labels) in FAMILIES.items():
            if kind == "histogram":
                families.histograms[name] = HistogramMetricFamily(name, _HELP[name], labels=labels)
            elif kind == "counter":
                families.sampled[name] = CounterMetricFamily(name, _HELP[name], labels=labels)
            else:
                families.sampled[name] = GaugeMetricFamily(name, _HELP[name], labels=labels)
        return families

    def in_order(self) -> Iterator[Metric]:
        """Every family, in ``FAMILIES`` order."""
        for name in FAMILIES:
            yield self.histograms[name] if name in self.histograms else self.sampled[name]


# The slot column of a rank's stats entry behind each per-slot family.
_SLOT_FAMILIES = {n.metric: n.name for n in SLOT_NUMBERS}


class Collector:
    """Builds every family afresh at each scrape from ``source()``, the latest ``Published``."""

    def __init__(self, source: Callable[[], Published], *, wall: Callable[[], float] = time.time) -> None:
        self._source = source
        self._wall = wall

    def describe(self) -> list[Metric]:
        return []  # nothing to check for clashes: this registry holds this collector alone

    def collect(self) -> Iterator[Metric]:
        published = self._source()  # one read: the views below belong together
        families = _Families.fresh()
        hosts: dict[int, str] = {}
        if published.core is not None:
            hosts = {r.rank: r.host for r in published.core.ranks}
            self._core(published.core, families)
        if published.stats is not None:
            self._stats(published.stats, hosts, families.sampled)
        yield from families.in_order()

    @staticmethod
    def _core(view: CoreView, families: _Families) -> None:
        f = families.sampled
        for row in view.ranks:
            labels = [str(row.rank), str(row.tp_group), row.host]
            f["wsd_rank_up"].add_metric(labels, float(row.up))
            if row.locked is not None:
                f["wsd_rank_locked"].add_metric(labels, float(row.locked))
            if row.num_ubatches is not None:
                f["wsd_rank_ubatches"].add_metric(labels, row.num_ubatches)
            if row.step is not None:
                f["wsd_rank_last_step"].add_metric(labels, row.step)
        for state, count in view.states:
            f["wsd_ranks"].add_metric([state], count)
        for group, consistent in view.consistent:
            f["wsd_group_consistent"].add_metric([str(group)], float(consistent))
        for (action, outcome), count in view.commands:
            f["wsd_commands_total"].add_metric([action, outcome], count)
        for action, buckets, total in view.latency:
            cumulative: list[tuple[str, float]] = []
            running = 0
            for bound, count in zip((*map(str, COMMAND_BUCKETS), "+Inf"), buckets):
                running += count
                cumulative.append((bound, running))
            families.histograms["wsd_command_duration_seconds"].add_metric([action], cumulative, total)
        f["wsd_heartbeats_total"].add_metric([], view.heartbeats)
        for reason, count in view.refused:
            f["wsd_agent_refusals_total"].add_metric([reason], count)
        f["wsd_command_seq"].add_metric([], view.seq)

    def _stats(self, view: StatsView, hosts: dict[int, str], f: dict[str, _Sampled]) -> None:
        result: dict[str, Any] = msgpack.unpackb(view.result, raw=False)
        for rank in result["ranks"]:
            r, g = str(rank["rank"]), str(rank["tp_group"])
            f["wsd_rank_workspace_bytes"].add_metric([r, g, hosts.get(rank["rank"], "")], rank["total_bytes"])
            slots = rank["slots"]
            places = [[r, g, str(u), str(lane)] for u, lane in zip(slots["ubatch"], slots["lane"])]
            for name, column in _SLOT_FAMILIES.items():
                family = f[name]
                for labels, value in zip(places, slots[column]):
                    family.add_metric(labels, value)
        for group in result["groups"]:
            if group["reporting"]:  # a group with no rank answering has no total to show
                labels = [str(group["tp_group"])]
                f["wsd_group_workspace_bytes"].add_metric(labels, group["total_bytes"])
                f["wsd_group_skew_bytes"].add_metric(labels, group["skew_bytes"])
        f["wsd_stats_age_seconds"].add_metric([], max(0.0, self._wall() - view.time))


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight never holds up the coordinator's exit
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape is noise; errors still reach the log through wsgiref


class MetricsServer:
    """``/metrics`` over HTTP in a thread of its own, serving a fresh ``Collector`` scrape."""

    def __init__(self, source: Callable[[], Published], host: str, port: int, *,
                 wall: Callable[[], float] = time.time) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(Collector(source, wall=wall))
        try:
            family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
            server_class: type[_Server] = type("_MetricsServer", (_Server,), {"address_family": family})
            # address[0] is the host as a string for every stream family getaddrinfo returns.
            self._server = make_server(str(address[0]), port, make_wsgi_app(registry), server_class,
                                       handler_class=_QuietHandler)
        except OSError as e:  # in use, not this host's, a privileged port: configuration
            raise BindError(f"cannot serve metrics on {host}:{port} ([coordinator] metrics_host, "
                            f"metrics_port): {e.strerror or e}") from e
        self.host = host
        self.port: int = self._server.server_address[1]
        """The bound port: the one asked for, or the one the OS chose for port 0."""
        bracketed = f"[{host}]" if ":" in host else host
        self.url = f"http://{bracketed}:{self.port}/metrics"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(_POLL_INTERVAL,),
                                        name="wsd-metrics", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and close the socket; waits at most ``timeout`` for the thread."""
        if self._thread.is_alive():
            # shutdown() waits for serve_forever to notice, which it does within
            # _POLL_INTERVAL; a thread that has already ended would never answer.
            self._server.shutdown()
            self._thread.join(timeout)
        self._server.server_close()
        if self._thread.is_alive():
            raise WsdError(f"metrics server did not stop within {timeout} s")
