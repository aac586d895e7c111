"""The Ray Serve application with the llama.cpp engine and the packaged Qwen2.5-Coder-0.5B on CPU:
OpenAI-compatible chat completions whose output is constrained by a JSON schema, on a real Synthea note."""

from __future__ import annotations

import base64
import json
import re
import urllib.request
from typing import Any

import pytest

from stam.net import free_port
from tests.conftest import DATA

pytestmark = [pytest.mark.integration, pytest.mark.model]  # make test runs it alone, after the others (Makefile)
NOTES = DATA / "synthea-bulk-10p" / "DocumentReference.000.ndjson"
NOTE_ID = "0061f2c3-da54-f173-8dd4-84aec491b624"  # "# Medications: nitrofurantoin ...; ibuprofen 400 mg ..."


@pytest.fixture(scope="module")
def served() -> Any:
    pytest.importorskip("llama_cpp", reason="the llm extra is not installed (make setup installs it)")
    pytest.importorskip("ray.serve")
    from stam.errors import WeightsError
    from stam.llm.weights import ensure_gguf

    try:
        ensure_gguf("qwen2.5-coder-0.5b-instruct-q4_k_m")
    except WeightsError as exc:
        pytest.skip(str(exc))
    import ray
    from ray import serve

    from stam.serving.app import run
    from stam.serving.config import LlamaCppEngine, ServingConfig

    port = free_port()
    run(ServingConfig(engine=LlamaCppEngine(model_id="qwen2.5-coder-0.5b-instruct-q4_k_m", n_ctx=4096),
                      port=port), blocking=False, num_cpus=2)
    yield f"http://127.0.0.1:{port}/v1"
    serve.shutdown()
    ray.shutdown()


def test_schema_constrained_extraction_from_a_real_note(served: str) -> None:
    from stam.llm.client import LLMClient

    if not NOTES.is_file():
        pytest.skip(f"shared data not found at {NOTES}")
    note = next(json.loads(line) for line in NOTES.read_text().splitlines() if NOTE_ID in line)
    text = base64.b64decode(note["content"][0]["attachment"]["data"]).decode()
    schema = {"type": "object", "properties": {"medications": {"type": "array", "items": {"type": "string"},
                                                               "maxItems": 12}},
              "required": ["medications"]}
    client = LLMClient(served, "qwen2.5-coder-0.5b-instruct-q4_k_m", timeout_s=300, retries=1)
    result = client.chat([{"role": "system", "content": "Extract facts from the clinical note. Answer in JSON."},
                          {"role": "user", "content": f"List every medication in this note.\n\n{text}"}],
                         schema=schema, schema_name="medications", max_tokens=200)
    meds = json.loads(result.content)["medications"]  # the grammar guarantees the shape
    # ... and compact JSON, as vLLM's grammar gives (stam.serving.app.JSON_SPACE_RULE): no whitespace outside strings
    assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', '""', result.content)), result.content
    assert isinstance(meds, list) and all(isinstance(m, str) for m in meds)
    lowered = text.lower()
    named = [m for m in meds if any(w in lowered for w in m.lower().split() if len(w) > 5)]
    assert named, f"none of {meds} appears in the note"
    assert result.prompt_tokens > 100 and result.completion_tokens > 0
    assert client.usage.calls == 1 and client.usage.prompt_tokens == result.prompt_tokens
    models = json.loads(urllib.request.urlopen(f"{served}/models", timeout=30).read())
    assert models["data"][0]["id"] == "qwen2.5-coder-0.5b-instruct-q4_k_m"


MODEL_NOTE_ID = "00d2ed9f-74f9-2ca0-1b88-e711d800c300"  # 1998-11-30; "# Medications: lisinopril 10 mg ...;
MODEL_NOTE_PATIENT = "6a4160eb-a793-2f86-2302-378626f46cce"  # hydrochlorothiazide 25 mg oral tablet"


def _patient_files(tmp: Any) -> tuple[list[Any], str]:
    """The patient's conditions, orders and encounters up to the note's date, and the note itself, as NDJSON."""
    from stam.sources.fhir_ndjson import patient_lines

    bulk = DATA / "synthea-bulk-10p"
    selected = patient_lines(bulk, MODEL_NOTE_PATIENT, ("Condition", "MedicationRequest", "Encounter"), "1998-12-01")
    note_line = next(line for line in (bulk / "DocumentReference.000.ndjson").read_text().splitlines()
                     if MODEL_NOTE_ID in line)
    selected["DocumentReference"] = [note_line]
    note = json.loads(note_line)
    paths = []
    for rtype, keep in selected.items():
        path = tmp / f"{rtype}.000.ndjson"
        path.write_text("\n".join(keep) + "\n")
        paths.append(path)
    return paths, base64.b64decode(note["content"][0]["attachment"]["data"]).decode()


def test_a_real_note_is_decomposed_through_the_write_path(served: str, stack_settings: Any, tmp_path: Any) -> None:
    """The worker, pointed at the Ray Serve app (0.5B on CPU), decomposes a real Synthea note streamed
    through the broker after the patient's coded history: the medications the note names become memories
    of that patient with spans into the note, each note fact costs at most one link+update call, and
    nothing is dead-lettered."""
    import asyncio
    import urllib.request

    from stam.publish import publish_paths
    from tests.integration.broker import collect_outputs
    from tests.integration.conftest import _stam_process

    if not NOTES.is_file():
        pytest.skip(f"shared data not found at {NOTES}")
    paths, note_text = _patient_files(tmp_path)
    metrics_port = free_port()
    with _stam_process(stack_settings, "worker", "worker-llm.log", STAM_LLM_URL=served,
                       STAM_LLM_MODEL="qwen2.5-coder-0.5b-instruct-q4_k_m", STAM_LLM_CONCURRENCY="1",
                       STAM_METRICS_PORT=str(metrics_port)):
        summary = asyncio.run(publish_paths(stack_settings, paths))
        assert summary.dead_lettered == 0 and summary.sent > 20
        from stam.sources.fhir_ndjson import load_ndjson

        entries = load_ndjson(paths).entries
        note_entry = next(e for e in entries if e.source_ref == f"DocumentReference/{MODEL_NOTE_ID}")
        transitions, letters = asyncio.run(collect_outputs(stack_settings, {e.entry_id for e in entries}, timeout=900))
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    assert letters == []
    added = [t["memory"] for t in transitions if t["kind"] == "added" and t["entry_id"] == note_entry.entry_id]
    assert added and all(m["patient_id"] == MODEL_NOTE_PATIENT for m in added)
    assert all(m["category"] != "note" for m in added), "the note was kept verbatim, not decomposed"
    meds = " | ".join(m["text"].lower() for m in added if m["category"] == "medication")
    assert "lisinopril" in meds and "hydrochlorothiazide" in meds, meds
    for m in added:
        span = m["span"]
        if span is not None:  # each span points into the note at words of the fact
            quoted = note_text[span["start"]:span["end"]].lower()
            assert quoted and quoted.split()[0] in m["text"].lower()
    assert sum(m["span"] is not None for m in added) >= len(added) // 2
    # Cost: one extraction call for the note, at most one link+update call per note fact.
    calls = sum(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith('stam_llm_calls_total{outcome="ok"}'))
    assert 1 <= calls <= 1 + len(added), (calls, len(added))
    assert MODEL_NOTE_PATIENT not in metrics
    # Relations the model made point at memories of this patient that existed before the note.
    known = {t["memory_id"] for t in transitions if t["kind"] == "added"}
    for t in transitions:
        if t["entry_id"] == note_entry.entry_id:
            assert all(r["target_id"] in known for r in t["relations"])
