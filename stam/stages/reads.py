"""What link and impact read, and whether it still holds when the update stage applies their entry.

With the four stages over topics a patient's entries pipeline: link and impact of an entry run at the state
version they read (``state_version``), and by the time the entry reaches the update stage the entries ahead of it
may have been applied. Whether their work went stale is decided by what it read, not by any change to the patient:

- **reused**: nothing it read changed. No memory it read (a candidate, a semantic hit, a relation's end) moved or
  gained a relation, and no memory added since shares a concept or a source resource it looked up. A memory added
  since that would join a semantic top-B only as a candidate the reasoner cannot act on (the coded reasoner acts on
  no candidate found by meaning alone; the model reasoner shows none under its ``min_score``) and pushes nothing
  out leaves it current too. Its relations and candidates are used as they are.
- **patched**: something it read changed, but its semantic search still holds once the memories added since are
  merged into it. The links and the code and graph channels are looked up again on the working state (in memory);
  the search is not run again.
- **redone**: the search runs again: no record of what was read (an older producer), a version this worker did not
  apply (another writer, a restart, a deletion: the change log does not cover it), a semantic hit gone since, or
  no vectors for the memories added since.

A patched entry's relations and candidates are what a redo gives; a reused one's differ from them at most by
candidates nobody reads. Either way the update decides as it would at the state it applies the entry to
(``tests/integration/test_stages_real_stores.py``: bursts pipelined against earlier states reach the state of
sequential processing). The change log is the update worker's own: never shared between processes, safe to lose.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from schemas import ImpactedEntry, RecordEntry, Relation, SemanticRead
from stam.backends.base import Hit
from stam.embedding import memory_vectors
from stam.patient_state import PatientState
from stam.reasoning.base import Impact
from stam.stages.changelog import VersionChange
from stam.stages.deps import Deps, Reads
from stam.stages.impact import impact_candidates
from stam.stages.link import link_relations


def reads_for_update(x: ImpactedEntry, state: PatientState, changes: list[VersionChange] | None,
                     deps: Deps) -> tuple[Sequence[Relation], dict[str, list[Impact]], Reads]:
    """The relations and candidates the update stage decides ``x`` on, at ``state`` (its working copy), and how
    they were had. ``changes``: what changed since ``x.state_version`` (:meth:`stam.stages.changelog.ChangeLog.since`)."""
    if not x.deferred and state.version == x.state_version:
        return x.relations, _recorded(x), Reads.CURRENT
    if x.deferred or x.semantic is None or changes is None or any(m.memory_id not in x.semantic for m in x.memories):
        return _redo(x, state, deps)
    read = _what_was_read(x)
    if any(mid not in state.memories for mid in read.semantic_ids):
        return _redo(x, state, deps)  # a hit gone (a deletion): the next best is not on record
    if any(mid not in state.memories for c in changes for mid in c.added):
        return _redo(x, state, deps)  # the log is not this state's history (the patient was erased and written again)
    new_ids = {m.memory_id for m in x.memories}
    newcomers = [mid for c in changes for mid in c.added if mid not in new_ids and mid not in read.ids]
    merged = _merged(x, newcomers, state, deps)
    if merged is None:
        return _redo(x, state, deps)
    hits, counts = merged
    touched = any(mid in read.ids or _keyed(state, mid, read) for c in changes for mid in c.memories | c.related)
    if not touched and not counts:
        return x.relations, _recorded(x), Reads.REUSED
    relations = link_relations(x.entry, x.memories, state, deps)
    return relations, impact_candidates(x.memories, relations, state, deps, x.entry, semantic=hits), Reads.PATCHED


def _recorded(x: ImpactedEntry) -> dict[str, list[Impact]]:
    return {k: [Impact.from_wire(c) for c in v] for k, v in x.candidates.items()}


def _redo(x: ImpactedEntry, state: PatientState,
          deps: Deps) -> tuple[Sequence[Relation], dict[str, list[Impact]], Reads]:
    relations = link_relations(x.entry, x.memories, state, deps)
    return relations, impact_candidates(x.memories, relations, state, deps, x.entry), Reads.REDONE


@dataclass(frozen=True)
class _Read:
    ids: frozenset[str]
    """Every prior memory read: candidates, semantic hits, the ends of the relations linked."""
    semantic_ids: frozenset[str]
    concepts: frozenset[str]
    """Concept keys looked up (the new memories', and references by concept)."""
    sources: frozenset[str]
    """Source resources looked up (the new memories', and the entry's references)."""


def _what_was_read(x: ImpactedEntry) -> _Read:
    semantic = {mid for s in (x.semantic or {}).values() for mid in s.memory_ids}
    ids = semantic | {c.memory_id for v in x.candidates.values() for c in v}
    ids |= {end for r in x.relations for end in (r.source_id, r.target_id)}
    concepts = {m.concept_key for m in x.memories if m.concept_key}
    sources = {m.source_ref for m in x.memories if m.source_ref}
    entry: RecordEntry = x.entry
    for ref in entry.references:
        if ref.target.startswith("concept:"):
            concepts.add(ref.target.removeprefix("concept:"))
        else:
            sources.add(ref.target)
    return _Read(frozenset(ids), frozenset(semantic), frozenset(concepts), frozenset(sources))


def _keyed(state: PatientState, memory_id: str, read: _Read) -> bool:
    """Whether a changed memory is one a lookup by concept or by source resource finds."""
    stored = state.get(memory_id)
    if stored is None:
        return False
    m = stored.memory
    return (m.concept_key is not None and m.concept_key in read.concepts) or (
        m.source_ref is not None and m.source_ref in read.sources)


def _merged(x: ImpactedEntry, newcomers: list[str], state: PatientState,
            deps: Deps) -> tuple[list[list[Hit]], bool] | None:
    """Each new memory's semantic top-B at ``state``: its recorded hits with the memories added since merged in
    by cosine (after the recorded ones on a tie, as a search lists older rows first); and whether any of those
    counts. None when the vectors of the added memories are not at hand.

    A memory added since counts when it pushes a recorded hit out of a full top-B, when it is close enough to be a
    graph seed of a memory the model links at its update, or when it is over what the reasoner of the new memory
    can act on in a candidate found by meaning alone (:meth:`stam.reasoning.base.Router.semantic_floor`). One that
    does not count would only add a candidate nobody reads."""
    assert x.semantic is not None
    limit = deps.params.impact_budget
    scores = None
    if newcomers:
        vectors = memory_vectors(x.memories, deps.embedder)
        scores = deps.vectors.similarities(state.patient_id, state.version, vectors, newcomers)
        if scores is None:
            return None
    out: list[list[Hit]] = []
    counts = False
    for i, m in enumerate(x.memories):
        read: SemanticRead = x.semantic[m.memory_id]
        hits = [Hit(mid, state.memories[mid].store, s) for mid, s in zip(read.memory_ids, read.scores, strict=True)]
        if scores is not None:
            full = len(hits) >= limit
            floor = hits[-1].score if full else float("-inf")
            extra = [Hit(mid, state.memories[mid].store, float(s))
                     for mid, s in zip(newcomers, scores[i], strict=True) if s > floor]
            if extra:
                acts = deps.router.semantic_floor(m)
                if deps.router.links_at_update(m):
                    acts = min(acts, deps.params.graph_seed_min)
                counts = counts or full or any(h.score >= acts for h in extra)
                hits = sorted(hits + extra, key=lambda h: -h.score)[:limit]  # stable: the recorded first on a tie
        out.append(hits)
    return out, counts
