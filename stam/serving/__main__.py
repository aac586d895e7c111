"""``python -m stam.serving``: the Ray Serve application without the rest of the CLI.

The serving images run this instead of ``stam serve`` so that they need only the serving dependencies (Ray
Serve, FastAPI, llama-cpp-python or vLLM), not the write path's (torch, Faust, Milvus). Same options as
``stam serve``, plus ``--model-source`` for vLLM.
"""

from __future__ import annotations

import argparse
import sys

from stam.serving.config import LlamaCppEngine, ServingConfig, VllmEngine


def parse(argv: list[str] | None = None) -> ServingConfig:
    p = argparse.ArgumentParser(prog="python -m stam.serving", description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["llamacpp", "vllm"], default="llamacpp")
    p.add_argument("--model", default=None, help="model id clients send as 'model'")
    p.add_argument("--gguf", default="", help="llamacpp: a GGUF path instead of the packaged weights")
    p.add_argument("--threads", type=int, default=2, help="llamacpp: threads per replica")
    p.add_argument("--model-source", default=None, help="vllm: HF id or a local/S3 path of the weights")
    p.add_argument("--accelerator", default="A100", help="vllm: Ray accelerator type")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm: GPUs per replica")
    p.add_argument("--min-replicas", type=int, default=1, help="vllm: autoscaling floor")
    p.add_argument("--max-replicas", type=int, default=4, help="vllm: autoscaling ceiling")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args(argv)
    engine: LlamaCppEngine | VllmEngine
    if args.engine == "vllm":
        kwargs = {"model_id": args.model or "qwen2.5-7b-instruct", "accelerator_type": args.accelerator,
                  "tensor_parallel_size": args.tensor_parallel_size,
                  "autoscaling": {"min_replicas": args.min_replicas, "max_replicas": args.max_replicas}}
        if args.model_source:
            kwargs["model_source"] = args.model_source
        engine = VllmEngine.model_validate(kwargs)
    else:
        engine = LlamaCppEngine(model_id=args.model or "qwen2.5-coder-1.5b-instruct-q4_k_m", gguf=args.gguf,
                                n_threads=args.threads)
    return ServingConfig(engine=engine, host=args.host, port=args.port)


def main(argv: list[str] | None = None) -> int:
    config = parse(argv)
    from stam.serving.app import run

    print(f"serving {config.engine.model_id} ({config.engine.kind}) at http://{config.host}:{config.port}/v1",
          file=sys.stderr)
    run(config, blocking=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
