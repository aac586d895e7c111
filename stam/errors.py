"""Every error STAM raises on purpose, in one family.

- :class:`MessageFault`: the input message itself cannot be handled. Workers dead-letter it with its class name
  and the stream goes on.
- :class:`Transient`: an outage or a race that retrying resolves. Workers hold the partition and retry.
- Everything else under :class:`StamError` is a user's or operator's mistake (refused with one line on the
  command line) or a configuration error (the process stops, saying what to fix).
- Any other exception inside a stage is a bug: the partition stops and an alert metric rises, nothing is
  dead-lettered silently (``workers.stage_agent.classify``).

Define a new error here, never in the module that raises it.
"""


class StamError(Exception):
    """Base of every error STAM raises on purpose."""


class Transient(StamError):
    """Marker: an outage or a race, not the message's fault; the worker retries the message (with backoff)."""


# --- the message's fault: dead-lettered ----------------------------------------------------------------------
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


class SignatureError(MessageFault):
    """An entry whose source identity cannot be trusted (unsigned where signing is required, an unknown source,
    a signature that does not verify). Dead-lettered by the extract stage with this text as the reason."""


class EntryIdCollision(MessageFault):
    """An entry whose id was already applied from another source system (or unsigned): dead-lettered, never
    taken for a redelivery (memory ids derive from entry ids, so the first one to use an id would hide the
    other's entry)."""


class SealBroken(MessageFault):
    """An envelope that does not open under its patient's key (corrupted, truncated, or forged)."""


class LLMError(MessageFault):
    """The endpoint refused the request (a 4xx other than 408/429) or answered something that is not a chat
    completion: the request's fault, so the entry is dead-lettered."""


# --- transient: retried ----------------------------------------------------------------------------------------
class ConcurrentUpdate(Transient):
    """Another writer changed the patient state between read and commit (version mismatch)."""


class StateRolledBack(Transient):
    """The state store holds less than this worker (or the durable checkpoint) knows was written: it lost
    writes (a crash without an append-only file, a restore from an older backup, a failover). The write path
    stops applying and rebuilds the affected patients from the transition log first."""


class LLMUnavailable(Transient, ConnectionError):
    """The endpoint could not be reached or kept failing (timeouts, 429, 5xx) through the retry budget: an
    outage, not the entry's fault, so the worker holds the partition and retries (``workers.stage_agent``)."""


class ListenerUnavailable(Transient):
    """The MLLP listener's broker or Redis did not take a message in time: the sender gets AR and sends it again
    (``stam.mllp``); nothing was acknowledged."""


class SubscriberUnreachable(Transient):
    """A FHIR Subscription's rest-hook endpoint did not take a notification (a connection error, a timeout, a
    non-2xx answer): retried, then the events are left for the subscriber to recover with ``$events``
    (``stam.fhir.notifier``)."""


# --- a user's or operator's mistake, configuration, the stack ----------------------------------------------------
class InputRefused(StamError):
    """A user's own mistake on the command line (a path that does not exist, an empty or non-clinical file):
    refused with one line before anything is sent; nothing is dead-lettered for a typo."""


class DeadLetterError(StamError):
    """An operator's request about dead letters that cannot be done as asked (one line for the CLI)."""


class UnknownStage(StamError, ValueError):
    """``stam worker --stages`` names a stage that does not exist."""


class StagesBacklog(StamError):
    """The fused worker would start while the four stages' own topics still hold messages of its consumer group that
    no stage has processed: it does not read them, so those entries would never be applied."""


class FourStagesRunning(StamError):
    """The fused worker would join a consumer group in which four-stage workers are alive: it does not read the
    extracted, linked and impacted topics, so what they leave there when they stop would never be applied."""


class StackError(StamError):
    """The embedded stack could not start or reach one of its services."""


class PortInUse(StamError):
    """A port this process must listen on is taken (another worker on the same host, most often)."""


class SourceConfigError(StamError):
    """The configured source systems cannot be read (a user's configuration mistake)."""


class PageInputError(StamError, ValueError):
    """A parameter of the timeline page's data request, or of ``stam state --html``, that cannot be read (answered
    400, or one line and exit 2)."""


class SubscriptionRefused(StamError, ValueError):
    """A FHIR Subscription that cannot be accepted as asked (an unknown topic or filter, a channel other than
    rest-hook, ``full-resource`` to an endpoint without TLS): answered 400/422 with an OperationOutcome."""


class TokenConfigError(StamError):
    """The query token file cannot be used (a user's configuration mistake)."""


class KeyConfigError(StamError):
    """The master key file is missing (where it may not be created), unreadable or malformed."""


class WeightsError(StamError):
    """Parts missing, or a joined file of the wrong size or digest."""


class ServeOptionError(StamError, ValueError):
    """The options of ``stam serve`` contradict each other or name what is not there (one line, no traceback)."""


class TrainingError(StamError, ValueError):
    """The inputs of a training run cannot be used (missing traces, none for the module, none short enough)."""


class LabNotInstalled(StamError):
    """A command of the lab part (stam-lab: evaluation, training, the deletion gate's calibration) was run where
    only the product is installed (a deployment's image ships the product alone)."""


# --- the read side -----------------------------------------------------------------------------------------------
class QueryError(StamError):
    """A query that cannot be answered as asked (unknown patient, no transition log for as_of...)."""


class UnsupportedQuery(QueryError):
    """A query this service cannot answer as asked (as_of_version where no transition log is configured)."""


class Erased(StamError):
    """The envelope's data key was shredded (``stam erase``): its content is gone, by design."""


class IsolationBreach(StamError):
    """A retrieved memory belongs to another patient. Never served: the query fails as an internal error and
    is logged at ERROR."""
