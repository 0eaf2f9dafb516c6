"""A vLLM worker's engine as wsd's patches see it: its calls, its warm-up, its sleep.

vLLM calls the worker's methods that wsd wraps (``patches``) and, since its GPU
worker's warm-up calls the worker's own ``execute_model`` and ``sample_tokens``,
it calls them from inside one another. The rule every wrapper keeps (``enter``
and ``leave``): only the outermost of the engine's calls on a thread counts;
one reached from inside another passes straight through to vLLM, so no wrapper
ever blocks on, re-enters or reorders another, whatever a release nests.

What each state is, and which vLLM call marks it (docs/vllm.md says the same):

- **warm**: the outermost ``compile_or_warm_up_model`` has returned. On a GPU
  that is after vLLM's CUDA-graph capture and the ``lock_workspace()`` that
  ends it (the V2 runner's ``capture_model``, inside that call); where vLLM
  never locks (``enforce_eager``, the CPU worker) it is the end of its warm-up.
  The steps its warm-up runs itself (the V2 runner's JIT warm-up calling
  ``execute_model``) are inside it and count as nothing. Nothing a
  coordinator sends, a replayed desired state included, applies before.
- **a step**: an outermost ``execute_model`` or ``execute_dummy_batch`` (a
  data-parallel rank's idle step), with ``sample_tokens`` as part of the
  engine's use of the workspace. Counted, and timed for stall detection, with
  no lock taken (``python -m bench --only wrapper`` measures what it costs).
- **asleep**: from the outermost ``sleep`` (marked before vLLM frees anything)
  to the ``wake_up`` that brings the KV cache back (no ``tags``, or
  ``"kv_cache"`` among them; a ``wake_up(tags=["weights"])`` leaves it asleep).
  Asleep, nothing applies, the engine is never woken for a waiting command,
  and no wsd thread touches the device.

Commands apply in one of two ways (``wsd.integrations.vllm.stream``): where
vLLM's engine core drives the workers through its ordered stream, the engine
core's round (``offer``, then ``settle``) between two steps; elsewhere the TP
group's agreement at the step boundary (``step``), or, for a TP group of one
rank with no engine core to ask, between the engine's steps on the agent's
thread (``step_between``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Engine", "Wake"]

logger = logging.getLogger(__name__)


class Engine:
    """This worker process's engine: its calls (``enter``/``leave``), steps, warm-up and sleep.

    The hot path (``enter``, ``step``, ``leave`` around every step) takes no lock: plain
    attribute writes by the engine's own thread. The one thread that may apply beside it,
    the agent's (``step_between``, only where no engine core drives the worker), excludes
    itself from the engine's steps by the two flags ``inside`` and ``applying``: each side
    sets its own, then reads the other's (CPython orders these plain reads and writes).
    """

    def __init__(self, failed: Callable[[BaseException], None]) -> None:
        """``failed(error)``: applying raised (it may raise in turn, to stop the engine)."""
        self._failed = failed
        self._local = threading.local()  # .depth: the engine's calls open on this thread
        self.inside = False
        """The engine's thread is inside one of its own outermost calls."""
        self.applying = False
        """The agent's thread is applying between the engine's steps (``step_between``)."""
        self._between = threading.Lock()  # held by the agent's thread while it applies
        self.warm = False
        self.asleep = False
        self.steps = 0
        """Engine steps (outermost ``execute_model``, ``execute_dummy_batch``) this process has run."""
        self.agent: Any = None
        """The attached agent (``wsd.agent.thread.Agent``), or None: standalone, or detached."""
        self.stream = False
        """The engine core drives this worker's rounds through vLLM's ordered stream."""
        self.group = 0
        """The worker's TP group (its index in its world)."""
        self.steered = True
        """Commands may apply here (``wsd.integrations.vllm.stream.steered``); if not, the worker
        only reports."""
        self._clock: Any = None  # the agent's StepClock, while warm and attached

    # -- attachment ----------------------------------------------------------------

    def attach(self, agent: Any, *, stream: bool, group: int, steered: bool = True) -> None:
        """The worker's agent from now on (None: standalone); ``stream``: the engine core drives
        its rounds (``wsd.integrations.vllm.stream.driven_by_engine_core``); ``group``: the
        worker's TP group, which its offers name; ``steered``: commands may apply here."""
        self.agent = agent
        self.stream = stream
        self.group = group
        self.steered = steered
        self._clock = agent.clock if agent is not None and self.warm else None

    def detach(self) -> None:
        self.agent = None
        self._clock = None

    # -- the engine's calls (the engine's thread) ------------------------------------

    def enter(self) -> bool:
        """One of the engine's wrapped calls begins; True when it is the outermost on this
        thread (the wrapper then does its part), False when vLLM called it from inside
        another (the wrapper passes straight through). Every ``enter`` has its ``leave``."""
        local = self._local
        depth = getattr(local, "depth", 0)
        local.depth = depth + 1
        if depth:
            return False
        self.inside = True
        if self.applying:  # the agent's thread is applying: let it finish first (rare)
            with self._between:
                pass
        clock = self._clock
        if clock is not None:
            clock.enter()
        return True

    def leave(self) -> None:
        local = self._local
        local.depth -= 1
        if local.depth:
            return
        clock = self._clock
        if clock is not None:
            clock.leave()
        self.inside = False

    def step(self) -> None:
        """An outermost engine step begins (after ``enter``): counted; where the TP group agrees
        at its steps, the agreement (every ``apply_every`` steps)."""
        self.steps += 1
        if not self.warm:
            self.warmed()  # an engine step comes after any warm-up: never wait for ever
        agent = self.agent
        if agent is None:
            return
        if self.stream or not self.steered:
            agent.count_step()
        elif not self.asleep:
            self._agree(agent, agree=False)

    def warmed(self) -> None:
        """vLLM's warm-up returned (its profile run, CUDA-graph capture and the lock after it):
        commands, a replayed desired state included, may apply from now on."""
        self.warm = True
        agent = self.agent
        if agent is not None:
            self._clock = agent.clock
            agent.mark_warm()

    def sleeping(self, asleep: bool) -> None:
        """The engine goes to sleep (True, before vLLM frees anything) or its KV cache is back
        (False)."""
        self.asleep = asleep
        agent = self.agent
        if agent is not None:
            agent.pause(asleep)

    def woke(self, tags: Any) -> None:
        """vLLM's ``wake_up(tags)`` returned: awake once the KV cache is back."""
        if tags is None or "kv_cache" in tags:
            self.sleeping(False)

    # -- rounds ----------------------------------------------------------------------

    def offer(self) -> dict[str, int] | None:
        """``wsd_offer``: what this worker holds and may apply, for its TP group; None where it
        takes no part (no agent, asleep)."""
        agent = self.agent
        if agent is None or self.asleep or not self.steered:
            return None
        return {"group": self.group, "held": agent.offer(), "applied": agent.applied_seq}

    def settle(self, agreed: dict[int, int]) -> list[int]:
        """``wsd_apply``: apply up to this worker's group's number in ``agreed`` (none: nothing)."""
        agent = self.agent
        if agent is None or self.asleep or not self.steered or self.group not in agreed:
            return []
        return self._guarded(lambda: agent.settle(agreed[self.group]))

    def agree_now(self) -> list[int]:
        """``wsd_step``: one agreement of the TP group, asked of every worker by the engine core
        (shapes where it does not drive the rounds through its stream)."""
        agent = self.agent
        if agent is None or self.asleep or not self.steered:
            return []
        return self._agree(agent, agree=True)

    def step_between(self) -> None:
        """On the agent's thread: one agreement (a TP group of one rank) if the engine is warm,
        awake and between two of its own steps; else nothing (its next wake-up asks again)."""
        if not self.warm or self.asleep or not self.steered or not self._between.acquire(blocking=False):
            return
        try:
            self.applying = True
            if not self.inside:
                agent = self.agent
                if agent is not None:
                    self._agree(agent, agree=True)
        finally:
            self.applying = False
            self._between.release()

    def _agree(self, agent: Any, *, agree: bool) -> list[int]:
        return self._guarded(lambda: agent.step(agree=agree))

    def _guarded(self, apply: Callable[[], list[int]]) -> list[int]:
        try:
            return apply()
        except Exception as e:
            self._failed(e)
            return []


class Wake:
    """The agent's ``on_pending``: how this worker gets a round out of its engine.

    Driven by its engine core (``stream``): ask the listener of an engine core in this
    process (``uni``), else tell the parent engine core over its socket (``mp``); a wake-up
    sent before the engine core listens is lost, and the agent asks again.

    Otherwise, in the order tried: an engine core in this process; a TP group of one rank,
    on the agent's thread between the engine's own steps (an engine in the caller's own
    process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); a parent engine core (an mp executor
    across nodes: it runs ``wsd_step`` on every worker); none of these (Ray workers, a
    multi-node follower, the external launcher with TP > 1): the command waits for the
    engine's next agreement, at most ``apply_every`` steps of traffic, said once at WARNING.
    """

    def __init__(self, engine: Engine, rank: int, tp_size: int, apply_every: int) -> None:
        from wsd.integrations.vllm.wake import WakeSender, wake_endpoint

        self.engine = engine
        self.rank = rank
        self.tp_size = tp_size
        self.apply_every = apply_every
        self.sender = WakeSender(wake_endpoint(os.getppid()))
        self._warned = False

    def __call__(self) -> None:
        from wsd.integrations.vllm.wake import local_listener

        listener = local_listener()
        if listener is not None:
            listener.request()
        elif self.engine.stream:
            self.sender()
        elif self.tp_size == 1:
            self.engine.step_between()
        elif self.sender.listening():
            self.sender()
        elif not self._warned:
            self._warned = True
            logger.warning("wsd: rank %d cannot wake its engine (no engine core listens at %s: "
                           "Ray, a multi-node follower or the external launcher); a waiting "
                           "command applies at the engine's next agreement step, within %d "
                           "steps of traffic", self.rank, self.sender.endpoint, self.apply_every)

    def close(self) -> None:
        self.sender.close()

