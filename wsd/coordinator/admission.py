"""What the coordinator lets in from its agent endpoint, and what it costs: ``AgentGate``.

Nothing a peer of the agent endpoint sends is believed until it passes here:

- **metering**, before a frame is decoded: a connection that has not registered
  may send registrations only (small and few), a registered one a bounded rate
  of bytes; the rest is dropped unread and counted;
- **identity**: with an agent token, each side proves it holds it afresh: an
  agent's first registration (with its nonce) is answered with a challenge (the
  coordinator's nonce and its proof), and only a second one that proves it over
  both nonces (``wsd.security.registration_proof``) registers, once: the
  challenge is spent, and the two nonces key the registration's commands;
- **claims**: sequence numbers beyond what the coordinator issued are capped;
- **events** from a source a peer controls are rate-limited, the rest summed up;
- **liveness** is judged only up to when every waiting frame was read (at most
  one heartbeat timeout behind), so that a flood can make no live rank look silent.

Plain logic with the coordinator's clock; no I/O. Imports no torch.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

from wsd.coordinator.ratelimit import RateLimit
from wsd.errors import Unauthenticated
from wsd.security import challenge_proof, new_nonce, registration_proof, same_proof, session_key
from wsd.wire import protocol as p

__all__ = ["FRAMES_PER_SECOND", "MAX_CHALLENGES", "PUSH_RATE", "TOO_LARGE", "UNREGISTERED_FRAME",
           "AgentGate", "Proven", "Unauthenticated"]

UNREGISTERED_FRAME = p.REGISTER_BYTES
"""The largest frame a connection that has not registered may send (a registration)."""
TOO_LARGE = "too large before registering"
PUSH_RATE = "stats push rate"
REFUSAL_REASONS = ("rate", TOO_LARGE, PUSH_RATE, "stats reply not asked for", "heartbeat beyond the issued seq",
                   "goodbye beyond the issued seq", "registration forbidden", "registration conflict",
                   "registration mismatch")
"""Every reason ``refused`` counts: the metric has a sample of each from the start (0), so that
``rate()`` and ``increase()`` see its first refusal."""
"""The reason counted for a frame over UNREGISTERED_FRAME."""
_UNREGISTERED_RATE = (p.REGISTER_BYTES, 2 * p.REGISTER_BYTES)  # bytes a second, burst
# A registered agent: heartbeats, acknowledgements and events of a few hundred
# bytes, and stats replies when asked (up to max_agent_message_bytes).
_REGISTERED_RATE = (1 << 20, 4 << 20)
# The least a frame counts for, so that a flood of tiny frames is metered too: before
# registering (its registrations, and garbage), and once registered.
_FRAME_COST, _REGISTERED_FRAME_COST = 256, 4096
FRAMES_PER_SECOND = _REGISTERED_RATE[0] / _REGISTERED_FRAME_COST
"""The most frames a registered connection may have read a second, however small (256): an
agent sends a heartbeat a second, pushes at most every 50 ms, an ack per command."""
_EVENT_RATE = (10.0, 50.0)  # events a source may add: a second, burst
# What taking in a pushed snapshot costs the coordinator, in microseconds of its loop:
# a delta of a few bytes is merged into the rank's whole snapshot, so its cost grows with
# that snapshot's slots (0.5 ms at 4,096 slots), not with its own bytes. Each rank may cost
# 1% of a core a second in pushes, in bursts of 5%: a real agent pushes at most every
# 50 ms (20 a second, about 9 ms at 4,096 slots); one pushing faster is refused.
_PUSH_COST = (30.0, 0.12)  # microseconds: a push, and each slot of its snapshot
_PUSH_RATE = (10_000.0, 50_000.0)  # microseconds a second, burst
MAX_CHALLENGES = 16384
"""Challenges outstanding at most (the oldest goes first): each is a connection's, answered
within a heartbeat timeout or spent."""


class Proven(NamedTuple):
    """A registration that proved it holds the agent token: its two nonces and the key of
    its commands."""

    nonce: str
    challenge: str
    key: bytes


class AgentGate:
    """The agent endpoint's admission: meters, the token check, claims, event budgets.

    ``refused`` counts what was refused or capped, by reason (``status`` shows it
    as ``agents_refused``, the metrics as ``wsd_agent_refusals_total``).
    """

    def __init__(self, token: bytes | None, heartbeat_timeout: float, clock: Callable[[], float]) -> None:
        self.token = token
        """Registrations must prove they hold it; None: they are not authenticated."""
        self._timeout = heartbeat_timeout
        self._clock = clock
        self._unregistered = RateLimit(*_UNREGISTERED_RATE)
        self._registered = RateLimit(*_REGISTERED_RATE)
        self._events = RateLimit(*_EVENT_RATE)
        self._pushes = RateLimit(*_PUSH_RATE)
        self.refused: Counter[str] = Counter()
        self._suppressed: Counter[str] = Counter()
        self._heard_until: float | None = None
        # Per connection, the challenge it was sent: (agent nonce, coordinator nonce, expiry).
        self._challenges: OrderedDict[bytes, tuple[str, str, float]] = OrderedDict()

    # -- frames ---------------------------------------------------------------------

    def meter(self, peer: bytes, size: int, *, registered: bool) -> str | None:
        """Why this connection's frame is dropped unread (its size or its rate), or None."""
        if not registered:
            if size > UNREGISTERED_FRAME:
                reason = TOO_LARGE
            elif self._unregistered.allow(peer, self._clock(), max(size, _FRAME_COST)):
                return None
            else:
                reason = "rate"
        elif self._registered.allow(peer, self._clock(), max(size, _REGISTERED_FRAME_COST)):
            return None
        else:
            reason = "rate"
        self.refused[reason] += 1
        return reason

    def push_allowed(self, rank: Hashable, slots: int) -> bool:
        """Whether a rank's pushed snapshot of ``slots`` slots (the larger of the one held and the
        one pushed) may be taken in now; counted when refused."""
        if self._pushes.allow(rank, self._clock(), _PUSH_COST[0] + _PUSH_COST[1] * slots):
            return True
        self.refused[PUSH_RATE] += 1
        return False

    def allow(self, source: Hashable) -> bool:
        """Whether ``source`` may have one more answer or log line now (the event budget)."""
        return self._events.allow(source, self._clock())

    # -- registrations and claims ------------------------------------------------------

    def challenge(self, peer: bytes, nonce: str) -> dict[str, str]:
        """The CHALLENGE body for a connection's first registration (with the agent's ``nonce``):
        the coordinator's own nonce and its proof that it holds the token."""
        assert self.token is not None
        while len(self._challenges) >= MAX_CHALLENGES:
            self._challenges.popitem(last=False)
        challenge = new_nonce()
        self._challenges.pop(peer, None)
        self._challenges[peer] = (nonce, challenge, self._clock() + self._timeout)
        return {"nonce": challenge, "proof": challenge_proof(self.token, nonce, challenge)}

    def authenticate(self, peer: bytes, body: dict[str, Any]) -> Proven | None:
        """The proof of a second registration, checked against the challenge this connection
        was sent, which is spent either way; None without a token. Unauthenticated otherwise."""
        if self.token is None:
            return None
        sent = self._challenges.pop(peer, None)
        fix = "give the worker the same WSD_AGENT_TOKEN or [security] agent_token_file"
        if sent is None or sent[2] < self._clock() or (sent[0], sent[1]) != (body["nonce"], body["challenge"]):
            raise Unauthenticated(
                f"rank {body['rank']}: registration refused: it answers no challenge this coordinator sent "
                f"to its connection, or one spent or expired (a registration replayed, or one that took "
                f"longer than heartbeat_timeout: it starts again by itself)")
        expected = registration_proof(self.token, body["rank"], body["instance"] or "", body["engine"],
                                      sent[0], sent[1])
        if not same_proof(body["proof"], expected):
            raise Unauthenticated(
                f"rank {body['rank']}: registration refused: it does not prove it holds this coordinator's "
                f"agent token ({fix})")
        return Proven(sent[0], sent[1], session_key(self.token, sent[0], sent[1]))

    def believable(self, body: dict[str, Any], what: str, issued: int) -> dict[str, Any]:
        """A heartbeat's or goodbye's seqs, never beyond ``issued`` (counted when capped)."""
        claims = [body.get(k) for k in ("applied_seq", "held_seq")]
        if not any(c is not None and c > issued for c in claims):
            return body
        self.refused[f"{what} beyond the issued seq"] += 1
        return {**body, **{k: min(c, issued) for k, c in zip(("applied_seq", "held_seq"), claims) if c is not None}}

    # -- events --------------------------------------------------------------------------

    def event_allowed(self, source: Hashable, kind: str) -> bool:
        """Whether an event from ``source`` (a rank, refused registrations) is kept; those
        that are not are counted by kind, for ``take_suppressed``."""
        if self.allow(source):
            return True
        self._suppressed[kind] += 1
        return False

    def take_suppressed(self) -> dict[str, int]:
        """Events dropped since the last call, by kind (empty if none)."""
        taken, self._suppressed = dict(self._suppressed), Counter()
        return taken

    # -- liveness ---------------------------------------------------------------------------

    def note_heard(self, until: float) -> None:
        """The socket loop: every agent frame that arrived before ``until`` has been read."""
        self._heard_until = until

    def heard(self, now: float) -> float:
        """The time up to which ranks are judged silent.

        Frames waiting unread behind a burst are the coordinator's delay, not the
        ranks' silence: up to when every waiting frame was read. But never more than
        a heartbeat timeout behind, so that a flood that keeps frames waiting delays
        finding a dead rank by one timeout at most, and does not stop it.
        """
        if self._heard_until is None:
            return now
        return max(min(now, self._heard_until), now - self._timeout)
