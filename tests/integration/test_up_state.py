"""``wsd up``'s state file: where it lies, ``--fresh``, the line saying what it recovered; ``wsd --version``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
from procs import coordinator_section, spawn, worker_env, write_config  # noqa: F401  (spawn is a fixture)

import wsd
import wsd.programs.up as wsd_up
from wsd.config import load_config
from wsd.coordinator.commandlog import CommandLog
from wsd.errors import LaunchError
from wsd_client.client import Client


def _seed(path: str) -> None:
    """A state file as a cluster leaves it after ``wsctl lock`` and ``wsctl set-ubatches 4``."""
    log = CommandLog(path, 64)
    log.append("lock", {}, None, 0.0)
    log.append("set_ubatches", {"n": 4}, None, 0.0)


def test_state_folder_follows_xdg_state_home_else_home(tmp_path):
    """Without it, wsd up would write its state wherever it is started (the old ./wsd-coordinator.state)."""
    assert wsd_up.state_folder({"XDG_STATE_HOME": str(tmp_path / "x"), "HOME": "/h"}) == str(tmp_path / "x" / "wsd")
    assert wsd_up.state_folder({"HOME": "/h"}) == "/h/.local/state/wsd"
    # The XDG specification: a relative path is invalid and ignored.
    assert wsd_up.state_folder({"XDG_STATE_HOME": "rel", "HOME": "/h"}) == "/h/.local/state/wsd"


def test_state_file_is_one_per_cluster_unless_the_configuration_names_one(tmp_path, monkeypatch):
    """Two clusters (two config files) never share a state file, so neither replays the other's
    desired state; a file reached by another path is the same cluster; an explicit
    state_file, in the file or the environment, wins."""
    env = {"XDG_STATE_HOME": str(tmp_path / "state")}
    folder = str(tmp_path / "state" / "wsd")
    assert wsd_up.up_state_file(load_config(None, env=env), 2, env) == (
        os.path.join(folder, "default-world2-tp2.state"), False)

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_config(tmp_path / "a" / "wsd.toml", {"workload": {"max_tokens": 32}})
    b = write_config(tmp_path / "b" / "wsd.toml", {"workload": {"max_tokens": 32}})
    path_a, chosen = wsd_up.up_state_file(load_config(a, env=env), 2, env)
    path_b, _ = wsd_up.up_state_file(load_config(b, env=env), 2, env)
    assert not chosen and path_a != path_b
    assert os.path.dirname(path_a) == folder and os.path.basename(path_a).startswith("wsd-world2-tp2-")
    monkeypatch.chdir(tmp_path / "a")
    os.symlink(a, tmp_path / "link.toml")
    for other in ("wsd.toml", str(tmp_path / "link.toml")):
        assert wsd_up.up_state_file(load_config(other, env=env), 2, env)[0] == path_a

    named = write_config(tmp_path / "named.toml", {"coordinator": {"state_file": str(tmp_path / "mine.state")}})
    assert wsd_up.up_state_file(load_config(named, env=env), 2, env) == (str(tmp_path / "mine.state"), True)
    env_named = {**env, "WSD_COORDINATOR_STATE_FILE": str(tmp_path / "env.state")}
    assert wsd_up.up_state_file(load_config(a, env=env_named), 2, env_named) == (str(tmp_path / "env.state"), True)


def test_state_file_is_one_per_world(tmp_path, monkeypatch):
    """A cluster is its configuration and its world: `wsd up --nproc 2` and `wsd up --nproc 4`
    (the quick start, no configuration file), or the same file with another TP size, are
    different clusters with different state files. Keyed by the file alone, every `wsd up`
    without --config shared default.state, and a 4-rank cluster replayed a 2-rank one's state."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    for name in ("WSD_CONFIG", "WSD_COORDINATOR_STATE_FILE", "WSD_WORKER_TP_SIZE"):
        monkeypatch.delenv(name, raising=False)
    seen: list[str] = []

    def start(self, timeout):
        seen.append(self.env["WSD_COORDINATOR_STATE_FILE"])
        raise LaunchError("stopped here by the test")

    monkeypatch.setattr(wsd_up.CoordinatorProcess, "start", start)
    tp2 = write_config(tmp_path / "tp2.toml", {"worker": {"tp_size": 2}})
    for nproc, config in ((2, None), (4, None), (2, None), (4, tp2), (4, tp2)):
        with pytest.raises(LaunchError):
            wsd_up.up(nproc, config, out=lambda line: None)
    folder = tmp_path / "wsd"
    assert seen[:3] == [str(folder / "default-world2-tp2.state"), str(folder / "default-world4-tp4.state"),
                        str(folder / "default-world2-tp2.state")]
    assert seen[3] == seen[4] and os.path.basename(seen[3]).startswith("tp2-world4-tp2-"), seen
    assert len(set(seen)) == 3


def test_forget_state_removes_the_snapshot_and_its_journal(tmp_path):
    path = str(tmp_path / "s.state")
    _seed(path)
    assert os.path.exists(path + ".journal")
    assert wsd_up.forget_state(path) == [path, path + ".journal"]
    assert not os.path.exists(path) and not os.path.exists(path + ".journal")
    assert wsd_up.forget_state(path) == []  # nothing left: not an error


def test_recovery_line_says_what_the_coordinator_will_replay_and_leaves_the_files_alone(tmp_path):
    """The line is what an operator needs to notice a replayed lock; reading it must not fold
    the journal of the real files (the coordinator loads them next)."""
    path = str(tmp_path / "s.state")
    assert wsd_up.recovery_line(path, 64) == f"no earlier state in {path}: starting empty"
    _seed(path)
    files = [tmp_path / "s.state", tmp_path / "s.state.journal"]
    before = [f.read_bytes() for f in files]
    assert wsd_up.recovery_line(path, 64) == (
        f"recovered seq 2, desired: locked, 4 ubatches from {path}; wsd up --fresh starts empty")
    assert [f.read_bytes() for f in files] == before
    files[0].write_bytes(b"not a state file")
    assert "cannot be loaded; the coordinator will say why" in wsd_up.recovery_line(path, 64)


def test_up_fresh_removes_the_state_and_hands_the_coordinator_its_path(tmp_path, monkeypatch):
    """wsd up --fresh says what it removed and that it starts empty; the coordinator is given the
    per-user state file through the environment (without it, it would use ./wsd-coordinator.state)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.delenv("WSD_COORDINATOR_STATE_FILE", raising=False)
    monkeypatch.delenv("WSD_CONFIG", raising=False)
    path = str(tmp_path / "wsd" / "default-world1-tp1.state")
    os.makedirs(os.path.dirname(path))
    _seed(path)
    seen: list[dict[str, str]] = []

    def start(self, timeout):
        seen.append(dict(self.env))
        raise LaunchError("stopped here by the test")

    monkeypatch.setattr(wsd_up.CoordinatorProcess, "start", start)
    lines: list[str] = []
    with pytest.raises(LaunchError):
        wsd_up.up(1, None, fresh=True, out=lines.append)
    assert lines == [f"wsd up: --fresh: removed {path} and {path}.journal",
                     f"wsd up: no earlier state in {path}: starting empty"]
    assert seen[0]["WSD_COORDINATOR_STATE_FILE"] == path
    assert not os.path.exists(path)


def test_wsd_version():
    result = subprocess.run([sys.executable, "-m", "wsd.programs.cli", "--version"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout == f"wsd {wsd.__version__}\n", result


def test_wsd_up_recovers_its_clusters_state_from_the_user_state_folder(tmp_path, spawn):  # noqa: F811
    """End to end: the state seeded in $XDG_STATE_HOME/wsd is the one the coordinator loads (seq 2,
    locked, 4 ubatches), and wsd up's first line says so."""
    section = {k: v for k, v in coordinator_section(tmp_path).items() if k != "state_file"}
    config = write_config(tmp_path / "wsd.toml", {
        "coordinator": section,
        "workload": {"hidden_size": 32, "ffn_size": 64, "max_tokens": 32, "warmup_steps": 4, "pace": 0.05},
    })
    env = {k: v for k, v in worker_env(XDG_STATE_HOME=str(tmp_path / "xdg")).items()
           if k not in ("WSD_COORDINATOR_STATE_FILE", "WSD_CONFIG")}
    path, chosen = wsd_up.up_state_file(load_config(config, env=env), 1, env)
    assert not chosen
    os.makedirs(os.path.dirname(path))
    _seed(path)
    up = spawn(["wsd", "up", "--nproc", "1", "--config", config], env=env, name="wsd up")
    up.wait_for(re.escape(f"wsd up: recovered seq 2, desired: locked, 4 ubatches from {path}"), 30)
    endpoint = up.wait_for(r"wsd up: clients on (\S+)", 60).group(1)
    with Client(endpoint, timeout=5) as client:
        status = client.status()
    assert status["recovered"] is True and status["seq"] == 2, status
    assert status["desired"]["locked"] is True and status["desired"]["num_ubatches"] == 4, status
    up.send(signal.SIGTERM)
    assert up.wait(60) == 0, up.output()


def _wsd_up(tmp_path, env_home: str) -> subprocess.CompletedProcess:
    """``wsd up`` with its state folder under ``env_home``: refused before anything starts."""
    env = {k: v for k, v in worker_env().items() if k != "WSD_COORDINATOR_STATE_FILE"}
    env["XDG_STATE_HOME"] = env_home
    return subprocess.run(["wsd", "up", "--nproc", "2"], env=env, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)


def test_a_state_folder_linked_to_another_users_open_folder_is_refused(tmp_path):
    """A state folder that is a link to someone else's 0777 folder, with a planted state
    ("locked, reserve 1024 TiB"), was replayed into the cluster."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    theirs.chmod(0o777)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "wsd").symlink_to(theirs)
    result = _wsd_up(tmp_path, str(tmp_path / "home"))
    assert result.returncode != 0 and "is not a folder of this user's that only it may write" in result.stderr
    assert "a link" in result.stderr and "Traceback" not in result.stderr and "torchrun" not in result.stderr


@pytest.mark.parametrize("kind", ["folder", "fifo", "device", "other user"])
def test_a_state_file_that_is_no_plain_file_of_ours_is_refused_in_one_line(tmp_path, kind):
    """A folder, FIFO or device at the state path ended in a traceback (or a copy of /dev/zero
    without bound); a file another user may write chooses what is replayed."""
    folder = tmp_path / "home" / "wsd"
    folder.mkdir(parents=True, mode=0o700)
    path = folder / "default-world2-tp2.state"
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    else:
        if os.getuid() != 0:
            pytest.skip("only root can give a file to another user here")
        path.write_bytes(b"")
        os.chown(path, 65534, 65534)
    result = _wsd_up(tmp_path, str(tmp_path / "home"))
    assert result.returncode != 0, result
    why = "belongs to uid 65534" if kind == "other user" else "must be a regular file"
    assert why in result.stderr and "Traceback" not in result.stderr, result.stderr
