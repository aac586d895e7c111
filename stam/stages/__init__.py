"""The four write-path stages as plain functions over one deps object.

Workers are thin wrappers around these; tests call them without a broker.

Per-patient order (DESIGN-NOTES): link and impact record the patient state version they read, and what they
read. The update stage re-reads the state; if the version moved (an earlier entry of the same patient was applied
in between, because the stages pipeline), it checks whether anything they read changed since and, if so, looks
it up again on the current state before deciding (:mod:`stam.stages.reads`). The commit itself is conditional on
the version it read, so no two writers interleave.

One module per stage, and what they share:

- :mod:`stam.stages.deps`: :class:`Deps` (what the stages need), :class:`StageParams`, :class:`Reads`,
  :class:`UpdateResult`;
- :mod:`stam.stages.extract`, :mod:`stam.stages.link`, :mod:`stam.stages.impact`: the first three stages;
- :mod:`stam.stages.changelog`, :mod:`stam.stages.reads`: what each applied version changed, and whether the work
  of link and impact still holds;
- :mod:`stam.stages.update`: the update stage, the single writer of patient state, and :func:`process_entry`;
- :mod:`stam.stages.delete`: the deletion gate's orders, applied by the same writer.
"""

from stam.stages.delete import DeletionResult, delete_batch
from stam.stages.deps import Deps, Reads, StageParams, UpdateResult
from stam.stages.extract import extract_batch, extract_signed_batch, extract_stage
from stam.stages.impact import EXPLICIT_ROLES, deferred_to_update, impact_batch, impact_stage
from stam.stages.link import link_batch, link_stage
from stam.stages.update import decode_outbox, process_entry, update_batch, update_stage

__all__ = [
    "EXPLICIT_ROLES", "DeletionResult", "Deps", "Reads", "StageParams", "UpdateResult", "decode_outbox",
    "deferred_to_update", "delete_batch", "extract_batch", "extract_signed_batch", "extract_stage", "impact_batch",
    "impact_stage", "link_batch", "link_stage", "process_entry", "update_batch", "update_stage",
]
