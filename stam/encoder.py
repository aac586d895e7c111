"""A sentence-transformers BERT model (``Transformer`` + mean ``Pooling`` + ``Normalize``, as all-MiniLM-L6-v2 is
packaged) run on torch, ``tokenizers`` and ``safetensors`` alone.

Why: ``SentenceTransformer`` imports transformers, scipy, scikit-learn and pandas before it encodes anything. That
is about 7 s of CPU at the start of every process that embeds: each worker, the query worker, each ``stam ask``
or ``stam deletion`` command, each test process. The arithmetic here is BERT's, as transformers computes it (the
same weights, WordPiece tokenizer, 256-token truncation, the post-LayerNorm encoder, GELU, mean pooling over the
attention mask, L2 normalisation). ``tests/unit/test_encoder.py`` checks it against SentenceTransformer on real
record text, including notes longer than 256 tokens. Any model folder of another shape is loaded by
SentenceTransformer (:class:`stam.embedding.Embedder` decides with :func:`load`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

_MODULES = ["Transformer", "Pooling", "Normalize"]
"""The modules of the shape run here, by class name (sentence-transformers has moved them between packages)."""


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def load(folder: str | Path) -> MeanPooledBert | None:
    """The model in ``folder`` when it is a sentence-transformers BERT with mean pooling and normalisation, else
    None."""
    root = Path(folder)
    modules = _json(root / "modules.json")
    config = _json(root / "config.json")
    if not modules or not config or not (root / "model.safetensors").is_file() or not (root / "tokenizer.json").is_file():
        return None
    types = [m.get("type", "") for m in modules]
    if (not all(t.startswith("sentence_transformers.") for t in types) or [t.rsplit(".", 1)[-1] for t in types] != _MODULES
            or modules[0].get("path", "") != ""):
        return None
    pooling = _json(root / modules[1]["path"] / "config.json") or {}
    mean_only = pooling.get("pooling_mode_mean_tokens") and not any(
        v for k, v in pooling.items() if k.startswith("pooling_mode_") and k != "pooling_mode_mean_tokens")
    st = _json(root / "sentence_bert_config.json") or {}
    if (config.get("model_type") != "bert" or config.get("hidden_act") != "gelu" or not mean_only
            or config.get("position_embedding_type", "absolute") != "absolute" or st.get("do_lower_case")):
        return None
    return MeanPooledBert(root, config, int(st.get("max_seq_length") or config["max_position_embeddings"]))


class MeanPooledBert:
    """``encode(texts)``: unit-normalised float32 vectors, as ``SentenceTransformer.encode(texts,
    normalize_embeddings=True)`` gives them."""

    def __init__(self, root: Path, config: dict[str, Any], max_seq_length: int) -> None:
        # deferred: torch, safetensors, tokenizers are slow to import
        import torch
        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        self._torch = torch
        self.max_seq_length = max_seq_length
        self.dim = int(config["hidden_size"])
        self._heads = int(config["num_attention_heads"])
        self._layers = int(config["num_hidden_layers"])
        self._eps = float(config.get("layer_norm_eps", 1e-12))
        w = load_file(str(root / "model.safetensors"))
        self._w = {k.removeprefix("bert."): v.float() for k, v in w.items()}
        tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        tok.no_padding()
        tok.enable_truncation(max_length=max_seq_length)  # the [CLS] and [SEP] count within it, as in transformers
        tok.enable_padding(pad_id=int(config.get("pad_token_id") or 0))
        self._tok = tok

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        torch = self._torch
        # As SentenceTransformer: stripped text, batches of similar length (longest first), results in input order.
        stripped = [str(t).strip() for t in texts]
        order = sorted(range(len(stripped)), key=lambda i: -len(stripped[i]))
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                idx = order[start:start + batch_size]
                enc = self._tok.encode_batch([stripped[i] for i in idx])
                ids = torch.tensor([e.ids for e in enc], dtype=torch.long)
                mask = torch.tensor([e.attention_mask for e in enc], dtype=torch.long)
                out[idx] = self._forward(ids, mask).numpy()
        return out

    def _forward(self, ids: Any, mask: Any) -> Any:
        torch = self._torch
        f = torch.nn.functional
        w = self._w
        n, length = ids.shape
        h = self.dim

        def dense(x: Any, name: str) -> Any:
            return f.linear(x, w[f"{name}.weight"], w[f"{name}.bias"])

        def norm(x: Any, name: str) -> Any:
            return f.layer_norm(x, (h,), w[f"{name}.weight"], w[f"{name}.bias"], self._eps)

        x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:length]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = norm(x, "embeddings.LayerNorm")
        # Padding is masked out of attention with the most negative float, as transformers does.
        bias = (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        heads, size = self._heads, h // self._heads
        for layer in range(self._layers):
            p = f"encoder.layer.{layer}"

            def split(t: Any) -> Any:
                return t.view(n, length, heads, size).transpose(1, 2)

            q, k, v = (split(dense(x, f"{p}.attention.self.{m}")) for m in ("query", "key", "value"))
            a = f.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(n, length, h)
            x = norm(dense(a, f"{p}.attention.output.dense") + x, f"{p}.attention.output.LayerNorm")
            y = dense(f.gelu(dense(x, f"{p}.intermediate.dense")), f"{p}.output.dense")
            x = norm(y + x, f"{p}.output.LayerNorm")
        m = mask.unsqueeze(-1).float()
        pooled = (x * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return f.normalize(pooled, p=2, dim=1)
