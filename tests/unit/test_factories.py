"""One factory per external client (issue 39): product code constructs the Kafka, Redis and Milvus clients in
stam/transport.py only, the embedding model in stam/embedding.py only, and sends chat completions (the language
model) from stam/llm/client.py only, so a setting given to a client (a timeout, TLS, a password) reaches every
client of its kind. An AST scan of every product module; tests and benchmarks may make their own."""

from __future__ import annotations

import ast

from tests.conftest import REPO

PRODUCT = ("schemas", "stam", "topology", "workers")

FACTORY_OF: dict[str, str] = {
    "AIOKafkaProducer": "stam/transport.py",
    "AIOKafkaConsumer": "stam/transport.py",
    "AIOKafkaAdminClient": "stam/transport.py",
    "AIOKafkaClient": "stam/transport.py",
    "KafkaAdminClient": "stam/transport.py",
    "MilvusClient": "stam/transport.py",
    "Redis": "stam/transport.py",
    "StrictRedis": "stam/transport.py",
    "SentenceTransformer": "stam/embedding.py",
    "/chat/completions": "stam/llm/client.py",
}
"""What is constructed (a class called, or ``Redis.from_url``), or for the language model the endpoint a request
names, and the one module that may do it."""

KNOWN: dict[tuple[str, str], str] = {
    ("stam/serving/check.py", "/chat/completions"):
        "the serving check reads vLLM's own reply fields (usage.seconds, finish_reason) that a ChatResult drops; "
        "its request body is LLMClient.body",
}
"""Constructions outside the factory, each with its reason; they only shrink (one that is gone fails too)."""


def _made(call: ast.Call) -> str | None:
    """The client a call constructs: ``X(...)`` or ``m.X(...)`` of a name in :data:`FACTORY_OF`, ``Redis.from_url``,
    or a request to a chat-completions URL."""
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    if name == "from_url" and isinstance(func, ast.Attribute):
        owner = func.value
        name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
    if name in FACTORY_OF:
        return name
    for arg in [*call.args, *(k.value for k in call.keywords)]:
        # A request's URL is a base and the path (f"{base}/chat/completions"); a server's route (a constant
        # "/v1/chat/completions" in stam.serving) is no client.
        if isinstance(arg, ast.JoinedStr) and any(
                isinstance(p, ast.Constant) and isinstance(p.value, str) and "/chat/completions" in p.value
                for p in arg.values):
            return "/chat/completions"
    return None


def stray_constructions(sources: dict[str, str]) -> dict[tuple[str, str], int]:
    """(module path, client) -> how many times a module other than the client's factory constructs it."""
    found: dict[tuple[str, str], int] = {}
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, ast.Call) and (made := _made(node)) is not None and FACTORY_OF[made] != path:
                found[(path, made)] = found.get((path, made), 0) + 1
    return found


def _product_sources() -> dict[str, str]:
    return {p.relative_to(REPO).as_posix(): p.read_text() for root in PRODUCT for p in sorted((REPO / root).rglob("*.py"))}


def test_product_code_makes_each_client_in_its_factory_only() -> None:
    stray = stray_constructions(_product_sources())
    unknown = {k: v for k, v in stray.items() if k not in KNOWN}
    assert unknown == {}, "construct these through their factory (stam.transport, stam.embedding, stam.llm.client)"
    assert set(KNOWN) - set(stray) == set(), "no longer constructed there: remove these from KNOWN"


def test_every_factory_module_exists() -> None:
    assert all((REPO / path).is_file() for path in FACTORY_OF.values())


def test_the_scan_finds_a_stray_construction() -> None:
    sources = {
        "stam/a.py": "import redis\nfrom pymilvus import MilvusClient\n"
                     "r = redis.Redis.from_url('redis://x')\nm = MilvusClient(uri='x')\nq = redis.asyncio.Redis(port=1)\n",
        "stam/b.py": "from aiokafka import AIOKafkaConsumer\nc = AIOKafkaConsumer('t', bootstrap_servers='x')\n"
                     "post(f'{url}/chat/completions', body)\n@api.post('/v1/chat/completions')\ndef route(): ...\n",
        "stam/transport.py": "import redis\nr = redis.Redis.from_url('redis://x')\n",
        "stam/embedding.py": "st = SentenceTransformer('m')\n",
    }
    assert stray_constructions(sources) == {("stam/a.py", "Redis"): 2, ("stam/a.py", "MilvusClient"): 1,
                                            ("stam/b.py", "AIOKafkaConsumer"): 1,
                                            ("stam/b.py", "/chat/completions"): 1}
