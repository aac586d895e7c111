"""The Ray Serve application with the llama.cpp engine and the packaged Qwen2.5-Coder-0.5B on CPU:
OpenAI-compatible chat completions whose output is constrained by a JSON schema, on a real Synthea note."""

from __future__ import annotations

import base64
import json
import socket
import urllib.request
from typing import Any

import pytest

from tests.conftest import DATA

pytestmark = pytest.mark.integration
NOTES = DATA / "synthea-bulk-10p" / "DocumentReference.000.ndjson"
NOTE_ID = "0061f2c3-da54-f173-8dd4-84aec491b624"  # "# Medications: nitrofurantoin ...; ibuprofen 400 mg ..."


@pytest.fixture(scope="module")
def served() -> Any:
    pytest.importorskip("llama_cpp", reason="the llm extra is not installed (make setup installs it)")
    pytest.importorskip("ray.serve")
    from stam.llm.weights import WeightsError, ensure_gguf

    try:
        ensure_gguf("qwen2.5-coder-0.5b-instruct-q4_k_m")
    except WeightsError as exc:
        pytest.skip(str(exc))
    import ray
    from ray import serve

    from stam.serving.app import run
    from stam.serving.config import LlamaCppEngine, ServingConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
    assert isinstance(meds, list) and all(isinstance(m, str) for m in meds)
    lowered = text.lower()
    named = [m for m in meds if any(w in lowered for w in m.lower().split() if len(w) > 5)]
    assert named, f"none of {meds} appears in the note"
    assert result.prompt_tokens > 100 and result.completion_tokens > 0
    assert client.usage.calls == 1 and client.usage.prompt_tokens == result.prompt_tokens
    models = json.loads(urllib.request.urlopen(f"{served}/models", timeout=30).read())
    assert models["data"][0]["id"] == "qwen2.5-coder-0.5b-instruct-q4_k_m"
