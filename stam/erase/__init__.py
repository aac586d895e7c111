"""Verified erasure of one patient (``stam erase --patient ID``).

:func:`erase` removes the patient from every place STAM keeps it, then runs :func:`scan`, an independent search
for the patient id and sample texts of the patient in every place, and publishes a receipt without patient data
on ``stam.audit.v1``. One module per place, each saying how the patient leaves it:

- :mod:`stam.erase.register`: **a marker** (a keyed digest of the id, never the id), so ``stam rebuild`` refuses
  to bring the patient back from the transition log; :class:`Report`, what each step removed and how;
- :mod:`stam.erase.redis_store`: **Redis**, every key of the patient by exact name, then Redis's persistence files
  rewritten;
- :mod:`stam.erase.milvus_store`: **Milvus**, the patient's vectors deleted from every collection, then the bytes
  purged (compaction on a server, a rewrite of the collection on Milvus Lite);
- :mod:`stam.erase.files`: **files under STAM_HOME** (JSON Lines lines removed, the id redacted in logs);
- :mod:`stam.erase.topics`: **topics**, the patient's data key shredded (crypto-shredding), and the topic scan;
- :mod:`stam.erase.verify`: the sample texts and the independent :func:`scan`;
- :mod:`stam.erase.lineage`: the LoRA adapters and teacher trace sets that learnt from the patient (listed, not
  removed: weights cannot forget one patient, they are retrained without them);
- here: :func:`plan` (``--dry-run``) and :func:`erase`, the steps in order and the receipt.

Running query workers: their timeline caches are keyed by the patient's state version, which erasure removes
(version 0), so the next query misses the cache, finds no memory and answers ``not_found``, like an unknown
patient. Erasure also increments ``<prefix>:erasures``, read with the version, and a query process drops every
timeline it holds when that count moves: a patient erased and re-created up to the same version is read anew.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib import metadata
from typing import Any

import redis

from schemas import ErasureReceipt, ErasureVerification
from stam.config import Settings
from stam.erase.files import (
    LOG_SUFFIXES,
    REDACTED,
    TEXT_SUFFIXES,
    erase_files,
    home_files,
    jsonl_files,
    lines_naming,
    parquet_strings,
    read_file,
)
from stam.erase.milvus_store import count_rows, erase_milvus, patient_collections, patient_expr
from stam.erase.redis_store import STATE_PARTS, erase_redis, redis_keys, rewrite_redis_files, state_key
from stam.erase.register import ErasureRegister, Report, is_erased, mark_erased
from stam.erase.topics import Crypto
from stam.erase.verify import pick_samples, scan
from stam.transport import deployment_milvus_client, redis_client
from topology import topics as t

__all__ = ["LOG_SUFFIXES", "REDACTED", "STATE_PARTS", "TEXT_SUFFIXES", "Crypto", "ErasureRegister", "Report",
           "erase", "erase_files", "erase_milvus", "erase_redis", "is_erased", "mark_erased", "parquet_strings",
           "pick_samples", "plan", "redis_keys", "rewrite_redis_files", "scan", "software_version"]

log = logging.getLogger("stam.erase")


def plan(settings: Settings, patient_id: str, *, client: redis.Redis | None = None) -> dict[str, Any]:
    """What an erasure would remove, counted per store (``--dry-run``)."""
    client = client or redis_client(settings)
    prefix = settings.collection_prefix
    keys = redis_keys(client, prefix, patient_id)
    counts: dict[str, int] = {
        "redis_keys": len(keys["state"]) + len(keys["outboxes"]) + len(keys["other"]),
        "memories": int(client.hlen(state_key(prefix, patient_id, "mem"))),
        "source_texts": int(client.hlen(state_key(prefix, patient_id, "src"))),
        "outboxes": len(keys["outboxes"]),
        "in_patients_set": int(bool(client.sismember(f"{prefix}:patients", patient_id))),
    }
    mc = deployment_milvus_client(settings)
    try:
        counts["milvus_vectors"] = sum(count_rows(mc, n, patient_expr(patient_id)) for n in patient_collections(mc))
    finally:
        mc.close()
    quoted = json.dumps(patient_id).encode()
    counts["file_lines"] = sum(lines_naming(p, quoted) for p in jsonl_files(settings))
    needle = patient_id.encode()
    counts["log_files"] = sum(1 for p in home_files(settings.home)
                              if p.suffix in LOG_SUFFIXES and needle in read_file(p))
    crypto = Crypto(settings, client)
    return {"counts": counts, "redis_keys": keys, "topics": "data key shredded" if crypto.available
            else crypto.reason, "erased_before": is_erased(settings, client, patient_id)}


async def _publish_receipt(settings: Settings, receipt: bytes, key: bytes) -> None:
    # Deferred: topology.admin brings aiokafka, a heavy import that only publishing needs.
    # deferred: topology.admin pulls in aiokafka
    from topology.admin import ensure_topics, producer

    await ensure_topics(settings)
    async with producer(settings) as out:
        await out.send_and_wait(t.AUDIT.name(settings.topic_prefix), key=key, value=receipt)


def software_version() -> str:
    try:
        return metadata.version("stam")
    except metadata.PackageNotFoundError:
        return "unknown"


def erase(settings: Settings, patient_id: str, *, request_id: str | None = None, samples: Sequence[str] = (),
          client: redis.Redis | None = None, publish: bool = True) -> dict[str, Any]:
    """Erase the patient everywhere, verify, and publish the receipt. Returns ``{"receipt": ..., "scan": ...,
    "published": bool, "samples": [...]}`` (``scan`` and ``samples`` name the patient's data only by count and
    location; the receipt holds nothing of the patient)."""
    client = client or redis_client(settings)
    prefix = settings.collection_prefix
    requested = datetime.now(UTC)
    receipt_id = f"erasure-{uuid.uuid4()}"
    report = Report()
    chosen = list(samples) + [s for s in pick_samples(settings, patient_id, client=client) if s not in samples]

    def step(name: str, fn: Any, *args: Any) -> None:
        t0 = time.perf_counter()
        fn(*args)
        report.seconds[name] = round(time.perf_counter() - t0, 3)

    step("marker", mark_erased, client, prefix, patient_id)
    step("redis", erase_redis, client, prefix, patient_id, report)
    step("milvus", erase_milvus, settings, patient_id, client, report)
    step("files", erase_files, settings, patient_id, report)
    # The data key goes before Redis's files are rewritten, so no copy of it is left on disk.
    crypto = Crypto(settings, client)
    shredded = crypto.shred(patient_id)
    report.removed["data_key_shredded"] = int(bool(shredded))
    report.steps["topics"] = ("data key shredded: every sealed copy on every topic is unreadable" if shredded
                              else "no live data key (already shredded, or nothing sealed for the patient)"
                              if shredded is not None else crypto.reason)
    step("redis_files", rewrite_redis_files, client, report)
    t0 = time.perf_counter()
    found = scan(settings, patient_id, chosen, client=client)
    report.seconds["scan"] = round(time.perf_counter() - t0, 3)
    report.steps["seconds"] = json.dumps(report.seconds, sort_keys=True)
    receipt = ErasureReceipt(
        receipt_id=receipt_id, request_id=request_id or receipt_id, requested_at=requested,
        completed_at=datetime.now(UTC), removed=report.removed, steps=report.steps,
        verification=ErasureVerification(verified=found["verified"], residuals=found["residuals"],
                                         not_covered=tuple(found["not_covered"]), samples=len(chosen)),
        software_version=software_version())
    published = False
    if publish:
        try:
            asyncio.run(_publish_receipt(settings, receipt.model_dump_json().encode(), receipt_id.encode()))
            published = True
        except Exception as exc:  # noqa: BLE001 - the erasure is done; the caller reports the receipt was not kept
            log.error("erasure receipt %s not published: %s", receipt_id, type(exc).__name__)
    log.info("erasure %s done: verified=%s", receipt_id, found["verified"])
    return {"receipt": receipt.model_dump(mode="json"), "published": published, "scan": found,
            "samples": len(chosen)}
