"""Rendering an evidence packet for a reader, with or without Current/Historical labels.

Labelled (the method's default): ACTIVE items under "Current", HISTORY items under "Historical", each
historical item with why and when it stopped holding and what replaced it. Neutral (``labels=false``): one
list in rank order with no store words, for the rendering controls of the paper's appendix E.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from schemas import Store
from schemas.query import EvidenceItem, QueryRequest
from stam.read.tokens import Tokenizer


def _d(t: datetime | None) -> str:
    return t.date().isoformat() if t else "?"


def render_item(item: EvidenceItem, *, labels: bool) -> str:
    line = f"- [{_d(item.effective_start)}] {item.text}"
    if labels and item.store is Store.HISTORY:
        why = item.reason.value if item.reason else "archived"
        line += f" (no longer current: {why}"
        if item.successor_text:
            line += f"; replaced by: {item.successor_text}"
        line += ")"
    if item.span_text:
        line += "\n  source: " + " ".join(item.span_text.split())
    return line


def render_packet(req: QueryRequest, items: Sequence[EvidenceItem], tokenizer: Tokenizer, *,
                  as_of: datetime | None, as_of_version: int | None) -> tuple[str, list[EvidenceItem], int]:
    """The rendered text, the items kept (by rank within ``token_budget``) and how many were dropped."""
    when = (f" as of {as_of.isoformat()}" if as_of else f" as of state version {as_of_version}"
            if as_of_version is not None else "")
    header = f"Patient record evidence{when}:"
    used = tokenizer.count(header)
    kept: list[EvidenceItem] = []
    for item in sorted(items, key=lambda i: i.rank):
        if req.token_budget is not None and used + item.tokens + 2 > req.token_budget:
            continue  # a lower-ranked, shorter item may still fit
        kept.append(item)
        used += item.tokens + 2  # the section header/newline share, counted conservatively
    dropped = len(items) - len(kept)
    lines = [header]
    if req.labels:
        current = [i for i in kept if i.store is Store.ACTIVE]
        past = [i for i in kept if i.store is Store.HISTORY]
        if current:
            lines.append("Current:")
            lines.extend(render_item(i, labels=True) for i in current)
        if past:
            lines.append("Historical:")
            lines.extend(render_item(i, labels=True) for i in past)
    else:
        lines.extend(render_item(i, labels=False) for i in kept)
    if not kept:
        lines.append("(no memory retrieved)")
    return "\n".join(lines), kept, dropped
