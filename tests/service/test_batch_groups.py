"""A batch's small calls of one shape are checked and run as a group (``api/grouping.py``).

Grouping is only a faster way to the same answers: every item of a batch gets exactly what the
single-call endpoint answers for it alone (its bits, or its problem's status, field, aclnn code and
detail). Expected values come from that endpoint and from the documentation's example, never from
the grouping under test. The items below share the example's shape, and each differs from it in one
way that the checks must see per call: a value of another type that compares equal (``True`` and
``2.0`` for ``2``), bytes that do not fit the shape, an index out of range or repeated.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from moegrad import REQUEST_LIMITS, DeviceFault, decode_batch
from moegrad_service.api.v1.grouping import GROUP_CALL_BYTES, group_calls
from moegrad_service.dataplane import GroupMember
from moegrad_service.engine import ReferenceBackend
from support.docexample import DOC_GRAD, DOC_IDX, example_document
from support.docexample import DOC_RESULT_BITS as EXAMPLE_BITS
from support.servicekit import post

BATCH = "/v1/moe_init_routing_v2_grad/batch"
PROBLEM_FIELDS = ("status", "title", "detail", "field", "aclnn_status", "aclnn_name")


def index(values) -> dict:
    return {"dtype": "int32", "shape": [len(values)], "data": np.array(values, np.int32).tobytes()}


def grad(rows: np.ndarray) -> dict:
    return {"dtype": "float32", "shape": list(rows.shape), "data": rows.astype("<f4").tobytes()}


# Each is the example's shape with one difference a group must not hide (the first ones are answered
# 200, the rest refused); "alone" is how the single-call endpoint answers it.
VARIANTS = {
    "swapped rows": example_document(expanded_row_idx=index([0, 2, 3, 1])),
    "other values": example_document(grad_expanded_x=grad(DOC_GRAD * 4)),
    "duplicates allowed": example_document(expanded_row_idx=index([2, 2, 1, 3]), allow_duplicate_indices=True),
    "order named": example_document(order="sequential"),
    "top_k True": example_document(top_k=True),
    "top_k 2.0": example_document(top_k=2.0),
    "drop_pad_mode False": example_document(drop_pad_mode=False),
    "allow_duplicate_indices 1": example_document(allow_duplicate_indices=1),
    "shape of floats": example_document(grad_expanded_x={**grad(DOC_GRAD), "shape": [4.0, 2]}),
    "short grad data": example_document(grad_expanded_x={**grad(DOC_GRAD), "data": DOC_GRAD.tobytes()[:-4]}),
    "long index data": example_document(
        expanded_row_idx={**index([2, 0, 1, 3]), "data": DOC_IDX.tobytes() + b"\0" * 4}
    ),
    "index out of range": example_document(expanded_row_idx=index([2, 0, 1, 4])),
    "index negative": example_document(expanded_row_idx=index([2, 0, -1, 3])),
    "index repeated": example_document(expanded_row_idx=index([2, 0, 2, 3])),
    "unknown field": example_document(extra=1),
    "order unknown": example_document(order="ascend960"),
    "order not a string": example_document(order=5),
    # a declared index shape far beyond its bytes (and beyond max_elements): nothing may be sized by it
    "index shape 2**40": example_document(expanded_row_idx={**index([2, 0]), "shape": [2**40]}),
    "index shape 10**7, no bytes": example_document(expanded_row_idx={**index([]), "shape": [10**7]}),
    "op nil": {**example_document(), "op": None},
}


def post_batch(client, items) -> list[dict]:
    response = client.post(
        BATCH, content=msgpack.packb(items, use_bin_type=True), headers={"content-type": "application/msgpack"}
    )
    assert response.status_code == 200, response.text
    return msgpack.unpackb(response.content, raw=False)["results"]


def assert_answered_as_alone(client, item: dict, result: dict) -> None:
    alone = post(client, {key: value for key, value in item.items() if key != "op"})  # op: a batch's own field
    if alone.status_code == 200:
        assert set(result) == {"grad_x", "backend", "order", "device", "timings_ms"}, result
        want = msgpack.unpackb(alone.content, raw=False)
        assert result["grad_x"] == want["grad_x"]  # dtype, shape and every byte
        assert (result["backend"], result["order"], result["device"]) == (
            want["backend"],
            want["order"],
            want["device"],
        )
    else:
        expected = alone.json()
        assert {k: result["problem"][k] for k in PROBLEM_FIELDS} == {k: expected[k] for k in PROBLEM_FIELDS}


def test_each_variant_among_members_of_its_shape_gets_its_single_call_answer(client):
    items = []
    for variant in VARIANTS.values():  # each between two plain members, and twice: its own group too
        items += [example_document(), variant, example_document(), variant]
    results = post_batch(client, items)
    assert len(results) == len(items)
    for item, result in zip(items, results, strict=True):
        assert_answered_as_alone(client, item, result)
    for result in results[0::2]:  # the plain members (== would also take drop_pad_mode=False for one)
        assert (np.frombuffer(result["grad_x"]["data"], np.uint32).reshape(2, 2) == EXAMPLE_BITS).all()


def grouped(items: list) -> list[bool]:
    class Plane:  # what group_calls asks of the dataplane: the emulation's (every order)
        default_order = "ascend910b@9.1"

        @staticmethod
        def check_order(named) -> None:
            pass

    body = msgpack.packb(items, use_bin_type=True)
    placed = group_calls(decode_batch(body, REQUEST_LIMITS), Plane(), max_elements=1 << 20)
    return [isinstance(member, GroupMember) for member in placed]


def test_only_calls_whose_every_check_holds_join_a_group():
    joins = {"swapped rows", "other values"}
    for name, variant in VARIANTS.items():
        # alongside two plain members, a variant that keeps every rule and differs only in its
        # tensors' values joins their group; any other goes alone (another attribute is another
        # group, and a group needs two members)
        assert grouped([example_document(), variant, example_document()]) == [True, name in joins, True], name
    # a batch item naming its op (a batch's own field) goes the single call's way too
    op_named = {**example_document(), "op": "grad"}
    assert grouped([example_document(), op_named, example_document()]) == [True, False, True]
    for name in ("index shape 2**40", "index shape 10**7, no bytes"):
        assert grouped([VARIANTS[name]] * 2) == [False, False], name


def test_a_batch_of_many_shapes_takes_one_queue_entry_per_worker(serve):
    """Two hundred calls of a hundred shapes (a hundred groups) on a server whose queue holds two:
    each gets its bits, none a 503 (the batch takes one queue entry per worker, not one a group)."""
    items, expected = [], []
    for hidden in range(1, 101):
        rows = np.arange(4 * hidden, dtype=np.float32).reshape(4, hidden) / 7
        for _ in range(2):
            items.append(example_document(grad_expanded_x=grad(rows)))
            expected.append(rows[DOC_IDX[0::2]] + rows[DOC_IDX[1::2]])  # K=2: one add a row
    assert all(grouped(items))
    with serve(streams=2, max_queue=2) as client:
        results = post_batch(client, items)
    for result, want in zip(results, expected, strict=True):
        assert "problem" not in result, result
        got = np.frombuffer(result["grad_x"]["data"], np.uint32).reshape(want.shape)
        assert (got == want.view(np.uint32)).all()


def test_a_group_needs_two_members_and_calls_over_the_size_limit_go_alone():
    assert grouped([example_document()]) == [False]
    assert grouped([example_document(order="sequential"), example_document()]) == [False, False]  # two shapes
    rows = GROUP_CALL_BYTES // 4 // 2 + 1  # float32 [rows, 2]: just over the limit
    big = example_document(
        grad_expanded_x=grad(np.ones((rows, 2), np.float32)),
        expanded_row_idx=index(list(range(rows))),
        top_k=1,
    )
    assert grouped([big, big]) == [False, False]


def test_a_shape_every_member_breaks_goes_alone_with_each_members_error(client):
    bad = example_document(top_k=3)  # 4 slots do not divide by 3: 561103 (CANN 9.1) for every member
    results = post_batch(client, [bad, bad, bad])
    alone = post(client, bad).json()
    assert alone["aclnn_status"] == 561103
    for result in results:
        assert {k: result["problem"][k] for k in PROBLEM_FIELDS} == {k: alone[k] for k in PROBLEM_FIELDS}


def test_many_members_of_every_mode_and_dtype_give_the_single_call_bits(client):
    """Forty calls each of three shapes (dropless, active, drop/pad; float16, bfloat16, float32),
    random values and routing, interleaved: each result has the single call's bytes."""
    import moegrad
    from support import routing

    rng = np.random.default_rng(3)
    items = []
    for number in range(120):
        mode, dtype = ("dropless", "active", "drop_pad")[number % 3], ("float16", "bfloat16", "float32")[number % 3]
        fixed = {"active": {"active_num": 9}, "drop_pad": {"capacity": 5}}.get(mode, {})  # one shape a mode
        r = routing.route(np.random.default_rng(number), 6, 3, 4, mode, **fixed)
        rows = rng.standard_normal(r.grad_shape(5)).astype(moegrad.DTYPES[dtype])
        items.append(
            example_document(
                grad_expanded_x={"dtype": dtype, "shape": list(rows.shape), "data": rows.tobytes()},
                expanded_row_idx=index(r.expanded_row_idx.tolist()),
                top_k=r.top_k,
                drop_pad_mode=r.drop_pad_mode,
                active_num=r.active_num,
            )
        )
    results = post_batch(client, items)
    for item, result in zip(items, results, strict=True):
        alone = post(client, item)
        assert alone.status_code == 200, alone.text
        assert result["grad_x"] == msgpack.unpackb(alone.content, raw=False)["grad_x"]


def test_members_run_one_by_one_where_the_backend_runs_no_group_and_fail_alone(serve):
    """With a fault hook the emulation runs each member on its own (the way a backend without
    run_group does): a member the backend fails gets its own 500; its group's others their bits."""

    def hook(call, timeout_s):
        if call.grad_expanded_x[0, 0] == 9.0:
            raise DeviceFault("injected fault for the member whose first value is 9")

    faulty = DOC_GRAD.copy()
    faulty[0, 0] = 9.0
    items = [example_document(), example_document(grad_expanded_x=grad(faulty)), example_document()]
    assert grouped(items) == [True, True, True]
    with serve(backend=ReferenceBackend(fault_hook=hook)) as client:
        results = post_batch(client, items)
    assert results[1]["problem"]["status"] == 500
    assert "injected fault" in results[1]["problem"]["detail"]
    for result in (results[0], results[2]):
        assert (np.frombuffer(result["grad_x"]["data"], np.uint32).reshape(2, 2) == EXAMPLE_BITS).all()


@pytest.mark.parametrize("streams", [1, 3])
def test_a_group_split_over_the_workers_keeps_each_members_place(serve, streams):
    rng = np.random.default_rng(streams)
    items, expected = [], []
    for _ in range(100):  # K=2 float32: each row is one add, v0 + v1, whatever the order
        rows = rng.standard_normal((4, 2)).astype(np.float32)
        order = rng.permutation(4)
        items.append(example_document(grad_expanded_x=grad(rows), expanded_row_idx=index(order.tolist())))
        expected.append(rows[order[0::2]] + rows[order[1::2]])
    with serve(streams=streams) as client:
        results = post_batch(client, items)
    for result, want in zip(results, expected, strict=True):
        assert (np.frombuffer(result["grad_x"]["data"], np.uint32).reshape(2, 2) == want.view(np.uint32)).all()


def test_a_share_is_cut_into_parts_and_a_batch_alone_always_fits_the_queue(serve, monkeypatch):
    """A worker checks the deadline (and whether the caller is still there) before each part of its
    share, so parts are small: at most 64 calls or 4 MiB of input. However many parts, a batch
    takes at most min(streams, max_queue) queue entries: alone on a server whose queue holds one, no
    call of it is refused, comparisons included."""
    from moegrad_service.engine import StreamPool

    shares = []
    run_parts = StreamPool.run_parts

    async def watching(self, parts, *, timeout_s, tenant=None):
        shares.append(
            [
                (
                    len(part),
                    sum(call.grad_expanded_x.nbytes for call in part)
                    if isinstance(part, tuple)
                    else len(part) * part.like.grad_expanded_x.nbytes,
                )
                for part in parts
            ]
        )
        return await run_parts(self, parts, timeout_s=timeout_s, tenant=tenant)

    monkeypatch.setattr(StreamPool, "run_parts", watching)
    rows = np.ones((16, 1024), np.float32)  # 64 KiB: a group of them is cut every 64 members
    group = [example_document(grad_expanded_x=grad(rows), expanded_row_idx=index(list(range(16))), top_k=1)] * 100
    alone = [example_document(grad_expanded_x=grad(np.ones((4, hidden), np.float32))) for hidden in range(1, 151)]
    compares = [{**example_document(), "op": "compare", "candidate": grad(np.ones((2, 2), np.float32))}] * 3
    with serve(streams=2, max_queue=1) as client:
        results = post_batch(client, group + alone + compares)
    assert len(shares) == 1  # min(streams 2, max_queue 1) = 1 queue entry
    assert all(count <= 64 and nbytes <= 4 << 20 for share in shares for count, nbytes in share), shares
    assert sum(count for share in shares for count, _ in share) == 100 + 150 + 3
    assert all("problem" not in result for result in results), [r for r in results if "problem" in r][:2]
    assert all("report" in result for result in results[-3:])


def test_a_refused_calls_problem_says_when_to_retry():
    """A batch call refused as busy (its share found the queue full) carries ``retry_after_s``: what
    the single call's Retry-After header says; other problems carry no such field."""
    from moegrad import DeviceBusy, InvalidArgument
    from moegrad_service.api.v1.codec import problem_document

    busy = problem_document(DeviceBusy("the queue is full (1 calls waiting)", retry_after_s=7.0))
    assert (busy["status"], busy["retry_after_s"]) == (503, 7.0)
    assert "retry_after_s" not in problem_document(InvalidArgument("x", aclnn_status=161002, field="top_k"))


def test_a_batch_reserves_five_times_its_body_from_the_in_flight_budget(serve):
    """A batch holds its body, its calls decoded, their results and the reply: the budget reserves
    five times its body (a single call two). With a 16 MiB budget (14 MiB for one large request), a
    single call of 1.5 MiB and a batch of one such call fit; a batch of three (4.5 MiB, 22.5 MiB
    held) is 413 naming the budget, before it is read."""
    rows = 131072  # float32 [rows, 2]: 1 MiB, and its int32 index 0.5 MiB
    item = example_document(
        grad_expanded_x=grad(np.ones((rows, 2), np.float32)), expanded_row_idx=index(list(range(rows))), top_k=1
    )
    with serve(max_inflight_bytes=16 << 20) as client:
        assert post(client, item).status_code == 200
        assert "problem" not in post_batch(client, [item])[0]
        response = client.post(
            BATCH, content=msgpack.packb([item] * 3, use_bin_type=True), headers={"content-type": "application/msgpack"}
        )
    assert response.status_code == 413, response.text
    detail = response.json()["detail"]
    assert "5 times the body" in detail and "max_inflight_bytes" in detail, detail
