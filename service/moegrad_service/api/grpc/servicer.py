"""Protocol v2 over gRPC, the servicer: ``inference.GRPCInferenceService`` on the shared dataplane.

Each RPC is admit and read (api/grpc/admission.py) -> decode (api/grpc/codec.py) -> dataplane ->
encode, like the HTTP routes; every method is registered request-streaming, so that nothing of
its message is read before it is admitted (a unary call is one message on the wire either way).
A ModelInfer, once decoded, holds what its call's shapes say (moegrad_service.memory.peaks, as an
HTTP call does) and runs in its tenant's turn: its caller's token, from the metadata.
An error is a gRPC status: its code from the one error table (api/errors.py, the ``grpc_code``
column), its details the same message the HTTP answer carries (for an operator constraint: the
field, the rule and the aclnn code), and the HTTP answer's shared headers as trailing metadata
(``retry-after`` on UNAVAILABLE, ``www-authenticate`` on UNAUTHENTICATED). Readiness RPCs answer
``ready: false`` rather than an error, as Triton does. The RPCs of the service definition that
moegrad does not serve (streaming, loading and unloading models, shared memory, trace and log
settings) answer UNIMPLEMENTED, reading nothing.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from tritonclient.grpc import model_config_pb2, service_pb2

from moegrad import DeadlineExceeded, DeviceBusy, MalformedRequest, MoegradError
from moegrad_service.api.auth import Authenticator
from moegrad_service.api.errors import NotFound, answer_for, message_of, shared_headers
from moegrad_service.api.grpc.admission import MessageGate, Reservation
from moegrad_service.api.grpc.codec import decode_infer_request, encode_infer_response
from moegrad_service.api.grpc.wire import check_typed_contents
from moegrad_service.api.inputs import INLINE_DECODE_BYTES, off_loop
from moegrad_service.api.v2.codec import INLINE_ENCODE_ELEMENTS
from moegrad_service.api.v2.model import (
    check_model,
    model_config,
    model_metadata,
    model_statistics,
    repository_index,
    server_metadata,
)
from moegrad_service.dataplane import DataPlane
from moegrad_service.memory import call_peak
from moegrad_service.metrics import Metrics

__all__ = ["SERVICE", "InferenceServicer", "Rpc", "authorization_of", "grpc_status", "method_handlers", "parse_request"]

log = logging.getLogger("moegrad_service.api")
#: The full name of the service (the prefix of every method path).
SERVICE = "inference.GRPCInferenceService"
_DESCRIPTOR = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
_SERVED = (
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelInfer",
    "ModelConfig",
    "ModelStatistics",
    "RepositoryIndex",
)


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """The status code (from :data:`moegrad_service.api.errors.ERRORS`), details and trailing
    metadata that answer ``exc`` on gRPC."""
    answer = answer_for(exc)
    trailers = tuple((key.lower(), value) for key, value in shared_headers(exc).items())
    return grpc.StatusCode[answer.grpc_code], message_of(exc), trailers


def authorization_of(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The ``authorization`` entry of an RPC's metadata ("" when absent), as HTTP's header."""
    return next((value for key, value in metadata or () if key == "authorization" and isinstance(value, str)), "")


@dataclass
class Rpc:
    """One RPC as its method sees it besides the request.

    Attributes:
        started: when it began (``time.perf_counter()``).
        tenant: whose it is: its token's identity (api/auth.py), None without tokens.
        received: its request message's size, in bytes.
        reservation: what it holds of the in-flight budget since its message was read, or None.
    """

    started: float
    tenant: str | None = None
    received: int = 0
    reservation: Reservation | None = None


Handler = Callable[[Any, Any, grpc.aio.ServicerContext, Rpc], Awaitable[Any]]
#: RPCs whose request messages have no fields: they are answered without reading them.
_UNREAD = frozenset({"ServerLive", "ServerReady", "ServerMetadata"})


def _parse(request_type: Any, raw: bytes) -> Any:
    try:
        return request_type.FromString(raw)
    except DecodeError as exc:
        raise MalformedRequest(
            f"the request is not a valid {request_type.DESCRIPTOR.full_name} message ({exc}); "
            f"send one serialized from the protocol's service definition"
        ) from None


async def parse_request(request_type: Any, raw: bytes) -> Any:
    """``raw`` parsed as a ``request_type`` message, on a worker thread when it is large."""
    return await off_loop(_parse, request_type, raw) if len(raw) > INLINE_DECODE_BYTES else _parse(request_type, raw)


def _rpc(method: Handler) -> Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[bytes]]:
    """An RPC served as request-streaming (module docstring): its request message is read only once
    the in-flight budget holds room for it (api/grpc/admission.py; RPCs whose request has no fields
    never read it), then parsed (bytes that are not the request message are INVALID_ARGUMENT, not
    the INTERNAL a failed deserializer gets from grpc), a large message on a worker thread. The reply
    is serialized here (ModelInfer's by its codec). Errors become gRPC statuses, counted in the
    failure metric under the method path."""
    endpoint = f"/{SERVICE}/{method.__name__}"
    request_type: Any = getattr(service_pb2, _DESCRIPTOR.methods_by_name[method.__name__].input_type.name)
    infer = method.__name__ == "ModelInfer"
    reads = method.__name__ not in _UNREAD

    @functools.wraps(method)
    async def handler(self: InferenceServicer, requests: Any, context: grpc.aio.ServicerContext) -> bytes:
        rpc = Rpc(started=time.perf_counter())
        try:
            if infer:  # refused before the message is read when the pool could not take the tenant's call
                rpc.tenant = self.tenant(context)
                self.dataplane.admit(tenant=rpc.tenant).release()
            raw = b""
            if reads:
                raw, rpc.reservation = await self.gate.receive(context, rpc.started)
            rpc.received = len(raw)
            if infer:
                check_typed_contents(raw)
            request = await parse_request(request_type, raw)
            del raw  # the parsed message holds what the call needs
            if rpc.reservation is not None and not infer:  # the parsed message is all such an RPC holds
                rpc.reservation.release()
            running = method(self, request, context, rpc)
            del request  # the method alone holds it now, and lets it go once decoded
            reply = await running
            data = reply if isinstance(reply, bytes) else reply.SerializeToString()
            if infer:
                self.metrics.bytes_in.inc(rpc.received)
                self.metrics.bytes_out.inc(len(data))
                self.metrics.succeeded(endpoint, rpc.started)
            return data
        except Exception as exc:  # every error, expected or not, is answered with a status
            code, details, trailers = grpc_status(exc)
            answer = answer_for(exc)
            if not isinstance(exc, MoegradError):
                log.error("%s: unexpected error", endpoint, exc_info=exc)
            elif answer.status >= 500 and not isinstance(exc, (DeviceBusy, DeadlineExceeded)):
                log.error("%s failed: %s: %s", endpoint, type(exc).__name__, details)
            self.metrics.failure.labels(endpoint=endpoint, reason=answer.reason).inc()
            context.set_trailing_metadata(trailers)
            await context.abort(code, details)
            raise AssertionError("context.abort raises") from None
        finally:
            if rpc.reservation is not None:
                rpc.reservation.release()

    return handler


def _declared_bytes(request: service_pb2.ModelInferRequest) -> int:
    """The inputs' bytes as their shapes declare them, at 4 bytes an element (a cheap upper guess for
    where to decode; the decoder checks the real sizes)."""
    return sum(4 * math.prod(tensor.shape) for tensor in request.inputs)


class InferenceServicer:
    """The Open Inference Protocol's gRPC service for the one model, on ``dataplane``.

    Args:
        dataplane: the dataplane every protocol shares.
        metrics: the app's metrics (successes, failures and bytes, labelled with the method path).
        gate: the admission of request messages before they are read.
        authenticator: the bearer tokens (a call's tenant is its token's identity); None: no tokens.
    """

    def __init__(
        self, dataplane: DataPlane, metrics: Metrics, gate: MessageGate, authenticator: Authenticator | None = None
    ) -> None:
        self.dataplane = dataplane
        self.metrics = metrics
        self.gate = gate
        self.authenticator = authenticator

    def tenant(self, context: grpc.aio.ServicerContext) -> str | None:
        """The caller's tenant: its token's identity (``token-<n>``, api/auth.py), from the metadata
        the server's interceptor has already checked; None without tokens.

        Raises:
            Unauthorized: (UNAUTHENTICATED) no accepted token (the interceptor refuses such an RPC first).
        """
        if self.authenticator is None:
            return None
        return self.authenticator.check(f"/{SERVICE}/ModelInfer", authorization_of(context.invocation_metadata()))

    async def _ready(self) -> bool:
        try:
            await self.dataplane.check_ready()
        except DeviceBusy:
            return False
        return True

    @_rpc
    async def ServerLive(self, request, context, rpc) -> service_pb2.ServerLiveResponse:
        return service_pb2.ServerLiveResponse(live=True)

    @_rpc
    async def ServerReady(self, request, context, rpc) -> service_pb2.ServerReadyResponse:
        return service_pb2.ServerReadyResponse(ready=await self._ready())

    @_rpc
    async def ModelReady(self, request, context, rpc) -> service_pb2.ModelReadyResponse:
        try:
            check_model(request.name, request.version)
        except NotFound:
            return service_pb2.ModelReadyResponse(ready=False)
        return service_pb2.ModelReadyResponse(ready=await self._ready())

    @_rpc
    async def ServerMetadata(self, request, context, rpc) -> service_pb2.ServerMetadataResponse:
        return json_format.ParseDict(server_metadata(binary_tensor_data=False), service_pb2.ServerMetadataResponse())

    @_rpc
    async def ModelMetadata(self, request, context, rpc) -> service_pb2.ModelMetadataResponse:
        check_model(request.name, request.version)
        document = model_metadata(self.dataplane)
        del document["parameters"]  # the message has no such field: ModelConfig carries them
        return json_format.ParseDict(document, service_pb2.ModelMetadataResponse())

    @_rpc
    async def ModelConfig(self, request, context, rpc) -> service_pb2.ModelConfigResponse:
        check_model(request.name, request.version)
        config = json_format.ParseDict(model_config(self.dataplane), model_config_pb2.ModelConfig())
        return service_pb2.ModelConfigResponse(config=config)

    @_rpc
    async def ModelStatistics(self, request, context, rpc) -> service_pb2.ModelStatisticsResponse:
        if request.name:  # "": every model
            check_model(request.name, request.version)
        return json_format.ParseDict(model_statistics(self.dataplane), service_pb2.ModelStatisticsResponse())

    @_rpc
    async def RepositoryIndex(self, request, context, rpc) -> service_pb2.RepositoryIndexResponse:
        return json_format.ParseDict({"models": repository_index(request.ready)}, service_pb2.RepositoryIndexResponse())

    @_rpc
    async def ModelInfer(self, request, context, rpc) -> bytes:
        check_model(request.model_name, request.model_version)
        dataplane, settings = self.dataplane, self.dataplane.settings
        timeout_s = settings.request_timeout_s
        remaining = context.time_remaining()  # the client's deadline, if it set one
        if remaining is not None:
            timeout_s = min(timeout_s, max(remaining, 0.0))
        decode = functools.partial(
            decode_infer_request, request, max_elements=settings.max_elements, default_order=dataplane.default_order
        )
        inline = _declared_bytes(request) <= INLINE_DECODE_BYTES
        del request  # decode holds it until the tensors are copied out of it, then nothing does
        decoded = decode() if inline else await off_loop(decode)
        del decode
        if decoded.timeout_s is not None:
            timeout_s = min(timeout_s, decoded.timeout_s)
        call, request_id = decoded.call, decoded.id
        del decoded  # the call alone holds the tensors, and the dataplane lets go of it once it has run
        if rpc.reservation is not None:  # from the read's reservation to what the call holds from now on
            rpc.reservation.cover(call_peak(call, body_bytes=rpc.received, reply="serialized"))
        # A client that cancels cancels this task: a queued call is dropped unrun (StreamPool.run).
        outcome = await dataplane.infer(call, timeout_s=timeout_s, received_s=rpc.started, tenant=rpc.tenant)
        del call
        if outcome.grad_x.size > INLINE_ENCODE_ELEMENTS:
            return await off_loop(encode_infer_response, outcome, request_id)
        return encode_infer_response(outcome, request_id)


def _unimplemented(name: str) -> Callable[..., Awaitable[None]]:
    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"moegrad does not serve {SERVICE}/{name}")

    return refuse


def method_handlers(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """Every method of the service definition, bound to ``servicer``, each request-streaming: its
    handler runs before the request message is read, and reads it (as bytes) only once admitted; a
    unary call is one message on the wire either way. Replies leave as bytes (each RPC serializes
    its own)."""
    handlers = {}
    for method in _DESCRIPTOR.methods:
        if method.name in _SERVED:
            handlers[method.name] = grpc.stream_unary_rpc_method_handler(getattr(servicer, method.name))
        elif method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(_unimplemented(method.name))
        else:
            handlers[method.name] = grpc.stream_unary_rpc_method_handler(_unimplemented(method.name))
    return grpc.method_handlers_generic_handler(SERVICE, handlers)
