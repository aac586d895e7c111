"""One base error; small classes per concern. Workers dead-letter any ``StamError`` with its class name."""


class StamError(Exception):
    """Base of every error STAM raises on purpose."""


class InvalidPayload(StamError):
    """A message does not match its wire schema."""


class SourceError(StamError):
    """A source document (FHIR bundle, HL7 message...) cannot be parsed or validated."""


class ReasoningError(StamError):
    """A reasoner could not produce a valid judgement for an entry."""


class ConcurrentUpdate(StamError):
    """Another writer changed the patient state between read and commit (version mismatch)."""


class StateRolledBack(StamError):
    """The state store holds less than this worker (or the durable checkpoint) knows was written: it lost
    writes (a crash without an append-only file, a restore from an older backup, a failover). The write path
    stops applying and rebuilds the affected patients from the transition log first."""


class StackError(StamError):
    """The embedded stack could not start or reach one of its services."""


class QueryError(StamError):
    """A query that cannot be answered as asked (unknown patient, no transition log for as_of...)."""


class UnsupportedQuery(QueryError):
    """A query this service cannot answer as asked (as_of_version where no transition log is configured)."""


class IsolationBreach(StamError):
    """A retrieved memory belongs to another patient. Never served: the query fails as an internal error and
    is logged at ERROR."""
