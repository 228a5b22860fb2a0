"""The dataplane checks the order each request named against its backend, with no HTTP.

The rule (docs/semantics.md, "Which chip answered"): a device computes its own profile (its chip at
its CANN release); a call that names another (another chip, or the same chip at another release)
is refused with 161002 (field ``order``) before it runs, and is not counted in the statistics; a
call that names none, its profile, or an alias of it runs and answers the profile's canonical name.
The device here is the emulation under another name, reporting an Atlas A2 at CANN 9.1
(``ascend910b@9.1``, which the alias ``ascend910b`` names).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import numpy as np
import pytest

import moegrad
from moegrad import CallGroup, MoeInitRoutingV2GradCall
from moegrad_service.dataplane import Comparison, DataPlane, GradOutcome, GroupMember, MemberOutcome
from moegrad_service.engine import ReferenceBackend, StreamPool
from moegrad_service.metrics import Metrics
from moegrad_service.settings import Settings
from support.docexample import DOC_GRAD, DOC_IDX

PARAM_INVALID = 161002


class Atlas910(ReferenceBackend):
    """The emulation, presented as a device whose profile is ascend910b@9.1."""

    name = "ascend"
    device = "Ascend910B3 #0"
    order = "ascend910b@9.1"


def call(order: str | None = None) -> MoeInitRoutingV2GradCall:
    """The documentation example, naming ``order``; None: naming no profile (the device's then)."""
    named = {} if order is None else {"order": order}
    return MoeInitRoutingV2GradCall(grad_expanded_x=DOC_GRAD, expanded_row_idx=DOC_IDX, top_k=2, **named)


def refused_for_its_order(answer: object) -> bool:
    return (isinstance(answer, moegrad.InvalidArgument) and answer.field == "order"
            and answer.aclnn_status == PARAM_INVALID)


@contextlib.asynccontextmanager
async def device_dataplane() -> AsyncIterator[DataPlane]:
    pool = StreamPool(Atlas910(warm_up=False), streams=1, max_queue=4)
    await pool.start()
    try:
        yield DataPlane(Settings(backend="reference", streams=1, max_queue=4), pool, Metrics())
    finally:
        await pool.close(grace_s=5)


@pytest.mark.asyncio
async def test_a_single_call_and_a_comparison_naming_another_order_are_refused_before_they_run():
    async with device_dataplane() as dataplane:
        with pytest.raises(moegrad.InvalidArgument) as refused:
            await dataplane.infer(call("ascend950"), timeout_s=30)
        assert refused_for_its_order(refused.value) and "'ascend910b@9.1'" in str(refused.value)
        comparison = Comparison.checked(call("ascend950"), np.zeros((2, 2), np.float32), None, False)
        with pytest.raises(moegrad.InvalidArgument) as refused:
            await dataplane.compare(comparison, timeout_s=30)
        assert refused_for_its_order(refused.value)
        assert dataplane.statistics.fail.count == 0 and dataplane.statistics.success.count == 0
        named = await dataplane.infer(call("ascend910b"), timeout_s=30)
        unnamed = await dataplane.infer(call(), timeout_s=30)
        assert named.order == unnamed.order == "ascend910b@9.1"  # the alias named, and the device's own
        assert dataplane.statistics.success.count == 2


@pytest.mark.asyncio
@pytest.mark.parametrize("other", ["ascend910b@9.0", "ascend910b@8.5", "ascend910_93@9.1", "ascend950@9.1", "sequential"])
async def test_another_release_or_chip_is_refused_and_the_device_profile_by_any_name_runs(other):
    async with device_dataplane() as dataplane:
        with pytest.raises(moegrad.InvalidArgument) as refused:
            await dataplane.infer(call(other), timeout_s=30)
        assert refused_for_its_order(refused.value)
        assert f"order={other!r}" in refused.value.message and "computes 'ascend910b@9.1'" in refused.value.message
        for name in ("ascend910b@9.1", "ascend910b"):
            assert (await dataplane.infer(call(name), timeout_s=30)).order == "ascend910b@9.1"


@pytest.mark.asyncio
async def test_a_batch_refuses_each_item_naming_another_order_in_its_place():
    async with device_dataplane() as dataplane:
        like = call()
        stacked = CallGroup(like, np.stack([like.grad_expanded_x] * 2), np.stack([like.expanded_row_idx] * 2))
        other = CallGroup(call("ascend950"), stacked.grad_expanded_x, stacked.expanded_row_idx)
        items = [
            call(),  # names none
            call("ascend950"),
            call("ascend910b"),
            GroupMember(stacked, 0), GroupMember(stacked, 1),  # name none
            GroupMember(other, 0), GroupMember(other, 1),  # name ascend950, as their group's like call
            Comparison.checked(call("ascend950"), np.zeros((2, 2), np.float32), None, False),
        ]
        answers = await dataplane.infer_batch(items, timeout_s=30)
        refused = [refused_for_its_order(answer) for answer in answers]
        assert refused == [False, True, False, False, False, True, True, True]
        assert isinstance(answers[0], GradOutcome) and isinstance(answers[2], GradOutcome)
        assert isinstance(answers[3], MemberOutcome) and answers[3].outcome.order == "ascend910b@9.1"
        assert answers[0].order == answers[2].order == "ascend910b@9.1"
        assert dataplane.statistics.success.count == 4 and dataplane.statistics.fail.count == 0


#: A v1 document or v2 parameters without ``order`` at all.
ABSENT = object()


def _with_order(document: dict, order: object) -> dict:
    return document if order is ABSENT else {**document, "order": order}


class UnknownDevice(ReferenceBackend):
    """The emulation, presented as a device whose profile moegrad does not know."""

    name = "ascend"
    device = "Ascend910X #0"
    order = None


@pytest.mark.parametrize(("device", "answers"), [(Atlas910, "ascend910b@9.1"), (UnknownDevice, "unknown")])
@pytest.mark.parametrize("order", [ABSENT, None, "ascend910b", "ascend910b@9.1", "ascend950"])
def test_every_http_path_runs_a_call_naming_none_or_its_profile_and_refuses_another(serve, device, answers, order):
    """On a device, the call's own profile decides (moegrad.operator.names_profile): absent or nil
    names none and runs on the device's; the device's by any name runs; another, or any on a device
    whose profile is unknown, is refused with 161002, field order (422; v2's 400), on v1's grad,
    batch (each item and a group of one shape), compare and explain, and v2's infer. Every answer
    names the device's profile ("unknown" for the unknown one)."""
    runs = order in (ABSENT, None) or (device is Atlas910 and order != "ascend950")
    import msgpack

    from support.docexample import example_document, v2_inputs
    from support.servicekit import MSGPACK_HEADERS, pack

    document = _with_order(example_document(), order)
    candidate = {"candidate": {"dtype": "float32", "shape": [2, 2], "data": np.zeros((2, 2), np.float32).tobytes()}}
    with serve(backend=device(warm_up=False), streams=1, max_queue=8) as client:
        for path, body in (("", document), ("/compare", {**document, **candidate}),
                           ("/explain", {**document, **candidate})):
            response = client.post(f"/v1/moe_init_routing_v2_grad{path}", content=pack(body), headers=MSGPACK_HEADERS)
            if runs:
                assert response.status_code == 200, (path, response.text)
                assert msgpack.unpackb(response.content)["order"] == answers
            else:
                problem = response.json()
                assert (response.status_code, problem["aclnn_status"], problem["field"]) == (422, PARAM_INVALID, "order")
        items = [document] * 3 + [example_document(top_k=1)]
        batch = client.post("/v1/moe_init_routing_v2_grad/batch", content=msgpack.packb(items), headers=MSGPACK_HEADERS)
        assert batch.status_code == 200, batch.text
        results = msgpack.unpackb(batch.content)["results"]
        for result in results[:3]:  # one shape: a group
            if runs:
                assert result["order"] == answers
            else:
                assert (result["problem"]["aclnn_status"], result["problem"]["field"]) == (PARAM_INVALID, "order")
        assert results[3]["order"] == answers  # names none: runs beside them
        parameters = _with_order({"top_k": 2}, order)
        response = client.post("/v2/models/moe_init_routing_v2_grad/infer",
                               json={"inputs": v2_inputs(), "parameters": parameters})
        if runs:
            assert response.status_code == 200 and response.json()["parameters"]["order"] == answers
        else:
            assert response.status_code == 400 and "order=" in response.json()["error"]
