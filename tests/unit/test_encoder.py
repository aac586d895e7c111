"""stam.encoder (the packaged MiniLM on torch alone) gives SentenceTransformer's vectors and transformers' token
counts, on real record text: Synthea notes longer than the 256-token window, MIMIC-IV lab names, and edge cases."""

from __future__ import annotations

import base64
import csv
import gzip
import json
import subprocess
import sys

import numpy as np
import pytest

from stam.embedding import resolve_model_path
from tests.conftest import DATA, REPO

NOTES = DATA / "synthea-bulk-10p" / "DocumentReference.000.ndjson"
LABS = DATA / "mimic-iv-demo-2.2" / "hosp" / "d_labitems.csv.gz"


@pytest.fixture(scope="module")
def texts() -> list[str]:
    if not NOTES.is_file() or not LABS.is_file():
        pytest.skip(f"shared data folder not found at {DATA} (set STAM_SHARED_DATA)")
    out = []
    with NOTES.open() as fh:
        for _, line in zip(range(12), fh, strict=False):
            out.append(base64.b64decode(json.loads(line)["content"][0]["attachment"]["data"]).decode())
    with gzip.open(LABS, "rt") as fh:
        out += [f"{r['label']} ({r['fluid']}, {r['category']})" for _, r in zip(range(80), csv.DictReader(fh),
                                                                                strict=False)]
    return out + ["", "  padded  ", "Café crème, naïve résumé", "日本語のテキスト", "a" * 3000,
                  "Potassium 4.1 mEq/L\n\t[current]"]


def test_the_vectors_are_sentence_transformers(texts: list[str]) -> None:
    from sentence_transformers import SentenceTransformer

    from stam import encoder

    path = resolve_model_path("all-MiniLM-L6-v2")
    bert = encoder.load(path)
    assert bert is not None and bert.dim == 384 and bert.max_seq_length == 256
    ours = bert.encode(texts)
    theirs = SentenceTransformer(path, device="cpu").encode(texts, batch_size=64, normalize_embeddings=True,
                                                             convert_to_numpy=True, show_progress_bar=False)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape == (len(texts), 384)
    assert float(np.abs(ours - theirs).max()) < 1e-5
    # the notes are longer than the model's window: truncated as SentenceTransformer truncates them
    from stam.read.tokens import load_tokenizer

    assert sum(n > 256 for n in load_tokenizer("all-MiniLM-L6-v2").count_many(texts)) >= 3


def test_the_token_counts_are_transformers(texts: list[str]) -> None:
    from transformers import AutoTokenizer

    from stam.read.tokens import HFTokenizer, WordPieceTokenizer, load_tokenizer

    ours = load_tokenizer("all-MiniLM-L6-v2")
    assert isinstance(ours, WordPieceTokenizer)
    tok = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    tok.model_max_length = 10**9
    theirs = HFTokenizer(tok, "all-MiniLM-L6-v2")
    assert ours.count_many(texts) == theirs.count_many(texts)
    assert [ours.count(t) for t in texts] == [theirs.count(t) for t in texts]
    assert max(ours.count_many(texts)) > 256  # never truncated: counting, not encoding


def test_embedding_and_counting_do_not_import_transformers() -> None:
    code = ("import sys\nfrom stam.embedding import Embedder\nfrom stam.read.tokens import load_tokenizer\n"
            "v = Embedder().embed(['Potassium 4.1 mEq/L'])\nassert v.shape == (1, 384)\n"
            "assert load_tokenizer('all-MiniLM-L6-v2').count('Potassium') > 0\n"
            "print(sorted(m for m in ('transformers', 'sentence_transformers', 'scipy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_another_shape_of_model_is_not_taken(tmp_path: object) -> None:
    from pathlib import Path

    from stam import encoder

    assert encoder.load(Path(str(tmp_path))) is None  # no modules.json: SentenceTransformer loads it
