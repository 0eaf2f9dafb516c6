"""One coordinator, many engines: each its own world of ranks, commands, desired state and
state file, and every request addressed to the engines it names (wsd.coordinator.core).

Driven through the core with fake clocks, as tests/unit/test_coordinator_core.py does; the same
over real sockets, with simulated ranks and wsctl, is in tests/integration/test_engines_live.py.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from corekit import AGENT, Harness, make, only_reply, ops, peer_of, replies, to_agents
from test_metrics import by, parse

from wsd.coordinator.core import CoordinatorCore
from wsd.coordinator.metrics import Collector
from wsd.wire.protocol import ErrorCode, Op


@pytest.fixture
def h(tmp_path) -> Harness:
    return make(tmp_path)


def peer(engine: str, rank: int) -> bytes:
    return f"{engine}-{peer_of(rank).decode()}".encode()


def join(h: Harness, engine: str | None, ranks: range = range(4), **overrides: Any) -> None:
    for rank in ranks:
        sent = h.register(rank, peer=peer(engine or "default", rank), engine=engine,
                          instance=f"{engine}-{rank}", **overrides)
        assert ops(sent) == [Op.REGISTERED], sent


def ack_all(h: Harness, engine: str, sent, step: int = 5) -> list:
    """Every rank of ``engine`` sent a command acknowledges it; the client replies that gives."""
    out = []
    for route, body in to_agents(sent, Op.COMMAND).items():
        if route.startswith(engine.encode() + b"-"):
            rank = int(route.split(b"rank")[1].split(b"-")[0])
            out += h.agent(route, Op.ACK, {"rank": rank, "seq": body["seq"], "step": step, "ok": True, "error": None})
    return out


def test_two_engines_hold_the_same_ranks_each_in_its_own_world(h):
    """Ranks are unique within an engine: two replicas' rank 0..3 are all live, where one
    world would have refused the second replica's every rank as a conflict."""
    join(h, "replica-a")
    join(h, "replica-b")
    ranks = h.ok(Op.RANKS)["engines"]
    assert sorted(ranks) == ["replica-a", "replica-b"]
    for name, answer in ranks.items():
        assert [(r["rank"], r["state"], r["engine"]) for r in answer["ranks"]] == [
            (rank, "live", name) for rank in range(4)]
    one = h.ok(Op.RANKS, {"engine": "replica-b"})
    assert {r["engine"] for r in one["ranks"]} == {"replica-b"} and len(one["ranks"]) == 4
    engines = h.ok(Op.ENGINES)
    assert [(e["engine"], e["live"], e["world_size"]) for e in engines["engines"]] == [
        ("default", 0, 4), ("replica-a", 4, 4), ("replica-b", 4, 4)]
    assert engines["default"] == "default"


def test_a_command_for_one_engine_reaches_only_its_ranks_and_numbers_in_its_log(h):
    join(h, "a")
    join(h, "b")
    sent = h.client(Op.LOCK, {"engine": "a"})
    assert {route[:2] for route in to_agents(sent, Op.COMMAND)} == {b"a-"}
    assert not replies(sent)  # waits for a's acknowledgements
    result = only_reply(ack_all(h, "a", sent)).result
    assert result["complete"] and result["seq"] == 1 and [a["rank"] for a in result["acked"]] == [0, 1, 2, 3]
    assert h.core.engine("a").log.seq == 1 and h.core.engine("b").log.seq == 0
    assert h.core.engine("a").log.desired(0)["locked"] and not h.core.engine("b").log.desired(0)["locked"]
    # An agent of b counts nothing of a's as its own: a heartbeat of b is sent nothing.
    assert ops(h.agent(peer("b", 0), Op.HEARTBEAT, {"rank": 0, "step": 1, "applied_seq": 0, "held_seq": 0,
                                                    "state": {}})) == []


def test_a_command_naming_no_engine_goes_to_every_engine_and_answers_for_each(h):
    join(h, "a", range(2))
    join(h, "b", range(2))
    sent = h.client(Op.SET_UBATCHES, {"n": 3})
    assert sorted(route[:2] for route in to_agents(sent, Op.COMMAND)) == [b"a-", b"a-", b"b-", b"b-"]
    assert not replies(ack_all(h, "a", sent))  # b has yet to answer: no reply
    result = only_reply(ack_all(h, "b", sent)).result
    assert sorted(result["engines"]) == ["a", "b"]
    for answer in result["engines"].values():
        assert answer["action"] == "set_ubatches" and answer["seq"] == 1
        assert [a["rank"] for a in answer["acked"]] == [0, 1] and not answer["complete"]  # ranks 2, 3 missing


def test_a_command_refused_by_one_engine_is_numbered_by_none(h):
    join(h, "a", range(2))
    join(h, "b", range(2))
    assert only_reply(h.client(Op.LOCK, {"engine": "a", "wait": False})).ok
    reply = h.call(Op.RESERVE, {"bytes": 1 << 20})
    assert not reply.ok and reply.code is ErrorCode.CONFLICT and "locked" in reply.message
    assert h.core.engine("a").log.seq == 1 and h.core.engine("b").log.seq == 0


def test_one_engine_in_use_answers_as_a_coordinator_of_one_engine_did(h):
    """With one engine serving, nothing names it and nothing changes shape: every answer is
    that engine's own (a coordinator of one engine is what every earlier client knows)."""
    join(h, "solo")
    status = h.ok(Op.STATUS)
    assert status["engine"] == "solo" and status["ranks"]["live"] == 4
    sent = h.client(Op.LOCK, {"wait": False})
    assert len(to_agents(sent, Op.COMMAND)) == 4 and only_reply(sent).result["seq"] == 1
    assert h.core.engine().log.seq == 0  # the default engine, unused, got nothing


def test_an_engine_not_served_is_named_in_the_error_with_those_that_are(h):
    join(h, "a", range(1))
    for op in (Op.STATUS, Op.RANKS, Op.STATS, Op.EVENTS):
        reply = h.call(op, {"engine": "typo"})
        assert not reply.ok and reply.code is ErrorCode.BAD_FIELD
        assert "no engine 'typo'" in reply.message and "a, default" in reply.message


def test_a_command_for_an_engine_not_served_yet_is_its_desired_state_when_it_starts(h):
    """A replica's desired state may be set before it starts, when the command says so
    (``new_engine``): it adds the engine (at most max_engines), and its first rank takes the
    lock on. Without it, a typo in ``--engine`` is refused, naming the engines served, and
    creates nothing (it once made a phantom engine, pre-locked, and exited 0)."""
    typo = h.call(Op.LOCK, {"engine": "latter", "wait": False})
    assert not typo.ok and typo.code is ErrorCode.BAD_FIELD and "no engine 'latter' (it serves default)" in typo.message
    assert "--new-engine" in typo.message and sorted(h.core.engines) == ["default"]
    numbered = only_reply(h.client(Op.LOCK, {"engine": "later", "wait": False, "new_engine": True})).result
    assert numbered["seq"] == 1 and h.core.engine("later").log.seq == 1
    assert [e["engine"] for e in h.events("engine_added")] == ["later"]
    sent = h.register(0, peer=peer("later", 0), engine="later", instance="later-0")
    assert to_agents(sent, Op.REGISTERED)[peer("later", 0)]["desired"]["locked"] is True
    assert h.core.engine().log.seq == 0


def test_a_connection_registered_for_one_engine_cannot_move_to_another(h):
    join(h, "a", range(1))
    sent = h.register(1, peer=peer("a", 0), engine="b", instance="a-0")
    assert ops(sent) == [Op.REJECTED] and to_agents(sent, Op.REJECTED)[peer("a", 0)]["code"] == "mismatch"
    assert "b" not in h.core.engines


def test_the_configured_world_is_the_default_engines_and_another_engine_brings_its_own(h):
    """deploy/kubernetes's coordinator is configured for its worker Job (here world 4, TP 2);
    vLLM replicas of another shape join it as engines of their own. Were the configured world
    every engine's, a TP = 1 replica's registration would be refused as another world."""
    join(h, "vllm-0", range(1), world_size=1, tp_size=1, tp_group=0)
    join(h, "vllm-1", range(2), world_size=2, tp_size=2, tp_group=0)
    shapes = {e["engine"]: (e["world_size"], e["tp_size"], e["live"]) for e in h.ok(Op.ENGINES)["engines"]}
    assert shapes == {"default": (4, 2, 0), "vllm-0": (1, 1, 1), "vllm-1": (2, 2, 2)}
    refused = h.register(0, world_size=2, tp_size=2)  # the default engine keeps its configured world
    assert "expects 4" in to_agents(refused, Op.REJECTED)[peer_of(0)]["message"]
    other = h.register(1, peer=b"late", engine="vllm-1", instance="late", world_size=4, tp_size=2)
    assert "expects 2" in to_agents(other, Op.REJECTED)[b"late"]["message"]


def test_engines_beyond_max_engines_are_refused_and_cost_nothing(tmp_path):
    h = make(tmp_path, max_engines=3)
    join(h, "e1", range(1))
    join(h, "e2", range(1))
    sent = h.register(0, peer=b"third", engine="e3", instance="x")
    body = to_agents(sent, Op.REJECTED)[b"third"]
    assert body["code"] == "conflict" and "max_engines = 3" in body["message"]
    refused = h.call(Op.LOCK, {"engine": "e4", "new_engine": True})
    assert refused.code is ErrorCode.CONFLICT and "max_engines = 3" in refused.message
    assert sorted(h.core.engines) == ["default", "e1", "e2"]
    assert not os.path.exists(f"{h.config.state_file}@e3")


def test_engines_that_hold_nothing_are_forgotten_and_count_toward_no_limit(tmp_path):
    """63 junk engine names from one token holder once filled max_engines for ever: a real
    engine was refused until a restart. One whose ranks are gone and that never numbered a
    command is forgotten after ENGINE_GRACE heartbeat timeouts (at once when the limit is
    reached), leaving no file; one with a desired state is kept."""
    from wsd.coordinator.core import ENGINE_GRACE

    h = make(tmp_path, max_engines=3)
    join(h, "junk", range(1))
    join(h, "kept", range(1))
    only_reply(h.client(Op.LOCK, {"engine": "kept", "wait": False}))
    for name in ("junk", "kept"):
        h.agent(peer(name, 0), Op.GOODBYE, {"rank": 0, "step": 1})
    join(h, "real", range(1))  # at the limit: junk, holding nothing, makes room at once
    assert sorted(h.core.engines) == ["default", "kept", "real"]
    assert [e["engine"] for e in h.events("engine_forgotten")] == ["junk"]
    h.agent(peer("real", 0), Op.GOODBYE, {"rank": 0, "step": 1})
    h.advance(ENGINE_GRACE * h.config.heartbeat_timeout - 1.0)
    assert "real" in h.core.engines, "forgotten before its grace"
    h.advance(2.0)
    assert sorted(h.core.engines) == ["default", "kept"] and os.path.exists(f"{h.config.state_file}@kept")
    assert sorted(p.name for p in tmp_path.iterdir() if "@" in p.name) == ["coordinator.state@kept",
                                                                           "coordinator.state@kept.journal"]


def test_each_engine_keeps_its_desired_state_in_its_own_file_across_a_restart(tmp_path):
    h = make(tmp_path)
    join(h, "a", range(2))
    join(h, "b", range(2))
    only_reply(ack_all(h, "b", h.client(Op.LOCK, {"engine": "b"})))
    assert os.path.exists(f"{h.config.state_file}@b")
    restarted = Harness(CoordinatorCore(h.config, clock=h.mono, wall=h.wall), h.mono, h.wall, h.config)
    assert sorted(restarted.core.engines) == ["default"]  # an engine comes back with its first rank
    for name, locked in (("a", None), ("b", True)):
        sent = restarted.register(0, peer=peer(name, 0), engine=name, instance=f"{name}-new")
        registered = to_agents(sent, Op.REGISTERED)[peer(name, 0)]
        assert registered["baseline_seq"] == (1 if name == "b" else 0)
        assert registered["desired"]["locked"] is locked
    assert [e["engine"] for e in restarted.events("engine_added")] == ["a", "b"]


def test_events_can_be_read_for_one_engine(h):
    join(h, "a", range(1))
    join(h, "b", range(1))
    joined = [e["engine"] for e in h.events("joined")]
    assert joined == ["a", "b"]
    only_a = h.ok(Op.EVENTS, {"engine": "a", "limit": 100})
    assert {e.get("engine") for e in only_a["events"]} == {"a"}
    assert only_a["cursor"] == h.ok(Op.EVENTS, {"limit": 100})["cursor"]  # b's were read past, not again


def test_fresh_stats_naming_no_engine_waits_for_every_engine(h):
    join(h, "a", range(2))
    join(h, "b", range(2))
    sent = h.client(Op.STATS, {"fresh": True})
    asked = [m for m in sent if m.kind == AGENT and m.message.op is Op.STATS_REQUEST]
    assert len(asked) == 4 and not replies(sent)
    out = h.advance(h.config.stats_timeout + 0.1)  # nobody answers: each engine's round times out
    answer = only_reply(out).result["engines"]
    assert sorted(answer) == ["a", "b"]
    assert all(sorted(m["rank"] for m in a["missing"]) == [0, 1, 2, 3] for a in answer.values())


def test_metrics_carry_the_engine_of_every_rank_and_group(tmp_path):
    h = make(tmp_path, metrics_port=0)
    join(h, "a", range(2))
    join(h, "b", range(4))
    h.advance(h.config.metrics_refresh)
    _, samples = parse(Collector(lambda: h.core.published).render().decode())
    up = by(samples, "wsd_rank_up", "engine", "rank")
    assert sum(1 for (engine, _), v in up.items() if engine == "a" and v) == 2
    assert sum(1 for (engine, _), v in up.items() if engine == "b" and v) == 4
    assert by(samples, "wsd_ranks", "engine", "state")[("a", "missing")] == 2
    assert by(samples, "wsd_command_seq", "engine") == {"default": 0, "a": 0, "b": 0}
    assert set(by(samples, "wsd_group_consistent", "engine", "tp_group")) >= {("a", "0"), ("b", "0"), ("b", "1")}


@pytest.mark.parametrize("engine", [None, "a"])
def test_a_registration_without_a_valid_engine_name_is_refused(h, engine):
    body_engine = "../etc" if engine is None else "a b"
    sent = h.register(0, peer=b"x", engine=body_engine, instance="x")
    assert to_agents(sent, Op.REJECTED)[b"x"]["code"] == str(ErrorCode.BAD_FIELD)
    assert sorted(h.core.engines) == ["default"]


def test_the_default_engine_is_the_one_an_agent_naming_none_joins(tmp_path):
    h = make(tmp_path, engine="cluster-x")
    join(h, None, range(1))
    assert h.core.engine().name == "cluster-x" and h.core.engine().registry.live()
    assert h.ok(Op.RANKS)["ranks"][0]["engine"] == "cluster-x"  # one engine's answer, not wrapped
