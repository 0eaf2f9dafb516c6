"""Every Prometheus family wsd exports, declared once: its type, its labels, its help.

The coordinator's endpoint (``wsd.coordinator.metrics``) exports all of them;
vLLM's own ``/metrics``, where wsd's plugin runs, the per-rank and per-slot
ones of its workers (``wsd.integrations.vllm.metrics``), under vLLM's labels.
``deploy/grafana`` and ``deploy/prometheus`` are checked against them
(``tests/integration/test_deploy.py``). A module of the shared floor: nothing of wsd's but
the slot schema and the placement labels, no third-party import.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from wsd import placement
from wsd.slotstats import SLOT_NUMBERS

__all__ = ["FAMILIES", "HELP", "SLOT_FAMILIES", "ViolationTotals"]

_SLOT = ("engine", "rank", "tp_group", "ubatch", "lane")
_RANK = ("engine", "rank", "tp_group")
_GROUP = ("engine", "tp_group")
_ENGINE = ("engine",)

FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    **{n.metric: ("counter" if n.counter else "gauge", _SLOT) for n in SLOT_NUMBERS},
    "wsd_rank_up": ("gauge", _RANK),
    "wsd_rank_info": ("gauge", (*_RANK, "host", "pid", "device", *placement.LABELS)),
    "wsd_rank_stalled": ("gauge", _RANK),
    "wsd_rank_waits_for": ("gauge", (*_RANK, "peer")),
    "wsd_rank_locked": ("gauge", _RANK),
    "wsd_rank_ubatches": ("gauge", _RANK),
    "wsd_rank_last_step": ("gauge", _RANK),
    "wsd_rank_workspace_bytes": ("gauge", _RANK),
    "wsd_rank_stats_age_seconds": ("gauge", _RANK),
    "wsd_rank_stats_stale": ("gauge", _RANK),
    "wsd_rank_lock_violations_total": ("counter", _RANK),
    "wsd_group_workspace_bytes": ("gauge", _GROUP),
    "wsd_group_skew_bytes": ("gauge", _GROUP),
    "wsd_group_consistent": ("gauge", _GROUP),
    "wsd_group_drift": ("gauge", _GROUP),
    "wsd_command_duration_seconds": ("histogram", ("action",)),
    "wsd_commands_total": ("counter", ("action", "result")),
    "wsd_ranks": ("gauge", ("engine", "state")),
    "wsd_heartbeats_total": ("counter", ()),
    "wsd_agent_refusals_total": ("counter", ("reason",)),
    "wsd_command_seq": ("gauge", _ENGINE),
    "wsd_stats_age_seconds": ("gauge", _ENGINE),
    "wsd_stats_absent_ranks": ("gauge", _ENGINE),
    "wsd_stats_stale_ranks": ("gauge", _ENGINE),
    "wsd_events_total": ("counter", ("kind",)),
    "wsd_build_info": ("gauge", ("version", "python", "pyzmq", "libzmq", "protocol")),
}
"""Every family the coordinator exports: name -> (type, label names). The contract that
deploy/grafana and deploy/prometheus are checked against (tests/integration/test_deploy.py)."""

SLOT_FAMILIES = frozenset(n.metric for n in SLOT_NUMBERS)
"""The per-slot families: without samples when ``[coordinator] metrics_slots`` is off."""

HELP = {
    **{n.metric: n.help for n in SLOT_NUMBERS},
    "wsd_rank_up": "1 if the rank is live, 0 if lost, stopped or missing (never registered); every expected rank "
                   "has one from the start.",
    "wsd_rank_info": "1 for every rank that registered, labelled with what it registered with (host, pid, device) "
                     "and where it runs as vLLM, Kubernetes and DCGM name it (model_name, rank_pod, rank_namespace, "
                     "rank_node, UUID; empty where not known).",
    "wsd_rank_stalled": "1 if the rank is live but its engine has been inside one step for longer than "
                        "[coordinator] stall_after (a TP peer froze mid-collective, say); 0 if live and not.",
    "wsd_rank_waits_for": "1 for each TP peer a stalled rank waits for, where that can be known (a peer lost, "
                          "stopped or missing, else one not inside the step).",
    "wsd_rank_locked": "1 if the rank's workspace is locked, as its last heartbeat said.",
    "wsd_rank_ubatches": "Micro-batch slots per lane of the rank's workspace, as its last heartbeat said.",
    "wsd_rank_last_step": "The last engine step the rank reported.",
    "wsd_rank_workspace_bytes": "Total bytes of the rank's workspace (scratch and persistent).",
    "wsd_rank_stats_age_seconds": "Seconds since the rank's snapshot (the wsd_slot_* figures) was known current.",
    "wsd_rank_stats_stale": "1 if the rank's snapshot is older than [coordinator] stats_stale_after.",
    "wsd_rank_lock_violations_total": "Requests refused because the workspace was locked, over the rank's slots, "
                                      "past ones included: never lower while the coordinator runs.",
    "wsd_group_workspace_bytes": "Workspace bytes summed over the TP group's reporting ranks.",
    "wsd_group_skew_bytes": "Largest minus smallest rank workspace total in the TP group.",
    "wsd_group_consistent": "1 if the TP group's live ranks agree on lock state and slot count.",
    "wsd_group_drift": "1 if the TP group's live ranks, with every command applied, report a lock state or slot "
                       "count other than the desired one.",
    "wsd_command_duration_seconds": "Seconds from numbering a command to its result.",
    "wsd_commands_total": "Commands finished, by action and result (complete, partial, failed).",
    "wsd_ranks": "Expected ranks of the engine by state (live, lost, stopped, missing).",
    "wsd_heartbeats_total": "Heartbeats received from agents.",
    "wsd_agent_refusals_total": "Agent frames and registrations refused, by reason (an impostor, a flood, "
                                "claims beyond the issued seq).",
    "wsd_command_seq": "The last command sequence number the engine handed out.",
    "wsd_stats_age_seconds": "Seconds since the engine's oldest rank snapshot was known current.",
    "wsd_stats_absent_ranks": "Expected ranks absent from the per-slot figures: lost, stopped, missing, or live "
                              "without a snapshot yet.",
    "wsd_stats_stale_ranks": "Ranks whose snapshot in the per-slot figures is older than stats_stale_after.",
    "wsd_events_total": "Events the coordinator logged, by kind (wsctl events).",
    "wsd_build_info": "1, labelled with the coordinator's wsd version, Python, pyzmq, libzmq and protocol version.",
}


class ViolationTotals:
    """``wsd_rank_lock_violations_total`` per rank: never lower than before while the coordinator runs.

    A rank's slots each count their own lock violations, and ``set_ubatches`` drops slots
    with their counts; the plain sum over the current slots would go down, which
    Prometheus reads as a counter reset (``increase()`` then adds the remaining count as
    new violations). So each rank's last count per slot (ubatch, lane) is remembered: a
    slot that is gone, or whose count is lower than before (a new life of the slot, or a
    new process of the rank, counting from 0), keeps its last count in the rank's
    retired total. Seen at each published view a scrape reads; a coordinator restart
    starts again from the ranks' counts (a true counter reset). Not thread-safe: the
    ``Collector`` calls it under its lock.
    """

    def __init__(self) -> None:
        self._slots: dict[Hashable, dict[tuple[int, int], int]] = {}
        self._retired: dict[Hashable, int] = {}

    def total(self, rank: Hashable, columns: Mapping[str, Sequence[int]]) -> int:
        """The rank's total, given its current slot columns (``ubatch``, ``lane``, ``lock_violations``)."""
        now = dict(zip(zip(columns["ubatch"], columns["lane"]), columns["lock_violations"]))
        retired = self._retired.get(rank, 0)
        for slot, count in self._slots.get(rank, {}).items():
            if now.get(slot, 0) < count:
                retired += count
        self._retired[rank] = retired
        self._slots[rank] = now
        return retired + sum(now.values())
