"""The endurance judge (stam/deletion/judge.py) against a local OpenAI-compatible endpoint: one function under
test, what it sends and how it reads the reply. Labels from the real local model are the evidence of issue 16's
closing note, not of this test."""

from __future__ import annotations

import asyncio
import json
from datetime import date
from pathlib import Path
from typing import Any

from aiohttp import web

from schemas import AtomicMemory, Category, CodeSystem, Coding
from stam.deletion.judge import (
    ENDURANCE,
    Label,
    agreement,
    by_type,
    code_labels,
    examples,
    judge_type,
    read_labels,
    write_labels,
)
from stam.deletion.labels import Endurance
from stam.llm.client import LLMClient


def _mem(i: int, code: str, display: str, text: str, category: Category = Category.OBSERVATION) -> AtomicMemory:
    return AtomicMemory(memory_id=f"m{i}", patient_id="patient-7731", entry_id=f"entry-{i}", category=category, text=text,
                        concept=Coding(system=CodeSystem.LOINC.value, code=code, display=display), position=0)


async def _serve(replies: list[str], seen: list[dict[str, Any]]) -> tuple[web.AppRunner, int]:
    async def chat(request: web.Request) -> web.Response:
        seen.append(await request.json())
        content = replies.pop(0) if replies else '{"endurance": "uncertain"}'
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": content}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def test_the_judge_sees_the_concept_and_three_spread_examples_and_its_verdict_is_recorded() -> None:
    seen: list[dict[str, Any]] = []
    runner, port = await _serve(['{"endurance": "safe-to-forget"}', "not json", '{"endurance": "maybe"}'], seen)
    try:
        client = LLMClient(f"http://127.0.0.1:{port}/v1", "qwen-judge", timeout_s=5)
        glucose = [_mem(i, "2339-0", "Glucose", f"Glucose {100 + i} mg/dL") for i in range(7)]
        label = await asyncio.to_thread(judge_type, client, glucose, today=date(2026, 11, 25))
        assert label == Label(f"{CodeSystem.LOINC.value}|2339-0", Endurance.SAFE, "judge", "qwen-judge",
                              ENDURANCE.id, "2026-11-25", 3)
        body = seen[0]
        assert body["messages"][0]["content"] in ENDURANCE.text  # system text, then the worked examples
        assert [m["role"] for m in body["messages"]] == ["system"] + ["user", "assistant"] * 3 + ["user"]
        assert all(m["content"].split("\n")[0] in ENDURANCE.text for m in body["messages"][1:-1:2])
        user = body["messages"][-1]["content"]
        assert user.startswith("Concept: observation: Glucose\nExamples:")
        assert [ln for ln in user.splitlines() if ln.startswith("- ")] == [
            "- Glucose 100 mg/dL", "- Glucose 103 mg/dL", "- Glucose 106 mg/dL"]  # first, middle, last
        sent = json.dumps(body)
        assert "patient-7731" not in sent and "entry-" not in sent  # blinded: the facts only, no ids
        assert body["response_format"]["json_schema"]["schema"]["properties"]["endurance"]["enum"] == [
            "safe-to-forget", "uncertain", "never-forget"]
        # Two invalid replies: the type is protected (uncertain) and the label says why.
        failed = await asyncio.to_thread(judge_type, client, glucose[:1], today=date(2026, 11, 25))
        assert failed.endurance is Endurance.UNCERTAIN and failed.note.startswith("no valid verdict")
    finally:
        await runner.cleanup()


def test_labels_round_trip_and_the_sources_are_compared(tmp_path: Path) -> None:
    hr = [_mem(1, "8867-4", "Heart rate", "Heart rate 80 /min")]
    glucose = [_mem(2, "2339-0", "Glucose", "Glucose 110 mg/dL")]
    types = by_type([*hr, *glucose])
    codes = code_labels(types, today=date(2026, 11, 25))
    assert [(x.concept_type.split("|")[1], x.endurance) for x in codes] == [("8867-4", Endurance.SAFE)]
    judge = [Label(codes[0].concept_type, Endurance.UNCERTAIN, "judge", "m", ENDURANCE.id, "2026-11-25", 1),
             Label(f"{CodeSystem.LOINC.value}|2339-0", Endurance.SAFE, "judge", "m", ENDURANCE.id, "2026-11-25", 1)]
    assert agreement(codes, judge) == {"types_both": 1, "agree": 0.0,
                                       "codes_vs_judge": {"safe-to-forget / uncertain": 1}}
    path = tmp_path / "labels.jsonl"
    assert write_labels(path, [*codes, *judge]) == 3
    assert read_labels(path) == [*codes, *judge]
    assert json.loads(path.read_text().splitlines()[0])["endurance"] == "safe-to-forget"
    assert examples(hr * 2) == ["Heart rate 80 /min"]  # distinct texts only


def test_splits_are_by_type_and_the_head_learns_a_separable_set(tmp_path: Path) -> None:
    import numpy as np
    import pytest

    from stam.deletion.scorer import Head, render, split_types, train

    labels = {f"t{i}": (Endurance.SAFE, Endurance.UNCERTAIN, Endurance.NEVER_FORGET)[i % 3] for i in range(30)}
    split = split_types(labels, seed=1)
    assert set(split) == set(labels) and set(split.values()) == {"train", "dev", "calibration"}
    for e in Endurance:  # stratified: 10 types per label cut 5 / 2 / 3
        mine = [split[t] for t, x in labels.items() if x is e]
        assert (mine.count("train"), mine.count("dev"), mine.count("calibration")) == (5, 2, 3)
    assert split_types(labels, seed=1) == split and split_types(labels, seed=2) != split
    with pytest.raises(ValueError):
        split_types(labels, (0.5, 0.5, 0.0))

    rng = np.random.default_rng(0)
    types = [f"t{i}" for i in range(40) for _ in range(1 + (i % 5) * 10)]  # types of very different sizes
    safe = np.asarray([int(t[1:]) % 2 for t in types], dtype=np.float32)
    x = rng.normal(size=(len(types), 8)).astype(np.float32) + np.outer(safe * 2 - 1, np.ones(8)) * 1.5
    head = train(x, safe, encoder="test", types=types)
    scores = head.score(x)
    assert scores[safe == 1].min() > scores[safe == 0].max() - 0.5
    assert ((scores > 0.5) == (safe == 1)).mean() > 0.95
    head.save(tmp_path / "head.npz")
    again = Head.load(tmp_path / "head.npz")
    assert np.allclose(again.score(x), scores) and again.trained_on == head.trained_on
    with pytest.raises(ValueError):
        train(x, np.ones_like(safe), encoder="test", types=types)
    assert render(_mem(1, "8867-4", "Heart rate", "Heart rate 80 /min")) == "observation | Heart rate | Heart rate 80 /min"
