"""Every STAM topic, as code.

All topics are keyed by patient id, so one patient's messages stay in one partition and in order. Stage
topics share one partition count, which lets Faust co-partition them: the worker that owns a patient's
partition owns that patient in every stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta


@dataclass(eq=True, frozen=True)
class TopicSpec:
    suffix: str
    description: str
    payload: str
    retention: timedelta | None
    """None: kept forever."""
    compacted: bool = False
    internal: bool = True

    def name(self, prefix: str) -> str:
        return f"{prefix}.{self.suffix}"


ENTRIES = TopicSpec("entries.v1", "Record entries published by users (HL7/FHIR-derived)",
                    "schemas.RecordEntry", timedelta(days=7), internal=False)
EXTRACTED = TopicSpec("extracted.v1", "extract -> link: entry with its atomic memories",
                      "schemas.ExtractedEntry", timedelta(days=1))
LINKED = TopicSpec("linked.v1", "link -> impact: typed relations and the state version read",
                   "schemas.LinkedEntry", timedelta(days=1))
IMPACTED = TopicSpec("impacted.v1", "impact -> update: impact candidates per new memory",
                     "schemas.ImpactedEntry", timedelta(days=1))
TRANSITIONS = TopicSpec("transitions.v1", "Public output: every state transition, the record of state",
                        "schemas.TransitionEvent", None, internal=False)
DEAD_LETTERS = TopicSpec("deadletter.v1", "Messages that failed: original bytes, stage, error",
                         "schemas.DeadLetter", timedelta(days=30), internal=False)

CHECKPOINTS = TopicSpec("checkpoints.v1", "Durability checkpoints of the state store (epoch, write counter), "
                        "written before each offset commit; a store behind the last one is rebuilt from the "
                        "transitions (stam.recovery)", "stam.recovery.Checkpoint", None, compacted=True)

QUERIES = TopicSpec("queries.v1", "Questions about one patient for the query workers (key = patient id)",
                    "schemas.query.QueryRequest", timedelta(days=1), internal=False)
ANSWERS = TopicSpec("answers.v1", "Evidence packets and answers, correlated by request_id (key = patient id)",
                    "schemas.query.QueryAnswer", timedelta(days=1), internal=False)

AUDIT = TopicSpec("audit.v1", "Audit records without patient data (erasure receipts), kept forever",
                  "schemas.ErasureReceipt", None, internal=False)

DELETIONS = TopicSpec("deletions.v1", "Deletion gate -> update: HISTORY memories of one patient to delete (each "
                      "with its score, tau, alpha and calibration); applied by the update stage as `deleted` "
                      "transitions", "schemas.DeletionOrder", timedelta(days=7))

ALL = (ENTRIES, EXTRACTED, LINKED, IMPACTED, TRANSITIONS, DEAD_LETTERS, QUERIES, ANSWERS, CHECKPOINTS, AUDIT,
       DELETIONS)
