"""The OpenAI-compatible reader client against a local aiohttp endpoint (one function under test: the
request it sends and how it reads the reply; a real model endpoint is the language-model work's)."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from stam.errors import LLMUnavailable
from stam.read.reader import OpenAIReader


async def test_reader_sends_question_and_evidence_and_returns_the_answer() -> None:
    seen: dict[str, Any] = {}

    async def chat(request: web.Request) -> web.Response:
        seen["auth"] = request.headers.get("Authorization")
        seen["body"] = await request.json()
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": " 87.8 cm \n"}}]})

    async def broken(request: web.Request) -> web.Response:
        seen["broken"] = seen.get("broken", 0) + 1
        return web.json_response({"error": "overloaded"}, status=503)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/bad/v1/chat/completions", broken)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        reader = OpenAIReader(f"http://127.0.0.1:{port}/v1/", "qwen2.5-0.5b", api_key="k", timeout_s=5)
        assert await reader.answer("What is the height?", "Current:\n- Body Height: 87.8 cm") == "87.8 cm"
        assert seen["auth"] == "Bearer k"
        body = seen["body"]
        assert body["model"] == "qwen2.5-0.5b" and body["temperature"] == 0
        assert "Body Height: 87.8 cm" in body["messages"][1]["content"]
        assert body["messages"][1]["content"].endswith("Question: What is the height?")
        assert reader.usage.calls == 1
        # Through the one client: a 503 is retried (with backoff), then the endpoint is reported unavailable.
        broken_reader = OpenAIReader(f"http://127.0.0.1:{port}/bad/v1", "m", timeout_s=5, retries=1)
        broken_reader.client.backoff_s = 0.01
        with pytest.raises(LLMUnavailable, match="503"):
            await broken_reader.answer("q", "e")
        assert seen["broken"] == 2
    finally:
        await runner.cleanup()
