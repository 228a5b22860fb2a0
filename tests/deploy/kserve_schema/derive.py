"""Derive a strict JSON Schema for KServe's ClusterServingRuntime and InferenceService from the kserve SDK wheel.

KServe publishes its API as an OpenAPI document; the ``kserve`` Python SDK on PyPI is generated from
it, and each generated model (``kserve/models/v1beta1_*.py``, ``v1alpha1_*.py``) carries the
definition as data: ``openapi_types`` (attribute -> type), ``attribute_map`` (attribute -> JSON
field name) and, in its setters, the fields that must not be None. This script reads those three
from the wheel's sources (with ``ast``: nothing of kserve is imported or installed) and writes one
JSON Schema (draft 2020-12) with a ``$defs`` entry per KServe model reachable from the two kinds.

- Every KServe object is closed (``additionalProperties: false``): an unknown or misspelt field
  is an error, as in ``kubectl apply --validate=strict``.
- Kubernetes types (``V1Container``, ``V1Toleration``, ``V1ObjectMeta``, ...) are not copied: they
  are references into the strict Kubernetes definitions that the ``kubernetes-validate`` wheel
  ships (``https://kubernetes.io/api/_definitions.json``), resolved when the tests validate.
- ``status`` is left open: manifests do not write it. So is a KServe type that the SDK refers to
  but does not define (``V1alpha1WorkerSpec`` in 0.21.0).

Regenerate (the wheel needs nothing but a download)::

    python -m pip download --no-deps -d /tmp/kserve-sdk kserve==0.21.0
    python tests/deploy/kserve_schema/derive.py /tmp/kserve-sdk/kserve-0.21.0-py3-none-any.whl \
        > tests/deploy/kserve_schema/kserve-0.21.0.schema.json
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path

K8S_DEFINITIONS = "https://kubernetes.io/api/_definitions.json"
SCHEMA_ID = "https://moegrad.invalid/tests/deploy/kserve-schema.json"
ROOTS = {"V1alpha1ClusterServingRuntime": ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"),
         "V1beta1InferenceService": ("serving.kserve.io/v1beta1", "InferenceService")}
SCALARS = {"str": {"type": "string"}, "int": {"type": "integer"}, "float": {"type": "number"},
           "bool": {"type": "boolean"}, "datetime": {"type": "string"}, "date": {"type": "string"}, "object": {}}
#: Where a Kubernetes model of the SDK lives among the Kubernetes definitions, tried in this order.
K8S_GROUPS = ("io.k8s.api.core.v1.", "io.k8s.apimachinery.pkg.apis.meta.v1.", "io.k8s.api.apps.v1.",
              "io.k8s.api.autoscaling.v2.", "io.k8s.apimachinery.pkg.api.resource.",
              "io.k8s.apimachinery.pkg.util.intstr.")
#: SDK type names that follow neither naming rule below.
K8S_ALIASES = {"ResourceQuantity": "io.k8s.apimachinery.pkg.api.resource.Quantity",
               # KServe wraps a resource.Quantity (an integer or a quantity string); the SDK has no model for it.
               "V1beta1MetricQuantity": "io.k8s.apimachinery.pkg.api.resource.Quantity"}
_REQUIRED = re.compile(r"and (\w+) is None:\s*# noqa: E501\s*raise ValueError\(\"Invalid value for `(\w+)`, must not be `None`")


def read_models(wheel: zipfile.ZipFile) -> dict[str, dict]:
    """Class name -> {"types": {...}, "names": {...}, "required": [...]} for every generated model."""
    models = {}
    for name in wheel.namelist():
        if not re.fullmatch(r"kserve/models/v1(alpha1|beta1)_\w+\.py", name):
            continue
        source = wheel.read(name).decode("utf-8")
        for node in ast.parse(source).body:
            if not isinstance(node, ast.ClassDef):
                continue
            found = {}
            for item in node.body:
                if isinstance(item, ast.Assign) and isinstance(item.targets[0], ast.Name):
                    if item.targets[0].id in ("openapi_types", "attribute_map"):
                        found[item.targets[0].id] = ast.literal_eval(item.value)
            if {"openapi_types", "attribute_map"} <= found.keys():
                models[node.name] = {"types": found["openapi_types"], "names": found["attribute_map"],
                                     "required": sorted({m.group(1) for m in _REQUIRED.finditer(source)})}
    return models


def k8s_reference(name: str, definitions: dict) -> dict:
    """A reference to the Kubernetes definition behind an SDK type name.

    The SDK names them ``V1Container`` (a core or meta type) or by Go package path,
    ``K8sIoApiAppsV1DeploymentStrategy`` (``k8s.io/api/apps/v1.DeploymentStrategy``).
    """
    by_path = {"".join(part[:1].upper() + part[1:] for part in key.replace("io.k8s.", "k8s.io.", 1).split(".")): key
               for key in definitions}
    if name in by_path or name in K8S_ALIASES:
        return {"$ref": f"{K8S_DEFINITIONS}#/$defs/{by_path.get(name) or K8S_ALIASES[name]}"}
    short = re.sub(r"^V\d\w*?(?=[A-Z])", "", name)  # V1Container -> Container, V2HPAScalingRules -> HPAScalingRules
    for group in K8S_GROUPS:
        if group + short in definitions:
            return {"$ref": f"{K8S_DEFINITIONS}#/$defs/{group}{short}"}
    raise KeyError(f"{name}: no Kubernetes definition {short} in {K8S_GROUPS}")


def type_schema(spec: str, models: dict, definitions: dict, todo: list[str]) -> dict:
    spec = spec.strip()
    if spec in SCALARS:
        return dict(SCALARS[spec])
    if spec.startswith("list[") and spec.endswith("]"):
        return {"type": "array", "items": type_schema(spec[5:-1], models, definitions, todo)}
    if spec.startswith("dict(") and spec.endswith(")"):
        key, value = spec[5:-1].split(",", 1)
        assert key.strip() == "str", spec
        return {"type": "object", "additionalProperties": type_schema(value, models, definitions, todo)}
    if spec in models:
        todo.append(spec)
        return {"$ref": f"#/$defs/{spec}"}
    if re.fullmatch(r"V1(alpha1|beta1)\w+", spec) and spec not in K8S_ALIASES:
        # A KServe type that the SDK names but does not ship (V1alpha1WorkerSpec in 0.21.0): left open.
        return {"$comment": f"{spec}: not defined in the SDK"}
    return k8s_reference(spec, definitions)


def derive(wheel_path: Path, definitions: dict) -> dict:
    with zipfile.ZipFile(wheel_path) as wheel:
        models = read_models(wheel)
    defs: dict[str, dict] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name in defs:
            continue
        model = models[name]
        properties = {}
        for attribute, spec in sorted(model["types"].items()):
            field = model["names"][attribute]
            properties[field] = {} if field == "status" else type_schema(spec, models, definitions, todo)
        if name in ROOTS:
            api_version, kind = ROOTS[name]
            properties["apiVersion"] = {"const": api_version}
            properties["kind"] = {"const": kind}
        schema = {"type": "object", "properties": properties, "additionalProperties": False}
        required = [model["names"][a] for a in model["required"]]
        if name in ROOTS:
            required = sorted({*required, "apiVersion", "kind", "metadata", "spec"})
        if required:
            schema["required"] = required
        defs[name] = schema
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID,
            "$comment": (f"Derived by tests/deploy/kserve_schema/derive.py from {wheel_path.name} (PyPI; sha256 "
                         f"{hashlib.sha256(wheel_path.read_bytes()).hexdigest()}): KServe's OpenAPI models as the SDK "
                         "ships them. Kubernetes types refer to kubernetes-validate's strict definitions."),
            "$defs": dict(sorted(defs.items()))}


def main(argv: list[str]) -> int:
    from kubernetes_validate.utils import latest_version, schema_contents

    version = latest_version()
    definitions = schema_contents(f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version)["$defs"]
    json.dump(derive(Path(argv[0]), definitions), sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
