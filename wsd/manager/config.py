"""``[workspace]``: the configuration of the per-rank workspace manager. No torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from wsd.fieldchecks import check_range, coerce_enum, size_field
from wsd.slotstats import MAX_LANES, MAX_UBATCHES  # the grid's bounds, on the shared floor

__all__ = ["MAX_LANES", "MAX_UBATCHES", "GrowthPolicy", "LockedGrowthPolicy", "Presize", "WorkspaceConfig"]


class GrowthPolicy(enum.Enum):
    """How a slot's buffer grows when a request does not fit."""

    EXACT = "exact"
    """To exactly the requested total, as vLLM does."""
    GRANULAR = "granular"
    """To the requested total rounded up to ``granularity`` bytes."""


class LockedGrowthPolicy(enum.Enum):
    """What a locked slot does with a request it cannot serve without growing."""

    RAISE = "raise"
    """Refuse it with ``WorkspaceLockedError`` (an ``AssertionError``), as vLLM does."""
    FALLBACK = "fallback"
    """Serve it from a one-off buffer outside the slot, counted and reported as a
    lock violation, so the engine keeps serving. Never during CUDA-graph capture."""


class Presize(enum.Enum):
    """What a manager reserves before its engine's own warm-up."""

    NONE = "none"
    """Nothing: warm-up grows the slots, as vLLM's does."""
    PROFILE = "profile"
    """Each slot at the largest request the coordinator's sizing profile of this rank's
    model (or engine), TP size and grid has seen, if one is known (docs/manager.md)."""


@dataclass(frozen=True, kw_only=True)
class WorkspaceConfig:
    """``[workspace]``: the per-rank workspace manager."""

    num_ubatches: int = 1
    """Micro-batch slots per lane (vLLM's ``num_ubatches``; 1 to MAX_UBATCHES)."""
    num_lanes: int = 1
    """Independent slots per ubatch (1 to MAX_LANES)."""
    alignment: int = 256
    """Byte alignment of every view in a buffer: a power of two, 16 to 1 MiB."""
    growth: GrowthPolicy = GrowthPolicy.EXACT
    """``"exact"`` (vLLM's) or ``"granular"`` (round up to ``granularity``)."""
    granularity: int = size_field(2 * 1024 * 1024)
    """Rounding of ``granular`` growth, in bytes: a multiple of ``alignment``."""
    max_slot_bytes: int | None = size_field(None)
    """Largest buffer one slot may grow to; a larger request is refused. None: no limit."""
    on_locked_growth: LockedGrowthPolicy = LockedGrowthPolicy.RAISE
    """``"raise"`` (vLLM's: the request fails) or ``"fallback"`` (a one-off buffer
    serves it, and the violation is counted and reported)."""
    presize: Presize = Presize.NONE
    """``"none"`` or ``"profile"``: before the engine's warm-up, reserve each slot at the largest
    request its sizing profile has seen (learned by the coordinator from every rank of the same
    model, TP size and grid; none without a coordinator, or before one is learned)."""

    def __post_init__(self) -> None:
        check_range("num_ubatches", self.num_ubatches, 1, MAX_UBATCHES)
        check_range("num_lanes", self.num_lanes, 1, MAX_LANES)
        check_range("alignment", self.alignment, 16, 2**20)
        if self.alignment & (self.alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {self.alignment}")
        coerce_enum(self, "growth", GrowthPolicy)
        check_range("granularity", self.granularity, self.alignment, 2**40)
        if self.granularity % self.alignment:
            raise ValueError(
                f"granularity must be a multiple of alignment ({self.alignment}), "
                f"got {self.granularity}"
            )
        if self.max_slot_bytes is not None:
            check_range("max_slot_bytes", self.max_slot_bytes, 0, 2**50)
        coerce_enum(self, "on_locked_growth", LockedGrowthPolicy)
        coerce_enum(self, "presize", Presize)
