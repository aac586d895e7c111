"""LoRA adapters on the llama.cpp engine: an adapter from a tiny ``stam train lora`` run on real teacher traces
(tests/data/traces-tiny), converted to GGUF, served by name beside the base model through the project's Ray
Serve app, switched per request without leaking the adapter into the base model's answers."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from stam.net import free_port
from stam.serving.check import note_text

pytestmark = [pytest.mark.integration, pytest.mark.extras]
MODEL = "qwen2.5-coder-0.5b-instruct-q4_k_m"
TRACES = Path(__file__).resolve().parents[1] / "data" / "traces-tiny"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("llama_cpp", reason="the llm extra is not installed (make setup installs it)")
    pytest.importorskip("peft", reason="the train extra is not installed (make vllm-setup installs it)")
    from stam.errors import WeightsError
    from stam.llm.convert import ensure_hf
    from stam_lab.training.lora import Recipe, train

    try:
        base = ensure_hf(MODEL)
    except WeightsError as exc:
        pytest.skip(str(exc))
    report = train("extract", TRACES, base, tmp_path_factory.mktemp("adapter") / "tiny",
                   Recipe(batch_size=1, epochs=1, max_steps=2, learning_rate=1e-3), progress=False)
    import ray
    from ray import serve

    from stam.serving.app import run
    from stam.serving.config import LlamaCppEngine, ServingConfig

    port = free_port()
    run(ServingConfig(engine=LlamaCppEngine(model_id=MODEL, n_ctx=4096, loras={"tiny": report["adapter"]}),
                      port=port), blocking=False, num_cpus=2)
    yield f"http://127.0.0.1:{port}/v1", report
    serve.shutdown()
    ray.shutdown()


def test_a_trained_adapter_is_served_by_name_and_switched_per_request(served: tuple[str, Any]) -> None:
    from stam.llm.client import LLMClient
    from stam.reasoning import prompts

    url, report = served
    assert (Path(report["adapter"]) / "adapter.gguf").is_file()  # converted once, beside the adapter
    models = json.loads(urllib.request.urlopen(f"{url}/models", timeout=30).read())
    assert [m["id"] for m in models["data"]] == [MODEL, "tiny"]

    messages = prompts.extract_messages(note_text())
    schema = prompts.schema(prompts.Extraction)

    def ask(model: str) -> Any:
        return LLMClient(url, model, timeout_s=600, retries=0).chat(messages, schema=schema,
                                                                    schema_name="Extraction", max_tokens=120)

    first = ask(MODEL)
    tuned = ask("tiny")
    again = ask(MODEL)
    assert tuned.content != first.content
    assert again.content == first.content  # the adapter is off again, and no prefix evaluated with it is reused
    assert tuned.prompt_tokens == first.prompt_tokens > 300


def test_a_teacher_run_stopped_by_sigterm_keeps_its_plan_and_says_how_to_go_on(
        served: tuple[str, Any], tmp_path: Path) -> None:
    """`stam train traces` against the served model (as an OpenAI-compatible teacher), stopped with SIGTERM once
    its first trace is written: the entries in flight finish, one line names --resume, exit status 130, and the
    plan stays for --resume."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import DATA

    url, _ = served
    out = tmp_path / "traces"
    env = dict(os.environ, STAM_SHARED_DATA=str(DATA))
    proc = subprocess.Popen(
        [sys.executable, "-m", "stam.cli", "train", "traces", "--teacher-url", url, "--teacher-model", MODEL,
         "--notes", "4", "--per-patient", "2", "--out", str(out)],
        cwd=Path(__file__).resolve().parents[2], env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ((out / "all.jsonl").is_file() and (out / "all.jsonl").stat().st_size) and proc.poll() is None:
            assert time.monotonic() < deadline, "no trace written in 300 s"
            time.sleep(1)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    # (Milvus Lite logs a harmless grpc traceback of its own, AllocTimestamp; the signal must not end in one)
    assert "stopped" in err and "--resume" in err and "KeyboardInterrupt" not in err, err[-4000:]
    assert (out / "plan.json").is_file()
