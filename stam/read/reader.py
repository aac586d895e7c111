"""The reader: a chat model that answers a question from an evidence packet.

Any OpenAI-compatible chat-completions endpoint serves (the Ray Serve app of the language-model work, vLLM,
llama.cpp's server): ``STAM_READER_URL`` (e.g. ``http://127.0.0.1:8000/v1``) and ``STAM_READER_MODEL``.
Without a URL no reader is configured and queries return the packet alone, saying so.

``LocalReader`` runs a packaged GGUF model in process with llama.cpp (the engine of the serving replicas on
CPU), for evaluation runs on one machine without a server.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from stam.llm.client import LLMClient, Usage
from stam.llm.prompt import prompt
from stam.llm.weights import ensure_gguf

SYSTEM = ("You answer questions about one patient using only the evidence given: the patient's record with the "
          "time of each fact. A fact marked [current] holds at the time of the record; earlier values and ended "
          "orders held before. A line starting 'Computed from the record' is computed exactly from the record. "
          "Answer briefly; if the evidence does not answer the question, say so.")
ANSWER = prompt("answer", 1, SYSTEM)
"""The reader's system prompt (a new wording: a new version, see stam/llm/prompt.py)."""


class Reader(Protocol):
    name: str

    async def answer(self, question: str, evidence: str) -> str: ...


def messages(question: str, evidence: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": f"{evidence}\n\nQuestion: {question}"}]


class OpenAIReader:
    """The reader over any OpenAI-compatible endpoint, through the project's one language-model client
    (:class:`stam.llm.client.LLMClient`, the reasoner's too): a timeout per request, bounded retries with
    backoff on connection errors, timeouts, 429 and 5xx, a concurrency limit, token accounting (``usage``) and
    the ``stam_llm_*`` metrics. The blocking call runs in a thread, off the caller's event loop."""

    def __init__(self, base_url: str, model: str, *, api_key: str = "", timeout_s: float = 60.0,
                 max_tokens: int = 256, system: str = SYSTEM, retries: int = 2, max_concurrency: int = 4) -> None:
        self.client = LLMClient(base_url, model, api_key=api_key, timeout_s=timeout_s, retries=retries,
                                max_concurrency=max_concurrency)
        self.base_url = self.client.base_url
        self.model = model
        self.name = model
        self._max_tokens = max_tokens
        self.system = system

    @property
    def usage(self) -> Usage:
        return self.client.usage

    async def answer(self, question: str, evidence: str) -> str:
        result = await asyncio.to_thread(self.client.chat, messages(question, evidence, self.system),
                                         max_tokens=self._max_tokens, temperature=0.0)
        return result.content.strip()


class LocalReader:
    """A packaged GGUF model (``stam.llm.weights``) answering in process through llama.cpp, temperature 0.
    ``usage`` sums the prompt and completion tokens of every answer."""

    def __init__(self, model: str, *, n_ctx: int = 8192, n_threads: int = 2, max_tokens: int = 64,
                 system: str = SYSTEM) -> None:
        # deferred: optional llama_cpp (stam[llm]), not installed everywhere
        from llama_cpp import Llama

        self.name = model
        self.system = system
        self._max_tokens = max_tokens
        self._llm = Llama(model_path=str(ensure_gguf(model)), n_ctx=n_ctx, n_threads=n_threads, verbose=False)
        self.usage = {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0}

    def answer_sync(self, question: str, evidence: str) -> str:
        out: Any = self._llm.create_chat_completion(messages=messages(question, evidence, self.system),  # type: ignore[arg-type]
                                                    temperature=0.0, max_tokens=self._max_tokens)
        usage = out.get("usage") or {}
        self.usage["calls"] += 1
        self.usage["prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
        self.usage["completion_tokens"] += int(usage.get("completion_tokens") or 0)
        return str(out["choices"][0]["message"]["content"] or "").strip()

    async def answer(self, question: str, evidence: str) -> str:
        return await asyncio.to_thread(self.answer_sync, question, evidence)
