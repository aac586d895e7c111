"""The memory state of one patient: ACTIVE and HISTORY memories and the typed relation graph.

The graph is an igraph ``Graph`` whose vertices are memories (named by memory id) and whose edges carry
the relation type and weight. Undirected relation types are stored once with ``directed=False``; igraph
holds everything in one directed graph and neighbour queries look both ways.

Invariants kept here:
- a relation is never added to a memory in HISTORY (relations that existed survive the transition);
- a memory moves ACTIVE -> HISTORY only through :meth:`archive`, which records reason and successor.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import igraph as ig
import orjson

from schemas import AtomicMemory, Reason, Relation, RelationType, Store, StoredMemory


@dataclass
class PatientState:
    patient_id: str
    version: int = 0
    memories: dict[str, StoredMemory] = field(default_factory=dict)
    graph: ig.Graph = field(default_factory=lambda: ig.Graph(directed=True))
    _by_concept: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    _by_source: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    # --- reads -------------------------------------------------------------------------------------

    def get(self, memory_id: str) -> StoredMemory | None:
        return self.memories.get(memory_id)

    def in_store(self, store: Store) -> Iterator[StoredMemory]:
        return (m for m in self.memories.values() if m.store is store)

    def by_concept(self, concept_key: str) -> list[StoredMemory]:
        return [self.memories[i] for i in self._by_concept.get(concept_key, ())]

    def by_source(self, source_ref: str) -> list[StoredMemory]:
        return [self.memories[i] for i in self._by_source.get(source_ref, ())]

    def neighbours(self, memory_id: str) -> list[tuple[str, RelationType, float]]:
        """One hop, both directions: (neighbour id, relation type, weight)."""
        try:
            v = self.graph.vs.find(name=memory_id)
        except ValueError:
            return []
        out: list[tuple[str, RelationType, float]] = []
        names = self.graph.vs["name"]
        for e in self.graph.es[self.graph.incident(v.index, mode="all")]:
            other = e.target if e.source == v.index else e.source
            out.append((names[other], RelationType(e["type"]), float(e["weight"])))
        return out

    def relations(self) -> list[Relation]:
        names = self.graph.vs["name"] if self.graph.vcount() else []
        return [
            Relation(
                source_id=names[e.source],
                target_id=names[e.target],
                type=RelationType(e["type"]),
                weight=float(e["weight"]),
            )
            for e in self.graph.es
        ]

    def counts(self) -> dict[str, int]:
        active = sum(1 for m in self.memories.values() if m.store is Store.ACTIVE)
        return {
            "active": active,
            "history": len(self.memories) - active,
            "relations": self.graph.ecount(),
        }

    # --- writes ------------------------------------------------------------------------------------

    def add(self, memory: AtomicMemory, store: Store, *, reason: Reason | None = None,
            successor_id: str | None = None, evidence_id: str | None = None,
            entry_id: str | None = None, at: datetime | None = None) -> StoredMemory:
        stored = StoredMemory(
            memory=memory, store=store, reason=reason, successor_id=successor_id,
            evidence_id=evidence_id,
            archived_by_entry=entry_id if store is Store.HISTORY else None,
            archived_at=at if store is Store.HISTORY else None,
        )
        self._index(stored)
        self.graph.add_vertex(name=memory.memory_id)
        return stored

    def archive(self, memory_id: str, *, reason: Reason, successor_id: str | None,
                evidence_id: str | None, entry_id: str, at: datetime) -> StoredMemory:
        current = self.memories[memory_id]
        if current.store is not Store.ACTIVE:
            raise ValueError(f"memory {memory_id} is not ACTIVE")
        moved = current.model_copy(update={
            "store": Store.HISTORY, "reason": reason, "successor_id": successor_id,
            "evidence_id": evidence_id, "archived_by_entry": entry_id, "archived_at": at,
        })
        self.memories[memory_id] = moved
        return moved

    def delete(self, memory_id: str, *, any_store: bool = False) -> list[StoredMemory]:
        """Forget a HISTORY memory (the deletion gate): the memory, its graph vertex and its relations go. A
        memory whose successor it was now has its successor, so a chain stays whole. Returns those re-pointed
        memories (changed, to store). ``any_store``: a point-in-time replay forgets a deleted memory even where
        it was still ACTIVE at that time."""
        gone = self.memories.get(memory_id)
        if gone is None or (gone.store is not Store.HISTORY and not any_store):
            raise ValueError(f"memory {memory_id} is not in HISTORY")
        del self.memories[memory_id]
        mem = gone.memory
        for index, key in ((self._by_concept, mem.concept_key), (self._by_source, mem.source_ref)):
            if key and memory_id in index.get(key, ()):
                index[key].remove(memory_id)
                if not index[key]:
                    del index[key]
        with suppress(ValueError):  # a memory without a vertex has no relations
            self.graph.delete_vertices(self.graph.vs.find(name=memory_id).index)
        relinked = [s.model_copy(update={"successor_id": gone.successor_id})
                    for s in self.memories.values() if s.successor_id == memory_id]
        for s in relinked:
            self.memories[s.memory.memory_id] = s
        return relinked

    def relate(self, relation: Relation) -> bool:
        """Add a relation unless it exists or touches a HISTORY memory. Returns whether it was added."""
        for end in (relation.source_id, relation.target_id):
            stored = self.memories.get(end)
            if stored is None or stored.store is Store.HISTORY:
                return False
        src = self.graph.vs.find(name=relation.source_id).index
        dst = self.graph.vs.find(name=relation.target_id).index
        for e in self.graph.es[self.graph.incident(src, mode="all")]:
            if e["type"] == relation.type.value and {e.source, e.target} == {src, dst}:
                return False
        self.graph.add_edge(src, dst, type=relation.type.value, weight=relation.weight)
        return True

    def restore_relation(self, relation: Relation) -> None:
        """Put back a relation recorded in the transition log (it was valid when it was made)."""
        src = self.graph.vs.find(name=relation.source_id).index
        dst = self.graph.vs.find(name=relation.target_id).index
        self.graph.add_edge(src, dst, type=relation.type.value, weight=relation.weight)

    def _index(self, stored: StoredMemory) -> None:
        mem = stored.memory
        self.memories[mem.memory_id] = stored
        if mem.concept_key:
            self._by_concept[mem.concept_key].append(mem.memory_id)
        if mem.source_ref:
            self._by_source[mem.source_ref].append(mem.memory_id)

    def copy(self) -> PatientState:
        """An independent copy to change and commit; the original (a cached snapshot) stays untouched."""
        return PatientState(
            patient_id=self.patient_id, version=self.version, memories=dict(self.memories),
            graph=self.graph.copy(),
            _by_concept=defaultdict(list, {k: list(v) for k, v in self._by_concept.items()}),
            _by_source=defaultdict(list, {k: list(v) for k, v in self._by_source.items()}),
        )

    # --- snapshot ----------------------------------------------------------------------------------

    def graph_snapshot(self) -> bytes:
        """Compact JSON of the igraph graph: vertex names and (source, target, type, weight) edges."""
        g = self.graph
        return orjson.dumps({
            "version": self.version,
            "vertices": g.vs["name"] if g.vcount() else [],
            # Bulk attribute reads: iterating g.es builds one Python Edge object per edge (slow on large graphs).
            "edges": [[s, t, ty, w] for (s, t), ty, w in zip(g.get_edgelist(), g.es["type"], g.es["weight"],
                                                              strict=True)] if g.ecount() else [],
        })

    @classmethod
    def restore(cls, patient_id: str, version: int, graph_blob: bytes | None,
                memories: Iterable[bytes]) -> PatientState:
        state = cls(patient_id=patient_id, version=version)
        for raw in memories:
            state._index(StoredMemory.model_validate_json(raw))
        if graph_blob:
            snap: dict[str, Any] = orjson.loads(graph_blob)
            g = ig.Graph(directed=True)
            g.add_vertices(len(snap["vertices"]), attributes={"name": snap["vertices"]})
            edges = snap["edges"]
            g.add_edges([(s, t) for s, t, _, _ in edges],
                        attributes={"type": [e[2] for e in edges], "weight": [e[3] for e in edges]})
            state.graph = g
        else:
            state.graph.add_vertices(list(state.memories))
        return state
