"""A small kustomize: renders a kustomization directory to a list of plain resources.

No kustomize or kubectl binary can be installed from the registries this project uses, so the
deployment tests render the manifests with this module. It implements exactly the subset that
``deploy/k8s`` uses, and refuses everything else loudly (``UnsupportedFeature``) instead of
rendering it wrongly:

- ``resources``: YAML files (one or more documents each) and directories holding a
  ``kustomization.yaml``, rendered recursively; the same resource twice is an error.
- ``patches``: ``- path: FILE`` entries whose documents are strategic-merge patches; each patch names
  its target by ``apiVersion``, ``kind`` and ``metadata.name`` (``metadata.namespace`` if set).
  Maps merge recursively and a null value deletes the key. A list merges item by item when the
  Kubernetes API declares a merge key for it (containers and volumes by ``name``, volumeMounts by
  ``mountPath``, ports by ``containerPort``, ...): a patch item merges into the item with the same
  key, and the result lists the patch's items first, in the patch's order, then the original items
  the patch does not name (the order kustomize itself writes). Every other list is replaced. Patch directives
  (``$patch``, ``$retainKeys``, ``$setElementOrder/...``, ``$deleteFromPrimitiveList/...``) are
  not supported.
- ``images``: ``name`` with ``newName`` and/or ``newTag``, applied to the containers and
  initContainers of workload pod templates (and bare Pods).

Where kubectl is installed (it bundles kustomize as ``kubectl kustomize``), the tests also compare
this renderer's output with the real one.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

__all__ = ["UnsupportedFeature", "load_documents", "render", "resource_id", "strategic_merge"]

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "patches", "images"}
#: The list fields this renderer merges, with their merge key (the Kubernetes API's patchMergeKey).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
}
#: Kinds whose ``spec.template.spec`` is a pod spec (``images`` applies there).
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "ReplicationController"}


class UnsupportedFeature(ValueError):
    """The kustomization uses something this renderer does not implement."""


def load_documents(path: Path) -> list[dict[str, Any]]:
    """The non-empty YAML documents of ``path``; each must be a mapping."""
    documents = [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]
    for doc in documents:
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: a document is a {type(doc).__name__}, not a mapping")
    return documents


def resource_id(resource: dict[str, Any]) -> tuple[str, str, str, str]:
    """(apiVersion, kind, namespace, name): what kustomize matches resources and patches by."""
    metadata = resource.get("metadata") or {}
    return (resource.get("apiVersion", ""), resource.get("kind", ""), metadata.get("namespace", ""),
            metadata.get("name", ""))


def render(directory: Path) -> list[dict[str, Any]]:
    """Render the kustomization in ``directory``: its resources with its patches and images applied.

    Raises:
        UnsupportedFeature: the kustomization uses a field or directive outside the subset above.
        ValueError: a resource is declared twice, or a patch matches no resource.
        FileNotFoundError: a referenced file or directory does not exist.
    """
    directory = Path(directory)
    kustomization = _read_kustomization(directory)
    unknown = set(kustomization) - SUPPORTED_FIELDS
    if unknown:
        raise UnsupportedFeature(f"{directory}: kustomization fields {sorted(unknown)} are not supported")
    kind = kustomization.get("kind", "Kustomization")
    if kind != "Kustomization":
        raise UnsupportedFeature(f"{directory}: kind {kind!r} is not supported")

    resources: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        target = directory / entry
        loaded = render(target) if target.is_dir() else load_documents(target)
        for resource in loaded:
            if any(resource_id(resource) == resource_id(seen) for seen in resources):
                raise ValueError(f"{directory}: resource {resource_id(resource)} is declared twice")
            resources.append(resource)

    for entry in kustomization.get("patches", []):
        if set(entry) != {"path"}:
            raise UnsupportedFeature(f"{directory}: only `- path: FILE` patches are supported, not {entry}")
        for patch in load_documents(directory / entry["path"]):
            matches = [i for i, resource in enumerate(resources) if resource_id(resource) == resource_id(patch)]
            if not matches:
                raise ValueError(f"{directory}: patch {entry['path']} matches no resource {resource_id(patch)}")
            for i in matches:
                resources[i] = strategic_merge(resources[i], patch)

    for image in kustomization.get("images", []):
        unknown = set(image) - {"name", "newName", "newTag"}
        if unknown or "name" not in image:
            raise UnsupportedFeature(f"{directory}: image entry {image} (only name, newName, newTag)")
        for resource in resources:
            for container in _containers(resource):
                container["image"] = _retag(container.get("image", ""), image)
    return resources


def strategic_merge(original: Any, patch: Any, field: str | None = None) -> Any:
    """``patch`` merged into ``original`` (neither is modified) by the rules in the module docstring."""
    if isinstance(patch, dict):
        _refuse_directives(patch)
        if not isinstance(original, dict):
            return copy.deepcopy(patch)
        merged = copy.deepcopy(original)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value, key)
            else:
                merged[key] = strategic_merge(None, value, key)
        return merged
    if isinstance(patch, list):
        key = MERGE_KEYS.get(field or "")
        if key is None or not isinstance(original, list):
            for item in patch:
                if isinstance(item, dict):
                    _refuse_directives(item)
            return copy.deepcopy(patch)
        # kustomize's order: the patch's items first, in the patch's order (merged into the original
        # item with the same key, if any), then the original items the patch does not name.
        by_key = {item.get(key): item for item in original if isinstance(item, dict)}
        merged = []
        for item in patch:
            if not isinstance(item, dict) or key not in item:
                raise ValueError(f"{field}: a patch item lacks the merge key {key!r}: {item}")
            _refuse_directives(item)
            merged.append(strategic_merge(by_key.get(item[key]), item, field))
        named = {item[key] for item in patch}
        merged += [copy.deepcopy(item) for item in original if not (isinstance(item, dict) and item.get(key) in named)]
        return merged
    return copy.deepcopy(patch)


def _read_kustomization(directory: Path) -> dict[str, Any]:
    for name in KUSTOMIZATION_FILES:
        if (directory / name).is_file():
            documents = load_documents(directory / name)
            if len(documents) != 1:
                raise ValueError(f"{directory / name}: expected one document, found {len(documents)}")
            return documents[0]
    raise FileNotFoundError(f"{directory}: no kustomization file ({', '.join(KUSTOMIZATION_FILES)})")


def _refuse_directives(mapping: dict[str, Any]) -> None:
    directives = [key for key in mapping if isinstance(key, str) and key.startswith("$")]
    if directives:
        raise UnsupportedFeature(f"strategic-merge directives {directives} are not supported")


def _containers(resource: dict[str, Any]) -> Iterable[dict[str, Any]]:
    if resource.get("kind") in WORKLOAD_KINDS:
        pod_spec = ((resource.get("spec") or {}).get("template") or {}).get("spec") or {}
    elif resource.get("kind") == "CronJob":
        job = ((resource.get("spec") or {}).get("jobTemplate") or {}).get("spec") or {}
        pod_spec = (job.get("template") or {}).get("spec") or {}
    elif resource.get("kind") == "Pod":
        pod_spec = resource.get("spec") or {}
    else:
        return []
    return [*pod_spec.get("initContainers", []), *pod_spec.get("containers", [])]


def _retag(reference: str, image: dict[str, str]) -> str:
    if "@" in reference:
        raise UnsupportedFeature(f"image {reference!r}: digests are not supported")
    name, tag = reference, None
    last = reference.rsplit("/", 1)[-1]
    if ":" in last:  # a registry port ("host:5000/x") sits before the last "/", a tag after it
        name, tag = reference.rsplit(":", 1)
    if name != image["name"]:
        return reference
    name = image.get("newName", name)
    tag = image.get("newTag", tag)
    return f"{name}:{tag}" if tag else name
