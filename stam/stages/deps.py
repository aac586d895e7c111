"""What the write-path stages need (:class:`Deps`: the services, the frozen :class:`StageParams`, the worker's
own :class:`~stam.stages.changelog.ChangeLog`), and what the update stage returns (:class:`UpdateResult`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum

from schemas import Channel, TransitionEvent
from stam.backends.base import StateStore, VectorStore
from stam.embedding import Embedder
from stam.reasoning.base import Router
from stam.stages.changelog import ChangeLog


def _utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class StageParams:
    """The write path's frozen parameters (set from Settings by the composition root, or by an evaluation)."""

    impact_budget: int = 48
    """Semantic top-B of impact retrieval (the paper's 48)."""
    graph_seeds: int = 3
    """ACTIVE neighbours a model memory's graph hop starts from when it has no relation yet."""
    graph_seed_min: float = 0.5
    """Least cosine for such a neighbour."""
    code_history: int = 16
    """HISTORY memories of the same concept the code channel brings, the last recorded (with every ACTIVE one):
    a lab test done 2,000 times would otherwise bring 2,000 candidates to every new value, and the cost of an entry
    would grow with the record. Older values of the concept remain reachable through the semantic channel."""
    impact_channels: frozenset[Channel] = frozenset(Channel)
    """Channels impact retrieval uses; ``{SEMANTIC}`` is the paper's semantic-only ablation (stam eval)."""
    commit_retries: int = 5
    """Recomputations of a batch whose commit met a newer version, before giving up."""
    lifecycle: bool = True
    """The lifecycle's placements and endings (``stam.lifecycle``); off only for the evaluation's baselines that
    accumulate (append-only) or follow the paper's concept rules alone."""


@dataclass
class Deps:
    """What the stages need, in three parts: the services they call (interfaces: any implementation, a
    projection in front of Milvus included), the frozen parameters, and this worker's own state."""

    # interfaces
    router: Router
    embedder: Embedder
    states: StateStore
    vectors: VectorStore
    clock: Callable[[], datetime] = field(default=_utcnow)
    # frozen parameters
    params: StageParams = field(default_factory=StageParams)
    # worker-local state: never shared between processes, safe to lose
    changes: ChangeLog = field(default_factory=ChangeLog)


class Reads(Enum):
    """What the update stage did with the link and impact work of an entry."""

    CURRENT = "current"
    """Read at the version the entry is applied to."""
    REUSED = "reused"
    """Nothing they read changed since: used as they are."""
    PATCHED = "patched"
    """Looked up again in memory, the semantic search kept with the memories added since merged in."""
    REDONE = "redone"
    """Searched again: whether what they read changed could not be told (and every entry of the one-hop path, which
    links at the update)."""


@dataclass
class UpdateResult:
    """The transitions an entry made (or, when it was applied already, its outbox's) and the version it left."""

    transitions: list[TransitionEvent]
    state_version: int
    duplicate: bool = False
    reads: Reads = Reads.CURRENT
    """What the update did with the entry's link and impact work (:mod:`stam.stages.reads`)."""

    @property
    def redone(self) -> bool:
        """Its link and impact ran again at the update, semantic search included."""
        return self.reads is Reads.REDONE
