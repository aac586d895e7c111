"""Regenerate the vendored CRD schemas in this folder (needs git mirrors of the three operator repositories).

    python helm/schemas/vendor.py MIRROR_ROOT

Each CRD's openAPIV3Schema (the version the chart uses) is kept, with descriptions, ``status`` and defaults
dropped to keep the files small. RayService pod templates (``template`` of the head and worker groups) are
replaced by ``{"x-stam-pod-template": true}``: stam.ops.helm_check validates them separately against the
Kubernetes PodTemplateSpec schema of kubernetes-validate, which is stricter than the CRD's copy of it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
SOURCES = [
    # (repository mirror folder, tag, path, version, output)
    ("ray-project+kuberay", "v1.6.2", "ray-operator/config/crd/bases/ray.io_rayservices.yaml", "v1",
     "rayservice-ray.io-v1.json"),
    ("kedacore+keda", "v2.20.2", "config/crd/bases/keda.sh_scaledobjects.yaml", "v1alpha1",
     "scaledobject-keda.sh-v1alpha1.json"),
    ("kedacore+keda", "v2.20.2", "config/crd/bases/keda.sh_triggerauthentications.yaml", "v1alpha1",
     "triggerauthentication-keda.sh-v1alpha1.json"),
    ("prometheus-operator+prometheus-operator", "v0.93.0",
     "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml", "v1",
     "servicemonitor-monitoring.coreos.com-v1.json"),
    ("prometheus-operator+prometheus-operator", "v0.93.0",
     "example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml", "v1",
     "prometheusrule-monitoring.coreos.com-v1.json"),
]
DROP = {"description", "default", "example"}


def shrink(node: Any, path: tuple[str, ...] = ()) -> Any:
    """The schema without descriptions/defaults/examples (a property may still be named so)."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            if k in DROP and not (path and path[-1] == "properties"):
                continue
            out[k] = shrink(v, (*path, k))
        props = out.get("properties")
        if isinstance(props, dict) and "template" in props and "rayStartParams" in props:  # a Ray group spec
            props["template"] = {"type": "object", "x-stam-pod-template": True}
        return out
    if isinstance(node, list):
        return [shrink(v, path) for v in node]
    return node


def main(root: str) -> None:
    for repo, tag, path, version, out in SOURCES:
        text = subprocess.run(["git", "-C", f"{root}/{repo}/repo", "show", f"{tag}:{path}"], check=True,
                              capture_output=True, text=True).stdout
        crd = yaml.safe_load(text)
        (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
        schema = ver["schema"]["openAPIV3Schema"]
        schema.get("properties", {}).pop("status", None)
        schema = shrink(schema)
        schema["x-stam-source"] = f"github.com/{repo.replace('+', '/')}@{tag}:{path}"
        (HERE / out).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
        print(out, (HERE / out).stat().st_size)


if __name__ == "__main__":
    main(sys.argv[1])
