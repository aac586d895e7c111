"""The update worker's change log (stam.stages.changelog): it answers only for versions it recorded without a gap."""

from __future__ import annotations

from stam.stages.changelog import ChangeLog, VersionChange


def _c(version: int, *ids: str) -> VersionChange:
    return VersionChange(version, frozenset(ids), frozenset(), tuple(ids))


def test_changes_since_a_version_are_the_committed_ones_then_the_batch_s_own() -> None:
    log = ChangeLog()
    log.record("p", [_c(1, "a"), _c(2, "b")])
    log.record("p", [_c(3, "c")])
    assert [c.version for c in log.since("p", 1, 3, [_c(4, "d")]) or []] == [2, 3, 4]
    assert log.since("p", 3, 3, []) == []
    assert log.since("p", 0, 3, []) == [_c(1, "a"), _c(2, "b"), _c(3, "c")]


def test_a_version_not_recorded_makes_it_unable_to_tell() -> None:
    log = ChangeLog()
    assert log.since("p", 0, 1, []) is None  # nothing recorded: a restart
    log.record("p", [_c(1, "a")])
    log.record("p", [_c(3, "c")])  # version 2 was another writer's (or a deletion): what came before is dropped
    assert log.since("p", 0, 3, []) is None
    assert log.since("p", 1, 3, []) is None
    assert [c.version for c in log.since("p", 2, 3, []) or []] == [3]
    assert log.since("p", 4, 3, []) is None  # read at a version the batch's base has not reached
    log.forget("p")
    assert log.since("p", 2, 3, []) is None


def test_the_log_is_bounded() -> None:
    log = ChangeLog(max_patients=2, max_versions=3)
    log.record("p", [_c(v, f"m{v}") for v in range(1, 6)])
    assert log.since("p", 1, 5, []) is None  # versions 2 and 3 were dropped
    assert [c.version for c in log.since("p", 2, 5, []) or []] == [3, 4, 5]
    log.record("q", [_c(1, "x")])
    log.record("r", [_c(1, "y")])
    assert log.since("p", 4, 5, []) is None  # the least recently recorded patient went
    assert log.since("r", 0, 1, []) == [_c(1, "y")]
