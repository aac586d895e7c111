"""A rest-hook subscriber on loopback (aiohttp): what the FHIR Subscriptions tests and the benchmark receive with.

It keeps every POST (path, content type, headers, the Bundle, when it arrived) and can be stopped and started
again on the same ports (a subscriber that was down). Plain HTTP and HTTPS (a self-signed certificate for
``localhost``) side by side.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from stam.net import free_port


def self_signed(folder: Path) -> tuple[Path, Path]:
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "receiver-cert.pem", folder / "receiver-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@dataclass
class Received:
    hook: str
    content_type: str
    headers: dict[str, str]
    bundle: dict[str, Any]
    at: float

    @property
    def status(self) -> dict[str, Any]:
        return self.bundle["entry"][0]["resource"]

    @property
    def type(self) -> str:
        return str(self.status["type"])

    @property
    def numbers(self) -> list[int]:
        return [int(e["eventNumber"]) for e in self.status.get("notificationEvent") or ()]


@dataclass
class Receiver:
    folder: Path
    http_port: int = field(default_factory=free_port)
    https_port: int = field(default_factory=free_port)
    got: list[Received] = field(default_factory=list)
    answer: int = 200
    """The status the receiver answers (a test may make it refuse)."""
    _runner: Any = None

    def __post_init__(self) -> None:
        self.cert, self.key = self_signed(self.folder)

    def url(self, hook: str, tls: bool) -> str:
        return f"https://localhost:{self.https_port}/{hook}" if tls else f"http://127.0.0.1:{self.http_port}/{hook}"

    async def _hook(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        self.got.append(Received(request.match_info["hook"], request.headers.get("Content-Type", ""),
                                 dict(request.headers), body, time.time()))
        return web.Response(status=self.answer)

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/{hook}", self._hook)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(str(self.cert), str(self.key))
        await web.TCPSite(self._runner, "127.0.0.1", self.http_port, reuse_address=True).start()
        await web.TCPSite(self._runner, "127.0.0.1", self.https_port, ssl_context=ctx, reuse_address=True).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def of(self, hook: str, kind: str | None = None) -> list[Received]:
        return [r for r in self.got if r.hook == hook and (kind is None or r.type == kind)]

    async def wait(self, predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.2)
