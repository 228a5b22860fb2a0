"""aclnn status codes and the moegrad exception tree.

Every error moegrad raises, on the client or in the service, is one of these::

    MoegradError
    ├── InvalidArgument        an input the operator rejects (carries aclnn_status, aclnn_name, field)
    ├── MalformedRequest       a body that is not a valid request document (bad msgpack, bad tensor map)
    │   └── PayloadTooLarge    a body or tensor over a configured limit
    ├── DeviceBusy             the admission queue is full, or the service is not ready (retry later)
    ├── DeadlineExceeded       the request's deadline passed before its result was ready
    ├── DeviceFault            the backend failed while running a valid call (device message attached)
    └── ServiceError           any other failure reported by a server or its transport
        ├── TransportError     the server could not be reached, or the connection broke
        └── Unauthorized       the server requires a bearer token and none or a wrong one was sent

One warning: :class:`ReplicaWarning`, a client named in a way that leaves replicas unused (a plain
``http://`` name that resolves to several addresses).

The first five are domain errors: the engine raises them, ``moegrad_service.api`` maps each to an
HTTP status through one table, and the client raises the same class again from the server's answer.
None of them carries HTTP in its definition.

aclnn status codes (``aclnn/acl_meta.h`` and the "aclnn Return Code" page of the CANN documentation).
"""

from __future__ import annotations

import enum

__all__ = [
    "AclnnStatus",
    "DeadlineExceeded",
    "DeviceBusy",
    "DeviceFault",
    "InvalidArgument",
    "MalformedRequest",
    "MoegradError",
    "PayloadTooLarge",
    "ReplicaWarning",
    "ServiceError",
    "TransportError",
    "Unauthorized",
]


class AclnnStatus(enum.IntEnum):
    """aclnnStatus return codes (CANN ``aclnn/acl_meta.h``; the 5611xx installation codes from
    opbase's ``include/nnopbase/opdev/op_errno.h``)."""

    ACLNN_SUCCESS = 0
    ACLNN_ERR_PARAM_NULLPTR = 161001
    ACLNN_ERR_PARAM_INVALID = 161002
    ACLNN_ERR_RUNTIME_ERROR = 361001
    ACLNN_ERR_INNER = 561000
    ACLNN_ERR_INNER_INFERSHAPE_ERROR = 561001
    ACLNN_ERR_INNER_TILING_ERROR = 561002
    ACLNN_ERR_INNER_FIND_KERNEL_ERROR = 561003
    ACLNN_ERR_INNER_CREATE_EXECUTOR = 561101
    ACLNN_ERR_INNER_NOT_TRANS_EXECUTOR = 561102
    ACLNN_ERR_INNER_NULLPTR = 561103
    ACLNN_ERR_INNER_OPP_PATH_NOT_FOUND = 561107
    ACLNN_ERR_INNER_LOAD_JSON_FAILED = 561108
    ACLNN_ERR_INNER_OPP_KERNEL_PKG_NOT_FOUND = 561112

    @classmethod
    def name_of(cls, code: int) -> str:
        """The symbolic name of ``code``, or ``"ACLNN_UNKNOWN_<code>"`` for a code not in the table."""
        try:
            return cls(code).name
        except ValueError:
            return f"ACLNN_UNKNOWN_{code}"


class MoegradError(Exception):
    """Base class of every moegrad error."""


class InvalidArgument(MoegradError):
    """An operator call the documented constraints (or the device's phase one) reject.

    Attributes:
        aclnn_status: the aclnn status code the operator's phase one returns for this input
            (161001 null tensor, 161002 dtype/value, 561002 attribute/shape; docs/operator.md).
        aclnn_name: the symbolic name of ``aclnn_status``.
        field: the request field at fault (``"expanded_row_idx"``, ``"top_k"``, ...), or None.
        message: a sentence a user understands, naming the value and the rule.
    """

    def __init__(self, message: str, *, aclnn_status: int, field: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.aclnn_status = int(aclnn_status)
        self.aclnn_name = AclnnStatus.name_of(self.aclnn_status)
        self.field = field

    def __str__(self) -> str:
        where = f" [field {self.field}]" if self.field else ""
        return f"{self.message}{where} ({self.aclnn_name} {self.aclnn_status})"

    def __reduce__(self):  # keep pickling (multiprocessing, pytest-xdist) working with kw-only args
        return (_rebuild_invalid_argument, (self.message, self.aclnn_status, self.field))


def _rebuild_invalid_argument(message: str, aclnn_status: int, field: str | None) -> InvalidArgument:
    return InvalidArgument(message, aclnn_status=aclnn_status, field=field)


class MalformedRequest(MoegradError):
    """A request body that is not a well-formed moegrad document.

    Attributes:
        field: the request field at fault, or None when the body as a whole is unreadable.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class PayloadTooLarge(MalformedRequest):
    """A body, tensor or structure larger than a configured limit (bytes or elements)."""


class DeviceBusy(MoegradError):
    """The service cannot admit the call now (queue full, starting, or shutting down).

    Attributes:
        retry_after_s: seconds after which a retry is reasonable.
    """

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = float(retry_after_s)


class DeadlineExceeded(MoegradError):
    """The call's deadline passed while it was queued or running; queued work is not run."""


class DeviceFault(MoegradError):
    """The backend failed while running a valid call.

    Attributes:
        aclnn_status: the runtime or aclnn code the backend returned, when it gave one.
        device_message: the device runtime's own text (``aclGetRecentErrMsg``), when it gave one.
    """

    def __init__(self, message: str, *, aclnn_status: int | None = None, device_message: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.aclnn_status = aclnn_status
        self.device_message = device_message


class ServiceError(MoegradError):
    """A failure reported by a server (or its transport) that no domain error describes.

    Attributes:
        status_code: the HTTP status, or None when no response arrived.
        problem: the decoded RFC 9457 problem document, when the server sent one.
    """

    def __init__(self, message: str, *, status_code: int | None = None, problem: dict | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.problem = problem or {}


class TransportError(ServiceError):
    """The server could not be reached, or the connection failed mid-request."""


class Unauthorized(ServiceError):
    """The server requires a bearer token and none, or a wrong one, was sent (HTTP 401)."""


class ReplicaWarning(UserWarning):
    """A client whose URL leaves replicas unused: a plain ``http(s)://`` name that resolves to several
    addresses of one family is one replica to the client, every call going to the address the
    resolver gives first (no spreading, no failover); a ``dns+`` URL makes each address a replica
    (docs/accuracy.md, "Sweeps"). Issued once per client and host, at its first connection."""
