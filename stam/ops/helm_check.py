"""Checks of the Helm chart that need no cluster: ``python -m stam.ops.helm_check``.

For the default values and each example values file: render the chart (Helm v4 as a library, helm-python-sdk),
``helm lint --strict``, validate every rendered object against the Kubernetes schemas of kubernetes-validate
(strict: unknown fields are errors) or, for the custom resources, against the CRD schemas vendored in
``helm/schemas/`` (made strict the same way; RayService pod templates are validated as core PodTemplateSpecs),
and ``promtool check rules`` on the PrometheusRule groups. Prints one line per failure on stderr, a JSON
summary on stdout, and exits 1 when anything failed.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "stam"
SCHEMAS = ROOT / "helm" / "schemas"
KUBE_VERSION = "1.30.0"  # the oldest Kubernetes the chart is checked against (Chart.yaml: >=1.27)
RELEASE = "stam"
NAMESPACE = "stam"
CASES: dict[str, Path | None] = {"default": None, "production": CHART / "values-production.yaml"}
# Custom resources: (apiVersion, kind) -> vendored openAPIV3 schema (helm/schemas/vendor.py).
CRDS = {
    ("ray.io/v1", "RayService"): "rayservice-ray.io-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda.sh-v1alpha1.json",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): "triggerauthentication-keda.sh-v1alpha1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-monitoring.coreos.com-v1.json",
}


def load_values(path: Path | None) -> dict[str, Any] | None:
    return None if path is None else dict(yaml.safe_load(path.read_text()) or {})


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The chart rendered offline with ``values`` over values.yaml: every object, in template order."""
    # deferred: optional helm_python (stam[deploy]), not installed everywhere
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    objects: list[dict[str, Any]] = []
    for name in sorted(manifests):
        if name.endswith((".txt", ".tpl")):
            continue
        objects.extend(d for d in yaml.safe_load_all(manifests[name]) if d)
    return objects


def lint(values: dict[str, Any] | None = None) -> list[str]:
    """``helm lint --strict``: the warnings and errors (severity >= 2), as lines."""
    # deferred: optional helm_python (stam[deploy]), not installed everywhere
    import helm_python as helm

    report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}")
    out = [f"{m['path']}: {m['error']}" for m in report.get("messages", []) if int(m.get("severity", 0)) >= 2]
    return out + [str(e) for e in report.get("errors", [])]


def _strict(node: Any) -> Any:
    """A CRD schema in which unknown fields are errors (as `kubectl apply` with server-side field validation)."""
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@cache
def _crd_validator(filename: str) -> Any:
    # deferred: optional jsonschema (stam[deploy]), not installed everywhere
    import jsonschema

    schema = _strict(json.loads((SCHEMAS / filename).read_text()))
    schema["properties"]["metadata"] = {"type": "object"}  # checked as core ObjectMeta instead
    return jsonschema.Draft202012Validator(schema)


def _pod_templates(node: Any, path: str = "") -> list[tuple[str, Any]]:
    """(path, value) of every place the vendored schema marks as a pod template (x-stam-pod-template)."""
    found: list[tuple[str, Any]] = []

    def walk(schema: dict[str, Any], value: Any, where: str) -> None:
        if schema.get("x-stam-pod-template"):
            found.append((where, value))
            return
        if isinstance(value, dict):
            for k, v in value.items():
                sub = schema.get("properties", {}).get(k)
                if isinstance(sub, dict):
                    walk(sub, v, f"{where}.{k}")
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for i, v in enumerate(value):
                walk(schema["items"], v, f"{where}[{i}]")

    walk(node[0], node[1], path)
    return found


def _core(obj: dict[str, Any]) -> list[str]:
    # deferred: optional kubernetes_validate (stam[deploy]), not installed everywhere
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path) or "(object)"
        return [f"{where}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [str(exc.message)]
    return []


DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
# Kinds whose names become DNS labels (Service host names) or pod-name prefixes: 63 characters at most.
SHORT_NAMES = {"Service", "Deployment", "RayService"}


def _metadata(obj: dict[str, Any]) -> list[str]:
    """What the API server checks in names and labels and the OpenAPI schemas do not."""
    meta = obj.get("metadata") or {}
    name, kind = str(meta.get("name", "")), obj.get("kind", "")
    errors = []
    short = kind in SHORT_NAMES
    if not (DNS_LABEL if short else DNS_SUBDOMAIN).match(name) or len(name) > (63 if short else 253):
        errors.append(f"metadata.name: {name!r} is not a valid {'DNS label' if short else 'DNS subdomain'}")
    for k, v in (meta.get("labels") or {}).items():
        if not isinstance(v, str) or len(v) > 63 or not LABEL_VALUE.match(v):
            errors.append(f"metadata.labels.{k}: {v!r} is not a valid label value")
    return errors


def validate(obj: dict[str, Any]) -> list[str]:
    """Schema errors of one rendered object (empty: valid)."""
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    if key not in CRDS:
        return _metadata(obj) + _core(obj)
    errors = _metadata(obj) + [f"metadata: {e}" for e in _core({"apiVersion": "v1", "kind": "ConfigMap",
                                                                "metadata": obj.get("metadata", {})})]
    validator = _crd_validator(CRDS[key])
    for err in sorted(validator.iter_errors(obj), key=lambda e: list(e.path)):
        errors.append(f"{'.'.join(str(p) for p in err.path) or '(object)'}: {err.message}")
    for where, template in _pod_templates((json.loads((SCHEMAS / CRDS[key]).read_text()), obj)):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"},
                   "template": copy.deepcopy(template)}
        errors.extend(f"{where.lstrip('.')}: {e}" for e in _core(wrapped))
    return errors


def rule_groups(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [g for o in objects if o.get("kind") == "PrometheusRule" for g in o["spec"]["groups"]]


def promtool() -> str | None:
    return shutil.which("promtool") or (str(p) if (p := Path("/usr/bin/promtool")).exists() else None)


def check_rules(groups: list[dict[str, Any]]) -> list[str]:
    """``promtool check rules`` on the groups; failures as lines (promtool missing is a failure)."""
    tool = promtool()
    if tool is None:
        return ["promtool not found (Debian package prometheus); the PrometheusRule was not checked"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rules.yaml"
        path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
        proc = subprocess.run([tool, "check", "rules", str(path)], capture_output=True, text=True)
    if proc.returncode == 0:
        return []
    return [line.strip() for line in (proc.stderr + proc.stdout).splitlines()
            if line.strip() and "Checking" not in line] or [f"promtool exit {proc.returncode}"]


@dataclass
class CaseResult:
    name: str
    objects: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    rules: int = 0


def check_case(name: str, values_file: Path | None) -> CaseResult:
    result = CaseResult(name)
    values = load_values(values_file)
    try:
        objects = render(values)
    except Exception as exc:  # noqa: BLE001 - a render error is the finding
        result.failures.append(f"render: {type(exc).__name__}: {' '.join(str(exc).split())}")
        return result
    result.objects = dict(Counter(o.get("kind", "?") for o in objects))
    result.failures.extend(f"lint: {line}" for line in lint(values))
    for obj in objects:
        label = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        result.failures.extend(f"{label}: {e}" for e in validate(obj))
    groups = rule_groups(objects)
    result.rules = sum(len(g.get("rules", [])) for g in groups)
    if groups:
        result.failures.extend(f"promtool: {line}" for line in check_rules(groups))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", type=Path, action="append", default=[],
                        help="check this values file too (repeatable)")
    args = parser.parse_args(argv)
    cases = dict(CASES)
    for path in args.values:
        cases[path.stem] = path
    results = [check_case(name, path) for name, path in cases.items()]
    for r in results:
        for line in r.failures:
            print(f"helm_check [{r.name}] {line}", file=sys.stderr)
    summary = {
        "kube_version": KUBE_VERSION,
        "cases": {r.name: {"objects": sum(r.objects.values()), "kinds": r.objects, "alert_rules": r.rules,
                           "failures": len(r.failures)} for r in results},
        "ok": not any(r.failures for r in results),
    }
    print(json.dumps(summary, indent=1, sort_keys=True))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
