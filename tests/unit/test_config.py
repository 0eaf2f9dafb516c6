"""Configuration: TOML file, WSD_* overrides, errors naming file, key and what is allowed."""

from __future__ import annotations

import os
import time

import pytest

from wsd.config import GrowthPolicy, WorkspaceConfig, load_config, parse_size
from wsd.errors import ConfigError


def write(tmp_path, text: str):
    path = tmp_path / "wsd.toml"
    path.write_text(text)
    return path


def test_defaults_without_file():
    config = load_config(None, env={})
    assert config.workspace == WorkspaceConfig()
    assert config.workspace.num_ubatches == 1 and config.workspace.alignment == 256
    assert config.source == "<defaults>"


def test_file_values_are_loaded(tmp_path):
    path = write(tmp_path, """
[workspace]
num_ubatches = 4
num_lanes = 2
growth = "granular"
granularity = "4MiB"
max_slot_bytes = "1 GiB"
""")
    ws = load_config(path, env={}).workspace
    assert (ws.num_ubatches, ws.num_lanes, ws.growth) == (4, 2, GrowthPolicy.GRANULAR)
    assert (ws.granularity, ws.max_slot_bytes) == (4 << 20, 1 << 30)


def test_environment_overrides_file(tmp_path):
    path = write(tmp_path, "[workspace]\nnum_ubatches = 4\n")
    env = {"WSD_WORKSPACE_NUM_UBATCHES": "8", "WSD_WORKSPACE_MAX_SLOT_BYTES": "none",
           "WSD_ENDPOINT": "ignored: not a config section"}
    ws = load_config(path, env=env).workspace
    assert ws.num_ubatches == 8 and ws.max_slot_bytes is None


def test_wsd_config_variable_names_the_file(tmp_path):
    path = write(tmp_path, "[workspace]\nnum_lanes = 3\n")
    assert load_config(env={"WSD_CONFIG": str(path)}).workspace.num_lanes == 3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[workspace]\nnum_ubatchez = 2\n", r"unknown key \[workspace\] 'num_ubatchez'; allowed keys: alignment"),
        ("[worksp]\n", r"unknown section \[worksp\]; allowed sections: \[workspace\]"),
        ("[workspace]\nnum_ubatches = 0\n", "num_ubatches must be between 1 and 64, got 0"),
        ("[workspace]\nnum_ubatches = 65\n", "num_ubatches must be between 1 and 64, got 65"),
        ("[workspace]\nnum_ubatches = \"two\"\n", r"\[workspace\] num_ubatches must be an integer, got 'two'"),
        ("[workspace]\nnum_ubatches = true\n", "must be an integer, got True"),
        ("[workspace]\ngrowth = \"double\"\n", "growth must be one of 'exact', 'granular', got 'double'"),
        ("[workspace]\nalignment = 100\n", "alignment must be a power of two, got 100"),
        ("[workspace]\ngranularity = \"3 parsecs\"\n", "expected a size"),
        ("[workspace]\ngranularity = 300\n", "granularity must be a multiple of alignment"),
        ("workspace = 3\n", "must be a \\[workspace\\] table"),
        ("[workspace\n", "not valid TOML"),
    ],
)
def test_bad_file_fails_naming_file_key_and_allowed(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(path, env={})
    assert str(path) in str(info.value)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    """tomllib decodes the bytes before parsing: without the translation a UnicodeDecodeError
    (not a ConfigError naming the file) would escape the loader and crash start-up with a traceback."""
    path = tmp_path / "wsd.toml"
    path.write_bytes(b"[workspace]\nnum_ubatches = 2 # \x80\xff\n")
    with pytest.raises(ConfigError, match="not valid TOML: not UTF-8") as info:
        load_config(path, env={})
    assert str(path) in str(info.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"nope.toml: configuration file not found"):
        load_config(tmp_path / "nope.toml", env={})


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WSD_WORKSPACE_NUM_UBATCHES": "x"}, "environment variable WSD_WORKSPACE_NUM_UBATCHES: .*must be an integer"),
        ({"WSD_WORKSPACE_NUM_UBATCHES": "0"}, "environment variable WSD_WORKSPACE_NUM_UBATCHES: .*between 1 and 64"),
        ({"WSD_WORKSPACE_BOGUS": "1"}, "environment variable WSD_WORKSPACE_BOGUS: unknown key"),
        ({"WSD_WORKSPACE": "1"}, "WSD_WORKSPACE: names no key"),
    ],
)
def test_bad_environment_is_named(env, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, env=env)


def test_parse_size():
    assert parse_size("2MiB") == 2 << 20
    assert parse_size("512 kb") == 512_000
    assert parse_size(4096) == 4096
    assert parse_size("4096") == 4096
    for bad in ("-1", "1.5MiB", True, "MiB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_config_objects_are_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        WorkspaceConfig(2)  # type: ignore[misc]
    config = WorkspaceConfig(num_ubatches=2)
    with pytest.raises(AttributeError):
        config.num_ubatches = 3  # type: ignore[misc]


def test_manager_from_config_file(tmp_path):
    torch = pytest.importorskip("torch")
    from wsd import WorkspaceManager

    path = write(tmp_path, "[workspace]\nnum_ubatches = 3\nnum_lanes = 2\nalignment = 64\n")
    manager = WorkspaceManager.from_config("cpu", str(path))
    assert (manager.num_ubatches, manager.num_lanes) == (3, 2)
    a, b = manager.get_simultaneous(((1,), torch.float32), ((1,), torch.float32))
    assert b.data_ptr() - a.data_ptr() == 64
    assert len(manager.stats().slots) == 6


def test_worker_workload_and_coordinator_mode_keys_load(tmp_path):
    from wsd.config import Backend, CoordinatorMode, WorkloadDtype

    path = write(tmp_path, """
[coordinator]
mode = "embedded"
connect_endpoint = "tcp://head:7600"
[worker]
tp_size = 4
backend = "gloo"
collective_timeout = 60
[workload]
hidden_size = 64
ffn_size = 128
layers = 3
dtype = "bfloat16"
max_tokens = 32
warmup_steps = 4
lock = false
steps = 10
pace = 0
oversize_chance = 0.5
seed = 7
""")
    config = load_config(path, env={"WSD_WORKLOAD_STEPS": "20", "WSD_WORKER_TP_SIZE": "none"})
    assert config.coordinator.mode is CoordinatorMode.EMBEDDED
    assert config.coordinator.connect_endpoint == "tcp://head:7600"
    assert (config.worker.tp_size, config.worker.backend) == (None, Backend.GLOO)
    assert config.worker.collective_timeout == 60.0
    w = config.workload
    assert (w.hidden_size, w.ffn_size, w.layers, w.dtype) == (64, 128, 3, WorkloadDtype.BFLOAT16)
    assert (w.max_tokens, w.warmup_steps, w.lock, w.steps) == (32, 4, False, 20)
    assert (w.pace, w.oversize_chance, w.seed) == (0, 0.5, 7)


def test_new_section_defaults():
    """The defaults `wsd up` relies on: an external coordinator, TP per node, a locking warm-up."""
    from wsd.config import Backend, CoordinatorMode

    config = load_config(None, env={})
    assert config.coordinator.mode is CoordinatorMode.EXTERNAL and config.coordinator.connect_endpoint is None
    assert config.worker.tp_size is None and config.worker.backend is Backend.AUTO
    assert config.workload.lock and config.workload.steps == 0 and config.workload.oversize_chance == 0.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[coordinator]\nmode = \"inline\"\n", "mode must be one of 'external', 'embedded', got 'inline'"),
        ("[coordinator]\nconnect_endpoint = \"head:7600\"\n", "connect_endpoint must be a ZeroMQ endpoint"),
        ("[worker]\ntp_size = 0\n", r"\[worker\] tp_size must be between 1 and"),
        ("[worker]\nbackend = \"mpi\"\n", "backend must be one of 'auto', 'nccl', 'gloo', got 'mpi'"),
        ("[worker]\ncollective_timeout = 0\n", "collective_timeout must be a number of seconds"),
        ("[worker]\nthreads = 2\n", r"unknown key \[worker\] 'threads'; allowed keys: backend"),
        ("[workload]\ndtype = \"int8\"\n", "dtype must be one of 'float32', 'bfloat16', 'float16'"),
        ("[workload]\nmax_tokens = 0\n", "max_tokens must be between 1 and"),
        ("[workload]\nmax_tokens = 4\nwarmup_steps = 8\n", r"warmup_steps \(8\) must not exceed max_tokens \(4\)"),
        ("[workload]\nsteps = -1\n", "steps must be between 0 and"),
        ("[workload]\npace = -0.1\n", r"pace must be a number of seconds in \[0, 3600\]"),
        ("[workload]\noversize_chance = 1.5\n", r"oversize_chance must be a number in \[0, 1\], got 1.5"),
        ("[workload]\nlock = \"yes\"\n", r"\[workload\] lock must be true or false"),
        ("[workload]\nlayers = 2.5\n", r"\[workload\] layers must be an integer"),
    ],
)
def test_bad_worker_and_workload_keys_name_file_key_and_allowed(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(path, env={})
    assert str(path) in str(info.value)


def test_bad_workload_environment_is_named():
    with pytest.raises(ConfigError, match=r"environment variable WSD_WORKLOAD_OVERSIZE_CHANCE: .*must be a number"):
        load_config(None, env={"WSD_WORKLOAD_OVERSIZE_CHANCE": "often"})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # ZeroMQ binds port 99999 as a random port, and -1 as 65535, on every interface, silently.
        ('[coordinator]\nagent_endpoint = "tcp://*:99999"\n',
         r"agent_endpoint must have a port from 0 \(any free port\) to 65535, got 'tcp://\*:99999'"),
        ('[coordinator]\nclient_endpoint = "tcp://127.0.0.1:-1"\n', "client_endpoint must have a port from 0"),
        ('[coordinator]\nclient_endpoint = "tcp://127.0.0.1:4294967297"\n', "client_endpoint must have a port"),
        ('[coordinator]\nagent_endpoint = "tcp://127.0.0.1:*"\n', "agent_endpoint must be a ZeroMQ endpoint: tcp://HOST:PORT"),
        ('[coordinator]\nagent_endpoint = "tcp://:7600"\n', "agent_endpoint must be a ZeroMQ endpoint"),
        ('[coordinator]\nagent_endpoint = "tcp://127.0.0.1"\n', "agent_endpoint must be a ZeroMQ endpoint"),
        ('[coordinator]\nagent_endpoint = "udp://127.0.0.1:7600"\n', "agent_endpoint must be a ZeroMQ endpoint"),
        ('[coordinator]\nagent_endpoint = "ipc://"\n', "agent_endpoint must be a ZeroMQ endpoint"),
        ('[coordinator]\nconnect_endpoint = "tcp://head:0"\n', "connect_endpoint must have a port from 1 to 65535"),
        ('[coordinator]\nconnect_endpoint = "tcp://*:7600"\n', "connect_endpoint must name the host to connect to"),
    ],
)
def test_an_endpoint_zeromq_would_bend_is_refused(tmp_path, text, expected):
    """Fails if an endpoint that ZeroMQ binds as some other one (or cannot use) loads."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(path, env={})
    assert str(path) in str(info.value)


def test_endpoints_that_work_still_load():
    """Fails if the endpoint check refuses what wsd relies on: port 0 (any free port, as the
    tests and `wsd up` use it), every interface, names, IPv6, ipc and inproc."""
    env = {"WSD_COORDINATOR_AGENT_ENDPOINT": "tcp://0.0.0.0:0", "WSD_COORDINATOR_CLIENT_ENDPOINT": "tcp://*:7601",
           "WSD_COORDINATOR_CONNECT_ENDPOINT": "tcp://head-node.example.com:7600"}
    assert load_config(None, env=env).coordinator.client_endpoint == "tcp://*:7601"
    for endpoint in ("tcp://[::1]:0", "tcp://localhost:65535", "ipc:///tmp/wsd.ipc", "inproc://wsd"):
        assert load_config(None, env={"WSD_COORDINATOR_AGENT_ENDPOINT": endpoint}).coordinator.agent_endpoint \
            == endpoint


def test_an_unknown_environment_section_fails_naming_the_variable():
    """Fails if WSD_COORDNATOR_HEARTBEAT_INTERVAL=2 (a typo) is ignored: the operator would
    believe the heartbeat changed."""
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"WSD_COORDNATOR_HEARTBEAT_INTERVAL": "2"})
    message = str(info.value)
    assert message.startswith("environment variable WSD_COORDNATOR_HEARTBEAT_INTERVAL: unknown section 'coordnator'")
    assert "SECTION one of WORKSPACE, COORDINATOR, AGENT, WORKER, WORKLOAD, SECURITY" in message
    assert "WSD_CONFIG" in message and "WSD_ENDPOINT" in message


def test_variables_that_are_not_configuration_are_left_alone(tmp_path):
    """Fails if a WSD_* variable that something else reads (a launcher's secret, wsctl's
    endpoint and keys, the file's name) breaks start-up."""
    from wsd.config import NOT_CONFIGURATION

    path = write(tmp_path, "[workspace]\nnum_lanes = 2\n")
    env = {name: "x" for name in NOT_CONFIGURATION} | {"WSD_CONFIG": str(path)}
    assert load_config(env=env).workspace.num_lanes == 2
    assert "WSD_AGENT_TOKEN" in NOT_CONFIGURATION


def test_every_wsd_variable_the_code_reads_is_configuration_or_listed():
    """Fails if code reads a WSD_* variable that load_config would refuse at start-up: add it to
    NOT_CONFIGURATION (with what reads it), or make it a configuration key."""
    import dataclasses
    import pathlib
    import re
    import typing

    from wsd.config import NOT_CONFIGURATION, WsdConfig

    root = pathlib.Path(__file__).resolve().parents[2]
    sections = {name: {f.name for f in dataclasses.fields(kind)}
                for name, kind in typing.get_type_hints(WsdConfig).items() if name != "source"}
    quoted = re.compile(r"""["'](WSD_[A-Z0-9_]*[A-Z0-9])["']""")
    read = re.compile(r"""environ(?:\.get\(|\[)\s*["'](WSD_[A-Z0-9_]*[A-Z0-9])["']""")
    names: set[str] = set()
    for folder, pattern in (("wsd", quoted), ("clients", quoted), ("bench", quoted), ("tests", read)):
        for source in (root / folder).rglob("*.py"):
            text = source.read_text()
            # A name the module defines (WSD_STEP = "wsd_step", listed in __all__) is Python's, not the shell's.
            names |= {n for n in pattern.findall(text) if not re.search(rf"^{n}\s*=", text, re.MULTILINE)}
    assert "WSD_ENDPOINT" in names and "WSD_COORDINATOR_CONNECT_ENDPOINT" in names  # the scan works
    for name in names - set(NOT_CONFIGURATION):
        section, _, key = name[4:].lower().partition("_")
        assert key in sections.get(section, ()), f"{name} is read but load_config refuses it"


SERVICE_LINKS = {
    # What kubelet sets for a Service named wsd-coordinator with ports agents 7600, clients 7601.
    "WSD_COORDINATOR_SERVICE_HOST": "10.96.0.10",
    "WSD_COORDINATOR_SERVICE_PORT": "7600",
    "WSD_COORDINATOR_SERVICE_PORT_AGENTS": "7600",
    "WSD_COORDINATOR_SERVICE_PORT_CLIENTS": "7601",
    "WSD_COORDINATOR_PORT": "tcp://10.96.0.10:7600",
    "WSD_COORDINATOR_PORT_7600_TCP": "tcp://10.96.0.10:7600",
    "WSD_COORDINATOR_PORT_7600_TCP_PROTO": "tcp",
    "WSD_COORDINATOR_PORT_7600_TCP_PORT": "7600",
    "WSD_COORDINATOR_PORT_7600_TCP_ADDR": "10.96.0.10",
    # ... and for Services named wsd, wsd-metrics and wsd-agent: other sections, or none.
    "WSD_SERVICE_HOST": "10.96.0.11",
    "WSD_PORT": "udp://10.96.0.11:53",
    "WSD_METRICS_SERVICE_HOST": "10.96.0.12",
    "WSD_METRICS_PORT_9090_SCTP_ADDR": "10.96.0.12",
    "WSD_AGENT_SERVICE_PORT": "80",
}


def test_kubernetes_service_links_are_not_configuration():
    """Fails if the variables kubelet gives every pod for a Service of its namespace stop
    wsd from starting: the project's own Service wsd-coordinator yields
    WSD_COORDINATOR_PORT=tcp://..., which once failed with "unknown key [coordinator] 'port'"."""
    config = load_config(None, env={**SERVICE_LINKS, "WSD_COORDINATOR_HEARTBEAT_INTERVAL": "2"})
    assert config.coordinator.heartbeat_interval == 2.0  # real keys beside them still apply


@pytest.mark.parametrize("name, value, expected", [
    # A real key keeps its own checks, whatever its value looks like.
    ("WSD_COORDINATOR_METRICS_PORT", "tcp://10.96.0.10:7602", "metrics_port must be an integer"),
    # <NAME>_PORT is kubelet's only with a URL for a value; a number is a mistyped key.
    ("WSD_COORDINATOR_PORT", "7600", "unknown key [coordinator] 'port'"),
    ("WSD_COORDINATOR_HEARTBEAT", "2", "unknown key [coordinator] 'heartbeat'"),
])
def test_what_only_looks_like_a_service_link_is_still_refused(name, value, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, env={name: value})
    assert expected in str(info.value)


@pytest.mark.parametrize("text", ['[coordinator]\nstate_file = "a\\u0000b"\n',
                                  '[security]\nviewer_keys = "a\\u0000b"\n'])
def test_a_nul_in_a_string_is_refused_naming_the_key(tmp_path, text):
    """A NUL in state_file once ended in a ValueError traceback ("embedded null byte") when the
    coordinator opened it: refused at load instead, naming the file and key."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=r"wsd\.toml: \[\w+\] \w+ must not contain a NUL character"):
        load_config(path)


@pytest.mark.parametrize("make, message", [
    (lambda p: p.write_text("a = " + "[" * 100_000 + "]" * 100_000), "nested too deeply"),
    (lambda p: p.write_text("[workspace]\n" + "# " + "x" * (2 << 20) + "\n"), "more than 1048576 bytes"),
    (lambda p: os.mkfifo(p), "not a regular file"),
    (lambda p: p.mkdir(), "not a regular file"),
])
def test_a_configuration_file_that_would_hang_or_crash_the_reader_is_a_one_line_error(tmp_path, make, message):
    """Arrays nested 100,000 deep gave a RecursionError traceback (wsd coordinator, wsd up,
    wsctl's contexts); a FIFO hung the reader; /dev/zero was read for ever."""
    path = tmp_path / "wsd.toml"
    make(path)
    with pytest.raises(ConfigError, match=message) as e:
        load_config(path, env={})
    assert str(path) in str(e.value)


def test_dev_zero_as_a_configuration_file_is_refused_at_once():
    started = time.monotonic()
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config("/dev/zero", env={})
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("mode", [0o666, 0o664, 0o646])
def test_a_configuration_file_others_may_write_is_refused_naming_the_fix(tmp_path, mode):
    """A configuration names the token and key files and the endpoints to trust; the token
    file was checked for its owner and mode while a world-writable configuration naming it
    was loaded silently."""
    path = tmp_path / "wsd.toml"
    path.write_text("[coordinator]\nheartbeat_interval = 1.0\n")
    path.chmod(mode)
    with pytest.raises(ConfigError, match=rf"has mode {mode:04o}: group and others must not be able to write"):
        load_config(str(path), env={})
    path.chmod(0o644)
    assert load_config(str(path), env={}).coordinator.heartbeat_interval == 1.0
