"""Receive buffers kept inside the in-flight budget (moegrad_service.memory: ReceiveBuffers, MemoryBudget).

The rules (docs/operations.md, "Limits"): a kept buffer's bytes are held in the budget; a buffer is
kept only when the budget has room for it outside the part kept for small calls; a reservation
that finds no room gives up kept buffers, oldest first, before it is refused; a buffer unused for
receive_keep_s seconds is given up; a kept buffer is taken by a body of at least half its size.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref

import numpy as np
import pytest

import moegrad
from moegrad_service.engine.reference import ReferenceBackend
from moegrad_service.memory import MemoryBudget, ReceiveBuffers

MiB = 1 << 20


def kept(size: int) -> np.ndarray:
    buffer = np.empty(size, dtype=np.uint8)
    buffer[:] = 1  # resident
    return buffer


def test_a_kept_buffer_is_held_in_the_budget_and_taken_back_by_a_body_of_its_size():
    budget = MemoryBudget(64 * MiB)
    buffers = ReceiveBuffers(budget, keep_s=60)
    buffer = kept(8 * MiB)
    buffers.keep(buffer)
    assert budget.held_bytes == 8 * MiB and buffers.kept_bytes == 8 * MiB
    assert buffers.take(9 * MiB) is not buffer  # too small for 9 MiB: a fresh one
    assert buffers.take(3 * MiB) is not buffer  # more than twice 3 MiB: not this one
    assert buffers.take(5 * MiB) is buffer
    assert budget.held_bytes == 0 and buffers.kept_bytes == 0


def test_a_reservation_gives_up_kept_buffers_oldest_first_before_it_is_refused():
    budget = MemoryBudget(32 * MiB)  # seven eighths: 28 MiB for large reservations
    buffers = ReceiveBuffers(budget, keep_s=60)
    first, second, third = kept(8 * MiB), kept(8 * MiB), kept(8 * MiB)
    buffers.keep(first)
    buffers.keep(second)
    buffers.keep(third)
    assert budget.held_bytes == 24 * MiB
    assert budget.reserve_body(4 * MiB) == 8 * MiB  # 24 + 8 > 28: the oldest kept buffer goes
    assert budget.held_bytes == 24 * MiB and buffers.kept_bytes == 16 * MiB
    assert buffers.take(8 * MiB) is second
    budget.release(8 * MiB)
    with pytest.raises(moegrad.PayloadTooLarge):
        budget.reserve_body(16 * MiB)  # 32 MiB: more than a call may ever take; nothing is given up
    assert buffers.kept_bytes == 8 * MiB
    budget.reserve(20 * MiB)  # 8 kept + 20 = 28: fits beside the kept buffer
    with pytest.raises(moegrad.DeviceBusy):
        budget.reserve(9 * MiB)  # gives up the last kept buffer, and still does not fit
    assert buffers.kept_bytes == 0 and budget.held_bytes == 20 * MiB


def test_a_buffer_is_kept_only_where_the_budget_has_room_and_never_in_the_small_calls_part():
    budget = MemoryBudget(32 * MiB)
    buffers = ReceiveBuffers(budget, keep_s=60)
    budget.reserve(24 * MiB)
    buffers.keep(kept(8 * MiB))  # 24 + 8 > 28
    assert buffers.kept_bytes == 0 and budget.held_bytes == 24 * MiB
    buffers.keep(kept(4 * MiB))  # 24 + 4 = 28
    assert buffers.kept_bytes == 4 * MiB


def test_small_viewed_and_unkept_buffers():
    budget = MemoryBudget(64 * MiB)
    buffers = ReceiveBuffers(budget, keep_s=60, max_kept=2)
    buffers.keep(kept(MiB - 1))  # under a MiB: never kept
    loan = buffers.body_loan(2 * MiB)  # a body's buffer, lent
    view = loan.array[:10]  # an array of the finished call still views it
    loan.forget()  # the answer is sent: the request lets go of its body
    assert buffers.kept_bytes == 0
    del view  # the last view: the buffer comes back, and is kept
    assert buffers.kept_bytes == 2 * MiB
    assert buffers.take(2 * MiB).nbytes == 2 * MiB and buffers.kept_bytes == 0
    for size in (2, 3, 4):
        buffers.keep(kept(size * MiB))
    assert buffers.kept_bytes == 7 * MiB == budget.held_bytes  # at most two: the oldest went
    never = ReceiveBuffers(MemoryBudget(64 * MiB), keep_s=0)
    never.keep(kept(2 * MiB))
    assert never.kept_bytes == 0 and never.budget.held_bytes == 0


def test_a_buffer_unused_for_keep_s_is_given_up():
    async def main():
        budget = MemoryBudget(64 * MiB)
        buffers = ReceiveBuffers(budget, keep_s=0.1)
        buffers.keep(kept(2 * MiB))
        await asyncio.sleep(0.05)
        buffers.keep(kept(4 * MiB))
        assert buffers.kept_bytes == 6 * MiB
        await asyncio.sleep(0.09)  # the first is 0.14 s old, the second 0.09 s
        assert buffers.kept_bytes == 4 * MiB
        await asyncio.sleep(0.1)
        assert buffers.kept_bytes == 0 and budget.held_bytes == 0

    asyncio.run(main())


def test_an_idle_service_gives_its_kept_buffers_up(serve):
    from support.servicekit import gauge, post_frames_call, random_call

    with serve(receive_keep_s=0.3) as client:
        grad, idx, k = random_call(np.float32, n=8192, k=2, h=64, seed=3)  # 4 MiB
        response = post_frames_call(client, grad, idx, k)
        assert response.status_code == 200
        assert gauge(client, "moegrad_receive_buffer_kept_bytes") >= grad.nbytes
        assert gauge(client, "moegrad_inflight_bytes") == gauge(client, "moegrad_receive_buffer_kept_bytes")
        deadline = time.monotonic() + 5
        while gauge(client, "moegrad_receive_buffer_kept_bytes") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gauge(client, "moegrad_receive_buffer_kept_bytes") == 0
        assert gauge(client, "moegrad_inflight_bytes") == 0


def test_bodies_of_nearly_the_same_size_share_a_buffer():
    """A fresh buffer is rounded up (a granule of 1/16 to 1/8 of its size): the same call in its
    msgpack, frames and v2 forms (a few hundred bytes apart) reuses one buffer."""
    budget = MemoryBudget(4 << 30)
    buffers = ReceiveBuffers(budget, keep_s=60)
    first = buffers.take(448 * MiB + 100)
    assert 448 * MiB + 100 <= first.nbytes <= (448 + 448 // 8) * MiB
    buffers.keep(first)
    assert buffers.take(448 * MiB + 5000) is first
    small = buffers.take(3 * MiB + 1)
    assert small.nbytes == 4 * MiB  # 2 MiB granules below 32 MiB


@pytest.fixture
def watched(monkeypatch):
    """What the service's ReceiveBuffers hand out and keep: [(nbytes, weakref to the buffer)] per
    take, and the weakrefs of the buffers kept (every way a buffer comes back ends in ``keep``;
    weak, so that watching adds no reference to the counts a give checks)."""
    taken, kept_by_give = [], []
    take, keep = ReceiveBuffers.take, ReceiveBuffers.keep

    def watching_take(self, nbytes):
        buffer = take(self, nbytes)
        taken.append((nbytes, weakref.ref(buffer)))
        return buffer

    def watching_keep(self, buffer):
        kept = keep(self, buffer)
        if kept:
            kept_by_give.append(weakref.ref(buffer))
        return kept

    monkeypatch.setattr(ReceiveBuffers, "take", watching_take)
    monkeypatch.setattr(ReceiveBuffers, "keep", watching_keep)
    return taken, kept_by_give


def test_a_large_grad_x_is_written_into_a_kept_buffer_and_kept_again(serve, watched):
    """grad_x of 1 MiB or more is written into a buffer an answered call left behind (no fresh pages),
    and every call's bits are its own."""
    from support.servicekit import grad_x_of, post_frames_call, random_call

    taken, kept_by_give = watched
    grad_x_bytes = 8192 * 64 * 4  # 2 MiB
    results = []

    def lent_buffer_back() -> bool:
        """Whether the last call's grad_x buffer is kept again: it comes back once the server's
        task has let go of the reply, which may be just after the client has read all of it."""
        last = [ref for nbytes, ref in taken if nbytes == grad_x_bytes][-1]()
        return last is not None and any(ref() is last for ref in kept_by_give)

    with serve() as client:
        for seed in (1, 2, 3):
            grad, idx, k = random_call(np.float32, n=8192, k=2, h=64, seed=seed)  # 4 MiB in
            response = post_frames_call(client, grad, idx, k)
            assert response.status_code == 200
            results.append((grad_x_of(response), grad[idx[0::2]] + grad[idx[1::2]]))  # K=2: one add
            deadline = time.monotonic() + 10
            while not lent_buffer_back() and time.monotonic() < deadline:
                time.sleep(0.01)
        result_buffers = [ref() for nbytes, ref in taken if nbytes == grad_x_bytes]
        assert len(result_buffers) == 3 and result_buffers[0] is not None
        assert result_buffers[1] is result_buffers[0] and result_buffers[2] is result_buffers[0]
        assert any(ref() is result_buffers[0] for ref in kept_by_give)
    for got, want in results:
        assert got.shape == (8192, 64) and (got.view(np.uint32) == want.view(np.uint32)).all()


def test_the_grad_x_buffer_of_a_timed_out_call_comes_back_only_once_its_worker_is_done(serve, gate, watched):
    """A call answered 504 while its worker still runs: its grad_x buffer is not kept while the worker
    (gated, so it has not written yet) holds it; it comes back once the worker is done, and the next
    call that reuses it gets its own bits."""
    from support.servicekit import grad_x_of, post_frames_call, random_call

    taken, kept_by_give = watched
    grad, idx, k = random_call(np.float32, n=8192, k=2, h=64, seed=4)
    with serve(backend=ReferenceBackend(fault_hook=gate)) as client:
        response = post_frames_call(client, grad, idx, k, headers={"x-request-timeout": "0.2"})
        assert response.status_code == 504
        (lent,) = [ref for nbytes, ref in taken if nbytes == grad.nbytes // 2]
        time.sleep(0.2)
        assert lent() is not None and not any(ref() is lent() for ref in kept_by_give)
        gate.release.set()
        deadline = time.monotonic() + 10
        while not any(ref() is lent() for ref in kept_by_give) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert any(ref() is lent() for ref in kept_by_give)  # given back by the worker's thread, then kept
        grad, idx, k = random_call(np.float32, n=8192, k=2, h=64, seed=5)
        response = post_frames_call(client, grad, idx, k)
        assert response.status_code == 200
        assert [ref() for nbytes, ref in taken if nbytes == grad.nbytes // 2][-1] is lent()
    want = grad[idx[0::2]] + grad[idx[1::2]]
    assert (grad_x_of(response).view(np.uint32) == want.view(np.uint32)).all()


def test_a_lent_array_comes_back_once_it_and_every_view_of_it_are_gone():
    buffers = ReceiveBuffers(MemoryBudget(64 * MiB), keep_s=60)
    grad_x = buffers.lend((512, 1024), np.dtype(np.float32))  # 2 MiB
    grad_x[:] = 1
    piece, row = memoryview(grad_x).cast("B")[: 1 << 20], grad_x[3]  # as a reply being sent holds it
    del grad_x
    assert buffers.kept_bytes == 0
    del row
    assert buffers.kept_bytes == 0
    del piece
    assert buffers.kept_bytes == 2 * MiB and buffers.budget.held_bytes == 2 * MiB
    again = buffers.lend((1024, 512), np.dtype(np.float32))
    assert buffers.kept_bytes == 0 and again.shape == (1024, 512) and again.flags.c_contiguous and again.flags.writeable


def test_a_lent_array_let_go_of_on_another_thread_is_still_given_up_when_unused():
    async def main():
        buffers = ReceiveBuffers(MemoryBudget(64 * MiB), keep_s=0.1)
        lent = [buffers.lend((2 * MiB,), np.dtype(np.uint8))]
        thread = threading.Thread(target=lent.clear)  # a worker that finished after its call timed out
        thread.start()
        thread.join()
        assert buffers.kept_bytes == 2 * MiB
        await asyncio.sleep(0.3)
        assert buffers.kept_bytes == 0 and buffers.budget.held_bytes == 0

    asyncio.run(main())


def test_a_lent_array_finalized_while_the_pool_holds_its_lock_does_not_deadlock():
    """A collection may finalize a lent array inside any allocation, one made under the pool's own
    lock included: giving it back then must not wait for that lock."""
    buffers = ReceiveBuffers(MemoryBudget(64 * MiB), keep_s=60)
    lent = [buffers.lend((2 * MiB,), np.dtype(np.uint8))]

    def finalize_under_the_lock() -> None:
        with buffers._lock:
            lent.clear()

    thread = threading.Thread(target=finalize_under_the_lock, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive()
    assert buffers.kept_bytes == 2 * MiB
