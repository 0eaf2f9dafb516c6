"""``wsctl`` failing fast and bounded: a closed port, a silent listener, a malformed endpoint.

Real sockets on loopback ports the kernel chose, a real coordinator
(``start_coordinator``), and ``wsctl.main`` run in this process; every time is
measured with ``time.monotonic``.
"""

from __future__ import annotations

import io
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from wsd import __version__
from wsd_client import wsctl
from wsd_client.client import BadEndpoint, Client, ClientError, Unavailable
from wsd_client.output import CLEAR, Output

# "Fail within 1 s when the port is closed"; the slack is for a loaded test machine.
FAST = 1.5


@pytest.fixture
def closed_port():
    """A loopback port nothing listens on: bound by the kernel's choice, then closed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return port


@pytest.fixture
def silent_port():
    """A port whose kernel accepts connections that nobody ever reads or answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield s.getsockname()[1]


def run(capsys, *argv: str) -> tuple[int, str, str, float]:
    """``wsctl argv...``: exit code, stdout, stderr, seconds taken."""
    start = time.monotonic()
    code = wsctl.main(list(argv))
    took = time.monotonic() - start
    out, err = capsys.readouterr()
    return code, out, err, took


@pytest.mark.parametrize("command", ["status", "ping", "stats", "events", "watch", "lock"])
def test_a_closed_port_fails_at_once_saying_refused(capsys, closed_port, command):
    """Fails if wsctl waits out its timeout (5 s, three attempts: 15 s) when nothing listens."""
    code, out, err, took = run(capsys, command, "--endpoint", f"tcp://127.0.0.1:{closed_port}")
    assert (code, out) == (1, "")
    assert took < FAST, f"{command} took {took:.2f} s to say nothing listens"
    assert err.startswith("wsctl: unavailable: ") and err.count("\n") == 1, err
    assert f"connection refused: nothing listens on 127.0.0.1:{closed_port}" in err


def test_the_client_raises_unavailable_at_once_on_a_closed_port(closed_port):
    with Client(f"tcp://127.0.0.1:{closed_port}", timeout=5) as client:
        start = time.monotonic()
        with pytest.raises(Unavailable, match="connection refused"):
            client.status()
        assert time.monotonic() - start < FAST


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_coordinator_that_is_up_still_answers(capsys, start_coordinator, host):
    """Fails if the probe of the port gets in the way of a real coordinator, by address or name."""
    coordinator = start_coordinator()
    port = coordinator.client_endpoint.rpartition(":")[2]
    code, out, err, _ = run(capsys, "ping", "--json", "--endpoint", f"tcp://{host}:{port}")
    assert code == 0 and '"epoch"' in out, err
    code, out, err, _ = run(capsys, "status", "--endpoint", f"tcp://{host}:{port}")
    assert code in (0, 3) and out and err == "", (code, err)


def test_a_coordinator_on_ipv6_still_answers(capsys, start_coordinator):
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    coordinator = start_coordinator(client_endpoint="tcp://[::1]:0")
    port = coordinator.client_endpoint.rpartition(":")[2]
    code, out, err, _ = run(capsys, "ping", "--endpoint", f"tcp://[::1]:{port}")
    assert code == 0 and out, err


def test_timeout_is_one_deadline_for_the_whole_command(capsys, silent_port):
    """Fails if --timeout bounds each of the three attempts (1.5 s) instead of all of them."""
    endpoint = f"tcp://127.0.0.1:{silent_port}"
    code, out, err, took = run(capsys, "status", "--timeout", "0.5", "--endpoint", endpoint)
    assert (code, out) == (1, "")
    assert 0.45 < took < 1.0, f"--timeout 0.5 took {took:.2f} s"
    assert err == f"wsctl: unavailable: no reply from {endpoint} to status within 0.5 s (3 attempts)\n"


def test_a_client_deadline_bounds_several_calls(silent_port):
    """Fails if a call inside ``Client.deadline`` gets a timeout of its own beyond the deadline."""
    with Client(f"tcp://127.0.0.1:{silent_port}", timeout=5) as client:
        start = time.monotonic()
        with client.deadline(0.5):
            for _ in range(2):  # the first spends the deadline; the second has nothing left
                with pytest.raises(Unavailable, match=r"within 0\.5 s"):
                    client.ping()
        assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("endpoint", ["127.0.0.1:7601", "localhost:7601", "tcp//127.0.0.1:7601"])
def test_an_endpoint_without_tcp_is_a_usage_error(capsys, endpoint):
    """Fails if a malformed endpoint is tried (exit 1, "unavailable") instead of refused (exit 2)."""
    code, out, err, took = run(capsys, "status", "--endpoint", endpoint)
    assert (code, out) == (2, "") and took < FAST
    assert "argument --endpoint: must be a ZeroMQ endpoint: tcp://HOST:PORT" in err
    assert f"did you mean 'tcp://{endpoint}'?" in err
    assert "unavailable" not in err and "Traceback" not in err


@pytest.mark.parametrize("host", ["a" * 300, "a" * 64 + ".example", ".".join(["abcdefgh"] * 30)])
def test_a_host_name_dns_cannot_hold_is_a_usage_error(capsys, host):
    """A 300-character host once ended in a UnicodeError traceback (the idna codec's)."""
    code, out, err, took = run(capsys, "status", "--endpoint", f"tcp://{host}:7601")
    assert (code, out) == (2, "") and took < FAST
    assert "must have a host name of at most 253 characters" in err and "Traceback" not in err


def test_a_key_name_no_file_system_holds_is_refused_in_one_line(capsys, tmp_path):
    """A 300-character key name once ended in an OSError traceback (File name too long)."""
    code, _, err, _ = run(capsys, "keygen", "k" * 300, "--dir", str(tmp_path))
    assert code == 2 and "key name must be at most 200 bytes, got 300" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
    code, _, err, _ = run(capsys, "keygen", "k" * 200, "--dir", str(tmp_path))
    assert code == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["k" * 200 + ".key", "k" * 200 + ".key_secret"]


def test_an_endpoint_without_tcp_in_the_environment_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setenv("WSD_ENDPOINT", "127.0.0.1:7601")
    code, out, err, _ = run(capsys, "ping")
    assert (code, out) == (2, "")
    assert err.startswith("wsctl: environment variable WSD_ENDPOINT must be a ZeroMQ endpoint")
    assert "did you mean 'tcp://127.0.0.1:7601'?" in err


def test_the_client_refuses_a_malformed_endpoint_as_its_own_error(monkeypatch):
    """Fails if a malformed endpoint escapes ``except Unavailable`` (``Unavailable``
    for every unavailability), or is not also a ValueError naming the fix."""
    with pytest.raises(BadEndpoint) as raised:
        Client("127.0.0.1:7601")
    error = raised.value
    assert isinstance(error, Unavailable) and isinstance(error, ClientError) and isinstance(error, ValueError)
    assert "endpoint must be a ZeroMQ endpoint: tcp://HOST:PORT" in str(error)
    assert "did you mean 'tcp://127.0.0.1:7601'?" in str(error)
    monkeypatch.setenv("WSD_ENDPOINT", "tcp://127.0.0.1:99999")
    with pytest.raises(BadEndpoint, match="environment variable WSD_ENDPOINT must have a port from 1 to 65535"):
        Client()


def test_version(capsys):
    code, out, err, _ = run(capsys, "--version")
    assert (code, out, err) == (0, f"wsctl {__version__}\n", "")


def test_help_has_examples(capsys):
    code, out, _, _ = run(capsys, "--help")
    assert code == 0
    examples = out[out.index("examples:"):].splitlines()
    invocations = [line for line in examples if line.startswith("  wsctl ")]
    assert 4 <= len(invocations) <= 6, examples
    for line in invocations:  # each parses: no typo in what users copy
        argv = re.split(r"\s{2,}", line.strip())[0].split()[1:]
        assert wsctl._parser().parse_args(argv).command in wsctl.COMMANDS, line


@pytest.mark.parametrize("argv", [["status"], ["stats"], ["watch", "--interval", "0.05"]])
def test_a_reader_gone_keeps_the_exit_code_and_stops_a_follower(start_coordinator, argv):
    """``wsctl status | head -1`` with ranks missing: the pipe closes before wsctl writes.
    The exit code still says partial (3), not 0 as when the broken pipe ended the command,
    with no traceback; and ``watch`` stops instead of polling into the closed pipe."""
    coordinator = start_coordinator(world_size=2, tp_size=2)  # nobody registers: 2 missing
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write
    try:
        done = subprocess.run([sys.executable, "-m", "wsd_client.wsctl", *argv, "--endpoint",
                               coordinator.client_endpoint], stdout=write_end, stderr=subprocess.PIPE,
                              timeout=30, text=True)
    finally:
        os.close(write_end)
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_control_characters_from_peers_never_reach_the_terminal_raw():
    """Every human rendering passes Output.emit: ESC, BEL and C1 controls a peer put in a name
    or a message come out escaped (they once cleared the screen and retitled the terminal);
    watch's own redraw, first in its frame, is the one sequence sent as it is."""
    stream = io.StringIO()
    Output(False, stream).emit({}, lambda: "rank 0  host-\x1b]0;pwned\x07  \x9b31m\tok")
    assert stream.getvalue() == "rank 0  host-\\x1b]0;pwned\\x07  \\x9b31m\tok\n"
    stream = io.StringIO()
    Output(False, stream).emit({}, lambda: f"{CLEAR}frame \x1b[2J")
    assert stream.getvalue() == f"{CLEAR}frame \\x1b[2J\n"
    stream = io.StringIO()
    Output(True, stream).emit({"host": "a\x1b"}, lambda: "unused")
    assert stream.getvalue() == '{"host": "a\\u001b"}\n'
