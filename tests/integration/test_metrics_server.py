"""The coordinator's /metrics endpoint (wsd.coordinator.metrics_server), scraped for real.

A real coordinator on port 0 in each test. Plain HTTP: gzip when asked, HEAD,
404 off /metrics, 405 for other methods, the build, process and Python
families beside wsd's, the per-slot switch. HTTPS with a throwaway CA made in
the test (``cryptography``): a scrape that trusts the CA succeeds; with
client_auth_required a scraper without a client certificate is refused and one
with a certificate the CA signed is served; plain HTTP to the TLS port fails;
a client that connects and says nothing holds up no one else's scrape
(prometheus_client's own server stalls there: its handshake runs in its one
accepting thread). Hundreds of idle connections neither stop a scrape nor take
a thread each; a client trickling its request a byte at a time is cut off at
the connection's deadline. Bad TLS configuration fails at start-up naming the
key, and client certificates are checked against the CAs given, never the system's.
"""

from __future__ import annotations

import datetime
import gzip
import http.client
import ipaddress
import platform
import select
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import coordinator_config, wait_until
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from test_metrics import by, parse

import wsd
from wsd.agent.simulated import SimulatedRanks
from wsd.config import load_config
from wsd.coordinator import metrics_server
from wsd.coordinator.loop import Coordinator
from wsd.coordinator.metrics import (
    CONTENT_TYPE,
    SLOT_FAMILIES,
    Collector,
    Counters,
    EngineFigures,
    Published,
    RankFigures,
    StatsView,
    core_view,
)
from wsd.coordinator.metrics_server import HANDSHAKE_TIMEOUT, MAX_CONNECTIONS, WRITE_TIMEOUT, MetricsServer
from wsd.coordinator.registry import Registry
from wsd.errors import ConfigError
from wsd.slotstats import SLOT_NUMBERS

HEARTBEAT = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0}


# -- a throwaway CA ------------------------------------------------------------------------------


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name | None,
                 issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool = False,
                 usage: x509.ObjectIdentifier | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False),
            critical=True)
    if usage is ExtendedKeyUsageOID.SERVER_AUTH:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed by it."""
    folder = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("wsd test CA", ca_key, None, ca_key, ca=True)
    pki = Pki(*(folder / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")))
    pki.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for who, cert, key_path, usage in (
            ("127.0.0.1", pki.server_cert, pki.server_key, ExtendedKeyUsageOID.SERVER_AUTH),
            ("prometheus", pki.client_cert, pki.client_key, ExtendedKeyUsageOID.CLIENT_AUTH)):
        key = ec.generate_private_key(ec.SECP256R1())
        signed = _certificate(who, key, ca.subject, ca_key, usage=usage)
        cert.write_bytes(signed.public_bytes(serialization.Encoding.PEM))
        _write_key(key_path, key)
    return pki


def tls_options(pki: Pki, **more: object) -> dict[str, object]:
    return {"metrics_certfile": str(pki.server_cert), "metrics_keyfile": str(pki.server_key), **more}


def client_context(pki: Pki, *, certificate: bool = False) -> ssl.SSLContext:
    """What a scraper that trusts the test CA uses (with the client certificate if asked)."""
    context = ssl.create_default_context(cafile=str(pki.ca))
    if certificate:
        context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    return context


def get(url: str, *, context: ssl.SSLContext | None = None, method: str = "GET",
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one request, an error status included."""
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read()


# -- plain HTTP ----------------------------------------------------------------------------------


def test_a_scrape_is_gzipped_when_asked_and_head_404_and_405_answer_as_http_says(start_coordinator):
    """Prometheus asks for gzip (a 3.5 MB scrape shrinks tenfold); HEAD gives the headers alone;
    a path other than /metrics is 404 and says where the metrics are; POST is 405."""
    coordinator = start_coordinator(world_size=2, metrics_port=0)
    url = coordinator.metrics_url
    status, headers, plain = get(url)
    assert status == 200 and headers["Content-Type"] == CONTENT_TYPE and "Content-Encoding" not in headers
    status, headers, packed = get(url, headers={"Accept-Encoding": "gzip, deflate"})
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    assert int(headers["Content-Length"]) == len(packed)
    assert set(parse(gzip.decompress(packed).decode())[1]) == set(parse(plain.decode())[1])
    status, headers, body = get(url, method="HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 1000
    status, _, body = get(url.replace("/metrics", "/"))
    assert status == 404 and b"/metrics" in body
    status, headers, _ = get(url, method="POST")
    assert status == 405 and headers["Allow"] == "GET, HEAD"


def test_build_process_and_start_time_are_in_every_scrape(start_coordinator):
    """wsd_build_info names the version an operator runs; process_* (prometheus_client's own
    collector) give the coordinator's CPU, memory, descriptors and start time."""
    coordinator = start_coordinator(metrics_port=0)
    _, _, body = get(coordinator.metrics_url)
    types, samples = parse(body.decode())
    (labels,) = samples["wsd_build_info"]
    build = dict(labels)
    assert build["version"] == wsd.__version__ and build["python"] == platform.python_version()
    assert samples["wsd_build_info"][labels] == 1
    assert types["process_start_time_seconds"] == "gauge"
    started = samples["process_start_time_seconds"][()]
    assert started <= time.time() and samples["process_resident_memory_bytes"][()] > 0
    assert samples["process_open_fds"][()] > 0 and "python_info" in types


def test_metrics_slots_off_serves_no_per_slot_series(start_coordinator):
    """[coordinator] metrics_slots = false, through the configuration to a real scrape: the
    ranks' figures are there, their slots' are not."""
    coordinator = start_coordinator(world_size=2, tp_size=2, metrics_port=0, metrics_refresh=0.2,
                                    metrics_slots=False, **HEARTBEAT)
    with SimulatedRanks(coordinator.agent_endpoint, [0, 1], world_size=2, tp_size=2, num_ubatches=4,
                        **HEARTBEAT) as ranks:
        assert ranks.wait_registered(10)
        s = wait_until(lambda: (m := parse(get(coordinator.metrics_url)[2].decode())[1])
                       and len(m.get("wsd_rank_workspace_bytes", {})) == 2 and m, 10, "both ranks' figures")
    assert not SLOT_FAMILIES & set(s)
    assert set(by(s, "wsd_rank_lock_violations_total", "rank")) == {"0", "1"}
    assert set(by(s, "wsd_group_workspace_bytes", "tp_group")) == {"0"}
    assert load_config(env={"WSD_COORDINATOR_METRICS_SLOTS": "false"}).coordinator.metrics_slots is False


# -- HTTPS ---------------------------------------------------------------------------------------


def test_https_scrape_with_the_ca_and_plain_http_to_the_tls_port_fails(start_coordinator, pki):
    coordinator = start_coordinator(world_size=2, metrics_port=0, **tls_options(pki))
    url = coordinator.metrics_url
    assert url.startswith("https://127.0.0.1:")
    status, _, body = get(url, context=client_context(pki))
    assert status == 200 and "wsd_rank_up" in parse(body.decode())[1]
    with pytest.raises(urllib.error.URLError) as untrusted:  # a scraper that does not trust the CA
        get(url, context=ssl.create_default_context())
    assert isinstance(untrusted.value.reason, ssl.SSLCertVerificationError)
    plain = http.client.HTTPConnection("127.0.0.1", coordinator.metrics.port, timeout=5)
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        plain.request("GET", "/metrics")
        plain.getresponse()
    plain.close()


def test_client_certificates_are_checked_against_the_given_cas_never_the_systems(start_coordinator, pki, tmp_path):
    """With client_auth_required and no CA file, any certificate a public CA signed passed (the
    system's CAs were loaded); a CA file without client_auth_required did nothing. Both refused
    at load; with both set, a certificate from another CA is refused."""
    with pytest.raises(ConfigError, match="metrics_client_auth_required needs metrics_client_cafile or "
                                          "metrics_client_capath"):
        load_config(env={"WSD_COORDINATOR_METRICS_CERTFILE": "a.pem", "WSD_COORDINATOR_METRICS_KEYFILE": "a.key",
                         "WSD_COORDINATOR_METRICS_CLIENT_AUTH_REQUIRED": "true"})
    with pytest.raises(ConfigError, match="metrics_client_capath would check nothing without "
                                          "metrics_client_auth_required"):
        load_config(env={"WSD_COORDINATOR_METRICS_CERTFILE": "a.pem", "WSD_COORDINATOR_METRICS_KEYFILE": "a.key",
                         "WSD_COORDINATOR_METRICS_CLIENT_CAPATH": "cas"})
    other_key = ec.generate_private_key(ec.SECP256R1())
    other = _certificate("another CA", other_key, None, other_key, ca=True)
    (tmp_path / "other-ca.pem").write_bytes(other.public_bytes(serialization.Encoding.PEM))
    coordinator = start_coordinator(metrics_port=0, **tls_options(
        pki, metrics_client_cafile=str(tmp_path / "other-ca.pem"), metrics_client_auth_required=True))
    with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
        get(coordinator.metrics_url, context=client_context(pki, certificate=True))


def test_client_auth_required_refuses_a_scraper_without_a_certificate(start_coordinator, pki):
    coordinator = start_coordinator(metrics_port=0, **tls_options(
        pki, metrics_client_cafile=str(pki.ca), metrics_client_auth_required=True))
    url = coordinator.metrics_url
    # TLS 1.3 reports the refusal after the handshake, at the first read: either way, no answer.
    with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
        get(url, context=client_context(pki))
    status, _, body = get(url, context=client_context(pki, certificate=True))
    assert status == 200 and "wsd_build_info" in parse(body.decode())[1]


def test_a_client_silent_during_its_handshake_holds_up_no_other_scrape(start_coordinator, pki):
    """The handshake runs on the connection's own thread: one client that connects and sends
    nothing (prometheus_client's server waits on it with every other scrape behind) costs
    nothing to the next scraper."""
    coordinator = start_coordinator(metrics_port=0, **tls_options(pki))
    with socket.create_connection(("127.0.0.1", coordinator.metrics.port), timeout=5):
        started = time.monotonic()
        status, _, _ = get(coordinator.metrics_url, context=client_context(pki))
        # Behind the silent client, the scrape would take the whole handshake timeout.
        assert status == 200 and time.monotonic() - started < HANDSHAKE_TIMEOUT / 2


@pytest.mark.parametrize("https", [False, True], ids=["http", "https"])
def test_hundreds_of_idle_connections_neither_stop_a_scrape_nor_take_a_thread_each(start_coordinator, pki, https):
    """One thread per connection, with no limit: 300 idle connections held 302 threads (and
    each would have held a scrape's text). Now at most MAX_CONNECTIONS are served at once;
    one more evicts the oldest that has sent no request, so a scrape still gets in."""
    options = tls_options(pki) if https else {}
    coordinator = start_coordinator(world_size=2, metrics_port=0, **options)
    context = client_context(pki) if https else None
    before = threading.active_count()
    idle = []
    try:
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", coordinator.metrics.port), timeout=5))
        status, _, body = get(coordinator.metrics_url, context=context)
        assert status == 200 and "wsd_rank_up" in parse(body.decode())[1]
        # The evicted connections' threads end as their sockets are shut, at once; the rest stay
        # bounded. (Before, each waited out its handshake or request timeout: 10 s, 60 s.)
        wait_until(lambda: threading.active_count() <= before + MAX_CONNECTIONS, HANDSHAKE_TIMEOUT / 2,
                   "connection threads within the limit")
        status, _, _ = get(coordinator.metrics_url, context=context)
        assert status == 200
    finally:
        for sock in idle:
            sock.close()


def trickle(sock: socket.socket | ssl.SSLSocket, seconds: float) -> float | None:
    """Send a request a byte at a time, one every 0.1 s, for at most ``seconds``; the seconds
    until the server closed the connection, or None if it never did."""
    started = time.monotonic()
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"y" * 10_000
    for byte in request:
        if time.monotonic() - started > seconds:
            return None
        readable, _, _ = select.select([sock], [], [], 0.1)
        try:
            if readable and sock.recv(1) == b"":
                return time.monotonic() - started
            sock.send(bytes([byte]))
        except (ConnectionError, ssl.SSLError, OSError):
            return time.monotonic() - started
    return None


@pytest.mark.parametrize("https", [False, True], ids=["http", "https"])
def test_a_client_trickling_its_request_is_cut_off_at_its_deadline(start_coordinator, pki, monkeypatch, https):
    """The timeout applied per read: a client sending a byte now and then held its thread for
    ever. One deadline now covers the handshake and the request line and headers."""
    monkeypatch.setattr(metrics_server, "HANDSHAKE_TIMEOUT", 1.0)
    coordinator = start_coordinator(metrics_port=0, **(tls_options(pki) if https else {}))
    sock: socket.socket | ssl.SSLSocket = socket.create_connection(("127.0.0.1", coordinator.metrics.port),
                                                                   timeout=5)
    if https:
        sock = client_context(pki).wrap_socket(sock, server_hostname="127.0.0.1")
    with sock:
        closed_after = trickle(sock, 30.0)
    assert closed_after is not None, "the server never closed a connection trickling its request"
    assert closed_after < 1.0 + 10.0  # the deadline, with a margin for a busy machine
    status, _, _ = get(coordinator.metrics_url, context=client_context(pki) if https else None)
    assert status == 200


@pytest.mark.parametrize("options, message", [
    ({"metrics_certfile": "missing.pem", "metrics_keyfile": "server.key"},
     r"\[coordinator\] metrics_certfile: file .*missing\.pem not found"),
    ({"metrics_certfile": "server.pem", "metrics_keyfile": "ca.pem"},
     r"metrics_certfile .*server\.pem, metrics_keyfile .*ca\.pem: not a certificate and its private key"),
    ({"metrics_certfile": "server.pem", "metrics_keyfile": "server.key", "metrics_client_cafile": "nope.pem",
      "metrics_client_auth_required": True},
     r"\[coordinator\] metrics_client_cafile: file .*nope\.pem not found"),
    ({"metrics_certfile": "server.pem", "metrics_keyfile": "server.key", "metrics_client_capath": "ca.pem",
      "metrics_client_auth_required": True},
     r"\[coordinator\] metrics_client_capath: .*ca\.pem is not a folder"),
    ({"metrics_certfile": ".", "metrics_keyfile": "server.key"},
     r"\[coordinator\] metrics_certfile: .* is a folder; a PEM file is expected"),
])
def test_bad_tls_files_fail_the_start_naming_the_key(tmp_path, pki, options, message):
    """Files are checked when the endpoint starts, before any port is left bound."""
    paths = {k: str(pki.ca.parent / v) if isinstance(v, str) else v for k, v in options.items()}
    config = coordinator_config(tmp_path, metrics_port=0, **paths)
    with pytest.raises(ConfigError, match=message):
        Coordinator(config)


@pytest.mark.parametrize("env, message", [
    ({"WSD_COORDINATOR_METRICS_CERTFILE": "a.pem"}, "metrics_certfile and metrics_keyfile go together"),
    ({"WSD_COORDINATOR_METRICS_CLIENT_AUTH_REQUIRED": "true"}, "metrics_client_auth_required need.* HTTPS"),
    ({"WSD_COORDINATOR_METRICS_CLIENT_CAFILE": "ca.pem"}, "metrics_client_cafile need.* HTTPS"),
    ({"WSD_COORDINATOR_METRICS_CERTFILE": "a.pem", "WSD_COORDINATOR_METRICS_KEYFILE": "a.key",
      "WSD_COORDINATOR_METRICS_CLIENT_CAFILE": "ca.pem"},
     "metrics_client_cafile would check nothing without metrics_client_auth_required = true"),
    ({"WSD_COORDINATOR_METRICS_SLOTS": "sometimes"}, "METRICS_SLOTS"),
])
def test_tls_options_that_would_serve_plain_http_are_refused(env, message):
    """A certificate without its key, or a client option without HTTPS, would serve plain
    HTTP while the operator believes otherwise: refused at load, naming the keys."""
    with pytest.raises(ConfigError, match=message):
        load_config(env=env)


def _big_view(ranks: int, slots: int) -> Published:
    """A published view of ``ranks`` ranks of ``slots`` slots each: a scrape of several MB."""
    columns = {n.name: [1 << 20] * slots for n in SLOT_NUMBERS}
    columns.update(ubatch=list(range(slots)), lane=[0] * slots)
    stats = StatsView(time.time(), tuple(RankFigures(r, r // 8, 1 << 30, 0.5, False, columns) for r in range(ranks)),
                      ())
    registry = Registry(ranks, 8, 5.0)
    return Published(counters=Counters(), engines=(EngineFigures("default", core_view(registry, seq=0,
                                                                                     inconsistent=set()), stats),))


def test_clients_that_never_read_their_answer_keep_no_real_scrape_out():
    """16 connections that sent `GET /metrics` and never read held every slot for 60 s once a
    scrape outgrew the socket buffers (3.6 MB at 1,024 ranks): 0 of 40 real scrapes got in.
    Now one address holds at most MAX_PER_ADDRESS connections, a full server evicts the one
    answered longest, and a write waits at most WRITE_TIMEOUT for its reader."""
    published = _big_view(2048, 8)
    server = MetricsServer(lambda: published, "127.0.0.1", 0)
    stuck = []
    try:
        size = len(Collector(lambda: published).render())
        assert size > 4 << 20, size  # far more than the socket buffers hold
        for _ in range(16):  # as many as the server serves at once
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # and never read
            stuck.append(sock)
        served = 0
        for _ in range(10):  # as Prometheus scrapes: gzip accepted
            status, _, body = get(server.url, headers={"Accept-Encoding": "gzip"})
            served += status == 200 and "wsd_rank_up" in gzip.decompress(body).decode()
        assert served == 10
        # every non-reader is gone within the write deadline, evicted or timed out
        wait_until(lambda: len(server._server.open) <= 1, WRITE_TIMEOUT + 10, "the non-readers dropped")
    finally:
        for sock in stuck:
            sock.close()
        server.stop()
