"""deploy/k8s as a fleet: every manifest against the Kubernetes schemas (kubernetes-validate,
strict) and the InferencePool and HTTPRoute ones against their CRDs' schemas
(tests/deploy/crd_schemas, strict too), and the gateway's pieces wired to each other and to
the engine: the pool selects the engine's pods and port, the route sends to the pool, the
endpoint picker reads the pool it is named for, the autoscaler scales the engine on a metric
the engine has."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from otel_engine.observability.metrics import VLLM_NAMES, EngineMetrics
from tests.deploy.test_deploy_configs import (
    K8S_DIR,
    container,
    container_port,
    engine_k8s_args,
    k8s_object,
    k8s_objects,
    load_all_yaml,
    load_yaml,
)

GATEWAY_DIR = K8S_DIR / "inference-gateway"
SCHEMAS = Path(__file__).parent / "crd_schemas"
KUBERNETES_VERSION = "1.37.0"  # the newest kubernetes-validate 1.37 knows
CRD_SCHEMAS = {  # (apiVersion, kind) -> the CRD version's schema file
    ("inference.networking.k8s.io/v1", "InferencePool"): (
        "inferencepool.inference.networking.k8s.io_v1.json"
    ),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute.gateway.networking.k8s.io_v1.json",
}


def gateway_kustomization() -> dict[str, Any]:
    return dict(load_yaml(GATEWAY_DIR / "kustomization.yaml"))


def gateway_objects() -> list[dict[str, Any]]:
    objects = []
    for resource in gateway_kustomization()["resources"]:
        if resource != "../":
            objects += load_all_yaml(GATEWAY_DIR / resource)
    return objects


def every_object() -> list[tuple[str, dict[str, Any]]]:
    """(where, object) of every manifest the two kustomizations apply."""
    return [(f"k8s/{o['kind']}/{o['metadata']['name']}", o) for o in k8s_objects()] + [
        (f"inference-gateway/{o['kind']}/{o['metadata']['name']}", o) for o in gateway_objects()
    ]


def gateway_object(kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in gateway_objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever it lists the known ones (as
    `kubernetes-validate --strict` does for the built-in kinds; the API server would prune
    them silently)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_validator(obj: dict[str, Any]) -> jsonschema.Validator | None:
    name = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if name is None:
        return None
    schema = strict(json.loads((SCHEMAS / name).read_text(encoding="utf-8")))
    return jsonschema.Draft7Validator(schema)


def validate(obj: dict[str, Any]) -> None:
    """Raise if `obj` does not validate; a kind neither validator knows fails too."""
    validator = crd_validator(obj)
    if validator is not None:
        validator.validate(obj)
        return
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(("where", "obj"), every_object(), ids=[w for w, _ in every_object()])
def test_every_manifest_validates_against_its_schema(where: str, obj: dict[str, Any]) -> None:
    validate(obj)


@pytest.mark.parametrize(("where", "obj"), every_object(), ids=[w for w, _ in every_object()])
def test_a_misspelt_field_fails_validation(where: str, obj: dict[str, Any]) -> None:
    """The validation is strict: an unknown field in the spec (a typo) is an error, not a
    field the API server drops without a word."""
    broken = copy.deepcopy(obj)
    target = broken.get("spec", broken.get("metadata"))
    target["replicaz" if "spec" in broken else "labelz"] = 1
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(broken)


def test_the_kustomizations_list_existing_files() -> None:
    config = gateway_kustomization()
    for resource in config["resources"]:
        assert (GATEWAY_DIR / resource).exists(), resource
    for generator in config["configMapGenerator"]:
        for entry in generator["files"]:
            assert (GATEWAY_DIR / entry.split("=")[-1]).is_file(), entry


def test_the_pool_selects_the_engine_pods_on_their_port() -> None:
    pool = gateway_object("InferencePool", "otel-engine")["spec"]
    engine = k8s_object("Deployment", "otel-engine")
    labels = engine["spec"]["template"]["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    assert [{"number": engine_k8s_args().port}] == pool["targetPorts"]
    assert engine_k8s_args().port == container_port(container(engine), "http")
    # the CRD's CEL rule (no JSON-schema validator runs it): a Service reference has a port
    picker = pool["endpointPickerRef"]
    assert picker.get("kind", "Service") != "Service" or "port" in picker
    service = gateway_object("Service", picker["name"])
    assert picker["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]


def test_the_route_sends_every_path_to_the_pool() -> None:
    route = gateway_object("HTTPRoute", "otel-engine")["spec"]
    ((rule),) = route["rules"]
    (backend,) = rule["backendRefs"]
    assert ("inference.networking.k8s.io", "InferencePool", "otel-engine") == (
        backend["group"],
        backend["kind"],
        backend["name"],
    )
    assert [{"path": {"type": "PathPrefix", "value": "/"}}] == rule["matches"]


def test_the_endpoint_picker_serves_the_pool_it_reads() -> None:
    deployment = gateway_object("Deployment", "otel-engine-epp")
    epp = container(deployment)
    args = epp["args"]

    def flag(name: str) -> str:
        return str(args[args.index(name) + 1])

    assert "otel-engine" == flag("--pool-name")
    service = gateway_object("Service", "otel-engine-epp")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert int(flag("--grpc-port")) == container_port(epp, ports["grpc-ext-proc"]["targetPort"])
    assert "http2" == ports["grpc-ext-proc"]["appProtocol"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert int(flag("--grpc-health-port")) == epp[probe]["grpc"]["port"]
    # its config file is the one the ConfigMap generator ships, mounted where it reads it
    (generator,) = gateway_kustomization()["configMapGenerator"]
    (mount,) = epp["volumeMounts"]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert generator["name"] == volumes[mount["name"]]["configMap"]["name"]
    assert flag("--config-file") == f"{mount['mountPath']}/{generator['files'][0]}"
    assert "otel-engine-epp" == deployment["spec"]["template"]["spec"]["serviceAccountName"]


def test_the_endpoint_picker_may_read_pods_and_pools() -> None:
    rules = gateway_object("Role", "otel-engine-epp")["rules"]
    allowed = {(g, r) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= allowed
    binding = gateway_object("RoleBinding", "otel-engine-epp")
    assert [("ServiceAccount", "otel-engine-epp")] == [
        (s["kind"], s["name"]) for s in binding["subjects"]
    ]


def test_the_endpoint_picker_finds_the_names_it_reads() -> None:
    """Its metric extractor reads vLLM's names by default (pods labelled engine-type vllm),
    scraping the path the engine serves them on."""
    engine = k8s_object("Deployment", "otel-engine")
    assert "vllm" == engine["spec"]["template"]["metadata"]["labels"]["llm-d.ai/engine-type"]
    assert engine_k8s_args().vllm_metric_names
    read = {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"}
    assert read | {"vllm:cache_config_info"} <= {name for name, _ in VLLM_NAMES.values()}
    config = yaml.safe_load((GATEWAY_DIR / "epp-config.yaml").read_text(encoding="utf-8"))
    (source,) = [p for p in config["plugins"] if p["type"] == "metrics-data-source"]
    assert "/metrics" == source["parameters"]["path"]


def test_the_autoscaler_scales_the_engine_on_its_queue() -> None:
    hpa = gateway_object("HorizontalPodAutoscaler", "otel-engine")["spec"]
    assert ("Deployment", "otel-engine") == (
        hpa["scaleTargetRef"]["kind"],
        hpa["scaleTargetRef"]["name"],
    )
    (metric,) = hpa["metrics"]
    body, _ = EngineMetrics().render()
    assert f"# TYPE {metric['pods']['metric']['name']} gauge" in body.decode()
    assert 1 <= hpa["minReplicas"] < hpa["maxReplicas"]


def test_disruptions_take_one_engine_pod_at_a_time() -> None:
    pdb = k8s_object("PodDisruptionBudget", "otel-engine")["spec"]
    labels = k8s_object("Deployment", "otel-engine")["spec"]["template"]["metadata"]["labels"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert 1 == pdb["maxUnavailable"]
