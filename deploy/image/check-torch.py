"""Exit 0 if the torch installed is the build the image asked for, else say which it is.

    python check-torch.py cuda|cpu|none

Run by the Containerfile once everything is installed, so that an image asked
for with TORCH=cpu cannot ship the CUDA build (or none at all) by accident, nor
TORCH=none carry a torch some dependency pulled in, nor a torch ship without
the numpy it imports at start-up (it warns "Failed to initialize NumPy" then,
in every worker). Importable without torch.
"""

from __future__ import annotations

import importlib.util
import sys

BUILDS = ("cuda", "cpu", "none")


def installed_build() -> str:
    """"none" without torch, else "cuda" for a CUDA build and "cpu" for any other."""
    if importlib.util.find_spec("torch") is None:
        return "none"
    import torch

    return "cuda" if torch.version.cuda else "cpu"


def numpy_works() -> bool:
    """Whether torch initialised numpy: a tensor made from an array is the proof."""
    import torch

    try:
        import numpy
    except ImportError:
        return False
    try:
        return torch.from_numpy(numpy.zeros(1)).numel() == 1
    except (RuntimeError, TypeError):
        return False


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in BUILDS:
        print(f"usage: check-torch.py {'|'.join(BUILDS)}", file=sys.stderr)
        return 2
    got = installed_build()
    if got != argv[0]:
        print(f"TORCH={argv[0]} was asked for, but the torch installed is {got}", file=sys.stderr)
        return 1
    if got != "none" and not numpy_works():
        print(f"TORCH={got}: torch cannot use numpy (not installed, or not a version it can load)",
              file=sys.stderr)
        return 1
    print(f"torch: {got}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
