"""Serving the language model with Ray Serve: one OpenAI-compatible chat-completions surface, two engines
(vLLM replicas on GPUs in production, a llama.cpp replica on CPU here)."""
