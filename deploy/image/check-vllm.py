"""The vLLM image's build check (deploy/image/vllm.Containerfile): wsd's plugin is one that
vLLM loads, and it and what it needs import beside this vLLM.

Exits 1 naming what is wrong; says which vLLM it found, and whether wsd was verified with it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys


def main() -> int:
    plugins = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "wsd"]
    if [e.value for e in plugins] != ["wsd.integrations.vllm:register"]:
        print(f"check-vllm: wsd's vLLM plugin entry point is {[e.value for e in plugins]}, expected "
              "['wsd.integrations.vllm:register']", file=sys.stderr)
        return 1
    for module in ("zmq", "msgpack", "prometheus_client", "wsd.integrations.vllm.plugin", "vllm"):
        try:
            importlib.import_module(module)
        except Exception as e:  # anything an import raises fails the build, named
            print(f"check-vllm: cannot import {module}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    from wsd.integrations.vllm.patches import CHECKED_VERSIONS, vllm_version

    version = vllm_version()
    verified = version.split("+")[0] in CHECKED_VERSIONS
    print(f"check-vllm: vLLM {version} ({'verified' if verified else 'not verified'} with wsd; "
          f"verified: {', '.join(CHECKED_VERSIONS)}), wsd's plugin loads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
