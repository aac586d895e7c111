"""``stam train lora``: one LoRA adapter per write module, trained with peft on teacher traces.

The paper's recipe (appendix "Write-Module Fine-Tuning") is the default: rank 32, alpha 64, dropout 0.05 on all
attention and MLP projections, learning rate 1e-4 with a linear warm-up over the first 3% of steps (then linear
decay), gradient clipping at 1.0, an effective batch of 8 (micro-batches of 1, gradients accumulated), at most two
epochs, cross-entropy on the teacher's response tokens only (the prompt is masked from the loss). Replies are
learnt as compact JSON (the teacher's value, without the whitespace an engine may have let it print).

Inputs are the traces of ``stam train traces`` (``train.jsonl`` and ``val.jsonl``, split by patient), filtered
to the module. Each trace becomes the chat template of its messages plus the teacher's reply. Validation loss is
measured before training and after every epoch; each epoch is saved as a checkpoint and the best one (lowest
validation loss) becomes the adapter. The adapter folder records the base model, the module, the recipe and the
patients whose traces it learnt from (``stam_adapter.json``), so erasing a patient can find it.

Runs on a CUDA GPU when torch sees one (bf16), else on CPU (float32: bf16 matmuls are slow on AVX2 CPUs).
"""

from __future__ import annotations

import json
import math
import random
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stam.errors import TrainingError
from stam.reasoning.traces import MODULE_OF, Trace, read_traces
from stam.serving.adapters import META, TARGET_MODULES

IGNORE = -100
MODULES = sorted(set(MODULE_OF.values()))


@dataclass(frozen=True)
class Recipe:
    rank: int = 32
    alpha: int = 64
    dropout: float = 0.05
    learning_rate: float = 1e-4
    warmup_ratio: float = 0.03
    max_grad_norm: float = 1.0
    batch_size: int = 8
    """Effective batch: micro-batches of one trace, gradients accumulated over this many."""
    epochs: int = 2
    max_steps: int = 0
    """Stop after this many optimiser steps (0: the epochs decide); for smoke runs."""
    max_length: int = 2048
    """Longer examples are dropped (counted in the report), never truncated into a reply without its end."""
    seed: int = 0
    target_modules: tuple[str, ...] = field(default=TARGET_MODULES)


def load_split(folder: Path, split: str, module: str) -> list[Trace]:
    path = Path(folder) / f"{split}.jsonl"
    if not path.is_file():
        raise TrainingError(f"{path} not found (stam train traces writes train.jsonl and val.jsonl)")
    return [t for t in read_traces(path) if t.module == module]


def check_traces(module: str, traces: Path) -> None:
    """Refuse a module or trace folder that cannot train, before anything costly (the base model's conversion)."""
    if module not in MODULES:
        raise TrainingError(f"unknown module {module!r} (known: {', '.join(MODULES)})")
    if not load_split(traces, "train", module):
        raise TrainingError(f"no {module} traces in {traces}/train.jsonl")
    load_split(traces, "val", module)


def compact(reply: str) -> str:
    """The teacher's JSON reply without free whitespace (the same value; what vLLM's grammar lets the student say,
    and fewer tokens to learn and to generate). A reply that is not JSON is kept as it is."""
    try:
        return json.dumps(json.loads(reply), ensure_ascii=False, separators=(",", ":"))
    except ValueError:
        return reply


def encode(tokenizer: Any, trace: Trace) -> tuple[list[int], list[int]]:
    """Token ids of prompt + reply (compacted), and labels with the prompt masked (loss on the reply only)."""
    prompt = tokenizer.apply_chat_template(trace.messages, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template([*trace.messages, {"role": "assistant", "content": compact(trace.reply)}],
                                         tokenize=False)
    if not full.startswith(prompt):
        raise TrainingError("the chat template does not extend the prompt with the reply; cannot mask the prompt")
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r_ids = tokenizer(full[len(prompt):], add_special_tokens=False)["input_ids"]
    return p_ids + r_ids, [IGNORE] * len(p_ids) + r_ids


def response_loss(model: Any, ids: list[int], labels: list[int], device: Any) -> Any:
    """Mean cross-entropy over the reply tokens, HF's causal-LM loss with these labels, but the vocabulary
    projection is computed only where a reply token is predicted (``logits_to_keep``): the prompt is most of each
    example, and its 151,936-wide logits were computed and kept for nothing."""
    # deferred: torch is slow to import (kept off `stam --help`)
    import torch

    first = next((i for i, lab in enumerate(labels) if lab != IGNORE), None)
    if first is None or first == 0:
        raise TrainingError("an example needs a prompt and a reply")
    out = model(input_ids=torch.tensor([ids], device=device), logits_to_keep=len(ids) - first + 1)
    logits = out.logits[0, :-1].float()  # position first-1 predicts token first, ..., the last but one the last
    return torch.nn.functional.cross_entropy(logits, torch.tensor(labels[first:], device=device))


def peak_rss_mb() -> float:
    """Peak resident memory of this process (Linux reports KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def sample(items: list[Trace], n: int, seed: int) -> list[Trace]:
    """At most ``n`` of ``items`` (0: all), a seeded choice kept in file order."""
    if not n or len(items) <= n:
        return items
    keep = set(random.Random(seed).sample(range(len(items)), n))
    return [t for i, t in enumerate(items) if i in keep]


def train(module: str, traces: Path, base: Path, out: Path, recipe: Recipe = Recipe(), *,
          base_name: str = "", progress: bool = True, max_train: int = 0, max_val: int = 0) -> dict[str, Any]:
    """Train the ``module`` adapter on ``traces`` over the HF model in ``base``; returns the report.

    ``max_train`` / ``max_val`` (0: all) take a seeded sample of the traces, for a CPU where each example costs
    seconds (a note gives one extraction trace but a dozen judgements). The adapter lists the patients of the
    traces it used."""
    # deferred: torch, transformers are slow to import (kept off `stam --help`)
    import torch
    from transformers import AutoTokenizer

    base_name = base_name or base.name.removesuffix(".hf")  # stam.llm.convert names folders <model>.hf
    if module not in MODULES:
        raise TrainingError(f"unknown module {module!r} (known: {', '.join(MODULES)})")
    all_train, all_val = load_split(traces, "train", module), load_split(traces, "val", module)
    available = {"train": len(all_train), "val": len(all_val)}
    train_traces, val_traces = sample(all_train, max_train, recipe.seed), sample(all_val, max_val, recipe.seed)
    if not train_traces:
        raise TrainingError(f"no {module} traces in {traces}/train.jsonl")
    random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    train_set, train_dropped = _examples(tokenizer, train_traces, recipe.max_length)
    val_set, val_dropped = _examples(tokenizer, val_traces, recipe.max_length)
    if not train_set:
        raise TrainingError(f"every {module} training trace is longer than max_length {recipe.max_length}")
    fit = _Fit(base, recipe, device, dtype, len(train_set), val_set)
    started = time.perf_counter()
    history, best, step_seconds = fit.run(train_set, out, f"lora {module}", progress)
    chosen = out / f"checkpoint-epoch{best}"
    # The adapter itself: the best checkpoint's files at the top of the folder.
    for f in chosen.iterdir():
        if f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    patients = sorted({t.patient_id for t in train_traces if t.patient_id})
    val_patients = sorted({t.patient_id for t in val_traces if t.patient_id})
    report: dict[str, Any] = {
        "module": module, "base": base_name, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "recipe": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(recipe).items()},
        "trainable_parameters": fit.trainable, "train_traces": len(train_set), "val_traces": len(val_set),
        "traces_available": available,
        "dropped_too_long": {"train": train_dropped, "val": val_dropped},
        "steps": fit.step, "steps_per_epoch": fit.steps_per_epoch, "warmup_steps": fit.warmup,
        "seconds": round(time.perf_counter() - started, 1),
        "seconds_per_step": round(sum(step_seconds) / max(1, len(step_seconds)), 2),
        "peak_rss_mb": peak_rss_mb(),
        "peak_gpu_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None,
        "history": history, "chosen_epoch": best, "adapter": str(out),
    }
    (out / META).write_text(json.dumps({
        "trained": True, "module": module, "base": base_name, "patients": patients,
        "validation_patients": val_patients, "traces": str(traces), "recipe": report["recipe"],
        "chosen_epoch": best}, indent=1) + "\n")
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def _examples(tokenizer: Any, items: list[Trace], max_length: int) -> tuple[list[tuple[list[int], list[int]]], int]:
    """The encoded traces (ids, labels) no longer than ``max_length``, and how many were longer (dropped)."""
    kept, dropped = [], 0
    for t in items:
        ids, labels = encode(tokenizer, t)
        if len(ids) > max_length:
            dropped += 1
            continue
        kept.append((ids, labels))
    return kept, dropped


class _Fit:
    """The adapter being trained: the base model with LoRA, the optimiser and the learning-rate schedule of the
    recipe, validation, and the epochs (a checkpoint each)."""

    def __init__(self, base: Path, recipe: Recipe, device: Any, dtype: Any, n_train: int,
                 val_set: list[tuple[list[int], list[int]]]) -> None:
        # deferred: optional peft (stam[train]), not installed everywhere; torch, transformers are slow to import
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        model: Any = AutoModelForCausalLM.from_pretrained(str(base), dtype=dtype)
        model.to(device)
        model.config.use_cache = False
        config = LoraConfig(r=recipe.rank, lora_alpha=recipe.alpha, lora_dropout=recipe.dropout,
                            target_modules=list(recipe.target_modules), task_type="CAUSAL_LM")
        self.model: Any = get_peft_model(model, config)
        self.recipe, self.device, self.val_set = recipe, device, val_set
        self.trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.steps_per_epoch = math.ceil(n_train / recipe.batch_size)
        total_steps = self.steps_per_epoch * recipe.epochs
        if recipe.max_steps:
            total_steps = min(total_steps, recipe.max_steps)
        warmup = max(1, math.ceil(recipe.warmup_ratio * total_steps))
        self.total_steps, self.warmup, self.step = total_steps, warmup, 0
        self.optimiser = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad],
                                           lr=recipe.learning_rate)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimiser,
            lambda s: (s + 1) / warmup if s < warmup else max(0.0, (total_steps - s) / max(1, total_steps - warmup)))

    def loss_of(self, ids: list[int], labels: list[int]) -> Any:
        return response_loss(self.model, ids, labels, self.device)

    def validate(self) -> float | None:
        """Mean validation loss (None without validation traces)."""
        # deferred: torch is slow to import (kept off `stam --help`)
        import torch

        if not self.val_set:
            return None
        self.model.eval()
        with torch.no_grad():
            total = sum(float(self.loss_of(i, lab)) for i, lab in self.val_set)
        self.model.train()
        return round(total / len(self.val_set), 4)

    def batch(self, examples: list[tuple[list[int], list[int]]]) -> float:
        """One optimiser step over ``examples`` (gradients accumulated); its loss."""
        # deferred: torch is slow to import (kept off `stam --help`)
        import torch

        self.optimiser.zero_grad()
        batch_loss = 0.0
        for ids, labels in examples:
            loss = self.loss_of(ids, labels) / len(examples)
            loss.backward()
            batch_loss += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe.max_grad_norm)
        self.optimiser.step()
        self.scheduler.step()
        self.step += 1
        return batch_loss

    def run(self, train_set: list[tuple[list[int], list[int]]], out: Path, desc: str,
            progress: bool) -> tuple[list[dict[str, Any]], int, list[float]]:
        """The epochs, each saved as a checkpoint under ``out``: the history, the best epoch (lowest validation
        loss, else training loss) and each step's seconds."""
        # deferred: tqdm is slow to import (kept off `stam --help`)
        from tqdm import tqdm

        history: list[dict[str, Any]] = [{"epoch": 0, "step": 0, "val_loss": self.validate()}]
        best: tuple[float, int] | None = None
        step_seconds: list[float] = []
        bar = tqdm(total=self.total_steps, desc=desc, unit="step", file=sys.stderr, disable=not progress)
        self.model.train()
        out.mkdir(parents=True, exist_ok=True)
        for epoch in range(1, self.recipe.epochs + 1):
            if self.step >= self.total_steps:
                break
            order = list(range(len(train_set)))
            random.shuffle(order)
            losses: list[float] = []
            for start in range(0, len(order), self.recipe.batch_size):
                if self.step >= self.total_steps:
                    break
                t0 = time.perf_counter()
                batch_loss = self.batch([train_set[i] for i in order[start:start + self.recipe.batch_size]])
                losses.append(batch_loss)
                step_seconds.append(time.perf_counter() - t0)
                bar.update(1)
                bar.set_postfix(loss=f"{batch_loss:.3f}")
            val = self.validate()
            checkpoint = out / f"checkpoint-epoch{epoch}"
            self.model.save_pretrained(str(checkpoint))
            history.append({"epoch": epoch, "step": self.step,
                            "train_loss": round(sum(losses) / max(1, len(losses)), 4), "val_loss": val,
                            "checkpoint": checkpoint.name})
            score = val if val is not None else history[-1]["train_loss"]
            if best is None or score < best[0]:
                best = (score, epoch)
        bar.close()
        assert best is not None
        return history, best[1], step_seconds
