"""What answering one request holds of the service's memory at its peak, from its decoded shapes.

A request is admitted before its body is read, from ``Content-Length`` alone
(:meth:`~moegrad_service.memory.Memory.admit`: twice the body for a call, five times for a batch,
:data:`JSON_HOLD_PER_BODY_BYTE` times a v2 body's JSON). Once decoded, its shapes say what
answering it really holds: each function here computes that as a :class:`Peak` (bytes, by part),
and the request's admission is topped up to it before anything runs
(:meth:`~moegrad_service.memory.Admission.cover`; a gRPC message's reservation likewise, once its
message is decoded). Every protocol uses the same functions (HTTP v1 and v2, gRPC with
``reply="serialized"``), and a request that asks what a call would cost can answer from them
without running it.

The figures are the service's host memory with numba's compiled comparison (a dependency of the
service): a dropless call's grad_x is computed in bounded chunks, so its work is constant; the
judge keeps :data:`JUDGE_ROW_BYTES` of per-row sums for every token (three comparisons of 33
float64 statistics each); an explanation holds what :func:`moegrad.explain_peak_bytes` bounds (its
blocks, the row search's index, and per differing row its result, then as much again for the reply's
map and its encoding); a comparison's report, as objects, as a reply map and packed, is about
:data:`REPORT_BYTES`; a batch item's decoded map, its call, its outcome and its reply map about
:data:`BATCH_ITEM_BYTES`. The constants were measured (peak RSS of a real server against the
formula, ``python -m bench.tenancy --only memory``; ``tests/e2e/test_tenancy_e2e.py`` holds a server to
them) with room to spare; what is not counted (a few MiB of chunks, small replies) is covered by the
fixed allowance the tests grant.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Literal

from moegrad import MoeInitRoutingV2GradCall, explain_peak_bytes

__all__ = [
    "BATCH_ITEM_BYTES",
    "COPIED_CALL_BYTES",
    "JSON_HOLD_PER_BODY_BYTE",
    "JSON_REPLY_ELEMENT_BYTES",
    "JUDGE_ROW_BYTES",
    "REPORT_BYTES",
    "Peak",
    "ReplyForm",
    "batch_peak",
    "call_peak",
    "compare_peak",
    "explain_peak",
    "grad_x_bytes",
]

#: The judge's per-row sums: 3 comparisons x 33 float64 statistics for every token of grad_x
#: (moegrad.accuracy's compiled comparison keeps them all until the rows are summed).
JUDGE_ROW_BYTES = 3 * 33 * 8
#: One comparison's report: its objects, its reply map and the map packed, with room to spare.
REPORT_BYTES = 32 << 10
#: One batch item besides its tensors: its decoded map, its call, its outcome and its reply map.
BATCH_ITEM_BYTES = 2 << 10
#: A call whose tensors come to at most this many bytes is copied out of the body as it is decoded
#: (msgpack's bins) and, in a batch, copied again when stacked with the calls of its shape; a larger
#: one's tensors view the body. Its small grad_x is copied into the packed reply.
COPIED_CALL_BYTES = 64 << 10
#: What a v2 body's JSON holds per byte while it is parsed: the text, the Python numbers and lists
#: it becomes (``[],`` in 3 bytes is a 64-byte list and its slot) and the flattened list.
JSON_HOLD_PER_BODY_BYTE = 24
#: What one element of grad_x costs while a JSON reply is built: a float64 copy, the Python float
#: and its list slot, and its text twice (the ``str`` and its encoded bytes).
JSON_REPLY_ELEMENT_BYTES = 96

#: How a reply carries grad_x: from its own buffer (v1 msgpack and frames, v2 binary), as JSON
#: numbers (a v2 reply without binary data), or copied into one serialized message beside it (gRPC:
#: the reply's bytes are built while grad_x is still held, so grad_x is held twice).
ReplyForm = Literal["buffers", "json", "serialized"]


@dataclass(frozen=True)
class Peak:
    """What answering one request holds at its peak, in bytes, by part.

    Attributes:
        body: the request body as received (its large tensors are views of it).
        decoded: what decoding makes beside the body: tensors copied out of it, a batch's items.
        result: grad_x, every call's (a comparison's device result included).
        work: the computation's own beyond grad_x: the judge's per-row sums and skipped-row masks
            (the largest of a batch's comparisons, which are judged one after another), the reports.
        reply: the reply beyond grad_x's own buffer (JSON text, small tensors packed).
    """

    body: int = 0
    decoded: int = 0
    result: int = 0
    work: int = 0
    reply: int = 0

    @property
    def total(self) -> int:
        """Every part together, in bytes: what the request's admission holds."""
        return self.body + self.decoded + self.result + self.work + self.reply

    def parts(self) -> dict[str, int]:
        """The parts by name (``body``, ``decoded``, ``result``, ``work``, ``reply``), in bytes."""
        return {part.name: getattr(self, part.name) for part in fields(self)}

    def describe(self) -> str:
        """The parts in words, the largest first, zero parts left out: "work 800000000, body ..." ."""
        parts = sorted(((n, name) for name, n in self.parts().items() if n), reverse=True)
        return ", ".join(f"{name} {n}" for n, name in parts)


def grad_x_bytes(call: MoeInitRoutingV2GradCall) -> int:
    """grad_x's size: N x H elements of grad_expanded_x's dtype, in bytes."""
    return call.num_tokens * call.hidden_size * call.grad_expanded_x.dtype.itemsize


def _input_bytes(call: MoeInitRoutingV2GradCall) -> int:
    return call.grad_expanded_x.nbytes + call.expanded_row_idx.nbytes


def call_peak(call: MoeInitRoutingV2GradCall, *, body_bytes: int, reply: ReplyForm = "buffers") -> Peak:
    """One call (v1 grad, v2 infer, gRPC ModelInfer): its body, its tensors copied out when small,
    grad_x [N, H], a JSON reply's numbers when ``reply`` is "json", and grad_x's copy in the reply
    when it is "serialized".

    A drop/pad call whose tokens are all dropped holds a grad_x many times its body ([N, H] from
    an index of N x K): that is the case this counts where a multiple of the body did not.

    Args:
        call: the validated call.
        body_bytes: the request body's size (a gRPC message's: its tensors, copied out of it as it
            is decoded, take its place), in bytes.
        reply: how the reply carries grad_x (:data:`ReplyForm`).
    """
    result = grad_x_bytes(call)
    inputs = _input_bytes(call)
    if reply == "json":
        encoded = call.num_tokens * call.hidden_size * JSON_REPLY_ELEMENT_BYTES
    elif reply == "serialized":
        encoded = result
    else:
        encoded = result if result <= COPIED_CALL_BYTES else 0
    return Peak(body=body_bytes, decoded=inputs if inputs <= COPIED_CALL_BYTES else 0, result=result, reply=encoded)


def _judge_work(call: MoeInitRoutingV2GradCall) -> int:
    """The judge's largest moment: the per-row sums of every token, or the skipped-row masks (three
    of N x K bools, then one of N) if those are larger; the report besides."""
    index_slots = call.expanded_row_idx.size
    masks = 3 * index_slots + 2 * call.num_tokens
    return max(call.num_tokens * JUDGE_ROW_BYTES, masks) + REPORT_BYTES


def compare_peak(call: MoeInitRoutingV2GradCall, candidate_bytes: int, *, body_bytes: int) -> Peak:
    """One comparison (v1 compare): its body, the device's grad_x, the judge's work (per-row sums,
    :data:`JUDGE_ROW_BYTES` a token, whatever H is: a call with H = 1 holds 66 times its body) and
    its report. A returned grad_x is sent from its own buffer.

    Args:
        call: the validated call.
        candidate_bytes: the candidate's size, in bytes (its tensors are copied out when small).
        body_bytes: the request body's size, in bytes.
    """
    inputs = _input_bytes(call) + candidate_bytes
    result = grad_x_bytes(call)
    return Peak(
        body=body_bytes,
        decoded=inputs if inputs <= COPIED_CALL_BYTES else 0,
        result=result,
        work=_judge_work(call),
        reply=result if result <= COPIED_CALL_BYTES else 0,
    )


def explain_peak(call: MoeInitRoutingV2GradCall, candidate_bytes: int, *, body_bytes: int) -> Peak:
    """One explanation (v1 explain): its body, the device's grad_x, explain's work with the device's
    result given (:func:`moegrad.explain_peak_bytes`: every row differing, the worst case) and its
    reply (the explanation's map and its msgpack encoding, as much again as the result's rows).

    Args:
        call: the validated call.
        candidate_bytes: the candidate's size, in bytes (its tensors are copied out when small).
        body_bytes: the request body's size, in bytes.
    """
    inputs = _input_bytes(call) + candidate_bytes
    work = explain_peak_bytes(call, device_result=True)
    return Peak(
        body=body_bytes,
        decoded=inputs if inputs <= COPIED_CALL_BYTES else 0,
        result=grad_x_bytes(call),
        work=work,
        reply=explain_peak_bytes(call, device_result=True, reply=True) - work,
    )


def batch_peak(
    calls: Iterable[MoeInitRoutingV2GradCall],
    comparisons: Iterable[tuple[MoeInitRoutingV2GradCall, int]],
    *,
    refused: int = 0,
    body_bytes: int,
) -> Peak:
    """One batch (v1 batch): its body, each item's decoded objects (:data:`BATCH_ITEM_BYTES`), a
    small call's tensors copied out and again when grouped, every call's grad_x held until the
    reply is sent (a small one packed into it too), every comparison's report, and the largest of
    the judges' work (they run one after another).

    Args:
        calls: the validated grad calls (group members included).
        comparisons: each validated comparison's call and its candidate's size in bytes.
        refused: items that earned an error while decoded (each answers a problem map).
        body_bytes: the request body's size, in bytes.
    """
    decoded = result = reply = judged = 0
    items = refused
    for call in calls:
        items += 1
        inputs, grad_x = _input_bytes(call), grad_x_bytes(call)
        decoded += 2 * inputs if inputs <= COPIED_CALL_BYTES else 0
        result += grad_x
        reply += grad_x if grad_x <= COPIED_CALL_BYTES else 0
    for call, candidate_bytes in comparisons:
        items += 1
        inputs, grad_x = _input_bytes(call) + candidate_bytes, grad_x_bytes(call)
        decoded += inputs if inputs <= COPIED_CALL_BYTES else 0
        result += grad_x
        reply += REPORT_BYTES + (grad_x if grad_x <= COPIED_CALL_BYTES else 0)
        judged = max(judged, _judge_work(call))
    return Peak(body=body_bytes, decoded=decoded + items * BATCH_ITEM_BYTES, result=result, work=judged, reply=reply)
