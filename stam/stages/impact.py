"""The impact stage: the prior memories (both stores) whose validity an entry's new memories may affect, found by
meaning, by code, by the resources the entry ends, and one hop in the graph."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any, cast

import numpy as np

from schemas import (
    ENDING_ROLES,
    AtomicMemory,
    Channel,
    ExtractedEntry,
    ImpactedEntry,
    LinkedEntry,
    RecordEntry,
    Relation,
    RelationType,
    SemanticRead,
    Store,
)
from stam.backends.base import Hit
from stam.embedding import memory_vectors
from stam.patient_state import PatientState
from stam.reasoning.base import Impact
from stam.stages.deps import Deps
from stam.stages.link import link_relations


def _semantic(memories: Sequence[AtomicMemory], vectors: np.ndarray, state: PatientState,
              deps: Deps) -> list[list[Hit]]:
    return deps.vectors.nearest(state.patient_id, state.version, vectors, deps.params.impact_budget,
                                exclude={m.memory_id for m in memories})


@lru_cache(maxsize=16)
def _channels(chans: frozenset[Channel]) -> tuple[Channel, ...]:
    return tuple(sorted(chans))  # sorting enums is slow; there are only 7 combinations


EXPLICIT_ROLES = ENDING_ROLES
"""Reference roles that name a source resource the entry ends; its memories are always impact candidates."""


def semantic_hits(memories: Sequence[AtomicMemory], state: PatientState, deps: Deps) -> list[list[Hit]]:
    """The semantic channel: per new memory, its top-B prior memories of both stores by cosine."""
    return _semantic(memories, memory_vectors(memories, deps.embedder), state, deps)


def impact_candidates(memories: Sequence[AtomicMemory], relations: Sequence[Relation], state: PatientState,
                      deps: Deps, entry: RecordEntry | None = None,
                      semantic: Sequence[Sequence[Hit]] | None = None) -> dict[str, list[Impact]]:
    """Semantic top-B over ACTIVE+HISTORY, exact-concept matches, resources the entry explicitly replaces or
    discontinues, and one graph hop, per new memory. ``semantic``: the semantic channel's hits when they are known
    already (:func:`semantic_hits`, or merged by the update stage), instead of searching."""
    channels = deps.params.impact_channels
    explicit = ([r.target for r in (entry.references if entry else ()) if r.role in EXPLICIT_ROLES]
                if Channel.CODE in channels else [])
    if semantic is None:
        semantic = semantic_hits(memories, state, deps)
    known = state.memories
    new_ids = {m.memory_id for m in memories}
    out: dict[str, list[Impact]] = {}
    for m, hits in zip(memories, semantic, strict=True):
        # memory id -> [channels, best score, strongest graph relation (weight, type)]
        found: dict[str, list[Any]] = {}

        def note(mid: str, channel: Channel, score: float, rel: tuple[float, RelationType] | None = None,
                 found: dict[str, list[Any]] = found) -> None:
            if mid in new_ids or mid not in known:
                return
            slot = found.get(mid)
            if slot is None:
                found[mid] = [{channel}, score, rel]
                return
            slot[0].add(channel)
            slot[1] = max(slot[1], score)
            if rel is not None and (slot[2] is None or rel[0] > slot[2][0]):
                slot[2] = rel

        for h in hits if Channel.SEMANTIC in channels else ():
            note(h.memory_id, Channel.SEMANTIC, h.score)
        if m.concept_key and Channel.CODE in channels:
            for s in state.recent_by_concept(m.concept_key, deps.params.code_history):
                note(s.memory.memory_id, Channel.CODE, 1.0)
        for ref in ([m.source_ref] if m.source_ref and Channel.CODE in channels else []) + explicit:
            for s in state.by_source(ref):
                note(s.memory.memory_id, Channel.CODE, 1.0)
        # Graph channel: the memories this entry links ``m`` to, and one hop from each of them in the
        # stored graph; a neighbour is scored by its strongest relation on that path.
        seeds: list[tuple[str, float, RelationType | None]] = [
            (r.target_id if r.source_id == m.memory_id else r.source_id, r.weight, r.type)
                 for r in relations if m.memory_id in (r.source_id, r.target_id)]
        if not seeds and deps.router.links_at_update(m):
            # Relations of a model memory are decided with its update (one call), so the hop starts from
            # its closest ACTIVE neighbours in meaning, the memories it would most likely be linked to.
            seeds = [(h.memory_id, h.score, cast(RelationType | None, None)) for h in hits
                     if h.score >= deps.params.graph_seed_min and h.memory_id in known
                     and known[h.memory_id].store is Store.ACTIVE][: deps.params.graph_seeds]
        for linked, weight, rtype0 in seeds if Channel.GRAPH in channels else ():
            if rtype0 is not None:
                note(linked, Channel.GRAPH, weight, (weight, rtype0))
            for nb, rtype, w in state.neighbours(linked):
                score = min(weight, w)
                note(nb, Channel.GRAPH, score, (score, rtype))
        ranked = sorted(found.items(), key=lambda kv: -kv[1][1])
        out[m.memory_id] = [
            Impact(mid, known[mid].store, _channels(frozenset(chans)), round(score, 6), rel[1] if rel else None)
            for mid, (chans, score, rel) in ranked
        ]
    return out


def impact_batch(items: Sequence[LinkedEntry], deps: Deps) -> list[ImpactedEntry]:
    """:func:`impact_stage` for each item; the batch's new texts are embedded in one model call and
    every patient's state version is read in one round trip."""
    memory_vectors([m for x in items for m in x.memories], deps.embedder)
    with deps.states.pinned_versions({x.entry.patient_id for x in items}):
        return [impact_stage(x, deps) for x in items]


def impact_stage(x: LinkedEntry, deps: Deps) -> ImpactedEntry:
    """Prior memories (both stores) whose validity the new memories may affect, and what the semantic channel read
    (the update stage checks it: :mod:`stam.stages.reads`)."""
    if x.deferred:
        return ImpactedEntry(entry=x.entry, memories=x.memories, relations=(), candidates={},
                             state_version=x.state_version, deferred=True)
    state = deps.states.load(x.entry.patient_id)
    relations: Sequence[Relation] = x.relations
    if state.version != x.state_version:
        relations = link_relations(x.entry, x.memories, state, deps)
    hits = semantic_hits(x.memories, state, deps)
    candidates = impact_candidates(x.memories, relations, state, deps, x.entry, semantic=hits)
    return ImpactedEntry(
        entry=x.entry, memories=x.memories, relations=tuple(relations),
        candidates={k: tuple(c.to_wire() for c in v) for k, v in candidates.items()}, state_version=state.version,
        semantic={m.memory_id: SemanticRead.model_construct(memory_ids=tuple(h.memory_id for h in hs),
                                                           scores=tuple(float(h.score) for h in hs))
                  for m, hs in zip(x.memories, hits, strict=True)})


def deferred_to_update(items: Sequence[ExtractedEntry]) -> list[ImpactedEntry]:
    """Extracted entries handed straight to :func:`update_batch` (the one-hop write path, ``stam worker --stages
    fused``): their linking and impact retrieval are done there, each on the working copy of its patient's state
    with every earlier entry of the batch applied, the way the update stage redoes an entry whose link and impact
    went stale. The version is not read (a deferred entry's is never compared)."""
    return [ImpactedEntry(entry=x.entry, memories=x.memories, relations=(), candidates={}, state_version=0,
                          deferred=True) for x in items]
