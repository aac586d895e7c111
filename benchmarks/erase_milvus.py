"""What erasing one patient from Milvus Lite costs, and whether the bytes go: N patients x M vectors (384-d) in a
Milvus Lite file, then one patient erased as ``stam erase`` does (delete, flush, collection rewritten). Prints
JSON: seconds per step, and whether the id is still in any file after delete+flush and after the rewrite.

    python -m benchmarks.erase_milvus --patients 100 --vectors 1000
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from schemas import Store
from stam.backends.base import VectorRow
from stam.backends.milvus import MilvusVectorStore
from stam.config import Settings
from stam.erase import Report, erase_milvus, parquet_strings
from stam.transport import local_redis_client, stop_local_redis
from stam_lab.eval.provenance import stamp


def _holds(root: Path, needle: bytes) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file() and (
        needle in p.read_bytes() or any(needle in s for s in parquet_strings(p))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--patients", type=int, default=100)
    ap.add_argument("--vectors", type=int, default=1000, help="per patient")
    ap.add_argument("--dim", type=int, default=384)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="stam-erase-bench-") as tmp:
        uri = str(Path(tmp) / "milvus.db")
        store = MilvusVectorStore(uri, dim=args.dim)
        t0 = time.perf_counter()
        for p in range(args.patients):
            pid = f"patient-{p:05d}-bench"
            store.place(pid, [VectorRow(f"m-{p}-{i}", rng.random(args.dim).astype(np.float32),
                                        Store.ACTIVE if i % 3 else Store.HISTORY) for i in range(args.vectors)])
            if p % 10 == 9:
                store.flush()
        store.flush()
        load_s = time.perf_counter() - t0
        target = "patient-00042-bench" if args.patients > 42 else "patient-00000-bench"
        t0 = time.perf_counter()
        store.erase_patient(target)
        store.flush()
        delete_s = time.perf_counter() - t0
        after_delete = _holds(Path(uri), target.encode())
        store.close()
        client = local_redis_client(Path(tmp) / "redis.rdb")
        report = Report()
        t0 = time.perf_counter()
        erase_milvus(Settings(home=Path(tmp), milvus_uri=uri), target, client, report)
        erase_s = time.perf_counter() - t0
        after_rewrite = _holds(Path(uri), target.encode())
        size = sum(p.stat().st_size for p in Path(uri).rglob("*") if p.is_file())
        stop_local_redis(client)
        print(json.dumps(stamp({"patients": args.patients, "vectors_per_patient": args.vectors, "dim": args.dim,
                          "rows": args.patients * args.vectors, "data_dir_bytes_after": size,
                          "load_seconds": round(load_s, 2), "delete_flush_seconds": round(delete_s, 3),
                          "files_holding_id_after_delete_flush": after_delete,
                          "erase_seconds_delete_flush_rewrite": round(erase_s, 2),
                          "files_holding_id_after_rewrite": after_rewrite, "step": report.steps["milvus"]})))


if __name__ == "__main__":
    main()
