"""deploy/kubernetes: every manifest validates against the committed strict schemas.

The schemas in tests/data/kubernetes/schemas are standalone and strict (unknown fields are errors):
Kubernetes v1.35 API kinds and the Gateway API Inference Extension v1 InferencePool CRD; see
tests/data/kubernetes/build_schemas.py for where they come from. No cluster or network is needed.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.paths import REPO

ROOT = REPO
DEPLOY = ROOT / "deploy" / "kubernetes"
SCHEMAS = ROOT / "tests" / "data" / "kubernetes" / "schemas"

SCHEMA_FILES = {
    ("v1", "Namespace"): "namespace-v1.json",
    ("v1", "Service"): "service-v1.json",
    ("v1", "ConfigMap"): "configmap-v1.json",
    ("v1", "ServiceAccount"): "serviceaccount-v1.json",
    ("apps/v1", "StatefulSet"): "statefulset-apps-v1.json",
    ("apps/v1", "Deployment"): "deployment-apps-v1.json",
    ("rbac.authorization.k8s.io/v1", "Role"): "role-rbac-v1.json",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebinding-rbac-v1.json",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-inference-v1.json",
}

# Options of the server (docs/operations/command-line.md) the StatefulSet passes; a typo would
# crash-loop.
SERVER_OPTIONS = {
    "--served-model-name", "--trust-remote-code", "--host", "--port", "--expert-parallel-size",
    "--max-model-len", "--max-num-seqs", "--gpu-memory-utilization", "--startup-timeout",
    "--shutdown-timeout", "--data-parallel-size", "--context-parallel-size", "--request-timeout",
    "--max-num-batched-tokens", "--step-timeout", "--max-queued-requests",
}  # fmt: skip


def kustomization() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


def documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for name in kustomization()["resources"]:
        for doc in yaml.safe_load_all((DEPLOY / name).read_text()):
            if doc is not None:
                docs.append((name, doc))
    return docs


def find(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for _, d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def validate(doc: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError if `doc` does not match its kind's strict schema."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    assert key in SCHEMA_FILES, f"no committed schema for {key}"
    schema = json.loads((SCHEMAS / SCHEMA_FILES[key]).read_text())
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if error is not None:
        raise error


def test_kustomization_lists_every_manifest_and_overridable_image() -> None:
    k = kustomization()
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert k["kind"] == "Kustomization"
    on_disk = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(k["resources"]) == on_disk
    (image,) = [i for i in k["images"] if i["name"] == "deepinfer-server"]
    assert (image["newName"], image["newTag"]) == ("deepinfer-server", "latest")
    server = find("StatefulSet", "deepinfer-server")["spec"]["template"]["spec"]["containers"][0]
    # kustomize replaces the image only where it matches the `images[].name`.
    assert server["image"] == "deepinfer-server"


@pytest.mark.parametrize(
    "doc",
    [pytest.param(d, id=f"{f}:{d['kind']}/{d['metadata']['name']}") for f, d in documents()],
)
def test_manifest_matches_strict_schema(doc: dict[str, Any]) -> None:
    validate(doc)


@pytest.mark.parametrize(
    ("kind", "name", "mutate", "message"),
    [
        (
            "StatefulSet",
            "deepinfer-server",
            lambda d: d["spec"]["template"]["spec"]["containers"][0].update(readinesProbe={}),
            "readinesProbe",
        ),
        (
            "StatefulSet",
            "deepinfer-server",
            lambda d: d["spec"]["template"]["spec"].update(terminationGracePeriodSeconds="180"),
            "'180' is not of type",
        ),
        (
            "InferencePool",
            "deepinfer-server",
            lambda d: d["spec"].pop("endpointPickerRef"),
            "'endpointPickerRef' is a required property",
        ),
        (
            "InferencePool",
            "deepinfer-server",
            lambda d: d["spec"].update(targetPorts=[{"number": 70000}]),
            "70000",
        ),
    ],
)
def test_invalid_manifest_is_rejected(kind: str, name: str, mutate: Any, message: str) -> None:
    doc = copy.deepcopy(find(kind, name))
    validate(doc)
    mutate(doc)
    with pytest.raises(jsonschema.ValidationError) as error:
        validate(doc)
    assert message in str(error.value)


def server_container() -> dict[str, Any]:
    return find("StatefulSet", "deepinfer-server")["spec"]["template"]["spec"]["containers"][0]


def option(name: str) -> str:
    for arg in server_container()["args"]:
        if arg.startswith(name + "="):
            return str(arg.split("=", 1)[1])
    raise AssertionError(f"{name} not passed")


def test_server_pod_for_one_eight_gpu_node() -> None:
    sts = find("StatefulSet", "deepinfer-server")
    pod = sts["spec"]["template"]["spec"]
    container = server_container()
    for arg in container["args"][1:]:
        assert arg.split("=", 1)[0] in SERVER_OPTIONS, arg
    assert option("--expert-parallel-size") == "8"
    assert option("--port") == "8000"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert container["resources"]["limits"]["rdma/ib"] == "1"
    assert {"IPC_LOCK", "SYS_RESOURCE"} <= set(container["securityContext"]["capabilities"]["add"])
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    # /dev/shm is memory-backed; the caches are on persistent volumes at the env's paths.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    (dshm,) = [v for v in pod["volumes"] if v["name"] == mounts["/dev/shm"]]
    assert dshm["emptyDir"]["medium"] == "Memory"
    env = {e["name"]: e.get("value") for e in container["env"]}
    claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
    for variable in ("HF_HOME", "DEEPINFER_JIT_CACHE_DIR"):
        assert mounts[env[variable]] in claims, variable


def test_probes_and_drain_timing() -> None:
    pod = find("StatefulSet", "deepinfer-server")["spec"]["template"]["spec"]
    container = server_container()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= int(
        option("--startup-timeout")
    )
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    # SIGTERM comes after preStop; the drain then needs --shutdown-timeout plus rank shutdown.
    budget = int(pre_stop[1]) + int(option("--shutdown-timeout")) + 30
    assert pod["terminationGracePeriodSeconds"] >= budget


def test_prometheus_scrape_annotations() -> None:
    annotations = find("StatefulSet", "deepinfer-server")["spec"]["template"]["metadata"][
        "annotations"
    ]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8000",
        "prometheus.io/path": "/metrics",
    }


def test_inference_pool_selects_the_server_pods_and_its_picker() -> None:
    pool = find("InferencePool", "deepinfer-server")
    template = find("StatefulSet", "deepinfer-server")["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    ref = pool["spec"]["endpointPickerRef"]
    service = find("Service", ref["name"])
    assert ref["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    epp = find("Deployment", ref["name"])
    assert (
        service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    )
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--pool-name={pool['metadata']['name']}" in args


def test_endpoint_picker_reads_this_servers_metric_names() -> None:
    epp = find("Deployment", "deepinfer-server-epp")
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    # GIE >= v1.4 refuses to start with the old metric-name flags.
    assert not [a for a in args if re.match(r"--\S*-metric\b", a)]
    (config_path,) = [a.split("=", 1)[1] for a in args if a.startswith("--config-file=")]
    config_map = find("ConfigMap", "deepinfer-server-epp")
    config = yaml.safe_load(config_map["data"][Path(config_path).name])
    assert config["kind"] == "EndpointPickerConfig"
    assert config["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    plugins = {p["name"]: p for p in config["plugins"]}
    for profile in config["schedulingProfiles"]:
        for ref in profile["plugins"]:
            assert ref["pluginRef"] in plugins
    extractor = plugins["core-metrics-extractor"]["parameters"]
    label_key = extractor["engineLabelKey"]
    labels = find("StatefulSet", "deepinfer-server")["spec"]["template"]["metadata"]["labels"]
    (engine,) = [e for e in extractor["engineConfigs"] if e["name"] == labels[label_key]]
    assert extractor["defaultEngine"] == engine["name"]
    assert engine == {
        "name": "deepinfer",
        "queuedRequestsSpec": "deepinfer:num_requests_waiting",
        "runningRequestsSpec": "deepinfer:num_requests_running",
        "kvUsageSpec": "deepinfer:kv_cache_usage_perc",
        "loraSpec": "",
        "cacheInfoSpec": "",
    }
    # The volume that holds the config is this ConfigMap, mounted where --config-file points.
    pod = epp["spec"]["template"]["spec"]
    (mount,) = pod["containers"][0]["volumeMounts"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert str(Path(mount["mountPath"]) / Path(config_path).name) == config_path


def test_rolebinding_grants_the_picker_its_role() -> None:
    binding = find("RoleBinding", "deepinfer-server-epp")
    (subject,) = binding["subjects"]
    assert subject["namespace"] == kustomization()["namespace"]
    epp = find("Deployment", "deepinfer-server-epp")
    assert subject["name"] == epp["spec"]["template"]["spec"]["serviceAccountName"]
    role = find("Role", binding["roleRef"]["name"])
    granted = {
        (g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
    }
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted
