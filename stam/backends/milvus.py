"""ACTIVE and HISTORY vectors in Milvus: one collection, patient id as partition key, the store as a field.

One collection with a ``store`` field (rather than a collection per store) makes a transition one upsert
that changes the field: atomic, so a vector is never in both stores or in neither, and one round trip
per entry on the write path (two collections needed an upsert and a delete per store touched). Searches
name the store, so ACTIVE and HISTORY are still searched separately with their own budgets.

Works with a Milvus server (``http://host:19530``) or Milvus Lite (a path ending in ``.db``, or the embedded
stack's Milvus Lite server). Every search and query is filtered by patient id; there is no cross-patient call.

On Milvus Lite a write is an ``insert``, not an ``upsert``: Lite's upsert first reads each key's old row, and that
read takes the collection's maintenance lock, which Lite holds while it seals a segment or compacts (hundreds of
milliseconds on the hospital feed, every ``STAM_MILVUS_FLUSH_S``), so every write of the update stage waited out
each seal. Lite's insert of a key it holds replaces the row (the newest write wins; ``tests/integration/
test_milvus_lite_writes.py`` checks it on the installed Lite), so the two are the same write there. A Milvus
server keeps both rows of a key written twice by insert, so there it stays an upsert.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
from pymilvus import DataType, MilvusClient, MilvusException

from schemas import Store
from stam.backends.base import Hit, VectorRow, VectorStore
from stam.errors import StoreRejected
from stam.transport import milvus_client

log = logging.getLogger("stam.backends.milvus")

_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


_NOT_LOADED = 101
"""Milvus's code for a collection that is not loaded (``released``): what a restarted server answers a read with."""

T = TypeVar("T")


def literal(value: str) -> str:
    """A Milvus string literal for ``value``: quotes and backslashes escaped, so no value can break out of
    the expression. Milvus reads no ``\\u`` escapes, so other characters stay as they are, and a control
    character it cannot spell is refused (``StoreRejected``: the value's fault, not an outage)."""
    if any(ord(c) < 32 and c not in "\n\r\t" for c in value):
        raise StoreRejected("an id with a control character cannot be written in a Milvus filter")
    return '"' + "".join(_ESCAPES.get(c, c) for c in value) + '"'


def is_milvus_lite(client: MilvusClient) -> bool:
    """Whether ``client`` talks to Milvus Lite (in this process or its server), which names itself in its version
    (``milvus_lite-3.2.2``); a Milvus server answers ``v2.x``."""
    return str(client.get_server_version()).startswith("milvus_lite")


def _patient_filter(patient_id: str) -> str:
    return f"patient_id == {literal(patient_id)}"


def _scope(patient_id: str, store: Store) -> str:
    return f"{_patient_filter(patient_id)} and store == {literal(store.value)}"


class _LiteLacksAllocTimestamp(logging.Filter):
    """Milvus Lite's in-process gRPC server does not implement ``AllocTimestamp``, which pymilvus calls while it
    waits for a new collection's index; grpc logs the servicer's NotImplementedError with a traceback at ERROR,
    and pymilvus goes on without the timestamp (the collection is created and used as usual). That record, and
    only that one, is dropped: it reported nothing that failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, NotImplementedError):
            return True
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        return tb is None or tb.tb_frame.f_code.co_name != "AllocTimestamp"


_LITE_FILTER = _LiteLacksAllocTimestamp()


class MilvusVectorStore(VectorStore):
    def __init__(self, uri: str, *, dim: int, prefix: str = "stam", token: str = "") -> None:
        if uri.endswith(".db"):  # Milvus Lite in this process: its gRPC server logs here
            logging.getLogger("grpc._server").addFilter(_LITE_FILTER)  # once: a filter is kept once per logger
        self._client = milvus_client(uri, token=token)
        self._dim = dim
        self._name = f"{prefix}_memories"
        self._written = True  # since the last flush (a new client: what an earlier one wrote may be unsealed)
        self.lite = is_milvus_lite(self._client)
        """Milvus Lite (writes are inserts: see the module's docstring)."""
        self._ensure(self._name)

    def _ensure(self, name: str) -> None:
        if self._client.has_collection(name):
            # A collection found on disk after a restart (Milvus Lite) is 'released' until loaded; loading an
            # already loaded collection is a no-op.
            self._client.load_collection(name)
            return
        schema = self._client.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("memory_id", DataType.VARCHAR, is_primary=True, max_length=64)
        schema.add_field("patient_id", DataType.VARCHAR, max_length=256, is_partition_key=True)
        schema.add_field("store", DataType.VARCHAR, max_length=16)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=self._dim)
        index = self._client.prepare_index_params()
        index.add_index("vector", index_type="FLAT", metric_type="COSINE")
        self._client.create_collection(name, schema=schema, index_params=index)

    def _read(self, call: Callable[[], T]) -> T:
        """A read, reloading the collection once if the server forgot it was loaded.

        A Milvus server restarted under a running worker (a crash, a pod moved) comes back with the collection
        'released': every search and query fails with code 101 until someone loads it again, and without this
        the stage holding the partition would retry the same failure forever."""
        try:
            return call()
        except MilvusException as exc:
            if exc.code != _NOT_LOADED:
                raise
            log.warning("Milvus collection %s was released (server restarted?); loading it again", self._name)
            self._client.load_collection(self._name)
            return call()

    def place(self, patient_id: str, rows: Sequence[VectorRow]) -> None:
        if not rows:
            return
        write = self._client.insert if self.lite else self._client.upsert
        try:
            write(self._name, [
                {"memory_id": r.memory_id, "patient_id": patient_id, "store": r.store.value,
                 "vector": r.vector.tolist()}
                for r in rows
            ])
        finally:
            # Marked once the rows are in (or may be, after a failure): a seal that cleared the mark while they
            # were being written is followed by another round.
            self._written = True

    def search(self, patient_id: str, store: Store, vectors: np.ndarray, limit: int) -> list[list[Hit]]:
        if len(vectors) == 0:
            return []
        res = self._read(lambda: self._client.search(
            self._name, data=[v.tolist() for v in vectors], limit=limit,
            filter=_scope(patient_id, store), output_fields=["memory_id"],
            search_params={"metric_type": "COSINE"},
        ))
        return [[Hit(str(h["entity"]["memory_id"]), store, float(h["distance"])) for h in hits]
                for hits in res]

    def fetch(self, patient_id: str, store: Store) -> list[VectorRow]:
        rows: list[VectorRow] = []
        it = self._read(lambda: self._client.query_iterator(
            self._name, batch_size=1000, filter=_scope(patient_id, store),
            output_fields=["memory_id", "vector"],
        ))
        try:
            while batch := it.next():
                rows.extend(VectorRow(r["memory_id"], np.asarray(r["vector"], dtype=np.float32), store)
                            for r in batch)
        finally:
            it.close()
        return rows

    def fetch_ids(self, patient_id: str, memory_ids: Sequence[str]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        ids = list(dict.fromkeys(memory_ids))
        for lo in range(0, len(ids), 1000):
            chunk = ids[lo: lo + 1000]
            expr = f"{_patient_filter(patient_id)} and memory_id in {json.dumps(chunk)}"
            res = self._read(lambda expr=expr: self._client.query(  # type: ignore[misc]
                self._name, filter=expr, output_fields=["memory_id", "vector"]))
            out.update((str(r["memory_id"]), np.asarray(r["vector"], dtype=np.float32)) for r in res)
        return out

    def count(self, patient_id: str, store: Store) -> int:
        res = self._read(lambda: self._client.query(self._name, filter=_scope(patient_id, store),
                                                    output_fields=["count(*)"]))
        return int(res[0]["count(*)"]) if res else 0

    def delete(self, patient_id: str, memory_ids: Sequence[str]) -> int:
        gone = 0
        ids = list(dict.fromkeys(memory_ids))
        self._written = True
        for lo in range(0, len(ids), 1000):
            expr = f"{_patient_filter(patient_id)} and memory_id in {json.dumps(ids[lo: lo + 1000])}"
            res = self._client.delete(self._name, filter=expr)
            gone += int(res.get("delete_count", 0)) if isinstance(res, dict) else 0
        return gone

    def erase_patient(self, patient_id: str) -> int:
        self._written = True
        res = self._client.delete(self._name, filter=_patient_filter(patient_id))
        return int(res.get("delete_count", 0)) if isinstance(res, dict) else 0

    def flush(self) -> None:
        # Cleared first: a write made while the flush runs (the seal timer runs it off the stage thread) sets it
        # again, and the next round seals it.
        self._written = False
        try:
            self._client.flush(self._name)
        except BaseException:
            self._written = True
            raise

    def flush_own_writes(self) -> None:
        if self._written:
            self.flush()

    def close(self) -> None:
        self._client.close()
