"""The GPU tier's scripts, checked here before a GPU machine's few minutes are spent on them.

The GPU machine reaches no package registry: ``tests/gpu/run.sh`` installs what its Python
lacks from wheels that travel with the checkout (``tests/gpu/wheels.sh`` fetches them where a
registry is reachable; ``tests/gpu/install.sh`` installs with ``--no-index``). The offline
install itself was proven by hand: a CPython 3.13 venv without pyzmq, network namespace
cut (``unshare -n``), ``bash tests/gpu/install.sh`` (docs/vllm.md, "The GPU tier").
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # wsd's own dependency there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "tests" / "gpu"
SCRIPTS = sorted(GPU.glob("*.sh"))


def _requirements() -> dict[str, str]:
    """tests/gpu/requirements.txt: each requirement's name, and the module it is imported as."""
    found = {}
    for line in (GPU / "requirements.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            requirement, _, module = line.partition("  # ")
            found[re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()] = module  # type: ignore[union-attr]
    return found


def test_the_gpu_tier_installs_what_wsd_needs_at_run_time_and_what_its_tests_import():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in project["dependencies"]}  # type: ignore[union-attr]
    assert set(_requirements()) == runtime | {"numpy", "pytest", "pytest-timeout", "hypothesis"}
    assert _requirements()["pyzmq"] == "zmq" and _requirements()["prometheus-client"] == "prometheus_client"


@pytest.mark.parametrize("script", ["install.sh", "run.sh"])
def test_nothing_on_the_gpu_machine_reaches_for_a_registry(script):
    """Every pip install there is --no-index; only wheels.sh, run where a registry is
    reachable, downloads."""
    text = (GPU / script).read_text().replace("\\\n", " ")  # continued lines joined
    installs = re.findall(r"pip install[^\n]*", text)
    assert "pip download" not in text
    assert all("--no-index" in call for call in installs), installs


def test_without_the_wheels_install_says_how_to_get_them_and_fetches_nothing(tmp_path):
    """A Python that lacks the tier's dependencies, no wheels: exit 1, naming the command that
    fetches them for that Python's version (pip is never run: the venv has none)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    result = subprocess.run(["bash", str(GPU / "install.sh")], capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "PYTHON": str(python), "WHEELS": str(tmp_path / "none")})
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"run 'bash tests/gpu/wheels.sh {version}'" in result.stderr and "pyzmq>=25" in result.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_gpu_scripts_parse_are_executable_and_pass_shellcheck(script):
    assert subprocess.run(["bash", "-n", str(script)], timeout=30).returncode == 0
    assert script.stat().st_mode & 0o111, f"{script} is not executable"
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    result = subprocess.run(["shellcheck", "--shell=bash", str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout


def test_the_tier_has_its_three_scripts():
    assert [p.name for p in SCRIPTS] == ["install.sh", "run.sh", "wheels.sh"]
