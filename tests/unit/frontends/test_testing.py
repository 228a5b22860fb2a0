"""moegrad.testing.assert_close: passes a correct port, fails with a message that names what and where.

Oracles: the candidates are the K=2 device result computed without moegrad, and hand-made
departures from it (tests/support/oracle.py); the row named as worst is the row the test corrupted.
"""

from __future__ import annotations

import numpy as np
import pytest

from moegrad import InvalidArgument
from moegrad.testing import assert_close
from support.oracle import device_k2, oracle_call, oracle_candidate


def args(call) -> tuple:
    return call.grad_expanded_x, call.expanded_row_idx, call.top_k


def test_a_correct_port_passes_and_the_report_is_returned():
    call = oracle_call()
    report = assert_close(oracle_candidate("one_ulp_noise", device_k2(call)), *args(call))
    assert report.verdict == "pass" and not report.exact.bit_exact


def test_require_exact_fails_a_correct_but_different_port():
    call = oracle_call()
    with pytest.raises(AssertionError, match="bit-exact: no"):
        assert_close(oracle_candidate("one_ulp_noise", device_k2(call)), *args(call), require_exact=True)
    assert_close(device_k2(call), *args(call), require_exact=True)


def test_a_corrupted_row_fails_and_is_named_first():
    call = oracle_call()
    with pytest.raises(AssertionError) as caught:
        assert_close(oracle_candidate("one_gross_element", device_k2(call)), *args(call), msg="my port, step 3")
    message = str(caught.value)
    assert message.startswith("my port, step 3\n")
    worst = message.splitlines()[message.splitlines().index(
        "  worst rows (|candidate - golden| / max(sum |summands|, small value)):") + 1]
    assert worst.startswith("    row 5:") and "column 3" in worst
    assert "accumulative: fail (the device: pass)" in message and "max_accumulative_error" in message


def test_bad_input_names_the_field():
    call = oracle_call()
    with pytest.raises(InvalidArgument) as caught:
        assert_close(np.zeros((3, 3), np.float32), *args(call))
    assert caught.value.field == "candidate" and caught.value.aclnn_status == 161002
