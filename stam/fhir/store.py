"""Subscriptions, their event numbers and their kept events, in the stack's Redis (durable: a restart keeps them).

Keys (``<p>`` is ``STAM_COLLECTION_PREFIX``):

- ``<p>:fhir:subs``: hash, subscription id -> the Subscription (JSON);
- ``<p>:fhir:n:<id>``: the number of events generated since the subscription started;
- ``<p>:fhir:tx:<id>:<transition id>``: the number a transition got (so a redelivered transition keeps its number
  and is not sent twice), for ``STAM_FHIR_EVENTS_TTL_S``;
- ``<p>:fhir:ev:<id>``: sorted set, event number -> the event, *sealed under its patient's data key*
  (``stam.crypto``): what the notification is built from, kept for ``$events`` (the last ``STAM_FHIR_EVENTS_KEPT``,
  for ``STAM_FHIR_EVENTS_TTL_S`` after the last one). Erasing the patient shreds the key: the events cannot be
  opened any more and are never sent;
- ``<p>:fhir:sent:<id>``: the last event number handed to the subscriber (delivered, or given up after the last try);
- ``<p>:fhir:lease:<id>``: which notifier process delivers the subscription now (a lease, so two replicas never
  send one subscription's notifications).

Blocking calls (redis-py): the notifier and the server call them in a thread.
"""

from __future__ import annotations

import json
from typing import Any

from stam.errors import Erased, SealBroken
from stam.fhir.resources import patient_id_for
from stam.fhir.subscriptions import Subscription

_NUMBER = """
local have = redis.call('GET', KEYS[2])
if have then return {tonumber(have), 0} end
local n = redis.call('INCR', KEYS[1])
redis.call('SET', KEYS[2], n, 'EX', ARGV[3])
redis.call('ZADD', KEYS[3], n, ARGV[1])
local extra = redis.call('ZCARD', KEYS[3]) - tonumber(ARGV[2])
if extra > 0 then redis.call('ZREMRANGEBYRANK', KEYS[3], 0, extra - 1) end
redis.call('EXPIRE', KEYS[3], ARGV[3])
return {n, 1}
"""
_SAVE_IF_PRESENT = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) return 1 end
return 0
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) and 1 or 0
"""


class SubscriptionStore:
    def __init__(self, client: Any, sealer: Any, *, prefix: str = "stam", kept: int = 1000,
                 ttl_s: int = 7 * 86400) -> None:
        self._r = client
        self._sealer = sealer
        self._p = f"{prefix}:fhir"
        self.kept, self.ttl_s = kept, ttl_s
        self._number = client.register_script(_NUMBER)
        self._save_if_present = client.register_script(_SAVE_IF_PRESENT)
        self._renew = client.register_script(_RENEW)

    # --- subscriptions ------------------------------------------------------------------------------------------
    def create(self, sub: Subscription) -> None:
        pipe = self._r.pipeline(transaction=True)
        pipe.hset(f"{self._p}:subs", sub.id, json.dumps(sub.to_json()))
        pipe.set(f"{self._p}:n:{sub.id}", 0, nx=True)
        pipe.set(f"{self._p}:sent:{sub.id}", 0, nx=True)
        pipe.execute()

    def get(self, sub_id: str) -> Subscription | None:
        raw = self._r.hget(f"{self._p}:subs", sub_id)
        return Subscription.from_json(json.loads(raw)) if raw is not None else None

    def all(self) -> list[Subscription]:
        return [Subscription.from_json(json.loads(v)) for v in self._r.hvals(f"{self._p}:subs")]

    def save(self, sub: Subscription) -> bool:
        """Write ``sub`` back if it still exists (a subscription deleted meanwhile stays deleted)."""
        return bool(self._save_if_present(keys=[f"{self._p}:subs"], args=[sub.id, json.dumps(sub.to_json())]))

    def delete(self, sub_id: str) -> bool:
        gone = bool(self._r.hdel(f"{self._p}:subs", sub_id))
        self._r.delete(f"{self._p}:n:{sub_id}", f"{self._p}:ev:{sub_id}", f"{self._p}:sent:{sub_id}",
                       f"{self._p}:lease:{sub_id}")
        return gone

    # --- events -------------------------------------------------------------------------------------------------
    def number(self, sub_id: str, transition_id: str, patient_id: str, event: dict[str, Any]) -> tuple[int, bool]:
        """The event number of ``transition_id`` for the subscription, and whether it is new (a redelivered
        transition keeps its number). A new event is kept sealed under the patient's key."""
        sealed = self._sealer.seal(patient_id, json.dumps(event, separators=(",", ":")).encode())
        n, new = self._number(keys=[f"{self._p}:n:{sub_id}", f"{self._p}:tx:{sub_id}:{transition_id}",
                                    f"{self._p}:ev:{sub_id}"], args=[sealed, self.kept, self.ttl_s])
        return int(n), bool(new)

    def events_since_start(self, sub_id: str) -> int:
        return int(self._r.get(f"{self._p}:n:{sub_id}") or 0)

    def events(self, sub_id: str, since: int, until: int | None = None, limit: int | None = None
               ) -> tuple[list[dict[str, Any]], list[int]]:
        """Kept events numbered ``since`` to ``until`` (inclusive), opened, in order, and the numbers that could not
        be opened (their patient was erased, or the value is broken): never sent."""
        raw = self._r.zrangebyscore(f"{self._p}:ev:{sub_id}", since, "+inf" if until is None else until,
                                    start=0 if limit else None, num=limit, withscores=True)
        out, lost = [], []
        for value, score in raw:
            try:
                out.append(dict(json.loads(self._sealer.open(value)), n=int(score)))
            except (Erased, SealBroken):
                lost.append(int(score))
        return out, lost

    def sent(self, sub_id: str) -> int:
        return int(self._r.get(f"{self._p}:sent:{sub_id}") or 0)

    def mark_sent(self, sub_id: str, n: int) -> None:
        self._r.set(f"{self._p}:sent:{sub_id}", n)

    def lease(self, sub_id: str, owner: str, ms: int) -> bool:
        """Take or renew the delivery lease of the subscription for ``ms``; False while another process holds it."""
        return bool(self._renew(keys=[f"{self._p}:lease:{sub_id}"], args=[owner, ms]))


def erase_patient_subscriptions(client: Any, prefix: str, patient_id: str) -> int:
    """Delete the Subscriptions filtered to the patient (by STAM's patient id, or the id notifications render it
    as), with their numbers and kept events (``stam erase``: a Subscription's filter names its patient in the
    clear). The number deleted."""
    forms = {patient_id, patient_id_for(patient_id, False)}
    p = f"{prefix}:fhir"
    gone = 0
    for sub_id, raw in client.hgetall(f"{p}:subs").items():
        sub_id = sub_id.decode() if isinstance(sub_id, bytes) else sub_id
        if json.loads(raw).get("patient") in forms:
            client.hdel(f"{p}:subs", sub_id)
            client.delete(f"{p}:n:{sub_id}", f"{p}:ev:{sub_id}", f"{p}:sent:{sub_id}", f"{p}:lease:{sub_id}")
            gone += 1
    return gone

