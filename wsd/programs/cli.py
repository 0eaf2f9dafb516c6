"""``wsd``: the service's own command line.

``wsd up`` starts a whole local cluster (a coordinator and ``torchrun``
workers) until Ctrl-C. ``wsd coordinator`` runs the coordinator alone, in the
foreground, as a sidecar; it imports no torch. ``wsd demo`` runs a manager
sized from configuration through a short engine life (warm-up, equalize, lock,
steady state, one over-size request) and prints its per-slot statistics.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from collections.abc import Sequence

from wsd import __version__
from wsd.config import flag_number
from wsd.errors import ConfigError, ExitCode, StateFileError, WsdError

logger = logging.getLogger("wsd")

MAX_LOCAL_WORKERS = 1024
"""Most workers ``wsd up`` starts: one machine's worth; more is a typo."""
MAX_DEMO_STEPS = 1_000_000
"""Most steady steps ``wsd demo`` runs; more is a typo."""


NEEDS_TORCH = ("wsd {command} needs torch, which this environment lacks: install the worker extra, torch "
               "first (pip install torch==2.13.0 && pip install -e '.[worker]' from a checkout); "
               "wsd coordinator and wsctl need no torch")


def has_torch() -> bool:
    """Whether torch can be imported here, without importing it (seconds)."""
    import importlib.util

    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # ValueError: a None in sys.modules, as a blocked import is
        return False


def device_flag(name: str) -> str:
    """``--device``: a torch device this machine has. A usage error (exit 2, USAGE) names the fix for
    a CUDA device on a machine without CUDA, where torch would fail in the first allocation
    with a traceback, and for no torch at all. Imports torch (only ``wsd demo`` has the flag)."""
    if not has_torch():
        raise argparse.ArgumentTypeError(NEEDS_TORCH.format(command="demo"))
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{name} needs CUDA, which this machine does not have: use --device cpu")
    return name


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wsd", description="wsd: a distributed workspace service for GPU inference clusters."
    )
    parser.add_argument("--version", action="version", version=f"wsd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo = sub.add_parser(
        "demo", help="run one manager through warm-up, lock and steady state; print its stats"
    )
    demo.add_argument("--config", help="TOML configuration file (default: $WSD_CONFIG or defaults)")
    demo.add_argument("--device", type=device_flag, default="cpu", help="torch device (default: cpu)")
    demo.add_argument("--steps", type=flag_number(int, 1, MAX_DEMO_STEPS, what="an integer"), default=100,
                      help=f"steady-state steps, 1..{MAX_DEMO_STEPS} (default: 100)")
    up = sub.add_parser(
        "up", help="start a local cluster: a coordinator and torchrun workers, until Ctrl-C, SIGTERM or SIGHUP",
        epilog="A worker that dies is reported in one line and not restarted; the coordinator keeps serving "
               "until Ctrl-C, so that wsctl shows the rank lost. Exit codes: "
               f"{ExitCode.OK:d} stopped by Ctrl-C, SIGTERM or SIGHUP, or the workers finished; "
               f"{ExitCode.USAGE:d} a bad configuration; {ExitCode.RANK_LOST:d} a rank lost; "
               f"{ExitCode.ERROR:d} otherwise.",
    )
    up.add_argument("--nproc", type=flag_number(int, 1, MAX_LOCAL_WORKERS, what="an integer"), default=2,
                    help=f"worker processes, 1..{MAX_LOCAL_WORKERS} (default: 2)")
    up.add_argument("--config", help="TOML configuration file (default: $WSD_CONFIG or defaults)")
    up.add_argument("--fresh", action="store_true",
                    help="start from an empty state: remove this cluster's state file and journal first")
    coordinator = sub.add_parser(
        "coordinator", help="run the coordinator alone in the foreground, until SIGTERM or Ctrl-C"
    )
    coordinator.add_argument("--config", help="TOML configuration file (default: $WSD_CONFIG or defaults)")
    coordinator.add_argument("--exit-with-parent", action="store_true",
                             help="also exit when the process that started it ends (embedded mode)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {socket.gethostname()} wsd-{args.command} %(name)s %(levelname)s %(message)s",
    )
    try:
        if args.command in ("up", "demo") and not has_torch():
            raise ConfigError(NEEDS_TORCH.format(command=args.command))
        if args.command == "up":
            from wsd.programs.up import up

            return up(args.nproc, args.config, fresh=args.fresh)
        if args.command == "coordinator":
            from wsd.config import load_config
            from wsd.programs.coordinator import serve_coordinator

            return serve_coordinator(load_config(args.config), exit_with_parent=args.exit_with_parent)
        if args.command == "demo":
            from wsd.manager.demo import run_demo

            print(run_demo(args.config, args.device, args.steps))
            return ExitCode.OK
    except ConfigError as e:  # a bad file, variable or flag, or an endpoint that cannot be bound
        print(f"wsd: configuration error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    except StateFileError as e:  # at start-up: the state file is unreadable, damaged or has no folder
        print(f"wsd: state file error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    except WsdError as e:
        print(f"wsd: {e}", file=sys.stderr)
        return ExitCode.ERROR
    parser.error(f"unknown command {args.command!r}")
    return ExitCode.USAGE


if __name__ == "__main__":
    sys.exit(main())
