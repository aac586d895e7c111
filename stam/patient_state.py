"""The memory state of one patient: ACTIVE and HISTORY memories and the typed relation graph.

The graph's vertices are memories (named by memory id) and its edges carry the relation type and weight;
undirected relation types are stored once, and neighbour queries look both ways. It is kept as adjacency
lists so that adding a memory or a relation costs the same on a patient with ten memories as on one with
twenty thousand (an igraph ``Graph`` re-indexes itself on every added vertex or edge: milliseconds at 20k).
:attr:`PatientState.graph` gives it as an igraph ``Graph`` (built on demand), and the stored form is the
igraph snapshot (:meth:`graph_snapshot`) plus a log of the changes made since (:attr:`graph_ops`), which the
state store appends per commit and folds into a new snapshot when the log outgrows it.

Invariants kept here:
- a relation is never added to a memory in HISTORY (relations that existed survive the transition);
- a memory moves ACTIVE -> HISTORY only through :meth:`archive`, which records reason and successor, and back only
  through :meth:`reinstate` (what ended it was cancelled).

The lifecycle's indexes (:mod:`stam.lifecycle` decides with them) are derived from the memory records alone, so a
state restored from its stored form has them too: the patient's clinical clock (:attr:`PatientState.clock`), each
encounter's ACTIVE facts that end with it, its end when its own record says it ended, and the ACTIVE facts with an
end time of their own.

A working copy (:meth:`copy`) shares the graph and the indexes with its original (persistent maps: a change
makes a new version and leaves the old one whole), so a copy of a large patient's state for one entry costs one
dictionary copy (the memory records), not a rebuild.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any

import igraph as ig
import immutables
import orjson

from schemas import AtomicMemory, Category, Reason, Relation, RelationType, Store, StoredMemory
from schemas.vocabulary import LIFECYCLE_BY_CATEGORY, Lifecycle

Edge = tuple[str, str, str, float]
"""(source memory id, target memory id, relation type value, weight)."""

NEVER = float("-inf")


def lifecycle_of(memory: AtomicMemory) -> Lifecycle:
    """How the fact stops being current: the memory's own lifecycle, else the default of its category."""
    return memory.lifecycle or LIFECYCLE_BY_CATEGORY[memory.category]


def is_encounter_record(memory: AtomicMemory) -> bool:
    """The memory is a record of its encounter itself (an admission, a visit), not a fact recorded during it."""
    return memory.category is Category.ENCOUNTER and memory.encounter_id is not None \
        and memory.source_ref == memory.encounter_id


def _ts(t: datetime | None) -> float:
    return t.timestamp() if t is not None else NEVER


def placed(stored: StoredMemory) -> bool:
    """Added straight to HISTORY by its own entry (it arrived already ended: a stop, an event, a discharge), as
    opposed to archived later by other evidence or by the lifecycle (``ended_at``)."""
    return (stored.store is Store.HISTORY and stored.evidence_id is None and stored.ended_at is None
            and stored.archived_by_entry == stored.memory.entry_id)


def evidence_ts(stored: StoredMemory) -> float:
    """The clinical time a memory is evidence at (seconds; see ``stam.read.asof.evidence_time``): an ended fact's end,
    a current fact's start."""
    m = stored.memory
    first, second = (m.effective_end, m.effective_start) if placed(stored) else (m.effective_start, m.effective_end)
    return _ts(first if first is not None else second)


class _Lists:
    """key -> tuple of values, persistent: a copy shares everything with its original and costs nothing, and a
    change rebuilds only the path to its key (``immutables.Map``, a hash array mapped trie), so a working copy of a
    patient with twenty thousand memories is as cheap to make (and to drop) as one with ten."""

    __slots__ = ("_m",)

    def __init__(self, m: immutables.Map[str, tuple[Any, ...]] | None = None) -> None:
        self._m: immutables.Map[str, tuple[Any, ...]] = m if m is not None else immutables.Map()

    def get(self, key: str) -> tuple[Any, ...]:
        return self._m.get(key, ())

    def add(self, key: str, value: Any) -> None:
        self._m = self._m.set(key, self._m.get(key, ()) + (value,))

    def remove(self, key: str, value: Any) -> None:
        found = self._m.get(key)
        if found is None or value not in found:
            return
        rest = tuple(v for v in found if v != value)
        self._m = self._m.set(key, rest) if rest else self._m.delete(key)

    def pop(self, key: str) -> tuple[Any, ...]:
        found = self._m.get(key, ())
        if found:
            self._m = self._m.delete(key)
        return found

    def copy(self) -> _Lists:
        return _Lists(self._m)


class PatientState:
    def __init__(self, patient_id: str, version: int = 0) -> None:
        self.patient_id = patient_id
        self.version = version
        self.memories: dict[str, StoredMemory] = {}
        self._vertices: immutables.Map[str, int] = immutables.Map()
        """Vertex name -> insertion rank (the order of an igraph graph's vertex ids)."""
        self._rank = 0
        self._edges: immutables.Map[int, Edge] = immutables.Map()
        """Edge number (insertion order: the order of an igraph graph's edge ids) -> edge."""
        self._next_edge = 0
        self._adj = _Lists()
        """Vertex name -> numbers of its edges, both directions."""
        self._by_concept = _Lists()
        self._active_concept = _Lists()
        """Concept key -> its ACTIVE memories (usually one: the current value)."""
        self._by_source = _Lists()
        # --- the lifecycle's indexes (see the module's notes) ---
        self.clock = NEVER
        """The patient's clinical clock (seconds since the epoch): the latest clinical time any memory is evidence
        at. It only moves forward; an interval or an encounter whose end it has passed is over."""
        self._scoped = _Lists()
        """Encounter id -> its ACTIVE memories whose lifecycle ends with the encounter (its own records included)."""
        self._enc_records = _Lists()
        """Encounter id -> its own ACTIVE records (an encounter with one is open)."""
        self._enc_end: immutables.Map[str, tuple[float, str]] = immutables.Map()
        """Encounter id -> (end, memory id) of the latest end its own records placed in HISTORY said."""
        self._enc_ended = _Lists()
        """Encounter id -> the memories the lifecycle archived when it ended (a cancelled discharge reinstates them)."""
        self._expiring: immutables.Map[str, float] = immutables.Map()
        """ACTIVE memory id -> its end, for facts whose lifecycle expires and that have an end time."""
        self._igraph: ig.Graph | None = None
        self.graph_ops: list[list[Any]] = []
        """Graph changes not yet persisted: ``["v", id]`` add a vertex, ``["e", source, target, type, weight]``
        add an edge, ``["x", id]`` remove a vertex and its edges."""
        self.graph_log = 0
        """Changes persisted after the stored snapshot (the state store's log length)."""
        self.graph_base = 0
        """Vertices plus edges of the stored snapshot (0: none stored)."""

    # --- reads -------------------------------------------------------------------------------------

    def get(self, memory_id: str) -> StoredMemory | None:
        return self.memories.get(memory_id)

    def in_store(self, store: Store) -> Iterator[StoredMemory]:
        return (m for m in self.memories.values() if m.store is store)

    def by_concept(self, concept_key: str) -> list[StoredMemory]:
        return [self.memories[i] for i in self._by_concept.get(concept_key)]

    def active_by_concept(self, concept_key: str) -> list[StoredMemory]:
        """The concept's ACTIVE memories, without looking at its history (a lab test done 2,000 times has one)."""
        return [self.memories[i] for i in self._active_concept.get(concept_key)]

    def recent_by_concept(self, concept_key: str, history: int) -> list[StoredMemory]:
        """The concept's ACTIVE memories and its ``history`` HISTORY memories recorded last: a bounded look at a
        concept however long its history is."""
        out = self.active_by_concept(concept_key)
        ids = self._by_concept.get(concept_key)
        if len(ids) <= len(out) + history:
            return self.by_concept(concept_key)
        taken = 0
        for i in reversed(ids):
            if taken == history:
                break
            s = self.memories[i]
            if s.store is not Store.ACTIVE:
                out.append(s)
                taken += 1
        return out

    def by_source(self, source_ref: str) -> list[StoredMemory]:
        return [self.memories[i] for i in self._by_source.get(source_ref)]

    def encounter_end(self, encounter_id: str) -> tuple[float, str] | None:
        """(end, memory id of the record that said so) of an encounter that ended; None while it is open (an
        ACTIVE record of its own) or while nothing recorded its end."""
        if self._enc_records.get(encounter_id):
            return None
        return self._enc_end.get(encounter_id)

    def encounters_with_scoped(self) -> list[str]:
        """Encounters that have ACTIVE facts ending with them."""
        return list(self._scoped._m.keys())

    def scoped_to(self, encounter_id: str) -> list[StoredMemory]:
        """An encounter's ACTIVE facts that end with it (its own ACTIVE records included)."""
        return [self.memories[i] for i in self._scoped.get(encounter_id)]

    def ended_with(self, encounter_id: str) -> list[StoredMemory]:
        """The memories the lifecycle archived when the encounter ended, still in HISTORY."""
        return [self.memories[i] for i in self._enc_ended.get(encounter_id)]

    def expiring(self) -> list[tuple[str, float]]:
        """(memory id, end) of the ACTIVE facts that expire at an end time of their own."""
        return list(self._expiring.items())

    def neighbours(self, memory_id: str) -> list[tuple[str, RelationType, float]]:
        """One hop, both directions: (neighbour id, relation type, weight), in igraph's order (by neighbour)."""
        out: list[tuple[int, int, str, RelationType, float]] = []
        for eid in self._adj.get(memory_id):
            s, t, ty, w = self._edges[eid]
            other = t if s == memory_id else s
            out.append((self._vertices[other], eid, other, RelationType(ty), w))
            if s == t:  # a loop is incident twice, as igraph lists it
                out.append(out[-1])
        out.sort(key=lambda x: (x[0], x[1]))
        return [(o, ty, w) for _, _, o, ty, w in out]

    def relations(self) -> list[Relation]:
        return [Relation(source_id=s, target_id=t, type=RelationType(ty), weight=float(w))
                for _, (s, t, ty, w) in sorted(self._edges.items())]

    def counts(self) -> dict[str, int]:
        active = sum(1 for m in self.memories.values() if m.store is Store.ACTIVE)
        return {
            "active": active,
            "history": len(self.memories) - active,
            "relations": len(self._edges),
        }

    def graph_size(self) -> int:
        """Vertices plus edges."""
        return len(self._vertices) + len(self._edges)

    @property
    def graph(self) -> ig.Graph:
        """The relation graph as an igraph ``Graph`` (vertex ``name``, edge ``type`` and ``weight``), built on
        demand and kept until the graph changes. Read-only: change the state through its methods."""
        if self._igraph is None:
            names, edges = self._indexed()
            g = ig.Graph(directed=True)
            g.add_vertices(len(names), attributes={"name": names})
            g.add_edges([(s, t) for s, t, _, _ in edges],
                        attributes={"type": [e[2] for e in edges], "weight": [e[3] for e in edges]})
            self._igraph = g
        return self._igraph

    def _indexed(self) -> tuple[list[str], list[tuple[int, int, str, float]]]:
        """Vertex names and edges with their ends as vertex ids, both in the order they were added (igraph's)."""
        names = [n for n, _ in sorted(self._vertices.items(), key=lambda kv: kv[1])]
        index = {n: i for i, n in enumerate(names)}
        return names, [(index[s], index[t], ty, w) for _, (s, t, ty, w) in sorted(self._edges.items())]

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
        self._add_vertex(memory.memory_id)
        self.graph_ops.append(["v", memory.memory_id])
        return stored

    def archive(self, memory_id: str, *, reason: Reason, successor_id: str | None,
                evidence_id: str | None, entry_id: str, at: datetime,
                ended_at: datetime | None = None) -> StoredMemory:
        """Move an ACTIVE memory to HISTORY. ``ended_at``: the lifecycle ended it at a clinical time of its own (an
        encounter's end, its interval's end), not at its evidence's time."""
        current = self.memories[memory_id]
        if current.store is not Store.ACTIVE:
            raise ValueError(f"memory {memory_id} is not ACTIVE")
        moved = current.model_copy(update={
            "store": Store.HISTORY, "reason": reason, "successor_id": successor_id,
            "evidence_id": evidence_id, "archived_by_entry": entry_id, "archived_at": at, "ended_at": ended_at,
        })
        self.memories[memory_id] = moved
        if current.memory.concept_key:
            self._active_concept.remove(current.memory.concept_key, memory_id)
        self._unindex_active(current)
        self._index_history(moved)
        self.clock = max(self.clock, evidence_ts(moved))  # a fact placed in HISTORY is evidence at its end
        return moved

    def reinstate(self, memory_id: str) -> StoredMemory:
        """A HISTORY memory back in ACTIVE: what ended it was cancelled (a cancelled discharge)."""
        current = self.memories[memory_id]
        if current.store is not Store.HISTORY:
            raise ValueError(f"memory {memory_id} is not in HISTORY")
        self._unindex_history(current)
        back = StoredMemory(memory=current.memory, store=Store.ACTIVE)
        self.memories[memory_id] = back
        if back.memory.concept_key:
            self._active_concept.add(back.memory.concept_key, memory_id)
        self._index_active(back)
        return back

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
        if mem.concept_key:
            self._by_concept.remove(mem.concept_key, memory_id)
            self._active_concept.remove(mem.concept_key, memory_id)
        if mem.source_ref:
            self._by_source.remove(mem.source_ref, memory_id)
        self._unindex_active(gone)
        self._unindex_history(gone)
        if self._remove_vertex(memory_id):
            self.graph_ops.append(["x", memory_id])
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
        ends = {relation.source_id, relation.target_id}
        for eid in self._adj.get(relation.source_id):
            s, t, ty, _ = self._edges[eid]
            if ty == relation.type.value and {s, t} == ends:
                return False
        self.restore_relation(relation)
        return True

    def restore_relation(self, relation: Relation) -> None:
        """Put back a relation recorded in the transition log (it was valid when it was made)."""
        for end in (relation.source_id, relation.target_id):
            if end not in self._vertices:
                raise ValueError(f"no vertex {end!r}")
        self._add_edge(relation.source_id, relation.target_id, relation.type.value, relation.weight)
        self.graph_ops.append(["e", relation.source_id, relation.target_id, relation.type.value, relation.weight])

    def _index(self, stored: StoredMemory) -> None:
        mem = stored.memory
        self.memories[mem.memory_id] = stored
        if mem.concept_key:
            self._by_concept.add(mem.concept_key, mem.memory_id)
            if stored.store is Store.ACTIVE:
                self._active_concept.add(mem.concept_key, mem.memory_id)
        if mem.source_ref:
            self._by_source.add(mem.source_ref, mem.memory_id)
        self.clock = max(self.clock, evidence_ts(stored))
        if stored.store is Store.ACTIVE:
            self._index_active(stored)
        else:
            self._index_history(stored)

    def _index_active(self, stored: StoredMemory) -> None:
        mem = stored.memory
        kind = lifecycle_of(mem)
        if mem.encounter_id is not None and kind.ends_with_encounter:
            self._scoped.add(mem.encounter_id, mem.memory_id)
        if is_encounter_record(mem):
            assert mem.encounter_id is not None
            self._enc_records.add(mem.encounter_id, mem.memory_id)
        if kind.expires and mem.effective_end is not None:
            self._expiring = self._expiring.set(mem.memory_id, mem.effective_end.timestamp())

    def _unindex_active(self, stored: StoredMemory) -> None:
        mem = stored.memory
        if mem.encounter_id is not None:
            self._scoped.remove(mem.encounter_id, mem.memory_id)
            self._enc_records.remove(mem.encounter_id, mem.memory_id)
        if mem.memory_id in self._expiring:
            self._expiring = self._expiring.delete(mem.memory_id)

    def _index_history(self, stored: StoredMemory) -> None:
        mem = stored.memory
        if mem.encounter_id is None or stored.reason is not Reason.ENCOUNTER_ENDED:
            return
        if is_encounter_record(mem) and placed(stored):
            end = evidence_ts(stored)
            known = self._enc_end.get(mem.encounter_id)
            if known is None or end >= known[0]:
                self._enc_end = self._enc_end.set(mem.encounter_id, (end, mem.memory_id))
        elif stored.ended_at is not None and not is_encounter_record(mem):
            self._enc_ended.add(mem.encounter_id, mem.memory_id)

    def _unindex_history(self, stored: StoredMemory) -> None:
        mem = stored.memory
        if mem.encounter_id is not None:
            self._enc_ended.remove(mem.encounter_id, mem.memory_id)
            known = self._enc_end.get(mem.encounter_id)
            if known is not None and known[1] == mem.memory_id:
                self._enc_end = self._enc_end.delete(mem.encounter_id)

    # --- the graph's own bookkeeping (no op recorded) ----------------------------------------------------

    def _add_vertex(self, name: str) -> None:
        if name not in self._vertices:
            self._vertices = self._vertices.set(name, self._rank)
            self._rank += 1
            self._igraph = None

    def _add_edge(self, source: str, target: str, rtype: str, weight: float) -> None:
        eid = self._next_edge
        self._next_edge += 1
        self._edges = self._edges.set(eid, (source, target, rtype, float(weight)))
        self._adj.add(source, eid)
        if target != source:
            self._adj.add(target, eid)
        self._igraph = None

    def _remove_vertex(self, name: str) -> bool:
        if name not in self._vertices:
            return False
        self._vertices = self._vertices.delete(name)
        for eid in self._adj.pop(name):
            s, t, _, _ = self._edges[eid]
            self._edges = self._edges.delete(eid)
            other = t if s == name else s
            if other != name:
                self._adj.remove(other, eid)
        self._igraph = None
        return True

    def _apply_op(self, op: list[Any]) -> None:
        if op[0] == "v":
            self._add_vertex(op[1])
        elif op[0] == "e":
            self._add_edge(op[1], op[2], op[3], op[4])
        elif op[0] == "x":
            self._remove_vertex(op[1])
        else:
            raise ValueError(f"unknown graph change {op[0]!r}")

    def copy(self) -> PatientState:
        """An independent copy to change and commit; the original (a cached snapshot) stays untouched. Its
        unpersisted graph changes start empty: the copy records what happens to it."""
        c = PatientState.__new__(PatientState)
        c.patient_id, c.version = self.patient_id, self.version
        c.memories = dict(self.memories)
        c._vertices, c._rank = self._vertices, self._rank  # persistent maps: shared, never changed in place
        c._edges, c._next_edge = self._edges, self._next_edge
        c._adj, c._by_concept, c._by_source = self._adj.copy(), self._by_concept.copy(), self._by_source.copy()
        c._active_concept = self._active_concept.copy()
        c.clock, c._scoped, c._enc_records = self.clock, self._scoped.copy(), self._enc_records.copy()
        c._enc_end, c._enc_ended, c._expiring = self._enc_end, self._enc_ended.copy(), self._expiring
        c._igraph = self._igraph  # igraph graphs are not changed in place here; a change drops it
        c.graph_ops, c.graph_log, c.graph_base = [], self.graph_log, self.graph_base
        return c

    def persisted(self, log_length: int, base: int) -> None:
        """The state store wrote :attr:`graph_ops`; its snapshot holds ``base`` vertices and edges, and the log after
        it ``log_length`` changes."""
        self.graph_ops = []
        self.graph_log, self.graph_base = log_length, base

    # --- snapshot ----------------------------------------------------------------------------------

    def graph_snapshot(self) -> bytes:
        """Compact JSON of the graph in igraph's terms: vertex names and (source, target, type, weight) edges,
        ends as vertex ids."""
        names, edges = self._indexed()
        return orjson.dumps({"version": self.version, "vertices": names, "edges": edges})

    @classmethod
    def restore(cls, patient_id: str, version: int, graph_blob: bytes | None,
                memories: Iterable[bytes], graph_log: Iterable[bytes] = ()) -> PatientState:
        """A state from its stored form: memory records, the graph snapshot and the changes logged after it
        (``graph_log``). Without a snapshot or log, every memory is a vertex without relations."""
        state = cls(patient_id=patient_id, version=version)
        for raw in memories:
            state._index(StoredMemory.model_validate_json(raw))
        log = list(graph_log)
        if graph_blob:
            snap: dict[str, Any] = orjson.loads(graph_blob)
            names: list[str] = snap["vertices"]
            for n in names:
                state._add_vertex(n)
            for s, t, ty, w in snap["edges"]:
                state._add_edge(names[s], names[t], ty, w)
            state.graph_base = len(names) + len(snap["edges"])
        elif not log:
            for n in state.memories:
                state._add_vertex(n)
        for raw in log:
            state._apply_op(orjson.loads(raw))
        state.graph_log = len(log)
        return state
