"""The model as protocol v2 describes it, on HTTP and gRPC alike: metadata, configuration,
statistics and the repository index, as plain documents.

The HTTP routes (api/v2/routes.py) answer these documents as JSON; the gRPC servicer
(api/grpc/servicer.py) parses the same documents into the protocol's messages
(``google.protobuf.json_format.ParseDict``), so both protocols say the same thing. The documents
follow the field names of Triton's service definition and model configuration (``grpc_service.proto``
and ``model_config.proto`` in triton-inference-server/common, the JSON forms its HTTP/REST API
answers: triton-inference-server/server ``docs/protocol/extension_model_configuration.md``,
``extension_statistics.md``, ``extension_model_repository.md``).
"""

from __future__ import annotations

from typing import Any

from moegrad import ORDERS, __version__
from moegrad_service.api.errors import NotFound
from moegrad_service.api.v2.codec import BINARY_ONLY, GRAD_DATATYPES, MODEL_NAME, MODEL_VERSION, OUTPUT
from moegrad_service.dataplane import DataPlane, Duration

__all__ = [
    "EXTENSIONS",
    "check_model",
    "model_config",
    "model_metadata",
    "model_statistics",
    "repository_index",
    "server_metadata",
]

#: The protocol extensions served on both protocols (binary tensor data is HTTP's alone).
EXTENSIONS = ("model_configuration", "statistics")
#: The tensors as the metadata and configuration give them: one datatype and shape each (the
#: configuration's dims use -1 for a variable dimension). grad_expanded_x also takes FP16 and BF16
#: and, in drop/pad mode, [E, C, H]; the parameters say so.
_TENSORS = {
    "inputs": [("grad_expanded_x", "FP32", [-1, -1]), ("expanded_row_idx", "INT32", [-1])],
    "outputs": [(OUTPUT, "FP32", [-1, -1])],
}


def check_model(name: str, version: str) -> None:
    """Return when ``name`` (and ``version``, "" for the default) is the served model.

    Raises:
        NotFound: (HTTP 404, gRPC NOT_FOUND) another model or version.
    """
    if name != MODEL_NAME:
        raise NotFound(f"unknown model {name!r}; this server serves {MODEL_NAME!r}")
    if version not in ("", MODEL_VERSION):
        raise NotFound(f"unknown version {version!r} of model {MODEL_NAME!r}; the versions are [{MODEL_VERSION!r}]")


def server_metadata(*, binary_tensor_data: bool) -> dict[str, Any]:
    """The server metadata; ``binary_tensor_data`` lists that extension (HTTP only)."""
    extensions = (["binary_tensor_data"] if binary_tensor_data else []) + list(EXTENSIONS)
    return {"name": "moegrad", "version": __version__, "extensions": extensions}


def _parameters(dataplane: DataPlane) -> dict[str, str]:
    parameters = {
        "operator": "aclnnMoeInitRoutingV2Grad",
        "backend": dataplane.backend_name,
        "grad_expanded_x_datatypes": ",".join(GRAD_DATATYPES),
        "grad_expanded_x_shape_drop_pad": "[-1,-1,-1] ([E, C, H]) when drop_pad_mode=1",
        "grad_x_datatype": "the datatype of grad_expanded_x",
        "binary_only_datatypes": ",".join(sorted(BINARY_ONLY)),
        "request_parameters": "top_k (int, required), drop_pad_mode (int, default 0), active_num (int, default 0), "
        f"order (a device profile: {'|'.join(ORDERS)}; an alias means its profile, the name replies carry), "
        "allow_duplicate_indices (bool, default false)",
        "default_order": dataplane.default_order,
    }
    if dataplane.device is not None:
        parameters["device"] = dataplane.device
    return parameters


def model_metadata(dataplane: DataPlane) -> dict[str, Any]:
    """The model metadata (the HTTP form has ``parameters``; the gRPC message has no such field)."""
    return {
        "name": MODEL_NAME,
        "versions": [MODEL_VERSION],
        "platform": f"moegrad_{dataplane.backend_name}",
        **{
            kind: [{"name": name, "datatype": datatype, "shape": shape} for name, datatype, shape in tensors]
            for kind, tensors in _TENSORS.items()
        },
        "parameters": _parameters(dataplane),
    }


def model_config(dataplane: DataPlane) -> dict[str, Any]:
    """The model configuration (Triton's ``ModelConfig``): no batching (``max_batch_size`` 0, so
    ``dims`` are the whole shapes), the one version, the tensors, and the metadata's parameters as
    ``{"string_value": ...}``."""

    def tensor(name: str, datatype: str, dims: list[int]) -> dict[str, Any]:
        return {"name": name, "data_type": f"TYPE_{datatype}", "dims": dims}

    return {
        "name": MODEL_NAME,
        "platform": f"moegrad_{dataplane.backend_name}",
        "backend": dataplane.backend_name,
        "version_policy": {"specific": {"versions": [int(MODEL_VERSION)]}},
        "max_batch_size": 0,
        "input": [tensor(*spec) for spec in _TENSORS["inputs"]],
        "output": [tensor(*spec) for spec in _TENSORS["outputs"]],
        "instance_group": [
            {
                "name": MODEL_NAME,
                "count": dataplane.settings.streams,
                "kind": "KIND_CPU" if dataplane.device is None else "KIND_MODEL",
            }
        ],
        "parameters": {key: {"string_value": value} for key, value in _parameters(dataplane).items()},
    }


def _duration(duration: Duration) -> dict[str, int]:
    return {"count": duration.count, "ns": duration.ns}


def model_statistics(dataplane: DataPlane) -> dict[str, Any]:
    """The statistics response (Triton's ``ModelStatisticsResponse``) for the one model, from the
    dataplane's counters (:class:`moegrad_service.dataplane.InferenceStatistics`); durations in ns,
    ``last_inference`` in milliseconds since the epoch. There is no response cache: its hit and miss
    counts are 0."""
    stats = dataplane.statistics
    inference_stats = {
        name: _duration(getattr(stats, name))
        for name in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
    }
    inference_stats |= {"cache_hit": {"count": 0, "ns": 0}, "cache_miss": {"count": 0, "ns": 0}}
    return {
        "model_stats": [
            {
                "name": MODEL_NAME,
                "version": MODEL_VERSION,
                "last_inference": stats.last_inference_ms,
                "inference_count": stats.inference_count,
                "execution_count": stats.execution_count,
                "inference_stats": inference_stats,
                "batch_stats": [],
            }
        ]
    }


def repository_index(ready: bool) -> list[dict[str, str]]:
    """The repository index: the one model, ``READY`` (the service serves it from start to stop;
    ``ready`` asks for ready models only, which is the same list)."""
    del ready
    return [{"name": MODEL_NAME, "version": MODEL_VERSION, "state": "READY", "reason": ""}]
