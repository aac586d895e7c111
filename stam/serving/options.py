"""Command-line options of the serving application, shared by ``stam serve`` and ``python -m stam.serving``."""

from __future__ import annotations

import argparse
import importlib.metadata
from pathlib import Path
from typing import Literal

from pydantic import ValidationError

from stam.errors import ServeOptionError
from stam.serving.config import Autoscaling, LlamaCppEngine, ServingConfig, VllmEngine

DEFAULT_CPU_MODEL = "qwen2.5-coder-1.5b-instruct-q4_k_m"
DEFAULT_VLLM_CPU_MODEL = "qwen2.5-coder-0.5b-instruct-q4_k_m"
DEFAULT_VLLM_GPU_MODEL = ("qwen2.5-7b-instruct", "Qwen/Qwen2.5-7B-Instruct")


def installed_vllm_device() -> str | None:
    """Which vLLM build is installed: ``cpu`` (vllm-cpu), ``gpu`` (vllm), or None."""
    for dist, device in (("vllm-cpu", "cpu"), ("vllm", "gpu")):
        try:
            importlib.metadata.version(dist)
            return device
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=["llamacpp", "vllm"], default="llamacpp",
                   help="llamacpp: CPU, packaged GGUF weights (default); vllm: vLLM replicas (GPU, or CPU with "
                   "the vllm-cpu build: make vllm-setup)")
    p.add_argument("--model", default=None,
                   help=f"model id clients send as 'model'. llamacpp: {DEFAULT_CPU_MODEL} (default) or "
                   f"{DEFAULT_VLLM_CPU_MODEL}; vllm: a packaged model name (converted once to safetensors; default "
                   f"{DEFAULT_VLLM_CPU_MODEL} on CPU) or any name with --model-source "
                   f"(default on GPU {DEFAULT_VLLM_GPU_MODEL[0]})")
    p.add_argument("--model-source", default=None, help="vllm: HF id or a local folder of the weights")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve a peft adapter folder under NAME (repeatable); a request names it as 'model' "
                   "(llamacpp: converted to GGUF once; a .gguf adapter file also works)")
    p.add_argument("--gguf", default="", help="llamacpp: a GGUF path instead of the packaged weights")
    p.add_argument("--threads", type=int, default=2, help="llamacpp: CPU threads of the replica (default 2)")
    p.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto",
                   help="vllm: auto follows the installed build (vllm-cpu: cpu, vllm: gpu)")
    p.add_argument("--eager", action="store_true",
                   help="vllm: no graph capture / compilation (starts in ~30 s on CPU instead of ~3 min)")
    p.add_argument("--max-model-len", type=int, default=None, help="vllm: context length (default 16384; "
                   "4096 on CPU)")
    p.add_argument("--accelerator", default="A100", help="vllm on GPU: Ray accelerator type")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm on GPU: GPUs per replica")
    p.add_argument("--min-replicas", type=int, default=1, help="vllm: autoscaling floor")
    p.add_argument("--max-replicas", type=int, default=None, help="vllm: autoscaling ceiling (default 4 on GPU, "
                   "1 on CPU)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")


def parse_loras(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ServeOptionError(f"--lora {item!r}: expected NAME=PATH")
        if name in out:
            raise ServeOptionError(f"--lora {name}: given twice")
        folder = Path(path).expanduser()
        gguf_file = folder.suffix == ".gguf" and folder.is_file()
        if not gguf_file and not (folder / "adapter_config.json").is_file():
            raise ServeOptionError(f"--lora {name}: {folder} is not a peft adapter folder (no adapter_config.json)")
        out[name] = str(folder.resolve())
    return out


def local_engine(engine: str, model: str, *, n_ctx: int = 4096,
                 loras: dict[str, str] | None = None) -> LlamaCppEngine | VllmEngine:
    """The engine a benchmark or ``stam train traces`` starts in-process for a packaged model: its weights made
    ready first (GGUF joined, or converted once to safetensors for vLLM; ``WeightsError`` if missing), vLLM
    eager on the installed build's device with one replica."""
    # deferred: stam.llm.weights (kept off `stam --help`)
    from stam.llm.weights import ensure_gguf

    if engine == "vllm":
        device = installed_vllm_device()
        if device is None:
            raise ServeOptionError("--engine vllm: vLLM is not installed here (make vllm-setup)")
        # deferred: stam.llm.convert (kept off `stam --help`)
        from stam.llm.convert import ensure_hf

        ensure_hf(model)
        return VllmEngine(model_id=model, model_source="", device="cpu" if device == "cpu" else "gpu",
                          enforce_eager=True, max_model_len=n_ctx, dtype="bfloat16", loras=loras or {},
                          autoscaling=Autoscaling(min_replicas=1, max_replicas=1))
    ensure_gguf(model)
    return LlamaCppEngine(model_id=model, n_ctx=n_ctx, loras=loras or {})


def _one_line(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(map(str, err["loc"]))
    return (f"{where}: " if where else "") + str(err["msg"]).removeprefix("Value error, ")


def config_from_args(args: argparse.Namespace) -> ServingConfig:
    """The serving configuration the options describe (``ServeOptionError`` for a mistake in them)."""
    engine: LlamaCppEngine | VllmEngine
    if args.engine == "vllm":
        wanted = installed_vllm_device() if args.device == "auto" else args.device
        device: Literal["gpu", "cpu"] = "cpu" if wanted == "cpu" else "gpu"
        # deferred: stam.llm.weights (kept off `stam --help`)
        from stam.llm.weights import MODELS

        model = args.model or (DEFAULT_VLLM_CPU_MODEL if device == "cpu" else DEFAULT_VLLM_GPU_MODEL[0])
        if args.model_source:
            source = args.model_source
        elif model in MODELS:
            source = ""
        elif model == DEFAULT_VLLM_GPU_MODEL[0]:
            source = DEFAULT_VLLM_GPU_MODEL[1]
        else:
            raise ServeOptionError(f"--model {model}: not a packaged model ({', '.join(MODELS)}); give --model-source")
        cpu = device == "cpu"
        try:
            engine = VllmEngine(
                model_id=model, model_source=source, device=device, accelerator_type=args.accelerator,
                tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.eager,
                max_model_len=args.max_model_len or (4096 if cpu else 16384),
                dtype="bfloat16" if cpu else "auto", loras=parse_loras(args.lora),
                autoscaling=Autoscaling(min_replicas=args.min_replicas,
                                        max_replicas=args.max_replicas or (1 if cpu else 4)))
        except ValidationError as exc:
            raise ServeOptionError(_one_line(exc)) from exc
    else:
        try:
            engine = LlamaCppEngine(model_id=args.model or DEFAULT_CPU_MODEL, gguf=args.gguf, n_threads=args.threads,
                                    loras=parse_loras(args.lora))
        except ValidationError as exc:
            raise ServeOptionError(_one_line(exc)) from exc
    return ServingConfig(engine=engine, host=args.host, port=args.port)
