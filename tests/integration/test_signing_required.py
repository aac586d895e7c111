"""Signing required (the default once sources are configured): through the real worker, an unsigned entry is
dead-lettered with the reason and applied nowhere; the same patient's signed entries are applied."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest
from pydantic import SecretStr

from stam.publish import Publisher, PublishSummary
from tests.integration.broker import _dead_letters, collect_outputs
from tests.integration.conftest import _stam_process

pytestmark = pytest.mark.integration

SECRETS = {"ehr-a": "ehr-a-secret-0123456789abcdef"}


def test_an_unsigned_entry_is_dead_lettered_where_signing_is_required(stack_settings: Any, small_bundle: Any) -> None:
    entries = small_bundle.entries
    signed, unsigned = entries[:-1], entries[-1]

    async def send() -> None:
        s = stack_settings.model_copy(update={"sources": SecretStr(json.dumps(SECRETS))})
        async with Publisher(s) as pub:  # a producer that does not sign
            await pub.send_entries([unsigned], PublishSummary())
        async with Publisher(s, source_system="ehr-a") as pub:
            await pub.send_entries(signed, PublishSummary())

    with _stam_process(stack_settings, "worker", "worker-required.log", STAM_SOURCES=json.dumps(SECRETS)):
        asyncio.run(send())
        transitions, _ = asyncio.run(collect_outputs(stack_settings, {e.entry_id for e in signed}, timeout=240))
    applied = {x["entry_id"] for x in transitions}
    assert {e.entry_id for e in signed} <= applied
    assert unsigned.entry_id not in applied
    assert {x["memory"]["source_system"] for x in transitions if x["kind"] == "added"} == {"ehr-a"}
    letters = [d for d in asyncio.run(_dead_letters(stack_settings))
               if unsigned.entry_id.encode() in base64.b64decode(d["value"])]
    # Stage "fused": the default worker's one stage.
    assert len(letters) == 1 and letters[0]["stage"] == "fused" and letters[0]["error_type"] == "SignatureError"
    assert letters[0]["error"].startswith("unsigned entry: signing is required")
