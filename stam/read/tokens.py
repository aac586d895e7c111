"""Token counting with a real tokenizer.

The default counts with the tokenizer of the embedding model (WordPiece for MiniLM), which ships with the
packaged model, so counts are real and offline. A deployment whose reader has another vocabulary sets
``STAM_TOKENIZER`` to that model's tokenizer (a local path or a name sentence-transformers/transformers can
load offline); counts are then the reader's own.
"""

from __future__ import annotations

import json
import os
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


class WordPieceTokenizer:
    """A BERT tokenizer's ``tokenizer.json`` read by ``tokenizers`` itself: the counts transformers'
    BertTokenizerFast gives (it wraps the same file), without importing transformers at a process's start."""

    def __init__(self, path: str, name: str) -> None:
        # deferred: tokenizers is slow to import
        from tokenizers import Tokenizer as Backend

        self._tok = Backend.from_file(path)
        self._tok.no_truncation()
        self._tok.no_padding()
        self.name = name

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids) if text else 0

    def count_many(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        return [len(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]


@lru_cache(maxsize=4)
def load_tokenizer(name: str) -> HFTokenizer | WordPieceTokenizer:
    """``name``: an embedding model name (its packaged tokenizer) or a local tokenizer folder."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # deferred: stam.embedding pulls in redis, numpy, pydantic
    from stam.embedding import resolve_model_path

    path = resolve_model_path(name)
    config, backend = os.path.join(path, "tokenizer_config.json"), os.path.join(path, "tokenizer.json")
    if os.path.isfile(config) and os.path.isfile(backend):
        with open(config) as fh:
            if json.load(fh).get("tokenizer_class") in ("BertTokenizer", "BertTokenizerFast"):
                return WordPieceTokenizer(backend, name)
    # deferred: transformers is slow to import
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.model_max_length = 10**9  # counting, not encoding for the model: never truncate or warn
    return HFTokenizer(tok, name)
