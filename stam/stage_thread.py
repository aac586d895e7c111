"""The stage thread: the one thread of a worker process on which stage work and every store call of the write
path run (Redis, Milvus, the embedding model), off the event loop and in order. The workers' agents, the query
worker and the recovery check (``stam.recovery``) all hand their blocking calls to it. One call runs beside it: the
worker's periodic Milvus seal (``workers.main.SEAL_THREAD``), which orders nothing and which the stage waited out."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

STAGE_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stam-stage")
