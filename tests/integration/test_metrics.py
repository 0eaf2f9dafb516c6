"""The coordinator's Prometheus metrics (wsd.coordinator.metrics), in three tiers.

Collector: given published views, every family with its labels and values,
and a label set gone from the views gone from the scrape. Core: with a fake
clock, the coordinator's own stats round every ``metrics_refresh`` and the
counters behind the command families. Sockets and processes: a real
coordinator on port 0 with ``metrics_port = 0``, simulated ranks and real
worker processes (tests/mp.py), scraped over HTTP and parsed with
``prometheus_client``'s parser, the values matching ``wsctl stats --json``.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import pytest
from conftest import wait_until
from prometheus_client.parser import text_string_to_metric_families

from wsd import placement
from wsd.agent.simulated import SimulatedRanks
from wsd.commands import COMMANDS
from wsd.config import CoordinatorConfig, load_config
from wsd.coordinator.admission import REFUSAL_REASONS
from wsd.coordinator.core import CLIENT, CoordinatorCore
from wsd.coordinator.events import EventKind
from wsd.coordinator.loop import Coordinator
from wsd.coordinator.metrics import (
    COMMAND_BUCKETS,
    FAMILIES,
    RANK_STATES,
    SLOT_FAMILIES,
    Collector,
    CommandOutcome,
    CommandStats,
    CoreView,
    Counters,
    EngineFigures,
    Published,
    StatsView,
    ViolationTotals,
    core_view,
)
from wsd.coordinator.pushed import LatestStats
from wsd.coordinator.registry import Registry
from wsd.errors import ConfigError, WsdError
from wsd.slotstats import ManagerStats, SlotStats
from wsd.wire import protocol as p
from wsd.wire.protocol import NEVER_REGISTERED, Op
from wsd_client import wsctl
from wsd_client.client import Client

HEARTBEAT = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0}
Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


# -- helpers -------------------------------------------------------------------------------------


def parse(text: str) -> tuple[dict[str, str], Samples]:
    """({family name: type}, {sample name: {sorted labels: value}}) of an exposition text."""
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return types, samples


E = (("engine", "default"),)
"""The label set of a one-engine coordinator's per-engine families."""


def one_engine(core: CoreView, stats: StatsView | None = None, counters: Counters | None = None) -> Published:
    """What a coordinator of one engine, ``default``, publishes."""
    return Published(counters=counters or Counters(), engines=(EngineFigures("default", core, stats),))


def collect(published: Published, wall: float = 0.0) -> tuple[dict[str, str], Samples]:
    """What one scrape of a collector reading ``published`` shows, read back by prometheus_client's parser."""
    return parse(Collector(lambda: published, wall=lambda: wall).render().decode())


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200
        return parse(response.read().decode())[1]


def nonzero(series: dict[Any, float]) -> dict[Any, float]:
    """The samples of a series that counted something (every action is exported from 0)."""
    return {k: v for k, v in series.items() if v}


def by(samples: Samples, name: str, *keys: str) -> dict[Any, float]:
    """``name``'s samples keyed by the values of ``keys`` (one key: the bare value)."""
    out = {}
    for labels, value in samples.get(name, {}).items():
        d = dict(labels)
        key = tuple(d[k] for k in keys)
        out[key[0] if len(key) == 1 else key] = value
    return out


def manager(capacities: list[int], *, lanes: int = 1, locked: bool = False) -> ManagerStats:
    slots = tuple(SlotStats.of(i // lanes, i % lanes, capacity_bytes=c, peak_requested_bytes=c + 7,
                               requests=100 + i, resizes=i, lock_violations=i % 2) for i, c in enumerate(capacities))
    return ManagerStats(device="cpu", num_ubatches=len(capacities) // lanes, num_lanes=lanes, locked=locked,
                        slots=slots)


def stats_view(snapshots: dict[int, ManagerStats], tp_size: int, world_size: int, *, time: float = 0.0,
               pushed: float = 0.0) -> StatsView:
    """What the coordinator publishes of these ranks' snapshots, pushed at ``pushed``, copied at ``time``."""
    expected = {g: list(range(g * tp_size, (g + 1) * tp_size)) for g in range(world_size // tp_size)}
    latest = LatestStats()
    for rank, stats in snapshots.items():
        latest.push(rank, rank // tp_size, {"base": None, "stats": stats.to_wire(), "step": 5, "version": 1}, pushed)
    missing = {r: "lost" for ranks in expected.values() for r in ranks if r not in snapshots}
    return StatsView(time, *latest.figures(expected, missing, time, 3.0))


def registration(rank: int, *, world_size: int = 4, tp_size: int = 2, host: str = "node-a",
                 locked: bool = False, num_ubatches: int = 2, config: dict[str, Any] | None = None,
                 model: str | None = None) -> dict[str, Any]:
    return {"rank": rank, "world_size": world_size, "tp_size": tp_size, "tp_group": rank // tp_size,
            "host": host, "pid": 100 + rank, "device": "cpu", "applied_seq": None, "acks": [], "step": 3,
            "idle": True, "state": {"locked": locked, "num_ubatches": num_ubatches}, "config": config or {},
            "model": model}


# -- the collector ---------------------------------------------------------------------------------


def test_rank_info_says_where_a_rank_runs_as_vllm_kubernetes_and_dcgm_name_it():
    """model_name (vLLM's label), the rank's pod, namespace and node (downward API), and its
    GPU's UUID (DCGM's label): what joins wsd's series with theirs. A value an agent made up
    (not a string, unprintable, longer than any Kubernetes name) is left out, never shown."""
    registry = Registry(3, 1, 5.0, wall=lambda: 1000.0)
    uuid = "GPU-8f6a2a16-0c55-6d7e-1a2b-3c4d5e6f7a8b"
    registry.register(b"p0", registration(0, world_size=3, tp_size=1, model="meta-llama/Llama-3.1-8B", config={
        "rank_pod": "vllm-0", "rank_namespace": "serving", "rank_node": "gpu-node-7", "UUID": uuid,
        "engine": "vllm"}), 0.0)
    registry.register(b"p1", registration(1, world_size=3, tp_size=1, config={
        "rank_pod": 7, "rank_namespace": "bad\x1b[31m", "rank_node": "n" * 254, "UUID": None}), 0.0)
    registry.register(b"p2", registration(2, world_size=3, tp_size=1), 0.0)
    _, s = collect(one_engine(core_view(registry, seq=0, inconsistent=set())))
    labels = ("rank", "model_name", "rank_pod", "rank_namespace", "rank_node", "UUID")
    assert by(s, "wsd_rank_info", *labels) == {
        ("0", "meta-llama/Llama-3.1-8B", "vllm-0", "serving", "gpu-node-7", uuid): 1,
        ("1", "", "", "", "", ""): 1,
        ("2", "", "", "", "", ""): 1,
    }


def test_placement_from_the_downward_apis_variables():
    assert placement.from_env({"POD_NAME": "vllm-0", "POD_NAMESPACE": "serving", "NODE_NAME": "",
                               "HOSTNAME": "vllm-0"}) == {"rank_pod": "vllm-0", "rank_namespace": "serving"}
    assert placement.from_env({}) == {}


def test_families_follow_prometheus_naming():
    """The contract deploy/ is checked against: a counter without _total, a byte gauge without
    _bytes or a name with capitals would break dashboards written by convention."""
    for name, (kind, labels) in FAMILIES.items():
        assert re.fullmatch(r"wsd_[a-z_]+", name), name
        assert kind in ("gauge", "counter", "histogram"), name
        assert name.endswith("_total") == (kind == "counter"), name
        assert "bytes" not in name or name.endswith("_bytes"), name
        assert len(set(labels)) == len(labels) and "le" not in labels, name


def test_collector_exports_every_family_with_its_labels_and_values():
    """Per slot, per rank, per group and coordinator figures, from one published view each:
    without the collector reading both views, some family would be empty or mislabelled."""
    registry = Registry(4, 2, 5.0, wall=lambda: 1000.0)
    registry.register(b"p2", registration(2, host="node-b"), 0.0)
    for rank in (0, 1):
        registry.register(b"p%d" % rank, registration(rank, locked=rank == 0), 10.0)
    assert [i.rank for i in registry.expire(12.0)] == [2]  # rank 2 lost, rank 3 never registered
    registry.ranks[1].in_step_since = 11.0
    registry.ranks[1].stalled = True  # inside a step that rank 0, between steps, never joined
    commands = CommandStats()
    commands.record("lock", CommandOutcome.COMPLETE, 0.02)
    commands.record("lock", CommandOutcome.PARTIAL, 3.0)
    view = core_view(registry, seq=7, inconsistent={1})
    counts, latency = commands.snapshot()
    counters = Counters(heartbeats=41, commands=counts, latency=latency,
                        refused=(("rate", 12), ("registration forbidden", 3)))
    stats = stats_view({0: manager([4096, 8192]), 1: manager([4096, 0])}, tp_size=2, world_size=4, time=990.0,
                       pushed=988.0)
    types, s = collect(one_engine(view, stats, counters), wall=1000.0)

    for name, (kind, labels) in FAMILIES.items():
        family = name[: -len("_total")] if kind == "counter" else name
        assert types[family] == kind, name
        series = name + "_count" if kind == "histogram" else name
        assert series in s, f"{name} has no sample"
        for label_set in s[series]:
            assert {k for k, _ in label_set} == set(labels), (name, label_set)

    assert by(s, "wsd_slot_capacity_bytes", "rank", "ubatch") == {
        ("0", "0"): 4096, ("0", "1"): 8192, ("1", "0"): 4096, ("1", "1"): 0}
    assert by(s, "wsd_rank_stalled", "rank") == {"0": 0, "1": 1}  # the lost rank 2 has none
    assert by(s, "wsd_rank_waits_for", "rank", "peer") == {("1", "0"): 1}
    assert by(s, "wsd_ranks", "state")["stalled"] == 1
    assert by(s, "wsd_slot_peak_requested_bytes", "rank", "ubatch")[("0", "1")] == 8192 + 7
    assert by(s, "wsd_slot_requests_total", "rank", "ubatch")[("1", "1")] == 101
    assert by(s, "wsd_slot_resizes_total", "rank", "ubatch")[("1", "1")] == 1
    assert by(s, "wsd_slot_lock_violations_total", "rank", "ubatch") == {
        ("0", "0"): 0, ("0", "1"): 1, ("1", "0"): 0, ("1", "1"): 1}
    assert by(s, "wsd_rank_up", "rank", "tp_group") == {("0", "0"): 1, ("1", "0"): 1, ("2", "1"): 0, ("3", "1"): 0}
    # What a rank registered with is in its info series alone; rank 3 never registered: none.
    assert by(s, "wsd_rank_info", "rank", "host", "pid", "device") == {
        ("0", "node-a", "100", "cpu"): 1, ("1", "node-a", "101", "cpu"): 1, ("2", "node-b", "102", "cpu"): 1}
    assert by(s, "wsd_rank_locked", "rank") == {"0": 1, "1": 0, "2": 0}  # none known for rank 3
    assert by(s, "wsd_rank_ubatches", "rank") == {"0": 2, "1": 2, "2": 2}
    assert by(s, "wsd_rank_last_step", "rank") == {"0": 3, "1": 3, "2": 3}
    assert by(s, "wsd_rank_workspace_bytes", "rank") == {"0": 12288, "1": 4096}
    assert by(s, "wsd_rank_lock_violations_total", "rank") == {"0": 1, "1": 1}  # summed over the slots
    assert by(s, "wsd_group_workspace_bytes", "tp_group") == {"0": 16384}  # group 1: nobody reported
    assert by(s, "wsd_group_skew_bytes", "tp_group") == {"0": 8192}
    assert by(s, "wsd_group_consistent", "tp_group") == {"0": 1, "1": 0}
    assert by(s, "wsd_ranks", "state") == {"live": 1, "stalled": 1, "lost": 1, "stopped": 0, "missing": 1}
    # Ranks 2 (lost) and 3 (never registered) have no snapshot in the figures; none is stale.
    assert s["wsd_stats_absent_ranks"] == {E: 2} and s["wsd_stats_stale_ranks"] == {E: 0}
    assert by(s, "wsd_events_total", "kind") == {str(kind): 0 for kind in EventKind}  # none given: all at 0
    assert nonzero(by(s, "wsd_commands_total", "action", "result")) == {("lock", "complete"): 1, ("lock", "partial"): 1}
    # every reason from the start, at 0 until refused (a first refusal is then an increase)
    assert by(s, "wsd_agent_refusals_total", "reason") == {**dict.fromkeys(REFUSAL_REASONS, 0),
                                                           "registration forbidden": 3, "rate": 12}
    assert nonzero(by(s, "wsd_command_duration_seconds_count", "action")) == {"lock": 2}
    assert nonzero(by(s, "wsd_command_duration_seconds_sum", "action")) == {"lock": pytest.approx(3.02)}
    assert s["wsd_heartbeats_total"] == {(): 41} and s["wsd_command_seq"] == {E: 7}
    assert s["wsd_stats_age_seconds"] == {E: 12.0}  # pushed 2 s before the copy, 10 s before the scrape
    assert by(s, "wsd_rank_stats_age_seconds", "rank") == {"0": 12.0, "1": 12.0}
    assert by(s, "wsd_rank_stats_stale", "rank") == {"0": 0, "1": 0}  # as the copy found them


def test_labels_gone_from_the_published_views_are_gone_from_the_next_scrape():
    """Built fresh per scrape: a slot set_ubatches removed and a rank that stopped reporting
    leave no series behind (a registry of long-lived metric objects would keep them)."""
    registry = Registry(4, 2, 5.0)
    for rank in range(4):
        registry.register(b"p%d" % rank, registration(rank), 0.0)
    views = [one_engine(core=core_view(registry, seq=0, inconsistent=set()),
                       stats=stats_view({r: manager([64, 64]) for r in range(4)}, 2, 4))]
    smaller = stats_view({0: manager([64]), 1: manager([64])}, 2, 4)
    views.append(one_engine(core=views[0].engines[0].core, stats=smaller))
    current = iter(views)
    published = next(current)
    collector = Collector(lambda: published)
    first = parse(collector.render().decode())[1]
    assert len(first["wsd_slot_capacity_bytes"]) == 8 and len(first["wsd_rank_workspace_bytes"]) == 4
    published = next(current)
    second = parse(collector.render().decode())[1]
    for name in ("wsd_slot_capacity_bytes", "wsd_slot_peak_requested_bytes", "wsd_slot_requests_total",
                 "wsd_slot_resizes_total", "wsd_slot_lock_violations_total"):
        assert set(by(second, name, "rank", "ubatch")) == {("0", "0"), ("1", "0")}, name
    assert set(by(second, "wsd_rank_workspace_bytes", "rank")) == {"0", "1"}
    assert set(by(second, "wsd_group_workspace_bytes", "tp_group")) == {"0"}


def test_rank_lock_violations_never_go_down_when_slots_are_dropped_or_start_again():
    """Summed over the current slots, the rank's counter fell from 40 to 10 when set_ubatches
    dropped a slot, and Prometheus read the drop as a reset: increase() then counted the
    10 left as new violations (WsdLockViolations fired with none). The slots gone keep
    their last count; a slot counting again from 0 (set back up, or a new process) adds on."""
    registry = Registry(2, 2, 5.0)
    core = core_view(registry, seq=0, inconsistent=set())

    def ranks(*slots: list[int]) -> StatsView:
        snapshots = {}
        for rank, violations in enumerate(slots):
            snapshots[rank] = ManagerStats(device="cpu", num_ubatches=len(violations), num_lanes=1, locked=True,
                                           slots=tuple(SlotStats.of(u, capacity_bytes=64, peak_requested_bytes=64,
                                                                    requests=1, lock_violations=v)
                                                       for u, v in enumerate(violations)))
        return stats_view(snapshots, 2, 2)

    published = one_engine(core=core, stats=ranks([30, 10], [1]))
    collector = Collector(lambda: published)

    def totals() -> dict[Any, float]:
        return by(parse(collector.render().decode())[1], "wsd_rank_lock_violations_total", "rank")

    assert totals() == {"0": 40, "1": 1}
    published = one_engine(core=core, stats=ranks([30], [1]))  # set_ubatches 1: slot 1 and its 10 gone
    assert totals() == {"0": 40, "1": 1}
    published = one_engine(core=core, stats=ranks([32], [1]))  # two new ones
    assert totals() == {"0": 42, "1": 1}
    published = one_engine(core=core, stats=ranks([32, 0], [1]))  # set_ubatches 2: slot 1 from 0
    assert totals() == {"0": 42, "1": 1}
    published = one_engine(core=core, stats=ranks([32, 3], [0]))  # rank 1 a new process: from 0
    assert totals() == {"0": 45, "1": 1}
    published = one_engine(core=core, stats=ranks([5, 3], [2]))  # rank 0's slot 0 a new life at 5
    assert totals() == {"0": 50, "1": 3}


def test_violation_totals_keep_what_each_slot_counted():
    """The bookkeeping alone: a slot gone keeps its count, a lower count is a new life."""
    totals = ViolationTotals()

    def columns(counts: dict[tuple[int, int], int]) -> dict[str, list[int]]:
        return {"ubatch": [u for u, _ in counts], "lane": [lane for _, lane in counts],
                "lock_violations": list(counts.values())}

    assert totals.total(0, columns({(0, 0): 4, (0, 1): 6, (1, 0): 1})) == 11
    assert totals.total(0, columns({(0, 0): 4, (0, 1): 6, (1, 0): 1})) == 11  # the same view again
    assert totals.total(0, columns({(0, 0): 4, (0, 1): 6})) == 11  # slot (1, 0) gone
    assert totals.total(0, columns({(0, 0): 4, (0, 1): 2})) == 13  # (0, 1) from 0, at 2 already: 1 + 6 + 4 + 2
    assert totals.total(1, columns({(0, 0): 9})) == 9  # ranks apart
    assert totals.total(0, columns({})) == 13


def test_concurrent_scrapes_of_one_view_share_one_render_and_the_ages_still_grow():
    """The text is written once per published view (two Prometheus servers, or overlapping
    scrapes, each wrote their own 14 MB before); the ages are the scrape's own."""
    registry = Registry(2, 2, 5.0)
    published = one_engine(core=core_view(registry, seq=0, inconsistent=set()),
                          stats=stats_view({0: manager([64, 64]), 1: manager([64])}, 2, 2, time=100.0, pushed=99.0))
    wall = [100.0]
    collector = Collector(lambda: published, wall=lambda: wall[0])
    writes = []
    write = collector._write
    collector._write = lambda view: writes.append(view) or write(view)  # type: ignore[method-assign]
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda _: collector.render(), range(16)))
    assert len(writes) == 1 and len({t[:t.index(b"# HELP process_")] for t in texts}) == 1  # process_*: live
    wall[0] = 110.0
    _, s = parse(collector.render().decode())
    assert len(writes) == 1
    assert s["wsd_stats_age_seconds"] == {E: 11.0} and by(s, "wsd_rank_stats_age_seconds", "rank") == {
        "0": 11.0, "1": 11.0}
    published = one_engine(published.engines[0].core, stats_view({0: manager([64])}, 2, 2, time=110.0, pushed=110.0))
    _, s = parse(collector.render().decode())
    assert len(writes) == 2 and s["wsd_stats_absent_ranks"] == {E: 1}


def test_rank_states_are_the_registrys_own_counts():
    """wsd_ranks shows what status shows: the registry's counts, missing for NEVER_REGISTERED."""
    assert tuple(Registry(3, 1, 5.0).counts()) == RANK_STATES
    assert Registry(3, 1, 5.0).missing() == dict.fromkeys(range(3), NEVER_REGISTERED)


def test_nothing_published_yet_gives_empty_families_not_an_error():
    """A scrape before the first tick must answer (Prometheus marks a failing target down):
    every family declared, none with a sample but the build's."""
    types, samples = collect(Published())
    assert set(FAMILIES) <= {f + "_total" if t == "counter" else f for f, t in types.items()}
    assert [name for name in samples if name.startswith("wsd_")] == ["wsd_build_info"]


def rank_series(samples: Samples) -> dict[str, set[tuple[tuple[str, str], ...]]]:
    """{family: its label sets} of the per-rank families (those labelled rank, not ubatch)."""
    return {name: set(series) for name, series in samples.items()
            if name.startswith("wsd_rank_") and name != "wsd_rank_info"}


def test_a_registration_renames_no_series_its_host_is_in_rank_info_alone():
    """Series churn: with host among a rank's labels, registering (or coming back from
    another host) ended every series of the rank and started new ones. Now each rank keeps
    {rank, tp_group} from the start, and only wsd_rank_info says where it runs."""
    registry = Registry(2, 2, 5.0)

    def scrape_of() -> Samples:
        return collect(one_engine(core=core_view(registry, seq=0, inconsistent=set())))[1]

    before = scrape_of()
    assert by(before, "wsd_rank_up", "rank", "tp_group") == {("0", "0"): 0, ("1", "0"): 0}
    assert "wsd_rank_info" not in before
    registry.register(b"p0", registration(0, world_size=2, host="node-a"), 0.0)
    registry.register(b"p1", registration(1, world_size=2, host="node-a"), 0.0)
    first = scrape_of()
    registry.register(b"p0b", registration(0, world_size=2, host="node-b"), 10.0)  # back, elsewhere
    second = scrape_of()
    assert set(before["wsd_rank_up"]) == set(first["wsd_rank_up"]) == set(second["wsd_rank_up"])
    assert rank_series(first) == rank_series(second)
    assert by(first, "wsd_rank_info", "rank", "host") == {("0", "node-a"): 1, ("1", "node-a"): 1}
    assert by(second, "wsd_rank_info", "rank", "host") == {("0", "node-b"): 1, ("1", "node-a"): 1}


def test_every_state_is_missing_not_never_registered_and_there_from_the_start():
    """One name per rank state: a rank that never registered is `missing` in `ranks`, `wsctl
    status` and wsd_ranks alike; every state has its sample before any rank registers."""
    _, s = collect(one_engine(core=core_view(Registry(3, 1, 5.0), seq=0, inconsistent=set())))
    assert by(s, "wsd_ranks", "state") == {"live": 0, "stalled": 0, "lost": 0, "stopped": 0, "missing": 3}
    assert s["wsd_stats_absent_ranks"] == {E: 3}  # nothing copied yet: every expected rank


def test_slots_off_drops_the_per_slot_series_and_keeps_every_other():
    """metrics_slots = false: no wsd_slot_* sample, and every per-rank and per-group series
    (lock violations per rank included, which the alert reads) as with it on."""
    registry = Registry(4, 2, 5.0)
    for rank in range(4):
        registry.register(b"p%d" % rank, registration(rank), 0.0)
    published = one_engine(core=core_view(registry, seq=0, inconsistent=set()),
                          stats=stats_view({r: manager([64, 128]) for r in range(4)}, 2, 4))
    on = Collector(lambda: published, wall=lambda: 0.0).render().decode()
    off_text = Collector(lambda: published, wall=lambda: 0.0, slots=False).render().decode()
    _, with_slots = parse(on)
    _, without = parse(off_text)
    assert len(with_slots["wsd_slot_capacity_bytes"]) == 8
    dropped = {name for name in with_slots if name not in without}
    assert dropped == SLOT_FAMILIES
    for name, series in without.items():
        if not name.startswith("process_"):  # CPU time and the like move between two scrapes
            assert series == with_slots[name], name
    assert by(without, "wsd_rank_lock_violations_total", "rank") == {"0": 1, "1": 1, "2": 1, "3": 1}


def test_a_scrape_before_the_first_tick_has_every_family(tmp_path):
    """The endpoint serves as soon as it is bound; what it serves is published as the core
    is made, not at its first tick (which left a first scrape with no wsd family at all)."""
    clock = Clock(100.0)
    core = CoordinatorCore(CoordinatorConfig(state_file=str(tmp_path / "state"), world_size=2, tp_size=2,
                                             metrics_port=0), clock=clock, wall=clock)
    _, samples = collect(core.published, wall=clock.now)
    assert {"wsd_rank_up", "wsd_events_total", "wsd_stats_absent_ranks", "wsd_build_info"} <= set(samples)
    assert by(samples, "wsd_rank_up", "rank") == {"0": 0, "1": 0}


def test_events_are_counted_by_kind_every_kind_from_the_start(tmp_path):
    """wsd_events_total: every kind at 0 from the first scrape, so that increase() sees the
    first lock violation; then the coordinator's own log, kind by kind."""
    core, clock = make_core(tmp_path, metrics_port=0)
    core.tick()
    _, s = collect(core.published, wall=clock.now)
    counted = by(s, "wsd_events_total", "kind")
    assert set(counted) == {str(kind) for kind in EventKind}
    assert nonzero(counted) == {"started": 1, "joined": 2}
    core.handle_agent((b"p1",), p.encode(Op.EVENT, {"rank": 1, "kind": "lock_violation", "detail": {
        "slot": 1, "caller": "moe.py:12:forward", "requested_bytes": 2048, "capacity_bytes": 1024}}))
    clock.now += 1.0
    core.tick()
    _, s = collect(core.published, wall=clock.now)
    assert nonzero(by(s, "wsd_events_total", "kind")) == {"started": 1, "joined": 2, "lock_violation": 1}
    assert nonzero(by(s, "wsd_events_total", "kind")) == {
        kind: sum(1 for e in core.events.since(0, 100)[0] if e["kind"] == kind) for kind in ("started", "joined",
                                                                                          "lock_violation")}


def test_command_latency_histogram_is_cumulative_per_action():
    """Prometheus needs cumulative buckets ending in +Inf with the count: histogram_quantile
    over per-bucket counts would give nonsense."""
    commands = CommandStats()
    for seconds in (0.003, 0.02, 7.0, 100.0):
        commands.record("trim", CommandOutcome.FAILED, seconds)
    registry = Registry(2, 2, 5.0)
    view = core_view(registry, seq=4, inconsistent=set())
    counts, latency = commands.snapshot()
    _, s = collect(one_engine(view, counters=Counters(commands=counts, latency=latency)))
    buckets = {le: v for (action, le), v in by(s, "wsd_command_duration_seconds_bucket", "action", "le").items()
               if action == "trim"}
    assert len(buckets) == len(COMMAND_BUCKETS) + 1
    assert (buckets["0.005"], buckets["0.025"], buckets["5.0"], buckets["10.0"], buckets["60.0"],
            buckets["+Inf"]) == (1, 2, 2, 3, 3, 4)
    assert by(s, "wsd_command_duration_seconds_sum", "action")["trim"] == pytest.approx(107.023)
    assert nonzero(by(s, "wsd_commands_total", "action", "result")) == {("trim", "failed"): 4}


# -- the core, with a fake clock -------------------------------------------------------------------


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_core(tmp_path, **options: Any) -> tuple[CoordinatorCore, Clock]:
    clock = Clock(100.0)
    config = CoordinatorConfig(state_file=str(tmp_path / "state"), world_size=2, tp_size=2,
                               heartbeat_interval=1.0, heartbeat_timeout=5.0, stats_timeout=2.0, **options)
    core = CoordinatorCore(config, clock=clock, wall=clock)
    for rank in (0, 1):
        core.handle_agent((b"p%d" % rank,), p.encode(Op.REGISTER, registration(rank, world_size=2)))
    return core, clock


def stats_requests(out) -> dict[bytes, int]:
    """{peer: request id} of the stats requests among ``out``; fails on any client frame."""
    assert not [o for o in out if o[0] == CLIENT], "the metrics' round answered a client"
    found = {}
    for _kind, route, frame in out:
        message = p.decode(frame, frozenset({Op.STATS_REQUEST, Op.PULSE, Op.COMMAND, Op.REGISTERED}))
        if message.op is Op.STATS_REQUEST:
            found[route[0]] = message.body["request"]
    return found


def push(core: CoordinatorCore, peer: bytes, version: int, capacities: list[int], *, step: int = 9) -> list:
    """Rank ``peer``'s whole snapshot, as its agent pushes it; returns the core's answer."""
    return core.handle_agent((peer,), p.encode(Op.STATS_PUSH, {
        "rank": int(peer[1:]), "version": version, "base": None, "step": step, "applied_seq": 0,
        "held_seq": 0, "state": {}, "stats": manager(capacities).to_wire()}))


def test_metrics_copy_the_pushed_snapshots_every_metrics_refresh_and_never_ask_a_rank(tmp_path):
    """The per-slot figures are the ranks' pushed snapshots, copied every metrics_refresh:
    without the copy wsd_slot_* would be empty or never move; with a round, a scrape
    would cost every rank a reply."""
    core, clock = make_core(tmp_path, metrics_port=0, metrics_refresh=3.0)
    push(core, b"p0", 1, [256, 512])
    push(core, b"p1", 1, [256, 0])
    assert stats_requests(core.tick()) == {}  # the copy is due at once: no rank asked
    _, s = collect(core.published, wall=clock.now + 1.5)
    assert by(s, "wsd_slot_capacity_bytes", "rank", "ubatch")[("0", "1")] == 512
    assert by(s, "wsd_rank_stats_age_seconds", "rank") == {"0": 1.5, "1": 1.5}
    assert s["wsd_stats_age_seconds"] == {E: 1.5}
    assert by(s, "wsd_rank_up", "rank") == {"0": 1, "1": 1}  # the core view published with it
    push(core, b"p0", 2, [1024])
    clock.now += 2.9
    assert stats_requests(core.tick()) == {}
    _, s = collect(core.published, wall=clock.now)
    assert by(s, "wsd_slot_capacity_bytes", "rank", "ubatch")[("0", "1")] == 512  # not copied yet
    assert core.next_deadline() <= 103.0
    clock.now += 0.1
    assert stats_requests(core.tick()) == {}
    _, s = collect(core.published, wall=clock.now)
    assert by(s, "wsd_slot_capacity_bytes", "rank", "ubatch") == {("0", "0"): 1024, ("1", "0"): 256, ("1", "1"): 0}


def test_a_rank_that_stops_pushing_turns_stale_then_lost(tmp_path):
    """Stale after stats_stale_after (three intervals by default): still shown, marked, the
    answer incomplete; lost after the heartbeat timeout: gone from the figures, rank_up 0."""
    core, clock = make_core(tmp_path, metrics_port=0, metrics_refresh=0.5)
    push(core, b"p0", 1, [64])
    core.tick()
    _, s = collect(core.published, wall=clock.now)
    assert s["wsd_stats_absent_ranks"] == {E: 1} and s["wsd_stats_stale_ranks"] == {E: 0}  # p1: nothing yet
    push(core, b"p1", 1, [64])
    for _ in range(7):  # rank 0 keeps confirming its snapshot; rank 1 falls silent
        clock.now += 0.5
        core.handle_agent((b"p0",), p.encode(Op.HEARTBEAT, {
            "rank": 0, "step": 9, "applied_seq": 0, "held_seq": 0, "state": {}, "stats_version": 1}))
        core.tick()
    _, s = collect(core.published, wall=clock.now)
    assert by(s, "wsd_rank_stats_stale", "rank") == {"0": 0, "1": 1}
    assert by(s, "wsd_rank_stats_age_seconds", "rank") == {"0": 0.0, "1": 3.5}
    assert by(s, "wsd_rank_up", "rank") == {"0": 1, "1": 1}
    assert s["wsd_stats_absent_ranks"] == {E: 0} and s["wsd_stats_stale_ranks"] == {E: 1}
    clock.now += 1.6  # 5.1 s silent: past the heartbeat timeout
    core.tick()
    _, s = collect(core.published, wall=clock.now)
    assert set(by(s, "wsd_rank_workspace_bytes", "rank")) == {"0"}
    assert by(s, "wsd_rank_up", "rank") == {"0": 1, "1": 0}
    assert s["wsd_stats_absent_ranks"] == {E: 1} and s["wsd_stats_stale_ranks"] == {E: 0}


def test_core_without_a_metrics_port_runs_no_rounds_and_publishes_nothing(tmp_path):
    """Metrics off (the default) costs the coordinator nothing: no stats round, no copies."""
    core, clock = make_core(tmp_path)
    for _ in range(5):
        assert stats_requests(core.tick()) == {}
        clock.now += 10.0
    assert core.published == Published()


def test_core_counts_commands_by_outcome_with_their_latency_and_heartbeats(tmp_path):
    """complete (every rank acknowledged), failed (a rank could not apply), partial (the
    timeout with a rank pending); the latency from numbering to the result, on the core's clock."""
    core, clock = make_core(tmp_path, metrics_port=0)

    def command(op: Op, body: dict[str, Any], acks: dict[int, bool], after: float) -> None:
        core.handle_client((b"c", b""), p.encode(op, {"wait": True, **body}, 1))
        seq = core.engine().log.seq
        clock.now += after
        for rank, ok in acks.items():
            core.handle_agent((b"p%d" % rank,), p.encode(Op.ACK, {
                "rank": rank, "seq": seq, "step": 4, "ok": ok, "error": None if ok else "no"}))

    command(Op.LOCK, {}, {0: True, 1: True}, 0.25)
    command(Op.UNLOCK, {}, {0: True, 1: False}, 0.5)
    command(Op.LOCK, {}, {0: True}, 0.0)
    clock.now += core.config.command_timeout  # rank 1 never acknowledges
    for rank in (0, 1):
        core.handle_agent((b"p%d" % rank,), p.encode(Op.HEARTBEAT, {
            "rank": rank, "step": 8, "applied_seq": 3, "held_seq": 3, "state": {}}))
    core.tick()
    _, s = collect(core.published, wall=clock.now)
    assert nonzero(by(s, "wsd_commands_total", "action", "result")) == {
        ("lock", "complete"): 1, ("unlock", "failed"): 1, ("lock", "partial"): 1}
    assert nonzero(by(s, "wsd_command_duration_seconds_sum", "action")) == {
        "lock": pytest.approx(0.25 + core.config.command_timeout), "unlock": pytest.approx(0.5)}
    assert s["wsd_command_seq"] == {E: 3} and s["wsd_heartbeats_total"] == {(): 2}
    assert by(s, "wsd_rank_last_step", "rank") == {"0": 8, "1": 8}


@pytest.mark.parametrize("key, value, message", [
    ("metrics_port", "70000", "metrics_port must be between 0 and 65535"),
    ("metrics_port", "http", "metrics_port must be an integer"),
    ("metrics_refresh", "0", "metrics_refresh must be a number of seconds"),
])
def test_bad_metrics_configuration_names_the_key(key, value, message):
    with pytest.raises(ConfigError, match=f"WSD_COORDINATOR_{key.upper()}.*{message}"):
        load_config(env={f"WSD_COORDINATOR_{key.upper()}": value})


def test_metrics_are_off_unless_a_port_is_set():
    config = load_config(env={})
    assert config.coordinator.metrics_port is None and config.coordinator.metrics_host == "127.0.0.1"
    assert load_config(env={"WSD_COORDINATOR_METRICS_PORT": "0"}).coordinator.metrics_port == 0


# -- a real coordinator over HTTP ------------------------------------------------------------------


def wsctl_stats(endpoint: str, capsys) -> dict[str, Any]:
    code = wsctl.main(["stats", "--json", "--endpoint", endpoint])
    assert code in (wsctl.Exit.OK, wsctl.Exit.PARTIAL), capsys.readouterr()
    return json.loads(capsys.readouterr().out)


def matches_wsctl(url: str, endpoint: str, capsys) -> tuple[Samples, dict[str, Any]]:
    """The scrape and `wsctl stats --json` agree on capacity and peak per slot, ranks up,
    locked and ubatches; returns both (falsy while they differ, e.g. between two rounds)."""
    s, doc = scrape(url), wsctl_stats(endpoint, capsys)
    slots = {(str(r["rank"]), str(x["ubatch"]), str(x["lane"])): (x["capacity_bytes"], x["peak_requested_bytes"])
             for r in doc["ranks"] for x in r["slots"]}
    capacity = by(s, "wsd_slot_capacity_bytes", "rank", "ubatch", "lane")
    peak = by(s, "wsd_slot_peak_requested_bytes", "rank", "ubatch", "lane")
    same = (
        {k: (capacity[k], peak[k]) for k in capacity} == slots
        and {r for r, up in by(s, "wsd_rank_up", "rank").items() if up == 1} == {str(r["rank"]) for r in doc["ranks"]}
        and {r["rank"] for r in doc["missing"]} == {int(r) for r, up in by(s, "wsd_rank_up", "rank").items() if up == 0}
        and all(by(s, "wsd_rank_locked", "rank").get(str(r["rank"])) == float(r["locked"]) for r in doc["ranks"])
        and all(by(s, "wsd_rank_ubatches", "rank").get(str(r["rank"])) == r["num_ubatches"] for r in doc["ranks"])
    )
    return (s, doc) if same else None  # type: ignore[return-value]


def test_scrape_of_a_running_cluster_matches_wsctl_stats(start_coordinator, capsys):
    """Simulated ranks over real sockets, scraped over HTTP: the exported figures are the
    stats clients see; set_ubatches removes slots from the next scrapes; a command bumps
    commands_total and the histogram; a lost rank reads 0 and its slots are gone."""
    coordinator = start_coordinator(world_size=6, tp_size=2, metrics_port=0, metrics_refresh=0.2, **HEARTBEAT)
    url, endpoint = coordinator.metrics_url, coordinator.client_endpoint
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url) and not url.endswith(":0/metrics")
    options = dict(world_size=6, tp_size=2, num_ubatches=2, slot_bytes=1 << 20, **HEARTBEAT)
    # Stopped exactly once: a second stop() of SimulatedRanks writes to wake-up descriptors
    # it has already closed, which another socket may have reused since.
    leaving = SimulatedRanks(coordinator.agent_endpoint, [4], **options).start()
    left = False
    try:
        with SimulatedRanks(coordinator.agent_endpoint, range(4), **options) as ranks, \
                Client(endpoint, timeout=5) as client:
            assert ranks.wait_registered(10) and leaving.wait_registered(10)
            s, doc = wait_until(lambda: (m := matches_wsctl(url, endpoint, capsys)) and len(m[1]["ranks"]) == 5
                                and m, 10, "the scrape to match wsctl stats")
            assert {m["rank"] for m in doc["missing"]} == {5}
            assert len(s["wsd_slot_capacity_bytes"]) == 10
            assert set(by(s, "wsd_slot_capacity_bytes", "ubatch")) == {"0", "1"}
            # Every action and outcome is there from the start, at 0: increase() sees the first one.
            assert nonzero(by(s, "wsd_commands_total", "action", "result")) == {}
            assert len(s["wsd_commands_total"]) == len(COMMANDS) * len(CommandOutcome)
            assert set(by(s, "wsd_command_duration_seconds_count", "action")) == set(COMMANDS)

            result = client.set_ubatches(1)  # partial: rank 5 never registered
            assert not result.complete and not result.failed and len(result.acked) == 5
            s, doc = wait_until(lambda: (m := matches_wsctl(url, endpoint, capsys))
                                and set(by(m[0], "wsd_slot_capacity_bytes", "ubatch")) == {"0"} and m, 10,
                                "slot 1 gone from the scrape")
            assert set(by(s, "wsd_rank_ubatches", "rank").values()) == {1}
            assert nonzero(by(s, "wsd_commands_total", "action", "result")) == {("set_ubatches", "partial"): 1}
            assert nonzero(by(s, "wsd_command_duration_seconds_count", "action")) == {"set_ubatches": 1}
            assert s["wsd_command_seq"] == {E: 1}
            assert s["wsd_stats_age_seconds"][E] < 5

            leaving.stop()
            left = True
            s, _ = wait_until(lambda: (m := matches_wsctl(url, endpoint, capsys))
                              and by(m[0], "wsd_rank_up", "rank")["4"] == 0 and m, 10, "rank 4 lost in the scrape")
            assert "4" not in by(s, "wsd_slot_capacity_bytes", "rank")
            assert by(s, "wsd_ranks", "state") == {"live": 4, "stalled": 0, "lost": 1, "stopped": 0, "missing": 1}
            assert s["wsd_heartbeats_total"][()] > 0
    finally:
        if not left:
            leaving.stop()


def test_a_real_agent_in_a_pod_is_scraped_with_its_pod_namespace_node_and_model(start_coordinator, monkeypatch):
    """The downward API's variables, as deploy/kubernetes sets them, reach wsd_rank_info over
    a real registration and a real HTTP scrape, with the model the engine serves."""
    import torch  # the agent side

    from wsd import WorkspaceManager
    from wsd.agent.thread import Agent

    monkeypatch.setenv("POD_NAME", "vllm-llama-0")
    monkeypatch.setenv("POD_NAMESPACE", "serving")
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    coordinator = start_coordinator(world_size=1, metrics_port=0, metrics_refresh=0.2, **HEARTBEAT)
    agent = Agent(WorkspaceManager(torch.device("cpu"), 1), endpoint=coordinator.agent_endpoint, rank=0,
                  world_size=1, model="meta-llama/Llama-3.1-8B", **HEARTBEAT).start()
    try:
        assert agent.wait_registered(10)
        info = wait_until(lambda: by(scrape(coordinator.metrics_url), "wsd_rank_info", "rank", "model_name",
                                     "rank_pod", "rank_namespace", "rank_node", "UUID"), 10, "rank 0's info")
        assert info == {("0", "meta-llama/Llama-3.1-8B", "vllm-llama-0", "serving", "gpu-node-7", ""): 1}
    finally:
        agent.stop()


def test_every_expected_rank_is_down_from_the_first_scrape_with_world_size_alone(start_coordinator):
    """The local recipe and plain `wsd up` set world_size and no tp_size: a job whose workers
    never start must still show 4 ranks down (it showed none, so no alert fired). Once ranks
    register (and tell the TP size), each keeps its one wsd_rank_up series, and the ranks
    still missing get their TP group."""
    coordinator = start_coordinator(world_size=4, metrics_port=0, metrics_refresh=0.2, **HEARTBEAT)
    first = scrape(coordinator.metrics_url)
    assert by(first, "wsd_rank_up", "rank") == {"0": 0, "1": 0, "2": 0, "3": 0}
    # The TP group is not known yet: empty, which Prometheus reads as no label.
    assert {dict(labels)["tp_group"] for labels in first["wsd_rank_up"]} == {""}
    assert by(first, "wsd_ranks", "state") == {"live": 0, "stalled": 0, "lost": 0, "stopped": 0, "missing": 4}
    assert first["wsd_stats_absent_ranks"] == {E: 4}
    with SimulatedRanks(coordinator.agent_endpoint, [0, 1], world_size=4, tp_size=2, num_ubatches=2,
                        **HEARTBEAT) as ranks:
        assert ranks.wait_registered(10)
        s = wait_until(lambda: (m := scrape(coordinator.metrics_url)) and m["wsd_stats_absent_ranks"] == {E: 2}
                       and m, 10, "ranks 0 and 1 in the scrape")
        assert by(s, "wsd_rank_up", "rank", "tp_group") == {("0", "0"): 1, ("1", "0"): 1, ("2", "1"): 0, ("3", "1"): 0}
        assert by(s, "wsd_ranks", "state") == {"live": 2, "stalled": 0, "lost": 0, "stopped": 0, "missing": 2}


def test_metrics_endpoint_starts_and_stops_with_the_coordinator(tmp_path, start_coordinator):
    """Bounded stop that frees the port; a port in use fails the start naming the key."""
    coordinator = start_coordinator(metrics_port=0)
    assert coordinator.metrics.port > 0
    scrape(coordinator.metrics_url)  # answers (200) with no rank registered
    started = time.monotonic()
    coordinator.stop(timeout=5)
    assert time.monotonic() - started < 2
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(coordinator.metrics_url, timeout=2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = CoordinatorConfig(agent_endpoint="tcp://127.0.0.1:0", client_endpoint="tcp://127.0.0.1:0",
                                   state_file=str(tmp_path / "s2"), metrics_port=taken.getsockname()[1])
        with pytest.raises(WsdError, match=r"cannot serve metrics on 127\.0\.0\.1:\d+ .*metrics_port"):
            Coordinator(config)


def test_a_metrics_host_reachable_from_other_hosts_is_warned_about(start_coordinator, caplog):
    caplog.set_level(logging.WARNING, logger="wsd.coordinator.loop")
    coordinator = start_coordinator(metrics_port=0, metrics_host="0.0.0.0")
    assert coordinator.metrics_url.startswith("http://0.0.0.0:")
    assert any("metrics endpoint" in r.message and "other hosts" in r.message for r in caplog.records)
    scrape(f"http://127.0.0.1:{coordinator.metrics.port}/metrics")  # answers (200)


# -- real worker processes ------------------------------------------------------------------------


def _worker(me, endpoint: str, sizes: list[int]) -> None:
    """A real manager warmed up on two slots, locked, behind an idle agent; on ``overflow``,
    one request too large for the locked slot 1 (a lock violation)."""
    import torch

    from wsd import WorkspaceManager, use_ubatch
    from wsd.agent.thread import Agent

    manager = WorkspaceManager("cpu", 2)
    for ubatch, size in enumerate(sizes):
        with use_ubatch(ubatch):
            manager.get_simultaneous(((size,), torch.uint8))
    manager.lock()
    agent = Agent(manager, endpoint=endpoint, rank=me.rank, world_size=me.world_size, tp_size=2, idle=True,
                  heartbeat_interval=0.2, heartbeat_timeout=1.0).start()
    try:
        me.report("ready")
        while True:
            message = me.poll()
            if message == ("overflow",):
                with use_ubatch(1), pytest.raises(AssertionError):
                    manager.get_simultaneous(((sizes[1] * 4,), torch.uint8))
                me.report("overflow")
            elif message == ("stop",):
                break
            time.sleep(0.01)
    finally:
        agent.stop()


@pytest.mark.timeout(90)
def test_scrape_of_real_workers_matches_wsctl_stats(start_coordinator, tmp_path, capsys):
    """Two worker processes in a gloo world with real managers: their real capacities (256-byte
    aligned), peaks, lock state and a lock violation reach the scrape as wsctl shows them."""
    from mp import Workers

    coordinator = start_coordinator(world_size=2, tp_size=2, metrics_port=0, metrics_refresh=0.2, **HEARTBEAT)
    with Workers(tmp_path, 2, _worker, coordinator.agent_endpoint, [1000, 3000]) as workers:
        for rank in (0, 1):
            workers.expect(rank, "ready", 60)
        s, _ = wait_until(lambda: (m := matches_wsctl(coordinator.metrics_url, coordinator.client_endpoint, capsys))
                          and len(m[1]["ranks"]) == 2 and m, 20, "the scrape of both ranks to match wsctl stats")
        assert by(s, "wsd_slot_capacity_bytes", "rank", "ubatch") == {
            ("0", "0"): 1024, ("0", "1"): 3072, ("1", "0"): 1024, ("1", "1"): 3072}
        assert set(by(s, "wsd_rank_locked", "rank").values()) == {1}
        workers.ask(1, "overflow")
        s = wait_until(lambda: (m := scrape(coordinator.metrics_url))
                       and by(m, "wsd_slot_lock_violations_total", "rank", "ubatch").get(("1", "1")) == 1 and m,
                       10, "the lock violation in the scrape")
        assert by(s, "wsd_slot_peak_requested_bytes", "rank", "ubatch")[("1", "1")] == 12032  # 12000, aligned
        violations = {r["rank"]: [x["lock_violations"] for x in r["slots"]]
                      for r in wsctl_stats(coordinator.client_endpoint, capsys)["ranks"]}
        assert violations == {0: [0, 0], 1: [0, 1]}
        for rank in (0, 1):
            workers.send(rank, "stop")


def test_a_group_that_drifts_from_its_desired_state_says_so_in_status_and_metrics(tmp_path):
    """Consistent (the ranks agree with each other) is not enough: ranks that all report
    locked after a desired unlock (an engine locking by itself) drift from what was asked."""
    core, clock = make_core(tmp_path, metrics_port=0)
    core.handle_client((b"c", b""), p.encode(Op.UNLOCK, {"wait": False}, 1))

    def heartbeats(locked: bool, applied: int) -> None:
        for rank in (0, 1):
            core.handle_agent((b"p%d" % rank,), p.encode(Op.HEARTBEAT, {
                "rank": rank, "step": 9, "applied_seq": applied, "held_seq": 1,
                "state": {"locked": locked, "num_ubatches": 2}}))

    def status_group() -> dict[str, Any]:
        out = core.handle_client((b"c", b""), p.encode(Op.STATUS, {}, 2))
        return msgpack.unpackb(out[0][2])["result"]["groups"][0]

    heartbeats(locked=True, applied=0)  # the unlock not applied yet: no drift to speak of
    assert status_group()["drift"] == []
    heartbeats(locked=True, applied=1)
    group = status_group()
    assert group["consistent"] and group["drift"] == ["locked: desired False, ranks report True"]
    core.tick()
    _, s = collect(core.published, wall=clock.now)
    assert by(s, "wsd_group_drift", "tp_group") == {"0": 1}
    heartbeats(locked=False, applied=1)
    assert status_group()["drift"] == []
    clock.now += 1.0
    core.tick()
    _, s = collect(core.published, wall=clock.now)
    assert by(s, "wsd_group_drift", "tp_group") == {"0": 0}
