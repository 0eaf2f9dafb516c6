"""One registered worker pushing at its connection's byte meter's limit: what it costs everyone else.

A real coordinator in a process of its own (``wsd coordinator``, a world of two
ranks of TP size 1, the agent token given), one real simulated rank beside it
(rank 1), and an attacker holding the token (rank 0) in a further process: it
registers as an agent does (the token's handshake), pushes a whole snapshot of
4,096 slots (a manager's most), then deltas of about 200 bytes that each change
one slot, pipelined on the acknowledged version, as fast as its connection's
byte meter lets frames in. Each delta is merged into the whole snapshot held,
so before pushes were charged by the snapshot they change, deltas at 1,000 a
second held the coordinator at a whole core and moved ``ping`` from 0.2 ms to
5 s.

Two floods: at its meter's limit (``FRAMES_PER_SECOND`` a second, the most a
registered connection may have read), the figure with the targets; and as fast
as its socket takes frames (several thousand a second), reported without a
target: frames past the meter are dropped unread, but receiving them still
costs the coordinator's ZeroMQ thread and loop tens of microseconds each.

Measured side by side, in windows alternating between the attacker idle
(registered, heartbeating) and flooding: the coordinator's share of one core
(its threads' run time from /proc), and a client's ``ping`` round trip, median
and 99th percentile. Targets: the flood moves the ping median by at most 10 ms
and the coordinator's CPU by at most 0.20 of a core.

Run: ``python -m bench.bench_hostile [--quick]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import zmq

from bench.bench_scale import cpu_seconds
from bench.helpers import Row
from wsd.agent.core import AgentCore
from wsd.agent.simulated import SimulatedManager, SimulatedRanks
from wsd.coordinator.admission import FRAMES_PER_SECOND
from wsd.programs.coordinator import CoordinatorProcess
from wsd.slotstats import snapshot_delta
from wsd.wire import protocol as p
from wsd.wire.protocol import Op
from wsd_client.client import Client

TOKEN = b"bench-hostile-token-0123456789abcdef"
TARGETS = {"ping moved": 10.0, "cpu moved": 0.20}
_SLOTS = (64, 64)  # ubatches x lanes: 4,096 slots, a manager's most


def attacker(endpoint: str, conn: Connection) -> None:
    """Rank 0: registers with the token, then floods pushes whenever told to, until told to stop."""
    manager = SimulatedManager(*_SLOTS)

    class Target:
        device = "cpu"

        def state(self) -> dict[str, Any]:
            return manager.state()

        def snapshot(self) -> dict[str, Any]:
            return manager.snapshot()

        def apply(self, action: str, args: dict[str, Any]) -> None:
            pass

        def in_step(self) -> tuple[int, float] | None:
            return None  # no engine: never inside a step, never stalled

        def stacks(self) -> list[dict[str, Any]]:
            return []

    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.connect(endpoint)
    link = AgentCore(Target(), rank=0, world_size=2, tp_size=1, idle=True, heartbeat_interval=1.0,
                     heartbeat_timeout=5.0, token=TOKEN)
    base = manager.snapshot()

    def serve_link(wait_ms: int) -> list[dict[str, Any]]:
        """Let the link register and heartbeat; the stats acknowledgements seen."""
        acks = []
        for frame in link.on_time(time.monotonic()):
            sock.send(frame)
        while sock.poll(wait_ms):
            frame = sock.recv()
            wait_ms = 0
            message = p.decode(frame, p.COORDINATOR_OPS)
            if message.op is Op.STATS_ACK:
                acks.append(message.body)
                continue
            for out in link.on_frame(frame, time.monotonic()):
                sock.send(out)
        return acks

    while not link.registered.is_set():
        serve_link(100)
    conn.send("registered")
    version = 1_000_000  # above the link's own pushes
    while True:
        order = conn.recv()
        if order == "stop":
            break
        seconds, rate = order
        gap = 0.0 if rate is None else 1.0 / rate
        # A whole snapshot first, then deltas each on the one before, pipelined.
        version += 1
        sock.send(p.encode(Op.STATS_PUSH, {"rank": 0, "version": version, "base": None, "step": version,
                                           "applied_seq": link.applied, "held_seq": link.held, "state": {},
                                           "stats": base}))
        held, sent, end = version, 0, time.monotonic() + seconds
        previous = base
        next_send = time.monotonic()
        while time.monotonic() < end:
            if gap:
                pause = next_send - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                next_send += gap
            current = {**previous, "slots": {**previous["slots"],
                                             "requests": list(previous["slots"]["requests"])}}
            current["slots"]["requests"][version % len(current["slots"]["requests"])] += 1
            version += 1
            try:
                sock.send(p.encode(Op.STATS_PUSH, {
                    "rank": 0, "version": version, "base": held, "step": version, "applied_seq": link.applied,
                    "held_seq": link.held, "state": {}, "delta": snapshot_delta(previous, current)}), zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass
            held, previous = version, current
            serve_link(0)
        conn.send(sent)
    sock.close()
    context.term()


def _pings(client: Client, seconds: float) -> list[float]:
    """Ping round trips, milliseconds, one after the other for ``seconds``."""
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        began = time.perf_counter()
        client.ping()
        out.append((time.perf_counter() - began) * 1000)
        time.sleep(0.01)
    return out


def run(quick: bool = False) -> list[Row]:
    windows, seconds = (2, 3.0) if quick else (4, 5.0)
    floods = {"at the meter": FRAMES_PER_SECOND, "unpaced": None}
    with tempfile.TemporaryDirectory(prefix="wsd-bench-hostile-") as tmp:
        config = Path(tmp) / "wsd.toml"
        config.write_text(f'[coordinator]\nagent_endpoint = "tcp://127.0.0.1:0"\n'
                          f'client_endpoint = "tcp://127.0.0.1:0"\nstate_file = "{tmp}/state"\n'
                          f"world_size = 2\ntp_size = 1\n")
        env = {**os.environ, "WSD_AGENT_TOKEN": TOKEN.decode()}
        coordinator = CoordinatorProcess(str(config), env=env).start(timeout=30.0)
        assert coordinator.proc is not None
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        flood = ctx.Process(target=attacker, args=(coordinator.agent_endpoint, theirs), daemon=True)
        flood.start()
        kinds = ("idle", *floods)
        samples: dict[str, dict[str, list[float]]] = {k: {"ping": [], "cpu": [], "frames": []} for k in kinds}
        try:
            with SimulatedRanks(coordinator.agent_endpoint, [1], world_size=2, num_ubatches=8,
                                token=TOKEN) as bystander, Client(coordinator.client_endpoint, timeout=10) as client:
                if not bystander.wait_registered(30) or not ours.poll(60) or ours.recv() != "registered":
                    raise SystemExit("bench_hostile: the ranks did not register")
                for _ in range(windows):
                    for kind in kinds:  # alternating, so that a drift of the machine hits each alike
                        before = cpu_seconds(coordinator.proc.pid)[1]
                        began = time.monotonic()
                        if kind != "idle":
                            ours.send((seconds, floods[kind]))
                        samples[kind]["ping"] += _pings(client, seconds)
                        if kind != "idle":
                            samples[kind]["frames"].append(ours.recv() / seconds)
                        elapsed = time.monotonic() - began
                        samples[kind]["cpu"].append((cpu_seconds(coordinator.proc.pid)[1] - before) / elapsed)
                status = client.status()
                refused, live = status["agents_refused"], status["ranks"]["live"]
                ours.send("stop")
        finally:
            flood.join(10)
            if flood.is_alive():
                flood.kill()
            coordinator.stop()
    ping = {k: statistics.median(v["ping"]) for k, v in samples.items()}
    p99 = {k: statistics.quantiles(v["ping"], n=100)[98] for k, v in samples.items()}
    cpu = {k: statistics.median(v["cpu"]) for k, v in samples.items()}
    print(f"one worker pushing 200-byte deltas into a 4,096-slot snapshot, {windows} windows of {seconds:g} s "
          f"of each, alternating; the meter reads {FRAMES_PER_SECOND:.0f} frames a second of a connection")
    print(f"{'':>14} {'frames/s':>9} {'ping p50 ms':>12} {'ping p99 ms':>12} {'coordinator cores':>18}")
    for kind in kinds:
        sent = f"{statistics.median(samples[kind]['frames']):.0f}" if samples[kind]["frames"] else "-"
        print(f"{kind:>14} {sent:>9} {ping[kind]:>12.2f} {p99[kind]:>12.2f} {cpu[kind]:>18.3f}")
    print(f"refused: {refused}; ranks live at the end: {live} of 2")
    meter = "at the meter"
    return [Row("hostile push at the meter: ping moved", ping[meter] - ping["idle"],
                "the same coordinator, attacker idle", TARGETS["ping moved"], unit=" ms"),
            Row("hostile push at the meter: cpu moved", cpu[meter] - cpu["idle"],
                "the same coordinator, attacker idle", TARGETS["cpu moved"], unit=" cores"),
            Row("hostile push unpaced: ping moved", ping["unpaced"] - ping["idle"],
                "the same coordinator, attacker idle", unit=" ms"),
            Row("hostile push unpaced: cpu moved", cpu["unpaced"] - cpu["idle"],
                "the same coordinator, attacker idle", unit=" cores")]


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_hostile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two windows of 3 s each way")
    args = parser.parse_args(argv)
    rows = run(args.quick)
    for row in rows:
        target = "" if row.target is None else f" (target <= {row.target:g}{row.unit}: " \
                                               f"{'met' if row.met else 'NOT met'})"
        print(f"{row.name}: {row.value:.3f}{row.unit}{target}")
    return rows


if __name__ == "__main__":
    main()
