"""A client for any OpenAI-compatible chat-completions endpoint (the Ray Serve app, vLLM, llama.cpp).

Timeouts per request, bounded retries with exponential backoff on connection errors, timeouts, 429 and
5xx (never on other 4xx: a bad request does not get better), a concurrency limit shared by every thread
of the process, and token accounting from the server's ``usage`` (totals on the client, and
``stam_llm_tokens_total{kind}`` / ``stam_llm_calls_total{outcome}`` metrics without patient data).

Structured output: ``schema`` is sent as ``response_format = {"type": "json_schema", "json_schema":
{"name", "schema", "strict": true}}``, which vLLM (guided decoding) and the llama.cpp replica of the Ray
Serve app (grammar from the schema) both enforce.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

from stam.errors import LLMError, LLMUnavailable
from stam.metrics import LLM_SECONDS

LLM_CALLS = Counter("stam_llm_calls_total", "Language-model calls by outcome", ["outcome"])
LLM_TOKENS = Counter("stam_llm_tokens_total", "Language-model tokens by kind (prompt, completion)", ["kind"])


@dataclass(frozen=True)
class ChatResult:
    content: str
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    attempts: int


@dataclass
class Usage:
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, r: ChatResult) -> None:
        with self._lock:
            self.calls += 1
            self.prompt_tokens += r.prompt_tokens
            self.completion_tokens += r.completion_tokens
            self.seconds += r.seconds

    def as_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "seconds": round(self.seconds, 3)}


_RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class LLMClient:
    """The project's one client of a chat-completions endpoint (every language-model call goes through one;
    ``tests/unit/test_factories.py`` holds it): ``timeout_s`` per request, ``retries`` with exponential backoff
    from ``backoff_s``, ``max_concurrency`` requests at once, the bearer ``api_key`` when given; plain HTTP(S)
    with the system's trust store (urllib)."""

    def __init__(self, base_url: str, model: str, *, api_key: str = "", timeout_s: float = 120.0, retries: int = 3,
                 backoff_s: float = 0.5, max_concurrency: int = 4) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._api_key = api_key
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self.usage = Usage()

    def body(self, messages: list[dict[str, str]], *, schema: dict[str, Any] | None, schema_name: str,
             max_tokens: int, temperature: float, sampling: dict[str, float] | None = None,
             model: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model or self.model, "messages": messages, "max_tokens": max_tokens,
                                "temperature": temperature, **(sampling or {})}
        if schema is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": schema_name, "schema": schema, "strict": True}}
        return body

    def chat(self, messages: list[dict[str, str]], *, schema: dict[str, Any] | None = None,
             schema_name: str = "output", max_tokens: int = 512, temperature: float = 0.0,
             sampling: dict[str, float] | None = None, model: str | None = None) -> ChatResult:
        """One chat completion. ``sampling``: extra sampling fields (``repetition_penalty``, accepted by vLLM
        and by the Ray Serve llama.cpp replica; ``frequency_penalty`` / ``presence_penalty``, OpenAI's).
        ``model``: another name than the client's for this call (a LoRA adapter the endpoint serves by name)."""
        payload = json.dumps(self.body(messages, schema=schema, schema_name=schema_name, max_tokens=max_tokens,
                                       temperature=temperature, sampling=sampling, model=model)).encode()
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        last: Exception | None = None
        first_try = time.perf_counter()
        for attempt in range(1, self.retries + 2):
            started = time.perf_counter()
            try:
                with self._slots:
                    req = urllib.request.Request(f"{self.base_url}/chat/completions", data=payload, headers=headers,
                                                 method="POST")
                    with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                        data = json.loads(resp.read())
                result = self._parse(data, time.perf_counter() - started, attempt)
                self.usage.add(result)
                LLM_CALLS.labels(outcome="ok").inc()
                LLM_SECONDS.observe(time.perf_counter() - first_try)  # retries included
                LLM_TOKENS.labels(kind="prompt").inc(result.prompt_tokens)
                LLM_TOKENS.labels(kind="completion").inc(result.completion_tokens)
                return result
            except urllib.error.HTTPError as exc:
                last = exc
                if exc.code not in _RETRY_STATUS:
                    LLM_CALLS.labels(outcome="rejected").inc()
                    detail = exc.read()[:500].decode(errors="replace")
                    raise LLMError(f"endpoint refused the request: HTTP {exc.code}: {detail}") from exc
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
                last = exc
            LLM_CALLS.labels(outcome="retry").inc()
            if attempt <= self.retries:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
        LLM_CALLS.labels(outcome="failed").inc()
        raise LLMUnavailable(f"endpoint failed after {self.retries + 1} attempts: {last}")

    @staticmethod
    def _parse(data: Any, seconds: float, attempt: int) -> ChatResult:
        try:
            content = data["choices"][0]["message"]["content"]
            usage = data.get("usage") or {}
            return ChatResult(content=str(content or ""), prompt_tokens=int(usage.get("prompt_tokens", 0)),
                              completion_tokens=int(usage.get("completion_tokens", 0)), seconds=seconds,
                              attempts=attempt)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise LLMError(f"not a chat completion: {str(data)[:300]}") from exc
