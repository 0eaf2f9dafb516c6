"""The ``wsctl`` command's entry point.

``wsctl --version`` is answered here, before ZeroMQ, msgpack and the parser of
every command are imported (about a tenth of a second on a busy node); anything
else goes to ``wsd_client.wsctl``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--version"]:  # what argparse's version action prints
        from wsd.version import __version__

        print(f"wsctl {__version__}")
        return 0
    from wsd_client.wsctl import main as wsctl

    return wsctl(args)
