"""The attack suite against a real ``moegrad-service``: support.attacks' attacks at their quick size.

One reference-backend server on a free 127.0.0.1 port (support.attacks.ATTACK_SETTINGS: a 64 MiB
in-flight budget, max_queue 2, 2 s body/header/idle timeouts, 300 connections) serves every
attack, watched by a probe process (``GET /health/live`` every 20 ms, the documentation's example
call every 200 ms, fresh connections). Each attack asserts its own figure, and the rules that
support.attacks judges every attack by:

- the example call succeeds within 1 s every time (at the connection cap it is answered 503 +
  Connection: close, which is the cap's point);
- the server's peak RSS (VmHWM, reset before each attack) stays within the budget + 256 MiB;
- no answer is a 5xx other than 503/504, and no request meets a reset or an unanswered close;
- ``/health/live`` never stalls: every probe within 1 s during every attack, and the 99th
  percentile over the whole run within 100 ms. (One attack's window holds a few dozen probes, so
  its own p99 is its slowest probe, at the mercy of the shared test machine's scheduler;
  ``python -m bench.attack`` reports each attack's p99 at full size.)

A second server with authentication takes the unauthenticated probing, and a third gets SIGTERM
under load. Hung kernels (the ascend backend on its simulator) are tested in tests/ascend.
"""

from __future__ import annotations

import time

import pytest

from support import attacks as attack
from support.launch import moegrad_server

pytestmark = pytest.mark.serial  # the probes' latency rules need the machine to themselves

SETTINGS = attack.ATTACK_SETTINGS
BUDGET = int(SETTINGS["max_inflight_bytes"])
TIMEOUT_S = float(SETTINGS["header_timeout_s"])
LIVE_MAX_S = 1.0


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("attacks")
    with moegrad_server(log_dir, settings=SETTINGS, name="attack") as server, \
            attack.Probes(server.port, log_dir, max_s=300) as probes:
        attack.example_call(server.port, timeout_s=120)  # compile the kernel first
        started = time.monotonic()
        yield server, probes
        live_s, _, _, _ = probes.window(started, time.monotonic())
        assert attack.p99(live_s) <= attack.LIVE_P99_S, f"/health/live p99 over the run {attack.p99(live_s):.3f} s"


def run(target, name: str, *args):
    server, probes = target
    outcome = getattr(attack, name)(server, probes, True, BUDGET, *args)
    problems = [p for p in outcome.problems if not p.startswith("/health/live p99")]
    assert not problems, outcome.row()
    assert outcome.live_p99_s <= LIVE_MAX_S, outcome.row()
    return outcome


def test_msgpack_body_of_empty_maps(target):
    outcome = run(target, "msgpack_empty_maps")
    assert set(outcome.statuses) == {400}, outcome.row()


def test_v2_json_ragged_nesting(target):
    outcome = run(target, "v2_json_ragged")
    assert set(outcome.statuses) == {400}, outcome.row()


def test_uploads_past_the_queue_are_503_before_they_are_read(target):
    outcome = run(target, "uploads_past_the_queue")
    # 16 x 16 MiB against a 64 MiB budget: one at a time fits (each holds 32 MiB of the 56 a large call
    # may take), the rest is 503 at once.
    assert set(outcome.statuses) <= {200, 503} and outcome.statuses[503] >= 12, outcome.row()
    assert outcome.figures["early_503"] == outcome.statuses[503], outcome.row()


def test_slow_senders(target):
    outcome = run(target, "slow_senders")
    assert set(outcome.statuses) <= {200, 408, 503}, outcome.row()


def test_uploads_that_stop_sending_are_408_after_body_timeout(target):
    outcome = run(target, "stalled_uploads")
    assert set(outcome.statuses) <= {408, 503} and outcome.statuses[408] >= 1, outcome.row()
    assert outcome.figures["elapsed_s"] < float(SETTINGS["body_timeout_s"]) + 1.5, outcome.row()


def test_slowloris_is_408_after_header_timeout(target):
    outcome = run(target, "slowloris")
    assert set(outcome.statuses) == {408}, outcome.row()
    assert outcome.figures["elapsed_s"] < TIMEOUT_S + 1.5, outcome.row()


def test_idle_sockets_are_closed_after_header_timeout(target):
    outcome = run(target, "idle_sockets")
    assert set(outcome.statuses) == {"closed"}, outcome.row()
    assert outcome.figures["elapsed_s"] < TIMEOUT_S + 1.5, outcome.row()


def test_a_huge_header_is_431_at_once(target):
    outcome = run(target, "huge_header")
    assert set(outcome.statuses) == {431}, outcome.row()
    assert outcome.figures["elapsed_s"] < 1.0, outcome.row()


def test_connections_past_the_cap_are_503_with_connection_close(target):
    outcome = run(target, "connection_cap", int(SETTINGS["max_connections"]))
    assert set(outcome.statuses) == {503} and outcome.figures["connection_close"] == 20, outcome.row()


def test_early_413_and_415_are_delivered(target):
    outcome = run(target, "early_answers")
    assert set(outcome.statuses) == {413, 415}, outcome.row()


def test_v1_unsupported_dtypes_are_161002(target):
    outcome = run(target, "unsupported_dtypes")
    assert set(outcome.statuses) == {422} and "[161002, 161002]" in outcome.now, outcome.row()


def test_v2_duplicate_keys(target):
    outcome = run(target, "duplicate_keys")
    assert set(outcome.statuses) == {400} and "twice" in outcome.now, outcome.row()


def test_rss_after_mixed_load_returns_near_its_start(target):
    outcome = run(target, "rss_after_load")
    assert outcome.figures["idle_mib"] - outcome.figures["start_mib"] <= 32, outcome.row()


def test_unauthenticated_probing_is_401(tmp_path):
    with attack.auth_server(tmp_path, SETTINGS) as server, \
            attack.Probes(server.port, tmp_path, token=attack.AUTH_TOKEN) as probes:
        attack.example_call(server.port, timeout_s=120, token=attack.AUTH_TOKEN)
        outcome = attack.unauthenticated_probing(server, probes, True, BUDGET)
    assert outcome.passed or all(p.startswith("/health/live p99") for p in outcome.problems), outcome.row()


def test_sigterm_under_load_answers_every_request(tmp_path):
    outcome = attack.sigterm_under_load(tmp_path, True, SETTINGS)
    assert outcome.passed, outcome.row()
    assert outcome.statuses[200] > 0 and outcome.statuses[503] > 0, outcome.row()
