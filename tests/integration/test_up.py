"""``wsd up`` and ``wsd coordinator`` as real processes, observed through the Python client."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import wait_until
from procs import (  # noqa: F401  (spawn is a fixture)
    COORDINATOR_READY,
    coordinator_section,
    python,
    spawn,
    wait_gone,
    worker_env,
    write_config,
)

import wsd.programs.up as wsd_up
from wsd.config import load_config
from wsd.errors import ConfigError, ExitCode, LaunchError
from wsd.programs.coordinator import children
from wsd_client.client import Client


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


SMALL_WORKLOAD = {"hidden_size": 32, "ffn_size": 64, "max_tokens": 32, "warmup_steps": 4, "pace": 0.05}
# A log line of ours: time, host, who (a rank or the coordinator), logger, level.
OUR_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \S+ (rank \d+/\d+|wsd-coordinator) \S+ INFO ")


def _groups(pids):
    """The process groups of ``pids`` (those still running)."""
    found = set()
    for pid in pids:
        try:
            found.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    return found


def _in_groups(groups):
    """Every process now in one of the process ``groups``."""
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getpgid(int(name)) in groups:
                    found.add(int(name))
            except ProcessLookupError:
                pass
    return found


@pytest.mark.parametrize(("sig", "group"), [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGHUP, False)],
                         ids=["ctrl-c", "sigterm", "sighup"])
def test_wsd_up_runs_a_cluster_and_leaves_no_process_behind(tmp_path, spawn, sig, group):  # noqa: F811
    """Ctrl-C (SIGINT to the terminal's process group), SIGTERM or SIGHUP (a closed terminal or
    ssh session) to `wsd up` stops the workers, torchrun and the coordinator; every process it
    started is gone, and so is every process group they led. SIGHUP used to kill wsd up
    alone, leaving the rest running under PID 1."""
    config = write_config(tmp_path / "wsd.toml", {
        "coordinator": coordinator_section(tmp_path),
        "workload": {"hidden_size": 32, "ffn_size": 64, "max_tokens": 32, "warmup_steps": 4, "pace": 0.05},
    })
    up = spawn(["wsd", "up", "--nproc", "2", "--config", config],
               env=worker_env(), name="wsd up")
    endpoint = up.wait_for(r"wsd up: clients on (\S+)", 60).group(1)
    up.wait_for(rf"wsd up: try +WSD_ENDPOINT={endpoint} wsctl status", 5)
    with Client(endpoint, timeout=5) as client:
        wait_until(lambda: client.status()["ranks"]["live"] == 2, 60, "both ranks to register")
    up.wait_for(r"warm-up done", 30)
    pids = up.tree()
    assert len(pids) >= 5, pids  # wsd up, the coordinator, torchrun, two workers
    groups = _groups(pids - {up.pid})  # each in a session, so a group, of its own
    up.send(sig, group=group)
    assert up.wait(60) == 0, up.output()
    wait_gone(pids, 10, "processes started by wsd up")
    wait_gone(_in_groups(groups), 10, "processes in the groups wsd up started")
    assert up.count("stopped cleanly after") == 2, up.output()
    assert up.count(f"wsd up: stopped by {signal.Signals(sig).name}") == 1
    assert up.count("Traceback") == 0, up.output()


def test_wsd_up_refuses_a_bad_config_before_starting_anything(tmp_path):
    import subprocess

    config = write_config(tmp_path / "bad.toml", {"workload": {"max_tokens": 0}})
    result = subprocess.run(["wsd", "up", "--config", config], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "bad.toml" in result.stderr and "max_tokens must be between 1 and" in result.stderr


def test_wsd_coordinator_runs_without_torch_and_stops_on_sigterm(tmp_path, spawn):  # noqa: F811
    """With every `import torch` failing, the coordinator serves clients; SIGTERM stops it, exit 0."""
    config = write_config(tmp_path / "wsd.toml", {"coordinator": {**coordinator_section(tmp_path), "world_size": 1}})
    code = ("import sys; sys.modules['torch'] = None\n"
            "from wsd.programs.cli import main\n"
            f"sys.exit(main(['coordinator', '--config', {config!r}]))\n")
    proc = spawn(python("-c", code), name="wsd coordinator")
    endpoint = proc.wait_for(COORDINATOR_READY, 30).group(2)
    with Client(endpoint, timeout=5) as client:
        assert client.ping() is not None
        status = client.status()
        assert (status.counts.live, status.counts.lost, status.counts.stopped, status.counts.missing) == (0, 0, 0, 1)
    proc.send(signal.SIGTERM)
    assert proc.wait(15) == 0, proc.output()
    assert proc.count("coordinator stopped") == 1 and proc.count("Traceback") == 0


def test_wsd_coordinator_stops_on_ctrl_c(tmp_path, spawn):  # noqa: F811
    config = write_config(tmp_path / "wsd.toml", {"coordinator": {**coordinator_section(tmp_path), "world_size": 1}})
    proc = spawn(["wsd", "coordinator", "--config", config], name="wsd coordinator")
    proc.wait_for(COORDINATOR_READY, 30)
    proc.send(signal.SIGINT, group=True)
    assert proc.wait(15) == 0, proc.output()
    assert proc.count("Traceback") == 0


def test_wsd_up_exits_2_when_its_coordinator_cannot_bind(tmp_path, spawn):  # noqa: F811
    """A port already taken is the configuration's fault: wsd up says so and exits 2 (it
    used to wait for the coordinator's ready line, then exit 1), starting no worker."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = spawn(["wsd", "up", "--nproc", "1"], name="wsd up", env={
            **os.environ, "WSD_COORDINATOR_CLIENT_ENDPOINT": f"tcp://127.0.0.1:{port}",
            "WSD_COORDINATOR_AGENT_ENDPOINT": "tcp://127.0.0.1:0",
            "WSD_COORDINATOR_STATE_FILE": str(tmp_path / "state")})
        assert proc.wait(60) == 2, proc.output()
    assert f"cannot bind tcp://127.0.0.1:{port}" in proc.output()
    assert "torchrun" not in proc.output() and "Traceback" not in proc.output()


def _up(tmp_path, spawn, *, env=None, **extra):  # noqa: F811
    """``wsd up --nproc 2`` on OS-chosen ports with short heartbeats; the process and its client endpoint."""
    config = write_config(tmp_path / "wsd.toml", {"coordinator": coordinator_section(tmp_path),
                                                  "workload": SMALL_WORKLOAD, **extra})
    up = spawn(["wsd", "up", "--nproc", "2", "--config", config], env=env or worker_env(), name="wsd up")
    return up, up.wait_for(r"wsd up: clients on (\S+)", 60).group(1)


def test_a_killed_worker_is_one_line_naming_its_rank_and_wsctl_shows_it_lost(tmp_path, spawn):  # noqa: F811
    """SIGKILL to one worker: wsd up says which rank died and how, in one line, with no
    traceback (it printed about 190 lines of them, torchrun's and the other rank's, and tore
    the coordinator down with the cluster); the coordinator keeps serving, so `wsctl status`
    shows the rank lost and exits 3, as the README says; wsd up then exits 3 on SIGTERM."""
    up, endpoint = _up(tmp_path, spawn)
    with Client(endpoint, timeout=5) as client:
        wait_until(lambda: client.status().counts.live == 2, 60, "both ranks to register")
        pid = next(r["pid"] for r in client.ranks().ranks if r["rank"] == 1)
        up.wait_for(r"rank 1/2 .* warm-up done", 30)
        before = len(up.lines)
        os.kill(pid, signal.SIGKILL)
        up.wait_for(rf"^wsd up: rank 1 \(pid {pid}\) exited with signal 9 \(SIGKILL\); rank 0 stopped with it$",
                    30, start=before)
        up.wait_for(r"^wsd up: a rank is gone; the coordinator keeps serving", 10, start=before)
        wait_until(lambda: {r["rank"]: r["state"] for r in client.ranks().ranks} == {0: "stopped", 1: "lost"},
                   10, "rank 1 lost (rank 0 said goodbye)")
    wsctl = subprocess.run([sys.executable, "-m", "wsd_client.wsctl", "--endpoint", endpoint, "status"],
                           capture_output=True, text=True, timeout=30)
    assert wsctl.returncode == 3 and "1 lost" in wsctl.stdout, wsctl
    up.send(signal.SIGTERM)
    assert up.wait(60) == 3, up.output()
    after = up.lines[before:]
    assert len(after) <= 6 and "Traceback" not in up.output(), "\n".join(after)
    assert sum("another rank of the job is gone (gloo: " in line for line in after) == 1, "\n".join(after)


def test_start_up_prints_no_banner_and_no_warning(tmp_path, spawn):  # noqa: F811
    """Without OMP_NUM_THREADS in the environment, torchrun printed a five-line banner about
    setting it: wsd up sets it itself, so everything up to both ranks' warm-up is wsd up's own
    lines and INFO log lines."""
    env = {k: v for k, v in worker_env().items() if k != "OMP_NUM_THREADS"}
    up, _ = _up(tmp_path, spawn, env=env)
    for rank in (0, 1):
        up.wait_for(rf"rank {rank}/2 .* warm-up done", 60)
    strange = [line for line in up.lines if not line.startswith("wsd up: ") and not OUR_LOG_LINE.match(line)]
    assert strange == [], "\n".join(up.lines)
    up.send(signal.SIGTERM)
    assert up.wait(60) == 0, up.output()


def _hand_over(monkeypatch, tmp_path):
    """``wsd_up.up`` stops at the coordinator's start; the environment it was to be given."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    for name in ("WSD_CONFIG", "WSD_COORDINATOR_STATE_FILE", "WSD_COORDINATOR_WORLD_SIZE",
                 "WSD_COORDINATOR_TP_SIZE", "WSD_WORKER_TP_SIZE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    seen: list[dict[str, str]] = []

    def start(self, timeout):
        seen.append(dict(self.env))
        raise LaunchError("stopped here by the test")

    monkeypatch.setattr(wsd_up.CoordinatorProcess, "start", start)

    def up(nproc: int, config: str | None = None) -> dict[str, str]:
        with pytest.raises(LaunchError, match="stopped here by the test"):
            wsd_up.up(nproc, config, out=lambda line: None)
        return seen.pop()

    return up


def test_up_shares_the_cpus_among_the_workers_unless_omp_num_threads_is_set(tmp_path, monkeypatch):
    """OMP_NUM_THREADS: this process's CPUs divided by --nproc, at least 1 (torchrun's own
    default was 1 with a banner); a value the user set is the workers' as it is."""
    up = _hand_over(monkeypatch, tmp_path)
    cpus = len(os.sched_getaffinity(0))
    assert up(2)["OMP_NUM_THREADS"] == str(max(1, cpus // 2))
    assert up(4 * cpus)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert up(2)["OMP_NUM_THREADS"] == "7"


def test_up_tells_the_coordinator_the_world_it_launches(tmp_path, monkeypatch):
    """The coordinator is given --nproc as its world size and the workers' TP size, whatever
    the environment held; a configuration that says otherwise is refused before anything
    starts (the workers would be refused one by one at registration)."""
    up = _hand_over(monkeypatch, tmp_path)
    env = up(4)
    assert (env["WSD_COORDINATOR_WORLD_SIZE"], env["WSD_COORDINATOR_TP_SIZE"]) == ("4", "4")
    tp2 = write_config(tmp_path / "tp2.toml", {"worker": {"tp_size": 2}})
    env = up(4, tp2)
    assert (env["WSD_COORDINATOR_WORLD_SIZE"], env["WSD_COORDINATOR_TP_SIZE"]) == ("4", "2")
    with pytest.raises(ConfigError, match=r"\[worker\] tp_size = 2 does not divide --nproc 3"):
        wsd_up.world_env(load_config(tp2, env={}), 3)
    other = write_config(tmp_path / "ws.toml", {"coordinator": {"world_size": 8}})
    with pytest.raises(ConfigError, match=r"\[coordinator\] world_size = 8, but wsd up starts a world of 4"):
        wsd_up.world_env(load_config(other, env={}), 4)


# Each worker waits before torch.distributed starts, so before it registers, until a file exists.
_GATE = """import os, time
if "RANK" in os.environ and "UP_TEST_GATE" in os.environ:
    deadline = time.monotonic() + 60
    while not os.path.exists(os.environ["UP_TEST_GATE"]) and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def test_the_coordinator_of_wsd_up_expects_every_rank_before_any_registers(tmp_path, spawn):  # noqa: F811
    """While no worker has registered, the coordinator already counts both ranks, missing (so
    metrics show wsd_rank_up 0 for them); without the world size from wsd up it would learn
    of ranks only as they register, and one that never does would be invisible."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_GATE)
    gate = tmp_path / "open"
    env = worker_env(UP_TEST_GATE=str(gate),
                     PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")])))
    up, endpoint = _up(tmp_path, spawn, env=env)
    with Client(endpoint, timeout=5) as client:
        status = client.status()
        assert (status.world_size, status.tp_size) == (2, 2), status
        assert (status.counts.live, status.counts.missing) == (0, 2), status
        assert sorted(m["rank"] for m in client.ranks().missing) == [0, 1]
        gate.touch()
        wait_until(lambda: client.status().counts.live == 2, 60, "both ranks to register once let through")
    up.send(signal.SIGTERM)
    assert up.wait(60) == 0, up.output()


@pytest.mark.skipif(torch_cuda_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("how", ["file", "environment"])
def test_wsd_up_refuses_nccl_without_cuda_before_starting_anything(tmp_path, how):
    """nccl (CUDA) on a machine without CUDA: one line naming the setting and the fix, exit 2,
    no coordinator and no torchrun (each worker failed alone, under torchrun's tracebacks)."""
    env = {**os.environ, "WSD_COORDINATOR_STATE_FILE": str(tmp_path / "state")}
    args = ["wsd", "up", "--nproc", "1"]
    if how == "file":
        args += ["--config", write_config(tmp_path / "gpu.toml", {"worker": {"backend": "nccl"}})]
        where = "gpu.toml"
    else:
        env["WSD_WORKER_BACKEND"] = "nccl"
        where = "WSD_WORKER_BACKEND"
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 2, result
    assert result.stderr.count("\n") == 1 and where in result.stderr, result.stderr
    assert "backend = 'nccl' needs CUDA" in result.stderr and "use 'gloo' or 'auto'" in result.stderr
    assert "clients on" not in result.stdout


@pytest.mark.skipif(torch_cuda_available(), reason="this machine has CUDA")
def test_wsd_demo_refuses_a_cuda_device_without_cuda_as_a_usage_error():
    result = subprocess.run([sys.executable, "-m", "wsd.programs.cli", "demo", "--device", "cuda:0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result
    assert result.stderr.splitlines()[-1] == (
        "wsd demo: error: argument --device: cuda:0 needs CUDA, which this machine does not have: use --device cpu")


def test_failures_are_one_line_per_rank_that_failed_of_its_own_accord():
    """torchrun's failure table in a line: the ranks stopped because of another (torchrun's
    SIGTERM, or a worker's RANK_LOST after its peer vanished) are named after it, not as
    failures of their own; when every rank was stopped, each is listed, as nothing says who
    went first."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from wsd.programs.torchrun import describe_failures

    def failed(rank: int, exitcode: int) -> ProcessFailure:
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file="<N/A>")

    killed, sigterm, lost = -signal.SIGKILL, -signal.SIGTERM, ExitCode.RANK_LOST
    assert describe_failures({0: failed(0, lost), 1: failed(1, killed), 2: failed(2, sigterm)}) == [
        "rank 1 (pid 101) exited with signal 9 (SIGKILL); ranks 0, 2 stopped with it"]
    assert describe_failures({3: failed(3, 1), 0: failed(0, 2)}) == [
        "rank 0 (pid 100) refused its configuration (exit code 2)", "rank 3 (pid 103) exited with code 1"]
    assert describe_failures({1: failed(1, sigterm), 0: failed(0, lost)}) == [
        f"rank 0 (pid 100) exited with code {lost}", "rank 1 (pid 101) exited with signal 15 (SIGTERM)"]


def test_the_launcher_exits_2_when_the_ranks_that_failed_on_their_own_refused_their_configuration():
    """One rank refusing its configuration while the other stopped because of it (RANK_LOST,
    or torchrun's SIGTERM) is a configuration error, exit 2, as the first rank's line says;
    the launcher used to ask every failure for exit 2 and so exited 3, a rank lost."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from wsd.programs.torchrun import exit_code

    def failed(rank: int, exitcode: int) -> ProcessFailure:
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file="<N/A>")

    usage, lost, sigterm = ExitCode.USAGE, ExitCode.RANK_LOST, -signal.SIGTERM
    assert exit_code({0: failed(0, usage), 1: failed(1, lost)}) == ExitCode.USAGE
    assert exit_code({0: failed(0, usage), 1: failed(1, sigterm)}) == ExitCode.USAGE
    assert exit_code({0: failed(0, usage), 1: failed(1, usage)}) == ExitCode.USAGE
    # A rank that died on its own, next to one refusing its configuration: a rank lost.
    assert exit_code({0: failed(0, usage), 1: failed(1, -signal.SIGKILL)}) == ExitCode.RANK_LOST
    assert exit_code({0: failed(0, lost), 1: failed(1, -signal.SIGKILL)}) == ExitCode.RANK_LOST
    assert exit_code({0: failed(0, lost), 1: failed(1, sigterm)}) == ExitCode.RANK_LOST


def test_a_coordinator_that_exits_at_start_is_said_to_have_exited_not_to_be_slow(tmp_path):
    """A coordinator that dies on start (here: before any import, exit 1) is reported at once as
    having exited; it used to read 'did not become ready within 30 s', which sent users after a
    timeout that never happened."""
    from wsd.programs.coordinator import CoordinatorProcess

    (tmp_path / "sitecustomize.py").write_text("import os\nos._exit(1)\n")
    process = CoordinatorProcess(None, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    with pytest.raises(LaunchError, match=r"^the coordinator exited before it was ready \(exit code 1\); "):
        process.start(timeout=30)


def test_wsd_up_help_gives_the_exit_codes_up_returns(capsys):
    """The exit codes in `wsd up --help` are the ones wsd.programs.up returns (ExitCode)."""
    from wsd.programs.cli import main

    with pytest.raises(SystemExit):
        main(["up", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "; 3 a rank lost;" in text and "; 2 a bad configuration;" in text and "; 1 otherwise" in text, text
    assert (ExitCode.USAGE, ExitCode.RANK_LOST, ExitCode.ERROR) == (2, 3, 1)


def test_a_signal_while_the_coordinator_starts_starts_no_worker(tmp_path, monkeypatch):
    """SIGTERM during the coordinator's start (it may take 30 s): wsd up stops the coordinator
    and returns 0 without starting torchrun (it used to start the workers anyway, then stop them)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.delenv("WSD_CONFIG", raising=False)
    monkeypatch.delenv("WSD_COORDINATOR_STATE_FILE", raising=False)
    stopped: list[bool] = []

    def start(self, timeout):
        os.kill(os.getpid(), signal.SIGTERM)  # handled by wsd up's stop_signals, as in a real start
        self.agent_endpoint, self.client_endpoint, self.metrics_url = "tcp://a:1", "tcp://c:2", None
        return self

    monkeypatch.setattr(wsd_up.CoordinatorProcess, "start", start)
    monkeypatch.setattr(wsd_up.CoordinatorProcess, "alive", lambda self: not stopped)
    monkeypatch.setattr(wsd_up.CoordinatorProcess, "stop", lambda self: stopped.append(True))
    monkeypatch.setattr(wsd_up, "_start_torchrun", lambda *args: pytest.fail("torchrun started after SIGTERM"))
    lines: list[str] = []
    assert wsd_up.up(2, None, out=lines.append) == ExitCode.OK
    assert stopped == [True] and lines[-1] == "wsd up: stopped by SIGTERM", lines


def test_stopping_the_workers_kills_their_groups_only_if_torchrun_had_to_be_killed(monkeypatch):
    """After torchrun exits by itself it has waited for its workers, whose pids may since belong
    to unrelated processes: no SIGKILL to their groups (it was sent whatever happened). When
    torchrun outlives its grace and is killed, the workers left are killed too."""
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(wsd_up, "descendants", lambda pid: [424242])
    monkeypatch.setattr(wsd_up, "_signal_group", lambda pid, sig: sent.append((pid, sig)))
    clean = subprocess.Popen(python("-c", "pass"))
    ours = {*children(os.getpid()), clean.pid}
    assert wsd_up._stop_workers(clean, ours, False) == 0
    assert sent == [(424242, signal.SIGTERM)]

    sent.clear()
    monkeypatch.setattr(wsd_up, "_WORKER_GRACE", 0.2)
    monkeypatch.setattr(wsd_up, "_TORCHRUN_GRACE", 0.2)
    stuck = subprocess.Popen(python("-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                    "print('ready', flush=True); time.sleep(60)"),
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert stuck.stdout is not None and stuck.stdout.readline() == "ready\n"
    try:
        assert wsd_up._stop_workers(stuck, {*ours, stuck.pid}, False) == -signal.SIGKILL
    finally:
        stuck.kill()
        stuck.wait(10)
        stuck.stdout.close()
    assert sent == [(424242, signal.SIGTERM), (424242, signal.SIGKILL)]


def test_workers_whose_torchrun_died_are_adopted_and_stopped_by_wsd_up(tmp_path, spawn):  # noqa: F811
    """torchrun SIGKILLed: its workers are re-parented to wsd up (a child subreaper), not to
    PID 1, so wsd up still finds them, stops them and reaps them, and exits 1 saying how
    torchrun ended. They used to run on under PID 1, out of reach of wsd up's snapshot of
    torchrun's descendants."""
    up, endpoint = _up(tmp_path, spawn)
    torchrun = int(up.wait_for(r"workers under torchrun, pid (\d+)", 10).group(1))
    with Client(endpoint, timeout=5) as client:
        wait_until(lambda: client.status().counts.live == 2, 60, "both ranks to register")
    up.wait_for(r"warm-up done", 30)
    pids = up.tree()
    workers = set(wsd_up.descendants(torchrun))
    assert len(workers) >= 2, workers
    os.kill(torchrun, signal.SIGKILL)
    assert up.wait(60) == 1, up.output()
    assert up.count(f"wsd up: the workers ended with exit code {-signal.SIGKILL}") == 1, up.output()
    assert up.count("stopped cleanly after") == 2, up.output()  # SIGTERM from wsd up, not a kill
    wait_gone(pids, 10, "processes started by wsd up")


def test_the_children_of_a_killed_wsd_up_follow_it(tmp_path, spawn):  # noqa: F811
    """wsd up SIGKILLed (nothing it can handle): the coordinator exits with its parent, and
    torchrun is sent SIGTERM by the kernel, on which it stops its workers; nothing is left
    running under PID 1."""
    up, endpoint = _up(tmp_path, spawn)
    with Client(endpoint, timeout=5) as client:
        wait_until(lambda: client.status().counts.live == 2, 60, "both ranks to register")
    up.wait_for(r"warm-up done", 30)
    pids = up.tree()
    assert len(pids) >= 5, pids
    up.send(signal.SIGKILL)
    assert up.wait(30) == -signal.SIGKILL
    wait_gone(pids, 60, "processes started by the killed wsd up")


WALK_THROUGH = {"WSD_WORKLOAD_WARMUP_STEPS": "16", "WSD_WORKLOAD_PACE": "0.5", "WSD_WORKLOAD_LOCK": "false",
                "WSD_WORKLOAD_OVERSIZE_CHANCE": "0.2"}
"""The README walk-through's variables: 16 warm-up steps of 0.5 s, the lock left to the operator."""


def test_a_second_wsd_up_replays_the_lock_only_after_each_ranks_warm_up(tmp_path, spawn):  # noqa: F811
    """A second wsd up (no --fresh) replays the walk-through's lock. It once landed before the
    fresh workers' warm-up and locked them at 0-448 KiB: 478 lock violations per rank in 15 s.
    Now each rank reads warming until its warm-up ends, and the lock applies after it: no
    violation comes from a warm-up step (the walk-through's oversize steps, after the lock, may)."""
    env = worker_env(**WALK_THROUGH)
    up, endpoint = _up(tmp_path, spawn, env=env)
    with Client(endpoint, timeout=5) as client:
        wait_until(lambda: client.status().counts.live == 2, 60, "both ranks to register")
        client.lock(wait=False)
        wait_until(lambda: [r.locked for r in client.ranks().ranks] == [True, True], 60, "the first lock")
    up.send(signal.SIGTERM)
    assert up.wait(60) == 0, up.output()

    up, endpoint = _up(tmp_path, spawn, env=env)  # the same state file: replays "locked"
    warming_seen = set()
    with Client(endpoint, timeout=5) as client:
        def locked() -> bool:
            ranks = client.ranks().ranks
            warming_seen.update(r.rank for r in ranks if r.warming)
            return len(ranks) == 2 and all(r.locked for r in ranks)

        wait_until(locked, 90, "the replayed lock", interval=0.1)
        assert warming_seen == {0, 1}, "a rank never read warming before the lock"
        for rank in (0, 1):
            up.wait_for(rf"rank {rank}/2 .* warm-up done after 16 steps at \d+ tokens: .* unlocked", 1)
        early = [e for e in client.events()["events"] if e["kind"] == "lock_violation" and e["step"] < 16]
        assert early == [], early
    up.send(signal.SIGTERM)
    assert up.wait(60) == 0, up.output()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11's")
def test_wsd_up_run_from_a_folder_holding_a_wsd_package_runs_the_installed_one(tmp_path, spawn):  # noqa: F811
    """Its coordinator and workers run `python -m`, which put the working directory first on
    sys.path: `wsd up` run from a folder holding a `wsd/` directory ran that directory's code."""
    planted = tmp_path / "here" / "wsd"
    planted.mkdir(parents=True)
    marker = tmp_path / "hijacked"
    (planted / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit(9)\n")
    config = write_config(tmp_path / "wsd.toml", {"coordinator": coordinator_section(tmp_path),
                                                  "workload": SMALL_WORKLOAD})
    up = spawn(["wsd", "up", "--nproc", "2", "--config", config], env=worker_env(), name="wsd up",
               cwd=planted.parent)
    endpoint = up.wait_for(r"wsd up: clients on (\S+)", 60).group(1)
    with Client(endpoint, timeout=5) as client:
        wait_until(lambda: client.status().counts.live == 2, 60, "both ranks to register")
    up.send(signal.SIGTERM)
    assert up.wait(60) == 0, up.output()
    assert not marker.exists(), "a process of wsd up imported the planted package"


@pytest.mark.timeout(240)
def test_ctrl_c_at_any_point_of_the_start_stops_wsd_up_within_10_s(tmp_path, spawn):  # noqa: F811
    """Ctrl-C while torchrun was still starting its workers once left them running until wsd up
    gave up on them and killed torchrun, 15 s later (35 s with the coordinator): the workers
    were signalled once, before some of them existed. Each cycle stops at another point of the
    start, from torchrun's launch to after the warm-up; every one ends within 10 s, exit 0,
    nothing left behind."""
    config = write_config(tmp_path / "wsd.toml", {
        "coordinator": coordinator_section(tmp_path),
        "workload": {"hidden_size": 32, "ffn_size": 64, "max_tokens": 32, "warmup_steps": 4, "pace": 0.05},
    })
    for cycle, after in enumerate((0.0, 0.3, 0.8, 1.5, None)):  # None: once both ranks are warm
        up = spawn(["wsd", "up", "--nproc", "2", "--config", config, "--fresh"], env=worker_env(),
                   name=f"wsd up {cycle}")
        up.wait_for(r"wsd up: Ctrl-C stops everything", 60)
        if after is None:
            up.wait_for(r"warm-up done", 60)
            up.wait_for(r"warm-up done", 30)
        else:
            time.sleep(after)  # the point of the start at which Ctrl-C comes
        pids = up.tree()
        sent = time.monotonic()
        up.send(signal.SIGINT, group=True)
        assert up.wait(60) == 0, up.output()
        took = time.monotonic() - sent
        assert took < 10.0, f"cycle {cycle} (Ctrl-C {after} s into the start) took {took:.1f} s:\n{up.output()}"
        wait_gone(pids, 10, "processes started by wsd up")
        assert up.count("did not stop within") == 0 and up.count("Traceback") == 0, up.output()
