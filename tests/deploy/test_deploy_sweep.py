"""The sweep (deploy/sweep): an Indexed Job, schema-valid, and consistent with the CLI, the servers and the docs.

The sweep's kustomizations (the Job and its headless Service, the volumes, the files pod, the
merge Job) are rendered by ``kubectl kustomize`` (the tests skip where kubectl is not installed).
Each is validated against the strict Kubernetes OpenAPI schemas of the ``kubernetes-validate``
wheel for versions that have every field the Job uses, and checked against what it must agree
with: the exit codes of ``moegrad`` (the pod failure policy: a pod that judged every case completes,
issue 38), the shard count (``completions`` and ``--shard I/N``), how Kubernetes expands
``$(JOB_COMPLETION_INDEX)``, the servers of deploy/k8s (labels, port, image, what they admit at
once), the one image setting (deploy/sweep/image, a kustomize component every kustomization
includes), and docs/operations.md ("Sweeps at cluster scale" states the interface: issue 30).
That the Job's URL reaches every server pod is run, not only read: test_deploy_sweep_run.py.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
from functools import cache
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import pytest
import yaml

from deploy._manifests import expand, kustomize, option, quantity

REPO = Path(__file__).resolve().parents[2]
SWEEP = REPO / "deploy" / "sweep"
K8S = REPO / "deploy" / "k8s"
KUSTOMIZATIONS = {"sweep": SWEEP, "volumes": SWEEP / "volumes", "merge": SWEEP / "merge", "files": SWEEP / "files"}
#: The kustomize component that sets the image of every kustomization above.
IMAGE = SWEEP / "image"
KINDS = {"sweep": ["Job", "Service"], "volumes": ["PersistentVolumeClaim"] * 2, "merge": ["Job"], "files": ["Pod"]}
#: The annotation the Job controller writes each pod's completion index to (Kubernetes' batch/v1 API).
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
MIB = 1 << 20
#: What the sweep's client holds besides its cases in flight, and how many bodies a case in flight holds.
CLIENT_BASELINE_BYTES = 512 * MIB
BODIES_PER_CASE_IN_FLIGHT = 2


@cache
def rendered(name: str) -> tuple[dict, ...]:
    return tuple(kustomize(KUSTOMIZATIONS[name]))


def one(name: str, kind: str) -> dict:
    (resource,) = [r for r in rendered(name) if r["kind"] == kind]
    return resource


def job(name: str = "sweep") -> dict:
    return one(name, "Job")


def pod_spec(name: str = "sweep") -> dict:
    return one("files", "Pod")["spec"] if name == "files" else job(name)["spec"]["template"]["spec"]


def container(name: str = "sweep") -> dict:
    (only,) = pod_spec(name)["containers"]
    return only


def shard_count() -> int:
    index, count = option(container()["args"], "--shard").split("/")
    assert index == "$(JOB_COMPLETION_INDEX)"
    return int(count)


def k8s_deployment() -> dict:
    (deployment,) = [r for r in kustomize(K8S / "base") if r["kind"] == "Deployment"]
    return deployment


def k8s_config() -> dict[str, str]:
    (config,) = [r for r in kustomize(K8S / "base") if r["kind"] == "ConfigMap"]
    return config["data"]


# ---- schema --------------------------------------------------------------------------------------

def _schema_versions() -> list[str]:
    """1.31 (podFailurePolicy stable), 1.33 (backoffLimitPerIndex stable) and the newest the wheel has."""
    from kubernetes_validate.utils import latest_version

    versions = {"1.31", "1.33", ".".join(latest_version().split(".")[:2])}
    return sorted(versions, key=lambda v: tuple(map(int, v.split("."))))


@pytest.mark.parametrize("version", _schema_versions())
@pytest.mark.parametrize("name", KINDS)
def test_every_sweep_manifest_is_valid_for_kubernetes(name, version):
    from kubernetes_validate.utils import validate

    for resource in rendered(name):
        validate(resource, version, strict=True)  # raises ValidationError / SchemaNotFoundError
    assert sorted(r["kind"] for r in rendered(name)) == sorted(KINDS[name])


# ---- the Indexed Job -----------------------------------------------------------------------------

def test_one_shard_per_index_and_every_index_run():
    spec = job()["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == shard_count(), "--shard I/N must name the Job's own number of indexes"
    assert 1 <= spec["parallelism"] <= spec["completions"]
    # Retried per index, never for the whole Job; a failed index never stops the others.
    assert spec["backoffLimitPerIndex"] >= 1 and "backoffLimit" not in spec
    assert spec["maxFailedIndexes"] == spec["completions"]


def test_each_index_judges_its_own_shard_into_its_own_file():
    app = container()
    assert app["command"] == ["moegrad"], "moegrad is PID 1: its exit status is the container's"
    args = app["args"]
    assert args[0] == "compare"
    (index_env,) = [e for e in app["env"] if e["name"] == "JOB_COMPLETION_INDEX"]
    assert index_env["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{INDEX_ANNOTATION}']"
    mounts = {m["name"]: m for m in app["volumeMounts"]}
    assert option(args, "--cases") == mounts["cases"]["mountPath"] and mounts["cases"]["readOnly"] is True
    outputs = set()
    for index in range(job()["spec"]["completions"]):
        env = {"JOB_COMPLETION_INDEX": str(index)}
        expanded = [expand(arg, env) for arg in args]
        assert option(expanded, "--shard") == f"{index}/{shard_count()}"
        output = PurePosixPath(option(expanded, "--output"))
        assert output.name == f"shard-{index}.jsonl"
        assert output.parent == PurePosixPath(mounts["results"]["mountPath"]) and not mounts["results"].get("readOnly")
        outputs.add(output)
    assert len(outputs) == job()["spec"]["completions"], "one result file per index"
    assert not any("$(" in expand(arg, {"JOB_COMPLETION_INDEX": "0"}) for arg in args), "every $(VAR) is defined"


def test_the_failure_policy_follows_moegrads_exit_codes():
    from moegrad.cli._main import EXIT_FAILURE, EXIT_INTERNAL, EXIT_MISMATCH, EXIT_REJECTED, EXIT_USAGE

    spec = job()["spec"]
    assert pod_spec()["restartPolicy"] == "Never", "required by podFailurePolicy and backoffLimitPerIndex"
    assert spec["podReplacementPolicy"] == "Failed", "one writer per shard file at a time"
    rules = spec["podFailurePolicy"]["rules"]
    # A pod evicted or preempted is started again without counting a failure; that rule comes first.
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    # A wrong command line is wrong for every index: the whole Job stops.
    fail_job = {"containerName": container()["name"], "operator": "In", "values": [EXIT_USAGE]}
    assert rules[1:] == [{"action": "FailJob", "onExitCodes": fail_job}]
    # A pod that judged every case exits 0 whatever the verdicts: a failed standard (1) or an invalid
    # case (3) never fails the index or the Job; the findings are the merge's (its summary, its exit status).
    assert "--exit-zero-on-findings" in container()["args"]
    assert "--exit-zero-on-findings" not in container("merge")["args"]
    named = {code for rule in rules[1:] for code in rule["onExitCodes"]["values"]}
    assert not named & {EXIT_MISMATCH, EXIT_REJECTED}
    # A server or transport failure (4) or a bug (70) matches no rule: counted, retried up to backoffLimitPerIndex.
    assert not named & {EXIT_FAILURE, EXIT_INTERNAL}


def test_the_job_args_are_the_clis():
    from moegrad.cli._main import build_parser

    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit):
        build_parser().parse_args(["compare", "--help"])
    if "--shard" not in shown.getvalue():
        pytest.skip("`moegrad compare` has no --shard yet (issue 30, item 2)")
    for name in ("sweep", "merge"):
        args = [expand(arg, {"JOB_COMPLETION_INDEX": "0"}) for arg in container(name)["args"]]
        try:
            build_parser().parse_args(args)
        except SystemExit as exc:  # argparse's answer to an argument the CLI does not take
            pytest.fail(f"the {name} Job's `moegrad {' '.join(args)}` is refused by the CLI (exit {exc.code})")


# ---- the servers it calls ------------------------------------------------------------------------

def test_the_sweep_calls_every_ready_server_pod():
    url = urlsplit(option(container()["args"], "--url"))
    service = one("sweep", "Service")
    # dns+: the client takes each address of the name as a replica (README.md, docs/accuracy.md
    # "Sweeps"); a plain http:// name is one replica. test_deploy_sweep_run.py runs it.
    assert url.scheme == "dns+http" and url.hostname == service["metadata"]["name"]
    # A headless Service: one A record per ready server pod, which the client takes as its replicas.
    assert service["spec"]["clusterIP"] == "None"
    server_labels = k8s_deployment()["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= server_labels.items()
    (server_port,) = [p for p in k8s_deployment()["spec"]["template"]["spec"]["containers"][0]["ports"]
                      if p["name"] == "http"]
    assert url.port == server_port["containerPort"] == int(k8s_config()["MOEGRAD_PORT"])
    # The sweep's pods are no servers: neither Service sends them traffic.
    sweep_labels = job()["spec"]["template"]["metadata"]["labels"]
    (k8s_service,) = [r for r in kustomize(K8S / "base") if r["kind"] == "Service"]
    for selector in (k8s_service["spec"]["selector"], service["spec"]["selector"]):
        assert not selector.items() <= sweep_labels.items()


def test_cases_in_flight_fit_what_the_servers_admit():
    config = k8s_config()
    per_server = int(config["MOEGRAD_STREAMS"]) + int(config["MOEGRAD_MAX_QUEUE"])  # running + queued
    admitted = k8s_deployment()["spec"]["replicas"] * per_server
    in_flight = job()["spec"]["parallelism"] * int(option(container()["args"], "--max-concurrency"))
    assert in_flight <= admitted, "more would be answered 503 and retried"


def test_memory_limit_covers_the_cases_in_flight():
    body = int(k8s_config()["MOEGRAD_MAX_BODY_BYTES"])  # a larger case is refused by the servers (413)
    in_flight = int(option(container()["args"], "--max-concurrency"))
    resources = container()["resources"]
    peak = CLIENT_BASELINE_BYTES + BODIES_PER_CASE_IN_FLIGHT * body * in_flight
    assert quantity(resources["limits"]["memory"]) >= peak
    for kind in ("cpu", "memory"):
        assert quantity(resources["requests"][kind]) <= quantity(resources["limits"][kind])


@pytest.mark.parametrize("name", ["sweep", "merge", "files"])
def test_the_servers_image_unprivileged_with_a_read_only_root(name):
    spec, app = pod_spec(name), container(name)
    server_spec = k8s_deployment()["spec"]["template"]["spec"]
    (server,) = server_spec["containers"]
    repository, _, tag = app["image"].rpartition(":")
    assert repository == server["image"].rpartition(":")[0] and tag == "cpu", "the cpu overlay's image: no CANN needed"
    security = spec["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    for key in ("runAsUser", "runAsGroup", "fsGroup", "seccompProfile"):
        assert security[key] == server_spec["securityContext"][key], key
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    assert app["securityContext"] == server["securityContext"]
    mounts = {m["mountPath"]: m["name"] for m in app["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]], "the root is read-only; numba and Python write under /tmp"
    assert spec["restartPolicy"] == "Never"


def test_every_pod_uses_the_claims_of_deploy_sweep_volumes():
    claims = {r["metadata"]["name"]: r for r in rendered("volumes")}
    assert all(claim["spec"]["accessModes"] == ["ReadWriteMany"] for claim in claims.values()), \
        "pods on several nodes write their shard files at once"
    for name in ("sweep", "merge", "files"):
        volumes = {v["name"]: v for v in pod_spec(name)["volumes"]}
        mounts = {m["name"]: m for m in container(name)["volumeMounts"]}
        for volume in ("cases", "results"):
            assert volumes[volume]["persistentVolumeClaim"]["claimName"] in claims
            assert mounts[volume]["mountPath"] == f"/{volume}"
        # Jobs only read the cases; the files pod fills them.
        assert bool(mounts["cases"].get("readOnly")) is (name != "files")


def test_the_merge_job_reads_every_shard_and_writes_the_summary_beside_them():
    args = container("merge")["args"]
    mounts = {m["name"]: m["mountPath"] for m in container("merge")["volumeMounts"]}
    assert container("merge")["command"] == ["moegrad"] and args[0] == "compare"
    assert option(args, "--merge") == mounts["results"], "the folder: every shard-*.jsonl in it"
    assert option(args, "--cases") == mounts["cases"], "checks that every case was judged"
    assert PurePosixPath(option(args, "--summary")).parent == PurePosixPath(mounts["results"])
    assert job("merge")["spec"]["backoffLimit"] == 0, "deterministic: its exit status is the sweep's verdict"


# ---- the image -----------------------------------------------------------------------------------

def _images(value) -> list[str]:
    """Every ``image`` of the containers in a rendered resource."""
    if isinstance(value, dict):
        return [image for key, item in value.items()
                for image in ([item] if key == "image" and isinstance(item, str) else _images(item))]
    return [image for item in value for image in _images(item)] if isinstance(value, list) else []


def test_every_manifest_is_rendered_by_a_kustomization_that_takes_the_image_from_one_place():
    component = yaml.safe_load((IMAGE / "kustomization.yaml").read_text(encoding="utf-8"))
    assert component["kind"] == "Component" and [rule["name"] for rule in component["images"]] == ["moegrad"]
    listed = set()
    for name, directory in KUSTOMIZATIONS.items():
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text(encoding="utf-8"))
        assert "images" not in kustomization, f"{directory}: the image is set in {IMAGE} alone"
        listed |= {(directory / resource).resolve() for resource in kustomization["resources"]}
        if any(_images(resource) for resource in rendered(name)):
            assert [(directory / c).resolve() for c in kustomization.get("components", [])] == [IMAGE.resolve()]
    manifests = {path.resolve() for path in SWEEP.rglob("*.yaml") if path.name != "kustomization.yaml"}
    assert manifests == listed, "every manifest is applied through a kustomization (kubectl apply -k)"


def test_one_rule_sets_the_image_of_every_container(tmp_path):
    """The rule of deploy/sweep/image changed in a copy: every container of every kustomization follows it."""
    copy = tmp_path / "sweep"
    shutil.copytree(SWEEP, copy)
    component = yaml.safe_load((copy / "image" / "kustomization.yaml").read_text(encoding="utf-8"))
    component["images"] = [{"name": "moegrad", "newName": "registry.example.com/ml/moegrad", "newTag": "9.9.9-cpu"}]
    (copy / "image" / "kustomization.yaml").write_text(yaml.safe_dump(component), encoding="utf-8")
    seen = 0
    for directory in KUSTOMIZATIONS.values():
        for resource in kustomize(copy / directory.relative_to(SWEEP)):
            for image in _images(resource):
                assert image == "registry.example.com/ml/moegrad:9.9.9-cpu", (directory, resource["kind"])
                seen += 1
    assert seen == 3, "the sweep Job, the merge Job and the files pod"


# ---- the documentation ---------------------------------------------------------------------------

def _section(title: str) -> str:
    text = (REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_the_operations_guide_describes_these_manifests():
    section = _section("Sweeps at cluster scale")
    for path in set(re.findall(r"deploy/sweep[\w/.-]*\w", section)):
        assert (REPO / path).exists(), path
    for directory in KUSTOMIZATIONS.values():
        assert str(directory.relative_to(REPO)) in section
    spec = job()["spec"]
    for fact in (f"completions: {spec['completions']}", f"parallelism: {spec['parallelism']}",
                 f"backoffLimitPerIndex: {spec['backoffLimitPerIndex']}", "FailJob", "DisruptionTarget",
                 "shard-$(JOB_COMPLETION_INDEX).jsonl", INDEX_ANNOTATION, option(container()["args"], "--url"),
                 "--exit-zero-on-findings", f"{IMAGE.relative_to(REPO)}/kustomization.yaml"):
        assert fact in section, fact
