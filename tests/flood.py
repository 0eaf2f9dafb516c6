"""A hostile peer of the agent endpoint, as a process of its own:
``python tests/flood.py ENDPOINT SECONDS BIG_BYTES``.

It never registers. It sends two frames of BIG_BYTES (the issue's attack: 15 MB,
under the 16 MiB limit of the time) made of nothing but empty lists (the most
objects per byte msgpack can be made to build), then, for SECONDS, as
many 4 KB frames of the same kind as the coordinator takes, from four
connections; and prints ``sent N`` at the end. A process of its own, so that
its sending competes with the coordinator and the real ranks for the CPU as an
attacker's would, and not for one interpreter's lock.
"""

from __future__ import annotations

import sys
import time

import msgpack
import zmq
from zmqkit import Sockets

from wsd.wire.protocol import PROTOCOL_VERSION


def nested(size: int) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "op": "heartbeat", "id": 0,
                          "body": {"rank": 0, "step": 0, "applied_seq": 0, "held_seq": 0,
                                   "state": {"x": [[]] * (size - 80)}}})


def main(endpoint: str, seconds: float, big_bytes: int) -> int:
    sockets = Sockets()
    socks = [sockets.socket(zmq.DEALER, connect=endpoint, sndtimeo=100) for _ in range(4)]
    big, small = nested(big_bytes), nested(4000)
    for sock in socks[:2]:
        sock.send(big)
    sent = 2
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for sock in socks:
            try:
                sock.send(small)
                sent += 1
            except zmq.Again:  # the coordinator's queue for us is full: it reads at its pace
                pass
    print(f"sent {sent}", flush=True)
    sockets.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3])))
