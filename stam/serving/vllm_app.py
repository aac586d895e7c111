"""The vLLM engine as a Ray Serve deployment: ``POST /v1/chat/completions`` and ``GET /v1/models``.

Why not Ray Serve's own LLM integration (``ray.serve.llm.build_openai_app``)? It does run with the CPU build
here (checked: a structured reply from the 0.5B through it), but its LoRA support only loads adapters from
cloud storage (``LoraConfig.dynamic_lora_loading_path`` must start with s3://, gs://, abfss:// or azure://), so
the folders ``stam train lora`` writes, or a hospital mounts on a volume, cannot be served by name. This
deployment holds vLLM's async engine (``AsyncLLM``) directly; the same code serves the CUDA wheel on GPU
replicas and the CPU build here, with only :class:`stam.serving.config.VllmEngine` changed.

- ``model``: the base model's id, or the name of an adapter from ``VllmEngine.loras`` (vLLM multi-LoRA: all
  adapters loaded on every replica, chosen per request; requests for different adapters batch together).
  Any other name: 404, as OpenAI answers.
- ``response_format`` ``json_schema`` (or ``json_object``): vLLM's structured outputs (xgrammar), so the
  reply always parses against the schema, as the llama.cpp replica's grammar does. Compact JSON (no free
  whitespace between tokens): a model allowed any whitespace can spend its whole budget on newlines (seen
  with an adapter here), and every token is paid for on a CPU.
- Sampling: ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``frequency_penalty``,
  ``presence_penalty``, ``repetition_penalty``.
- ``usage``: prompt and completion tokens, and ``seconds`` (time in the engine), as the llama.cpp replica.
"""

import time
import uuid
from typing import Any

from fastapi import FastAPI, HTTPException, Request

from stam.llm.convert import ensure_hf
from stam.serving.config import VllmEngine, vllm_deployment_options, vllm_engine_kwargs
from stam.serving.http import chat_body, model_list


def model_path(engine: VllmEngine) -> str:
    """Where the replica loads weights from: ``model_source``, or the packaged model converted once."""
    if engine.model_source:
        return engine.model_source

    return str(ensure_hf(engine.model_id))


def structured(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI ``response_format`` -> keyword arguments of vLLM's ``StructuredOutputsParams`` (None: free text)."""
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON object")
        return {"json": schema}
    if fmt.get("type") == "json_object":
        if isinstance(fmt.get("schema"), dict):
            return {"json": fmt["schema"]}
        return {"json_object": True}
    raise ValueError(f"unsupported response_format type {fmt.get('type')!r}")


SAMPLING_FIELDS = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "repetition_penalty")


def sampling_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The request's sampling fields as ``SamplingParams`` keyword arguments (greedy unless told otherwise)."""
    out: dict[str, Any] = {"max_tokens": int(body.get("max_tokens") or 512), "temperature": 0.0}
    for name in SAMPLING_FIELDS:
        if body.get(name) is not None:
            out[name] = float(body[name])
    if body.get("seed") is not None:
        out["seed"] = int(body["seed"])
    if out["max_tokens"] < 1:
        raise ValueError("max_tokens must be at least 1")
    return out


def build_vllm_app(engine: VllmEngine) -> Any:
    # deferred: optional ray (stam[llm]), not installed everywhere
    from ray import serve

    api = FastAPI(title="STAM language model (vLLM)")

    @serve.deployment(name="vllm", **vllm_deployment_options(engine))
    @serve.ingress(api)
    class VllmServer:
        def __init__(self, cfg: dict[str, Any]) -> None:
            # deferred: optional vllm (make vllm-setup), not installed everywhere
            from vllm import AsyncEngineArgs
            from vllm.config import StructuredOutputsConfig
            from vllm.lora.request import LoRARequest
            from vllm.v1.engine.async_llm import AsyncLLM

            self.cfg = VllmEngine.model_validate(cfg)
            path = model_path(self.cfg)
            kwargs = vllm_engine_kwargs(self.cfg, path)
            kwargs["structured_outputs_config"] = StructuredOutputsConfig(**kwargs["structured_outputs_config"])
            self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
            self.tokenizer = self.engine.get_tokenizer()
            # lora_int_id must be unique per adapter and stable for the replica's life.
            self.loras = {name: LoRARequest(name, i, folder)
                          for i, (name, folder) in enumerate(sorted(self.cfg.loras.items()), start=1)}

        @api.get("/v1/models")
        async def models(self) -> dict[str, Any]:
            return model_list(self.cfg.model_id, self.loras)

        @api.post("/v1/chat/completions")
        async def chat(self, request: Request) -> dict[str, Any]:
            # deferred: optional vllm (make vllm-setup), not installed everywhere
            from vllm import SamplingParams
            from vllm.sampling_params import StructuredOutputsParams

            body = await chat_body(request)
            messages = body["messages"]
            name = body.get("model") or self.cfg.model_id
            if name != self.cfg.model_id and name not in self.loras:
                raise HTTPException(status_code=404, detail=f"model {name!r} is not served here "
                                    f"(base {self.cfg.model_id!r}, adapters {sorted(self.loras)})")
            try:
                fmt = structured(body.get("response_format"))
                params = SamplingParams(**sampling_kwargs(body),
                                        structured_outputs=StructuredOutputsParams(**fmt) if fmt else None)
                prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except (TypeError, ValueError, KeyError) as exc:
                raise HTTPException(status_code=400, detail=f"bad request: {exc}") from exc
            started = time.perf_counter()
            final = None
            async for out in self.engine.generate(prompt, params, uuid.uuid4().hex,
                                                  lora_request=self.loras.get(name)):
                final = out
            if final is None or not final.outputs:
                raise HTTPException(status_code=500, detail="the engine returned no output")
            choice = final.outputs[0]
            prompt_tokens = len(final.prompt_token_ids or [])
            completion_tokens = len(choice.token_ids)
            return {
                "id": f"chatcmpl-{final.request_id}", "object": "chat.completion", "created": int(time.time()),
                "model": name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": choice.text},
                             "finish_reason": choice.finish_reason or "stop"}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens,
                          "seconds": round(time.perf_counter() - started, 3)},
            }

        def __del__(self) -> None:
            engine = getattr(self, "engine", None)
            if engine is not None:
                engine.shutdown()

    return VllmServer.bind(engine.model_dump())  # type: ignore[attr-defined]
