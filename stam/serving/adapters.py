"""LoRA adapters in peft's format: the target modules of the paper's recipe, and an untrained adapter.

An *untrained* adapter (both LoRA matrices random, seeded) changes a model's output without having learnt
anything; it is what the serving checks load when no trained adapter is given, and it says so in its
``stam_adapter.json`` (``"trained": false``). Trained adapters come from ``stam train lora`` (the lab part,
``stam_lab.training``); what serving and erasure read of one (``read_meta``, ``META``) is here, in the product.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# All attention and MLP projections of a Qwen2 / Llama-style decoder layer (the paper's recipe).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
META = "stam_adapter.json"


def read_meta(folder: Path) -> dict[str, Any]:
    """What STAM recorded about an adapter (module, base model, patients it learnt from); {} if nothing."""
    path = Path(folder) / META
    return json.loads(path.read_text()) if path.is_file() else {}


def untrained_adapter(base: Path, out: Path, *, rank: int = 8, alpha: int = 16, seed: int = 0,
                      scale: float = 0.02) -> Path:
    """A randomly initialised LoRA adapter for the model in ``base`` (an HF folder), saved to ``out``.

    peft's random B matrices, times ``scale``: at full size (and at 0.2) the update is larger than the weights
    it adapts and the 0.5B answers with random tokens; at 0.02 its answer changes but stays a model's answer."""
    # deferred: optional peft (stam[train]), not installed everywhere; torch, transformers are slow to import
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    meta = read_meta(out)
    if (out / "adapter_config.json").is_file() and (meta.get("seed"), meta.get("scale")) == (seed, scale):
        return out
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(TARGET_MODULES), lora_dropout=0.0,
                        init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out))
    (out / META).write_text(json.dumps({"trained": False, "seed": seed, "scale": scale, "rank": rank, "alpha": alpha,
                                        "base": base.name, "patients": []}, indent=1) + "\n")
    return out
