"""The vLLM engine end to end whenever vLLM is installed (``make vllm-setup``; ``.ci/run`` installs it): the
project's Ray Serve app holding vLLM's async engine on the packaged 0.5B (converted to safetensors), LoRA
adapters served by name (an untrained one, and one from a tiny ``stam train lora`` run on real teacher traces),
structured output the model reasoner validates, and the server's refusals.

The traces (tests/data/traces-tiny) are a real ``stam train traces`` run: the packaged 0.5B as teacher over four
Synthea notes of two patients (``--notes 4 --per-patient 2 --val-fraction 0.5``), 29 traces."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from stam.net import free_port
from stam.serving.check import NOTE_ID, note_text

pytestmark = [pytest.mark.integration, pytest.mark.extras]
MODEL = "qwen2.5-coder-0.5b-instruct-q4_k_m"
TRACES = Path(__file__).resolve().parents[1] / "data" / "traces-tiny"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from stam.serving.options import installed_vllm_device

    if installed_vllm_device() is None:
        pytest.skip("vLLM is not installed (make vllm-setup installs the CPU build; .ci/run does)")
    pytest.importorskip("peft", reason="the train extra is not installed (make vllm-setup installs it)")
    from stam.errors import WeightsError
    from stam.llm.convert import ensure_hf
    from stam.serving.adapters import untrained_adapter

    try:
        base = ensure_hf(MODEL)
    except WeightsError as exc:
        pytest.skip(str(exc))
    adapter = untrained_adapter(base, tmp_path_factory.mktemp("adapter") / "extract", seed=7)
    # A tiny training run (two optimiser steps, a high learning rate so that two steps move the greedy output).
    from stam_lab.training.lora import Recipe, train

    report = train("extract", TRACES, base, tmp_path_factory.mktemp("adapter") / "tiny",
                   Recipe(batch_size=1, epochs=1, max_steps=2, learning_rate=1e-3), progress=False)
    assert report["steps"] == 2 and report["train_traces"] == 2 and report["val_traces"] == 2
    assert report["history"][0]["val_loss"] is not None and report["history"][-1]["val_loss"] is not None
    import ray
    from ray import serve

    from stam.serving.app import run
    from stam.serving.config import ServingConfig, VllmEngine

    port = free_port()
    engine = VllmEngine(model_id=MODEL, model_source="", device=installed_vllm_device(), enforce_eager=True,
                        max_model_len=4096, dtype="bfloat16", loras={"extract": str(adapter), "tiny": report["adapter"]},
                        autoscaling={"min_replicas": 1, "max_replicas": 1})
    run(ServingConfig(engine=engine, port=port), blocking=False, num_cpus=2)
    yield f"http://127.0.0.1:{port}/v1", report
    serve.shutdown()
    ray.shutdown()


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_the_reasoner_gets_validated_facts_from_vllm_and_the_adapter_changes_them(served: tuple[str, Any]) -> None:
    from schemas import RecordEntry
    from stam.llm.client import LLMClient
    from stam.reasoning import prompts
    from stam.reasoning.language_model import ModelReasoner

    url, _ = served
    text = note_text()
    entry = RecordEntry.model_validate({"entry_id": f"note-{NOTE_ID}", "patient_id": "vllm-test-patient",
                                        "source": "fhir-r4", "source_ref": f"DocumentReference/{NOTE_ID}",
                                        "resource_type": "DocumentReference", "text": text,
                                        "recorded_at": "2020-01-01T00:00:00Z", "effective_at": "2020-01-01T00:00:00Z"})
    base = ModelReasoner(LLMClient(url, MODEL, timeout_s=600, retries=0), extract_max_tokens=600)
    memories = base.extract(entry)
    names = " ".join(m.text.lower() for m in memories)
    assert base.stats.facts >= 2, memories
    assert "ibuprofen" in names or "nitrofurantoin" in names, names
    assert base.usage["extraction"].completion_tokens > 0

    # The same request through the adapter: still a reply the schema and the model accept, and not the same.
    messages = prompts.extract_messages(text)
    body = LLMClient(url, "extract").body(messages, schema=prompts.schema(prompts.Extraction),
                                            schema_name="Extraction", max_tokens=500, temperature=0)
    status, tuned = _post(f"{url}/chat/completions", body)
    assert status == 200, tuned
    assert tuned["model"] == "extract"
    if tuned["choices"][0]["finish_reason"] == "stop":  # a reply cut at max_tokens is a valid prefix only
        prompts.Extraction.model_validate_json(tuned["choices"][0]["message"]["content"])
    status, plain = _post(f"{url}/chat/completions", {**body, "model": MODEL})
    assert status == 200
    assert plain["choices"][0]["message"]["content"] != tuned["choices"][0]["message"]["content"]
    assert tuned["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] > 300
    # Compact JSON (the engine's structured-outputs config): no pretty-printing newlines paid for token by token.
    assert "\n" not in plain["choices"][0]["message"]["content"], plain["choices"][0]["message"]["content"][:200]

    # The adapter of the tiny training run: loaded by name, and its greedy answer is not the base model's.
    status, trained = _post(f"{url}/chat/completions", {**body, "model": "tiny"})
    assert status == 200 and trained["model"] == "tiny"
    assert trained["choices"][0]["message"]["content"] != plain["choices"][0]["message"]["content"]


def test_a_trained_adapter_records_its_patients_and_recipe(served: tuple[str, Any]) -> None:
    from stam.serving.adapters import read_meta

    _, report = served
    meta = read_meta(Path(report["adapter"]))
    manifest = json.loads((TRACES / "manifest.json").read_text())
    assert meta["trained"] is True and meta["module"] == "extract" and meta["base"] == MODEL
    assert meta["patients"] == manifest["splits"]["train"]["patients"]
    assert meta["validation_patients"] == manifest["splits"]["val"]["patients"]
    assert meta["recipe"]["rank"] == 32 and meta["recipe"]["alpha"] == 64 and meta["recipe"]["dropout"] == 0.05
    assert report["seconds_per_step"] > 0 and report["peak_rss_mb"] > 0


def test_models_lists_the_adapters_and_bad_requests_are_refused(served: tuple[str, Any]) -> None:
    url, _ = served
    models = json.loads(urllib.request.urlopen(f"{url}/models", timeout=30).read())
    assert [m["id"] for m in models["data"]] == [MODEL, "extract", "tiny"]
    assert models["data"][1]["parent"] == MODEL
    hello = [{"role": "user", "content": "Say hello."}]
    status, err = _post(f"{url}/chat/completions", {"model": "link", "messages": hello})
    assert status == 404 and "not served here" in err["detail"]
    status, err = _post(f"{url}/chat/completions", {"model": MODEL, "messages": hello,
                                                       "response_format": {"type": "regex"}})
    assert status == 400 and "unsupported response_format" in err["detail"]
    status, err = _post(f"{url}/chat/completions", {"model": MODEL, "messages": []})
    assert status == 400
    status, ok = _post(f"{url}/chat/completions", {"model": MODEL, "messages": hello, "max_tokens": 8})
    assert status == 200 and 0 < ok["usage"]["completion_tokens"] <= 8
    assert ok["choices"][0]["finish_reason"] in ("length", "stop")


def test_an_adapter_folder_is_checked_on_the_command_line(tmp_path: Path) -> None:
    import argparse

    from stam.errors import ServeOptionError
    from stam.serving.options import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ServeOptionError, match="not a peft adapter folder"):
        config_from_args(p.parse_args(["--engine", "vllm", "--lora", f"extract={tmp_path}"]))
