"""deploy/kubernetes: every manifest validates against the committed strict schemas.

The schemas in tests/data/kubernetes/schemas are standalone and strict (unknown fields are errors):
Kubernetes v1.35 API kinds and the Gateway API Inference Extension v1 InferencePool CRD; see
tests/data/kubernetes/build_schemas.py for where they come from. No cluster or network is needed.
"""

from __future__ import annotations

import copy
import itertools
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


# deploy/kubernetes/pd: prefill and decode Deployments behind smg in PD mode.

PD = DEPLOY / "pd"
# The prefill/decode options (docs/operations/disaggregation.md) the two Deployments pass.
PD_OPTIONS = {
    "--disaggregation-mode", "--disaggregation-transfer-backend", "--disaggregation-bootstrap-port",
    "--disaggregation-ib-device",
}  # fmt: skip


def pd_kustomization() -> dict[str, Any]:
    return yaml.safe_load((PD / "kustomization.yaml").read_text())


def pd_documents() -> list[tuple[str, dict[str, Any]]]:
    return [
        (name, doc)
        for name in pd_kustomization()["resources"]
        for doc in yaml.safe_load_all((PD / name).read_text())
        if doc is not None
    ]


def pd_find(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for _, d in pd_documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pd_server(role: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """A role's Deployment, its server container and its `--name=value` options."""
    deployment = pd_find("Deployment", f"deepinfer-{role}")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    options = {name: value for name, _, value in (a.partition("=") for a in container["args"][1:])}
    return deployment, container, options


def selector_args(args: list[str], flag: str) -> dict[str, str]:
    """smg's `--flag key=value key=value ...` label selector, as a dict."""
    rest = args[args.index(flag) + 1 :]
    pairs = itertools.takewhile(lambda a: not a.startswith("--"), rest)
    return dict(pair.split("=", 1) for pair in pairs)


def test_pd_kustomization_lists_every_manifest_and_both_images() -> None:
    k = pd_kustomization()
    assert k["namespace"] == kustomization()["namespace"]
    assert set(k["resources"]) == {p.name for p in PD.glob("*.yaml")} - {"kustomization.yaml"}
    assert (PD / "namespace.yaml").read_text() == (DEPLOY / "namespace.yaml").read_text()
    images = {i["name"] for i in k["images"]}
    used = {
        c["image"]
        for _, d in pd_documents()
        if d["kind"] == "Deployment"
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    assert used == images == {"deepinfer-server", "deepinfer-smg"}


@pytest.mark.parametrize(
    "doc",
    [pytest.param(d, id=f"pd/{f}:{d['kind']}/{d['metadata']['name']}") for f, d in pd_documents()],
)
def test_pd_manifest_matches_strict_schema(doc: dict[str, Any]) -> None:
    validate(doc)


def test_pd_roles_split_one_eight_gpu_node() -> None:
    gpus = 0
    for role, dp, cp in (("prefill", 1, 4), ("decode", 4, 1)):
        _, container, options = pd_server(role)
        assert set(options) <= SERVER_OPTIONS | PD_OPTIONS, options
        assert options["--disaggregation-mode"] == role
        assert options["--disaggregation-transfer-backend"] == "mooncake"
        ep = int(options["--expert-parallel-size"])
        assert (ep, int(options["--data-parallel-size"]), ep // dp) == (4, dp, cp)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == str(ep)
        assert container["resources"]["limits"]["rdma/ib"] == "1"
        assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
        gpus += ep
    assert gpus == 8
    # A COMPLETION engine has no bootstrap server; only the prefill side listens on one.
    assert "--disaggregation-bootstrap-port" not in pd_server("decode")[2]


def test_prefill_bootstrap_port_is_announced_to_smg() -> None:
    deployment, container, options = pd_server("prefill")
    port = options["--disaggregation-bootstrap-port"]
    # smg's Kubernetes discovery reads a prefill pod's bootstrap port from this annotation.
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["sglang.ai/bootstrap-port"] == port
    assert int(port) in {p["containerPort"] for p in container["ports"]}


def test_smg_discovers_the_prefill_and_decode_pods() -> None:
    gateway = pd_find("Deployment", "deepinfer-pd-gateway")
    pod = gateway["spec"]["template"]["spec"]
    (smg,) = pod["containers"]
    args = smg["args"]
    assert args[:2] == ["launch", "--pd-disaggregation"]
    assert "--service-discovery" in args
    options = dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)
    assert options["--service-discovery-namespace"] == pd_kustomization()["namespace"]
    for role in ("prefill", "decode"):
        deployment, container, server_options = pd_server(role)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        selector = selector_args(args, f"--{role}-selector")
        assert selector.items() <= labels.items(), role
        assert options["--service-discovery-port"] == server_options["--port"]
        assert int(server_options["--port"]) in {p["containerPort"] for p in container["ports"]}
    # The two selectors must not both match one pod.
    assert selector_args(args, "--prefill-selector") != selector_args(args, "--decode-selector")
    # smg's metrics port defaults to 29000 on every interface: set, and declared.
    assert options["--prometheus-port"] in {str(p["containerPort"]) for p in smg["ports"]}
    service = pd_find("Service", "deepinfer-pd")
    assert (
        service["spec"]["selector"].items()
        <= gateway["spec"]["template"]["metadata"]["labels"].items()
    )
    # Pod discovery needs get/list/watch on pods through the pod's ServiceAccount.
    binding = pd_find("RoleBinding", "deepinfer-pd-gateway")
    (subject,) = binding["subjects"]
    assert subject["name"] == pod["serviceAccountName"]
    assert subject["namespace"] == pd_kustomization()["namespace"]
    role = pd_find("Role", binding["roleRef"]["name"])
    (rule,) = role["rules"]
    assert (rule["apiGroups"], rule["resources"]) == ([""], ["pods"])
    assert {"get", "list", "watch"} <= set(rule["verbs"])


def test_pd_pods_stay_out_of_the_single_server_services() -> None:
    """Both kustomizations share the namespace: the single-server Services and InferencePool
    must not select prefill or decode pods (a client would reach a PROMPT engine directly)."""
    selectors = [find("Service", "deepinfer-server")["spec"]["selector"]]
    selectors.append(find("InferencePool", "deepinfer-server")["spec"]["selector"]["matchLabels"])
    for role in ("prefill", "decode"):
        labels = pd_server(role)[0]["spec"]["template"]["metadata"]["labels"]
        for selector in selectors:
            assert not selector.items() <= labels.items(), (role, selector)
