"""What wsd's wrapper of vLLM's ``execute_model`` costs per step, against the method unwrapped.

The wrapper is the one the plugin installs (``wsd.integrations.vllm.install``), around
the plugin's engine (``wsd.integrations.vllm.lifecycle.Engine``) attached as it is in a
worker whose engine core drives the rounds: each step is counted and timed for stall
detection, with no lock. Both are timed side by side, interleaved, in one run; the
figure is the extra time per step, in microseconds (target: at most 1 µs).

Run: ``python -m bench.bench_wrapper [--quick]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.helpers import Row
from wsd.agent.stacks import StepClock
from wsd.integrations.vllm import install
from wsd.integrations.vllm.lifecycle import Engine


class _Agent:
    """What the engine asks of an attached agent on every step (its step count and clock)."""

    def __init__(self) -> None:
        self.clock = StepClock(time.monotonic)
        self.steps = 0

    def count_step(self) -> None:
        self.steps += 1

    def mark_warm(self) -> None:
        pass


class _Worker:
    def execute_model(self, scheduler_output: Any) -> Any:
        return scheduler_output


def _per_call(call: Callable[[], Any], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - start) / n


def run(quick: bool) -> list[Row]:
    engine = Engine(print)
    engine.attach(_Agent(), stream=True, group=0)
    engine.warmed()
    plain = _Worker()
    wrapped_class: Any = type("Wrapped", (_Worker,), {})
    wrapped_class.execute_model = install._stepping(engine)(_Worker.execute_model)
    wrapped = wrapped_class()
    n, rounds = (20_000, 7) if quick else (100_000, 15)
    extra = []
    for _ in range(rounds):  # interleaved: the machine's noise hits both alike
        bare = _per_call(lambda: plain.execute_model(None), n)
        mine = _per_call(lambda: wrapped.execute_model(None), n)
        extra.append((mine - bare) * 1e6)
    extra.sort()
    median = extra[len(extra) // 2]
    print(f"execute_model wrapper: {median:.3f} µs per step over the method unwrapped "
          f"(median of {rounds} interleaved rounds of {n} calls)")
    return [Row("vLLM step wrapper, extra per step", median, "unwrapped method", target=1.0, unit=" µs")]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    run(parser.parse_args(argv).quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
