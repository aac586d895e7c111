"""The Helm chart (helm/stam), rendered here with Helm v4 as a library: no cluster is contacted."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

pytest.importorskip("helm_python", reason="the deploy extra (make deploy-setup)")
pytest.importorskip("kubernetes_validate", reason="the deploy extra (make deploy-setup)")

from stam.ops import helm_check as hc  # noqa: E402
from stam.serving.config import Autoscaling, ServingConfig, VllmEngine, vllm_deployment_options  # noqa: E402

PRODUCTION = hc.load_values(hc.CASES["production"])
GROUPS = {"write": {"mode": "groups"}}
ALL = {"write": {"mode": "all"}}
FUSED = {"write": {"mode": "fused", "autoscaling": {"enabled": True}}}


@pytest.fixture(scope="module")
def default() -> list[dict[str, Any]]:
    return hc.render()


@pytest.fixture(scope="module")
def production() -> list[dict[str, Any]]:
    return hc.render(PRODUCTION)


def kinds(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return list(obj["spec"]["template"]["spec"]["containers"])


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_both_value_files_render_every_expected_kind(default: list[dict[str, Any]],
                                                     production: list[dict[str, Any]]) -> None:
    assert {"Deployment", "Service", "ConfigMap", "Secret", "PodDisruptionBudget", "NetworkPolicy",
            "ServiceMonitor", "PrometheusRule"} <= {o["kind"] for o in default}
    assert {"RayService", "ScaledObject", "TriggerAuthentication"} <= {o["kind"] for o in production}
    assert not kinds(production, "Secret"), "production names an existingSecret: the chart makes none"


@pytest.mark.parametrize("case", ["default", "production", "groups", "fused", "all"])
def test_every_rendered_object_validates(case: str) -> None:
    values = {"default": None, "production": PRODUCTION, "groups": GROUPS, "fused": FUSED, "all": ALL}[case]
    objects = hc.render(values)
    errors = [f"{o['kind']}/{o['metadata']['name']}: {e}" for o in objects for e in hc.validate(o)]
    assert errors == []
    assert hc.lint(values) == []


def test_validation_catches_bad_objects(production: list[dict[str, Any]]) -> None:
    # The checks can fail: an unknown field in a Deployment, a CRD and a RayService pod template, a bad name.
    dep = copy.deepcopy(kinds(production, "Deployment")[0])
    containers(dep)[0]["imagePullPolcy"] = "Always"
    assert any("imagePullPolcy" in e for e in hc.validate(dep))
    so = copy.deepcopy(kinds(production, "ScaledObject")[0])
    so["spec"]["maxReplicaCount"] = "eight"
    assert hc.validate(so)
    ray = copy.deepcopy(kinds(production, "RayService")[0])
    ray["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["gpus"] = 1
    assert any("gpus" in e for e in hc.validate(ray))
    svc = copy.deepcopy(kinds(production, "Service")[0])
    svc["metadata"]["name"] = "Query_Service"
    assert hc.validate(svc)


def test_per_group_deployments_get_distinct_consumer_groups(production: list[dict[str, Any]]) -> None:
    write = [d for d in kinds(production, "Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"]
             == "write"]
    assert len(write) == 2
    app_ids = [env(containers(d)[0])["STAM_APP_ID"] for d in write]
    assert sorted(app_ids) == ["stam-write-extract", "stam-write-graph"]
    args = sorted(tuple(containers(d)[0]["args"]) for d in write)
    assert args == [("worker", "--stages", "extract"), ("worker", "--stages", "link,impact,update")]
    # KEDA watches each group's own consumer group on its own input topics.
    triggers = {so["metadata"]["name"]: {(t["metadata"]["consumerGroup"], t["metadata"]["topic"])
                                         for t in so["spec"]["triggers"]} for so in kinds(production, "ScaledObject")}
    assert triggers["stam-write-extract"] == {("stam-write-extract", "stam.entries.v1")}
    assert triggers["stam-write-graph"] == {("stam-write-graph", f"stam.{t}.v1")
                                            for t in ("extracted", "linked", "impacted")}
    assert triggers["stam-query"] == {("stam-query", "stam.queries.v1")}


def test_fused_mode_is_one_deployment_of_the_one_hop_write_path() -> None:
    objects = hc.render(FUSED)
    (write,) = [d for d in kinds(objects, "Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"]
                == "write"]
    assert containers(write)[0]["args"] == ["worker", "--stages", "fused"]
    assert env(containers(write)[0])["STAM_APP_ID"] == "stam-write"
    (scaled,) = [so for so in kinds(objects, "ScaledObject") if so["metadata"]["name"] == "stam-write"]
    assert {(t["metadata"]["consumerGroup"], t["metadata"]["topic"]) for t in scaled["spec"]["triggers"]} == {
        ("stam-write", "stam.entries.v1")}  # its one input topic


def test_one_deployment_of_the_fused_write_path_by_default(default: list[dict[str, Any]]) -> None:
    (write,) = [d for d in kinds(default, "Deployment") if d["metadata"]["name"] == "stam-write"]
    assert containers(write)[0]["args"] == ["worker", "--stages", "fused"]
    assert env(containers(write)[0])["STAM_APP_ID"] == "stam-write"


def test_all_mode_is_one_deployment_of_the_four_stages() -> None:
    (write,) = [d for d in kinds(hc.render(ALL), "Deployment") if d["metadata"]["name"] == "stam-write"]
    assert containers(write)[0]["args"] == ["worker", "--stages", "all"]
    assert env(containers(write)[0])["STAM_APP_ID"] == "stam-write"


@pytest.mark.parametrize("values,message", [
    ({"write": {"mode": "groups", "groups": [{"name": "a", "stages": ["extract", "link"]},
                                              {"name": "b", "stages": ["link", "impact", "update"]}]}},
     "more than one group"),
    ({"write": {"mode": "groups", "groups": [{"name": "a", "stages": ["extract", "link", "impact"]}]}},
     "stage update is in no group"),
])
def test_stage_groups_cover_each_stage_once(values: dict[str, Any], message: str) -> None:
    with pytest.raises(Exception, match=message):
        hc.render(values)


def test_keda_max_replicas_never_exceed_partitions(production: list[dict[str, Any]]) -> None:
    partitions = PRODUCTION["kafka"]["partitions"]
    for so in kinds(production, "ScaledObject"):
        assert so["spec"]["maxReplicaCount"] <= partitions
    too_many = copy.deepcopy(PRODUCTION)
    too_many["write"]["groups"][1]["autoscaling"]["maxReplicaCount"] = partitions + 1
    with pytest.raises(Exception, match="exceeds kafka.partitions"):
        hc.render(too_many)
    with pytest.raises(Exception, match="exceeds kafka.partitions"):
        hc.render({"kafka": {"partitions": 2}, "query": {"autoscaling": {"enabled": True, "maxReplicaCount": 3}}})


def test_pods_run_non_root_read_only_without_capabilities(default: list[dict[str, Any]],
                                                         production: list[dict[str, Any]]) -> None:
    for obj in kinds(default, "Deployment") + kinds(production, "Deployment"):
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
        mounts = {m["mountPath"]: m["name"] for c in pod["containers"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]] and "emptyDir" in volumes[mounts["/var/lib/stam"]]
        data_key = volumes[mounts["/etc/stam/secrets"]]["secret"]
        assert {"key": "data.key", "path": "data.key"} in data_key["items"]


def test_probes_point_at_healthz_and_readyz(production: list[dict[str, Any]]) -> None:
    for obj in kinds(production, "Deployment"):
        for c in containers(obj):
            ports = {p["name"] for p in c["ports"]}
            assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
            assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
            assert c["livenessProbe"]["httpGet"]["port"] in ports
            assert c["readinessProbe"]["httpGet"]["port"] in ports


def test_no_secret_in_the_configmap() -> None:
    secrets = {"kafkaSaslPassword": "kafka-pw-123", "redisPassword": "redis-pw-456", "milvusToken": "root:milvus-789",
               "queryToken": "query-tok-abc", "llmApiKey": "llm-key-def", "dataKey": "A" * 43 + "=",
               "sources": '{"ehr": "sign-secret-ghi"}', "queryTokens": '{"tokens": []}'}
    objects = hc.render({"kafka": {"securityProtocol": "SASL_SSL", "saslUsername": "stam"},
                         "secrets": {"values": secrets, "sourcesFile": True}})
    settings = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "stam-settings"]
    text = json.dumps(settings)
    for value in secrets.values():
        assert value not in text
    (secret,) = kinds(objects, "Secret")
    assert secret["stringData"]["kafka-sasl-password"] == "kafka-pw-123"
    assert secret["stringData"]["data.key"] == "A" * 43 + "="
    with pytest.raises(Exception, match="looks like a secret"):
        hc.render({"settings": {"REDIS_PASSWORD": "oops"}})


def test_workers_reach_the_rayservice_model(production: list[dict[str, Any]]) -> None:
    (cm,) = [o for o in production if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "stam-settings"]
    (ray,) = kinds(production, "RayService")
    assert cm["data"]["STAM_LLM_URL"] == f"http://{ray['metadata']['name']}-serve-svc.stam.svc:8000/v1"
    assert cm["data"]["STAM_LLM_MODEL"] == PRODUCTION["rayService"]["model"]["id"]
    assert cm["data"]["STAM_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert cm["data"]["STAM_BROKER_URL"].startswith("kafka://kafka-0.kafka.data.svc:9093;kafka://")
    workers = ray["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    pod = workers[0]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert (workers[0]["minReplicas"], workers[0]["maxReplicas"]) == (2, 8)
    # serveConfigV2 carries the ServingConfig `stam serve --engine vllm` builds, for the same deployment code.
    import yaml

    (app,) = yaml.safe_load(ray["spec"]["serveConfigV2"])["applications"]
    assert app["import_path"] == "stam.serving.app:build_from_args"
    r = PRODUCTION["rayService"]
    expected = VllmEngine(model_id=r["model"]["id"], model_source=r["model"]["source"], device="gpu",
                          accelerator_type=r["acceleratorType"], tensor_parallel_size=r["model"]["tensorParallelSize"],
                          max_model_len=r["model"]["maxModelLen"],
                          gpu_memory_utilization=r["model"]["gpuMemoryUtilization"], loras=r["model"]["loras"],
                          max_ongoing_requests=r["maxOngoingRequests"],
                          autoscaling=Autoscaling(min_replicas=r["autoscaling"]["minReplicas"],
                                                  max_replicas=r["autoscaling"]["maxReplicas"],
                                                  target_ongoing_requests=r["autoscaling"]["targetOngoingRequests"]))
    config = ServingConfig.model_validate(app["args"])  # what build_from_args reads: strict, so no stray key
    assert config.engine == expected
    options = vllm_deployment_options(config.engine)
    assert options["ray_actor_options"]["num_gpus"] == r["model"]["tensorParallelSize"]
    assert options["ray_actor_options"]["accelerator_type"] == r["acceleratorType"]


def test_alert_rules_pass_promtool(production: list[dict[str, Any]]) -> None:
    if hc.promtool() is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    groups = hc.rule_groups(production)
    alerts = {r["alert"] for g in groups for r in g["rules"]}
    assert {"StamDeadLettersRising", "StamConsumerLagGrowing", "StamStaleRedoRatioHigh", "StamQueryP99High",
            "StamTransitionsStalled"} <= alerts
    assert hc.check_rules(groups) == []
    broken = copy.deepcopy(groups)
    broken[0]["rules"][0]["expr"] = "sum(rate(stam_dead_letters_total[5m]"
    assert hc.check_rules(broken)


def test_dashboard_configmap_carries_the_generated_json(default: list[dict[str, Any]]) -> None:
    (cm,) = [o for o in default if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "stam-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["stam.json"]) == json.loads((hc.CHART / "dashboards" / "stam.json").read_text())


def test_a_deletion_gate_configmap_is_mounted_and_scheduled() -> None:
    objects = hc.render({"deletion": {"gateConfigMap": "stam-deletion-gate", "sweepSeconds": 3600}})
    errors = [f"{o['kind']}/{o['metadata']['name']}: {e}" for o in objects for e in hc.validate(o)]
    assert errors == []
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "stam-settings"]
    assert (cm["data"]["STAM_DELETION_GATE"], cm["data"]["STAM_DELETION_SWEEP_S"]) == ("/etc/stam/deletion-gate", "3600")
    for deployment in kinds(objects, "Deployment"):
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["deletion-gate"]["configMap"]["name"] == "stam-deletion-gate"
        for c in containers(deployment):
            assert {"name": "deletion-gate", "mountPath": "/etc/stam/deletion-gate", "readOnly": True} in c[
                "volumeMounts"]
    plain = hc.render()
    (cm,) = [o for o in plain if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "stam-settings"]
    assert "STAM_DELETION_GATE" not in cm["data"]


def test_the_hospital_listeners_are_deployments_with_their_ports(default: list[dict[str, Any]],
                                                                 production: list[dict[str, Any]]) -> None:
    """`stam listen mllp` and `stam listen fhir`: off by default; on in production, each a Deployment and a Service
    with the port the hospital reaches (2575, 8090) and a metrics port the ServiceMonitor scrapes."""
    names = {o["metadata"]["name"] for o in default}
    assert not any(n.endswith(("-mllp", "-fhir")) for n in names)
    for name, port in (("mllp", 2575), ("fhir", 8090)):
        deployment = next(o for o in kinds(production, "Deployment") if o["metadata"]["name"].endswith(f"-{name}"))
        (c,) = containers(deployment)
        assert c["args"] == ["listen", name, "--quiet"]
        assert {p["name"]: p["containerPort"] for p in c["ports"]}[name] == port
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        service = next(o for o in kinds(production, "Service") if o["metadata"]["name"].endswith(f"-{name}"))
        assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {name: port, "metrics": 9103 if name == "mllp"
                                                                            else 9104}
    mllp = containers(next(o for o in kinds(production, "Deployment") if o["metadata"]["name"].endswith("-mllp")))[0]
    assert env(mllp)["STAM_MLLP_PORT"] == "2575" and env(mllp)["STAM_MLLP_WEB_PORT"] == "6068"
    monitor = kinds(production, "ServiceMonitor")[0]
    assert {"mllp", "fhir"} <= set(monitor["spec"]["selector"]["matchExpressions"][0]["values"])


def test_the_listeners_have_network_policies(default: list[dict[str, Any]],
                                             production: list[dict[str, Any]]) -> None:
    """Each enabled listener gets its own NetworkPolicy: its port (from listeners.<name>.allowedFrom) and the metrics
    port in; DNS, Kafka and Redis out, and for the FHIR listener the subscribers' rest-hook port."""
    assert not [o for o in kinds(default, "NetworkPolicy") if o["metadata"]["name"].endswith(("-mllp", "-fhir"))]
    policies = {o["metadata"]["name"].rsplit("-", 1)[1]: o for o in kinds(production, "NetworkPolicy")}
    for name in ("mllp", "fhir"):
        spec = policies[name]["spec"]
        assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == name
        assert spec["policyTypes"] == ["Ingress", "Egress"]
        ingress_ports = {p["port"] for rule in spec["ingress"] for p in rule["ports"]}
        assert ingress_ports == {name, "metrics"}
        egress_ports = {p["port"] for rule in spec["egress"] for p in rule["ports"]}
        redis, milvus = PRODUCTION["redis"]["port"], PRODUCTION["milvus"]["port"]
        assert {53, redis, *PRODUCTION["kafka"]["ports"]} <= egress_ports and milvus not in egress_ports
        assert (443 in egress_ports) == (name == "fhir")
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "integration"}}}]
    values = copy.deepcopy(PRODUCTION)
    values["listeners"]["mllp"]["allowedFrom"] = peers
    narrowed = hc.render(values)
    (mllp,) = [o for o in kinds(narrowed, "NetworkPolicy") if o["metadata"]["name"].endswith("-mllp")]
    (rule,) = [r for r in mllp["spec"]["ingress"] if {p["port"] for p in r["ports"]} == {"mllp"}]
    assert rule["from"] == peers
