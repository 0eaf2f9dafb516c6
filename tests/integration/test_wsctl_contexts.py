"""``wsctl`` contexts: each cluster's endpoint and keys by name in one file, as kubectl's.

Real coordinators on random loopback ports (one with CURVE, its keys written by
``wsctl keygen``), a contexts file in ``tmp_path`` named by ``$WSCTL_CONFIG``,
and ``wsctl.main`` run in this process.
"""

from __future__ import annotations

import json
import os
import shutil
import socket

import pytest

from wsd.security import SecurityConfig
from wsd.wire.curve import keygen
from wsd_client import contexts, wsctl


@pytest.fixture
def config(tmp_path, monkeypatch):
    """``config(text)``: the contexts file, with ``$WSCTL_CONFIG`` naming it and no ``$WSD_*``."""
    path = tmp_path / "wsctl.toml"
    monkeypatch.setenv("WSCTL_CONFIG", str(path))
    for name in ("WSD_ENDPOINT", "WSD_CURVE_SERVER_KEY", "WSD_CURVE_CLIENT_KEY"):
        monkeypatch.delenv(name, raising=False)

    def write(text: str):
        path.write_text(text)
        path.chmod(0o600)  # whatever the umask: one open to others is refused
        return path

    return write


@pytest.fixture
def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = wsctl.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def pinged(capsys, *argv: str) -> str:
    """Where ``wsctl ping`` went (its endpoint), failing with its stderr if it did not answer."""
    code, out, err = run(capsys, "ping", "--json", *argv)
    assert code == 0, err
    return json.loads(out)["endpoint"]


def test_precedence_flag_then_context_then_environment_then_current(config, capsys, monkeypatch,
                                                                    start_coordinator, closed_port):
    """Fails if a context is not used, or used over what should win: --endpoint or --context,
    then $WSD_ENDPOINT, then the file's current context."""
    one, two = start_coordinator(), start_coordinator()
    config(f'current = "one"\n\n[contexts.one]\nendpoint = "{one.client_endpoint}"\n\n'
           f'[contexts.two]\nendpoint = "{two.client_endpoint}"\n\n[contexts.down]\nendpoint = "{closed_port}"\n')
    assert pinged(capsys) == one.client_endpoint  # the current context
    assert pinged(capsys, "--context", "two") == two.client_endpoint
    assert pinged(capsys, "--endpoint", two.client_endpoint) == two.client_endpoint
    monkeypatch.setenv("WSD_ENDPOINT", two.client_endpoint)
    assert pinged(capsys) == two.client_endpoint  # the environment over the current context
    code, _, err = run(capsys, "ping", "--context", "down")  # --context over the environment
    assert code == 1 and f"nothing listens on {closed_port.removeprefix('tcp://')}" in err


def test_a_context_carries_the_curve_keys(config, capsys, start_coordinator, tmp_path):
    """Fails if a context's keys (relative to the file) are not used: a CURVE coordinator
    answers no one without them."""
    pairs = tmp_path / "keys"
    for name in ("server", "ops"):
        keygen(name, pairs)
    (tmp_path / "admin").mkdir()
    shutil.copy(pairs / "ops.key", tmp_path / "admin" / "ops.key")
    secure = start_coordinator(security=SecurityConfig(server_secret_key=str(pairs / "server.key_secret"),
                                                       admin_keys=str(tmp_path / "admin"), curve_clients=True))
    config(f'[contexts.secure]\nendpoint = "{secure.client_endpoint}"\n'
           'server_key = "keys/server.key"\nclient_key = "keys/ops.key_secret"\n'
           f'[contexts.plain]\nendpoint = "{secure.client_endpoint}"\n')
    code, out, err = run(capsys, "lock", "--context", "secure", "--json")
    assert code == 0 and json.loads(out)["seq"] == 1, err
    code, _, err = run(capsys, "ping", "--context", "plain", "--timeout", "0.3")
    assert code == 1 and "no reply" in err  # the same coordinator, without the keys


def test_config_lists_switches_and_prints_the_current_context(config, capsys):
    """Fails if use-context does not rewrite ``current`` (keeping the rest of the file), or
    get-contexts and current-context misreport the file."""
    path = config('# my clusters\ncurrent = "lab"  # where I work\n\n'
                  '[contexts.lab]\nendpoint = "tcp://127.0.0.1:7601"\n\n'
                  '[contexts.prod]  # careful\nendpoint = "tcp://head-0:7601"\n'
                  'server_key = "/etc/wsd/server.key"\nclient_key = "ops.key_secret"\n')
    code, out, _ = run(capsys, "config", "get-contexts")
    assert code == 0
    assert [line.split() for line in out.splitlines()] == [
        ["CURRENT", "NAME", "ENDPOINT", "CURVE"], ["*", "lab", "tcp://127.0.0.1:7601", "no"],
        ["prod", "tcp://head-0:7601", "yes"]]
    assert run(capsys, "config", "use-context", "prod") == (0, f"current context: prod ({path})\n", "")
    assert path.read_text().splitlines()[:2] == ["# my clusters", 'current = "prod"']
    assert "[contexts.prod]  # careful" in path.read_text()
    assert run(capsys, "config", "current-context") == (0, "prod\n", "")
    code, out, _ = run(capsys, "config", "get-contexts", "--json")
    doc = json.loads(out)
    assert doc["current"] == "prod" and doc["file"] == str(path)
    assert doc["contexts"][1] == {"name": "prod", "endpoint": "tcp://head-0:7601",
                                  "server_key": "/etc/wsd/server.key",
                                  "client_key": str(path.parent / "ops.key_secret")}


def test_a_file_without_current_gets_one_and_no_file_is_no_context(config, capsys, tmp_path):
    """Fails if use-context cannot set ``current`` where the file has none, or if a missing
    file is an error where it only means there are no contexts."""
    assert run(capsys, "config", "get-contexts")[:2] == (0, f"no contexts in {tmp_path / 'wsctl.toml'}\n")
    code, _, err = run(capsys, "config", "current-context")
    assert code == 1 and err == f"wsctl: no current context in {tmp_path / 'wsctl.toml'}\n"
    path = config('[contexts.lab]\nendpoint = "tcp://127.0.0.1:7601"\n')
    assert run(capsys, "config", "use-context", "lab")[0] == 0
    assert contexts.Contexts.load(path).current == "lab"


@pytest.mark.parametrize("text, argv, message", [
    ("current = [", ["ping"], "wsctl.toml: not valid TOML"),
    ('colour = "blue"\n', ["ping"], "wsctl.toml: colour: unknown key (allowed: current, contexts)"),
    ('[contexts.a]\nendpont = "tcp://h:1"\n', ["ping"], "wsctl.toml: contexts.a.endpont: unknown key"),
    ("[contexts.a]\n", ["ping"], "wsctl.toml: contexts.a.endpoint: missing"),
    ('[contexts.a]\nendpoint = "h:7601"\n', ["ping"],
     "wsctl.toml: contexts.a.endpoint: must be a ZeroMQ endpoint: tcp://HOST:PORT"),
    ('[contexts.a]\nendpoint = 7601\n', ["ping"], "wsctl.toml: contexts.a.endpoint: must be a string, got 7601"),
    ('[contexts.a]\nendpoint = "tcp://h:1"\nserver_key = "s.key"\n', ["ping"],
     "wsctl.toml: contexts.a.client_key: missing: CURVE needs both keys, and server_key is given"),
    ('current = "b"\n[contexts.a]\nendpoint = "tcp://h:1"\n', ["ping"],
     "wsctl.toml: current: no context 'b' (contexts: a)"),
    ('[contexts.a]\nendpoint = "tcp://h:1"\n', ["ping", "--context", "b"],
     "wsctl.toml: no context 'b' (contexts: a)"),
    ('[contexts.a]\nendpoint = "tcp://h:1"\n', ["config", "use-context", "b"],
     "wsctl.toml: no context 'b' (contexts: a)"),
    ("a = " + "[" * 50_000 + "]" * 50_000 + "\n", ["ping"], "wsctl.toml: not valid TOML for wsd: nested too deeply"),
])
def test_a_bad_file_is_a_usage_error_naming_the_file_and_key(config, capsys, text, argv, message):
    """Fails if a wrong contexts file is tried, raises a traceback, or is refused without
    saying which file and which key."""
    path = config(text)
    before = path.read_text()
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "") and err.startswith(f"wsctl: {path.parent}/") and message in err, err
    assert path.read_text() == before  # nothing rewritten


def test_a_broken_file_does_not_stop_an_explicit_endpoint(config, capsys, start_coordinator):
    """Fails if the contexts file is read (and its error stops wsctl) when --endpoint says
    where to go: the file is only read when a context is needed."""
    coordinator = start_coordinator()
    config("current = [")
    assert pinged(capsys, "--endpoint", coordinator.client_endpoint) == coordinator.client_endpoint


@pytest.mark.parametrize("argv", [
    ["--context", "secure", "--endpoint", "{other}", "lock"],
    ["lock", "--endpoint", "{other}", "--context", "secure"],
    ["--endpoint", "{other}", "lock", "--context", "secure"],  # one before the command, one after
])
def test_endpoint_and_context_together_are_a_usage_error(config, capsys, tmp_path, argv):
    """Fails if --endpoint with --context is accepted: the context's CURVE keys (and the
    command) would go to another cluster's endpoint. Nothing is sent: the other endpoint is
    a plain socket that records whether anyone connected."""
    config('[contexts.secure]\nendpoint = "tcp://127.0.0.1:1"\n'
           'server_key = "keys/server.key"\nclient_key = "keys/ops.key_secret"\n')
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        other.setblocking(False)
        endpoint = f"tcp://127.0.0.1:{other.getsockname()[1]}"
        code, out, err = run(capsys, *(a.format(other=endpoint) for a in argv))
        assert (code, out) == (2, ""), err
        assert "argument --context: not allowed with argument --endpoint" in err
        with pytest.raises(BlockingIOError):
            other.accept()  # nobody came


def test_a_contexts_file_others_can_write_is_refused(config, capsys, tmp_path):
    """Fails if wsctl trusts a contexts file that group or others can write: whoever can
    write it chooses the server key wsctl trusts (and the endpoint it sends commands to), so
    it is refused as ``load_public`` refuses such a key file, with exit 2 and the fix."""
    path = config('current = "lab"\n[contexts.lab]\nendpoint = "tcp://127.0.0.1:7601"\n')
    for mode in (0o664, 0o646, 0o666):
        path.chmod(mode)
        for argv in (["ping"], ["config", "get-contexts"], ["config", "use-context", "lab"]):
            code, out, err = run(capsys, *argv)
            assert (code, out) == (2, ""), (oct(mode), argv, err)
            assert err == (f"wsctl: the contexts file (it names the server keys wsctl trusts): {path} has mode "
                           f"{mode:04o}: group and others must not be able to write it (chmod 644 {path})\n")
    path.chmod(0o644)  # readable by others is fine: it holds no secret, only paths
    assert run(capsys, "config", "current-context")[:2] == (0, "lab\n")
    path.chmod(0o600)
    assert run(capsys, "config", "current-context")[:2] == (0, "lab\n")


def test_the_python_client_takes_a_context_too(config, start_coordinator):
    coordinator = start_coordinator()
    config(f'current = "here"\n[contexts.here]\nendpoint = "{coordinator.client_endpoint}"\n')
    with contexts.client(timeout=5) as client:
        assert client.endpoint == coordinator.client_endpoint and client.ping().epoch == coordinator.core.epoch


@pytest.mark.parametrize("kind", ["fifo", "proc", "large"])
def test_a_contexts_file_that_is_no_plain_file_of_ours_is_refused_without_hanging(config, capsys, tmp_path, kind):
    """A FIFO as the contexts file once hung wsctl; a link to /proc or a huge file is no
    contexts file either. Each is one line and exit 2, at once."""
    path = config('current = "lab"\n[contexts.lab]\nendpoint = "tcp://127.0.0.1:7601"\n')
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path, 0o644)
        why = "is not a regular file"
    elif kind == "proc":
        path.symlink_to("/proc/self/environ")
        why = "is /proc/"
    else:
        path.write_text("# " + "x" * (2 << 20) + "\n")
        why = "is over 1048576 bytes"
    code, out, err = run(capsys, "ping")
    assert (code, out) == (2, "") and why in err and "Traceback" not in err, err
