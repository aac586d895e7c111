"""Write the JSON Schema of every wire contract to schemas/json/ (``python -m schemas``)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

import schemas

CONTRACTS: dict[str, type[BaseModel]] = {
    "record-entry": schemas.RecordEntry,
    "transition-event": schemas.TransitionEvent,
    "dead-letter": schemas.DeadLetter,
    "extracted-entry": schemas.ExtractedEntry,
    "linked-entry": schemas.LinkedEntry,
    "impacted-entry": schemas.ImpactedEntry,
    "query-request": schemas.QueryRequest,
    "query-answer": schemas.QueryAnswer,
    "erasure-receipt": schemas.ErasureReceipt,
    "deletion-order": schemas.DeletionOrder,
}

OUT = Path(__file__).parent / "json"


def render(model: type[BaseModel]) -> str:
    return json.dumps(model.model_json_schema(), indent=2, sort_keys=True) + "\n"


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for name, model in CONTRACTS.items():
        (OUT / f"{name}.v{schemas.WIRE_VERSION}.json").write_text(render(model))


if __name__ == "__main__":
    main()
