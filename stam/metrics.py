"""prometheus-client metrics. Labels never carry patient identifiers."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

MESSAGES = Counter("stam_messages_total", "Messages handled per stage and outcome", ["stage", "outcome"])
STAGE_SECONDS = Histogram(
    "stam_stage_seconds", "Time spent in a stage function per message", ["stage"],
    buckets=(0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
             0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0),  # the tail: model calls on a CPU
)
HOP_WAIT_SECONDS = Histogram(
    "stam_hop_wait_seconds",
    "From a message's produce (its Kafka timestamp) to its stage starting on it: the producer's linger, the "
    "broker, the consumer's fetch wait, the stream's buffer and the batch window (clocks of two hosts when the "
    "producer runs elsewhere)", ["stage"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0,
             30.0, 60.0, 300.0),
)
COMMIT_SECONDS = Histogram(
    "stam_commit_seconds",
    "One update batch's write of what it applied, by store: 'milvus' (the changed memories' vectors) and 'redis' "
    "(every patient's state with its transition outboxes in one MULTI/EXEC; the server's fsync included when it "
    "runs appendfsync always)", ["store"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
DELIVERY_SECONDS = Histogram(
    "stam_delivery_seconds",
    "From an applied entry's transitions handed to the producer to the broker's acknowledgement of all of them "
    "(the outbox publish: the producer's linger, the produce round trip and the broker's write)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0),
)
FREE_TEXT = Counter("stam_free_text_entries_total",
                    "Entries carrying free text, by handling: 'decomposed' by the language model, or kept "
                    "'verbatim' as one note memory because no model is configured", ["handling"])
TRANSITIONS = Counter("stam_transitions_total", "State transitions applied", ["kind", "reason"])
DELETIONS_SKIPPED = Counter("stam_deletions_skipped_total",
                            "Memories of a deletion order the update stage did not delete: gone already, or kept "
                            "by a rule in the state the order met (active, before-current, thread-start, related, "
                            "coded-never-forget)",
                            ["why"])
REDONE = Counter("stam_stale_redo_total",
                 "Entries whose link/impact the updater ran again, search included, because what they read could "
                 "not be checked (no record, a version this worker did not apply, a semantic hit gone)")
RUN_AHEAD = Gauge("stam_run_ahead_entries", "Four stages in one process: entries the extract stage handed on that "
                  "have not left the pipeline (bounded by STAM_RUN_AHEAD_ENTRIES)")
READS = Counter("stam_update_reads_total",
                "Entries of the four stages by what the updater did with their link and impact work: current (read "
                "at the version applied to), reused (what they read had not changed), patched (looked up again in "
                "memory, the semantic search kept with the memories added since merged in), redone (searched again)",
                ["reads"])
RECOVERIES = Counter("stam_state_recoveries_total",
                     "Times the worker found the state store behind the transition log and rebuilt it")
RECOVERED_PATIENTS = Counter("stam_state_recovered_patients_total",
                             "Patients rebuilt from the transition log after the state store lost writes")
UNREADABLE = Counter("stam_state_unreadable_transitions_total",
                     "Transitions recovery could not open: their patient's data key is missing from the key store "
                     "(not erased); alert on any increase")
BACKGROUND_FAILURES = Counter("stam_background_failures_total",
                              "Failures of the worker's timers and background tasks (retried; never fatal)",
                              ["task", "error_type"])
DEAD_LETTERS = Counter("stam_dead_letters_total", "Messages sent to the dead-letter topic",
                       ["stage", "error_type"])
STAGE_BUGS = Counter("stam_stage_bug_total",
                     "Unexpected exceptions in a stage (a bug, not the message's fault nor an outage): the "
                     "partition holds and retries; alert on any increase", ["stage", "error_type"])
PARTITION_STALLED = Gauge("stam_partition_stalled",
                          "Partitions of a stage held by an unexpected exception right now (alert when > 0)",
                          ["stage"])
QUERIES = Counter("stam_queries_total", "Queries answered, by channel, outcome ('ok' or the error kind: "
                  "not_found, invalid, unavailable, internal) and what was served (active, both, none)",
                  ["channel", "outcome", "served"])
QUERY_SECONDS = Histogram(
    "stam_query_seconds", "Query latency (retrieval, gate, packet; reader included when configured)",
    ["channel"], buckets=(0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
ARCHIVE_REFUSED = Counter("stam_archive_refused_total", "Archivals refused by the source-identity rule (an entry "
                          "from another source system, or unsigned, proposed to retract or amend a fact)",
                          ["reason"])
CONSUMER_LAG = Gauge("stam_consumer_lag", "Messages of a partition held by this process not yet committed by its "
                     "consumer group: end offset minus committed offset (0 when caught up)",
                     ["group", "topic", "partition"])
PROMPT_INFO = Gauge("stam_prompt_info", "The prompts this process sends a language model: 1 per purpose, labelled "
                    "with the prompt's id (purpose/version-fingerprint, stam/llm/prompt.py)", ["purpose", "prompt"])
READY = Gauge("stam_ready", "A dependency of this process answered its last readiness check (1) or not (0)",
              ["dependency"])
# Declared for the dashboard (stam/ops/dashboard.py); observed where the query packet is served and where a
# language-model call returns.
QUERY_SERVED_TOKENS = Histogram(
    "stam_query_served_tokens", "Tokens of the evidence packet served per query, by channel and what was served "
    "(active, both)", ["channel", "served"],
    buckets=(50, 100, 250, 500, 1000, 2000, 4000, 8000, 16000, 32000, 64000))
LLM_SECONDS = Histogram(
    "stam_llm_seconds", "Duration of successful language-model calls (retries included)",
    buckets=(0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0))

# The HL7 v2 MLLP listener (stam/mllp.py): no sender, patient or control id in any label.
MLLP_MESSAGES = Counter("stam_mllp_messages_total", "HL7 v2 messages received over MLLP, by outcome: accepted, "
                        "dead_lettered, duplicate, refused_sender, too_large, unavailable, no_ack", ["outcome"])
MLLP_ACKS = Counter("stam_mllp_acks_total", "Acknowledgements sent, by code (AA, AE, AR, CA, CE, CR)", ["code"])
MLLP_ACK_SECONDS = Histogram(
    "stam_mllp_ack_seconds", "From a message's last byte to its acknowledgement written, by code", ["code"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
MLLP_CONNECTIONS = Gauge("stam_mllp_connections", "Open MLLP connections")

# FHIR topic-based Subscriptions (stam/fhir/): no subscription, patient or endpoint in any label.
FHIR_NOTIFICATIONS = Counter("stam_fhir_notifications_total", "Notification Bundles POSTed to subscribers, by type "
                             "(handshake, heartbeat, event-notification) and outcome: sent, failed (one try that "
                             "failed), dropped (left for $events after the last try)", ["type", "outcome"])
FHIR_EVENTS = Counter("stam_fhir_events_total", "Subscription events generated from transitions, by topic and "
                      "outcome: numbered, duplicate (a redelivered transition), erased (its patient was erased: "
                      "nothing sent)", ["topic", "outcome"])
FHIR_DELIVERY_SECONDS = Histogram(
    "stam_fhir_delivery_seconds", "From a transition applied (its recorded_at) to the subscriber's 2xx for the "
    "notification that carried it", buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0))
FHIR_SUBSCRIPTIONS = Gauge("stam_fhir_subscriptions", "Subscriptions this process delivers, by status", ["status"])
