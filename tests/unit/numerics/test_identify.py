"""moegrad.identify, ``moegrad identify`` and a comparison's profiles_matching.

Oracles: which profile has which order of adds is the issue's table (docs/semantics.md, "Device
profiles"), written out below as three families; each family's result comes from the independent
slow loops of ``support.slow_loops`` (docs/semantics.md sections 3 and 7), and the expected
outcome of every profile is the comparison of those loops' bits with the grad_x asked about. The
signed-zero cases follow docs/semantics.md sections 4 and 7.3 by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import moegrad
from moegrad import AclnnStatus, Identification, InvalidArgument, accuracy, identify
from support.bits import bits
from support.inputs import BF16, F16, F32
from support.slow_loops import ascend950_row, expected_chunk, round_from_float32, slow950, slow_grad_x

INVALID = AclnnStatus.ACLNN_ERR_PARAM_INVALID
# The table: the kernel order of each profile.
BINS = {f"{chip}@{release}" for chip in ("ascend910b", "ascend910_93") for release in ("8.5", "9.0", "9.1")}
GROUPS = {"ascend950@9.0", "ascend950@9.1"}
CHAIN = {"ascend950@8.5", "sequential"}
EVERY = BINS | GROUPS | CHAIN
UB = 253952  # the 950's default platform (docs/semantics.md section 7.4)


def finite_values(rng, shape, dtype):
    """Signed values over 32 binades and some ±0.0: every order rounds differently, no NaN anywhere."""
    size = int(np.prod(shape))
    values = rng.choice([-1.0, 1.0], size) * (1.0 + rng.random(size)) * np.exp2(rng.integers(-20, 12, size))
    values[rng.random(size) < 0.05] = 0.0
    values[rng.random(size) < 0.05] = -0.0
    return values.astype(dtype).reshape(shape)


def a_call(rng, mode, top_k, dtype, tokens=4, hidden=8):
    """(fields, families' slow-loop results) of one call: dropless, active or drop/pad."""
    slots = tokens * top_k
    if mode == "dropless":
        idx, grad_rows, drop_pad_mode, active_num = rng.permutation(slots), (slots,), 0, 0
    elif mode == "active":
        active_num = slots // 2 + 1
        idx, grad_rows, drop_pad_mode = rng.permutation(slots), (active_num,), 0
    else:
        idx = rng.choice(3 * slots, size=slots, replace=False)
        idx[rng.random(slots) < 0.3] = -1
        grad_rows, drop_pad_mode, active_num = (3, slots), 1, 0
    grad = finite_values(rng, (*grad_rows, hidden), dtype)
    idx = idx.astype(np.int32)
    fields = {"grad_expanded_x": grad, "expanded_row_idx": idx, "top_k": top_k, "drop_pad_mode": drop_pad_mode,
              "active_num": active_num}
    results = {
        "bins": slow_grad_x(grad, idx, top_k, drop_pad_mode, active_num, order="ascend910b"),
        "chain": slow_grad_x(grad, idx, top_k, drop_pad_mode, active_num, order="sequential"),
        "groups": slow950(grad, idx, top_k, drop_pad_mode, active_num,
                          chunk=expected_chunk(np.dtype(dtype), top_k, hidden, UB), grouped=True),
    }
    return fields, results


FAMILIES = {"bins": BINS, "chain": CHAIN, "groups": GROUPS}


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("mode", ["dropless", "active", "drop_pad"])
@pytest.mark.parametrize("top_k", [1, 3, 4, 6, 9, 17])
def test_identify_names_exactly_the_profiles_whose_order_gives_these_bits(dtype, mode, top_k):
    rng = np.random.default_rng(top_k * 7 + len(mode))
    fields, results = a_call(rng, mode, top_k, dtype)
    for family, grad_x in results.items():
        found = identify(fields, grad_x)
        differing = {name: int(np.count_nonzero(bits(other) != bits(grad_x))) for name, other in results.items()}
        want = {p for name, members in FAMILIES.items() if differing[name] == 0 for p in members}
        assert family in {name for name, count in differing.items() if count == 0}
        assert set(found.matching) == want
        for name, members in FAMILIES.items():
            for profile in members:
                outcome = found.outcome_of(profile)
                assert outcome.differing_elements == differing[name], (family, profile)
                assert outcome.outcome == ("identical" if differing[name] == 0 else "differs")
        assert [p.profile for p in found.profiles] == list(moegrad.PROFILES)
        # one emulation per family: every A2/A3 release names the same computed profile
        assert len({found.outcome_of(p).computed_with for p in BINS}) == 1


def test_the_orders_differ_where_the_sweep_needs_them_to():
    # The sweep above proves something only if the families' bits differ somewhere: K = 6 float32 dropless.
    fields, results = a_call(np.random.default_rng(3), "dropless", 6, F32, tokens=5, hidden=16)
    pairs = [("bins", "chain"), ("bins", "groups"), ("chain", "groups")]
    assert all((bits(results[a]) != bits(results[b])).any() for a, b in pairs)
    assert set(identify(fields, results["groups"]).matching) == GROUPS


def test_a_nudged_element_matches_no_profile_and_is_counted():
    fields, results = a_call(np.random.default_rng(4), "dropless", 6, F32)
    grad_x = results["bins"].copy()
    grad_x.view(np.uint32)[1, 2] ^= 1  # one bit of one element
    found = identify(fields, grad_x)
    assert found.matching == ()
    assert {found.outcome_of(p).differing_elements for p in BINS} == {1}


def test_signed_zero_tells_the_a2_a3_from_the_950_and_the_golden():
    # docs/semantics.md 4 and 7.3: a dropless row of -0.0 values is -0.0 on A2/A3, +0.0 on the 950 and the golden.
    grad = np.full((4, 3), -0.0, np.float32)
    fields = {"grad_expanded_x": grad, "expanded_row_idx": np.array([1, 0, 3, 2], np.int32), "top_k": 2}
    assert set(identify(fields, np.full((2, 3), -0.0, np.float32)).matching) == BINS
    assert set(identify(fields, np.zeros((2, 3), np.float32)).matching) == GROUPS | CHAIN


def test_a_nan_payload_counts():
    fields, results = a_call(np.random.default_rng(5), "dropless", 3, F32)
    grad_x = results["bins"].copy()
    grad_x.view(np.uint32)[0, 0] = 0x7FC00000  # a quiet NaN where the sum is finite
    other = grad_x.copy()
    other.view(np.uint32)[0, 0] = 0x7FC00001  # the same NaN but one payload bit
    one, two = identify(fields, grad_x), identify(fields, other)
    assert one.outcome_of("ascend910b@9.1").differing_elements == 1
    assert two.outcome_of("ascend910b@9.1").differing_elements == 1
    assert one.matching == two.matching == ()


def test_a_nan_matches_a_nan_of_any_payload():
    # docs/semantics.md 4: which NaN comes out is not part of the contract; NaN is compared by position.
    grad = np.full((6, 2), 0x7FC00123, np.uint32).view(np.float32)  # NaN with a payload in every slot
    fields = {"grad_expanded_x": grad, "expanded_row_idx": np.arange(6, dtype=np.int32), "top_k": 2}
    canonical = np.full((3, 2), np.nan, np.float32)  # another payload, 0x7FC00000
    assert canonical.view(np.uint32)[0, 0] != 0x7FC00123
    assert set(identify(fields, canonical).matching) == set(moegrad.PROFILES)
    finite = canonical.copy()
    finite[0, 0] = 1.0  # a number where every profile gives NaN: one element differs
    assert identify(fields, finite).outcome_of("ascend950@9.1").differing_elements == 1


def test_a_single_name_is_one_profile_and_none_is_refused():
    fields, results = a_call(np.random.default_rng(7), "dropless", 3, F32)
    assert [p.profile for p in identify(fields, results["bins"], profiles="ascend950").profiles] == ["ascend950@9.1"]
    with pytest.raises(ValueError, match="profiles is empty"):
        identify(fields, results["bins"], profiles=[])


def test_a_call_only_950_at_9_1_defines_is_refused_by_the_others():
    # Dropless with -1 slots (Huawei's binding with active_expert_range): only 950@9.1 reads them as +0.0 rows.
    rng = np.random.default_rng(6)
    top_k, tokens, hidden = 5, 3, 4
    grad = finite_values(rng, (tokens * top_k, hidden), F32)
    idx = rng.permutation(tokens * top_k).astype(np.int32)
    idx[[0, 4, 7]] = -1
    want = np.empty((tokens, hidden), np.float32)
    for i in range(tokens):  # the 950's groups of four, a -1 slot a row of +0.0
        row = [None if j < 0 else grad[j] for j in idx[i * top_k:(i + 1) * top_k]]
        want[i] = [round_from_float32(v, np.dtype(np.float32)) for v in ascend950_row(row, hidden, top_k, True)]
    found = identify({"grad_expanded_x": grad, "expanded_row_idx": idx, "top_k": top_k}, want)
    assert found.matching == ("ascend950@9.1",)
    assert set(found.refusing) == EVERY - {"ascend950@9.1"}
    refusal = found.outcome_of("ascend910b")  # a bare chip: its newest release
    assert refusal.profile == "ascend910b@9.1" and refusal.aclnn_status == INVALID
    assert "ascend950@9.1" in refusal.reason and refusal.differing_elements is None


def test_every_profile_refusing_is_an_outcome_not_an_error():
    fields = {"grad_expanded_x": np.zeros((4, 2), np.float32), "expanded_row_idx": np.array([0, 1, 2, 9], np.int32),
              "top_k": 2, "drop_pad_mode": 1}  # rank 2 in drop/pad mode: every profile's attribute check
    found = identify(fields, np.zeros((2, 2), np.float32))
    assert found.matching == () and set(found.refusing) == EVERY
    assert {found.outcome_of(p).aclnn_status for p in EVERY} <= {561002, 561103}
    assert "every profile refuses" in str(found)


def test_the_result_reads_and_round_trips():
    fields, results = a_call(np.random.default_rng(7), "dropless", 6, F32)
    found = identify(moegrad.MoeInitRoutingV2GradCall(**fields), results["groups"])
    data = json.loads(json.dumps(found.to_dict()))
    assert data["matching"] == list(found.matching) and data["dtype"] == "float32" and data["shape"] == [4, 8]
    assert Identification.from_dict(data) == found
    text = str(found)
    assert f"bit-identical to {', '.join(found.matching)}" in text
    assert all(profile in text for profile in EVERY)
    assert found.matching == ("ascend950@9.0", "ascend950@9.1")  # float32 over 32 binades: the orders differ
    assert identify(fields, results["groups"], profiles=["ascend950", "sequential"]).matching == ("ascend950@9.1",)


@pytest.mark.parametrize(("grad_x", "text"), [
    (np.zeros((4, 8), np.float32), "float16"),
    (np.zeros((4, 7), np.float16), "[4, 8]"),
    ([[0.0] * 8] * 4, "numpy.ndarray"),
])
def test_a_grad_x_that_cannot_match_is_refused(grad_x, text):
    fields, _ = a_call(np.random.default_rng(8), "dropless", 2, F16)
    with pytest.raises(InvalidArgument) as caught:
        identify(fields, grad_x)
    assert caught.value.aclnn_status == INVALID and caught.value.field == "grad_x" and text in caught.value.message


def test_misuse_raises():
    fields, results = a_call(np.random.default_rng(9), "dropless", 2, F32)
    with pytest.raises(ValueError, match="not a device profile"):
        identify(fields, results["bins"], profiles=["ascend310"])
    with pytest.raises(TypeError, match="unknown field"):
        identify({**fields, "k": 2}, results["bins"])
    with pytest.raises(TypeError, match="mapping"):
        identify([1, 2], results["bins"])


def test_every_profile_of_a_group_computes_the_same_bits():
    # identify computes one emulation per group: each profile's own emulation must agree with it.
    for mode in ("dropless", "active", "drop_pad"):
        fields, _ = a_call(np.random.default_rng(10), mode, 9, BF16)
        grad_x = moegrad.moe_init_routing_v2_grad(**fields, order="ascend950@9.0")
        found = identify(fields, grad_x)
        for match in found.profiles:
            own = moegrad.moe_init_routing_v2_grad(**fields, order=match.profile)
            assert (np.count_nonzero(bits(own) != bits(grad_x)) == match.differing_elements), match.profile


def test_profiles_matching_in_every_report(tmp_path):
    fields, results = a_call(np.random.default_rng(11), "dropless", 6, F32)
    call = moegrad.MoeInitRoutingV2GradCall(**fields)
    report = accuracy.compare(call, results["chain"])
    assert report.profiles_matching is None  # not asked for: no extra emulation
    report = accuracy.with_profiles(report, call, results["chain"])
    assert set(report.profiles_matching) == CHAIN
    assert "profiles bit-identical to the candidate: ascend950@8.5, sequential" in accuracy.format_report(report)
    assert "ascend950@8.5, sequential" in accuracy.markdown_report(report)
    assert accuracy.rejudge(report, standards="bitwise").profiles_matching == report.profiles_matching
    accuracy.write_json_report(tmp_path / "r.json", report)
    assert accuracy.read_json_report(tmp_path / "r.json").profiles_matching == report.profiles_matching
    rows = accuracy.csv_rows(report)
    assert rows[0]["profiles_matching"] == "ascend950@8.5+sequential" and rows[1]["profiles_matching"] == ""
    accuracy.write_csv_report(tmp_path / "r.csv", report)
    assert "profiles_matching" in (tmp_path / "r.csv").read_text(encoding="utf-8-sig").splitlines()[0]
    widened = results["chain"].astype(np.float32)  # a float32 candidate of a float16 call matches nothing
    call16 = moegrad.MoeInitRoutingV2GradCall(**{**fields, "grad_expanded_x": fields["grad_expanded_x"].astype(F16)})
    assert accuracy.with_profiles(accuracy.compare(call16, widened), call16, widened).profiles_matching == ()
    nothing = accuracy.with_profiles(report, call, results["chain"] * 3)
    assert nothing.profiles_matching == () and accuracy.csv_rows(nothing)[0]["profiles_matching"] == "none"


# --------------------------------------------------------------------------------------------------
# The command, as a user runs it


def run_moegrad(*argv):
    return subprocess.run([sys.executable, "-m", "moegrad", *argv], capture_output=True, text=True, timeout=120,
                          env=os.environ.copy())


def test_the_identify_command_exit_codes(tmp_path):
    fields, results = a_call(np.random.default_rng(12), "dropless", 6, F32)
    np.save(tmp_path / "g.npy", fields["grad_expanded_x"])
    np.save(tmp_path / "idx.npy", fields["expanded_row_idx"])
    np.save(tmp_path / "groups.npy", results["groups"])
    np.save(tmp_path / "wrong.npy", results["groups"] * 3)
    call = ["identify", "--grad-expanded-x", str(tmp_path / "g.npy"), "--expanded-row-idx", str(tmp_path / "idx.npy"),
            "--top-k", "6"]
    done = run_moegrad(*call, "--grad-x", str(tmp_path / "groups.npy"))
    assert done.returncode == 0, done.stderr
    assert "bit-identical to ascend950@9.0, ascend950@9.1" in done.stdout
    done = run_moegrad(*call, "--grad-x", str(tmp_path / "wrong.npy"), "--json")
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["matching"] == []
    accuracy.save_case(tmp_path / "c.npz", candidate=results["bins"], **fields)
    done = run_moegrad("identify", "--case", str(tmp_path / "c.npz"), "--profile", "ascend910_93@8.5")
    assert done.returncode == 0 and "bit-identical to ascend910_93@8.5" in done.stdout
    np.save(tmp_path / "bad.npy", np.array([0, 1, 2, 99, 4, 5] * 4, np.int32))  # outside [0, N*K) everywhere...
    done = run_moegrad("identify", "--grad-expanded-x", str(tmp_path / "g.npy"), "--expanded-row-idx",
                       str(tmp_path / "bad.npy"), "--top-k", "6", "--grad-x", str(tmp_path / "groups.npy"))
    assert done.returncode == 3, done.stdout  # ...and repeated: every profile refuses
    assert run_moegrad("identify", "--case", str(tmp_path / "c.npz"), "--top-k", "6").returncode == 2
    assert run_moegrad(*call).returncode == 2  # no --grad-x
    single = ["compare", *call[1:], "--candidate", str(tmp_path / "groups.npy"), "--local", "--json"]
    assert set(json.loads(run_moegrad(*single).stdout)["profiles_matching"]) == GROUPS  # moegrad compare asks
    assert json.loads(run_moegrad(*single, "--no-profiles").stdout)["profiles_matching"] is None
    help_text = run_moegrad("identify", "--help").stdout
    assert "exit status" in help_text and "every profile refuses" in help_text
