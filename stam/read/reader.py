"""The reader: a chat model that answers a question from an evidence packet.

Any OpenAI-compatible chat-completions endpoint serves (the Ray Serve app of the language-model work, vLLM,
llama.cpp's server): ``STAM_READER_URL`` (e.g. ``http://127.0.0.1:8000/v1``) and ``STAM_READER_MODEL``.
Without a URL no reader is configured and queries return the packet alone, saying so.
"""

from __future__ import annotations

from typing import Any, Protocol

SYSTEM = ("You answer questions about one patient using only the evidence given. Facts under 'Current' hold "
          "now; facts under 'Historical' held before and say what replaced them. Answer briefly; if the "
          "evidence does not answer the question, say so.")


class Reader(Protocol):
    name: str

    async def answer(self, question: str, evidence: str) -> str: ...


class OpenAIReader:
    def __init__(self, base_url: str, model: str, *, api_key: str = "", timeout_s: float = 60.0,
                 max_tokens: int = 256) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = model
        self._api_key = api_key
        self._timeout = timeout_s
        self._max_tokens = max_tokens

    def request_body(self, question: str, evidence: str) -> dict[str, Any]:
        return {"model": self.model, "temperature": 0, "max_tokens": self._max_tokens,
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"{evidence}\n\nQuestion: {question}"}]}

    async def answer(self, question: str, evidence: str) -> str:
        import aiohttp

        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        timeout = aiohttp.ClientTimeout(total=self._timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.post(
                f"{self.base_url}/chat/completions", json=self.request_body(question, evidence),
                headers=headers) as resp:
            resp.raise_for_status()
            data = await resp.json()
        return str(data["choices"][0]["message"]["content"]).strip()
