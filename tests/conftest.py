"""Shared test kit: bounded waits, coordinators on random loopback ports, ZeroMQ sockets.

ZeroMQ in tests, one way everywhere (as the best ZeroMQ test suites do,
``tests/zmqkit.py``): a context per test from ``zmq_context``; sockets from
``zmq_socket``, each with LINGER 0, bound to a random loopback port or
connected, and all closed at teardown; the context terminated within a bound,
so that a socket left open somewhere fails the test that left it instead of
hanging the run.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import zmq
from zmqkit import Sockets

from wsd.config import CoordinatorConfig
from wsd.coordinator.loop import Coordinator
from wsd.security import SecurityConfig
from wsd_client.results import PerEngine

T = TypeVar("T")

# wsctl's contexts: never the ones of whoever runs the tests (a current context of
# theirs would answer for every test that names no endpoint); tests of contexts set
# their own file. And `wsd up`'s state folder: one of the run's own, removed at its
# end, never the runner's ~/.local/state/wsd. Inherited by every process a test starts.
os.environ["WSCTL_CONFIG"] = os.devnull
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="wsd-tests-state-")
atexit.register(shutil.rmtree, os.environ["XDG_STATE_HOME"], ignore_errors=True)


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.01) -> Any:
    """Poll ``predicate`` until it is truthy; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def one_engine(answer: T | PerEngine[T]) -> T:
    """A client call's answer from one engine (the coordinator serves one, or the call named
    it): the client's calls are typed for a coordinator of several, one answer each."""
    assert not isinstance(answer, PerEngine), f"one engine's answer expected: {answer!r}"
    return answer


def coordinator_config(tmp_path, **overrides: Any) -> CoordinatorConfig:
    options: dict[str, Any] = {
        "agent_endpoint": "tcp://127.0.0.1:0",
        "client_endpoint": "tcp://127.0.0.1:0",
        "state_file": str(tmp_path / "coordinator.state"),
        "heartbeat_interval": 0.2,
        "heartbeat_timeout": 1.0,
        "command_timeout": 5.0,
        "stats_timeout": 2.0,
    }
    options.update(overrides)
    return CoordinatorConfig(**options)


@pytest.fixture
def start_coordinator(tmp_path) -> Iterator[Callable[..., Coordinator]]:
    """Start coordinators in threads on random ports; all are stopped afterwards."""
    started: list[Coordinator] = []

    def start(*, security: SecurityConfig | None = None, agent_token: bytes | None = None,
              **overrides: Any) -> Coordinator:
        coordinator = Coordinator(coordinator_config(tmp_path, **overrides), security=security,
                                  agent_token=agent_token).start()
        started.append(coordinator)
        return coordinator

    yield start
    for coordinator in started:
        coordinator.stop(timeout=10)


@pytest.fixture
def zmq_sockets() -> Iterator[Sockets]:
    """This test's own context and sockets (``tests/zmqkit.py``), closed and terminated at
    teardown within a bound (the test fails if a socket was left open)."""
    sockets = Sockets()
    yield sockets
    sockets.close()


@pytest.fixture
def zmq_context(zmq_sockets: Sockets) -> zmq.Context:
    """A context of this test's own, terminated at teardown within a bound (fails if not)."""
    return zmq_sockets.context


@pytest.fixture
def zmq_socket(zmq_sockets: Sockets) -> Callable[..., Any]:
    """``zmq_socket(kind, connect=ENDPOINT)`` or ``zmq_socket(kind, bind=True)`` (a random
    loopback port: ``sock.LAST_ENDPOINT``): LINGER 0, closed at teardown."""
    return zmq_sockets.socket
