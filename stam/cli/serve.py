"""``stam serve``: the language model behind an OpenAI-compatible endpoint (Ray Serve)."""

from __future__ import annotations

import argparse
import sys


def cmd_serve(args: argparse.Namespace) -> int:
    from stam.serving.app import run
    from stam.serving.config import LlamaCppEngine, ServingConfig, VllmEngine

    engine: LlamaCppEngine | VllmEngine
    if args.engine == "vllm":
        engine = VllmEngine(model_id=args.model or "qwen2.5-7b-instruct", accelerator_type=args.accelerator)
    else:
        engine = LlamaCppEngine(model_id=args.model or "qwen2.5-coder-1.5b-instruct-q4_k_m", gguf=args.gguf,
                                n_threads=args.threads)
    config = ServingConfig(engine=engine, host=args.host, port=args.port)
    print(f"serving {engine.model_id} ({engine.kind}) at http://{args.host}:{args.port}/v1  (Ctrl-C stops)",
          file=sys.stderr)
    run(config, blocking=True)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="the language model behind an OpenAI-compatible endpoint (Ray Serve)",
                       description="llamacpp: a CPU replica on the packaged GGUF weights (joined and checked on "
                       "first use). vllm: Ray Serve LLM replicas on GPUs (needs vLLM installed; not runnable here).")
    p.add_argument("--engine", choices=["llamacpp", "vllm"], default="llamacpp",
                   help="llamacpp: CPU, packaged GGUF weights (default); vllm: GPUs")
    p.add_argument("--model", default=None, help="model id (llamacpp: qwen2.5-coder-1.5b-instruct-q4_k_m, the "
                   "default, or qwen2.5-coder-0.5b-instruct-q4_k_m)")
    p.add_argument("--gguf", default="", help="llamacpp: a GGUF path instead of the packaged weights")
    p.add_argument("--threads", type=int, default=2, help="llamacpp: CPU threads of the replica (default 2)")
    p.add_argument("--accelerator", default="A100", help="vllm: Ray accelerator type")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.set_defaults(fn=cmd_serve)
