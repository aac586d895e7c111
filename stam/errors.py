"""One base error; small classes per concern.

Workers dead-letter a :class:`MessageFault` (the message's fault) with its class name; any other exception
inside a stage is either an outage (retried) or a bug (the partition stops and an alert metric rises), see
``workers.common``.
"""


class StamError(Exception):
    """Base of every error STAM raises on purpose."""


class MessageFault(StamError):
    """The input message itself cannot be handled (malformed, over a limit, refused by a store as a value):
    it is dead-lettered and the stream goes on. Stage and source code raise this family for bad input."""


class InvalidPayload(MessageFault):
    """A message does not match its wire schema."""


class MessageTooLarge(MessageFault):
    """A message, or what a stage would send on for it, is over the broker's message limit."""


class StoreRejected(MessageFault):
    """A store refused a value of this message (a Milvus value over a field's length, a bad filter, a Redis
    WRONGTYPE on one key): retrying cannot help, so the message is dead-lettered rather than held."""


class SourceError(MessageFault):
    """A source document (FHIR bundle, HL7 message...) cannot be parsed or validated."""


class ReasoningError(MessageFault):
    """A reasoner could not produce a valid judgement for an entry."""


class ConcurrentUpdate(StamError):
    """Another writer changed the patient state between read and commit (version mismatch)."""


class StateRolledBack(StamError):
    """The state store holds less than this worker (or the durable checkpoint) knows was written: it lost
    writes (a crash without an append-only file, a restore from an older backup, a failover). The write path
    stops applying and rebuilds the affected patients from the transition log first."""


class InputRefused(StamError):
    """A user's own mistake on the command line (a path that does not exist, an empty or non-clinical file):
    refused with one line before anything is sent; nothing is dead-lettered for a typo."""


class StackError(StamError):
    """The embedded stack could not start or reach one of its services."""


class QueryError(StamError):
    """A query that cannot be answered as asked (unknown patient, no transition log for as_of...)."""


class UnsupportedQuery(QueryError):
    """A query this service cannot answer as asked (as_of_version where no transition log is configured)."""


class IsolationBreach(StamError):
    """A retrieved memory belongs to another patient. Never served: the query fails as an internal error and
    is logged at ERROR."""
