"""The language-model reasoner: the method's judgements for free text (clinical notes, note-like results).

Behind the same interface as the coded reasoner (``stam.reasoning.base.Reasoner``):

- extract: ONE call per entry; the note becomes atomic facts (``prompts.Extraction``). A fact whose name
  does not occur in the note (at least half of its words) is dropped as ungrounded, duplicates are merged,
  and each fact keeps the span of the note it names. A note of which nothing is extracted is kept verbatim,
  never lost.
- link + update: ONE call per new memory over all its impact candidates (``prompts.Judgement``): the
  relations to CURRENT candidates and which of them the new fact ends, answered by candidate number. No
  candidates, no call: the memory's own status decides (a stopped/resolved fact goes to HISTORY). So link
  and update together cost at most one call per new memory. ``link`` itself makes no call; relations come
  with the update decision (``UpdateDecision.relations``), and impact retrieval takes its graph hop from
  the memory's best semantic neighbours instead of from link-stage relations.

Output is constrained by the JSON schema of its pydantic model (``response_format``), then validated with
that model and checked against the prompt (candidate numbers in range). An invalid reply is retried with
the validation error shown to the model, within ``attempts``; a final failure raises ``ReasoningError``
carrying the raw output, which sends the entry to dead letters - never a guessed result. An unreachable
endpoint is not the entry's fault: ``LLMUnavailable`` makes the worker hold the partition and retry.

Replies are cached by prompt (bounded LRU, in this process only), so a batch the worker re-runs one entry
at a time to isolate a fault does not pay for its model calls twice.

Each kind of call can go to its own model name (``models``: a LoRA adapter the endpoint serves by name,
``stam serve --lora extract=... --lora update=...``), and every validated call can be recorded as a teacher
trace (``trace``, :mod:`stam.reasoning.traces`).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from schemas import (
    Archive,
    AtomicMemory,
    Category,
    Channel,
    Reason,
    RecordEntry,
    Relation,
    RelationType,
    Store,
    UpdateDecision,
)
from schemas.memory import Span
from stam.cache import LRU
from stam.errors import ReasoningError
from stam.ids import memory_id
from stam.llm.client import LLMClient, Usage
from stam.patient_state import PatientState
from stam.reasoning import prompts
from stam.reasoning.base import Candidate
from stam.reasoning.coded import terminal_reason, verbatim_memory
from stam.reasoning.traces import MODULE_OF, Trace

T = TypeVar("T", bound=BaseModel)

CATEGORY: dict[str, Category] = {
    "condition": Category.CONDITION, "symptom": Category.CONDITION, "medication": Category.MEDICATION,
    "observation": Category.OBSERVATION, "procedure": Category.PROCEDURE, "allergy": Category.ALLERGY,
    "immunization": Category.IMMUNIZATION, "careplan": Category.CAREPLAN, "encounter": Category.ENCOUNTER,
    "social": Category.OTHER,
}
_STATUS_PHRASE = {"active": "current", "history": "past history", "negated": "absent (negated)"}
_WORD = re.compile(r"[a-z0-9]+")
_PURPOSE = {"extraction": prompts.EXTRACT.purpose, "link+update": prompts.JUDGE.purpose}


@dataclass
class ModelStats:
    """Counts a benchmark or the demo reports (totals for this process)."""

    entries: int = 0
    facts: int = 0
    dropped_ungrounded: int = 0
    merged_duplicates: int = 0
    verbatim_fallbacks: int = 0
    judge_calls: int = 0
    judge_skipped: int = 0
    invalid_replies: int = 0
    refused_archivals: int = 0
    refused_past: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _words(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if len(w) > 2 or w.isdigit()]


def grounded(name: str, note_words: set[str]) -> bool:
    """At least two thirds of the fact's words occur in the note (a name the note does not support, such as
    a fact copied from the prompt's example, is dropped)."""
    words = _words(name)
    if not words:
        return False
    return sum(w in note_words for w in words) * 3 >= len(words) * 2


def find_span(name: str, text: str) -> Span | None:
    """Where the note names the fact: the name itself, else its first word of four letters or more."""
    lowered = text.lower()
    at = lowered.find(name.lower().strip())
    if at >= 0:
        return Span(start=at, end=at + len(name.strip()))
    for w in _words(name):
        if len(w) >= 4:
            m = re.search(rf"\b{re.escape(w)}", lowered)
            if m:
                return Span(start=m.start(), end=m.end())
    return None


def _later(a: AtomicMemory, b: AtomicMemory) -> bool:
    """Whether ``a`` is known to be clinically later than ``b``."""
    ta, tb = a.effective_start or a.recorded_at, b.effective_start or b.recorded_at
    return ta is not None and tb is not None and ta > tb


class ModelReasoner:
    name = "model"

    def __init__(self, client: LLMClient, *, attempts: int = 3, max_current: int = 10, max_past: int = 4,
                 min_score: float = 0.35, extract_max_tokens: int = 1500, judge_max_tokens: int = 256,
                 repetition_penalty: float = 1.0, parallel: int = 4, cache_size: int = 4096,
                 models: dict[str, str] | None = None, trace: Callable[[Trace], None] | None = None) -> None:
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.client = client
        self.attempts = attempts
        self.max_current = max_current
        self.max_past = max_past
        self.min_score = min_score
        # Small models can loop on long lists (one item repeated to the token limit; the schema's maxItems and
        # the de-duplication bound the damage). A repetition penalty stops loops but also penalises the JSON
        # keys every fact repeats and ends lists early: on the gold notes 1.1 cut the 1.5B model's recall from
        # 0.71 to 0.55 (benchmarks/llm_notes.py). Off by default; sent with extraction calls when set.
        self.repetition_penalty = repetition_penalty
        self.extract_max_tokens = extract_max_tokens
        self.judge_max_tokens = judge_max_tokens
        self.parallel = max(1, parallel)
        self.stats = ModelStats()
        self.usage = {"extraction": Usage(), "link+update": Usage()}
        """Calls and tokens per kind of judgement (the client's ``usage`` has the totals)."""
        self._cache: LRU[str, str] = LRU(cache_size)
        self._stats_lock = threading.Lock()
        self.prompts = {p.purpose: p.id for p in (prompts.EXTRACT, prompts.JUDGE)}
        """The prompt versions this reasoner sends (``stam.llm.prompt``), for reports."""
        unknown = set(models or {}) - set(MODULE_OF)
        if unknown:
            raise ValueError(f"models: unknown kinds of call {sorted(unknown)} (known: {sorted(MODULE_OF)})")
        self.models = {k: v for k, v in (models or {}).items() if v}
        """Model name per kind of call (``extraction``, ``link+update``); absent: the client's model."""
        self.trace = trace

    def _count(self, **inc: int) -> None:
        with self._stats_lock:
            for k, v in inc.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    # --- the one way a call is made: constrained, validated, retried, cached ----------------------------

    def _ask(self, messages: list[dict[str, str]], model: type[T], *, max_tokens: int, what: str,
             check: Callable[[T], None] | None = None, sampling: dict[str, float] | None = None,
             entry: RecordEntry | None = None, schema: dict[str, object] | None = None) -> T:
        served = self.models.get(what)
        key = hashlib.sha256(json.dumps([model.__name__, served, messages], sort_keys=True).encode()).hexdigest()
        cached = self._cache.get(key)
        if cached is not None:
            return model.model_validate_json(cached)
        schema = schema or prompts.schema(model)
        convo = list(messages)
        raw = ""
        problem = ""
        for attempt in range(1, self.attempts + 1):
            result = self.client.chat(convo, schema=schema, schema_name=model.__name__, max_tokens=max_tokens,
                                      sampling=sampling, model=served)
            self.usage[what].add(result)
            raw = result.content
            try:
                parsed = model.model_validate_json(raw)
                if check is not None:
                    check(parsed)
            except (ValidationError, ValueError) as exc:
                self._count(invalid_replies=1)
                problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                if isinstance(exc, ValidationError):
                    problem = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
                # Show the model its reply and what is wrong with it: a new prompt, so a deterministic
                # (temperature 0) engine answers differently.
                convo = [*messages, {"role": "assistant", "content": raw[:4000]},
                         {"role": "user", "content": f"That reply is invalid ({problem}). Reply again with "
                                                     "valid JSON only."}]
                continue
            self._cache.put(key, raw)
            if self.trace is not None:
                # The teacher's final, validated answer to the original prompt (not the retry conversation).
                self.trace(Trace(module=MODULE_OF[what], purpose=what, prompt_id=self.prompts[_PURPOSE[what]],
                                 model=served or self.client.model, schema_name=model.__name__,
                                 messages=list(messages), reply=raw, attempts=attempt,
                                 entry_id=entry.entry_id if entry else None,
                                 patient_id=entry.patient_id if entry else None))
            return parsed
        raise ReasoningError(f"{what}: no valid reply in {self.attempts} attempts ({problem}); raw model "
                             f"output: {raw[:2000]!r}")

    # --- extract ---------------------------------------------------------------------------------------

    def extract(self, entry: RecordEntry, *, context: Sequence[str] = (), start: int = 0) -> list[AtomicMemory]:
        text = (entry.text or "").strip()
        if not text:
            raise ReasoningError("entry has neither codes nor text: nothing to extract")
        out = self._ask(prompts.extract_messages(text, context), prompts.Extraction,
                        max_tokens=self.extract_max_tokens, what="extraction",
                        sampling={"repetition_penalty": self.repetition_penalty}
                        if self.repetition_penalty != 1.0 else None, entry=entry)
        note_words = set(_words(text))
        seen: set[tuple[str, str, str]] = set()
        memories: list[AtomicMemory] = []
        dropped = merged = 0
        for fact in out.facts:
            name = " ".join(fact.name.split())
            if not grounded(name, note_words):
                dropped += 1
                continue
            key = (fact.category, name.lower(), fact.status)
            if key in seen:
                merged += 1
                continue
            seen.add(key)
            memories.append(self._memory(entry, fact, name, start + len(memories), text))
        self._count(entries=1, facts=len(memories), dropped_ungrounded=dropped, merged_duplicates=merged)
        if not memories:
            self._count(verbatim_fallbacks=1)
            memories.append(verbatim_memory(entry, start))
        return memories

    def extract_many(self, entries: Sequence[RecordEntry], contexts: Sequence[Sequence[str]],
                     starts: Sequence[int]) -> list[list[AtomicMemory] | BaseException]:
        """:meth:`extract` for several entries, their calls in flight together (the engine batches them).
        Each result is the memories or the error of that entry, so one bad entry fails alone."""

        def one(i: int) -> list[AtomicMemory] | BaseException:
            try:
                return self.extract(entries[i], context=contexts[i], start=starts[i])
            except Exception as exc:  # handed back per entry; the caller raises it for that entry only
                return exc

        if len(entries) <= 1 or self.parallel == 1:
            return [one(i) for i in range(len(entries))]
        with ThreadPoolExecutor(min(self.parallel, len(entries)), thread_name_prefix="stam-llm") as pool:
            return list(pool.map(one, range(len(entries))))

    @staticmethod
    def _memory(entry: RecordEntry, fact: prompts.Fact, name: str, position: int, text: str) -> AtomicMemory:
        category = CATEGORY[fact.category]
        value = f" {fact.value.strip()}" if fact.value and fact.value.strip() else ""
        date = entry.effective_at.date().isoformat() if entry.effective_at else "date unknown"
        label = fact.category.capitalize()
        statement = f"{label}: {name}{value}; {_STATUS_PHRASE.get(fact.status, fact.status)} (note of {date})"
        return AtomicMemory(
            memory_id=memory_id(entry.patient_id, entry.entry_id, position), patient_id=entry.patient_id,
            entry_id=entry.entry_id, position=position, category=category, text=statement,
            embed_text=f"{category.value}: {name}", status=fact.status,
            value_text=fact.value.strip() if fact.value and fact.value.strip() else None,
            effective_start=entry.effective_at, effective_end=None, recorded_at=entry.recorded_at,
            source_ref=entry.source_ref, span=find_span(name, text),
        )

    # --- link ------------------------------------------------------------------------------------------

    def semantic_floor(self, memory: AtomicMemory) -> float:
        """Its update shows no candidate found by meaning alone below ``min_score``."""
        return self.min_score

    def link(self, entry: RecordEntry, memories: Sequence[AtomicMemory], state: PatientState) -> list[Relation]:
        """No call here: the relations of a model memory are decided with its update, in the same call."""
        return []

    # --- update ----------------------------------------------------------------------------------------

    def update(self, entry: RecordEntry, memory: AtomicMemory, candidates: Sequence[Candidate]) -> UpdateDecision:
        own = terminal_reason(memory.category, memory.status)
        # Semantic-only candidates below min_score are not shown (impact retrieval's top-B has no floor, so
        # every fact of a patient would otherwise cost a call); code and graph candidates always are.
        shown = [c for c in candidates
                 if c.impact.score >= self.min_score or any(ch is not Channel.SEMANTIC for ch in c.impact.channels)]
        current = [c for c in shown if c.stored.store is Store.ACTIVE][: self.max_current]
        past = [c for c in shown if c.stored.store is Store.HISTORY][: self.max_past]
        if memory.category is Category.NOTE or not current:
            # Nothing CURRENT to relate to or end: no call. PAST-only candidates cannot change state either.
            self._count(judge_skipped=1)
            return self._own_status(memory, own)
        date = memory.effective_start.date().isoformat() if memory.effective_start else None
        messages = prompts.judge_messages(memory.text, date, [c.stored.memory.text for c in current],
                                          [c.stored.memory.text for c in past])
        n_current = len(current)

        def check(j: prompts.Judgement) -> None:
            bad = [x.n for x in j.links if x.n > n_current] + [x.n for x in j.ended if x.n > n_current]
            if bad:
                raise ValueError(f"numbers {bad} are not CURRENT facts (1-{n_current})")

        self._count(judge_calls=1)
        j = self._ask(messages, prompts.Judgement, max_tokens=self.judge_max_tokens, what="link+update", check=check,
                      entry=entry, schema=prompts.judgement_schema(n_current))
        mid = memory.memory_id
        relations: dict[tuple[str, RelationType], Relation] = {}
        for link in j.links:
            target = current[link.n - 1].stored.memory.memory_id
            rtype = RelationType(link.type)
            relations[(target, rtype)] = Relation(source_id=mid, target_id=target, type=rtype,
                                                  weight=rtype.weight)
        archives: dict[str, Archive] = {}
        refused = 0
        for ended in j.ended:
            old = current[ended.n - 1].stored.memory
            if _later(old, memory):
                # Older evidence never ends a clinically newer fact (the coded reasoner's rule too): the
                # model's answer is overruled here, not trusted.
                refused += 1
                continue
            archives[old.memory_id] = Archive(memory_id=old.memory_id, reason=Reason(ended.reason), successor_id=mid)
        if refused:
            self._count(refused_archivals=refused)
        placement, reason = Store.ACTIVE, None
        if own is not None:
            placement, reason = Store.HISTORY, own
        elif j.new_is == "past":
            if memory.status == "active" and not any(_later(c.stored.memory, memory) for c in current):
                # The note states the fact as current and nothing CURRENT is clinically newer: "past" would
                # archive the newest evidence behind older facts (a restated medication judged "superseded"
                # by its own earlier mention). Overruled, as the coded reasoner's late-arrival rule would.
                self._count(refused_past=1)
            else:
                placement, reason = Store.HISTORY, Reason(j.past_reason) if j.past_reason else Reason.PRIOR_STATE
        return UpdateDecision(memory_id=mid, placement=placement, placement_reason=reason,
                              archive=tuple(archives.values()), relations=tuple(relations.values()),
                              rationale=f"model judgement over {n_current} current and {len(past)} past facts")

    def update_many(self, entry: RecordEntry,
                    items: Sequence[tuple[AtomicMemory, Sequence[Candidate]]]) -> list[UpdateDecision]:
        """:meth:`update` for the memories of one entry, their calls in flight together. Their candidates
        are prior memories only (never each other), so the judgements are independent."""
        if len(items) <= 1 or self.parallel == 1:
            return [self.update(entry, m, c) for m, c in items]
        with ThreadPoolExecutor(min(self.parallel, len(items)), thread_name_prefix="stam-llm") as pool:
            return list(pool.map(lambda mc: self.update(entry, mc[0], mc[1]), items))

    @staticmethod
    def _own_status(memory: AtomicMemory, own: Reason | None) -> UpdateDecision:
        if own is not None:
            return UpdateDecision(memory_id=memory.memory_id, placement=Store.HISTORY, placement_reason=own,
                                  rationale=f"the note says {memory.status}")
        return UpdateDecision(memory_id=memory.memory_id, placement=Store.ACTIVE)
