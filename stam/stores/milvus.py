"""ACTIVE and HISTORY vectors in Milvus: one collection per store, patient id as partition key.

Works with a Milvus server (``http://host:19530``) or Milvus Lite (a local folder path). Every search
and query is filtered by patient id; there is no cross-patient call.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
from pymilvus import DataType, MilvusClient

from schemas import Store
from stam.stores.base import Hit, VectorRow, VectorStore


def _patient_filter(patient_id: str) -> str:
    # json.dumps quotes and escapes the id, so no id can break out of the expression.
    return f"patient_id == {json.dumps(patient_id)}"


class MilvusVectorStore(VectorStore):
    def __init__(self, uri: str, *, dim: int, prefix: str = "stam", token: str = "") -> None:
        self._client = MilvusClient(uri=uri, token=token) if token else MilvusClient(uri=uri)
        self._dim = dim
        self._names = {Store.ACTIVE: f"{prefix}_active", Store.HISTORY: f"{prefix}_history"}
        for name in self._names.values():
            self._ensure(name)

    def _ensure(self, name: str) -> None:
        if self._client.has_collection(name):
            return
        schema = self._client.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("memory_id", DataType.VARCHAR, is_primary=True, max_length=64)
        schema.add_field("patient_id", DataType.VARCHAR, max_length=256, is_partition_key=True)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=self._dim)
        index = self._client.prepare_index_params()
        index.add_index("vector", index_type="FLAT", metric_type="COSINE")
        self._client.create_collection(name, schema=schema, index_params=index)

    def place(self, patient_id: str, rows: Sequence[VectorRow]) -> None:
        for store, other in ((Store.ACTIVE, Store.HISTORY), (Store.HISTORY, Store.ACTIVE)):
            group = [r for r in rows if r.store is store]
            if not group:
                continue
            self._client.upsert(self._names[store], [
                {"memory_id": r.memory_id, "patient_id": patient_id, "vector": r.vector.tolist()}
                for r in group
            ])
            ids = json.dumps([r.memory_id for r in group])
            self._client.delete(
                self._names[other], filter=f"{_patient_filter(patient_id)} and memory_id in {ids}"
            )

    def search(self, patient_id: str, store: Store, vectors: np.ndarray, limit: int) -> list[list[Hit]]:
        if len(vectors) == 0:
            return []
        res = self._client.search(
            self._names[store], data=[v.tolist() for v in vectors], limit=limit,
            filter=_patient_filter(patient_id), output_fields=["memory_id"],
            search_params={"metric_type": "COSINE"},
        )
        return [[Hit(str(h["entity"]["memory_id"]), store, float(h["distance"])) for h in hits]
                for hits in res]

    def fetch(self, patient_id: str, store: Store) -> list[VectorRow]:
        rows: list[VectorRow] = []
        it = self._client.query_iterator(
            self._names[store], batch_size=1000, filter=_patient_filter(patient_id),
            output_fields=["memory_id", "vector"],
        )
        try:
            while batch := it.next():
                rows.extend(VectorRow(r["memory_id"], np.asarray(r["vector"], dtype=np.float32), store)
                            for r in batch)
        finally:
            it.close()
        return rows

    def count(self, patient_id: str, store: Store) -> int:
        res = self._client.query(self._names[store], filter=_patient_filter(patient_id),
                                 output_fields=["count(*)"])
        return int(res[0]["count(*)"]) if res else 0

    def erase_patient(self, patient_id: str) -> int:
        removed = 0
        for name in self._names.values():
            res = self._client.delete(name, filter=_patient_filter(patient_id))
            removed += int(res.get("delete_count", 0)) if isinstance(res, dict) else 0
        return removed

    def flush(self) -> None:
        for name in self._names.values():
            self._client.flush(name)

    def close(self) -> None:
        self._client.close()
