"""wsd's figures in vLLM's own ``/metrics``: every worker's slots, served by vLLM's API server.

vLLM serves ``/metrics`` from its API server, while the workspaces live in the
worker processes. vLLM itself brings its engine cores' figures to the API
server in the scheduler stats each output carries, and, with several API
servers, through prometheus_client's multiprocess directory. wsd does as the
latter, with files of its own:

- the first process where the plugin runs (``vllm serve``'s own, which starts
  every other) makes a directory only its user may enter and names it in
  ``WSD_VLLM_METRICS_DIR``, which every process it starts inherits; it removes
  the directory as it exits (``share_directory``);
- each worker writes its figures there (``Publisher``): one file named after its
  pid, replaced whole (written aside, then renamed) every ``PUBLISH_INTERVAL``
  seconds when they changed, touched when not, removed when the worker stops;
- the registry vLLM serves at ``/metrics`` (prometheus_client's global one with
  one API server, each server's multiprocess one with several) gets a collector
  that reads every file at each scrape (``WorkerCollector``, added by
  ``serve_workers`` where the patches find vLLM asking for that registry). A file
  whose process is gone is removed there.

The labels are vLLM's first, ``model_name`` (the served model name) and
``engine`` (the engine's index, its data-parallel rank), so that a ``wsd_*``
series joins the ``vllm:*`` ones; then ``rank`` (vLLM's global rank),
``tp_group`` and, per slot, ``ubatch`` and ``lane``. ``wsd_rank_info`` adds the
name the engine has at a coordinator (``wsd_engine``) and the coordinator's
endpoint (``coordinator``, empty when standalone). The families, their types and
help are ``wsd.families``'s, as the coordinator exports them. A worker on another
node (a multi-node engine's follower, a headless data-parallel engine) writes
into its own node's directory, which no API server reads: its figures are at
the coordinator only. Imports no torch.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgpack

from wsd.families import FAMILIES, HELP, ViolationTotals
from wsd.slotstats import SLOT_COLUMNS, SLOT_NUMBERS, ManagerStats

__all__ = ["DIRECTORY", "EXPORTED", "PUBLISH_INTERVAL", "Publisher", "WorkerCollector", "labels", "serve_workers",
           "share_directory"]

logger = logging.getLogger(__name__)

DIRECTORY = "WSD_VLLM_METRICS_DIR"
"""The environment variable naming the directory the workers write into."""

PUBLISH_INTERVAL = 1.0
"""Seconds between two looks of a worker at its figures: how old a scrape's may be."""

MAX_FILE_BYTES = 1 << 20
"""Largest file a scrape reads: a worker of 4,096 slots writes about 200 KB."""

MAX_FILES = 4096
"""Most files a scrape reads: more workers than one host runs."""

_VLLM_LABELS = ("model_name", "engine")

EXPORTED = (*(n.metric for n in SLOT_NUMBERS), "wsd_rank_info", "wsd_rank_locked", "wsd_rank_ubatches",
            "wsd_rank_last_step", "wsd_rank_workspace_bytes", "wsd_rank_lock_violations_total",
            "wsd_rank_stats_age_seconds")
"""The families vLLM's ``/metrics`` shows, of ``wsd.families.FAMILIES``: the per-slot and
per-rank ones a worker knows of itself."""

_INFO_EXTRA = ("wsd_engine", "coordinator")
_FILE = re.compile(r"([0-9]{1,10})\.msgpack")


def labels(family: str) -> tuple[str, ...]:
    """A family's labels in vLLM's ``/metrics``: vLLM's own first, then wsd's but ``engine``
    (which there is vLLM's engine index) and ``model_name``; ``wsd_rank_info`` adds
    ``wsd_engine`` and ``coordinator``."""
    own = tuple(name for name in FAMILIES[family][1] if name not in _VLLM_LABELS)
    return (*_VLLM_LABELS, *own, *(_INFO_EXTRA if family == "wsd_rank_info" else ()))


# -- where the figures meet ------------------------------------------------------------


def share_directory(env: Mapping[str, str] = os.environ) -> str:
    """The directory this process's workers write into: ``WSD_VLLM_METRICS_DIR`` where an
    ancestor named it, else a new one (mode 0700, named for this user and this process),
    named for the processes this one starts, and removed as this process exits. Those a
    SIGKILLed process of this user left behind are removed first."""
    named = env.get(DIRECTORY)
    if named:
        return named
    creator = os.getpid()
    prefix = f"wsd-vllm-metrics-{os.getuid()}-"
    _remove_stale(tempfile.gettempdir(), prefix)
    directory = tempfile.mkdtemp(prefix=f"{prefix}{creator}-")
    os.environ[DIRECTORY] = directory

    def remove() -> None:
        if os.getpid() == creator:  # never in a forked child that runs this process's atexit
            shutil.rmtree(directory, ignore_errors=True)

    atexit.register(remove)
    return directory


def _remove_stale(folder: str, prefix: str) -> None:
    """Remove this user's metrics directories (``PREFIX<pid>-...``) whose process is gone: a
    vLLM killed by SIGKILL (or whose atexit never ran) leaves its directory behind."""
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        pid_text = name[len(prefix):].split("-", 1)[0]
        path = os.path.join(folder, name)
        try:
            info = os.lstat(path)
            if not pid_text.isdigit() or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue  # not one of ours: never followed, never removed
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # alive under another user (EPERM), or gone meanwhile
            continue


# -- a worker's side ------------------------------------------------------------------------


class Publisher:
    """Writes one worker's figures into the shared directory, on a thread of its own.

    ``identity`` is what labels them (``model_name``, ``engine``, ``rank``, ``tp_group``,
    ``wsd_engine``, ``coordinator``, and ``wsd_rank_info``'s host, pid, device and placement
    labels); ``step()`` the engine's last step.
    """

    def __init__(self, manager: Any, identity: Mapping[str, Any], *, directory: str,
                 step: Callable[[], int | None], interval: float = PUBLISH_INTERVAL) -> None:
        self.manager = manager
        self.identity = dict(identity)
        self.step = step
        self.interval = interval
        self.path = os.path.join(directory, f"{os.getpid()}.msgpack")
        self._aside = os.path.join(directory, f".{os.getpid()}.writing")
        self._last: bytes | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wsd-vllm-metrics", daemon=True)

    def start(self) -> Publisher:
        self.publish()
        self._thread.start()
        return self

    def publish(self) -> None:
        """Write the figures if they changed since the last write, else mark them current."""
        data = msgpack.packb({**self.identity, "step": self.step(), "stats": self.manager.stats().to_wire()})
        if data == self._last:
            os.utime(self.path)
            return
        with open(self._aside, "wb") as f:
            f.write(data)
        os.replace(self._aside, self.path)
        self._last = data

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.publish()
            except OSError as e:  # the directory went (the API server exited first): nothing to serve
                logger.warning("wsd: rank %s stops writing its figures for vLLM's /metrics: %s",
                               self.identity.get("rank"), e)
                return

    def stop(self) -> None:
        """Stop writing, and take the figures away (the worker is leaving)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        for path in (self.path, self._aside):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


# -- the API server's side ---------------------------------------------------------------------


class _Figures:
    """One worker's file, read and checked."""

    def __init__(self, record: dict[str, Any], age: float) -> None:
        self.record = record
        self.stats = ManagerStats.from_wire(record["stats"])
        self.age = age
        self.head = (str(record["model_name"]), str(record["engine"]))
        self.rank = (str(record["rank"]), str(record["tp_group"]))


_TEXT_FIELDS = ("model_name", "engine", "wsd_engine", "coordinator", "host", "device", "rank_pod",
                "rank_namespace", "rank_node", "UUID")
_INT_FIELDS = ("rank", "tp_group", "pid")


def _check(record: Any) -> dict[str, Any]:
    """A worker's record as ``Publisher`` writes it, or ValueError saying what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"not a map but {type(record).__name__}")
    for name in _TEXT_FIELDS:
        if not isinstance(record.get(name), str):
            raise ValueError(f"{name}: expected text, got {type(record.get(name)).__name__}")
    for name in _INT_FIELDS:
        if type(record.get(name)) is not int:
            raise ValueError(f"{name}: expected an integer, got {type(record.get(name)).__name__}")
    if record.get("step") is not None and type(record["step"]) is not int:
        raise ValueError(f"step: expected an integer or nil, got {type(record['step']).__name__}")
    stats = record.get("stats")
    if not isinstance(stats, dict) or not isinstance(stats.get("slots"), dict):
        raise ValueError("stats: expected a snapshot's map")
    for name in ("num_ubatches", "num_lanes", "total_bytes"):
        if type(stats.get(name)) is not int:
            raise ValueError(f"stats.{name}: expected an integer")
    if type(stats.get("locked")) is not bool:
        raise ValueError("stats.locked: expected true or false")
    slots = stats["slots"]
    lengths = set()
    for name in SLOT_COLUMNS:
        column = slots.get(name)
        if not isinstance(column, list) or any(type(v) not in (int, float) for v in column):
            raise ValueError(f"stats.slots.{name}: expected a list of numbers")
        lengths.add(len(column))
    if len(lengths) > 1:
        raise ValueError("stats.slots: columns of different lengths")
    return record


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class WorkerCollector:
    """A prometheus_client collector of every worker's figures in ``directory`` (``EXPORTED``).

    Read at each scrape; a file that cannot be read or checked is left out, said once at
    WARNING naming it; the file of a process that is gone is removed.
    """

    def __init__(self, directory: str, *, wall: Callable[[], float] = time.time,
                 alive: Callable[[int], bool] = _alive) -> None:
        self.directory = directory
        self._wall = wall
        self._alive = alive
        self._lock = threading.Lock()
        self._violations = ViolationTotals()
        self._said: set[str] = set()

    def describe(self) -> Iterator[Any]:
        """The families without samples: what the registry checks names against."""
        return iter(self._families().values())

    def collect(self) -> Iterator[Any]:
        families = self._families()
        with self._lock:
            for figures in self._read():
                self._add(figures, families)
        return iter(families.values())

    @staticmethod
    def _families() -> dict[str, Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        kinds = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}
        return {name: kinds[FAMILIES[name][0]](name, HELP[name], labels=labels(name)) for name in EXPORTED}

    def _read(self) -> list[_Figures]:
        try:
            entries = [(e, int(m.group(1))) for e in os.scandir(self.directory)
                       if (m := _FILE.fullmatch(e.name))][:MAX_FILES]
        except FileNotFoundError:
            return []
        now = self._wall()
        out = []
        for entry, pid in sorted(entries, key=lambda found: found[1]):
            try:
                if not self._alive(pid):
                    os.unlink(entry.path)
                    continue
                status = entry.stat()
                if status.st_size > MAX_FILE_BYTES:
                    raise ValueError(f"{status.st_size} bytes, more than {MAX_FILE_BYTES}")
                with open(entry.path, "rb") as f:
                    record = _check(msgpack.unpackb(f.read(MAX_FILE_BYTES + 1)))
                out.append(_Figures(record, max(0.0, now - status.st_mtime)))
            except FileNotFoundError:  # the worker left between the listing and the read
                continue
            except (OSError, ValueError, TypeError, KeyError, msgpack.UnpackException) as e:
                said = f"{entry.name}: {type(e).__name__}" + (f": {e}" if str(e) else "")
                if said not in self._said and len(self._said) < MAX_FILES:
                    self._said.add(said)
                    logger.warning("wsd: a worker's figures left out of vLLM's /metrics: %s/%s", self.directory, said)
        return out

    def _add(self, figures: _Figures, families: dict[str, Any]) -> None:
        record, stats = figures.record, figures.stats
        rank = (*figures.head, *figures.rank)
        families["wsd_rank_info"].add_metric(tuple(str(record[name]) for name in labels("wsd_rank_info")), 1)
        families["wsd_rank_locked"].add_metric(rank, int(stats.locked))
        families["wsd_rank_ubatches"].add_metric(rank, stats.num_ubatches)
        if record.get("step") is not None:
            families["wsd_rank_last_step"].add_metric(rank, record["step"])
        families["wsd_rank_workspace_bytes"].add_metric(rank, stats.total_bytes)
        families["wsd_rank_stats_age_seconds"].add_metric(rank, figures.age)
        columns = record["stats"]["slots"]
        families["wsd_rank_lock_violations_total"].add_metric(
            rank, self._violations.total((*figures.head, figures.rank[0]), columns))
        for slot in stats.slots:
            where = (*rank, str(slot.ubatch), str(slot.lane))
            for number in SLOT_NUMBERS:
                families[number.metric].add_metric(where, getattr(slot, number.name))


_served: weakref.WeakSet[Any] = weakref.WeakSet()
_served_lock = threading.Lock()


def serve_workers(registry: Any) -> None:
    """Add the workers' figures to ``registry``, a registry vLLM serves at ``/metrics``
    (once per registry, however often vLLM asks for it)."""
    with _served_lock:
        if registry in _served:
            return
        registry.register(WorkerCollector(share_directory()))
        _served.add(registry)
