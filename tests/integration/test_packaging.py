"""The installed package: torch-free imports, console scripts, public surface."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from modulekit import TORCH_FREE, TORCH_SIDE, run

import wsd


def test_nothing_but_the_integration_imports_vllm():
    """wsd, its manager, agent, coordinator and wsctl never import vLLM, and the plugin's
    entry point, unconfigured, does nothing: not even that import."""
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # any 'import vllm' now raises
        "import importlib\n"
        f"for m in {TORCH_FREE + sorted(TORCH_SIDE)!r}: importlib.import_module(m)\n"
        "import os; [os.environ.pop(k, None) for k in ('WSD_CONFIG', 'WSD_COORDINATOR_CONNECT_ENDPOINT')]\n"
        "import wsd.integrations.vllm as plugin; plugin.register()\n"
        "print('ok')\n"
    )
    result = run(sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_manager_names_load_lazily_from_wsd():
    assert wsd.WorkspaceManager.__module__ == "wsd.manager.core"
    for name in wsd.__all__:
        assert getattr(wsd, name) is not None


def test_public_surface_is_pinned():
    """A change to what `wsd` exports must be deliberate: update this list with it."""
    assert wsd.__all__ == sorted([
        "ConfigError", "GrowthPolicy", "LockViolation", "LockedGrowthPolicy", "ManagerStats", "PersistentStats",
        "SlotOutOfRangeError", "SlotStats", "WorkspaceCaptureError", "WorkspaceConfig",
        "WorkspaceError", "WorkspaceLimitError", "WorkspaceLockHeldError", "WorkspaceLockedError", "WorkspaceManager",
        "WorkspaceNotInitializedError", "WsdConfig", "WsdError", "__version__",
        "current_lane", "current_ubatch", "current_workspace_manager", "init_workspace_manager",
        "is_workspace_manager_initialized", "load_config", "lock_workspace",
        "reset_workspace_manager", "unlock_workspace", "use_lane", "use_ubatch",
    ])


def test_wsctl_starts_with_only_what_its_command_needs():
    """A fresh wsctl once took 3.6 times a bare interpreter for --version (python -m bench
    --only wsctl): ``import wsd`` loaded every configuration section, the client CURVE's
    asyncio-based ZAP thread. Now --version loads nothing of the client, ``import wsd``
    nothing of wsd's but ``wsd.version`` (the release, on the shared floor), and a
    command's parser no configuration loader, ZAP thread nor contexts file reader."""
    code = (
        "import sys, io, contextlib\n"
        "from wsd_client.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out: code = main(['--version'])\n"
        "assert code == 0 and out.getvalue().startswith('wsctl '), out.getvalue()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('wsd', 'wsd_client', 'zmq', 'msgpack')))\n"
        "import wsd_client.wsctl\n"
        "print(sorted(m for m in ('wsd.config', 'zmq.auth.thread', 'asyncio', 'wsd_client.contexts', 'torch')\n"
        "             if m in sys.modules))\n"
    )
    result = run(sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["['wsd', 'wsd.version', 'wsd_client', 'wsd_client.cli']", "[]"]


def test_py_typed_is_shipped():
    assert (Path(wsd.__file__).parent / "py.typed").is_file()


def test_console_scripts_run():
    for script in ("wsd", "wsctl"):
        result = run(script, "--help")
        assert result.returncode == 0, result.stderr
        assert "usage:" in result.stdout


def test_wsd_demo_runs_the_manager_through_its_life(tmp_path):
    config = tmp_path / "wsd.toml"
    config.write_text("[workspace]\nnum_ubatches = 2\nnum_lanes = 2\n")
    result = run("wsd", "demo", "--config", str(config), "--steps", "20")
    assert result.returncode == 0, result.stderr
    assert "Workspace is locked but allocation from" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line[:1].isspace() and line.split()[0].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]


def test_wsd_demo_bad_config_exits_2_naming_key(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[workspace]\nnum_ubatches = 0\n")
    result = run("wsd", "demo", "--config", str(config))
    assert result.returncode == 2
    assert "bad.toml" in result.stderr and "num_ubatches must be between 1 and 64" in result.stderr


@pytest.mark.parametrize("argv", [["demo"], ["up", "--nproc", "1"]])
def test_without_torch_demo_and_up_name_the_worker_extra_in_one_line(argv):
    """On a torch-free install (the coordinator's and wsctl's), `wsd demo` and `wsd up` ended
    in a raw ModuleNotFoundError traceback: now exit 2 and one line naming the fix, before
    anything starts."""
    code = ("import sys; sys.modules['torch'] = None\n"  # as if torch were not installed
            "from wsd.programs.cli import main\n"
            f"sys.exit(main({argv!r}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result
    assert f"wsd {argv[0]} needs torch, which this environment lacks: install the worker extra" in result.stderr
    assert "Traceback" not in result.stderr and "wsd up:" not in result.stdout
