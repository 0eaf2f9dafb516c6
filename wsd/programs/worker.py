"""``python -m wsd.worker --config FILE [--idle]``: one wsd worker, run by torchrun.

Reads the torchrun environment, initialises ``torch.distributed`` and the TP
groups, builds the manager from configuration, starts the agent (and, when
``[coordinator] mode = "embedded"``, rank 0 starts the coordinator as a child
process first), then runs the built-in engine loop, or with ``--idle`` only
serves the manager. SIGTERM and SIGINT end it cleanly at the next step
boundary, on every rank at the same step. When another rank of the job dies,
the next collective fails: the worker says so in one line and exits
``ExitCode.RANK_LOST``, so that the launcher can tell the rank that died from those that
stopped because of it.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import secrets
import socket
import sys
import threading
from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from wsd.agent.thread import Agent
from wsd.config import CoordinatorMode, Presize, WsdConfig, load_config
from wsd.errors import ConfigError, ExitCode, LaunchError
from wsd.manager.core import WorkspaceManager
from wsd.programs.coordinator import CoordinatorProcess, stop_signals
from wsd.security import AGENT_TOKEN_ENV, load_agent_token
from wsd.wire.curve import agent_keys
from wsd.worker.distributed import (
    DistContext,
    TorchrunEnv,
    any_rank,
    broadcast_from_rank0,
    init_distributed,
    read_torchrun_env,
)
from wsd.worker.workload import TensorParallelMlp, run_workload

logger = logging.getLogger("wsd.programs.worker")

# An idle worker looks at its stop flag this often.
_IDLE_POLL = 0.5
# gloo reports a broken connection to another rank as a plain RuntimeError whose
# message starts with the transport source file: "[.../gloo/transport/tcp/pair.cc:537] Read error ...".
_GLOO_TRANSPORT = re.compile(r"^\[[^\]]*gloo/transport/[^\]]*\]\s*")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m wsd.worker",
                                     description="A wsd worker: run it under torchrun (or wsd up).")
    parser.add_argument("--config", help="TOML configuration file (default: $WSD_CONFIG or defaults)")
    parser.add_argument("--idle", action="store_true",
                        help="serve the manager without compute: commands apply on receipt")
    return parser


def _setup_logging(env: TorchrunEnv) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {socket.gethostname()} rank {env.rank}/{env.world_size} "
               f"%(name)s %(levelname)s %(message)s",
    )


def _agent_endpoint(config: WsdConfig, ctx: DistContext,
                    token: bytes | None) -> tuple[str, bytes | None, CoordinatorProcess | None]:
    """Where the agents connect, and the agent token; when embedded, rank 0 starts the
    coordinator first (collective) and, unless one was given, makes up the token."""
    coordinator = config.coordinator
    if coordinator.mode is CoordinatorMode.EXTERNAL:
        return coordinator.connect_endpoint or coordinator.agent_endpoint, token, None
    child = None
    found: tuple[str, bytes] | None = None
    refused: str | None = None  # rank 0's coordinator refused its configuration: why
    if ctx.env.rank == 0:
        token = token or secrets.token_hex(32).encode()
        try:
            child = CoordinatorProcess(
                config.source if config.source != "<defaults>" else None,
                env=_child_env(ctx, token), exit_with_parent=True,
            ).start(config.worker.coordinator_start_timeout)
            endpoint = coordinator.connect_endpoint or _reachable(child.agent_endpoint)
            found = (endpoint, token)
            logger.info("embedded coordinator: clients on %s (agents on %s)", child.client_endpoint, endpoint)
        except ConfigError as e:
            refused = str(e)
            logger.error("rank 0 could not start the embedded coordinator: %s", e)
        except LaunchError:
            logger.exception("rank 0 could not start the embedded coordinator")
    # Every rank joins the broadcast, also when rank 0 failed, so that none hangs in it.
    # The token travels on the job's own process group, as its tensors do.
    found = broadcast_from_rank0(found if found is not None else refused, ctx.control_group)
    if isinstance(found, str):  # the configuration, on every rank: exit 2 everywhere
        raise ConfigError(f"the embedded coordinator refused its configuration: {found}")
    if found is None:
        raise LaunchError("rank 0 could not start the embedded coordinator; its log says why")
    return found[0], found[1], child


def _child_env(ctx: DistContext, token: bytes) -> dict[str, str]:
    # The coordinator knows the whole world from the start, so it can name ranks never seen,
    # and admits only the job's own agents.
    return {**os.environ, "WSD_COORDINATOR_WORLD_SIZE": str(ctx.env.world_size),
            "WSD_COORDINATOR_TP_SIZE": str(ctx.tp_size), AGENT_TOKEN_ENV: token.decode()}


def _reachable(bound: str) -> str:
    """A bound endpoint as other hosts reach it: a wildcard host becomes this host's name."""
    return re.sub(r"^tcp://(0\.0\.0\.0|\*|\[::\])(:\d+)$", rf"tcp://{socket.gethostname()}\2", bound)


def peer_gone(error: BaseException) -> str | None:
    """Why a collective failed, in one line, if it failed because another rank is gone
    (its connection broke); None for any other error."""
    if not isinstance(error, RuntimeError):
        return None
    first = (str(error).splitlines() or [""])[0]
    transport = _GLOO_TRANSPORT.match(first)
    if transport is not None:  # its first sentence; the rest is advice on hangs
        return "gloo: " + re.split(r"(?<=\.)\s", first[transport.end():], maxsplit=1)[0]
    if isinstance(error, dist.DistNetworkError):
        return first
    return None


@record
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        env = read_torchrun_env()
        config = load_config(args.config)
        curve = agent_keys(config.security)  # key files checked before anything starts
        token = load_agent_token(config.security)
    except ConfigError as e:
        print(f"wsd.programs.worker: {e}", file=sys.stderr)
        return ExitCode.USAGE
    _setup_logging(env)
    stop = threading.Event()
    ctx = agent = child = None
    clean = False  # only a clean shutdown says goodbye: a worker dying of an error is lost
    with stop_signals(lambda signum: stop.set()):
        try:
            ctx = init_distributed(env, config.worker)
            manager = WorkspaceManager.from_config(ctx.device, config)
            endpoint, token, child = _agent_endpoint(config, ctx, token)
            agent = Agent(
                manager, endpoint=endpoint, rank=env.rank, world_size=env.world_size,
                tp_size=ctx.tp_size, tp_group=ctx.tp_side_group, idle=args.idle, config=config.agent,
                heartbeat_interval=config.coordinator.heartbeat_interval,
                heartbeat_timeout=config.coordinator.heartbeat_timeout,
                extra={"backend": ctx.backend, "local_rank": env.local_rank, "idle": args.idle},
                curve=curve, token=token, warm=args.idle,  # the workload says when it is warm
                presize=config.workspace.presize is Presize.PROFILE and not args.idle,
            ).start()
            logger.info("%r on %s, TP group %d of size %d, agent to %s", manager, ctx.backend,
                        ctx.tp_index, ctx.tp_size, endpoint)
            if args.idle:
                while not stop.wait(_IDLE_POLL):
                    pass
                logger.info("stopped cleanly (idle)")
            else:
                mlp = TensorParallelMlp(config.workload, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size,
                                        device=ctx.device, group=ctx.tp_group)
                # Before warm-up: the slots start at what the profile saw them need.
                agent.presize_from_profile(config.agent.connect_timeout)
                group = ctx.control_group
                result = run_workload(manager, mlp, config.workload, step_boundary=agent.step,
                                      should_stop=lambda: any_rank(stop.is_set(), group), wait=stop.wait,
                                      warmed=agent.mark_warm, stepping=agent.stepping)
                logger.info("stopped cleanly after %d steps, %d lock violations",
                            result.steps, result.violations)
            clean = True
            return ExitCode.OK
        except ConfigError as e:
            logger.error("%s", e)
            return ExitCode.USAGE
        except RuntimeError as e:
            why = peer_gone(e)
            if why is None:
                raise
            # Stopped in order, because of another rank: say goodbye, so that only
            # the rank that died shows as lost.
            logger.error("stopping: another rank of the job is gone (%s)", why)
            clean = True
            return ExitCode.RANK_LOST
        finally:
            if agent is not None:
                agent.stop(goodbye=clean)
            if child is not None:
                child.stop()
            if ctx is not None and dist.is_initialized():
                dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
