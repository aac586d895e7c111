"""The update worker's own log of what each version it applied changed in a patient's state, for deciding whether
the work of link and impact went stale (:mod:`stam.stages.reads`). Never shared between processes, safe to lose:
what it does not cover is redone."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from schemas import AtomicMemory, TransitionEvent


@dataclass(frozen=True)
class VersionChange:
    """What applying one entry changed in a patient's state: the version it made, the memories it added, moved
    between stores or reinstated, the memories at either end of a relation it added, and the memories it added in
    the order it added them."""

    version: int
    memories: frozenset[str]
    related: frozenset[str]
    added: tuple[str, ...]

    @classmethod
    def of(cls, version: int, changed: Sequence[str], events: Sequence[TransitionEvent],
           added: Sequence[AtomicMemory]) -> VersionChange:
        related = {end for e in events for r in e.relations for end in (r.source_id, r.target_id)}
        return cls(version, frozenset(changed), frozenset(related), tuple(m.memory_id for m in added))


class ChangeLog:
    """Per patient, what each version this worker applied changed: the last ``max_versions`` versions of the last
    ``max_patients`` patients. A version it did not record (another writer, a deletion, a restart) is a gap, and
    a gap makes :meth:`since` say it cannot tell."""

    def __init__(self, max_patients: int = 2048, max_versions: int = 256) -> None:
        # An entry's link and impact are at most a run-ahead bound (STAM_RUN_AHEAD_ENTRIES, 4,096) behind its update,
        # over every patient of the burst: some versions of each of the patients written last are what gets asked
        # for. With 32 versions, an unbounded run-ahead left half the hospital feed's entries out of reach (redone).
        self._log: OrderedDict[str, deque[VersionChange]] = OrderedDict()
        self._max_patients = max_patients
        self._max_versions = max_versions

    def record(self, patient_id: str, changes: Sequence[VersionChange]) -> None:
        """Changes committed for a patient, in version order."""
        if not changes:
            return
        log = self._log.get(patient_id)
        if log is None or (log and log[-1].version + 1 != changes[0].version):
            log = deque(maxlen=self._max_versions)  # a gap: what came before is of no use
        log.extend(changes)
        self._log[patient_id] = log
        self._log.move_to_end(patient_id)
        while len(self._log) > self._max_patients:
            self._log.popitem(last=False)

    def forget(self, patient_id: str) -> None:
        self._log.pop(patient_id, None)

    def since(self, patient_id: str, version: int, base: int,
              pending: Sequence[VersionChange]) -> list[VersionChange] | None:
        """The changes from ``version`` on: the committed ones up to ``base`` (the version the batch read), then
        ``pending`` (the batch's own, not committed yet). None when the log does not cover every one of them."""
        if version > base:
            return None
        log = self._log.get(patient_id, ())
        committed = [c for c in log if version < c.version <= base]
        if len(committed) != base - version:
            return None
        return committed + list(pending)
