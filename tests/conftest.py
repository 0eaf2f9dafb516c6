"""Shared test kit: bounded waits, coordinators on random loopback ports."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from wsd.config import CoordinatorConfig
from wsd.server import Coordinator


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

    def start(**overrides: Any) -> Coordinator:
        coordinator = Coordinator(coordinator_config(tmp_path, **overrides)).start()
        started.append(coordinator)
        return coordinator

    yield start
    for coordinator in started:
        coordinator.stop(timeout=10)
