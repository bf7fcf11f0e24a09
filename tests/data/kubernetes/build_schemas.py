"""Regenerate the committed JSON schemas in schemas/ (run by hand; the tests only read them).

Sources (schema data, not code):
  * Kubernetes API: the `-local-strict` schemas shipped in the PyPI wheel `kubernetes-validate`
    (1.37.0, Kubernetes v1.35.0 schemas). Each kind used by deploy/kubernetes/ is bundled into one
    standalone file: the kind's schema plus only the definitions it reaches, refs rewritten to
    `#/$defs/...`. "Strict" means every object schema has `additionalProperties: false`, so an
    unknown or misspelt field is an error (as `kubectl apply --validate=strict` reports).
  * InferencePool: the `openAPIV3Schema` of the Gateway API Inference Extension CRD
    `inferencepools.inference.networking.k8s.io` (version v1, GIE release v1.5.0,
    config/crd/bases/inference.networking.k8s.io_inferencepools.yaml), made strict the same way
    (`additionalProperties: false` on every object with `properties`; `x-kubernetes-*` keys kept
    as annotations, which JSON Schema ignores).

    python -m pip download --no-deps -d /tmp/kv kubernetes-validate==1.37.0
    python tests/data/kubernetes/build_schemas.py \
        /tmp/kv/kubernetes_validate-1.37.0-py3-none-any.whl \
        path/to/inference.networking.k8s.io_inferencepools.yaml
"""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path
from typing import Any

import yaml

KUBERNETES_VERSION = "v1.35.0"
KINDS = {
    # output file: schema file inside the wheel's v<version>-local-strict directory
    "namespace-v1.json": "namespace-v1.json",
    "statefulset-apps-v1.json": "statefulset-apps-v1.json",
    "deployment-apps-v1.json": "deployment-apps-v1.json",
    "service-v1.json": "service-v1.json",
    "configmap-v1.json": "configmap-v1.json",
    "serviceaccount-v1.json": "serviceaccount-v1.json",
    "role-rbac-v1.json": "role-rbac-v1.json",
    "rolebinding-rbac-v1.json": "rolebinding-rbac-v1.json",
}
REF_PREFIX = "/api/_definitions.json#/$defs/"
LOCAL_PREFIX = "#/$defs/"  # refs between definitions inside _definitions.json
OUT = Path(__file__).parent / "schemas"


def _refs(node: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            for prefix in (REF_PREFIX, LOCAL_PREFIX):
                if ref.startswith(prefix):
                    found.add(ref[len(prefix) :])
        for value in node.values():
            found |= _refs(value)
    elif isinstance(node, list):
        for value in node:
            found |= _refs(value)
    return found


def _rewrite(node: Any) -> Any:
    if isinstance(node, dict):
        out = {key: _rewrite(value) for key, value in node.items() if key not in ("$id",)}
        ref = out.get("$ref")
        if isinstance(ref, str) and ref.startswith(REF_PREFIX):
            out["$ref"] = "#/$defs/" + ref[len(REF_PREFIX) :]
        return out
    if isinstance(node, list):
        return [_rewrite(value) for value in node]
    return node


def bundle(wheel: Path) -> None:
    base = f"kubernetes_validate/kubernetes-json-schema/{KUBERNETES_VERSION}-local-strict/"
    with zipfile.ZipFile(wheel) as archive:
        definitions = json.loads(archive.read(base + "_definitions.json"))["$defs"]
        for out_name, in_name in KINDS.items():
            schema = json.loads(archive.read(base + in_name))
            needed: set[str] = set()
            todo = _refs(schema)
            while todo:
                name = todo.pop()
                if name in needed:
                    continue
                needed.add(name)
                todo |= _refs(definitions[name]) - needed
            standalone = _rewrite(schema)
            standalone["$schema"] = "https://json-schema.org/draft/2020-12/schema"
            standalone["$defs"] = {name: _rewrite(definitions[name]) for name in sorted(needed)}
            (OUT / out_name).write_text(json.dumps(standalone, indent=1, sort_keys=True) + "\n")


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        out = {key: _strict(value) for key, value in node.items()}
        if out.get("type") == "object" and "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(node, list):
        return [_strict(value) for value in node]
    return node


def inference_pool(crd_path: Path) -> None:
    crd = yaml.safe_load(crd_path.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    group = crd["spec"]["group"]
    schema["properties"]["apiVersion"] = {"type": "string", "enum": [f"{group}/v1"]}
    schema["properties"]["kind"] = {"type": "string", "enum": [crd["spec"]["names"]["kind"]]}
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "spec"})
    (OUT / "inferencepool-inference-v1.json").write_text(
        json.dumps(schema, indent=1, sort_keys=True) + "\n"
    )


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    bundle(Path(sys.argv[1]))
    inference_pool(Path(sys.argv[2]))
