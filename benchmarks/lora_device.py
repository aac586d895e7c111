"""`stam train lora`'s training on whatever accelerator torch sees (a lent GPU), and the adapter's effect.

Trains the extract and the update adapter with ``stam_lab.training.lora.train`` (the function behind
``stam train lora``; the recipe's defaults except ``--max-steps``), then loads the update adapter over its base
and checks that greedy output changes. Prints one JSON line (and writes it to ``--out``/lora-device.json): the
device, dtype, steps, seconds per step, peak GPU memory and losses per module, ``adapter_changed_output``.

It needs only torch, transformers, peft and tqdm beside this repository (``PYTHONPATH=.``), so it runs on a GPU
machine that has no STAM install. ``--base-dir`` is the real student (an HF folder, as ``stam.llm.convert``
writes it). Where the student's weights cannot be brought (the lent GPU machine here takes 64 MiB per call; the
0.5B is 988 MB in bf16), ``--tiny-from`` builds a 2-layer random model with the student's configuration,
tokenizer and chat template instead: it checks the code path (device, dtype, masking, checkpoints, loading),
not what the adapter learns; with ``--full-size`` the random model has the student's size, so seconds per step and
peak memory are the real student's training cost on that device.

Usage: PYTHONPATH=. python3 -m benchmarks.lora_device --traces DIR (--base-dir HF | --tiny-from HF)
       [--full-size] [--max-steps 6] [--lr 1e-4] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from stam.reasoning.traces import read_traces
from stam_lab.eval.provenance import stamp
from stam_lab.training.lora import Recipe, train

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def tiny_model(source: Path, out: Path, full: bool = False) -> Path:
    """A random model with ``source``'s architecture, vocabulary, tokenizer and chat template: 2 layers, 64 wide,
    or (``full``) of the student's own size, whose training costs what the real student's does."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(source)
    if not full:
        cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size = 2, 64, 128
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 2, 16
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:2]
    torch.manual_seed(0)
    fresh: Any = AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]
    fresh.to(torch.bfloat16).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return out


def changed_output(base: Path, adapter: Path, traces: Path) -> bool:
    """Greedy output of the base and of base + adapter on the first validation update prompt differ."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    trace = next(t for t in read_traces(traces / "val.jsonl") if t.module == "update")
    tokenizer: Any = AutoTokenizer.from_pretrained(base)
    ids = tokenizer.apply_chat_template(trace.messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"].to(device)
    model: Any = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    model = model.to(device).eval()
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
        tuned_model: Any = PeftModel.from_pretrained(model, str(adapter))
        tuned_model.eval()
        tuned = tuned_model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    return bool(plain != tuned)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lora_device", description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, required=True, help="a folder with train.jsonl and val.jsonl")
    base = p.add_mutually_exclusive_group(required=True)
    base.add_argument("--base-dir", type=Path, help="the student as an HF folder")
    base.add_argument("--tiny-from", type=Path, help="build a tiny random model from this HF folder's config")
    p.add_argument("--full-size", action="store_true",
                   help="with --tiny-from: the random model has the student's full size (training cost, not effect)")
    p.add_argument("--max-steps", type=int, default=6, help="optimiser steps per module (default 6)")
    p.add_argument("--lr", type=float, default=Recipe().learning_rate,
                   help="learning rate (default the recipe's; a tiny random model needs more to move in a few steps)")
    p.add_argument("--out", type=Path, default=None, help="also write lora-device.json here")
    args = p.parse_args(argv)
    import torch

    work = Path(tempfile.mkdtemp(prefix="stam-lora-device-"))
    try:
        model = args.base_dir or tiny_model(args.tiny_from, work / "tiny", full=args.full_size)
        result: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                                  "torch": torch.__version__, "base": str(model) if args.base_dir else
                                  "random, student's size" if args.full_size else "tiny-random"}
        recipe = Recipe(max_steps=args.max_steps, learning_rate=args.lr)
        for module in ("extract", "update"):
            r = train(module, args.traces, model, work / module, recipe, base_name=model.name, progress=False)
            result[module] = {k: r[k] for k in ("device", "dtype", "steps", "seconds", "seconds_per_step",
                                                "peak_gpu_mb", "peak_rss_mb", "train_traces", "val_traces", "history")}
        result["adapter_changed_output"] = changed_output(model, work / "update", args.traces)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    line = json.dumps(stamp(result))
    print(line)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "lora-device.json").write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
