"""Token buckets by key: how much each peer may cost the coordinator per second.

Plain logic with the caller's clock; no I/O. The coordinator meters agent
frames per connection before decoding them, and the events each rank or
connection may add to the event log, so that one flooding peer can neither
stall the loop nor push everyone else's events out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

__all__ = ["RateLimit"]


class RateLimit:
    """Per key, ``rate`` units a second with bursts up to ``burst``.

    At most ``keys`` keys are remembered, the least recently seen forgotten
    first: a forgotten key starts again with a full bucket, so memory stays
    bounded whatever the number of peers.
    """

    def __init__(self, rate: float, burst: float, *, keys: int = 4096) -> None:
        if rate <= 0 or burst <= 0 or keys < 1:
            raise ValueError(f"rate, burst and keys must be positive, got {rate}, {burst}, {keys}")
        self.rate = rate
        self.burst = burst
        self._keys = keys
        self._buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()  # key: (tokens, at)
        self.refused = 0
        """Units refused in all (for counters and tests)."""

    def allow(self, key: Hashable, now: float, cost: float = 1.0) -> bool:
        """Take ``cost`` units from ``key``'s bucket if it holds them; False (nothing taken) if not."""
        tokens, at = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - at) * self.rate)
        allowed = tokens >= cost
        if allowed:
            tokens -= cost
        else:
            self.refused += 1
        self._buckets[key] = (tokens, now)
        if len(self._buckets) > self._keys:
            self._buckets.popitem(last=False)
        return allowed

    def forget(self, key: Hashable) -> None:
        self._buckets.pop(key, None)
