"""Teacher traces and LoRA training inputs: the split is by patient and stable, gold patients are never chosen,
the loss mask covers exactly the prompt, and adapters record their patients. (A real teacher run and a real
training run are in tests/integration/test_training_run.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stam.reasoning.traces import Trace, TraceWriter, read_traces
from stam_lab.training.teacher import choose_notes, excluded_patients, is_validation, note_patient, split
from tests.conftest import DATA

BULK = DATA / "synthea-bulk-10p"
GOLD = Path(__file__).resolve().parents[2] / "benchmarks" / "gold" / "synthea_notes.json"


def trace(patient: str, module: str = "extract", reply: str = '{"facts":[]}') -> Trace:
    return Trace(module=module, purpose="extraction" if module == "extract" else "link+update",
                 prompt_id="extract/v1-x", model="teacher", schema_name="Extraction",
                 messages=[{"role": "system", "content": "Extract."}, {"role": "user", "content": f"note of {patient}"}],
                 reply=reply, entry_id=f"e-{patient}", patient_id=patient, attempts=1)


def test_the_split_is_by_patient_stable_and_never_empty(tmp_path: Path) -> None:
    patients = [f"p{i}" for i in range(40)]
    writer = TraceWriter(tmp_path / "all.jsonl")
    for p in patients:
        writer(trace(p))
        writer(trace(p, "update"))
    writer.close()
    chosen = {p: [json.dumps({"id": f"n-{p}"})] for p in patients}
    m = split(tmp_path, chosen, url="u", model="teacher", prompts={}, val_fraction=0.2, seed=3, seconds=1.0,
              failed=[], usage={})
    train_p = {t.patient_id for t in read_traces(tmp_path / "train.jsonl")}
    val_p = {t.patient_id for t in read_traces(tmp_path / "val.jsonl")}
    assert train_p and val_p and not train_p & val_p and train_p | val_p == set(patients)
    assert set(m["splits"]["val"]["patients"]) == val_p == {p for p in patients if is_validation(p, 3, 0.2)}
    assert m["splits"]["train"]["traces"] == {"extract": len(train_p), "update": len(train_p)}
    assert (tmp_path / "train.jsonl").stat().st_mode & 0o777 == 0o600 and not (tmp_path / "all.jsonl").exists()
    # Two patients and a small fraction: one still goes to validation.
    small = tmp_path / "small"
    small.mkdir()
    w = TraceWriter(small / "all.jsonl")
    w(trace("a"))
    w(trace("b"))
    w.close()
    m2 = split(small, {"a": ['{"id": "n-a"}'], "b": ['{"id": "n-b"}']}, url="u", model="t", prompts={},
               val_fraction=0.01, seed=0, seconds=0, failed=[], usage={})
    assert len(m2["splits"]["val"]["patients"]) == 1 and len(m2["splits"]["train"]["patients"]) == 1


@pytest.mark.skipif(not BULK.is_dir(), reason="shared data not present")
def test_gold_patients_are_never_chosen_and_choices_are_seeded() -> None:
    exclude = excluded_patients(BULK, [GOLD])
    assert len(exclude) >= 1
    a = choose_notes(BULK, notes=30, per_patient=5, exclude=exclude, seed=1)
    b = choose_notes(BULK, notes=30, per_patient=5, exclude=exclude, seed=1)
    assert a == b and sum(len(v) for v in a.values()) == 30
    assert not set(a) & exclude
    for patient, lines in a.items():
        assert len(lines) <= 5 and all(note_patient(json.loads(line)) == patient for line in lines)
    assert choose_notes(BULK, notes=30, per_patient=5, exclude=exclude, seed=2) != a


@pytest.mark.extras
def test_the_loss_mask_covers_the_prompt_and_nothing_else() -> None:
    pytest.importorskip("peft", reason="the train extra is not installed")
    from transformers import AutoTokenizer

    from stam.errors import WeightsError
    from stam.llm.convert import ensure_hf
    from stam_lab.training.lora import IGNORE, encode

    try:
        base = ensure_hf("qwen2.5-coder-0.5b-instruct-q4_k_m")
    except WeightsError as exc:
        pytest.skip(str(exc))
    tok = AutoTokenizer.from_pretrained(str(base))
    t = trace("p1", reply='{"facts":[{"category":"medication","name":"ibuprofen","status":"active"}]}')
    ids, labels = encode(tok, t)
    n_prompt = sum(1 for x in labels if x == IGNORE)
    assert len(ids) == len(labels) and labels[:n_prompt] == [IGNORE] * n_prompt and IGNORE not in labels[n_prompt:]
    answer = tok.decode(ids[n_prompt:])
    assert answer.startswith(t.reply) and answer[len(t.reply):].strip() == "<|im_end|>"
    assert tok.decode(ids[:n_prompt]).endswith("<|im_start|>assistant\n")


def test_train_lora_refuses_missing_traces_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from stam.cli import main

    (tmp_path / "train.jsonl").write_text(json.dumps(trace("p1", "update").as_dict()) + "\n")
    (tmp_path / "val.jsonl").write_text("")
    assert main(["train", "lora", "--module", "extract", "--traces", str(tmp_path), "--out",
                 str(tmp_path / "a")]) == 2
    assert capsys.readouterr().err.strip() == f"stam train lora: no extract traces in {tmp_path}/train.jsonl"
    (tmp_path / "val.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="val.jsonl:1: not a trace"):
        list(read_traces(tmp_path / "val.jsonl"))


def test_erasure_finds_the_adapters_and_trace_sets_that_learnt_from_a_patient(tmp_path: Path) -> None:
    from stam.erase.lineage import trained_on
    from stam.serving.adapters import META

    a = tmp_path / "adapters" / "extract"
    a.mkdir(parents=True)
    (a / META).write_text(json.dumps({"trained": True, "patients": ["p1", "p2"], "validation_patients": ["p3"]}))
    b = tmp_path / "adapters" / "update"
    b.mkdir()
    (b / META).write_text(json.dumps({"trained": True, "patients": ["p2"], "validation_patients": []}))
    t = tmp_path / "traces"
    t.mkdir()
    (t / "manifest.json").write_text(json.dumps({"splits": {"train": {"patients": ["p1"]}, "val": {"patients": ["p3"]}}}))
    (tmp_path / "other.json").write_text("not json")
    assert trained_on("p1", [tmp_path]) == {"adapters": [str(a)], "trace_sets": [str(t)]}
    assert trained_on("p3", [tmp_path]) == {"adapters": [str(a)], "trace_sets": [str(t)]}
    assert trained_on("p2", [tmp_path]) == {"adapters": [str(a), str(b)], "trace_sets": []}
    assert trained_on("p9", [tmp_path, tmp_path / "missing"]) == {"adapters": [], "trace_sets": []}
    running = tmp_path / "running"  # a teacher run not finished yet: its plan names the patients
    running.mkdir()
    (running / "plan.json").write_text(json.dumps({"teacher": "t", "notes": {"p9": ["n1"]}}))
    assert trained_on("p9", [tmp_path]) == {"adapters": [], "trace_sets": [str(running)]}


@pytest.mark.skipif(not BULK.is_dir(), reason="shared data not present")
def test_an_unfinished_teacher_run_is_never_overwritten_and_resumes_only_the_same_plan(tmp_path: Path) -> None:
    from stam.errors import TrainingError
    from stam_lab.training.teacher import collect

    exclude = excluded_patients(BULK, [GOLD])
    kw = {"url": "http://127.0.0.1:9/v1", "notes": 3, "per_patient": 3, "exclude": exclude, "progress": False}
    (tmp_path / "plan.json").write_text("{}")  # a run that stopped midway left its plan
    with pytest.raises(TrainingError, match="unfinished teacher run; give --resume"):
        collect(BULK, tmp_path, model="teacher", **kw)  # type: ignore[arg-type]
    with pytest.raises(TrainingError, match="another teacher, prompt version or choice of notes"):
        collect(BULK, tmp_path, model="teacher", resume=True, **kw)  # type: ignore[arg-type]
    assert (tmp_path / "plan.json").read_text() == "{}"


def test_a_training_sample_is_seeded_and_keeps_file_order() -> None:
    from stam_lab.training.lora import sample

    items = [trace(f"p{i}") for i in range(20)]
    a, b = sample(items, 5, seed=1), sample(items, 5, seed=1)
    assert a == b and len(a) == 5 and sample(items, 5, seed=2) != a
    assert [items.index(t) for t in a] == sorted(items.index(t) for t in a)
    assert sample(items, 0, seed=1) == items and sample(items, 50, seed=1) == items


def test_an_adapter_on_a_read_only_volume_is_converted_into_the_model_cache(tmp_path: Path, monkeypatch:
                                                                             pytest.MonkeyPatch) -> None:
    import os

    from stam.serving.gguf_lora import default_out

    adapter = tmp_path / "mounted" / "extract"
    adapter.mkdir(parents=True)
    assert default_out(adapter) == adapter / "adapter.gguf"
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == adapter else real(p, mode))
    monkeypatch.setenv("STAM_MODEL_CACHE", str(tmp_path / "cache"))
    out = default_out(adapter)
    assert out.parent == tmp_path / "cache" / "loras" and out.name.startswith("extract-") and out.suffix == ".gguf"
    assert default_out(adapter) == out  # the same folder, the same file: converted once


def test_replies_are_learnt_as_compact_json_of_the_same_value() -> None:
    from stam_lab.training.lora import compact

    pretty = '{\n  "new_is": "current",\n  "links": [\n    {\n      "n": 1,\n      "type": "restatement"\n    }\n  ]\n}'
    assert compact(pretty) == '{"new_is":"current","links":[{"n":1,"type":"restatement"}]}'
    assert json.loads(compact(pretty)) == json.loads(pretty)
    assert compact('{"name": "café"}') == '{"name":"café"}' and compact("not json") == "not json"


def test_the_device_check_builds_a_tiny_model_of_the_students_architecture(tmp_path: Path) -> None:
    """benchmarks.lora_device's stand-in for a student whose weights cannot travel: same architecture and
    vocabulary, two layers, loadable, its tokenizer files copied beside it."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from benchmarks.lora_device import tiny_model

    source = tmp_path / "student"
    Qwen2Config(vocab_size=512, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, intermediate_size=4864).save_pretrained(source)
    (source / "chat_template.jinja").write_text("{{ messages }}")
    model = AutoModelForCausalLM.from_pretrained(tiny_model(source, tmp_path / "tiny"))
    assert model.config.model_type == "qwen2" and model.config.vocab_size == 512
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert (tmp_path / "tiny" / "chat_template.jinja").read_text() == "{{ messages }}"


def test_the_reply_only_loss_is_the_full_causal_lm_loss(tmp_path: Path) -> None:
    """Training computes logits only where a reply token is predicted; the loss is HF's own with the prompt
    masked, to float precision, and an example without a prompt is refused."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from stam.errors import TrainingError
    from stam_lab.training.lora import IGNORE, response_loss

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64)).eval()
    ids = [5, 17, 42, 9, 250, 3, 77, 120]
    labels = [IGNORE] * 5 + ids[5:]
    full = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss
    assert torch.allclose(response_loss(model, ids, labels, "cpu"), full, atol=1e-5)
    with pytest.raises(TrainingError):
        response_loss(model, ids, list(ids), "cpu")
