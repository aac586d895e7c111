"""Language-model plumbing: local weights, the OpenAI-compatible client, prompts with schema-bound output."""
