"""The Kubernetes manifests (deploy/k8s): rendered by kustomize, schema-valid, and consistent with the app.

Each variant (the base and the cpu / npu overlays) is rendered to plain resources by ``kubectl
kustomize`` (the tests skip where kubectl is not installed), validated against the Kubernetes
OpenAPI schemas that the ``kubernetes-validate`` wheel ships (strict: unknown fields are errors; no
network), and checked against the facts it must agree with: the routes ``create_app`` really serves,
the service's ``Settings``, the image (its port and user), one NPU and one worker per pod, and a
termination grace period long enough for the graceful shutdown.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path, PurePosixPath

import pytest

from deploy._manifests import kustomize, quantity
from deploy._routes import serves_get

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
VARIANTS = {"base": K8S / "base", "cpu": K8S / "overlays" / "cpu", "npu": K8S / "overlays" / "npu"}
OVERLAYS = ("cpu", "npu")
NPU_RESOURCE = "huawei.com/Ascend910"
MIB = 1 << 20
#: The host-memory model of base/deployment.yaml: interpreter and libraries (CANN's are larger), and
#: how many request bodies a running call holds (a queued call holds one).
BASELINE_BYTES = {"cpu": 512 * MIB, "npu": 1536 * MIB}
BODIES_PER_RUNNING_CALL = 3


@cache
def rendered(variant: str) -> tuple[dict, ...]:
    return tuple(kustomize(VARIANTS[variant]))


def one(variant: str, kind: str) -> dict:
    (resource,) = [r for r in rendered(variant) if r["kind"] == kind]
    return resource


def pod_spec(variant: str) -> dict:
    return one(variant, "Deployment")["spec"]["template"]["spec"]


def container(variant: str) -> dict:
    (only,) = pod_spec(variant)["containers"]
    return only


def config(variant: str) -> dict[str, str]:
    return one(variant, "ConfigMap")["data"]


# ---- schema --------------------------------------------------------------------------------------

def _schema_versions() -> list[str]:
    from kubernetes_validate.utils import latest_version

    return sorted({"1.28", ".".join(latest_version().split(".")[:2])})


@pytest.mark.parametrize("version", _schema_versions())
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_manifest_is_valid_for_kubernetes(variant, version):
    from kubernetes_validate.utils import validate

    kinds = set()
    for resource in rendered(variant):
        validate(resource, version, strict=True)  # raises ValidationError / SchemaNotFoundError
        kinds.add(resource["kind"])
    assert kinds == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"}


# ---- invariants ----------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_settings_in_the_configmap_are_valid(variant, monkeypatch):
    from moegrad_service.settings import Settings

    for name in list(os.environ):
        if name.startswith("MOEGRAD_") or name == "ASCEND_HOME_PATH":
            monkeypatch.delenv(name)
    for name, value in config(variant).items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.port == int(config(variant)["MOEGRAD_PORT"])
    assert settings.host == "0.0.0.0"


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_and_scraping_point_at_routes_the_app_serves(variant):
    app_container = container(variant)
    probes = {kind: app_container[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["path"] == "/health/live"  # never touches the device
    assert probes["readinessProbe"]["path"] == "/health/ready"
    assert probes["startupProbe"]["path"] in {"/health/live", "/health/ready"}
    annotations = one(variant, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    for path in [probe["path"] for probe in probes.values()] + [annotations["prometheus.io/path"]]:
        assert serves_get(path), path
    tls = "MOEGRAD_TLS_CERTFILE" in config(variant)
    assert all(probe.get("scheme", "HTTP") == ("HTTPS" if tls else "HTTP") for probe in probes.values())
    if "MOEGRAD_AUTH_TOKENS_FILE" in config(variant) or "MOEGRAD_AUTH_TOKENS" in config(variant):
        assert config(variant)["MOEGRAD_METRICS_PUBLIC"] == "true", "Prometheus scrapes without a token"


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_port_is_the_configured_port(variant):
    port = int(config(variant)["MOEGRAD_PORT"])
    app_container = container(variant)
    (http,) = [p for p in app_container["ports"] if p["name"] == "http"]
    assert http["containerPort"] == port
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert app_container[kind]["httpGet"]["port"] in ("http", port)
    annotations = one(variant, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == port
    (service_port,) = one(variant, "Service")["spec"]["ports"]
    assert service_port["targetPort"] in ("http", port)
    # Kubernetes would inject MOEGRAD_PORT=tcp://... for the Service named "moegrad"; service links are off.
    assert pod_spec(variant)["enableServiceLinks"] is False


@pytest.mark.parametrize("variant", VARIANTS)
def test_service_and_budget_select_the_pods(variant):
    deployment = one(variant, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selector in (deployment["spec"]["selector"]["matchLabels"], one(variant, "Service")["spec"]["selector"],
                     one(variant, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    assert one(variant, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_process_one_worker_per_pod(variant):
    spec = pod_spec(variant)
    assert len(spec["containers"]) == 1 and not spec.get("initContainers")
    app_container = container(variant)
    assert "command" not in app_container, "the image's entrypoint runs `moegrad-service serve`"
    assert not any("worker" in arg for arg in app_container.get("args", []))
    names = {e["name"] for e in app_container.get("env", [])} | set(config(variant))
    assert not names & {"WEB_CONCURRENCY", "UVICORN_WORKERS"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_grace_period_outlasts_the_graceful_shutdown(variant):
    spec = pod_spec(variant)
    command = container(variant)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop_s = float(command[1])
    grace_s = float(config(variant)["MOEGRAD_SHUTDOWN_GRACE_S"])
    # uvicorn waits for open requests up to shutdown_grace_s + 1, then the pool for admitted calls.
    assert spec["terminationGracePeriodSeconds"] > pre_stop_s + (grace_s + 1) + grace_s
    assert grace_s >= float(config(variant)["MOEGRAD_REQUEST_TIMEOUT_S"]), "an admitted call may run that long"
    assert pre_stop_s > 0


@pytest.mark.parametrize("variant", OVERLAYS)
def test_memory_limit_covers_the_documented_model(variant):
    settings = config(variant)
    body = int(settings["MOEGRAD_MAX_BODY_BYTES"])
    calls = int(settings["MOEGRAD_MAX_QUEUE"]) + BODIES_PER_RUNNING_CALL * int(settings["MOEGRAD_STREAMS"])
    resources = container(variant)["resources"]
    assert quantity(resources["limits"]["memory"]) >= BASELINE_BYTES[variant] + body * calls
    assert quantity(resources["requests"]["memory"]) <= quantity(resources["limits"]["memory"])
    assert quantity(resources["requests"]["cpu"]) >= int(settings["MOEGRAD_STREAMS"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_pods_run_unprivileged_with_a_read_only_root(variant):
    spec = pod_spec(variant)
    app_container = container(variant)
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    assert spec["automountServiceAccountToken"] is False
    security = app_container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"]: m["name"] for m in app_container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    for name, value in config(variant).items():
        if name == "ASCEND_PROCESS_LOG_PATH":  # CANN must be able to write its logs
            assert PurePosixPath(value).is_relative_to("/tmp")


@pytest.mark.parametrize("variant", VARIANTS)
def test_token_secret_is_an_optional_mounted_reference(variant):
    tokens_file = PurePosixPath(config(variant)["MOEGRAD_AUTH_TOKENS_FILE"])
    mounts = {m["mountPath"]: m for m in container(variant)["volumeMounts"]}
    mount = mounts[str(tokens_file.parent)]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod_spec(variant)["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["optional"] is True
    assert not [r for r in rendered(variant) if r["kind"] == "Secret"], "a reference, never the Secret itself"


def test_npu_pods_ask_for_exactly_one_npu_on_npu_nodes():
    resources = container("npu")["resources"]
    assert int(resources["requests"][NPU_RESOURCE]) == int(resources["limits"][NPU_RESOURCE]) == 1
    assert config("npu")["MOEGRAD_BACKEND"] == "ascend"
    assert config("npu")["MOEGRAD_DEVICE_ID"] == "0", "the device plugin's one visible NPU is device 0 in the pod"
    spec = pod_spec("npu")
    assert spec["nodeSelector"] == {"accelerator": "huawei-Ascend910"}
    assert {"key": NPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert container("npu")["image"] == "moegrad:npu"
    # A rolling update must not wait for a spare NPU that may not exist.
    assert one("npu", "Deployment")["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


def test_npu_startup_probe_allows_minutes_for_device_init():
    startup = container("npu")["startupProbe"]
    budget_s = startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"]
    assert budget_s >= 300
    cpu_startup = container("cpu")["startupProbe"]
    assert budget_s > cpu_startup["periodSeconds"] * cpu_startup["failureThreshold"]


def test_cpu_pods_use_the_emulation_and_no_npu():
    assert config("cpu")["MOEGRAD_BACKEND"] == "reference"
    resources = container("cpu")["resources"]
    assert not any(NPU_RESOURCE in part for part in resources.values())
    assert "nodeSelector" not in pod_spec("cpu")
    assert container("cpu")["image"] == "moegrad:cpu"
    assert one("cpu", "Deployment")["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
