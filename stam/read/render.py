"""Rendering an evidence packet for a reader: one compact block per concept thread, newest first.

A measured value's thread is one line, the current value first with its time, then the earlier ones::

    - Bicarbonate (Blood): 26 mEq/L at 2149-02-14 04:46 [current]; earlier: 24 mEq/L at 2149-02-13 05:10;
      20 mEq/L at 2149-02-12 06:00 (first)

Orders, problems and other facts are one line per source resource (an order's versions together), with start,
end, status and what replaced them, said once::

    - Ciprofloxacin 500 mg PO Q12H: started 2148-01-23 08:00; ended 2148-01-25 14:00 (superseded), changed into
      Levofloxacin 750 mg PO Q24H

Computed facts (``stam.read.select``) come last, next to the question, marked as computed; their tokens are
counted first, so the budget never drops one. ``labels=false`` is the neutral rendering
of the method's appendix (no store words: no ``[current]``, no reasons); times and order stay. ``spans=true``
adds the source text around each memory that has one.

**The current encounter.** When the question's time falls in an admission (``stay_start``: when it began), a value
line marks where it begins ("| before this admission (from 2148-01-20 08:00):" between the values of this stay and
the earlier ones). An order that ended with its admission says so ("ended 2145-07-10 14:00 (at discharge)"); a
current order or medication that names no encounter and no end time says "no end recorded": nothing will end it
but an entry, and none is guessed.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from schemas import Reason, Store
from schemas.query import ComputedFact, EvidenceItem, QueryRequest
from stam.read.tokens import Tokenizer

_TAGS = frozenset({"first", "previous", "highest", "lowest"})
_MIDNIGHT = (0, 0)


def when(t: datetime | None) -> str:
    if t is None:
        return "unknown time"
    return t.strftime("%Y-%m-%d") if (t.hour, t.minute) == _MIDNIGHT and t.second == 0 else t.strftime(
        "%Y-%m-%d %H:%M")


def _before(i: EvidenceItem, stay_start: datetime | None) -> bool:
    return stay_start is not None and i.effective_start is not None and i.effective_start < stay_start


def _value_line(items: Sequence[EvidenceItem], labels: bool, stay_start: datetime | None = None) -> str:
    """One measured concept: current value first, then earlier values newest first; where the current encounter
    begins is marked between a value of it and an earlier one."""
    head, rest = items[0], items[1:]
    name = head.concept or head.text

    def one(i: EvidenceItem, first: bool) -> str:
        s = f"{i.value} at {when(i.effective_start)}"
        if labels and first and i.store is Store.ACTIVE:
            s += " [current]"
        elif labels and first:
            s += " [last recorded]"
        if i.role in _TAGS:
            s += f" ({i.role})"
        return s

    line = f"- {name}: {one(head, True)}"
    if _before(head, stay_start):
        assert stay_start is not None
        line += f" (before this admission, from {when(stay_start)})"
    if rest:
        parts: list[str] = []
        for prev, i in zip(items, rest, strict=False):
            if _before(i, stay_start) and not _before(prev, stay_start):
                assert stay_start is not None
                parts.append(f"| before this admission (from {when(stay_start)}): {one(i, False)}")
            else:
                parts.append(one(i, False))
        line += "; earlier: " + "; ".join(parts)
    return line


def _name(i: EvidenceItem) -> str:
    name = i.concept or i.text
    return f"{name} {i.dosage}" if i.dosage and i.dosage not in name else name


_ORDERS = frozenset({"medication", "order", "careplan"})


def _resource_line(items: Sequence[EvidenceItem], labels: bool, shown: set[str]) -> str:
    """One source resource (an order and its versions, a problem, an encounter): start, end, status, and what
    replaced it when that is another order not shown beside it."""
    newest = items[0]
    active = [i for i in items if i.store is Store.ACTIVE]
    if newest.category.value in ("note", "other") or not newest.concept:
        line = f"- [{when(newest.effective_start)}] {newest.text}"
    else:
        dosed = next((i for i in items if i.dosage), newest)
        start = (active[0] if active else items[-1]).effective_start
        verb = "started" if newest.category.value in _ORDERS else "from"
        line = f"- {_name(dosed)}: {verb} {when(start)}"
        ends = [i.effective_end for i in active if i.effective_end]
        if ends:
            line += f" to {when(max(ends))}"
    if active:
        open_end = newest.category.value in _ORDERS and not any(i.effective_end or i.encounter for i in active)
        return line + ("; no end recorded" if open_end else "") + (" [current]" if labels else "")
    last = max(items, key=_end_key)
    ended = last.ended_at or last.effective_end
    line += f"; ended {when(ended)}" if ended else "; ended"
    if labels and last.reason is not None:
        line += f" ({_REASON_WORDS.get(last.reason, last.reason.value)})"
    if (last.successor_text and last.successor_id not in shown and last.reason is not None
            and last.reason is Reason.SUPERSEDED and newest.category.value in _ORDERS):
        line += f", changed into {last.successor_text}"
    return line


_REASON_WORDS = {Reason.ENCOUNTER_ENDED: "at discharge: its admission ended", Reason.EXPIRED: "expired: its end time"}
"""The lifecycle's reasons in words (the others are their own word)."""
_ORDER_ENDS = frozenset({Reason.STOPPED, Reason.CANCELLED})
"""Reasons an order ends for (rather than changes into another order)."""


def _end_key(i: EvidenceItem) -> float:
    t = i.ended_at or i.effective_end or i.effective_start
    return t.timestamp() if t else float("-inf")


def render_block(items: Sequence[EvidenceItem], *, labels: bool, stay_start: datetime | None = None) -> str:
    """The lines of one thread's items (newest first); ``stay_start``: when the current encounter began."""
    if not items:
        return ""
    if all(i.value is not None and i.category.value == "observation" for i in items):
        lines = [_value_line(items, labels, stay_start)]
    else:
        groups: dict[str, list[EvidenceItem]] = {}
        for i in items:
            key = i.source_ref if i.source_ref and i.concept else i.memory_id
            groups.setdefault(key, []).append(i)
        # An order's end that is its own entry (a POE discontinuation) is said on the order's line.
        ends = {i.successor_id for i in items if i.successor_id and i.reason in _ORDER_ENDS}
        shown = {i.memory_id for i in items}
        lines = [_resource_line(g, labels, shown) for g in groups.values()
                 if not all(i.memory_id in ends and i.store is Store.HISTORY for i in g)]
    spans = [f"  source: {' '.join(i.span_text.split())}" for i in items if i.span_text]
    return "\n".join(lines + spans)


def header(as_of: datetime | None, as_of_version: int | None, at: datetime | None) -> str:
    if as_of_version is not None:
        return f"Patient record as of state version {as_of_version}:"
    if at is not None:
        return f"Patient record as of {when(at)}:"
    return "Patient record:"


def render_packet(req: QueryRequest, blocks: Sequence[Sequence[EvidenceItem]], facts: Sequence[ComputedFact],
                  tokenizer: Tokenizer, *, top: str,
                  stay_start: datetime | None = None) -> tuple[str, list[EvidenceItem], list[ComputedFact], int]:
    """The rendered text, the items and facts kept within ``token_budget`` (blocks in rank order; a block that
    does not fit whole is tried with only what the question needs), and how many items were dropped."""
    budget = req.token_budget
    lines = [top]
    used = tokenizer.count(top)
    kept_facts: list[ComputedFact] = []
    fact_lines: list[str] = []
    for f in facts:  # their tokens first: a computed fact is never what the budget drops
        line = f"Computed from the record: {f.text}"
        n = tokenizer.count(line) + 1
        if budget is None or used + n <= budget:
            fact_lines.append(line)
            kept_facts.append(f)
            used += n
    kept: list[EvidenceItem] = []
    dropped = 0
    for n_block, block in enumerate(blocks):
        tries = [list(block)]
        needed = [i for i in block if i.role != "earlier"]
        if len(needed) < len(block) and needed:
            tries.append(needed)
        placed = False
        for items in tries:
            text = render_block(items, labels=req.labels, stay_start=stay_start)
            cost = tokenizer.count(text) + 1
            if budget is None or used + cost <= budget:
                lines.append(text)
                kept.extend(i.model_copy(update={"thread": n_block}) for i in items)
                dropped += len(block) - len(items)
                used += cost
                placed = True
                break
        if not placed:
            dropped += len(block)
    # The computed facts last, next to the question: the packaged 1.5B reader answered from the threads above them
    # where they came first (docs/lifecycle.md, "What the reader makes of it").
    lines.extend(fact_lines)
    if not kept and not kept_facts:
        lines.append("(no memory retrieved)")
    return "\n".join(lines), [i.model_copy(update={"rank": n}) for n, i in enumerate(kept, start=1)], kept_facts, \
        dropped


def render_item(item: EvidenceItem, *, labels: bool) -> str:
    """One item alone (its token share)."""
    return render_block([item], labels=labels)
