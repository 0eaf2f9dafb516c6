"""``wsctl``: the ops command line of wsd (its commands arrive with the control plane)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="wsctl", description="Query and steer a wsd coordinator over ZeroMQ."
    )
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
