"""The candidate: an implementation of aclnnMoeInitRoutingV2Grad that moegrad puts on the bench.

A candidate is one of:

- a Python callable ``fn(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode, active_num)
  -> grad_x``, called with NumPy arrays or with torch tensors (:class:`Candidate` ``accepts``);
- ``"package.module:function"``, such a callable imported by name (:meth:`Candidate.load`);
- the URL of a server speaking protocol v2 (the Open Inference Protocol of KServe and Triton; the
  moegrad service's own ``/v2/models/moe_init_routing_v2_grad/infer`` is one), called over HTTP with
  binary tensor data (docs/protocol.md, "Protocol v2").

:class:`Candidate` wraps each the same way: called with a :class:`~moegrad.MoeInitRoutingV2GradCall`,
it returns grad_x as a NumPy array of shape [N, H] in the call's dtype or float32, or raises
:class:`CandidateError`. It counts its calls (``.calls``), which the probes report.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np

from moegrad._dtypes import DTYPES, dtype_name
from moegrad._errors import MoegradError
from moegrad._tensors import is_tensor, to_numpy
from moegrad.operator._call import MoeInitRoutingV2GradCall

__all__ = ["V2_MODEL", "Candidate", "CandidateError", "as_candidate", "candidate_in_use"]

#: The model name of the operator on a v2 server (docs/protocol.md).
V2_MODEL = "moe_init_routing_v2_grad"
_HEADER_LENGTH = "Inference-Header-Content-Length"
_V2_TYPES = {"float16": "FP16", "bfloat16": "BF16", "float32": "FP32", "int32": "INT32"}
_V2_DTYPES = {v2: name for name, v2 in _V2_TYPES.items()}
_ACCEPTS = ("auto", "numpy", "torch")


class CandidateError(MoegradError):
    """The candidate failed (raised, or its server answered an error) or returned something that is
    not the call's grad_x (another shape, a dtype other than the call's or float32)."""


def _first_annotation(fn: Any) -> Any:
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature
        return None
    return parameters[0].annotation if parameters else None


def _detect(fn: Any, device: str | None) -> tuple[str, str | None]:
    """``(accepts, device)`` for ``accepts="auto"``: torch for a ``torch.nn.Module`` or a first
    parameter annotated as a ``Tensor``; NumPy otherwise."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(fn, torch.nn.Module):
        tensors = [*fn.parameters(), *fn.buffers()]
        return "torch", device or (str(tensors[0].device) if tensors else "cpu")
    annotation = _first_annotation(fn)
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    if text == "Tensor" or text.endswith(".Tensor"):
        return "torch", device or "cpu"
    return "numpy", device


def _torch_tensor(array: np.ndarray, device: str) -> Any:
    import torch

    if dtype_name(array.dtype) == "bfloat16":
        tensor = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(array)
    return tensor.to(device)


def _check_result(result: Any, call: MoeInitRoutingV2GradCall, name: str) -> np.ndarray:
    array = to_numpy(result) if is_tensor(result) else result
    if not isinstance(array, np.ndarray):
        raise CandidateError(f"candidate {name} returned {type(result).__name__}, not an array or a tensor")
    want = (call.num_tokens, call.hidden_size)
    if array.shape != want:
        raise CandidateError(
            f"candidate {name} returned shape {list(array.shape)}; grad_x of this call is {list(want)} [N, H]"
        )
    kind = dtype_name(array.dtype)
    if kind not in (call.dtype_name, "float32"):
        raise CandidateError(
            f"candidate {name} returned dtype {kind or array.dtype}; grad_x must have the call's dtype "
            f"({call.dtype_name}) or float32"
        )
    return array


class Candidate:
    """A candidate implementation, called with a validated call; returns grad_x as a NumPy array.

    Args:
        target: a callable ``fn(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode,
            active_num)``; or a URL ``http(s)://host:port`` of a v2 server (the model route
            ``/v2/models/<model>/infer`` is added), or the full infer URL.
        accepts: how a callable takes its tensors: ``"numpy"`` (NumPy arrays: bfloat16 as
            ``ml_dtypes.bfloat16``, the index int32), ``"torch"`` (torch tensors on ``device``,
            bfloat16 as ``torch.bfloat16``), or ``"auto"`` (default): torch for a
            ``torch.nn.Module`` (on the device of its first parameter or buffer) and for a callable
            whose first parameter is annotated ``torch.Tensor``, NumPy otherwise. Calling to find
            out is never tried: a failing call may have side effects.
        device: the torch device of the inputs (default ``"cpu"``); with ``accepts="torch"`` only.
        model: the v2 model name (default ``"moe_init_routing_v2_grad"``).
        token: a bearer token for the v2 server.
        parameters: extra v2 request parameters (e.g. ``{"order": "ascend950@9.1"}`` for a moegrad
            service); top_k, drop_pad_mode and active_num always come from the call.
        timeout_s: the whole v2 request's limit in seconds.
        http_client: an ``httpx.Client`` to send v2 requests with (e.g. a test client); default one
            of its own, closed by :meth:`close`.

    The callable gets fresh copies of the call's arrays (it may write to them) and
    ``drop_pad_mode`` and ``active_num`` as keywords; its result may be a NumPy array or a torch
    tensor on any device, [N, H], in the call's dtype or float32.

    Raises:
        ValueError: an unknown ``accepts``, or ``device`` with NumPy inputs.
        TypeError: a target that is neither callable nor a URL.
    """

    def __init__(
        self,
        target: Any,
        *,
        accepts: str = "auto",
        device: str | None = None,
        model: str = V2_MODEL,
        token: str | None = None,
        parameters: dict[str, Any] | None = None,
        timeout_s: float = 300.0,
        http_client: httpx.Client | None = None,
    ) -> None:
        if accepts not in _ACCEPTS:
            raise ValueError(f"accepts={accepts!r} is not one of {', '.join(_ACCEPTS)}")
        self.calls = 0
        self._v2: _V2Candidate | None = None
        self._fn: Any = None
        self._spec: str | None = None
        if isinstance(target, str) and target.startswith(("http://", "https://")):
            self._v2 = _V2Candidate(target, model, token, dict(parameters or {}), timeout_s, http_client)
            self.name, self.accepts, self.device = self._v2.url, "v2", None
            return
        if not callable(target):
            raise TypeError(f"a candidate is a callable or a v2 URL (http://...), got {type(target).__name__}")
        self._fn = target
        self.name = getattr(target, "__qualname__", None) or type(target).__name__
        self.accepts, self.device = _detect(target, device) if accepts == "auto" else (accepts, device)
        if self.accepts == "torch":
            self.device = self.device or "cpu"
        elif self.device is not None:
            raise ValueError(f"device={device!r} needs accepts='torch' (NumPy arrays live in host memory)")

    @classmethod
    def load(cls, spec: str, **options: Any) -> Candidate:
        """The candidate ``"package.module:function"`` (an attribute path after the colon may be
        dotted: ``"pkg.mod:Class.method"``), imported from ``sys.path``.

        Raises:
            ValueError: a spec without exactly one colon, or naming nothing callable.
            ImportError: the module does not import.
        """
        module_name, colon, attribute = spec.partition(":")
        if not colon or not module_name or not attribute or ":" in attribute:
            raise ValueError(f"candidate {spec!r}: write it as package.module:function")
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            try:
                target = getattr(target, part)
            except AttributeError:
                raise ValueError(f"candidate {spec!r}: {module_name} has no attribute {attribute!r}") from None
        if not callable(target):
            raise ValueError(f"candidate {spec!r} is a {type(target).__name__}, not a callable")
        candidate = cls(target, **options)
        candidate.name = candidate._spec = spec
        return candidate

    def __call__(self, call: MoeInitRoutingV2GradCall) -> np.ndarray:
        """grad_x of ``call`` as the candidate computes it: [N, H], the call's dtype or float32.

        Raises:
            CandidateError: the candidate raised or its server answered an error, or the result
                has another shape or dtype.
        """
        self.calls += 1
        if self._v2 is not None:
            return _check_result(self._v2(call), call, self.name)
        grad, index = np.array(call.grad_expanded_x, order="C"), np.array(call.expanded_row_idx, order="C")
        inputs: tuple[Any, Any] = (grad, index)
        if self.accepts == "torch":
            assert self.device is not None  # set in __init__ for torch inputs
            inputs = (_torch_tensor(grad, self.device), _torch_tensor(index, self.device))
        try:
            result = self._fn(*inputs, call.top_k, drop_pad_mode=call.drop_pad_mode, active_num=call.active_num)
        except Exception as error:
            raise CandidateError(f"candidate {self.name} raised {type(error).__name__}: {error}") from error
        return _check_result(result, call, self.name)

    @property
    def spec(self) -> str | None:
        """``"package.module:function"`` that imports this candidate's callable back: the spec it was
        loaded from, or the module and qualified name of a function defined at a module's top level
        (or a class's); None for a v2 URL, a lambda, a closure, an object, or anything in ``__main__``."""
        if self._fn is None:
            return None
        if self._spec is not None:
            return self._spec
        return _importable_name(self._fn)

    @property
    def url(self) -> str | None:
        """The v2 infer URL this candidate posts to (None for a callable)."""
        return None if self._v2 is None else self._v2.url

    @property
    def parameters(self) -> dict[str, Any]:
        """The extra v2 request parameters (empty for a callable)."""
        return {} if self._v2 is None else dict(self._v2.parameters)

    def close(self) -> None:
        """Close the v2 client this candidate opened (nothing for a callable)."""
        if self._v2 is not None:
            self._v2.close()

    def __enter__(self) -> Candidate:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Candidate({self.name!r}, accepts={self.accepts!r})"


def _importable_name(fn: Any) -> str | None:
    """``"module:qualname"`` when importing it gives ``fn`` itself, else None."""
    module_name, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str):
        return None
    if module_name == "__main__" or "<" in qualname:  # a script's own, a lambda, a closure
        return None
    target: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return f"{module_name}:{qualname}" if target is fn else None


def as_candidate(candidate: Any) -> Candidate:
    """``candidate`` as a :class:`Candidate`: one as it is, a URL or a ``"package.module:function"``
    string, or a callable (``accepts="auto"``)."""
    if isinstance(candidate, Candidate):
        return candidate
    if isinstance(candidate, str) and not candidate.startswith(("http://", "https://")):
        return Candidate.load(candidate)
    return Candidate(candidate)


@contextlib.contextmanager
def candidate_in_use(candidate: Any) -> Iterator[Candidate]:
    """:func:`as_candidate` for the length of a ``with`` block: a :class:`Candidate` made here (from a
    URL, a spec or a callable) is closed at the end; one given is left open for its owner."""
    made = as_candidate(candidate)
    try:
        yield made
    finally:
        if made is not candidate:
            made.close()


def _infer_url(url: str, model: str) -> str:
    path = httpx.URL(url).path.rstrip("/")
    if path.endswith("/infer"):
        return url
    if "/v2/models/" in path:
        return url.rstrip("/") + "/infer"
    return url.rstrip("/") + f"/v2/models/{model}/infer"


def _little_endian(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


class _V2Candidate:
    """A candidate behind a v2 server: one binary-data infer request per call."""

    def __init__(
        self,
        url: str,
        model: str,
        token: str | None,
        parameters: dict[str, Any],
        timeout_s: float,
        client: httpx.Client | None,
    ) -> None:
        self.url = _infer_url(url, model)
        self.parameters = parameters
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.owned = client is None
        self.client = client if client is not None else httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        if self.owned:
            self.client.close()

    def request(self, call: MoeInitRoutingV2GradCall) -> tuple[bytes, dict[str, str]]:
        grad, index = call.grad_expanded_x, call.expanded_row_idx
        parts = [_little_endian(grad), _little_endian(index)]
        inputs = [
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": _V2_TYPES[dtype_name(array.dtype) or ""],
                "parameters": {"binary_data_size": len(part)},
            }
            for name, array, part in (("grad_expanded_x", grad, parts[0]), ("expanded_row_idx", index, parts[1]))
        ]
        document = {
            "parameters": {
                **self.parameters,
                "top_k": call.top_k,
                "drop_pad_mode": call.drop_pad_mode,
                "active_num": call.active_num,
                "binary_data_output": True,
            },
            "inputs": inputs,
            "outputs": [{"name": "grad_x", "parameters": {"binary_data": True}}],
        }
        head = json.dumps(document, separators=(",", ":")).encode()
        headers = {**self.headers, _HEADER_LENGTH: str(len(head)), "Content-Type": "application/octet-stream"}
        return b"".join([head, *parts]), headers

    def __call__(self, call: MoeInitRoutingV2GradCall) -> np.ndarray:
        body, headers = self.request(call)
        try:
            reply = self.client.post(self.url, content=body, headers=headers)
        except httpx.HTTPError as error:
            raise CandidateError(f"candidate {self.url} could not be reached: {error}") from error
        if reply.status_code != 200:
            raise CandidateError(f"candidate {self.url} answered {reply.status_code}: {_error_text(reply)}")
        return _decode_reply(reply, self.url)


def _error_text(reply: httpx.Response) -> str:
    try:
        return str(reply.json().get("error", reply.text))
    except (ValueError, AttributeError):
        return reply.text[:500]


def _decode_reply(reply: httpx.Response, url: str) -> np.ndarray:
    """grad_x from a v2 infer reply, binary or JSON (docs/protocol.md, "The reply")."""
    content = reply.content
    length = reply.headers.get(_HEADER_LENGTH)
    head_size = int(length) if length is not None else len(content)
    try:
        document = json.loads(content[:head_size])
        outputs = document["outputs"]
        output = next(item for item in outputs if item.get("name") == "grad_x")
        dtype = np.dtype(DTYPES[_V2_DTYPES[output["datatype"]]])
        shape = tuple(int(size) for size in output["shape"])
    except (ValueError, KeyError, TypeError, StopIteration) as error:
        raise CandidateError(f"candidate {url} sent no readable grad_x output ({error!r})") from error
    size = output.get("parameters", {}).get("binary_data_size")
    if size is None:
        return np.asarray(output.get("data", []), dtype=dtype).reshape(shape)
    offset = head_size
    for item in outputs[: outputs.index(output)]:  # binary outputs follow the JSON in their order
        offset += int(item.get("parameters", {}).get("binary_data_size", 0))
    data = content[offset : offset + int(size)]
    if len(data) != int(size) or int(size) != int(np.prod(shape)) * dtype.itemsize:
        raise CandidateError(f"candidate {url} sent {len(data)} bytes of grad_x for shape {list(shape)}")
    return np.frombuffer(data, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape)
