"""The Ray Serve application: ``POST /v1/chat/completions`` and ``GET /v1/models``, OpenAI-compatible.

- vLLM engine (GPUs in production, CPUs here): :mod:`stam.serving.vllm_app`, a Serve deployment holding vLLM's
  async engine (replicas, autoscaling, accelerator type, multi-LoRA by name, structured outputs for
  ``response_format``; why not Ray Serve's LLM integration is said there).
- llama.cpp engine (CPU): :class:`LlamaCppServer`, a Serve deployment holding ``llama_cpp.Llama`` on the
  GGUF file; ``response_format`` of type ``json_schema`` becomes a llama.cpp grammar for that schema
  (:func:`json_grammar`), so the output always parses against it. LoRA adapters (converted to GGUF,
  :mod:`stam.serving.gguf_lora`) are loaded once and applied per request by name (``model``); switching
  adapter drops the cached prompt prefix. Any other ``model`` is the base model.

Run with ``stam serve`` (see the CLI); any OpenAI-compatible endpoint can replace it by URL.
"""

import asyncio
import ctypes
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

# FastAPI resolves endpoint annotations at runtime; Ray pickles the deployment class by value, so this
# module keeps real (not postponed) annotations and imports Request at the top.
from fastapi import FastAPI, HTTPException, Request

from stam.llm.weights import ensure_gguf
from stam.serving.config import LlamaCppEngine, ServingConfig, VllmEngine
from stam.serving.gguf_lora import to_gguf
from stam.serving.http import chat_body, model_list
from stam.serving.vllm_app import build_vllm_app

log = logging.getLogger("stam.serving")

RAY_START_ATTEMPTS = 3
"""Ray's own start-up gives its processes fixed times: the raylet 30 s (hard-coded in ray/_private/node.py) to register
with the GCS, the GCS server a wait for its port file. On this 2-core machine the first start in a fresh environment
has missed one or the other, with no log written by the process waited for (ray-project/ray#47087, #62883): three
times in seven fresh-clone test runs. The next start, after a shutdown, has always come up."""
RAY_START_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")
"""What Ray's start-up says when one of its processes did not come up in its time (the raylet; the GCS server)."""

# No whitespace between a JSON reply's tokens, as vLLM's grammar here (``disable_any_whitespace``, see
# ``stam.serving.config``): both engines lead a model down the same tokens, replies are shorter, and the
# adapters learnt the teacher's replies as compact JSON. llama-cpp-python's converter allows one optional space
# (``" "?``), and the model's own choice between ``"new_is":"`` and ``"new_is": "`` changed its verdicts: the
# 1.5B answered 'past' to 19 of the 39 new facts its vLLM run calls 'current' (80 of 100 verdicts agreed);
# compact, 88 of 100 agree (README, Fine-tuning: the comparison).
JSON_SPACE_RULE = 'space ::= ""'


def json_grammar(schema: dict[str, Any]) -> str:
    """GBNF for compact replies valid against ``schema`` (llama-cpp-python's converter, ``JSON_SPACE_RULE``)."""
    # deferred: optional llama_cpp (stam[llm]), not installed everywhere
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    text, n = re.subn(r"(?m)^space ::= .*$", lambda _m: JSON_SPACE_RULE, json_schema_to_gbnf(json.dumps(schema)))
    if n != 1:  # a newer converter that names or writes the rule otherwise: say so rather than serve the old one
        raise RuntimeError(f"llama-cpp-python's JSON-schema grammar has {n} 'space' rules, not one; "
                           "stam.serving.app.json_grammar needs updating for it")
    return text


def _llama_constraint(fmt: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI ``response_format`` -> ``create_chat_completion`` arguments: a JSON schema becomes a grammar
    (:func:`json_grammar`); ``json_object`` without one stays llama-cpp-python's generic JSON grammar."""
    if not fmt or fmt.get("type") == "text":
        return {}
    if fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema", {})
    elif fmt.get("type") == "json_object":
        if "schema" not in fmt:
            return {"response_format": {"type": "json_object"}}
        schema = fmt["schema"]
    else:
        raise ValueError(f"unsupported response_format type {fmt.get('type')!r}")
    # deferred: optional llama_cpp (stam[llm]), not installed everywhere
    from llama_cpp.llama_grammar import LlamaGrammar

    return {"grammar": LlamaGrammar.from_string(json_grammar(schema), verbose=False)}


def _load_llama_adapter(llm: Any, source: str) -> Any:
    """A LoRA adapter loaded on the llama.cpp model (a peft folder is converted to GGUF once)."""
    # deferred: optional llama_cpp (stam[llm]), not installed everywhere
    import llama_cpp

    path = source if source.endswith(".gguf") else str(to_gguf(Path(source)))
    adapter = llama_cpp.llama_adapter_lora_init(llm.model, path.encode())
    if not adapter:
        raise RuntimeError(f"llama.cpp could not load the LoRA adapter {path}")
    return adapter


def _use_llama_adapter(llm: Any, adapter: Any | None) -> None:
    """Apply ``adapter`` (scale 1: alpha / rank as trained) to the context, or none."""
    # deferred: optional llama_cpp (stam[llm]), not installed everywhere
    import llama_cpp

    if adapter is None:
        rc = llama_cpp.llama_set_adapters_lora(llm._ctx.ctx, None, 0, None)
    else:
        rc = llama_cpp.llama_set_adapters_lora(llm._ctx.ctx, (llama_cpp.llama_adapter_lora_p_ctypes * 1)(adapter), 1,
                                               (ctypes.c_float * 1)(1.0))
    if rc:
        raise RuntimeError(f"llama.cpp refused to set the LoRA adapters ({rc})")


async def _finish_even_if_cancelled(generation: asyncio.Future[Any]) -> Any:
    """Await a generation on the replica's llama.cpp context, and keep waiting for it if this request is cancelled
    (a client that timed out or went away): a thread cannot be stopped, so the lock around the context is held until
    the thread is done. Released early, the next request (often the client's own retry) would decode on the same
    context at the same time, and llama.cpp aborts the whole replica (GGML_ASSERT in ggml-cpu/ops.cpp)."""
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(generation)
        except asyncio.CancelledError:
            if generation.done():
                raise
            cancelled = True
            continue
        if cancelled:
            raise asyncio.CancelledError
        return result


def build_llamacpp_app(engine: LlamaCppEngine) -> Any:
    # deferred: optional ray (stam[llm]), not installed everywhere
    from ray import serve

    api = FastAPI(title="STAM language model (llama.cpp)")

    @serve.deployment(name="llamacpp", num_replicas=engine.replicas, max_ongoing_requests=4,
                      ray_actor_options={"num_cpus": engine.num_cpus})
    @serve.ingress(api)
    class LlamaCppServer:
        def __init__(self, cfg: dict[str, Any]) -> None:
            # deferred: optional llama_cpp (stam[llm]), not installed everywhere
            from llama_cpp import Llama

            self.cfg = LlamaCppEngine.model_validate(cfg)
            path = self.cfg.gguf or str(ensure_gguf(self.cfg.model_id))
            self.llm = Llama(model_path=path, n_ctx=self.cfg.n_ctx, n_threads=self.cfg.n_threads, verbose=False)
            self.lock = asyncio.Lock()  # one llama.cpp context: one generation at a time per replica
            self.adapters = {name: _load_llama_adapter(self.llm, source) for name, source in self.cfg.loras.items()}
            self.active: str | None = None

        @api.get("/v1/models")
        async def models(self) -> dict[str, Any]:
            return model_list(self.cfg.model_id, self.adapters)

        @api.post("/v1/chat/completions")
        async def chat(self, request: Request) -> dict[str, Any]:
            body = await chat_body(request)
            try:
                constraint = _llama_constraint(body.get("response_format"))
            except ValueError as exc:
                raise HTTPException(status_code=400, detail=str(exc)) from exc
            kwargs = {"messages": body["messages"], "max_tokens": int(body.get("max_tokens") or 512),
                      "temperature": float(body.get("temperature", 0.0)), **constraint}
            try:
                # OpenAI's penalties, and vLLM's repetition_penalty (llama.cpp calls it repeat_penalty).
                for name, target in (("frequency_penalty", "frequency_penalty"),
                                     ("presence_penalty", "presence_penalty"),
                                     ("repetition_penalty", "repeat_penalty")):
                    if body.get(name) is not None:
                        kwargs[target] = float(body[name])
            except (TypeError, ValueError) as exc:
                raise HTTPException(status_code=400, detail=f"bad sampling parameter: {exc}") from exc
            # An adapter by name; any other name is the base model (as before adapters existed).
            adapter: str | None = body.get("model") if body.get("model") in self.adapters else None

            def generate() -> Any:
                if adapter != self.active:
                    _use_llama_adapter(self.llm, self.adapters.get(adapter) if adapter else None)
                    self.active = adapter
                    self.llm.reset()  # type: ignore[no-untyped-call]  # the prefix was evaluated with the other adapter
                return self.llm.create_chat_completion(**kwargs)

            async with self.lock:
                started = time.perf_counter()
                out: dict[str, Any] = await _finish_even_if_cancelled(asyncio.ensure_future(asyncio.to_thread(generate)))
            out["model"] = adapter or self.cfg.model_id
            out.setdefault("usage", {})["seconds"] = round(time.perf_counter() - started, 3)
            return out

    return LlamaCppServer.bind(engine.model_dump())  # type: ignore[attr-defined]


def build_app(config: ServingConfig) -> Any:
    if isinstance(config.engine, VllmEngine):
        return build_vllm_app(config.engine)
    return build_llamacpp_app(config.engine)


def build_from_args(args: dict[str, Any]) -> Any:
    """Application builder for a Serve config file or KubeRay's ``serveConfigV2``
    (``import_path: stam.serving.app:build_from_args``, ``args``: a :class:`ServingConfig` as a mapping)."""
    return build_app(ServingConfig.model_validate(args))


def start_ray(**options: Any) -> None:
    """``ray.init(**options)``, started again (after ``ray.shutdown()``) when one of Ray's processes did not come up in
    its time (:data:`RAY_START_TIMEOUTS`), up to :data:`RAY_START_ATTEMPTS` times; any other failure, or the last
    timeout, is raised as Ray raised it."""
    # deferred: optional ray (stam[llm]), not installed everywhere
    import ray

    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            ray.init(**options)
            return
        except Exception as exc:  # Ray raises a bare Exception for this timeout
            if not any(s in str(exc) for s in RAY_START_TIMEOUTS) or attempt == RAY_START_ATTEMPTS:
                raise
            log.warning("Ray's node did not come up in time (attempt %d of %d: %s); starting it again", attempt,
                        RAY_START_ATTEMPTS, str(exc).splitlines()[0][:200])
            ray.shutdown()


def run(config: ServingConfig, *, blocking: bool = True, num_cpus: int | None = None,
        log_to_driver: bool | None = None) -> None:
    """Start Ray (local), Serve's HTTP proxy on ``host:port`` and the application."""
    # deferred: optional ray (stam[llm]), not installed everywhere
    import ray
    from ray import serve

    if not ray.is_initialized():
        # The vLLM replica's own log (engine start, a load failure's cause) is the server's output; llama.cpp's
        # replica has nothing to say that the HTTP answers do not.
        # (log_to_driver=False: a caller whose stdout is a report, such as a benchmark.)
        start_ray(num_cpus=num_cpus, include_dashboard=False,
                  log_to_driver=isinstance(config.engine, VllmEngine) if log_to_driver is None else log_to_driver)
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(build_app(config), name="stam-llm", route_prefix=config.route_prefix, blocking=blocking)
