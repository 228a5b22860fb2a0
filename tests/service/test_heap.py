"""Trimming the C heap once the service is quiet (moegrad_service.memory.heap).

What is checked against something independent: the process's resident pages (/proc/self/statm)
before and after ``malloc_trim`` over blocks freed with the C library's own ``free``; the rest is
the trimmer's rule (docs/operations.md, "Resources"): released bytes arm it, and it runs its quiet
time later, or as soon after as no request holds bytes, kept buffers aside.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import threading
import time

import numpy as np
import pytest

from moegrad_service.memory import heap
from moegrad_service.memory.heap import HeapTrimmer

MiB = 1 << 20


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(heap._MALLOC_TRIM is None or not os.path.exists("/proc/self/statm"),
                    reason="needs glibc's malloc_trim and /proc")
def test_trim_heap_gives_freed_heap_pages_back_to_the_system():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block = 64 << 10  # under glibc's mmap threshold (128 KiB at least): from the heap
    blocks = [libc.malloc(block) for _ in range(2048)]  # 128 MiB
    for address in blocks:
        ctypes.memset(address, 1, block)  # resident
    before_free = resident_bytes()
    for address in blocks[:-1]:  # the last one stays: the freed space is not at the heap's top
        libc.free(address)
    freed = resident_bytes()
    assert before_free - freed < 16 * MiB  # free() alone leaves them resident
    assert heap.trim_heap() is True
    assert freed - resident_bytes() > 100 * MiB
    libc.free(blocks[-1])


def trimmer_run(scenario):
    """Run ``scenario(trimmer, held, trims)`` on a fresh loop: ``held`` [requests' bytes, kept
    buffers' bytes] is what the trimmer sees; ``trims`` counts the trims (heap.trim_heap replaced)."""
    trims = []

    async def main():
        held = [0, 0]
        trimmer = HeapTrimmer(asyncio.get_running_loop(), lambda: held[0] + held[1], lambda: held[1],
                              after_bytes=100, quiet_s=0.02)
        await scenario(trimmer, held, trims)

    original = heap.trim_heap
    heap.trim_heap = lambda: trims.append(time.monotonic()) or True
    try:
        asyncio.run(main())
    finally:
        heap.trim_heap = original


async def until(condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_released_bytes_arm_a_trim_that_waits_for_no_request_to_hold_any():
    async def scenario(trimmer, held, trims):
        trimmer.released(60)
        await asyncio.sleep(0.2)
        assert trims == []  # 60 of the 100 bytes that arm it
        held[0] = 5  # a request holds bytes
        trimmer.released(60)
        await asyncio.sleep(0.2)
        assert trims == []  # armed, waiting for quiet
        held[0] = 0
        await until(lambda: len(trims) == 1)
        trimmer.released(99)
        await asyncio.sleep(0.2)
        assert len(trims) == 1 and trimmer.trims == 1  # counting starts again after a trim

    trimmer_run(scenario)


def test_a_trickle_of_small_releases_does_not_put_the_trim_off():
    async def scenario(trimmer, held, trims):
        trimmer.quiet_s = 0.1
        trimmer.released(100)
        armed = time.monotonic()
        while time.monotonic() - armed < 0.5 and not trims:  # a small call answered every 10 ms
            held[0] = 1
            await asyncio.sleep(0.002)
            held[0] = 0
            trimmer.released(1)
            await asyncio.sleep(0.008)
        assert trims, "the trickle kept the heap from being trimmed"
        assert trims[0] - armed >= 0.1

    trimmer_run(scenario)


def test_released_after_the_loop_closed_is_ignored():
    loop = asyncio.new_event_loop()
    trimmer = HeapTrimmer(loop, lambda: 0, lambda: 0, after_bytes=1, quiet_s=0.01)
    loop.close()
    trimmer.released(10)  # a worker's last release as the service stops: no error


def test_kept_buffers_do_not_keep_the_heap_from_being_trimmed():
    async def scenario(trimmer, held, trims):
        held[1] = 64 * MiB  # only kept buffers
        trimmer.released(100)
        await until(lambda: len(trims) == 1)

    trimmer_run(scenario)


def test_bytes_released_on_another_thread_arm_the_trim():
    async def scenario(trimmer, held, trims):
        worker = threading.Thread(target=trimmer.released, args=(500,))
        worker.start()
        worker.join()
        await until(lambda: len(trims) == 1)

    trimmer_run(scenario)


def test_the_service_trims_its_heap_after_a_large_call_once_quiet(serve, monkeypatch):
    monkeypatch.setattr(heap, "TRIM_AFTER_BYTES", 1 * MiB)
    monkeypatch.setattr(heap, "QUIET_S", 0.05)
    trims = []
    monkeypatch.setattr(heap, "trim_heap", lambda: trims.append(1) or True)
    import moegrad

    rng = np.random.default_rng(0)
    call = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=rng.standard_normal((512, 512), dtype=np.float32),
                                            expanded_row_idx=rng.permutation(512).astype(np.int32), top_k=1)
    with serve() as client:
        response = client.post("/v1/moe_init_routing_v2_grad", content=moegrad.wire._codec.encode_body(call.to_wire()),
                               headers={"content-type": "application/msgpack"})
        assert response.status_code == 200
        deadline = time.monotonic() + 5
        while not trims:
            assert time.monotonic() < deadline, "the service never trimmed its heap"
            time.sleep(0.02)
        assert client.app_state["dataplane"].memory.trimmer.trims == 1
