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


class StackError(StamError):
    """The embedded stack could not start or reach one of its services."""
