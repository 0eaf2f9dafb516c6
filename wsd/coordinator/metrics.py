"""The coordinator's Prometheus metrics: the families, what the core publishes, the scrape text.

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
rank's is, and ``wsd_stats_age_seconds`` the oldest.

Every series a rank has keeps one identity, ``{engine, rank, tp_group}``, from
the coordinator's start (ranks are unique within an engine; every per-rank,
per-group and per-slot family, and each engine's own figures, carry
``engine``): what a rank registered with (its host, pid, device) and where it
runs as vLLM, DCGM and Kubernetes name it (``wsd.placement``) is in
``wsd_rank_info`` alone, so that a registration adds one series instead of
renaming every other. The HTTP endpoint is ``wsd.coordinator.metrics_server``.
Imports no torch.
"""

from __future__ import annotations

import bisect
import platform
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import zmq
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, generate_latest

from wsd import placement
from wsd.commands import COMMANDS
from wsd.coordinator.admission import REFUSAL_REASONS
from wsd.coordinator.events import EventKind
from wsd.coordinator.registry import RankState, Registry
from wsd.families import FAMILIES, HELP, SLOT_FAMILIES, ViolationTotals
from wsd.slotstats import SLOT_NUMBERS
from wsd.version import __version__
from wsd.wire.protocol import PROTOCOL_VERSION, StrEnum

__all__ = ["COMMAND_BUCKETS", "CONTENT_TYPE", "FAMILIES", "HELP", "RANK_STATES", "SLOT_FAMILIES", "Collector",
           "CommandOutcome", "CommandStats", "CoreView", "Counters", "EngineFigures", "GroupFigures", "Published",
           "RankFigures", "RankRow", "StatsView", "ViolationTotals", "core_view"]

RANK_STATES = (*(str(s) for s in RankState), "missing")
"""The ``state`` values of ``wsd_ranks``, every one exported from the start: the keys of
``Registry.counts()``, ``missing`` being an expected rank the registry lists as
``NEVER_REGISTERED`` (the word ``ranks`` and ``wsctl status`` use)."""

COMMAND_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Upper bounds (seconds) of the command latency histogram: a step-synchronised command
takes a few engine steps; one that waits for a lost rank takes the command timeout."""

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
    tp_group: int | None
    """None: not known yet (no ``tp_size`` configured and no rank registered)."""
    up: bool
    locked: bool | None
    num_ubatches: int | None
    step: int | None
    registered: tuple[Any, ...] | None
    """(host, pid, device, then ``wsd.placement.LABELS``) it registered with; None for a rank
    that never registered."""
    stalled: bool = False
    waits_for: tuple[int, ...] = ()
    """The TP peers a stalled rank waits for, where known (``Registry.waits_for``)."""


@dataclass(frozen=True)
class CoreView:
    """One engine's registry at one moment, for the metrics (immutable)."""

    seq: int
    ranks: tuple[RankRow, ...]
    states: tuple[tuple[str, int], ...]
    consistent: tuple[tuple[int, bool], ...]
    drift: tuple[tuple[int, bool], ...] = ()


@dataclass(frozen=True)
class Counters:
    """The coordinator's own counters at one moment, over every engine (immutable)."""

    heartbeats: int = 0
    commands: tuple[tuple[tuple[str, str], int], ...] = ()
    latency: tuple[tuple[str, tuple[int, ...], float], ...] = ()
    refused: tuple[tuple[str, int], ...] = ()
    events: tuple[tuple[str, int], ...] = ()
    """Events logged by kind."""


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


class EngineFigures(NamedTuple):
    """One engine's views: its registry, and its ranks' snapshots (None: not copied yet)."""

    name: str
    core: CoreView
    stats: StatsView | None = None


@dataclass(frozen=True)
class Published:
    """What the collector reads; the core replaces it whole, never changes it."""

    counters: Counters | None = None
    engines: tuple[EngineFigures, ...] = ()


def core_view(registry: Registry, *, seq: int, inconsistent: set[int],
              drifting: set[int] | None = None) -> CoreView:
    """Copy what the metrics need of an engine's registry (on the loop thread).

    Every expected rank has a row, registered or not, so that ``wsd_rank_up`` has a 0
    for a rank that never registered also when only ``world_size`` is configured.
    """
    rows = [_rank_row(registry, rank) for rank in registry.expected()]
    counted = registry.counts()  # the registry's own counts, as ``status`` shows them
    states = {state: counted[state] for state in RANK_STATES}
    return CoreView(seq=seq, ranks=tuple(rows), states=tuple(states.items()),
                    consistent=tuple((g, g not in inconsistent) for g in registry.groups()),
                    drift=tuple((g, g in (drifting or set())) for g in registry.groups()))


def _rank_row(registry: Registry, rank: int) -> RankRow:
    info = registry.ranks.get(rank)
    if info is None:
        group = None if registry.tp_size is None else rank // registry.tp_size
        return RankRow(rank, group, False, None, None, None, None)
    stalled = info.shown is RankState.STALLED
    return RankRow(rank, info.tp_group, info.state is RankState.LIVE, info.manager_state.get("locked"),
                   info.manager_state.get("num_ubatches"), info.step,
                   (info.host, info.pid, info.device, *placement.labels(info.config, info.model)),
                   stalled, tuple(registry.waits_for(info)) if stalled else ())


def _build_labels() -> tuple[str, ...]:
    """``wsd_build_info``'s label values: fixed for the life of the process."""
    return (__version__, platform.python_version(), zmq.pyzmq_version(), zmq.zmq_version(),
            str(PROTOCOL_VERSION))


def _process_registry() -> CollectorRegistry:
    """prometheus_client's own ``process_*`` and ``python_info`` collectors, apart from its
    global registry: a dozen samples read from /proc at each scrape, rendered by it."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


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

    def family(self, name: str) -> bytes:
        """One family's text: its HELP and TYPE lines, then its samples."""
        return (f"# HELP {name} {HELP[name]}\n# TYPE {name} {FAMILIES[name][0]}\n"
                + "".join(self.lines[name])).encode()

    def chunks(self, apart: Iterable[str] = ()) -> list[bytes | str]:
        """Every family's text in ``FAMILIES`` order, runs of families joined into one bytes;
        the families named in ``apart`` are left as their names, to be written later."""
        out: list[bytes | str] = []
        run: list[str] = []
        for name, (kind, _) in FAMILIES.items():
            if name in apart:
                out += ["".join(run).encode(), name]
                run = []
                continue
            run.append(f"# HELP {name} {HELP[name]}\n# TYPE {name} {kind}\n")
            run += self.lines[name]
        out.append("".join(run).encode())
        return out


# Families that change with the time of the scrape, not only with what was published:
# written afresh at every scrape, where the rest is written once per published view.
_PER_SCRAPE = ("wsd_rank_stats_age_seconds", "wsd_stats_age_seconds")


class Collector:
    """Writes every family from ``source()``, the latest ``Published``, followed by
    prometheus_client's ``process_*`` and ``python_info``.

    The text is written once per published view and shared by every scrape of it (two
    Prometheus servers, or a slow scrape overlapping the next, cost one render, and hold
    one copy of the text); only the ages, which grow with the time of the scrape, are
    written afresh each time. ``slots`` False leaves the per-slot families
    (``SLOT_FAMILIES``, four samples in five of a large scrape) without samples; every
    per-rank and per-group family stays. Safe to call from several threads.
    """

    def __init__(self, source: Callable[[], Published], *, wall: Callable[[], float] = time.time,
                 slots: bool = True) -> None:
        self._source = source
        self._wall = wall
        self.slots = slots
        self._build = _build_labels()
        self._process = _process_registry()
        self._violations = ViolationTotals()
        # The view last written and its text; the lock makes concurrent scrapes of a new
        # view wait for one render instead of each writing its own.
        self._lock = threading.Lock()
        self._written: tuple[Published, list[bytes | str]] | None = None

    def render(self) -> bytes:
        """One scrape, in the text exposition format (``CONTENT_TYPE``)."""
        return b"".join(self.chunks())

    def chunks(self) -> list[bytes]:
        """One scrape as pieces to send one after the other, most of them shared with every
        other scrape of the same published view (the HTTP server sends them as they are)."""
        published = self._source()  # one read: the views below belong together
        with self._lock:
            if self._written is None or self._written[0] is not published:
                self._written = (published, self._write(published))
            written = self._written[1]
        ages = _Text()
        for engine in published.engines:
            if engine.stats is not None:
                self._ages(engine.name, engine.stats, ages)
        return [c if isinstance(c, bytes) else ages.family(c) for c in written] + [generate_latest(self._process)]

    def _write(self, published: Published) -> list[bytes | str]:
        text = _Text()
        text.add("wsd_build_info", self._build, 1)
        if published.counters is not None:
            self._counters(published.counters, text)
        for engine in published.engines:
            self._core(engine.name, engine.core, text)
            if engine.stats is not None:
                self._stats(engine.name, engine.stats, text)
            self._completeness(engine, text)
        return text.chunks(apart=_PER_SCRAPE)

    @staticmethod
    def _counters(view: Counters, text: _Text) -> None:
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
        refused = dict.fromkeys(REFUSAL_REASONS, 0)
        refused.update(view.refused)
        for reason, count in refused.items():
            text.add("wsd_agent_refusals_total", (reason,), count)
        logged = {str(kind): 0 for kind in EventKind} | dict(view.events)  # every kind from the start
        for kind, count in sorted(logged.items()):
            text.add("wsd_events_total", (kind,), count)

    @staticmethod
    def _core(engine: str, view: CoreView, text: _Text) -> None:
        for row in view.ranks:
            labels = (engine, row.rank, "" if row.tp_group is None else row.tp_group)
            text.add("wsd_rank_up", labels, row.up)
            if row.registered is not None:
                text.add("wsd_rank_info", (*labels, *row.registered), 1)
            if row.up:
                text.add("wsd_rank_stalled", labels, row.stalled)
                for peer in row.waits_for:
                    text.add("wsd_rank_waits_for", (*labels, peer), 1)
            if row.locked is not None:
                text.add("wsd_rank_locked", labels, row.locked)
            if row.num_ubatches is not None:
                text.add("wsd_rank_ubatches", labels, row.num_ubatches)
            if row.step is not None:
                text.add("wsd_rank_last_step", labels, row.step)
        for state, count in view.states:
            text.add("wsd_ranks", (engine, state), count)
        for group, consistent in view.consistent:
            text.add("wsd_group_consistent", (engine, group), consistent)
        for group, drifting in view.drift:
            text.add("wsd_group_drift", (engine, group), drifting)
        text.add("wsd_command_seq", (engine,), view.seq)

    def _stats(self, engine: str, view: StatsView, text: _Text) -> None:
        for rank in view.ranks:
            labels = (engine, rank.rank, rank.tp_group)
            text.add("wsd_rank_workspace_bytes", labels, rank.total_bytes)
            text.add("wsd_rank_stats_stale", labels, rank.stale)
            text.add("wsd_rank_lock_violations_total", labels,
                     self._violations.total((engine, rank.rank), rank.columns))
            if self.slots:
                self._slots(engine, rank, text)
        for group in view.groups:
            text.add("wsd_group_workspace_bytes", (engine, group.tp_group), group.total_bytes)
            text.add("wsd_group_skew_bytes", (engine, group.tp_group), group.skew_bytes)

    def _ages(self, engine: str, view: StatsView, text: _Text) -> None:
        """The ``_PER_SCRAPE`` families: each rank's age at this scrape, and the engine's oldest."""
        since = max(0.0, self._wall() - view.time)  # the ages were measured when the view was made
        oldest = 0.0
        for rank in view.ranks:
            age = rank.age + since
            oldest = max(oldest, age)
            text.add("wsd_rank_stats_age_seconds", (engine, rank.rank, rank.tp_group), age)
        text.add("wsd_stats_age_seconds", (engine,), oldest)

    @staticmethod
    def _slots(engine: str, rank: RankFigures, text: _Text) -> None:
        """The bulk of a scrape: one line per slot and number, written as plainly as can be."""
        head_labels = f'engine="{_escape(engine)}",rank="{rank.rank}",tp_group="{rank.tp_group}"'
        places = [f'{head_labels},ubatch="{u}",lane="{lane}"}} '
                  for u, lane in zip(rank.columns["ubatch"], rank.columns["lane"])]
        for number in SLOT_NUMBERS:
            head = number.metric + "{"
            values = rank.columns[number.name]
            if number.kind is not int:  # an int formats as itself; a float needs NaN and Inf spelled
                values = list(map(_number, values))
            text.lines[number.metric] += [f"{head}{place}{value}\n" for place, value in zip(places, values)]

    @staticmethod
    def _completeness(engine: EngineFigures, text: _Text) -> None:
        """How far an engine's per-slot figures are from every expected rank's current snapshot."""
        stats = engine.stats
        reported = set() if stats is None else {r.rank for r in stats.ranks}
        text.add("wsd_stats_absent_ranks", (engine.name,), sum(1 for r in engine.core.ranks if r.rank not in reported))
        text.add("wsd_stats_stale_ranks", (engine.name,),
                 0 if stats is None else sum(1 for r in stats.ranks if r.stale))
