"""Every module but the torch side imports without torch: the coordinator and the clients run
on machines with none."""

from __future__ import annotations

import sys

from modulekit import TORCH_FREE, TORCH_SIDE, WSD_MODULES, run


def test_client_side_imports_without_torch():
    """Fails if any module outside TORCH_SIDE, or any client module, imports torch at import time."""
    assert TORCH_SIDE <= set(WSD_MODULES), TORCH_SIDE - set(WSD_MODULES)
    for package in ("wsd.coordinator", "wsd.wire"):  # torch-free as a whole
        assert not {m for m in TORCH_SIDE if m.startswith(package + ".")}
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any 'import torch' now raises
        f"import importlib; [importlib.import_module(m) for m in {TORCH_FREE!r}]\n"
        "import wsd; wsd.load_config(None, env={})\n"
        "print('ok')\n"
    )
    result = run(sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
