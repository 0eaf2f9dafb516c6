"""Commands through vLLM's own ordered stream: no agreement inside a step, no collective.

vLLM's engine core delivers every call to all the workers of an engine through
one ordered stream: ``MultiprocExecutor.collective_rpc`` puts each call, every
step's ``execute_model`` included, on one broadcast queue that each worker reads
in order, and the ``uni`` executor calls its one worker directly. A call that
the engine core puts in that stream between two steps therefore reaches every
worker between the same two steps. wsd's round is two such calls, made by the
engine core's own thread when a worker's agent asks for one (``wake``):

1. ``wsd_offer`` on every worker: the highest command each holds and may apply
   (nothing while the engine warms up or sleeps);
2. ``wsd_apply`` on every worker, with each TP group's agreed number (the
   lowest any member offered): each worker applies the commands up to it.

Every rank of a TP group thus applies the same commands between the same two
steps, by construction, with nothing on vLLM's TP ``cpu_group`` (which vLLM's
fault tolerance uses every step) and nothing inside ``execute_model``.

Where no engine core drives the workers through such a stream (vLLM's
``external_launcher`` under torchrun, an engine in the caller's own process,
an mp executor across nodes, Ray), the TP group agrees as before, with one
small ``all_reduce`` every ``apply_every`` steps (``wsd.agent.thread.Agent.step``),
on vLLM's gloo ``cpu_group`` of the TP group; except under vLLM's
``--enable-fault-tolerance``, whose barrier runs on that group every step and which
asks that nothing else run on it (vllm-project/vllm#48720): there a TP group of more
than one rank is not steered (``steered``): its ranks report, and apply no command.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ENGINE_CORE_PID", "STREAM_EXECUTORS", "WSD_APPLY", "WSD_OFFER", "agree", "driven_by_engine_core",
           "steered", "stream_shape"]

WSD_OFFER = "wsd_offer"
"""The worker method that offers what the worker holds: ``{"group": g, "held": n, "applied": m}``,
or None where it takes no part (wsd off in it, asleep)."""
WSD_APPLY = "wsd_apply"
"""The worker method that applies up to its TP group's agreed number."""

ENGINE_CORE_PID = "WSD_VLLM_ENGINE_CORE"
"""Set by vLLM's engine core process (``EngineCoreProc``) to its pid before it builds its
executor, so that the workers it spawns (and the one ``uni`` builds in it) know that an engine
core drives them; an engine in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) has
no such process, and nothing would drive its rounds."""

STREAM_EXECUTORS = ("mp", "uni")
"""The executors whose every call to the workers goes through one ordered stream that the engine
core feeds from one thread (Ray's compiled graph in 0.32 does not; 0.33's ``RayExecutorV2`` is an
``mp`` executor underneath but reports ``ray``, and its workers may live on other nodes, where a
worker cannot reach its engine core to ask for a round)."""


def stream_shape(parallel: Any) -> bool:
    """Whether vLLM's parallel configuration is one whose engine core feeds all its workers through
    one ordered stream from this node: an ``mp`` or ``uni`` executor on one node. The engine core
    and each of its workers read the same configuration, so they reach the same answer."""
    return parallel.distributed_executor_backend in STREAM_EXECUTORS and getattr(parallel, "nnodes", 1) == 1


def driven_by_engine_core(parallel: Any, env: Mapping[str, str], pid: int, ppid: int) -> bool:
    """In a worker: whether its engine core drives it through the ordered stream: the shape is
    one (``stream_shape``) and the engine core is this process (``uni``) or its parent (``mp``).
    Every worker of one engine answers alike: they share the configuration and the engine core."""
    owner = env.get(ENGINE_CORE_PID, "")
    return stream_shape(parallel) and owner.isdigit() and int(owner) in (pid, ppid)


def steered(parallel: Any, stream: bool, tp_size: int) -> bool:
    """Whether this worker's commands may apply: through the stream, in a TP group of one rank,
    or by the group's agreement on vLLM's ``cpu_group`` where vLLM's fault tolerance (0.33+,
    ``enable_fault_tolerance``) does not claim that group for itself."""
    return stream or tp_size == 1 or not getattr(parallel, "enable_fault_tolerance", False)


def agree(offers: Sequence[Mapping[str, int] | None]) -> dict[int, int] | None:
    """Each TP group's agreed number from every worker's offer (``wsd_offer``, in any order):
    the lowest ``held`` of its members. A group any member of which offered nothing (``None``
    makes every group wait: an offer that says nothing says no group either) or which has
    nothing new for any member is left out. None when no group has anything to apply, so that
    no second call is made."""
    present = [offer for offer in offers if offer is not None]
    if len(present) < len(offers):
        return None
    held: dict[int, int] = {}
    applied: dict[int, int] = {}
    for offer in present:
        group = offer["group"]
        held[group] = min(held.get(group, offer["held"]), offer["held"])
        applied[group] = min(applied.get(group, offer["applied"]), offer["applied"])
    agreed = {group: seq for group, seq in held.items() if seq > applied[group]}
    return agreed or None
