"""Token counting with a real tokenizer.

The default counts with the tokenizer of the embedding model (WordPiece for MiniLM), which ships with the
packaged model, so counts are real and offline. A deployment whose reader has another vocabulary sets
``STAM_TOKENIZER`` to that model's tokenizer (a local path or a name sentence-transformers/transformers can
load offline); counts are then the reader's own.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Protocol


class Tokenizer(Protocol):
    name: str

    def count(self, text: str) -> int: ...

    def count_many(self, texts: list[str]) -> list[int]: ...


class HFTokenizer:
    """A Hugging Face (fast) tokenizer; special tokens are not counted."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self._tok = tokenizer
        self.name = name

    def count(self, text: str) -> int:
        if not text:
            return 0
        return len(self._tok(text, add_special_tokens=False, truncation=False)["input_ids"])

    def count_many(self, texts: list[str]) -> list[int]:
        """One batched tokenizer call for many texts (the fast tokenizer encodes them in one pass)."""
        if not texts:
            return []
        ids = self._tok(texts, add_special_tokens=False, truncation=False)["input_ids"]
        return [len(x) for x in ids]


@lru_cache(maxsize=4)
def load_tokenizer(name: str) -> HFTokenizer:
    """``name``: an embedding model name (its packaged tokenizer) or a local tokenizer folder."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from stam.embedding import resolve_model_path

    path = resolve_model_path(name)
    tok = AutoTokenizer.from_pretrained(path)
    tok.model_max_length = 10**9  # counting, not encoding for the model: never truncate or warn
    return HFTokenizer(tok, name)
