"""Serving configuration (vLLM engine arguments and replica options; the engine itself runs in
tests/integration/test_vllm_engine.py), the OpenAI request translation for both engines, the client's request
body, and the weights registry."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from stam.errors import WeightsError
from stam.llm.client import LLMClient
from stam.llm.weights import MODELS, ensure_gguf
from stam.serving.config import (
    Autoscaling,
    LlamaCppEngine,
    ServingConfig,
    VllmEngine,
    vllm_deployment_options,
    vllm_engine_kwargs,
)


def test_vllm_engine_maps_to_engine_args_and_replica_options() -> None:
    engine = VllmEngine(model_id="qwen", model_source="/models/qwen", accelerator_type="A100",
                        autoscaling=Autoscaling(min_replicas=2, max_replicas=8, target_ongoing_requests=32),
                        tensor_parallel_size=2, loras={"extract": "/adapters/extract"})
    kw = vllm_engine_kwargs(engine, "/models/qwen")
    assert kw["model"] == "/models/qwen" and kw["served_model_name"] == "qwen"
    assert kw["tensor_parallel_size"] == 2 and kw["gpu_memory_utilization"] == 0.9
    assert (kw["enable_lora"], kw["max_loras"], kw["max_lora_rank"]) == (True, 1, 32)
    # Compact JSON is an engine setting in vLLM 0.32 (its xgrammar backend ignores the per-request field).
    assert kw["structured_outputs_config"] == {"backend": "xgrammar", "disable_any_whitespace": True}
    opts = vllm_deployment_options(engine)
    assert opts["autoscaling_config"] == {"min_replicas": 2, "max_replicas": 8, "target_ongoing_requests": 32}
    assert opts["ray_actor_options"]["num_gpus"] == 2 and opts["ray_actor_options"]["accelerator_type"] == "A100"
    assert opts["ray_actor_options"]["runtime_env"] == {"env_vars": {}}
    cpu = VllmEngine(model_id="m", model_source="", device="cpu", cpu_kvcache_gib=3)
    cpu_kw = vllm_engine_kwargs(cpu, "/p")
    assert "gpu_memory_utilization" not in cpu_kw and "enable_lora" not in cpu_kw
    cpu_opts = vllm_deployment_options(cpu)["ray_actor_options"]
    assert "num_gpus" not in cpu_opts
    assert cpu_opts["runtime_env"]["env_vars"] == {"VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_CPU_OMP_THREADS_BIND": "auto",
                                                   "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    with pytest.raises(ValidationError, match="adapter names"):
        VllmEngine(model_id="m", loras={"m": "/a"})
    with pytest.raises(ValidationError, match="adapter names"):
        VllmEngine(model_id="m", loras={"a:b": "/a"})


def test_vllm_request_translation() -> None:
    from stam.serving.vllm_app import sampling_kwargs, structured

    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert structured({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}) == {"json": schema}
    assert structured({"type": "json_object"}) == {"json_object": True}
    assert structured(None) is None and structured({"type": "text"}) is None
    with pytest.raises(ValueError, match="unsupported"):
        structured({"type": "regex"})
    with pytest.raises(ValueError, match="must be a JSON object"):
        structured({"type": "json_schema", "json_schema": {"name": "x"}})
    assert sampling_kwargs({"max_tokens": 7, "repetition_penalty": 1.1, "seed": 3}) == {
        "max_tokens": 7, "temperature": 0.0, "repetition_penalty": 1.1, "seed": 3}
    with pytest.raises(ValueError, match="at least 1"):
        sampling_kwargs({"max_tokens": -2})


def test_serve_options_pick_the_engine_the_model_and_its_source(tmp_path: Path) -> None:
    import argparse

    from stam.errors import ServeOptionError
    from stam.serving.options import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--engine", "vllm", "--device", "cpu", "--eager"]))
    assert isinstance(cfg.engine, VllmEngine)
    assert (cfg.engine.model_id, cfg.engine.model_source) == ("qwen2.5-coder-0.5b-instruct-q4_k_m", "")
    assert (cfg.engine.max_model_len, cfg.engine.dtype, cfg.engine.enforce_eager) == (4096, "bfloat16", True)
    gpu = config_from_args(p.parse_args(["--engine", "vllm", "--device", "gpu"])).engine
    assert isinstance(gpu, VllmEngine)
    assert (gpu.model_source, gpu.autoscaling.max_replicas) == ("Qwen/Qwen2.5-7B-Instruct", 4)
    with pytest.raises(ServeOptionError, match="give --model-source"):
        config_from_args(p.parse_args(["--engine", "vllm", "--model", "mine"]))
    with pytest.raises(ServeOptionError, match="NAME=PATH"):
        config_from_args(p.parse_args(["--engine", "vllm", "--lora", "extract"]))
    with pytest.raises(ServeOptionError, match="not a peft adapter folder"):
        config_from_args(p.parse_args(["--lora", "a=/b"]))
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    llama = config_from_args(p.parse_args(["--lora", f"extract={tmp_path / 'a.gguf'}"])).engine
    assert isinstance(llama, LlamaCppEngine) and llama.loras == {"extract": str(tmp_path / "a.gguf")}
    with pytest.raises(ServeOptionError, match="adapter names must differ"):
        config_from_args(p.parse_args(["--lora", f"qwen2.5-coder-1.5b-instruct-q4_k_m={tmp_path / 'a.gguf'}"]))


def test_serving_config_is_strict_and_discriminated() -> None:
    cfg = ServingConfig.model_validate({"engine": {"kind": "vllm", "accelerator_type": "A100"}, "port": 8001})
    assert isinstance(cfg.engine, VllmEngine)
    assert isinstance(ServingConfig().engine, LlamaCppEngine)
    with pytest.raises(ValidationError):
        ServingConfig.model_validate({"engine": {"kind": "vllm", "acelerator_type": "A100"}})
    with pytest.raises(ValidationError):
        Autoscaling(min_replicas=4, max_replicas=2)


def test_response_format_translation_for_llama_cpp() -> None:
    from llama_cpp.llama_grammar import LlamaGrammar

    from stam.serving.app import _llama_constraint

    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    for fmt in ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                {"type": "json_object", "schema": schema}):
        assert isinstance(_llama_constraint(fmt)["grammar"], LlamaGrammar)
    assert _llama_constraint({"type": "json_object"}) == {"response_format": {"type": "json_object"}}
    assert _llama_constraint(None) == {} and _llama_constraint({"type": "text"}) == {}
    with pytest.raises(ValueError, match="unsupported"):
        _llama_constraint({"type": "regex"})


def test_the_llama_cpp_json_grammar_is_compact_as_vllms() -> None:
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    from stam.reasoning import prompts
    from stam.serving.app import json_grammar

    schema = prompts.judgement_schema(2)
    bundled, ours = json_schema_to_gbnf(json.dumps(schema)), json_grammar(schema)
    assert 'space ::= " "?' in bundled.splitlines()  # what llama-cpp-python writes: one optional space
    spaces = [line for line in ours.splitlines() if line.startswith("space ::=")]
    assert spaces == ['space ::= ""']  # none, as vLLM's xgrammar with disable_any_whitespace
    # everything else as the bundled converter writes it (the enum of CURRENT numbers included)
    assert [x for x in ours.splitlines() if x not in spaces] == [x for x in bundled.splitlines() if x != 'space ::= " "?']
    assert 'Link-n ::= "1" | "2"' in ours


def test_client_sends_the_schema_as_strict_json_schema() -> None:
    body = LLMClient("http://x/v1", "m").body([{"role": "user", "content": "hi"}], schema={"type": "object"},
                                              schema_name="facts", max_tokens=64, temperature=0)
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "facts", "schema": {"type": "object"}, "strict": True}}


def test_weights_registry() -> None:
    assert MODELS["qwen2.5-coder-0.5b-instruct-q4_k_m"].size == 491_400_064
    with pytest.raises(WeightsError, match="unknown model"):
        ensure_gguf("no-such-model")


def test_a_cancelled_request_holds_the_llama_context_until_its_generation_ends() -> None:
    """A client that times out and retries: the retry must not decode on the replica's one llama.cpp context while
    the abandoned generation still runs in its thread (llama.cpp aborts the replica: GGML_ASSERT)."""
    import asyncio
    import threading
    import time

    from stam.serving.app import _finish_even_if_cancelled

    running: list[str] = []
    overlaps: list[str] = []
    guard = threading.Lock()

    def generate(tag: str) -> str:
        with guard:
            running.append(tag)
            if len(running) > 1:
                overlaps.append(tag)
        time.sleep(0.3)
        with guard:
            running.remove(tag)
        return tag

    async def main() -> None:
        lock = asyncio.Lock()

        async def request(tag: str) -> str:
            async with lock:
                return await _finish_even_if_cancelled(asyncio.ensure_future(asyncio.to_thread(generate, tag)))

        first = asyncio.create_task(request("abandoned"))
        await asyncio.sleep(0.05)
        first.cancel()
        assert await request("retry") == "retry"
        with pytest.raises(asyncio.CancelledError):
            await first

    asyncio.run(main())
    assert overlaps == []


class _FakeRay:
    """``ray.init`` that fails with ``errors`` in turn, then starts; records init and shutdown calls."""

    def __init__(self, *errors: Exception) -> None:
        self.errors, self.calls = list(errors), []

    def init(self, **options: object) -> None:
        self.calls.append("init")
        if self.errors:
            raise self.errors.pop(0)

    def shutdown(self) -> None:
        self.calls.append("shutdown")


TIMED_OUT = Exception("The current node timed out during startup. This could happen because some of the raylet failed "
                      "to startup or the GCS has become overloaded.")


GCS_LATE = RuntimeError("Timed out waiting for file /tmp/ray/session_2026-11-28_14-40-11_664163_2604/gcs_server_port_"
                        "778bad3bbfe04a554540b4460a2b5a1270fe313d2dee8db83dde414c")


def test_ray_is_started_again_when_its_node_times_out_during_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from stam.serving import app

    fake = _FakeRay(TIMED_OUT, GCS_LATE)
    monkeypatch.setitem(sys.modules, "ray", fake)
    app.start_ray(num_cpus=2)
    assert fake.calls == ["init", "shutdown", "init", "shutdown", "init"]


def test_ray_start_gives_up_after_its_attempts_and_other_failures_are_raised_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from stam.serving import app

    fake = _FakeRay(*[TIMED_OUT] * app.RAY_START_ATTEMPTS)
    monkeypatch.setitem(sys.modules, "ray", fake)
    with pytest.raises(Exception, match="timed out during startup"):
        app.start_ray()
    assert fake.calls.count("init") == app.RAY_START_ATTEMPTS
    other = _FakeRay(ValueError("num_cpus must be positive"))
    monkeypatch.setitem(sys.modules, "ray", other)
    with pytest.raises(ValueError):
        app.start_ray(num_cpus=-1)
    assert other.calls == ["init"]
