"""One admitted request's hold on the service's memory (moegrad_service.memory: Memory, Admission).

The rules (docs/operations.md, "Limits" and "Resources"): a request holds twice its body's bytes (a
batch five times) from admission until its answer is sent; a large body is read into a receive
buffer and a large grad_x written into one, both kept for the next call once the request is
released; a result buffer whose worker may still write it comes back only once nothing holds it.
The expected numbers are worked out here by hand.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import moegrad
from moegrad_service.memory import Memory, MemoryBudget

MiB = 1 << 20


def test_an_admission_holds_twice_its_body_until_released_once():
    memory = Memory(64 * MiB, keep_s=60)
    admission = memory.admit(3 * MiB)
    assert admission.reserved_bytes == 6 * MiB == memory.budget.held_bytes
    admission.release()
    admission.release()  # idempotent
    assert memory.budget.held_bytes == 0


def test_a_batch_holds_five_times_its_body_and_a_with_block_releases_it():
    memory = Memory(64 * MiB, keep_s=60)
    with memory.admit(2 * MiB, per_byte=MemoryBudget.BATCH_HOLD_PER_BODY_BYTE) as admission:
        assert admission.reserved_bytes == 10 * MiB == memory.budget.held_bytes
    assert memory.budget.held_bytes == 0


def test_a_body_of_unknown_size_is_reserved_as_it_arrives_and_limited_as_a_whole():
    memory = Memory(16 * MiB, keep_s=60)  # a large request may take 14 MiB: a body of 7 MiB
    admission = memory.admit()
    assert admission.reserved_bytes == 0
    for _ in range(7):
        admission.reserve(MiB)
    assert admission.reserved_bytes == 14 * MiB
    with pytest.raises(moegrad.PayloadTooLarge):
        admission.reserve(1)  # the eighth MiB's first byte: the whole body is over what one request may take
    admission.release()
    assert memory.budget.held_bytes == 0


def test_a_refused_admission_holds_nothing():
    memory = Memory(16 * MiB, keep_s=60)
    held = memory.admit(6 * MiB)  # 12 of the 14 MiB a large request may find held
    with pytest.raises(moegrad.DeviceBusy):
        memory.admit(2 * MiB)  # 12 + 4 > 14
    assert memory.budget.held_bytes == 12 * MiB
    held.release()


def test_a_large_body_buffer_is_kept_for_the_next_body_once_released():
    memory = Memory(64 * MiB, keep_s=60)
    with memory.admit(3 * MiB) as admission:
        small = admission.body_buffer(MiB - 1)  # under REUSE_MIN_BYTES: not one to keep
        assert small.nbytes == MiB - 1
        buffer = admission.body_buffer(3 * MiB)
        del small, buffer  # the call is done with its body
    # 4 MiB: 3 MiB rounded up to 2 MiB granules; the reservation gone, the kept buffer held instead
    assert memory.buffers.kept_bytes == 4 * MiB == memory.budget.held_bytes
    with memory.admit(3 * MiB) as again:
        assert again.body_buffer(3 * MiB).nbytes == 4 * MiB
        assert memory.buffers.kept_bytes == 0 and memory.budget.held_bytes == 6 * MiB


def test_a_body_buffer_still_viewed_is_not_kept():
    memory = Memory(64 * MiB, keep_s=60)
    with memory.admit(3 * MiB) as admission:
        view = admission.body_buffer(3 * MiB)[:16]  # an array of the call still views the body
    assert memory.buffers.kept_bytes == 0 and memory.budget.held_bytes == 0
    del view


def test_a_written_result_buffer_comes_back_at_release_whatever_still_references_it():
    memory = Memory(64 * MiB, keep_s=60)
    admission = memory.admit(2 * MiB)
    assert admission.result_buffer((512, 511), np.dtype(np.float32)) is None  # under a MiB: the backend allocates
    grad_x = admission.result_buffer((512, 1024), np.dtype(np.float32))  # 2 MiB
    assert grad_x is not None and grad_x.shape == (512, 1024) and grad_x.flags.c_contiguous
    grad_x[:] = 1
    admission.result_written()
    admission.release()  # grad_x is still referenced here: the release says it is free, not a count
    assert memory.buffers.kept_bytes == 2 * MiB == memory.budget.held_bytes
    with memory.admit(2 * MiB) as next_call:
        again = next_call.result_buffer((1024, 512), np.dtype(np.float32))
        assert again is not None and np.shares_memory(again, grad_x)
        next_call.result_written()
    assert memory.buffers.kept_bytes == 2 * MiB
    del grad_x, again
    gc.collect()  # each buffer comes back once: the lent arrays going now give nothing back again
    assert memory.buffers.kept_bytes == 2 * MiB == memory.budget.held_bytes


def test_a_result_buffer_its_worker_may_still_write_comes_back_once_nothing_holds_it():
    memory = Memory(64 * MiB, keep_s=60)
    admission = memory.admit(2 * MiB)
    grad_x = admission.result_buffer((512, 1024), np.dtype(np.float32))
    worker_view = grad_x[7]  # what a worker given up on still writes into
    del grad_x
    admission.release()  # no result_written(): the call was given up on while it ran
    assert memory.buffers.kept_bytes == 0 and memory.budget.held_bytes == 0
    del worker_view
    assert memory.buffers.kept_bytes == 2 * MiB == memory.budget.held_bytes
