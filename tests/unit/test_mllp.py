"""The MLLP listener's parts that need no stack: framing over a real socket pair, the MSH header, acknowledgements
in both modes, the allow-list, and the CLI's one-line refusals."""

from __future__ import annotations

import asyncio
import socket
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hl7.mllp import MLLPStreamWriter

from stam.mllp import (
    Frame,
    allowed_senders,
    build_ack,
    parse_header,
    read_frame,
    sender_allowed,
)

ADT = (b"MSH|^~\\&|ADTApp|GHH^2.16.840^ISO|EHRApp|GHHR|20260101120000||ADT^A01^ADT_A01|MSG-1|P|2.5\r"
       b"PID|1||123^^^H^MR||Doe^John\r")


def frames(stream: bytes, limit: int) -> list[Frame | None]:
    """Every frame ``read_frame`` reads from ``stream`` sent over a real socket pair, then the end."""

    async def run() -> list[Frame | None]:
        a, b = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=a, limit=limit)
        _, w = await asyncio.open_connection(sock=b)
        w.write(stream)
        await w.drain()
        w.close()
        out: list[Frame | None] = []
        while True:
            try:
                f = await read_frame(reader, limit)
            except ConnectionError as exc:
                out.append(Frame(str(exc).encode(), -1))
                break
            out.append(f)
            if f is None:
                break
        writer.close()
        return out

    return asyncio.run(run())


def test_frames_in_a_row_an_oversized_one_skipped_with_its_head_and_junk_between_blocks() -> None:
    big = ADT + b"NTE|1||" + b"x" * 5000 + b"\r"
    stream = b"\x0b" + ADT + b"\x1c\r" + b"\r\n\x0b" + big + b"\x1c\r" + b"\x0b" + ADT + b"\x1c\r"
    got = frames(stream, limit=2048)
    assert got[0] == Frame(ADT, len(ADT))
    assert got[1] is not None and got[1].too_large and got[1].size == len(big)
    assert got[1].data == big[:4093]  # its first 4 KiB, less the 3 bytes of junk and the start byte
    assert got[2] == Frame(ADT, len(ADT))
    assert got[3] is None


def test_a_block_without_a_start_byte_and_a_connection_cut_inside_a_block() -> None:
    assert frames(b"garbage\x1c\r", 1024)[0] == Frame(b"garbage", 7, framed=False)
    cut = frames(b"\x0b" + ADT[:20], 1024)
    assert cut[0] is not None and cut[0].size == -1 and b"inside a message" in cut[0].data
    assert frames(b"", 1024) == [None]


def test_the_writer_of_the_hl7_package_frames_what_read_frame_reads() -> None:
    async def run() -> Frame | None:
        a, b = socket.socketpair()
        reader, _ = await asyncio.open_connection(sock=a)
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.connect_accepted_socket(lambda: asyncio.StreamReaderProtocol(
            asyncio.StreamReader()), sock=b)
        MLLPStreamWriter(transport, protocol, None, loop).writeblock(ADT)
        return await read_frame(reader, 1 << 16)

    assert asyncio.run(run()) == Frame(ADT, len(ADT))


def test_original_mode_acks_echo_msh_10_and_address_the_sender() -> None:
    h = parse_header(ADT)
    assert h is not None and h.control_id == "MSG-1" and not h.enhanced
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    ok = build_ack(h, "ok", now=now).decode().split("\r")
    assert ok[0].startswith("MSH|^~\\&|EHRApp|GHHR|ADTApp|GHH^2.16.840^ISO|20260102030405+0000||ACK^A01^ACK|A")
    assert ok[0].endswith("|P|2.5") and ok[1] == "MSA|AA|MSG-1" and ok[2] == ""
    bad = build_ack(h, "error", error="PID-3|missing ^ here", now=now).decode().split("\r")
    assert bad[1] == "MSA|AE|MSG-1|PID-3\\F\\missing \\S\\ here"
    assert bad[2] == "ERR|||207^Application internal error^HL70357|E||||PID-3\\F\\missing \\S\\ here"
    none = build_ack(None, "error", error="no MSH").decode().split("\r")
    assert none[1] == "MSA|AE||no MSH"


def test_enhanced_mode_commit_codes_and_when_msh_15_asks_for_them() -> None:
    def with_15_16(a: str, b: str) -> bytes:
        return ADT.replace(b"|P|2.5\r", f"|P|2.5|||{a}|{b}\r".encode())

    h = parse_header(with_15_16("AL", "NE"))
    assert h is not None and h.enhanced
    assert [build_ack(h, s).split(b"\r")[1][:6] for s in ("ok", "error", "reject")] == [
        b"MSA|CA", b"MSA|CE", b"MSA|CR"]
    never, errors_only, success_only, app_only = (
        parse_header(with_15_16(a, b)) for a, b in (("NE", "AL"), ("ER", "NE"), ("SU", ""), ("", "AL")))
    assert never is not None and not any(never.sends(s) for s in ("ok", "error", "reject"))
    assert errors_only is not None and [errors_only.sends(s) for s in ("ok", "error", "reject")] == [False, True, True]
    assert success_only is not None and [success_only.sends(s) for s in ("ok", "error")] == [True, False]
    assert app_only is not None and app_only.enhanced and app_only.sends("ok")


def test_header_with_other_delimiters_and_what_is_not_a_header() -> None:
    h = parse_header(b"\xef\xbb\xbfMSH#*~\\&#App*X#Fac#R#RF#20260101##ORU*R01#C-9#P#2.3\r")
    assert h is not None and h.part(3) == "App" and h.copied(3) == "App^X" and h.part(9, 2) == "R01"
    assert h.control_id == "C-9"
    assert parse_header(b"PID|1") is None and parse_header(b"MSH") is None and parse_header(b"MSHa^~\\&") is None


def test_allow_list() -> None:
    allowed = allowed_senders(" LabApp^*, ADTApp^GHH ,Other")
    assert allowed == [("LabApp", "*"), ("ADTApp", "GHH"), ("Other", "*")]
    h = parse_header(ADT)
    assert h is not None and sender_allowed(h, allowed)
    assert not sender_allowed(h, allowed_senders("ADTApp^ELSEWHERE"))


def test_cli_says_a_missing_stack_and_a_bad_tls_file_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from stam.cli import main

    for var in ("STAM_BROKER_URL", "STAM_REDIS_URL", "STAM_MILVUS_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("STAM_HOME", str(tmp_path / "empty"))
    assert main(["listen", "mllp"]) == 3
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "stam stack up" in err

    monkeypatch.setenv("STAM_BROKER_URL", "kafka://127.0.0.1:1")
    monkeypatch.setenv("STAM_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("STAM_MLLP_PORT", "0")
    monkeypatch.setenv("STAM_MLLP_TLS_CERTFILE", str(tmp_path / "missing.pem"))
    monkeypatch.setenv("STAM_MLLP_TLS_KEYFILE", str(tmp_path / "missing.key"))
    assert main(["listen", "mllp"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("stam listen mllp: TLS (STAM_MLLP_TLS_*)")

    monkeypatch.delenv("STAM_MLLP_TLS_KEYFILE")
    assert main(["listen", "mllp"]) == 2
    assert "STAM_MLLP_TLS_KEYFILE go together" in capsys.readouterr().err
