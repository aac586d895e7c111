"""Typed configuration of the serving application (both engines).

The vLLM engine cannot run on this machine (no GPU); its configuration is typed and tested, and
:func:`vllm_llm_config_kwargs` produces exactly the keyword arguments given to Ray Serve's
``ray.serve.llm.LLMConfig`` on a GPU cluster (that import needs vLLM installed, so it happens only there).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Autoscaling(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=4, ge=1)
    target_ongoing_requests: int = Field(default=16, ge=1)

    @model_validator(mode="after")
    def _order(self) -> Autoscaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas < min_replicas")
        return self


class VllmEngine(BaseModel):
    """vLLM replicas on GPUs (production)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["vllm"] = "vllm"
    model_id: str = Field(default="qwen2.5-7b-instruct", description="Name clients send as 'model'")
    model_source: str = Field(default="Qwen/Qwen2.5-7B-Instruct", description="HF id or a local/S3 path")
    accelerator_type: str = Field(default="A100")
    tensor_parallel_size: int = Field(default=1, ge=1)
    max_model_len: int = Field(default=16384, ge=512)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    autoscaling: Autoscaling = Autoscaling()
    max_ongoing_requests: int = Field(default=64, ge=1)
    guided_decoding_backend: str = Field(default="xgrammar", description="Enforces response_format json_schema")


class LlamaCppEngine(BaseModel):
    """A llama.cpp replica on CPU (this machine, and CPU-only sites)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["llamacpp"] = "llamacpp"
    model_id: str = Field(default="qwen2.5-coder-1.5b-instruct-q4_k_m")
    gguf: str = Field(default="", description="Path of the GGUF file; empty: join the packaged parts of model_id")
    n_ctx: int = Field(default=8192, ge=512)
    n_threads: int = Field(default=2, ge=1)
    replicas: int = Field(default=1, ge=1)
    num_cpus: float = Field(default=1.0, gt=0, description="Ray logical CPUs reserved per replica")


class ServingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: VllmEngine | LlamaCppEngine = Field(default_factory=LlamaCppEngine, discriminator="kind")
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    route_prefix: str = "/"


def vllm_llm_config_kwargs(engine: VllmEngine) -> dict[str, Any]:
    """Keyword arguments of ``ray.serve.llm.LLMConfig`` for the vLLM engine (Ray Serve's LLM integration)."""
    return {
        "model_loading_config": {"model_id": engine.model_id, "model_source": engine.model_source},
        "accelerator_type": engine.accelerator_type,
        "deployment_config": {
            "autoscaling_config": {
                "min_replicas": engine.autoscaling.min_replicas,
                "max_replicas": engine.autoscaling.max_replicas,
                "target_ongoing_requests": engine.autoscaling.target_ongoing_requests,
            },
            "max_ongoing_requests": engine.max_ongoing_requests,
        },
        "engine_kwargs": {
            "tensor_parallel_size": engine.tensor_parallel_size,
            "max_model_len": engine.max_model_len,
            "gpu_memory_utilization": engine.gpu_memory_utilization,
            "guided_decoding_backend": engine.guided_decoding_backend,
        },
    }
