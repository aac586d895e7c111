"""The packaged GGUF weights as a bf16 safetensors folder, for vLLM and for training with peft.

vLLM's CPU build and peft need Hugging Face weights, not GGUF. The folder is made once from the joined,
verified GGUF (:func:`stam.llm.weights.ensure_gguf`) and cached beside it (``STAM_MODEL_CACHE``):
``<name>.hf/`` with ``config.json``, ``model.safetensors``, the tokenizer and its chat template. transformers
de-quantises the GGUF tensors (``GgufConfig(dequantize=True)``); a model loaded with ``gguf_file=`` refuses to
serialise, so its state dict is copied into a model built ``from_config`` and that one is saved. A marker file
(``.converted``) is written last, so an interrupted conversion is redone, never half used.

Needs the ``train`` extra (``gguf``, ``accelerate``; ``make vllm-setup`` installs it). About 45 s for the 0.5B here.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from stam.errors import WeightsError
from stam.llm.weights import MODELS, cache_dir, ensure_gguf

MARKER = ".converted"


def hf_dir(name: str) -> Path:
    return cache_dir() / f"{name}.hf"


def ensure_hf(name: str) -> Path:
    """The bf16 safetensors folder of packaged model ``name`` (converted on first use)."""
    if name not in MODELS:
        raise WeightsError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    target = hf_dir(name)
    gguf = ensure_gguf(name)
    marker = target / MARKER
    if marker.is_file():
        try:
            if json.loads(marker.read_text()).get("gguf_sha256") == MODELS[name].sha256:
                return target
        except ValueError:
            pass
    # transformers needs gguf and accelerate to read GGUF weights, and says so only deep inside the conversion.
    missing = [m for m in ("gguf", "accelerate", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise WeightsError(f"converting {name} needs the train extra (make vllm-setup, or pip install -e "
                           f"'.[train]'); missing: {', '.join(missing)}")
    # deferred: torch, transformers are slow to import
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16,
                                                  quantization_config=GgufConfig(dequantize=True))
    config = loaded.config
    config.name_or_path = name
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    if missing or unexpected:
        raise WeightsError(f"{name}: converted weights do not fit the model (missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]})")
    fresh.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(target, ignore_errors=True)
    tmp.replace(target)
    (target / MARKER).write_text(json.dumps({"gguf": gguf.name, "gguf_sha256": MODELS[name].sha256,
                                             "dtype": "bfloat16"}) + "\n")
    return target
