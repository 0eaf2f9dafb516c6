"""Bad configuration and usage end in one clear line and exit code 2, never a traceback.

An endpoint ZeroMQ bends (``tcp://*:99999`` bound a random
port on every interface), a misspelt ``WSD_*`` section, ``wsctl --timeout
1e308``, an endpoint that cannot be bound and a damaged state file. Two tiers:
real sockets on port 0, then ``wsd`` and ``wsctl`` as real processes.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator

import pytest
import zmq
from procs import TRACEBACK, coordinator_section, write_config

from wsd.errors import ConfigError
from wsd.wire.transport import BindError, bind, make_socket

_ENV = {k: v for k, v in os.environ.items() if not k.startswith("WSD_")}


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback TCP port held (bound and listening) for the whole test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# -- sockets ----------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:99999", "tcp://127.0.0.1:-1", "tcp://127.0.0.1:4294967297",
                                      "tcp://127.0.0.1:*", "tcp://:7600", "127.0.0.1:7600"])
def test_bind_refuses_an_endpoint_zeromq_would_bend(zmq_context, endpoint):
    """Fails if bind() hands ZeroMQ an endpoint it binds as another (99999: a random port;
    -1: 65535; 2**32 + 1: port 1) instead of refusing it, naming it."""
    sock = make_socket(zmq_context, zmq.ROUTER)
    try:
        with pytest.raises(BindError, match=f"cannot bind {endpoint.replace('*', '[*]')}: must"):
            bind(sock, endpoint)
    finally:
        sock.close()


def test_a_port_in_use_is_a_configuration_error_naming_the_endpoint(zmq_context, taken_port):
    """Fails if a bind failure is not a ConfigError (what ``wsd`` answers with exit 2) that
    names the endpoint and the reason."""
    sock = make_socket(zmq_context, zmq.ROUTER)
    try:
        with pytest.raises(ConfigError) as info:
            bind(sock, f"tcp://127.0.0.1:{taken_port}")
    finally:
        sock.close()
    assert str(info.value) == f"cannot bind tcp://127.0.0.1:{taken_port}: Address already in use"


def test_port_0_binds_a_free_port_and_ipv6_binds(zmq_context):
    """Fails if port 0 (any free port, as the tests and ``wsd up`` use it) stops working, or an
    IPv6 address fails with ZeroMQ's "No such device" for want of the IPV6 option."""
    sock = make_socket(zmq_context, zmq.ROUTER)
    try:
        bound = bind(sock, "tcp://127.0.0.1:0")
        assert bound.startswith("tcp://127.0.0.1:") and int(bound.rsplit(":", 1)[1]) > 0
    finally:
        sock.close()
    if not socket.has_ipv6 or not os.path.exists("/proc/net/if_inet6"):
        pytest.skip("no IPv6 on this machine")
    sock = make_socket(zmq_context, zmq.ROUTER)
    try:
        assert bind(sock, "tcp://[::1]:0").startswith("tcp://[::1]:")
    finally:
        sock.close()


# -- processes ----------------------------------------------------------------------


def _run(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """Exit code and stderr of a command that must end by itself, quickly, with no traceback."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False,
                            env=_ENV if env is None else env)
    assert TRACEBACK not in result.stderr + result.stdout, result.stderr
    return result.returncode, result.stderr


def _section(tmp_path, **overrides) -> dict:
    """A ``[coordinator]`` that starts (its world size set, so no other start-up check fails)."""
    return coordinator_section(tmp_path) | {"world_size": 1} | overrides


def _last_line(stderr: str) -> str:
    """The error line (the coordinator may log warnings before it)."""
    return stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("key", ["agent_endpoint", "client_endpoint", "metrics_port"])
def test_wsd_coordinator_exits_2_when_a_port_is_in_use(tmp_path, taken_port, key):
    """Fails if `wsd coordinator` exits 1 (an error of wsd) instead of 2 (fix your configuration)
    when one of its endpoints is taken, or does not say which and why in one line."""
    section = _section(tmp_path, **{key: f"tcp://127.0.0.1:{taken_port}" if key.endswith("endpoint") else taken_port})
    config = write_config(tmp_path / "wsd.toml", {"coordinator": section})
    code, stderr = _run(["wsd", "coordinator", "--config", config])
    assert code == 2, stderr
    line = _last_line(stderr)
    assert line.startswith("wsd: configuration error: cannot ") and line.endswith("Address already in use")
    assert f"127.0.0.1:{taken_port}" in line


def test_wsd_coordinator_exits_2_for_an_endpoint_out_of_range(tmp_path):
    """Fails if tcp://*:99999 starts a coordinator (on a random port, on every interface)."""
    section = _section(tmp_path, client_endpoint="tcp://*:99999")
    config = write_config(tmp_path / "wsd.toml", {"coordinator": section})
    code, stderr = _run(["wsd", "coordinator", "--config", config])
    assert code == 2
    assert _last_line(stderr) == (
        f"wsd: configuration error: {config}: [coordinator] client_endpoint must have a port from 0 "
        f"(any free port) to 65535, got 'tcp://*:99999'")


def test_wsd_exits_2_for_a_misspelt_environment_section(tmp_path):
    """Fails if WSD_COORDNATOR_HEARTBEAT_INTERVAL is ignored and the coordinator starts."""
    config = write_config(tmp_path / "wsd.toml", {"coordinator": _section(tmp_path)})
    code, stderr = _run(["wsd", "coordinator", "--config", config],
                        env=_ENV | {"WSD_COORDNATOR_HEARTBEAT_INTERVAL": "2"})
    assert code == 2
    assert _last_line(stderr).startswith(
        "wsd: configuration error: environment variable WSD_COORDNATOR_HEARTBEAT_INTERVAL: unknown section")


def test_wsd_coordinator_exits_2_for_a_damaged_state_file(tmp_path):
    """Fails if a state file the coordinator refuses to load ends in exit 1 or a traceback."""
    section = _section(tmp_path)
    with open(section["state_file"], "wb") as f:
        f.write(b"not a state file")
    config = write_config(tmp_path / "wsd.toml", {"coordinator": section})
    code, stderr = _run(["wsd", "coordinator", "--config", config])
    assert code == 2
    line = _last_line(stderr)
    assert line.startswith(f"wsd: state file error: {section['state_file']}: ")
    assert sum(1 for entry in stderr.splitlines() if entry.startswith("wsd:")) == 1


@pytest.mark.parametrize("argv", [
    ["wsctl", "--timeout", "1e308", "ping"],
    ["wsctl", "--endpoint", "tcp://127.0.0.1:99999", "ping"],
    ["wsctl", "events", "--since", "99999999999999999999999"],
    ["wsctl", "reserve", "99999999999999999999999"],
    ["wsd", "up", "--nproc", "nan"],
    ["wsd", "up", "--nproc", "99999999999999999999999"],
    ["wsd", "demo", "--steps", "1e308"],
])
def test_a_number_out_of_range_on_the_command_line_is_a_usage_error(argv):
    """Fails if an absurd number on the command line ends in a traceback (each of the wsctl ones
    did) instead of a usage line naming the option, exit 2."""
    code, stderr = _run(argv)
    assert code == 2 and _last_line(stderr).split(": error: argument ")[1].startswith(
        ("--timeout", "--endpoint", "--since", "SIZE", "--nproc", "--steps")), stderr
