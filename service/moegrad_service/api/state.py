"""What a request keeps in its ASGI state: its :class:`~moegrad_service.memory.Admission`, under one key.

:func:`~moegrad_service.api.inputs.read_body` admits the request and keeps the admission here
(:func:`hold_admission`); the route releases it once the answer is sent (:func:`release_admission`,
api/routing.py); the access log and the early-answer check read it (:func:`admission_of`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.types import Scope

if TYPE_CHECKING:
    from moegrad_service.memory import Admission

__all__ = ["ADMISSION", "admission_of", "hold_admission", "release_admission"]

#: The request state's key of the request's Admission.
ADMISSION = "admission"


def hold_admission(scope: Scope, admission: Admission) -> None:
    """Keep ``admission`` as the request's, until :func:`release_admission`."""
    scope["state"][ADMISSION] = admission


def admission_of(scope: Scope) -> Admission | None:
    """The request's admission, or None: its body was not read."""
    return scope.get("state", {}).get(ADMISSION)


def release_admission(scope: Scope) -> None:
    """Give back what the request holds of the service's memory (:meth:`Admission.release`), once
    its answer is sent."""
    admission = admission_of(scope)
    if admission is not None:
        admission.release()
