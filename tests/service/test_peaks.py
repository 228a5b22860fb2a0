"""What a request holds, from its shapes (memory.peaks), the admission topped up to it, and the
memory limit read from a container's cgroup (v2 and v1).

Oracles: the rules of docs/operations.md ("Memory a request holds"), worked by hand for each case
below (a comparison holds 3 x 33 float64 per-row statistics, 792 bytes, for every token; a call its
grad_x N x H x itemsize; an explanation its grad_x and moegrad.explain_peak_bytes with the device's
result given and the reply; a batch item 2 KiB besides its tensors, a compare item a 32 KiB report;
tensors of a call up to 64 KiB are copied out of the body, twice in a batch), and for the cgroup
files, the kernel's documentation of memory.max and memory.limit_in_bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from moegrad import DeviceBusy, MoeInitRoutingV2GradCall, PayloadTooLarge, explain_peak_bytes
from moegrad_service.memory import Memory, Peak, batch_peak, call_peak, compare_peak, explain_peak
from moegrad_service.memory.peaks import JUDGE_ROW_BYTES
from moegrad_service.settings import memory_limit_bytes

MIB = 1 << 20


def dropless(tokens: int, hidden: int, top_k: int = 1) -> MoeInitRoutingV2GradCall:
    return MoeInitRoutingV2GradCall(grad_expanded_x=np.ones((tokens * top_k, hidden), np.float32),
                                    expanded_row_idx=np.arange(tokens * top_k, dtype=np.int32), top_k=top_k)


def all_dropped(tokens: int, hidden: int) -> MoeInitRoutingV2GradCall:
    return MoeInitRoutingV2GradCall(grad_expanded_x=np.ones((1, 1, hidden), np.float32),
                                    expanded_row_idx=np.full(tokens, -1, np.int32), top_k=1, drop_pad_mode=1)


def test_the_judges_row_statistics_are_the_compiled_comparisons():
    from moegrad.accuracy import _fused_jit  # the kernel keeps SLOTS float64 a row for each of 3 comparisons

    assert JUDGE_ROW_BYTES == 3 * _fused_jit.SLOTS * 8 == 792


def test_a_comparison_with_h_1_holds_792_bytes_a_token():
    # 100,000 tokens, H = 1, K = 1, float32: grad_expanded_x 400,000 B, index 400,000 B, candidate 400,000 B
    call = dropless(100_000, 1)
    peak = compare_peak(call, 400_000, body_bytes=1_200_100)
    assert peak == Peak(body=1_200_100, decoded=0, result=400_000, work=100_000 * 792 + 32768, reply=0)
    assert peak.total > 66 * 1_200_100  # what "two times the body" left out


def test_an_explanation_holds_its_grad_x_and_explains_bound_with_the_reply():
    # 2,000 tokens, H = 1, K = 1, float32: 8,000 B of grad_expanded_x and index and 8,000 B of
    # candidate, copied out (24,000 B <= 64 KiB); grad_x 8,000 B; explain's bound with the device's
    # result given, the reply (as much again as the result's rows) apart
    call = dropless(2_000, 1)
    work = explain_peak_bytes(call, device_result=True)
    reply = explain_peak_bytes(call, device_result=True, reply=True) - work
    peak = explain_peak(call, 8_000, body_bytes=24_200)
    assert peak == Peak(body=24_200, decoded=24_000, result=8_000, work=work, reply=reply)
    assert reply > 2_000 * 6_144  # every row may differ: its objects, then its map and encoding
    assert peak.total > 3_000 * 24_200  # what "two times the body" left out


def test_a_call_whose_tokens_are_all_dropped_holds_its_grad_x():
    # 100,000 tokens of H = 64 from an index of 400,000 B and one row of 256 B: grad_x is 25,600,000 B
    peak = call_peak(all_dropped(100_000, 64), body_bytes=400_400)
    assert (peak.body, peak.result, peak.total) == (400_400, 25_600_000, 26_000_400)


def test_a_small_call_counts_its_copies_and_a_json_reply_its_numbers():
    # the documentation-sized call: 4 x 2 float32 (32 B) and 4 int32 (16 B) copied out; grad_x 2 x 2 (16 B)
    call = MoeInitRoutingV2GradCall(grad_expanded_x=np.ones((4, 2), np.float32),
                                    expanded_row_idx=np.arange(4, dtype=np.int32), top_k=2)
    assert call_peak(call, body_bytes=100) == Peak(body=100, decoded=48, result=16, reply=16)
    assert call_peak(call, body_bytes=100, reply="json").reply == 4 * 96
    assert call_peak(call, body_bytes=100, reply="serialized").reply == 16  # gRPC's reply copies grad_x


def test_a_grpc_call_holds_grad_x_twice_whatever_its_size():
    # the all-dropped call of 100,000 tokens over gRPC: grad_x 25,600,000 B, and its copy in the serialized reply
    peak = call_peak(all_dropped(100_000, 64), body_bytes=400_500, reply="serialized")
    assert peak == Peak(body=400_500, result=25_600_000, reply=25_600_000)


def test_a_batch_holds_each_item_every_result_and_its_largest_judging():
    small = dropless(2, 2, top_k=2)  # tensors 32 + 16 B, grad_x 16 B
    large = dropless(100_000, 1)  # tensors 800,000 B (viewed, not copied), grad_x 400,000 B
    peak = batch_peak([small, small], [(small, 16), (large, 400_000)], refused=1, body_bytes=1_300_000)
    assert peak.body == 1_300_000
    assert peak.decoded == 2 * (2 * 48) + (48 + 16) + 5 * 2048  # two grad items copied twice, one compare once
    assert peak.result == 3 * 16 + 400_000
    assert peak.work == 100_000 * 792 + 32768  # the larger judging (one after another)
    assert peak.reply == 3 * 16 + 2 * 32768  # small grad_x packed, two reports


def test_the_admission_is_topped_up_to_the_peak_and_given_back_whole():
    memory = Memory(256 * MIB)
    admission = memory.admit(1 * MIB)  # twice the body before it is read
    assert memory.budget.held_bytes == 2 * MIB
    admission.cover(Peak(body=1 * MIB, work=50 * MIB))
    assert memory.budget.held_bytes == admission.reserved_bytes == 51 * MIB
    admission.cover(Peak(body=1 * MIB))  # less than it holds: nothing given back
    assert memory.budget.held_bytes == 51 * MIB
    admission.release()
    assert memory.budget.held_bytes == 0


def test_a_peak_that_could_never_fit_is_413_naming_its_parts():
    memory = Memory(64 * MIB)
    admission = memory.admit(1 * MIB)
    with pytest.raises(PayloadTooLarge, match=r"holds 80740352 bytes .*work 79691776.*max_inflight_bytes"):
        admission.cover(Peak(body=1 * MIB, work=76 * MIB))
    assert memory.budget.held_bytes == 2 * MIB  # the body's reservation, until the answer is sent
    admission.release()


def test_a_peak_that_does_not_fit_now_is_503_and_takes_nothing():
    memory = Memory(64 * MIB)
    other = memory.admit(10 * MIB)  # 20 MiB held
    admission = memory.admit(1 * MIB)
    with pytest.raises(DeviceBusy):
        admission.cover(Peak(body=1 * MIB, work=40 * MIB))  # 20 + 41 > 56 (seven eighths)
    assert memory.budget.held_bytes == 22 * MIB
    other.release()
    admission.cover(Peak(body=1 * MIB, work=40 * MIB))
    assert memory.budget.held_bytes == 41 * MIB
    admission.release()


# --- the memory limit: cgroup v2 and v1 ----------------------------------------------------------

PHYSICAL = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
V1_UNLIMITED = "9223372036854771712"  # 2^63 rounded down to a 4 KiB page: v1's "no limit"


def tree(root: Path, files: dict[str, str], own: str) -> tuple[Path, Path]:
    for name, text in files.items():
        path = root / "cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    proc = root / "self-cgroup"
    proc.write_text(own)
    return root / "cgroup", proc


@pytest.mark.parametrize(
    ("files", "own", "limit"),
    [
        ({"memory.max": str(3 << 30)}, "0::/\n", 3 << 30),  # a v2 container's own cgroup at the mount
        ({"memory.max": "max"}, "0::/\n", None),
        ({"memory/memory.limit_in_bytes": str(3 << 30)}, "4:memory:/\n", 3 << 30),  # v1: Docker's bind mount
        ({"memory/memory.limit_in_bytes": V1_UNLIMITED}, "4:memory:/\n", None),
        # v1 without a namespace: this process's cgroup below the mount, its parent's limit applying too
        ({"memory/memory.limit_in_bytes": V1_UNLIMITED, "memory/pods/memory.limit_in_bytes": str(2 << 30),
          "memory/pods/one/memory.limit_in_bytes": V1_UNLIMITED}, "9:cpu:/\n4:memory:/pods/one\n", 2 << 30),
        # v2 without a namespace: the process's cgroup's own limit
        ({"pods/one/memory.max": str(1 << 30), "pods/memory.max": "max"}, "0::/pods/one\n", 1 << 30),
        ({}, "", None),  # no cgroup files at all: the machine's memory
    ],
    ids=["v2", "v2-max", "v1", "v1-unlimited", "v1-nested", "v2-nested", "none"],
)
def test_the_memory_limit_is_the_cgroups_on_v2_and_v1(tmp_path, files, own, limit):
    root, proc = tree(tmp_path, files, own)
    assert memory_limit_bytes(root, proc) == (PHYSICAL if limit is None else min(limit, PHYSICAL))
