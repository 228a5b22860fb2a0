"""The moegrad service's own v2 route as a candidate: probed, checked order-free and for determinism.

Oracles: the order each profile's kernel adds in, written in tests/support/candidates.py from
docs/semantics.md (the probe must name it through the service's v2 infer route, parameter
``order``), and the float64 sum of the same module on order-free inputs. The harness talks to the
in-process app through its test client (an httpx.Client), so bytes go through the real v2 codec.
"""

from __future__ import annotations

import numpy as np
import pytest

from moegrad import Candidate, CandidateError, check_determinism, order_free_inputs, probe_order
from support.bits import same_bits
from support.candidates import bins_tree, chain_tree, expression_of, float64_sum, groups_tree

KERNELS = {"ascend910b@9.1": bins_tree, "ascend950@9.1": lambda k: groups_tree(k, k), "sequential": chain_tree}


@pytest.mark.parametrize("profile", list(KERNELS))
def test_the_service_v2_route_is_probed_per_profile(serve, profile):
    with serve(warm_up=False) as client:
        remote = Candidate("http://testserver", http_client=client, parameters={"order": profile})
        probe = probe_order(remote, 7, "bfloat16")
        assert probe.expression == expression_of(KERNELS[profile](7))
        assert profile in probe.profiles and probe.calls == remote.calls == 3


def test_the_service_is_clean_on_order_free_inputs_and_steady(serve):
    with serve(warm_up=False) as client:
        remote = Candidate("http://testserver", http_client=client)
        call = order_free_inputs(16, 8, 8, "float16", drop_pad_mode=1, seed=4)
        exact = float64_sum(call.grad_expanded_x.astype(np.float64), call.expanded_row_idx, 8, drop_pad_mode=1)
        assert same_bits(remote(call), exact.astype(np.float16))
        assert check_determinism(remote, call, runs=3).deterministic


def test_a_refused_call_is_a_candidate_error_with_the_service_message(serve):
    with serve(warm_up=False) as client:
        remote = Candidate("http://testserver", http_client=client, parameters={"order": "no-such-profile"})
        call = order_free_inputs(2, 2, 2, seed=0)
        with pytest.raises(CandidateError, match="answered 400: .*order"):
            remote(call)
