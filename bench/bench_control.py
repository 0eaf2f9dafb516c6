"""Benchmark of the control plane, each figure against its bare baseline.

Side by side in one run (absolute times on a shared machine mean little), with
N = 1, 8 and 32 simulated ranks (``wsd.agent.simulated``, 8 slots each):

* ``stats``: the round trip client -> coordinator -> client of an answer from
  the snapshots the N agents pushed, against a bare pyzmq ROUTER fan-out of a
  request of a rank's stats request's size to N DEALERs and the gather of a
  reply of a rank's snapshot's size from each (what any design that asks every
  rank costs at least); beside it, ``stats --fresh``, which does ask every rank;
* a command (``lock``/``unlock`` in turn) applied and acknowledged by N idle
  agents, against the same bare fan-out with the command's and the
  acknowledgement's sizes;
* beside them, the floor of any design in which a client asks a coordinator
  process: a bare relay (client DEALER -> a ROUTER in a process of its own ->
  the same bare fan-out and gather -> an answer of the stats answer's size back
  to the client), doing nothing else. ``stats`` over this floor is what wsd
  itself adds; the floor over the bare fan-out is what the extra hop costs.

The coordinator, the simulated ranks and the bare DEALERs each run in a
process of their own; the bare DEALERs run as the simulated ranks do (one
thread, one poller, one DEALER per rank). The candidates are interleaved, in
an order in which each follows each of the others equally often (and never
itself), and the median taken. Then, with 2 real gloo ranks, the per-step agreement
(``Agent.step()``, apply_every=1) against one bare gloo ``all_reduce`` of one
integer on the same group, interleaved in the same processes.

Run: ``python -m bench.bench_control [--quick] [--tp-size 8]`` (TP groups of one rank by
default, the targets' set-up; of 8 to see the same figures with real TP groups).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import struct
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import zmq

from bench.helpers import START_TIMEOUT, Helper, Row, one_engine, run_coordinator, timed_us
from wsd.agent.core import AgentCore
from wsd.agent.simulated import SimulatedManager, SimulatedRanks
from wsd.config import AgentConfig
from wsd.coordinator.commandlog import CommandLog
from wsd.wire import protocol as p
from wsd.wire.protocol import Op
from wsd.wire.transport import bind, connect, make_socket, send_nowait
from wsd_client.client import Client

SLOTS = 8
TARGETS = {"stats": 0.5, "command": 2.0, "agreement": 1.2}
PUSH_STEP_RATE_TARGET = 0.99  # steps per second pushing / not pushing: at least
_ROUND_TIMEOUT = 10.0

# -- helper processes (spawned: each starts clean, with no torch) ------------------------


def _run_simulated(conn: Any, endpoint: str, n: int, tp_size: int = 1) -> None:
    with SimulatedRanks(endpoint, range(n), world_size=n, tp_size=tp_size, num_ubatches=SLOTS) as sim:
        conn.send(sim.wait_registered(START_TIMEOUT))
        conn.recv()


def _run_bare_dealers(conn: Any, endpoint: str, n: int) -> None:
    """N DEALERs on one thread and one poller, as the simulated ranks run.

    Each answers a request with a reply of the size the request's first four
    bytes ask for, so that one set of DEALERs serves every payload size.
    """
    context = zmq.Context()
    poller = zmq.Poller()
    sockets = []
    for _ in range(n):
        sock = make_socket(context, zmq.DEALER)
        connect(sock, endpoint)
        poller.register(sock, zmq.POLLIN)
        send_nowait(sock, [b"hello"])  # so that the ROUTER learns our identity
        sockets.append(sock)
    replies: dict[int, bytes] = {}
    conn.send(True)
    while not conn.poll(0):
        for sock, _ in poller.poll(100):
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                size = struct.unpack_from("<I", frame)[0]
                reply = replies.get(size) or replies.setdefault(size, bytes(size))
                send_nowait(sock, [reply])
    for sock in sockets:
        sock.close(linger=0)
    context.term()


def _run_bare_relay(conn: Any, n: int) -> None:
    """A bare coordinator: fans each client request out to N DEALERs, gathers, answers.

    A client request is the answer's size (four bytes) followed by the frame to
    fan out; the answer is that many zero bytes, so that the client receives as
    much as it does from ``stats``.
    """
    context = zmq.Context()
    fan = BareFanOut(context, n)
    front = make_socket(context, zmq.ROUTER)
    conn.send((fan.endpoint, bind(front, "tcp://127.0.0.1:0")))
    fan.wait_peers()
    conn.send(True)
    answers: dict[int, bytes] = {}
    while not conn.poll(0):
        if not front.poll(100):
            continue
        peer, request = front.recv_multipart()
        size = struct.unpack_from("<I", request)[0]
        fan.round(request[4:])
        send_nowait(front, [peer, answers.get(size) or answers.setdefault(size, bytes(size))])
    fan.close()
    front.close(linger=0)
    context.term()


# -- the bare fan-out ---------------------------------------------------------------


class BareFanOut:
    """A ROUTER that sends one frame to each of N DEALERs and gathers one reply from each."""

    def __init__(self, context: zmq.Context, n: int) -> None:
        self.n = n
        self.router = make_socket(context, zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.endpoint = bind(self.router, "tcp://127.0.0.1:0")
        self.peers: list[bytes] = []

    def wait_peers(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while len(self.peers) < self.n:
            if not self.router.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                raise SystemExit(f"only {len(self.peers)} of {self.n} bare DEALERs connected")
            self.peers.append(self.router.recv_multipart()[0])

    def round(self, request: bytes) -> None:
        router = self.router
        for peer in self.peers:
            router.send_multipart([peer, request])
        deadline = time.monotonic() + _ROUND_TIMEOUT
        for _ in range(self.n):
            if not router.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                raise SystemExit("a bare DEALER did not answer")
            router.recv_multipart()

    def close(self) -> None:
        self.router.close(linger=0)


class BareRelayClient:
    """The client's side of the bare relay: one request, one answer of a given size."""

    def __init__(self, context: zmq.Context, endpoint: str) -> None:
        self.sock = make_socket(context, zmq.DEALER)
        connect(self.sock, endpoint)

    def round(self, request: bytes, answer_size: int) -> None:
        self.sock.send(struct.pack("<I", answer_size) + request)
        if not self.sock.poll(int(_ROUND_TIMEOUT * 1000)):
            raise SystemExit("the bare relay did not answer")
        self.sock.recv()

    def close(self) -> None:
        self.sock.close(linger=0)


def balanced_order(n: int) -> list[int]:
    """A cycle through 0..n-1 in which each one follows each other one exactly once, and
    none itself: an Eulerian circuit of the complete directed graph on n nodes
    (Hierholzer's algorithm). Each comes n - 1 times in its n * (n - 1) steps."""
    unused = {v: [w for w in range(n) if w != v] for v in range(n)}
    path, circuit = [0], []
    while path:
        if unused[path[-1]]:
            path.append(unused[path[-1]].pop())
        else:
            circuit.append(path.pop())
    return circuit[:0:-1]  # reversed, less the closing return to 0


def _request(size: int, reply_size: int) -> bytes:
    return struct.pack("<I", reply_size) + bytes(max(0, size - 4))


def frame_sizes() -> dict[str, tuple[int, int]]:
    """(request, reply) bytes of one rank's leg of a stats round and of a command."""
    # The reply exactly as a simulated rank sends it (a rank number of the same width).
    link = AgentCore(SimulatedManager(SLOTS), rank=1, world_size=2, idle=True)
    request = p.encode(Op.STATS_REQUEST, {"request": 1})
    [reply] = link.on_frame(request, 0.0)
    stats = (len(request), len(reply))
    command = (len(p.encode(Op.COMMAND, {"seq": 1, "action": "lock", "args": {}, "group": None})),
               len(p.encode(Op.ACK, {"rank": 1, "seq": 1, "step": 0, "ok": True, "error": None})))
    return {"stats": stats, "command": command}


def bench_fan_out(n: int, rounds: int, state_dir: str, tp_size: int = 1) -> dict[str, Any]:
    """Median microseconds of wsd, the bare fan-out and the bare relay, N ranks in TP groups
    of ``tp_size``."""
    sizes = frame_sizes()
    context = zmq.Context()
    bare = BareFanOut(context, n)
    coordinator = Helper(run_coordinator, str(Path(state_dir) / f"bench-{n}.state"))
    helpers = [coordinator]
    relay_client = None
    try:
        agent_endpoint, client_endpoint = coordinator.result()
        relay = Helper(_run_bare_relay, n)
        relay_fan_endpoint, relay_endpoint = relay.result()
        sim = Helper(_run_simulated, agent_endpoint, n, tp_size)
        dealers = Helper(_run_bare_dealers, bare.endpoint, n)
        relay_dealers = Helper(_run_bare_dealers, relay_fan_endpoint, n)
        helpers += [relay, sim, dealers, relay_dealers]
        if not sim.result():
            raise SystemExit(f"the {n} simulated ranks did not all register")
        dealers.result()
        relay_dealers.result()
        bare.wait_peers()
        relay.result()
        relay_client = BareRelayClient(context, relay_endpoint)
        client = Client(client_endpoint, timeout=_ROUND_TIMEOUT, context=context)
        stats_request = _request(*sizes["stats"])
        command_request = _request(*sizes["command"])
        actions = [client.lock, client.unlock]

        def wsd_stats(fresh: bool = False) -> None:
            result = one_engine(client.stats(fresh=fresh))
            if len(result.reporting) != n:
                raise SystemExit(f"stats answered for {len(result.reporting)} of {n} ranks")

        deadline = time.monotonic() + START_TIMEOUT
        while not client.stats()["complete"]:  # every rank's first push in
            if time.monotonic() > deadline:
                raise SystemExit(f"the {n} simulated ranks did not all push their snapshots")
            time.sleep(0.05)

        def wsd_command(i: int) -> None:
            result = one_engine(actions[i % 2]())
            if not result.complete or len(result.acked) != n:
                raise SystemExit(f"{result.action} acknowledged by {len(result.acked)} of {n} ranks")

        for i in range(20):  # warm up every path
            wsd_stats()
            bare.round(stats_request)
            wsd_command(i)
            bare.round(command_request)
        # What the client receives and decodes whole each round; the relay answers as much.
        answer = msgpack.packb(one_engine(client.stats()).doc, use_bin_type=True)
        answer_bytes = len(answer)
        relay_client.round(stats_request, answer_bytes)
        samples: dict[str, list[float]] = {
            k: [] for k in ("stats", "fresh stats", "bare stats", "relay stats", "command", "bare command")}
        candidates: list[tuple[str, Callable[[int], object]]] = [
            ("bare stats", lambda i: bare.round(stats_request)),
            ("stats", lambda i: wsd_stats()),
            ("fresh stats", lambda i: wsd_stats(fresh=True)),
            ("relay stats", lambda i: relay_client.round(stats_request, answer_bytes)),
            ("bare command", lambda i: bare.round(command_request)),
            ("command", wsd_command),
        ]
        # Each candidate follows each of the others equally often, and never itself: what
        # one leaves behind (a command's pushes, a cold cache) falls on every other alike.
        sequence = balanced_order(len(candidates))
        for k in range(rounds * len(candidates)):
            name, fn = candidates[sequence[k % len(sequence)]]
            i = len(samples[name])  # the candidate's own count: commands lock and unlock in turn
            samples[name].append(timed_us(partial(fn, i)))
        client.close()
        # Of a stats round, what the client's decoding of the answer takes alone.
        frame = p.ok_reply_packed(1, answer)
        decode = statistics.median(timed_us(lambda: p.decode_reply(frame)) for _ in range(rounds))
        med = {k: statistics.median(v) for k, v in samples.items()}
        return {"stats": (med["stats"], med["bare stats"]), "command": (med["command"], med["bare command"]),
                "fresh": med["fresh stats"],
                "relay": med["relay stats"], "answer_bytes": answer_bytes, "decode": decode}
    finally:
        if relay_client is not None:
            relay_client.close()
        for helper in reversed(helpers):
            helper.stop()
        bare.close()
        context.term()


# -- per-step agreement on 2 gloo ranks ------------------------------------------------


def _agreement_rank(rank: int, world: int, init_file: str, endpoint: str, rounds: int, calls: int,
                    results: Any) -> None:
    import torch
    import torch.distributed as dist

    from wsd import WorkspaceManager
    from wsd.agent.collectives import tp_groups
    from wsd.agent.thread import Agent

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    _, group = tp_groups(rank, world, world, None)
    agent = Agent(WorkspaceManager("cpu", 2), endpoint=endpoint, rank=rank, world_size=world,
                  tp_size=world, tp_group=group, config=AgentConfig(apply_every=1)).start()
    try:
        if not agent.wait_registered(START_TIMEOUT):
            raise SystemExit(f"rank {rank}: agent did not register")
        value = torch.zeros(1, dtype=torch.int64)

        def bare() -> None:
            dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)

        candidates: dict[str, Callable[[], object]] = {"step": agent.step, "bare": bare}
        samples: dict[str, list[float]] = {k: [] for k in candidates}
        for fn in candidates.values():  # warm up
            for _ in range(calls):
                fn()
        for r in range(rounds):
            order = list(candidates.items()) if r % 2 == 0 else list(reversed(candidates.items()))
            for name, fn in order:
                dist.barrier(group)
                start = time.perf_counter_ns()
                for _ in range(calls):
                    fn()
                samples[name].append((time.perf_counter_ns() - start) / calls / 1e3)
        if rank == 0:
            results.put({k: statistics.median(v) for k, v in samples.items()})
    finally:
        agent.stop()
        dist.destroy_process_group()


def bench_agreement(rounds: int, calls: int, state_dir: str) -> tuple[float, float]:
    """Median microseconds per call of ``Agent.step()`` and of a bare all_reduce, 2 gloo ranks."""
    import torch.multiprocessing as tmp

    coordinator = Helper(run_coordinator, str(Path(state_dir) / "bench-agreement.state"))
    try:
        agent_endpoint, _ = coordinator.result()
        ctx = mp.get_context("spawn")
        results = ctx.SimpleQueue()
        tmp.start_processes(_agreement_rank, nprocs=2, start_method="spawn", join=True,
                            args=(2, str(Path(state_dir) / "gloo-init"), agent_endpoint, rounds, calls, results))
        med = results.get()
        return med["step"], med["bare"]
    finally:
        coordinator.stop()


# -- the engine's step rate with pushes on and off -------------------------------------


def _stepping_rank(endpoint: str, rounds: int, window: float, results: Any) -> None:
    import torch

    from wsd import WorkspaceManager, use_ubatch
    from wsd.agent.thread import Agent

    torch.set_num_threads(1)
    manager = WorkspaceManager("cpu", SLOTS)
    agent = Agent(manager, endpoint=endpoint, rank=0, world_size=1, config=AgentConfig(apply_every=1)).start()
    link = agent._link  # the benchmark turns pushes off and on; nothing else may
    try:
        if not agent.wait_registered(START_TIMEOUT):
            raise SystemExit("the agent did not register")
        interval = link.push.interval
        weights = torch.randn(64, 64)

        def step() -> None:  # an engine step: every ubatch slot's scratch, a little compute, the agreement
            for u in range(SLOTS):
                with use_ubatch(u):
                    (x,) = manager.get_simultaneous(((64, 64), torch.float32))
                    torch.mm(weights, weights, out=x)
            agent.step()

        def steps_in_window() -> float:
            count, end = 0, time.perf_counter() + window
            while time.perf_counter() < end:
                step()
                count += 1
            return count / window

        steps_in_window()  # warm up
        samples: dict[str, list[float]] = {"on": [], "off": []}
        for r in range(rounds):
            for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
                link.push.interval = interval if name == "on" else None  # None: pushes off
                samples[name].append(steps_in_window())
        link.push.interval = interval
        results.put({k: statistics.median(v) for k, v in samples.items()})
    finally:
        agent.stop()


def bench_push_overhead(rounds: int, window: float, state_dir: str) -> tuple[float, float]:
    """Median engine steps per second with the agent pushing its snapshot (every step changes
    it: each look finds something to push) and with pushes off, interleaved in one process."""
    coordinator = Helper(run_coordinator, str(Path(state_dir) / "bench-push.state"))
    try:
        agent_endpoint, _ = coordinator.result()
        ctx = mp.get_context("spawn")
        results = ctx.SimpleQueue()
        rank = ctx.Process(target=_stepping_rank, args=(agent_endpoint, rounds, window, results), daemon=True)
        rank.start()
        rank.join(rounds * window * 2 + 10 * START_TIMEOUT)
        if rank.is_alive() or results.empty():
            rank.kill()
            raise SystemExit("the stepping rank did not finish")
        med = results.get()
        return med["on"], med["off"]
    finally:
        coordinator.stop()


def state_write_cost(directory: str, commands: int) -> float:
    """Median microseconds of recording one command (a journal record appended and
    fdatasynced, then counted in the journal's header and fdatasynced again)."""
    with tempfile.TemporaryDirectory(prefix="wsd-bench-", dir=directory) as d:
        log = CommandLog(str(Path(d) / "cost.state"), 4096)
        return statistics.median(timed_us(lambda: log.append("lock", {}, None, 0.0)) for _ in range(commands))


def _default_state_dir() -> str | None:
    # The two fdatasyncs of each command's state-file write cost what the disk makes them
    # (0.01 ms on tmpfs, 0.4-3 ms on this machine's shared disk): on tmpfs the
    # command figure measures the control plane; its disk share is printed apart.
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


BASELINES = {
    "stats": "bare ROUTER fan-out and gather, same payload",
    "command": "bare ROUTER fan-out and gather, same payload",
    "agreement": "one bare gloo all_reduce of one integer",
    "relay": "bare relay: client -> ROUTER -> same fan-out -> same-size answer",
}


def run(quick: bool = False, state_dir: str | None = None, tp_size: int = 1) -> list[Row]:
    """Measure, print the tables and return the ratios for ``python -m bench``.

    ``state_dir`` holds the coordinator's state file (default: /dev/shm if present);
    ``tp_size``: the simulated ranks' TP groups (at most N ranks each; the targets are
    set for 1, each rank its own group).
    """
    state_dir = _default_state_dir() if state_dir is None else state_dir
    rounds, agree_rounds, calls = (100, 7, 200) if quick else (200, 21, 1000)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="wsd-bench-", dir=state_dir) as tmp:
        sizes = frame_sizes()
        print(f"fan-out to N simulated ranks ({SLOTS} slots each, TP groups of {tp_size} or N), "
              f"median of {rounds} interleaved rounds (us)")
        print(f"  payload per rank: stats {sizes['stats'][0]} B out, {sizes['stats'][1]} B back; "
              f"command {sizes['command'][0]} B out, {sizes['command'][1]} B back")
        print("  relay: the bare relay, the floor of a client asking a coordinator (see the docstring)")
        print("  stats: answered from the pushed snapshots; fresh: stats --fresh, every rank asked")
        print("  decode: of a stats round, the client's decoding of the answer alone")
        print(f"{'N':>4} {'stats':>9} {'bare':>9} {'ratio':>7}   {'fresh':>9} {'f/bare':>7}   "
              f"{'relay':>9} {'r/bare':>7}   {'command':>9} {'bare':>9} {'ratio':>7}   "
              f"{'stats answer':>12} {'decode':>7}")
        for n in (1, 8, 32):
            res = bench_fan_out(n, rounds, tmp, min(tp_size, n))
            (stats, bare_stats), (command, bare_command), relay = res["stats"], res["command"], res["relay"]
            fresh = res["fresh"]
            print(f"{n:>4} {stats:>9.0f} {bare_stats:>9.0f} {stats / bare_stats:>7.2f}   "
                  f"{fresh:>9.0f} {fresh / bare_stats:>7.2f}   {relay:>9.0f} {relay / bare_stats:>7.2f}   "
                  f"{command:>9.0f} {bare_command:>9.0f} {command / bare_command:>7.2f}"
                  f"   {res['answer_bytes']:>10} B {res['decode']:>7.0f}", flush=True)
            for what, ratio in (("stats", stats / bare_stats), ("command", command / bare_command)):
                rows.append(Row(f"{what}[{n}] wsd/bare", ratio, BASELINES[what],
                                TARGETS[what] if n == 32 and tp_size == 1 else None))
            rows.append(Row(f"stats --fresh[{n}] wsd/bare", fresh / bare_stats, BASELINES["stats"]))
            rows.append(Row(f"relay[{n}] relay/bare", relay / bare_stats, BASELINES["stats"]))
        print()
        step, bare = bench_agreement(agree_rounds, calls, tmp)
        print(f"per-step agreement, 2 gloo ranks, median of {agree_rounds} interleaved rounds of {calls} calls (us)")
        print(f"{'Agent.step()':>12} {'all_reduce':>10} {'ratio':>7}")
        print(f"{step:>12.1f} {bare:>10.1f} {step / bare:>7.2f}")
        rows.append(Row("agreement wsd/bare", step / bare, BASELINES["agreement"], TARGETS["agreement"]))
        print()
        push_rounds, window = (6, 1.0) if quick else (20, 2.0)
        on, off = bench_push_overhead(push_rounds, window, tmp)
        print(f"engine steps per second, pushing on against off, median of {push_rounds} interleaved "
              f"windows of {window:g} s")
        print(f"{'on':>10} {'off':>10} {'ratio':>7}")
        print(f"{on:>10.0f} {off:>10.0f} {on / off:>7.3f}")
        rows.append(Row("step rate pushing on/off", on / off, "the same engine loop with pushes off",
                        PUSH_STEP_RATE_TARGET, at_least=True))
    print()
    print("recording one command (journal append + header, two fdatasyncs), median us:")
    for directory in dict.fromkeys([state_dir or tempfile.gettempdir(), tempfile.gettempdir()]):
        print(f"  {directory}: {state_write_cost(directory, 20 if quick else 100):.0f}"
              f"{'  (used above)' if directory == (state_dir or tempfile.gettempdir()) else ''}")
    print()
    for row in rows:
        if row.target is not None:
            print(f"target: {row.name} {'>=' if row.at_least else '<='} {row.target}: {row.value:.2f} "
                  f"({'met' if row.met else 'NOT met'})")
    return rows


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about half a minute)")
    parser.add_argument("--state-dir", default=_default_state_dir(),
                        help="where the coordinator's state file goes (default: /dev/shm if present); "
                        "its storage decides what the fdatasyncs of each command cost")
    parser.add_argument("--tp-size", type=int, choices=(1, 2, 4, 8), default=1,
                        help="the simulated ranks' TP group size (default 1, each rank its own group: "
                        "the targets' set-up)")
    args = parser.parse_args(argv)
    return run(args.quick, args.state_dir, args.tp_size)


if __name__ == "__main__":
    main()
