"""Serving configuration (the vLLM path cannot run here: its config is what is tested), the OpenAI
response_format translation for llama.cpp, the client's request body, and the weights registry."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from stam.errors import WeightsError
from stam.llm.client import LLMClient
from stam.llm.weights import MODELS, ensure_gguf
from stam.serving.config import Autoscaling, LlamaCppEngine, ServingConfig, VllmEngine, vllm_llm_config_kwargs


def test_vllm_engine_maps_to_ray_serve_llm_config() -> None:
    engine = VllmEngine(model_id="qwen", model_source="/models/qwen", accelerator_type="A100",
                        autoscaling=Autoscaling(min_replicas=2, max_replicas=8, target_ongoing_requests=32),
                        tensor_parallel_size=2)
    kw = vllm_llm_config_kwargs(engine)
    assert kw["accelerator_type"] == "A100"
    assert kw["model_loading_config"] == {"model_id": "qwen", "model_source": "/models/qwen"}
    assert kw["deployment_config"]["autoscaling_config"] == {"min_replicas": 2, "max_replicas": 8,
                                                             "target_ongoing_requests": 32}
    assert kw["engine_kwargs"]["tensor_parallel_size"] == 2
    assert kw["engine_kwargs"]["guided_decoding_backend"] == "xgrammar"


def test_serving_config_is_strict_and_discriminated() -> None:
    cfg = ServingConfig.model_validate({"engine": {"kind": "vllm", "accelerator_type": "A100"}, "port": 8001})
    assert isinstance(cfg.engine, VllmEngine)
    assert isinstance(ServingConfig().engine, LlamaCppEngine)
    with pytest.raises(ValidationError):
        ServingConfig.model_validate({"engine": {"kind": "vllm", "acelerator_type": "A100"}})
    with pytest.raises(ValidationError):
        Autoscaling(min_replicas=4, max_replicas=2)


def test_response_format_translation_for_llama_cpp() -> None:
    from stam.serving.app import _llama_response_format

    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert _llama_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}) == {
        "type": "json_object", "schema": schema}
    assert _llama_response_format(None) is None and _llama_response_format({"type": "text"}) is None
    with pytest.raises(ValueError, match="unsupported"):
        _llama_response_format({"type": "regex"})


def test_client_sends_the_schema_as_strict_json_schema() -> None:
    body = LLMClient("http://x/v1", "m").body([{"role": "user", "content": "hi"}], schema={"type": "object"},
                                              schema_name="facts", max_tokens=64, temperature=0)
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "facts", "schema": {"type": "object"}, "strict": True}}


def test_weights_registry() -> None:
    assert MODELS["qwen2.5-coder-0.5b-instruct-q4_k_m"].size == 491_400_064
    with pytest.raises(WeightsError, match="unknown model"):
        ensure_gguf("no-such-model")
