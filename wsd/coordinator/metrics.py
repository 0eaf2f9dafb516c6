"""The coordinator's Prometheus metrics: the families, what the core publishes, the endpoint.

Two threads meet here. The coordinator's core runs on its loop thread and
owns the live registry and counters; it never shares them. Instead it
*publishes*: it builds immutable views (``CoreView`` from the registry and
counters at every pulse, ``StatsView`` from the ranks' pushed snapshots) and
replaces one reference, ``CoordinatorCore.published``, with a new
``Published``. The HTTP server's threads only read that reference: at each
scrape ``Collector`` builds every family afresh from the latest views, so a
rank that left or a slot that ``set_ubatches`` removed is gone from the next
scrape, with no stale label set left in a registry.

The per-slot figures are the snapshots the ranks pushed, as the coordinator
remembers them, copied every ``[coordinator] metrics_refresh`` seconds: a
scrape never asks a rank. ``wsd_rank_stats_age_seconds`` says how old each
rank's is, and ``wsd_stats_age_seconds`` the oldest. Imports no torch.
"""

from __future__ import annotations

import bisect
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any, NamedTuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from wsd.commands import COMMANDS
from wsd.coordinator.registry import RankState, Registry
from wsd.errors import WsdError
from wsd.manager.stats import SLOT_NUMBERS
from wsd.wire.protocol import StrEnum
from wsd.wire.transport import BindError

__all__ = ["COMMAND_BUCKETS", "CONTENT_TYPE", "FAMILIES", "Collector", "CommandOutcome", "CommandStats", "CoreView",
           "GroupFigures", "MetricsServer", "Published", "RankFigures", "RankRow", "StatsView", "core_view"]

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
    "wsd_rank_stats_age_seconds": ("gauge", _RANK),
    "wsd_rank_stats_stale": ("gauge", _RANK),
    "wsd_group_workspace_bytes": ("gauge", _GROUP),
    "wsd_group_skew_bytes": ("gauge", _GROUP),
    "wsd_group_consistent": ("gauge", _GROUP),
    "wsd_group_drift": ("gauge", _GROUP),
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
    "wsd_rank_stats_age_seconds": "Seconds since the rank's snapshot (the wsd_slot_* figures) was known current.",
    "wsd_rank_stats_stale": "1 if the rank's snapshot is older than [coordinator] stats_stale_after.",
    "wsd_group_workspace_bytes": "Workspace bytes summed over the TP group's reporting ranks.",
    "wsd_group_skew_bytes": "Largest minus smallest rank workspace total in the TP group.",
    "wsd_group_consistent": "1 if the TP group's live ranks agree on lock state and slot count.",
    "wsd_group_drift": "1 if the TP group's live ranks, with every command applied, report a lock state or slot "
                       "count other than the desired one.",
    "wsd_command_duration_seconds": "Seconds from numbering a command to its result.",
    "wsd_commands_total": "Commands finished, by action and result (complete, partial, failed).",
    "wsd_ranks": "Expected ranks by state (live, lost, stopped, never_registered).",
    "wsd_heartbeats_total": "Heartbeats received from agents.",
    "wsd_agent_refusals_total": "Agent frames and registrations refused, by reason (an impostor, a flood, "
                                "claims beyond the issued seq).",
    "wsd_command_seq": "The last command sequence number handed out.",
    "wsd_stats_age_seconds": "Seconds since the oldest rank's snapshot was known current.",
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

    def __init__(self, actions: Iterable[str] = COMMANDS) -> None:
        # Every action and outcome from the start, at 0: a counter that first appears
        # at its first event hides that event from increase() and rate().
        self._counts: dict[tuple[str, str], int] = {(a, str(o)): 0 for a in actions for o in CommandOutcome}
        # action -> [count per bucket (one past the last bound: +Inf), sum of seconds]
        self._latency: dict[str, tuple[list[int], list[float]]] = {
            a: ([0] * (len(COMMAND_BUCKETS) + 1), [0.0]) for a in actions}

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
    drift: tuple[tuple[int, bool], ...] = ()


class RankFigures(NamedTuple):
    """One rank's remembered snapshot, as the metrics show it."""

    rank: int
    tp_group: int
    total_bytes: int
    age: float
    """Seconds since it was known current, when the view was made."""
    stale: bool
    columns: dict[str, list[Any]]
    """The snapshot's slot columns by name (``SLOT_COLUMNS``); never changed once published."""


class GroupFigures(NamedTuple):
    """A TP group's totals over its reporting ranks."""

    tp_group: int
    total_bytes: int
    skew_bytes: int


@dataclass(frozen=True)
class StatsView:
    """The ranks' remembered snapshots when last copied: the wall-clock time, per rank and per group."""

    time: float
    ranks: tuple[RankFigures, ...]
    groups: tuple[GroupFigures, ...]


@dataclass(frozen=True)
class Published:
    """What the collector reads; the core replaces it whole, never changes it."""

    core: CoreView | None = None
    stats: StatsView | None = None


def core_view(registry: Registry, *, seq: int, heartbeats: int, inconsistent: set[int],
              commands: CommandStats, refused: dict[str, int] | None = None,
              drifting: set[int] | None = None) -> CoreView:
    """Copy what the metrics need of the registry and counters (on the loop thread)."""
    rows = [RankRow(i.rank, i.tp_group, i.host, i.state is RankState.LIVE, i.manager_state.get("locked"),
                    i.manager_state.get("num_ubatches"), i.step) for i in registry.ranks.values()]
    never = [RankRow(rank, g, "", False, None, None, None)
             for g in registry.groups() for rank in registry.expected(g) if rank not in registry.ranks]
    states = tuple(registry.counts().items())  # the same counts by state as ``status`` shows
    counts, latency = commands.snapshot()
    return CoreView(seq=seq, heartbeats=heartbeats, ranks=tuple(sorted(rows + never)), states=states,
                    consistent=tuple((g, g not in inconsistent) for g in registry.groups()),
                    drift=tuple((g, g in (drifting or set())) for g in registry.groups()),
                    commands=counts, latency=latency, refused=tuple(sorted((refused or {}).items())))


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text exposition format the endpoint writes."""


def _escape(value: str) -> str:
    """A label value as the text format quotes it."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def _labels(names: Sequence[str], values: Iterable[object]) -> str:
    pairs = ",".join(f'{n}="{_escape(str(v))}"' for n, v in zip(names, values))
    return "{" + pairs + "}" if pairs else ""


class _Text:
    """One scrape: each family's sample lines, written out in ``FAMILIES`` order.

    The text is built directly, not through prometheus_client's family objects:
    at 1,024 ranks of 8 slots a scrape holds about 50,000 samples, and building
    an object per sample cost several times the 50 ms a scrape may take.
    """

    def __init__(self) -> None:
        self.lines: dict[str, list[str]] = {name: [] for name in FAMILIES}

    def add(self, name: str, values: Iterable[object], value: float) -> None:
        self.lines[name].append(f"{name}{_labels(FAMILIES[name][1], values)} {_number(value)}\n")

    def render(self) -> bytes:
        out: list[str] = []
        for name, (kind, _) in FAMILIES.items():
            out.append(f"# HELP {name} {_HELP[name]}\n# TYPE {name} {kind}\n")
            out += self.lines[name]
        return "".join(out).encode()


class Collector:
    """Writes every family afresh at each scrape from ``source()``, the latest ``Published``."""

    def __init__(self, source: Callable[[], Published], *, wall: Callable[[], float] = time.time) -> None:
        self._source = source
        self._wall = wall

    def render(self) -> bytes:
        """One scrape, in the text exposition format (``CONTENT_TYPE``)."""
        published = self._source()  # one read: the views below belong together
        text = _Text()
        hosts: dict[int, str] = {}
        if published.core is not None:
            hosts = {r.rank: r.host for r in published.core.ranks}
            self._core(published.core, text)
        if published.stats is not None:
            self._stats(published.stats, hosts, text)
        return text.render()

    @staticmethod
    def _core(view: CoreView, text: _Text) -> None:
        for row in view.ranks:
            labels = (row.rank, row.tp_group, row.host)
            text.add("wsd_rank_up", labels, row.up)
            if row.locked is not None:
                text.add("wsd_rank_locked", labels, row.locked)
            if row.num_ubatches is not None:
                text.add("wsd_rank_ubatches", labels, row.num_ubatches)
            if row.step is not None:
                text.add("wsd_rank_last_step", labels, row.step)
        for state, count in view.states:
            text.add("wsd_ranks", (state,), count)
        for group, consistent in view.consistent:
            text.add("wsd_group_consistent", (group,), consistent)
        for group, drifting in view.drift:
            text.add("wsd_group_drift", (group,), drifting)
        for (action, outcome), count in view.commands:
            text.add("wsd_commands_total", (action, outcome), count)
        histogram = "wsd_command_duration_seconds"
        lines = text.lines[histogram]
        for action, buckets, total in view.latency:
            running = 0
            quoted = _escape(action)
            for bound, count in zip((*map(str, COMMAND_BUCKETS), "+Inf"), buckets):
                running += count
                lines.append(f'{histogram}_bucket{{action="{quoted}",le="{bound}"}} {running}\n')
            lines.append(f'{histogram}_count{{action="{quoted}"}} {running}\n')
            lines.append(f'{histogram}_sum{{action="{quoted}"}} {_number(total)}\n')
        text.add("wsd_heartbeats_total", (), view.heartbeats)
        for reason, count in view.refused:
            text.add("wsd_agent_refusals_total", (reason,), count)
        text.add("wsd_command_seq", (), view.seq)

    def _stats(self, view: StatsView, hosts: dict[int, str], text: _Text) -> None:
        since = max(0.0, self._wall() - view.time)  # the ages were measured when the view was made
        oldest = 0.0
        slot_lines = [text.lines[n.metric] for n in SLOT_NUMBERS]
        for rank in view.ranks:
            labels = (rank.rank, rank.tp_group, hosts.get(rank.rank, ""))
            text.add("wsd_rank_workspace_bytes", labels, rank.total_bytes)
            age = rank.age + since
            oldest = max(oldest, age)
            text.add("wsd_rank_stats_age_seconds", labels, age)
            text.add("wsd_rank_stats_stale", labels, rank.stale)
            # The bulk of a scrape: one line per slot and number, written as plainly as can be.
            places = [f'rank="{rank.rank}",tp_group="{rank.tp_group}",ubatch="{u}",lane="{lane}"}} '
                      for u, lane in zip(rank.columns["ubatch"], rank.columns["lane"])]
            for number, lines in zip(SLOT_NUMBERS, slot_lines):
                head = number.metric + "{"
                values = rank.columns[number.name]
                if number.kind is not int:  # an int formats as itself; a float needs NaN and Inf spelled
                    values = list(map(_number, values))
                lines += [f"{head}{place}{value}\n" for place, value in zip(places, values)]
        for group in view.groups:
            text.add("wsd_group_workspace_bytes", (group.tp_group,), group.total_bytes)
            text.add("wsd_group_skew_bytes", (group.tp_group,), group.skew_bytes)
        text.add("wsd_stats_age_seconds", (), oldest)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight never holds up the coordinator's exit
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape is noise; errors still reach the log through wsgiref


def _app(collector: Collector) -> Callable[..., list[bytes]]:
    """The WSGI application: ``/metrics`` (any path) is a fresh scrape."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        body = collector.render()
        start_response("200 OK", [("Content-Type", CONTENT_TYPE), ("Content-Length", str(len(body)))])
        return [b"" if environ.get("REQUEST_METHOD") == "HEAD" else body]

    return app


class MetricsServer:
    """``/metrics`` over HTTP in a thread of its own, serving a fresh ``Collector`` scrape."""

    def __init__(self, source: Callable[[], Published], host: str, port: int, *,
                 wall: Callable[[], float] = time.time) -> None:
        collector = Collector(source, wall=wall)
        try:
            family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
            server_class: type[_Server] = type("_MetricsServer", (_Server,), {"address_family": family})
            # address[0] is the host as a string for every stream family getaddrinfo returns.
            self._server = make_server(str(address[0]), port, _app(collector), server_class,
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
