"""deploy/kubernetes/store: the shared store tier's master, a Deployment and its Service, valid
against the committed strict schemas, with the options `mooncake_master` knows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.lanes import missing_lane
from tests.unit.deploy.test_kubernetes_manifests import DEPLOY, validate

STORE = DEPLOY / "store"


def _documents() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((STORE / "kustomization.yaml").read_text())
    return [
        doc
        for name in kustomization["resources"]
        for doc in yaml.safe_load_all((STORE / name).read_text())
        if doc is not None
    ]


def test_the_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((STORE / "kustomization.yaml").read_text())
    on_disk = {path.name for path in STORE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == on_disk
    assert (STORE / "namespace.yaml").read_text() == (DEPLOY / "namespace.yaml").read_text()


@pytest.mark.parametrize("doc", _documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_the_manifests_match_the_strict_schemas(doc: dict[str, Any]) -> None:
    validate(doc)


def test_the_service_reaches_the_masters_rpc_port() -> None:
    (deployment,) = [d for d in _documents() if d["kind"] == "Deployment"]
    (service,) = [d for d in _documents() if d["kind"] == "Service"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["mooncake_master"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert f"--rpc_port={ports['rpc']}" in container["args"]
    assert f"--metrics_port={ports['metrics']}" in container["args"]


@pytest.mark.disaggregation
def test_mooncake_master_knows_every_option() -> None:
    binary = Path(sys.executable).parent / "mooncake_master"
    if not binary.exists():
        missing_lane("disaggregation", "mooncake_master is not installed (its extra)")
    (deployment,) = [d for d in _documents() if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    known = subprocess.run(
        [str(binary), "--helpfull"], capture_output=True, text=True, timeout=30, check=False
    )
    for option in container["args"]:
        assert f"-{option.split('=')[0].lstrip('-')} " in known.stdout + known.stderr, option
