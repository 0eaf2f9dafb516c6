"""The command table (wsd.commands): every part of wsd that knows a command reads its row.

Each test names a reader; it fails if that reader kept a list of its own that a
new row would not reach.
"""

from __future__ import annotations

import argparse

import pytest

from wsd import commands
from wsd.agent.simulated import SimulatedManager
from wsd.commands import COMMANDS, DESIRED_FIELDS, CommandResult, start_actions
from wsd.wire import protocol
from wsd_client import wsctl


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_row_is_an_operation_with_its_arguments_on_the_wire(name):
    spec = COMMANDS[name]
    op = protocol.Op(name)
    assert op in protocol.COMMAND_OPS and op in protocol.CLIENT_OPS
    wire = {f.name: (f.low, f.high) for f in protocol.SCHEMAS[op]}
    assert {a.name: (a.low, a.high) for a in spec.args}.items() <= wire.items()
    assert set(wire) - {a.name for a in spec.args} == {"engine", "group", "wait", "timeout", "new_engine"}


def test_the_wire_has_no_state_changing_operation_outside_the_table():
    assert {str(op) for op in protocol.COMMAND_OPS} == set(COMMANDS)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_row_names_a_method_of_the_manager_and_of_the_simulated_one(name):
    WorkspaceManager = pytest.importorskip("wsd.manager.core").WorkspaceManager  # torch: not on the I/O-free tier
    method = COMMANDS[name].method
    assert callable(getattr(WorkspaceManager, method)) and callable(getattr(SimulatedManager, method))


def test_call_applies_a_row_to_a_real_manager_and_refuses_an_unknown_action():
    manager = pytest.importorskip("wsd.manager.core").WorkspaceManager("cpu", 2)
    commands.call(manager, "set_ubatches", {"n": 3})
    commands.call(manager, "reserve", {"bytes": 4096})
    commands.call(manager, "lock", {})
    assert manager.num_ubatches == 3 and manager.is_locked()
    assert all(s.capacity_bytes >= 4096 for s in manager.stats().slots)
    with pytest.raises(ValueError, match="unknown action 'pin_lanes'"):
        commands.call(manager, "pin_lanes", {})


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_row_is_a_wsctl_subcommand_with_its_arguments(name):
    spec = COMMANDS[name]
    assert spec.cli in wsctl.COMMANDS
    parser = wsctl._parser()
    values = [str(a.low) for a in spec.args]
    args = parser.parse_args([spec.cli, *values, "--group", "1", "--no-wait"])
    assert args.command == spec.cli and args.group == 1 and args.wait is False
    assert {a.name: getattr(args, a.name) for a in spec.args} == {a.name: a.low for a in spec.args}
    for arg in spec.args:  # a value past the row's bound is a usage error (exit 2)
        too_big = [str(a.high + 1) if a is arg else str(a.low) for a in spec.args]
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([spec.cli, *too_big])
        assert exit_.value.code == 2


def test_a_fresh_rank_takes_on_its_groups_desired_state_in_the_tables_order():
    """Unlock first (so that a reserve applies), then slots, reservation, and a lock last."""
    locked = {"locked": True, "num_ubatches": 3, "reserve_bytes": 4096}
    assert start_actions(locked) == [("set_ubatches", {"n": 3}), ("reserve", {"bytes": 4096}), ("lock", {})]
    unlocked = {"locked": False, "num_ubatches": None, "reserve_bytes": 4096}
    assert start_actions(unlocked) == [("unlock", {}), ("reserve", {"bytes": 4096})]
    assert start_actions(dict.fromkeys(commands.DESIRED_FIELDS)) == []


def test_the_reply_type_is_shared_and_keeps_every_field_it_is_given():
    """The coordinator's reply used to be a dict, re-read by the client field by field: a key
    added on one side was silently dropped on the other."""
    full = CommandResult(seq=4, action="lock", group=1, waited=True, complete=False,
                         acked=({"rank": 2, "step": 9, "ok": True, "error": None},), failed=(),
                         same_step={1: True}, pending=(3,), lost=(), missing=({"rank": 5, "reason": "x"},))
    assert CommandResult.from_dict(full.to_dict()) == full
    assert CommandResult.from_dict({**full.to_dict(), "a_later_field": 1}) == full  # a newer coordinator's
    numbered = CommandResult(seq=5, action="trim", group=None, waited=False)
    assert numbered.to_dict() == {"seq": 5, "action": "trim", "group": None, "waited": False, "complete": False,
                                  "acked": (), "failed": (), "same_step": None, "pending": (), "lost": (),
                                  "missing": ()}
    assert CommandResult.from_dict(numbered.to_dict()) == numbered


def test_argparse_namespace_has_each_argument_under_its_wire_name():
    """wsctl sends ``getattr(args, arg.name)`` for each argument: the names must agree."""
    ns = wsctl._parser().parse_args(["reserve", "64KiB"])
    assert isinstance(ns, argparse.Namespace) and ns.bytes == 64 << 10


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_rows_change_to_the_desired_state_stays_within_what_it_says_it_touches(name):
    """desired_at rebuilds a past state from ``touches``: a row writing a field it does
    not name would make a fresh rank start from a wrong state, silently."""
    spec = COMMANDS[name]
    for before in (dict.fromkeys(DESIRED_FIELDS), {"locked": True, "num_ubatches": 7, "reserve_bytes": 99}):
        for bound in ("low", "high"):
            state = dict(before)
            if spec.desired is not None:
                spec.desired(state, {a.name: getattr(a, bound) for a in spec.args})
            changed = {k for k in DESIRED_FIELDS if state[k] != before[k]}
            assert changed <= set(spec.touches), (name, changed)


def test_a_row_that_disagrees_with_itself_is_refused_when_declared():
    with pytest.raises(ValueError, match="go together"):
        commands.CommandSpec(name="x", cli="x", help="x", method="x", touches=("locked",))
    with pytest.raises(ValueError, match="not all desired-state fields"):
        commands.CommandSpec(name="x", cli="x", help="x", method="x", desired=lambda s, a: None,
                             touches=("colour",))
