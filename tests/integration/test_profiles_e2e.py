"""Sizing profiles measured on real processes: the README's walk-through cluster (``wsd up``,
two torchrun workers, TP 2, locked steps that sometimes ask for more than warm-up reached),
run once to learn and once with ``[workspace] presize = "profile"``.

The figures this prints (``pytest -s``) are the ones in docs/wsctl.md ("Measured: the
walk-through, twice").
"""

from __future__ import annotations

import json
import re
import signal
import subprocess

import torch
from procs import COORDINATOR_READY, coordinator_section, spawn, worker_env, write_config  # noqa: F401

from wsd.coordinator.profiles import ProfileKey, Profiles, profiles_path
from wsd.fmt import format_bytes
from wsd.manager.buffers import layout
from wsd_client.client import Client

# The walk-through's workload (README: 16 warm-up steps, one locked step in five asking for
# more), its lock taken by the workload itself after warm-up instead of by an operator's
# `wsctl lock`, and a fixed number of steady steps so that both runs make the same requests
# (the same seed: every rank draws the same token counts, run after run). Two ubatches of
# two lanes each, so that each slot has a size of its own.
WORKLOAD = {"warmup_steps": 16, "oversize_chance": 0.2, "steps": 40, "pace": 0.02, "lock": True}
WORKSPACE = {"num_ubatches": 2, "num_lanes": 2}
STATE = "default-2.state"
STOPPED = re.compile(r"rank (\d)/2 .* stopped cleanly after (\d+) steps, (\d+) lock violations")
PRESIZED = re.compile(r"rank (\d): presized (\d+) slot\(s\) from the sizing profile: (\d+) bytes")


def _run(tmp_path, spawn, *, presize: str):  # noqa: F811
    """One `wsd up` of the walk-through, to its end: each rank's lock violations, and its output."""
    # The state file named as the README's cluster's engine is: wsd up names the engine after it.
    coordinator = {**coordinator_section(tmp_path), "state_file": str(tmp_path / STATE)}
    config = write_config(tmp_path / "wsd.toml", {"coordinator": coordinator,
                                                  "workspace": {**WORKSPACE, "presize": presize},
                                                  "workload": WORKLOAD})
    up = spawn(["wsd", "up", "--nproc", "2", "--config", config], env=worker_env(), name="wsd up")
    assert up.wait(90) == 0, up.output()
    violations = {int(m.group(1)): int(m.group(3)) for m in STOPPED.finditer(up.output())}
    assert sorted(violations) == [0, 1], up.output()
    return violations, up.output()


def _request_bytes(tokens: int) -> int:
    """What one forward pass of the built-in workload asks one slot for, at ``tokens``
    (default [workload] sizes, TP 2: input, then per layer its shard and its output)."""
    hidden, shard = 256, 1024 // 2
    shapes = [((tokens, hidden), torch.float32)] + [((tokens, shard), torch.float32),
                                                    ((tokens, hidden), torch.float32)] * 2
    return layout(shapes, 256)[3]


def test_the_second_walk_through_with_presize_profile_has_no_lock_violation(tmp_path, spawn):  # noqa: F811
    """Without the profile (or with every slot presized alike at warm-up's size), the second run
    repeats the first's violations: its locked oversize steps are the same requests."""
    learned, _ = _run(tmp_path, spawn, presize="none")
    assert all(n > 0 for n in learned.values()), learned  # the walk-through has violations to learn from

    store = Profiles(profiles_path(str(tmp_path / STATE)), wall=lambda: 0.0, clock=lambda: 0.0)
    [key] = store.profiles
    assert key == ProfileKey("default-2", 2, 2, 2)  # wsd up's engine, TP 2, 2 ubatches x 2 lanes
    sizes = dict(store.profiles[key].slots)
    assert len(sizes) == 4 and len(set(sizes.values())) > 1  # each slot its own size

    presized, output = _run(tmp_path, spawn, presize="profile")
    assert presized == {0: 0, 1: 0}, output
    reserved = {int(m.group(1)): int(m.group(3)) for m in PRESIZED.finditer(output)}
    assert reserved == {0: sum(sizes.values()), 1: sum(sizes.values())}, output

    # What it reserves, against the guesses an operator without a profile would make.
    warm_up = 4 * _request_bytes(256)                 # what warm-up alone reaches (max_tokens)
    every_at_largest = 4 * max(sizes.values())        # every slot at the largest request seen
    workload_bound = 4 * _request_bytes(2 * 256)      # every slot at the largest the workload can ask
    per_rank = reserved[0]
    assert warm_up < per_rank <= every_at_largest < workload_bound
    print(f"\nrun 1 (presize none): lock violations per rank {learned}"
          f"\nrun 2 (presize profile): lock violations per rank {presized}"
          f"\nper rank: warm-up reaches {format_bytes(warm_up)}; the profile reserves {format_bytes(per_rank)} "
          f"({', '.join(f'{u}/{lane} {format_bytes(b)}' for (u, lane), b in sorted(sizes.items()))}); "
          f"every slot at the largest request seen {format_bytes(every_at_largest)} "
          f"(+{100 * (every_at_largest - per_rank) / per_rank:.0f}%); every slot at the workload's bound "
          f"{format_bytes(workload_bound)} (+{100 * (workload_bound - per_rank) / per_rank:.0f}%)")

    # A coordinator started again on the same state file has them: wsctl shows them and drops one.
    coordinator = spawn(["wsd", "coordinator", "--config", str(tmp_path / "wsd.toml")],
                        env=worker_env(WSD_COORDINATOR_WORLD_SIZE="2", WSD_COORDINATOR_ENGINE="default-2"),
                        name="wsd coordinator")
    endpoint = coordinator.wait_for(COORDINATOR_READY, 30).group(2)
    shown = subprocess.run(["wsctl", "--endpoint", endpoint, "--json", "profiles"],
                           capture_output=True, text=True, timeout=30, env=worker_env())
    assert shown.returncode == 0, shown.stderr
    [profile] = json.loads(shown.stdout)["profiles"]
    assert profile["key"] == str(key) and profile["ranks"] == 2 and profile["total_bytes"] == per_rank
    human = subprocess.run(["wsctl", "--endpoint", endpoint, "profiles"], capture_output=True, text=True,
                           timeout=30, env=worker_env())
    assert human.returncode == 0 and str(key) in human.stdout, human.stderr
    print(human.stdout)
    with Client(endpoint, timeout=5) as client:
        assert client.drop_profile(str(key)) == {"dropped": str(key), "saved": True}
        assert client.profiles().profiles == []
    coordinator.send(signal.SIGTERM)
    assert coordinator.wait(15) == 0, coordinator.output()
