"""What the client's read calls return: typed views over the coordinator's answers.

Each is the decoded answer as it came (``doc``), read through typed properties,
and a read-only mapping of it too (``status["ranks"]``), so that code written
when the calls returned plain maps keeps working (but for ``stats``, whose
``ranks`` and ``groups`` are tables now: ``Stats.ranks`` and ``Stats.groups``
give their rows). Nothing is copied or expanded
when one is made: ``Client.stats()`` at 4,096 ranks costs what decoding costs
(its tables become rows only when asked for: ``Stats.ranks``, ``Stats.groups``,
``Stats.rows()``); the lists and maps a property gives are otherwise the
answer's own, to read, not to change. The entries of
``Status.groups``, ``Ranks.ranks`` and the ``missing`` lists are typed views of
the same kind (``GroupStatus``, ``RankEntry``, ``MissingRank``), one small object
per entry, made when the property is read. Commands return
``wsd.commands.CommandResult``. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from wsd.rankrow import RankRow, row_fields
from wsd_client import rows as _rows

__all__ = [
    "Answer",
    "EngineSummary",
    "Engines",
    "Events",
    "GroupStatus",
    "MissingRank",
    "PerEngine",
    "Pong",
    "RankCounts",
    "RankEntry",
    "Ranks",
    "Sequenced",
    "Stats",
    "Status",
    "by_engine",
    "per_engine",
]


class Answer(Mapping[str, Any]):
    """One answer of the coordinator: its document (``doc``), read-only by key or property."""

    __slots__ = ("doc",)

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc

    def __getitem__(self, key: str) -> Any:
        return self.doc[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.doc)

    def __len__(self) -> int:
        return len(self.doc)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.doc!r})"

    @property
    def engine(self) -> str | None:
        """The engine that answered (None: the answer names none, as `ping`'s)."""
        return self.doc.get("engine")


T = TypeVar("T")


class PerEngine(Mapping[str, T], Generic[T]):
    """Several engines' answers to one request that named none, by engine name: a coordinator
    serving several engines answers ``{"engines": {name: answer}}``."""

    __slots__ = ("answers",)

    def __init__(self, answers: dict[str, T]) -> None:
        self.answers = answers

    def __getitem__(self, name: str) -> T:
        return self.answers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.answers)

    def __len__(self) -> int:
        return len(self.answers)

    def __repr__(self) -> str:
        return f"PerEngine({self.answers!r})"


def per_engine(doc: Any, read: Callable[[Any], T]) -> T | PerEngine[T]:
    """One engine's answer read as ``read`` reads it, or several engines' answers as a ``PerEngine``."""
    if isinstance(doc, dict) and len(doc) == 1 and isinstance(doc.get("engines"), dict):
        return PerEngine({name: read(answer) for name, answer in doc["engines"].items()})
    return read(doc)


def by_engine(answer: T | PerEngine[T]) -> dict[str | None, T]:
    """Each engine's answer by engine name, whether one engine answered or several (one
    engine's answer is under its own name, or None where it names none)."""
    if isinstance(answer, PerEngine):
        return {name: one for name, one in answer.answers.items()}
    return {getattr(answer, "engine", None): answer}


class EngineSummary(Answer):
    """One engine of ``engines``: ``{engine, model, live, world_size, tp_size, seq, locked,
    num_ubatches, workspace_bytes, lock_violations, desired}``."""

    __slots__ = ()

    @property
    def name(self) -> str:
        return str(self.doc["engine"])

    @property
    def live(self) -> int:
        return int(self.doc["live"])

    @property
    def world_size(self) -> int | None:
        return self.doc["world_size"]


class Engines(Answer):
    """``engines``: every engine the coordinator serves, and its default engine's name."""

    __slots__ = ()

    @property
    def engines(self) -> list[EngineSummary]:
        return [EngineSummary(e) for e in self.doc["engines"]]

    @property
    def default(self) -> str:
        return str(self.doc["default"])


class Sequenced(Answer):
    """An answer that says which coordinator gave it and where its command sequence stands."""

    __slots__ = ()

    @property
    def epoch(self) -> str:
        """The coordinator's incarnation: a new one after each start."""
        return str(self.doc["epoch"])

    @property
    def seq(self) -> int:
        """The last command the coordinator numbered (0: none yet)."""
        return int(self.doc["seq"])


class Pong(Sequenced):
    """``ping``: who answered and where its command sequence stands."""

    __slots__ = ()

    @property
    def time(self) -> float:
        """The coordinator's wall clock, Unix seconds."""
        return float(self.doc["time"])


@dataclass(frozen=True)
class RankCounts:
    """Expected ranks by state. ``missing``: never registered (the state ``ranks`` shows
    as ``missing``)."""

    live: int
    lost: int
    stopped: int
    missing: int
    stalled: int = 0
    """Live ranks (their agents answer) inside one engine step for longer than ``stall_after``."""

    @classmethod
    def from_wire(cls, counts: dict[str, int]) -> RankCounts:
        return cls(live=counts["live"], lost=counts["lost"], stopped=counts["stopped"], missing=counts["missing"],
                   stalled=counts["stalled"])

    @property
    def absent(self) -> int:
        """Expected ranks not live: lost, stopped or missing."""
        return self.lost + self.stopped + self.missing


class MissingRank(Answer):
    """An expected rank that is not there, and why (``never registered``, ``lost at ...``)."""

    __slots__ = ()

    @property
    def rank(self) -> int:
        return int(self.doc["rank"])

    @property
    def reason(self) -> str:
        return str(self.doc["reason"])


class GroupStatus(Answer):
    """One TP group of ``status``: its members, which are live and which missing, and what
    its live ranks report (a list of the distinct values, one entry when they agree)."""

    __slots__ = ()

    @property
    def tp_group(self) -> int:
        return int(self.doc["tp_group"])

    @property
    def ranks(self) -> list[int]:
        """Every rank the group should have."""
        return self.doc["ranks"]

    @property
    def live(self) -> list[int]:
        return self.doc["live"]

    @property
    def missing(self) -> list[MissingRank]:
        """The group's expected ranks that are not live: lost, stopped or never registered."""
        return [MissingRank(m) for m in self.doc["missing"]]

    @property
    def locked(self) -> list[bool | None]:
        return self.doc["locked"]

    @property
    def num_ubatches(self) -> list[int | None]:
        return self.doc["num_ubatches"]

    @property
    def applied_seq(self) -> list[int]:
        return self.doc["applied_seq"]

    @property
    def consistent(self) -> bool:
        """The live ranks agree with each other."""
        return bool(self.doc["consistent"])

    @property
    def desired(self) -> dict[str, Any]:
        """The group's desired state: ``{locked, num_ubatches, reserve_bytes}``, None where never set."""
        return self.doc["desired"]

    @property
    def drift(self) -> list[str]:
        """How the live ranks differ from the desired state once every command is applied."""
        return self.doc["drift"]


class Status(Sequenced):
    """``status``: the world, the desired state and every TP group at a glance."""

    __slots__ = ()

    @property
    def world_size(self) -> int | None:
        """None: an open world (no ``world_size`` configured)."""
        return self.doc["world_size"]

    @property
    def tp_size(self) -> int | None:
        return self.doc["tp_size"]

    @property
    def desired(self) -> dict[str, Any]:
        """The default desired state: ``{locked, num_ubatches, reserve_bytes}``, None where never set."""
        return self.doc["desired"]

    @property
    def counts(self) -> RankCounts:
        return RankCounts.from_wire(self.doc["ranks"])

    @property
    def groups(self) -> list[GroupStatus]:
        """Per TP group of this page (``offset``, at most the ``limit`` asked for), typed and
        readable as a map (docs/wsctl.md)."""
        return [GroupStatus(g) for g in self.doc["groups"]]

    @property
    def groups_total(self) -> int:
        """The TP groups there are, listed or not."""
        return int(self.doc["groups_total"])


def _row_property(name: str, kind: Any, doc: str) -> property:
    """A typed property reading ``name`` of a row's document: converted to ``kind`` where it is
    a plain type, as it came where it may be null."""
    if kind in (int, float, str, bool):
        def read(self: Answer) -> Any:
            return kind(self.doc[name])
    else:
        def read(self: Answer) -> Any:
            return self.doc[name]
    read.__name__ = name
    return property(read, doc=doc)


def _rank_row_properties(cls: type[Answer]) -> type[Answer]:
    """Give ``cls`` one typed property per field of ``wsd.rankrow.RankRow``: the row is
    declared once, and the class writes none of its properties by hand."""
    for name, kind, doc in row_fields():
        if name in vars(cls):
            raise TypeError(f"{cls.__name__}.{name} is derived from RankRow: not written by hand")
        setattr(cls, name, _row_property(name, kind, doc))
    return cls


if TYPE_CHECKING:
    class _RankEntryBase(Answer, RankRow):  # what the derived properties give, for the type checker
        ...
else:
    _RankEntryBase = Answer


@_rank_row_properties
class RankEntry(_RankEntryBase):
    """One rank of ``ranks`` that registered: a property per field of ``wsd.rankrow.RankRow``
    (``rank``, ``state``, ``tp_group``, ...; the table in docs/wsctl.md)."""

    __slots__ = ()


class Ranks(Answer):
    """``ranks``: every rank known, and the expected ones that never registered."""

    __slots__ = ()

    @property
    def ranks(self) -> list[RankEntry]:
        """Per rank that registered, typed and readable as a map (``wsd.rankrow.RankRow``)."""
        return [RankEntry(r) for r in self.doc["ranks"]]

    @property
    def missing(self) -> list[MissingRank]:
        """Per expected rank that never registered (state ``missing``)."""
        return [MissingRank(m) for m in self.doc["missing"]]


class Stats(Answer):
    """``stats``: per rank, slot and TP group, as the coordinator sends it (every part a table
    of columns, see ``wsd_client.rows``); ``rows()`` gives the one row shape ``wsctl stats
    --json`` prints."""

    __slots__ = ()

    @property
    def complete(self) -> bool:
        """Every expected rank reported, and none is stale."""
        return bool(self.doc["complete"])

    @property
    def fresh(self) -> bool:
        """Every rank was asked now (``fresh=True``) rather than read from its last push."""
        return bool(self.doc["fresh"])

    @property
    def total_bytes(self) -> int:
        return int(self.doc["total_bytes"])

    @property
    def missing(self) -> list[MissingRank]:
        """Per expected rank absent from the answer: lost, stopped, never registered, or live
        with no usable snapshot (its ``reason`` says which)."""
        return [MissingRank(m) for m in self.doc["missing"]]

    @property
    def stale(self) -> list[int]:
        """Ranks whose snapshot is older than ``[coordinator] stats_stale_after``."""
        return self.doc["stale"]

    @property
    def as_of(self) -> float:
        """When the coordinator sent it, Unix seconds on its clock."""
        return float(self.doc["as_of"])

    @property
    def reporting(self) -> list[int]:
        """The ranks in the answer, in its order (the ``ranks`` table's ``rank`` column)."""
        return self.doc["ranks"]["rank"]

    @property
    def ranks(self) -> list[dict[str, Any]]:
        """Per reporting rank, its figures without its slots (``rank_columns``, ``rows()``), and
        ``confirmed_at``: when its snapshot was last known current (``ages()``). Built from the
        answer's ``ranks`` table on each read."""
        return _rows.table_rows(self.doc["ranks"])

    def ages(self) -> dict[int, float]:
        """Each rank's age, seconds: ``as_of`` less its ``confirmed_at`` (0 for ``fresh``)."""
        return _rows.ages(self.doc)

    @property
    def groups(self) -> list[dict[str, Any]]:
        """Per TP group, its totals and skew without its per-slot summary (``group_columns``).
        Built from the answer's ``groups`` table on each read."""
        return _rows.table_rows(self.doc["groups"])

    def rows(self) -> dict[str, Any]:
        """The answer with each rank's and group's slots as rows under it, and each rank's
        ``age`` and ``stale``: exactly the document ``wsctl stats --json`` prints (built on
        each call)."""
        return _rows.stats_rows(self.doc)

    def rank_columns(self) -> dict[int, dict[str, Any]]:
        """Each rank's slots as columns, by rank (``wsd_client.rows.rank_columns``)."""
        return _rows.rank_columns(self.doc)

    def rank_slots(self, rank: int) -> list[dict[str, Any]]:
        """One rank's slots as rows."""
        return _rows.rank_slots(self.doc, rank)

    def group_columns(self) -> dict[int, dict[str, list[Any]]]:
        """Each TP group's per-slot summary as columns, by group."""
        return _rows.group_columns(self.doc)

    def group_slots(self, tp_group: int) -> list[dict[str, Any]]:
        """One TP group's per-slot summary as rows, each with the ranks that have the slot."""
        return _rows.group_slots(self.doc, tp_group)


class Events(Answer):
    """``events``: a page of the event log and the cursor to ask with next."""

    @property
    def events(self) -> list[dict[str, Any]]:
        """``{id, time, kind, ...}`` per event, oldest first."""
        return self.doc["events"]

    @property
    def cursor(self) -> int:
        """The id of the last event given (or the newest one, at the tail)."""
        return int(self.doc["cursor"])

    @property
    def epoch(self) -> str | None:
        """The coordinator's incarnation: a new one means ids began again."""
        return self.doc.get("epoch")
