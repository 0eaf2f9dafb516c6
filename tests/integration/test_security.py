"""Security: CURVE keys, client roles, loopback by default; and the agent socket's size limit.

Real coordinators in threads on random loopback ports, with real CURVE key
pairs written by ``wsctl keygen``, real ZAP (pyzmq's authenticator), the real
Python client, wsctl and in-process agents. A key listed nowhere, and a
plain-text peer, must get nothing at all: the tests bound that wait and expect
``Unavailable`` (clients) or no registration (agents).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import zmq
import zmq.auth
from conftest import coordinator_config, wait_until
from procs import COORDINATOR_READY, coordinator_section, python, spawn, torchrun, worker_env, write_config  # noqa: F401
from zmq.utils.monitor import recv_monitor_message

from wsd import WorkspaceManager
from wsd.agent.thread import Agent
from wsd.config import MAX_LANES, MAX_UBATCHES, CoordinatorConfig, load_config
from wsd.coordinator.loop import Coordinator
from wsd.errors import ConfigError, StateFileError
from wsd.security import SecurityConfig
from wsd.wire import protocol as p
from wsd.wire.curve import ClientKeys, agent_keys, is_loopback, keygen, load_public, load_secret
from wsd.wire.protocol import COMMAND_OPS, ErrorCode, Op
from wsd_client import wsctl
from wsd_client.client import Client, ClientError, Unavailable

# How long a refused peer is given to get in anyway: a listed key connects in
# milliseconds on loopback, so this only bounds the wait for "nothing happened".
REFUSED_WAIT = 1.0


class Keys:
    """Key pairs written by keygen, and the coordinator's folders of public keys."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pairs = root / "pairs"
        for name in ("server", "admin", "viewer", "stranger", "agent", "rogue_agent"):
            keygen(name, self.pairs)
        for folder, names in (("admin", ["admin"]), ("viewer", ["viewer"]), ("agents", ["agent"])):
            (root / folder).mkdir()
            for name in names:
                shutil.copy(self.pairs / f"{name}.key", root / folder / f"{name}.key")

    def secret(self, name: str) -> str:
        return str(self.pairs / f"{name}.key_secret")

    def public(self, name: str) -> str:
        return str(self.pairs / f"{name}.key")

    def security(self, **overrides) -> SecurityConfig:
        options = {"server_secret_key": self.secret("server"), "viewer_keys": str(self.root / "viewer"),
                   "admin_keys": str(self.root / "admin"), "agent_keys": str(self.root / "agents"),
                   "agent_secret_key": self.secret("agent")}
        return SecurityConfig(**{**options, **overrides})

    def client(self, coordinator: Coordinator, name: str, timeout: float = 5.0) -> Client:
        return Client(coordinator.client_endpoint, timeout=timeout, retries=0,
                      curve_server_key=self.public("server"), curve_client_key=self.secret(name))


@pytest.fixture
def keys(tmp_path) -> Keys:
    return Keys(tmp_path / "keys")


@pytest.fixture
def serve(start_coordinator):
    """Start coordinators with a [security] section (conftest's, which stops them all)."""
    return lambda security, **overrides: start_coordinator(security=security, **overrides)


@pytest.fixture
def agents():
    made: list[Agent] = []

    def make(coordinator: Coordinator, rank: int, world: int, curve: ClientKeys | None) -> Agent:
        agent = Agent(WorkspaceManager("cpu", 1), endpoint=coordinator.agent_endpoint, rank=rank,
                      world_size=world, idle=True, heartbeat_interval=0.2, heartbeat_timeout=1.0,
                      curve=curve).start()
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.stop(timeout=10)


# -- client roles ------------------------------------------------------------------------------


def test_admin_key_may_change_state(keys, serve):
    """Fails if CURVE keeps an admin out, or the admin role is refused a command."""
    coordinator = serve(keys.security(curve_clients=True))
    with keys.client(coordinator, "admin") as admin:
        result = admin.lock(wait=False)
        assert result.seq == 1
        assert admin.status()["desired"]["locked"] is True
        # The command's event names the role and key CURVE proved, apart from what the client says.
        (event,) = [e for e in admin.events()["events"] if e["kind"] == "command"]
        assert event["proven"] == {"role": "admin", "key": "admin"} and set(event["by"]) == {"user", "host"}


def test_viewer_key_reads_and_every_state_changing_op_is_forbidden(keys, serve):
    """Fails if a viewer can read nothing, if any command op gets through for a viewer, or
    if a refused command consumes a sequence number or touches the desired state."""
    coordinator = serve(keys.security(curve_clients=True))
    with keys.client(coordinator, "admin") as admin, keys.client(coordinator, "viewer") as viewer:
        admin.set_ubatches(2, wait=False)  # a desired state that is not blank
        before = viewer.status()
        assert viewer.ping()["seq"] == 1
        assert viewer.ranks()["ranks"] == []
        assert "complete" in viewer.stats()
        assert viewer.events()["cursor"] >= 0
        commands = {
            Op.LOCK: lambda c: c.lock(wait=False), Op.UNLOCK: lambda c: c.unlock(wait=False),
            Op.SET_UBATCHES: lambda c: c.set_ubatches(4, wait=False),
            Op.RESERVE: lambda c: c.reserve_bytes(4096, wait=False),
            Op.EQUALIZE: lambda c: c.equalize(wait=False), Op.TRIM: lambda c: c.trim(wait=False),
        }
        assert set(commands) == COMMAND_OPS  # a new command op must be added here
        for op, call in commands.items():
            with pytest.raises(ClientError) as refused:
                call(viewer)
            assert refused.value.code is ErrorCode.FORBIDDEN, op
            assert str(op) in refused.value.message and "viewer" in refused.value.message
        after = viewer.status()
        assert (after["seq"], after["desired"]) == (before["seq"], before["desired"]) == (1, before["desired"])
        assert admin.lock(wait=False).seq == 2  # no number was spent on the refusals


def test_stacks_are_for_an_admin_key_only(keys, serve):
    """Fails if a viewer key can read the workers' stacks (they name the code and files each
    worker runs, and asking interrupts every worker asked), or an admin cannot."""
    coordinator = serve(keys.security(curve_clients=True))
    with keys.client(coordinator, "admin") as admin, keys.client(coordinator, "viewer") as viewer:
        with pytest.raises(ClientError) as refused:
            viewer.stacks()
        assert refused.value.code is ErrorCode.FORBIDDEN and "stacks" in refused.value.message
        assert "viewer" in refused.value.message
        assert admin.stacks().ranks == []  # no rank registered: an answer with none


def test_unlisted_key_and_plain_text_client_get_nothing(keys, serve):
    """Fails if a key in no folder, or a client without CURVE, gets any answer at all."""
    coordinator = serve(keys.security(curve_clients=True))
    for client in (keys.client(coordinator, "stranger", timeout=REFUSED_WAIT),
                   Client(coordinator.client_endpoint, timeout=REFUSED_WAIT, retries=0)):
        with client, pytest.raises(Unavailable):
            client.ping()
    with keys.client(coordinator, "admin") as admin:  # the coordinator was up all along
        assert admin.ping()["seq"] == 0


def test_wsctl_connects_with_curve_keys_from_flags_and_environment(keys, serve, capsys, monkeypatch):
    """Fails if wsctl ignores --curve-*-key or WSD_CURVE_*, or hides a viewer's refusal."""
    coordinator = serve(keys.security(curve_clients=True))
    endpoint = ["--endpoint", coordinator.client_endpoint, "--timeout", "3"]
    assert wsctl.main([*endpoint, "ping", "--curve-server-key", keys.public("server"),
                       "--curve-client-key", keys.secret("admin")]) == 0
    monkeypatch.setenv("WSD_CURVE_SERVER_KEY", keys.public("server"))
    monkeypatch.setenv("WSD_CURVE_CLIENT_KEY", keys.secret("viewer"))
    assert wsctl.main([*endpoint, "status"]) == 0
    capsys.readouterr()
    assert wsctl.main([*endpoint, "lock"]) == 1
    assert "forbidden" in capsys.readouterr().err
    monkeypatch.delenv("WSD_CURVE_SERVER_KEY")
    assert wsctl.main([*endpoint, "ping"]) == 2  # one key of two: a usage error
    assert "--curve-server-key" in capsys.readouterr().err


# -- agents ------------------------------------------------------------------------------------


def test_agents_register_only_with_a_listed_key(keys, serve, agents):
    """Fails if CURVE on the agent endpoint keeps a listed agent out, or lets an agent with an
    unlisted key, or with no CURVE at all, register."""
    security = keys.security(curve_agents=True)
    coordinator = serve(security, world_size=3)
    good = agents(coordinator, 0, 3, agent_keys(security))
    rogue = agents(coordinator, 1, 3, ClientKeys.load(keys.secret("rogue_agent"), keys.public("server")))
    plain = agents(coordinator, 2, 3, None)
    assert good.wait_registered(10)
    assert not rogue.wait_registered(REFUSED_WAIT) and not plain.wait_registered(0)
    with Client(coordinator.client_endpoint, timeout=5) as client:  # clients stay plain here
        assert client.status()["ranks"]["live"] == 1


def test_coordinator_and_worker_processes_use_curve_from_one_config_file(keys, tmp_path, spawn):  # noqa: F811
    """Fails if ``wsd coordinator`` ignores [security], or a torchrun worker's agent does not
    connect with the configured keys (it would never register on a CURVE agent endpoint)."""
    security = {"curve_clients": True, "curve_agents": True, "server_secret_key": keys.secret("server"),
                "admin_keys": str(keys.root / "admin"), "agent_keys": str(keys.root / "agents"),
                "agent_secret_key": keys.secret("agent")}
    config = write_config(tmp_path / "wsd.toml", {"coordinator": {**coordinator_section(tmp_path),
                                                                  "world_size": 1},
                                                  "security": security})
    coordinator = spawn(python("-m", "wsd.programs.cli", "coordinator", "--config", config), name="wsd coordinator")
    agent_endpoint, client_endpoint = coordinator.wait_for(COORDINATOR_READY, 30).groups()
    spawn(torchrun(1, config, "--idle"), name="torchrun",
          env=worker_env(WSD_COORDINATOR_CONNECT_ENDPOINT=agent_endpoint))
    with Client(client_endpoint, timeout=5, curve_server_key=keys.public("server"),
                curve_client_key=keys.secret("admin")) as admin:
        wait_until(lambda: admin.status()["ranks"]["live"] == 1, 60, "the worker's agent to register")
        assert admin.lock(timeout=10).complete
    with Client(client_endpoint, timeout=REFUSED_WAIT, retries=0) as plain, pytest.raises(Unavailable):
        plain.ping()


# -- key files ---------------------------------------------------------------------------------


def test_key_files_others_may_read_or_write_are_refused_at_start_up(keys, tmp_path):
    """Fails if a secret key readable by group or others, or a public key others may rewrite,
    is used instead of refused with the file and its mode."""
    config = coordinator_config(tmp_path)
    os.chmod(keys.secret("server"), 0o640)
    with pytest.raises(ConfigError, match=r"server_secret_key.*server\.key_secret has mode 0640"):
        Coordinator(config, security=keys.security(curve_clients=True))
    with pytest.raises(ConfigError, match="mode 0640"):  # agents read it when server_public_key is unset
        agent_keys(keys.security(curve_agents=True))
    os.chmod(keys.secret("server"), 0o600)
    os.chmod(keys.secret("viewer"), 0o604)
    with pytest.raises(ConfigError, match=r"--curve-client-key.*viewer\.key_secret has mode 0604"):
        Client("tcp://127.0.0.1:1", curve_server_key=keys.public("server"),
               curve_client_key=keys.secret("viewer"))
    os.chmod(keys.root / "admin" / "admin.key", 0o666)
    with pytest.raises(ConfigError, match=r"admin_keys.*admin\.key has mode 0666"):
        Coordinator(config, security=keys.security(curve_clients=True))
    os.chmod(keys.root / "admin" / "admin.key", 0o644)
    Coordinator(config, security=keys.security(curve_clients=True)).stop()  # fixed: it starts


def test_security_section_loads_from_file_and_environment(keys, tmp_path):
    """Fails if [security] is not read by load_config, or a half-configured CURVE is accepted."""
    path = tmp_path / "wsd.toml"
    path.write_text(f'[security]\ncurve_clients = true\nserver_secret_key = "{keys.secret("server")}"\n'
                    f'admin_keys = "{keys.root / "admin"}"\n')
    config = load_config(path, env={"WSD_SECURITY_CURVE_AGENTS": "true"})
    assert config.security.curve_clients and config.security.curve_agents
    assert config.security.admin_keys == str(keys.root / "admin")
    path.write_text("[security]\ncurve_clients = true\n")
    with pytest.raises(ConfigError, match=r"wsd\.toml: \[security\] .*viewer_keys nor admin_keys"):
        load_config(path, env={})


# -- where the client endpoint listens ---------------------------------------------------------


def test_client_endpoint_is_loopback_by_default_and_says_nothing(tmp_path, caplog):
    """Fails if the default client (or agent) endpoint is reachable from other hosts, or if a
    loopback coordinator without CURVE warns anyway."""
    defaults = load_config(env={}).coordinator
    assert is_loopback(defaults.client_endpoint) and is_loopback(defaults.agent_endpoint)
    config = CoordinatorConfig(client_endpoint=defaults.client_endpoint.rsplit(":", 1)[0] + ":0",
                               agent_endpoint=defaults.agent_endpoint.rsplit(":", 1)[0] + ":0",
                               state_file=str(tmp_path / "state"))
    with caplog.at_level(logging.WARNING, logger="wsd"):
        coordinator = Coordinator(config)
    coordinator.stop()
    assert coordinator.client_endpoint.startswith("tcp://127.0.0.1:")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_non_loopback_bind_without_curve_warns(keys, tmp_path, caplog):
    """Fails if a coordinator reachable from other hosts without CURVE says nothing, or warns
    about an endpoint CURVE protects."""
    wide = coordinator_config(tmp_path, client_endpoint="tcp://0.0.0.0:0")
    with caplog.at_level(logging.WARNING, logger="wsd"):
        Coordinator(wide).stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "clients endpoint tcp://0.0.0.0:" in warnings[0]
    assert "curve_clients" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="wsd"):
        Coordinator(wide, security=keys.security(curve_clients=True)).stop()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# -- wsctl keygen ------------------------------------------------------------------------------


def test_keygen_writes_a_zeromq_certificate_pair_with_a_private_secret(tmp_path, capsys):
    """Fails if keygen's files do not load as ZeroMQ certificates, if the secret is readable by
    anyone but its owner, if it says nothing of where the public key goes, or if it overwrites."""
    folder = tmp_path / "mine"
    assert wsctl.main(["keygen", "alice", "--dir", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "viewer_keys" in out and "admin_keys" in out and str(folder / "alice.key") in out
    public, none = zmq.auth.load_certificate(folder / "alice.key")
    again, secret = zmq.auth.load_certificate(folder / "alice.key_secret")
    assert none is None and secret is not None and public == again and len(public) == 40
    assert stat.S_IMODE(os.stat(folder / "alice.key_secret").st_mode) == 0o600
    assert sorted(os.listdir(folder)) == ["alice.key", "alice.key_secret"]  # no temporary left
    assert wsctl.main(["keygen", "alice", "--dir", str(folder)]) == 2
    assert "exists already" in capsys.readouterr().err
    assert zmq.auth.load_certificate(folder / "alice.key_secret")[1] == secret


# -- the agent socket's size limit ----------------------------------------------------------------


def test_oversize_agent_frame_is_dropped_and_the_coordinator_serves_on(start_coordinator, agents, zmq_socket):
    """Fails if the agent ROUTER has no MAXMSGSIZE (an agent could make it buffer any amount:
    the oversize frame would reach the core and be refused there), or if dropping it hurts
    the coordinator or a well-behaved rank."""
    limit = 64 * 1024
    coordinator = start_coordinator(max_agent_message_bytes=limit, world_size=1)
    good = agents(coordinator, 0, 1, None)
    assert good.wait_registered(10)
    raw = zmq_socket(zmq.DEALER)
    monitor = raw.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    try:
        raw.connect(coordinator.agent_endpoint)

        def next_event(timeout_ms: int = 5000) -> int:
            assert monitor.poll(timeout_ms), "no socket event in time"
            return recv_monitor_message(monitor)["event"]

        assert next_event() == zmq.EVENT_CONNECTED
        raw.send(b"\xc1" * (limit - 64))  # garbage under the limit: read and refused
        assert raw.poll(5000), "no reply to a frame under the limit"
        assert p.decode(raw.recv()).op is Op.REJECTED
        refused = coordinator.core.dropped_bad_agent_frames
        raw.send(b"\xc1" * (limit + 1))
        assert next_event() == zmq.EVENT_DISCONNECTED  # cut off, unread
        assert coordinator.core.dropped_bad_agent_frames == refused
        with Client(coordinator.client_endpoint, timeout=5) as client:
            assert client.ping()["epoch"] == coordinator.core.epoch
            wait_until(lambda: client.status()["ranks"]["live"] == 1, 5, "rank 0 live")
            assert client.lock().complete and good.manager.is_locked()
    finally:
        raw.disable_monitor()
        monitor.close(linger=0)


def test_default_agent_limit_passes_the_largest_stats_reply(start_coordinator):
    """Fails if the default agent limit cuts off a legitimate stats reply: a rank with the most
    slots a manager allows (64 ubatches x 64 lanes) must still report in full."""
    coordinator = start_coordinator(world_size=1)  # max_agent_message_bytes at its default
    assert coordinator.config.max_agent_message_bytes == CoordinatorConfig().max_agent_message_bytes
    manager = WorkspaceManager("cpu", MAX_UBATCHES, MAX_LANES)
    agent = Agent(manager, endpoint=coordinator.agent_endpoint, rank=0, world_size=1, idle=True,
                  heartbeat_interval=0.2, heartbeat_timeout=1.0).start()
    try:
        assert agent.wait_registered(10)
        with Client(coordinator.client_endpoint, timeout=10) as client:
            stats = client.stats(fresh=True)  # asked for
            assert stats["complete"] and not stats["missing"] and len(stats.reporting) == 1
            stats = wait_until(lambda: (s := client.stats())["complete"] and s, 5, "the pushed snapshot")
        assert len(stats["slots"]["ubatch"]) == MAX_UBATCHES * MAX_LANES
    finally:
        agent.stop(timeout=10)


# -- files a reader may trust ------------------------------------------------------------------


def _token_file(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A token file of one hostile kind, and the words its refusal must have."""
    path = tmp_path / "token"
    if kind == "fifo":
        os.mkfifo(path, 0o600)
        return path, "is not a regular file"
    if kind == "proc":
        path.symlink_to("/proc/self/environ")
        return path, "/environ, not a file of yours"
    path.write_text("t" * 64)
    path.chmod(0o600)
    if kind == "other user":
        if os.getuid() != 0:
            pytest.skip("only root can give a file to another user here")
        os.chown(path, 65534, 65534)
        return path, "belongs to uid 65534, not to this user"
    if kind == "readable":
        path.chmod(0o640)
        return path, "has mode 0640: group and others must have no access to it (chmod 600"
    path.write_text("t" * 5000)  # "large"
    return path, "is over 4096 bytes"


@pytest.mark.parametrize("kind", ["fifo", "proc", "other user", "readable", "large"])
def test_an_agent_token_file_is_read_only_from_a_plain_file_of_its_own(tmp_path, kind):
    """Another user's token file (mode 0600 in their folder) was trusted, a link to
    /proc/self/environ read, and a FIFO would hang the start: each is refused, naming why."""
    from wsd.security import SecurityConfig, load_agent_token

    path, why = _token_file(tmp_path, kind)
    with pytest.raises(ConfigError, match=r"\[security\] agent_token_file: ") as info:
        load_agent_token(SecurityConfig(agent_token_file=str(path)), environ={})
    assert why in str(info.value)


def test_a_key_file_of_another_user_is_refused(tmp_path):
    if os.getuid() != 0:
        pytest.skip("only root can give a file to another user here")
    public, secret = keygen("k", tmp_path)
    os.chown(public, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        load_public(str(public), "[security] server_key")
    assert load_secret(str(secret), "[security] key")[1]


def test_a_viewers_frame_is_decoded_once(monkeypatch):
    """Fails if the loop decodes a viewer's read-only request before the core decodes it
    again (two decodes of every query), or passes a viewer's command on to the core."""
    decoded: list[bytes] = []
    real_decode = p.decode
    monkeypatch.setattr(p, "decode", lambda frame, *a, **k: (decoded.append(frame), real_decode(frame, *a, **k))[1])
    reached: list[bytes] = []

    class Core:  # the core decodes what reaches it (CoordinatorCore.handle_client does)
        def handle_client(self, route: tuple[bytes, ...], frame: bytes, role: str | None, key: str | None) -> list:
            reached.append(frame)
            p.decode(frame, p.CLIENT_OPS)
            return []

    loop = SimpleNamespace(core=Core())
    query, command = p.encode(Op.STATUS, {}, 7), p.encode(Op.LOCK, {"group": None}, 8)
    assert Coordinator._client_frame(loop, (b"peer",), query, "viewer:alice") == []  # type: ignore[arg-type]
    assert (decoded, reached) == ([query], [query])
    decoded.clear()
    ((_, _, reply),) = Coordinator._client_frame(loop, (b"peer",), command, "viewer:alice")  # type: ignore[arg-type]
    answer = p.decode_reply(reply)
    assert (answer.id, answer.code) == (8, ErrorCode.FORBIDDEN)
    assert (decoded, reached) == ([command], [query])


# -- a local cluster belongs to its owner ----------------------------------------------------------


@pytest.mark.skipif(os.getuid() != 0, reason="trying another user's connection needs root to become that user")
def test_a_local_clusters_client_endpoint_admits_its_owner_only(tmp_path, start_coordinator):
    """Without CURVE whoever reaches the client endpoint is an admin, and `wsd up`'s was TCP on
    loopback: any user of a shared GPU node could lock, unlock or reserve another user's
    cluster. Its endpoint is now a Unix socket in a folder only its owner may enter: another
    user's connection is refused by the kernel; the owner's works."""
    import socket

    from wsd.programs.up import owner_only_endpoint

    endpoint = owner_only_endpoint(str(tmp_path / "default-world2-tp2.state"))
    assert endpoint == f"ipc://{tmp_path}/default-world2-tp2.run/client"
    assert stat.S_IMODE(os.stat(tmp_path / "default-world2-tp2.run").st_mode) == 0o700
    tmp_path.chmod(0o755)  # the folder above lets others pass, as a home or /tmp does
    coordinator = start_coordinator(client_endpoint=endpoint)
    with Client(coordinator.client_endpoint, timeout=5) as owner:
        assert owner.lock(wait=False).seq == 1
    path = endpoint.removeprefix("ipc://")
    child = os.fork()
    if child == 0:  # another user of the host: nobody
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
            code = 0
        except PermissionError:
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 1, "another user connected to the cluster's client socket"
    assert coordinator.core.engine().log.seq == 1


def test_a_folder_for_the_client_socket_that_others_may_enter_is_refused(tmp_path):
    from wsd.programs.up import owner_only_endpoint

    (tmp_path / "c.run").mkdir(mode=0o755)
    (tmp_path / "c.run").chmod(0o755)
    with pytest.raises(StateFileError, match=r"c\.run: .* not a folder only this user may enter .*mode 0755"):
        owner_only_endpoint(str(tmp_path / "c.state"))
    assert owner_only_endpoint(str(tmp_path / ("x" * 120 + ".state"))) is None  # too long for a Unix socket
