"""The KServe manifests (deploy/kserve): schema-valid for KServe, and consistent with the app and deploy/k8s.

Each variant (npu, cpu) is a ClusterServingRuntime and an InferenceService that uses it, rendered by
``kubectl kustomize``. KServe's schema for the two kinds comes from KServe's own OpenAPI models as
the ``kserve`` SDK wheel ships them: tests/deploy/kserve_schema/derive.py turns them into a strict
JSON Schema (every KServe object closed to unknown fields), vendored beside it with the wheel's
name and sha256; the Kubernetes types inside (containers, tolerations, metadata, ...) resolve to the
strict Kubernetes definitions of the ``kubernetes-validate`` wheel. No cluster and no network.
"""

from __future__ import annotations

import json
import os
import re
from functools import cache
from pathlib import Path, PurePosixPath

import jsonschema
import pytest
from referencing import Registry, Resource

from deploy._manifests import kustomize
from deploy._routes import serves_get

REPO = Path(__file__).resolve().parents[2]
KSERVE = REPO / "deploy" / "kserve"
K8S = REPO / "deploy" / "k8s"
VARIANTS = ("npu", "cpu")
SCHEMA_PATH = Path(__file__).with_name("kserve_schema") / "kserve-0.21.0.schema.json"
ROOT_DEFINITIONS = {"ClusterServingRuntime": "V1alpha1ClusterServingRuntime",
                    "InferenceService": "V1beta1InferenceService"}
NPU_RESOURCE = "huawei.com/Ascend910"
#: The runtime container KServe merges the InferenceService's model container into.
KSERVE_CONTAINER = "kserve-container"


@cache
def rendered(variant: str) -> tuple[dict, ...]:
    return tuple(kustomize(KSERVE / variant))


def one(variant: str, kind: str) -> dict:
    (resource,) = [r for r in rendered(variant) if r["kind"] == kind]
    return resource


def runtime(variant: str) -> dict:
    return one(variant, "ClusterServingRuntime")["spec"]


def container(variant: str) -> dict:
    (only,) = runtime(variant)["containers"]
    return only


def model(variant: str) -> dict:
    return one(variant, "InferenceService")["spec"]["predictor"]["model"]


def env(variant: str) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container(variant)["env"]}


def k8s_deployment(overlay: str) -> dict:
    (deployment,) = [r for r in kustomize(K8S / "overlays" / overlay) if r["kind"] == "Deployment"]
    return deployment


# ---- schema --------------------------------------------------------------------------------------

@cache
def _schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def _k8s_versions() -> list[str]:
    from kubernetes_validate.utils import latest_version

    return sorted({"1.28", ".".join(latest_version().split(".")[:2])})


@cache
def _validator(kind: str, k8s_version: str) -> jsonschema.Validator:
    from kubernetes_validate.utils import all_versions, schema_contents

    version = [v for v in all_versions() if v.startswith(k8s_version + ".")][-1]
    definitions = schema_contents(f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version)
    registry = Registry().with_resources([(_schema()["$id"], Resource.from_contents(_schema())),
                                          (definitions["$id"], Resource.from_contents(definitions))])
    root = {"$ref": f"{_schema()['$id']}#/$defs/{ROOT_DEFINITIONS[kind]}"}
    return jsonschema.Draft202012Validator(root, registry=registry)


def validate(resource: dict, k8s_version: str) -> None:
    _validator(resource["kind"], k8s_version).validate(resource)


@pytest.mark.parametrize("k8s_version", _k8s_versions())
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_resource_is_valid_for_kserve(variant, k8s_version):
    for resource in rendered(variant):
        validate(resource, k8s_version)  # raises jsonschema.ValidationError
    assert sorted(r["kind"] for r in rendered(variant)) == ["ClusterServingRuntime", "InferenceService"]


def _broken(variant: str, kind: str, path: tuple, value: object) -> dict:
    import copy

    resource = copy.deepcopy(one(variant, kind))
    target = resource
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return resource


@pytest.mark.parametrize(("kind", "path", "value"), [
    ("ClusterServingRuntime", ("spec", "protocolVersion"), ["v2"]),            # a misspelt KServe field
    ("ClusterServingRuntime", ("spec", "containers"), KeyError),               # required by KServe
    ("ClusterServingRuntime", ("spec", "multiModel"), "no"),                   # a bool
    # Kubernetes, strict:
    ("ClusterServingRuntime", ("spec", "containers", 0, "livenessProbe", "httpGet", "paht"), "/x"),
    ("ClusterServingRuntime", ("apiVersion",), "serving.kserve.io/v1beta1"),
    ("InferenceService", ("spec", "predictor", "model", "modelFormat"), KeyError),  # required by KServe
    ("InferenceService", ("spec", "predictor", "model", "runtimeName"), "moegrad"),
    ("InferenceService", ("spec", "predictor", "minReplicas"), "1"),           # an integer
    ("InferenceService", ("spec", "predictor", "autoScaling", "metrics", 0, "external", "metric", "promql"), "x"),
    ("InferenceService", ("spec", "predictor", "autoScaling", "metrics", 0, "external", "target"), KeyError),
    ("InferenceService", ("spec", "predictor", "autoScaling", "behavior", "scaleDown", "window"), 600),  # Kubernetes'
])
def test_the_schema_refuses_what_kserve_refuses(kind, path, value):
    resource = _broken("npu", kind, path, value)
    with pytest.raises(jsonschema.ValidationError):
        validate(resource, _k8s_versions()[-1])


def test_the_schema_names_its_source():
    comment = _schema()["$comment"]
    assert "kserve-0.21.0-py3-none-any.whl" in comment
    assert re.search(r"sha256 [0-9a-f]{64}", comment)


# ---- invariants ----------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_both_protocols_of_the_open_inference_protocol(variant):
    assert runtime(variant)["protocolVersions"] == ["v2", "grpc-v2"]
    assert model(variant)["protocolVersion"] in runtime(variant)["protocolVersions"]
    assert runtime(variant)["multiModel"] is False


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_inference_service_uses_this_runtime(variant):
    isvc = one(variant, "InferenceService")
    assert model(variant)["runtime"] == one(variant, "ClusterServingRuntime")["metadata"]["name"]
    formats = [(f["name"], f.get("autoSelect")) for f in runtime(variant)["supportedModelFormats"]]
    assert (model(variant)["modelFormat"]["name"], True) in formats
    assert container(variant)["name"] == KSERVE_CONTAINER
    assert "storageUri" not in model(variant), "the operator needs no model files"
    # A plain Deployment: both ports served, never scaled to zero.
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
    assert isvc["spec"]["predictor"]["minReplicas"] >= 1


@pytest.mark.parametrize("variant", VARIANTS)
def test_ports_are_the_configured_ports(variant):
    http, grpc = container(variant)["ports"]
    assert http["containerPort"] == int(env(variant)["MOEGRAD_PORT"])
    assert grpc["containerPort"] == int(env(variant)["MOEGRAD_GRPC_PORT"]) == 8001
    # KServe's raw Service: the first port becomes port 80; a name with "grpc" gets appProtocol h2c.
    assert "grpc" not in http["name"] and "h2c" not in http["name"]
    assert "grpc" in grpc["name"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container(variant)[probe]["httpGet"]["port"] in (http["containerPort"], http["name"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_settings_in_the_runtime_are_valid(variant, monkeypatch):
    from moegrad_service.settings import Settings

    for name in list(os.environ):
        if name.startswith("MOEGRAD_") or name == "ASCEND_HOME_PATH":
            monkeypatch.delenv(name)
    for name, value in env(variant).items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.port == int(env(variant)["MOEGRAD_PORT"]) and settings.host == "0.0.0.0"
    if "grpc_port" in Settings.model_fields:
        assert settings.grpc_port == int(env(variant)["MOEGRAD_GRPC_PORT"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_and_scraping_point_at_routes_the_app_serves(variant):
    probes = {kind: container(variant)[kind]["httpGet"]["path"]
              for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"] == "/health/live"  # never touches the device
    assert probes["readinessProbe"] == "/health/ready"
    assert probes["startupProbe"] in {"/health/live", "/health/ready"}
    annotations = runtime(variant)["annotations"]
    assert int(annotations["prometheus.kserve.io/port"]) == int(env(variant)["MOEGRAD_PORT"])
    for path in [*probes.values(), annotations["prometheus.kserve.io/path"]]:
        assert serves_get(path), path
    isvc_annotations = one(variant, "InferenceService")["metadata"]["annotations"]
    assert isvc_annotations["serving.kserve.io/enable-prometheus-scraping"] == "true"
    assert env(variant)["MOEGRAD_METRICS_PUBLIC"] == "true", "Prometheus scrapes without a token"


@pytest.mark.parametrize("variant", VARIANTS)
def test_runs_unprivileged_as_the_image_user_with_a_read_only_root(variant):
    security = container(variant)["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    pod_security = k8s_deployment(variant)["spec"]["template"]["spec"]["securityContext"]
    assert (security["runAsUser"], security["runAsGroup"]) == (pod_security["runAsUser"], pod_security["runAsGroup"])
    assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"]: m["name"] for m in container(variant)["volumeMounts"]}
    volumes = {v["name"]: v for v in runtime(variant)["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    tokens = PurePosixPath(env(variant)["MOEGRAD_AUTH_TOKENS_FILE"])
    assert volumes[mounts[str(tokens.parent)]]["secret"]["optional"] is True
    for name, value in env(variant).items():
        if name == "ASCEND_PROCESS_LOG_PATH":
            assert PurePosixPath(value).is_relative_to("/tmp")


@pytest.mark.parametrize("variant", VARIANTS)
def test_grace_period_outlasts_the_graceful_shutdown(variant):
    pre_stop_s = float(container(variant)["lifecycle"]["preStop"]["exec"]["command"][1])
    grace_s = float(env(variant)["MOEGRAD_SHUTDOWN_GRACE_S"])
    grace_period_s = one(variant, "InferenceService")["spec"]["predictor"]["terminationGracePeriodSeconds"]
    assert grace_period_s > pre_stop_s + (grace_s + 1) + grace_s
    assert grace_s >= float(env(variant)["MOEGRAD_REQUEST_TIMEOUT_S"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_resources_match_the_kubernetes_manifests(variant):
    (k8s_container,) = k8s_deployment(variant)["spec"]["template"]["spec"]["containers"]
    assert container(variant)["resources"] == model(variant)["resources"] == k8s_container["resources"]


def test_npu_pods_ask_for_exactly_one_npu_on_the_device_plugins_nodes():
    for resources in (container("npu")["resources"], model("npu")["resources"]):
        assert int(resources["requests"][NPU_RESOURCE]) == int(resources["limits"][NPU_RESOURCE]) == 1
    k8s_pod = k8s_deployment("npu")["spec"]["template"]["spec"]
    assert runtime("npu")["nodeSelector"] == k8s_pod["nodeSelector"] == {"accelerator": "huawei-Ascend910"}
    assert {"key": NPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in runtime("npu")["tolerations"]
    assert env("npu")["MOEGRAD_BACKEND"] == "ascend" and env("npu")["MOEGRAD_DEVICE_ID"] == "0"
    assert container("npu")["image"] == "moegrad:npu"
    startup = container("npu")["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "device init can take minutes"


@pytest.mark.parametrize("variant", VARIANTS)
def test_autoscaling_follows_the_servers_queue(variant):
    from moegrad_service.metrics import Metrics

    isvc = one(variant, "InferenceService")
    predictor = isvc["spec"]["predictor"]
    # KServe's KEDA autoscaler, which runs only in raw deployment mode.
    assert isvc["metadata"]["annotations"]["serving.kserve.io/autoscalerClass"] == "keda"
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
    assert 1 <= predictor["minReplicas"] < predictor["maxReplicas"]
    (metric,) = predictor["autoScaling"]["metrics"]
    assert metric["type"] == "External" and metric["external"]["metric"]["backend"] == "prometheus"
    query = metric["external"]["metric"]["query"]
    # The gauge of calls waiting for a worker, by the name the service's own registry gives it.
    (queue,) = Metrics().pending.describe()
    assert queue.type == "gauge"
    assert set(re.findall(r"\bmoegrad_\w+", query)) == {queue.name}
    # Summed over this InferenceService's predictor pods (KServe names them <name>-predictor-...).
    assert f'pod=~"{isvc["metadata"]["name"]}-predictor-.*"' in query and query.startswith("sum(")
    # KServe reads target.value (KEDA's threshold, per replica): below a full queue, which refuses with 503.
    target = metric["external"]["target"]
    assert target["type"] == "Value"
    assert 0 < float(target["value"]) < int(env(variant)["MOEGRAD_MAX_QUEUE"])
    # No replica is given back sooner than a new one may take to start.
    startup = container(variant)["startupProbe"]
    window_s = predictor["autoScaling"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"]
    assert window_s >= startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"]


def test_cpu_pods_use_the_emulation_and_no_npu():
    assert env("cpu")["MOEGRAD_BACKEND"] == "reference"
    for resources in (container("cpu")["resources"], model("cpu")["resources"]):
        assert not any(NPU_RESOURCE in part for part in resources.values())
    assert "nodeSelector" not in runtime("cpu") and "tolerations" not in runtime("cpu")
    assert container("cpu")["image"] == "moegrad:cpu"
