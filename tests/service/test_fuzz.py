"""Fuzzing the v1 decoder and endpoint (hypothesis) and the JSON routes against /openapi.json (schemathesis).

What is proved:

- every body a client can send -- random bytes, random msgpack structures, and valid documents with
  one field broken (dtype name, shape/data mismatch, a huge declared shape, odd attributes, deep
  nesting, ext types) -- is answered with a 4xx RFC 9457 problem document, never a 5xx
  (docs/protocol.md, "Errors": "A client's mistake is never a 500");
- across the whole run the process's resident memory (the in-process server is this process) stays
  within a fixed bound of where it was after warming up: nothing a bad request leaves behind piles up;
- the decoder itself (``decode_body`` + ``MoeInitRoutingV2GradCall.from_wire``) raises only the
  client-error kinds of the exception tree for the same inputs;
- schemathesis: every JSON operation in the OpenAPI document answers without a 5xx and conforms to
  the document.

Every hypothesis run is derandomized (a fixed seed per test) and uses no example database, so a run
is reproducible and leaves nothing behind. The endpoint fuzz alone sends at least 2,100 bodies a run
(the decoder fuzz 500 more), together at least twice as many bytes as the memory bound.
"""

from __future__ import annotations

import contextlib
import ctypes
import math

import msgpack
import numpy as np
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.specs.openapi.checks import status_code_conformance, unsupported_method

from moegrad import InvalidArgument, MalformedRequest, MoeInitRoutingV2GradCall, decode_body
from moegrad_service.app import create_app
from moegrad_service.memory import heap
from moegrad_service.settings import Settings
from support import routing
from support.servicekit import MSGPACK_HEADERS

GRAD_PATH = "/v1/moe_init_routing_v2_grad"
#: Statuses a fuzzed v1 body may get (docs/protocol.md, "Errors"; 415 cannot happen: the type is right).
CLIENT_ERRORS = {400, 413, 422}
#: The most the process's resident memory may grow over the endpoint fuzz, after warming up.
RSS_BOUND_BYTES = 64 << 20
#: Examples of the large-body family (1 to 6 MiB each).
LARGE_EXAMPLES = 120
#: max_elements of the fuzzed service: small enough that a huge declared shape meets it cheaply.
MAX_ELEMENTS = 1 << 22
WIRE_DTYPES = {"float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2"), "float32": np.dtype("<f4"),
               "int32": np.dtype("<i4")}
FIELDS = ("grad_expanded_x", "expanded_row_idx", "top_k", "drop_pad_mode", "active_num", "order",
          "allow_duplicate_indices")
PLACEHOLDER = "\x00moegrad-fuzz-placeholder\x00"

FUZZ = dict(deadline=None, derandomize=True, database=None, print_blob=False,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                   HealthCheck.large_base_example, HealthCheck.filter_too_much])


def rss_bytes() -> int:
    """This process's resident set size (VmRSS in /proc/self/status), in bytes, once the C library
    has given back the free memory it keeps (``malloc_trim``, where glibc has it).

    The test runs the app in the pytest process, which does not fix glibc's mmap threshold as the
    server does (``moegrad-service serve``): after the large allocations of earlier tests in the same
    worker the threshold has grown, bodies of a few MiB come from the heap, and their freed pages
    stay resident. Trimming leaves what is still allocated, which is what the bound is about.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


# --- strategies -----------------------------------------------------------------------------------

ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, 1, 2, -1, 2**31, 2**32, 2**63 - 1, 2**64 - 1]))
floats = st.floats(allow_nan=True, allow_infinity=True)
ext = st.one_of(st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=16)),
                st.builds(msgpack.Timestamp, st.integers(0, 2**32 - 1), st.integers(0, 999_999_999)))
leaves = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=24), st.binary(max_size=64), ext)
keys = st.one_of(st.sampled_from(FIELDS + ("dtype", "shape", "data")), st.text(max_size=12), st.binary(max_size=8),
                 st.integers(-5, 5))
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
                      max_leaves=12)


def pack(document) -> bytes:
    return msgpack.packb(document, use_bin_type=True, datetime=False)


@st.composite
def msgpack_bodies(draw) -> bytes:
    """A random msgpack structure: any value at all, or a map over the wire's keys with random values."""
    if draw(st.booleans()):
        return pack(draw(values))
    document = draw(st.dictionaries(keys, values, max_size=7))
    if draw(st.booleans()):  # tensor-shaped maps with random contents
        for name in ("grad_expanded_x", "expanded_row_idx"):
            document[name] = draw(st.fixed_dictionaries(
                {"dtype": st.sampled_from(sorted(WIRE_DTYPES)) | st.text(max_size=10),
                 "shape": st.lists(ints, max_size=10) | values, "data": st.binary(max_size=256) | values}))
    return pack(document)


@st.composite
def valid_documents(draw, large: bool = False) -> dict:
    """A valid request document of any mode and dtype, tensors encoded by hand from NumPy arrays
    (up to 1 MiB of grad; ``large``: 1 to 6 MiB)."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    mode = draw(st.sampled_from(["dropless", "active", "drop_pad"]))
    if large:
        tokens, top_k, hidden = draw(st.integers(32, 48)), draw(st.integers(2, 4)), 8192
    else:
        tokens, top_k = draw(st.integers(1, 16)), draw(st.integers(1, 4))
        hidden = draw(st.sampled_from([1, 3, 16, 256, 2048, 4096]))
    experts = draw(st.integers(top_k, top_k + 6))
    r = routing.route(rng, tokens, top_k, experts, mode)
    dtype = draw(st.sampled_from(["float16", "bfloat16", "float32"]))
    bits = np.uint16 if WIRE_DTYPES[dtype].itemsize == 2 else np.uint32  # any bit pattern: NaN and inf too
    grad = rng.integers(0, np.iinfo(bits).max, size=r.grad_shape(hidden), dtype=bits, endpoint=True)
    document = {
        "grad_expanded_x": {"dtype": dtype, "shape": list(r.grad_shape(hidden)),
                            "data": grad.astype(bits().dtype.newbyteorder("<")).tobytes()},
        "expanded_row_idx": {"dtype": "int32", "shape": [r.expanded_row_idx.size],
                             "data": r.expanded_row_idx.astype("<i4").tobytes()},
        "top_k": r.top_k, "drop_pad_mode": r.drop_pad_mode, "active_num": r.active_num,
    }
    if draw(st.booleans()):
        document["order"] = draw(st.sampled_from(["ascend910b", "sequential"]))
    return document


def nested(depth: int, kind: str) -> bytes:
    """msgpack bytes of a value nested ``depth`` containers deep (packed by hand: msgpack's packer
    refuses deep recursion, a hostile client need not)."""
    opener = b"\x91" if kind == "list" else b"\x81\xa1a"  # fixarray of 1 / fixmap of 1 with key "a"
    return opener * depth + b"\x01"


@st.composite
def broken_bodies(draw, large: bool = False) -> bytes:
    """A valid document with exactly one field broken."""
    document = draw(valid_documents(large))
    tensor = draw(st.sampled_from(["grad_expanded_x", "expanded_row_idx"]))
    t = document[tensor]
    how = draw(st.sampled_from([
        "dtype", "shape_off", "shape_huge", "shape_rank", "shape_odd", "data_short", "data_long", "data_type",
        "tensor_keys", "tensor_type", "attribute", "order", "allow", "index_value", "missing", "unknown_key",
        "deep", "ext",
    ]))
    if how == "dtype":
        t["dtype"] = draw(st.one_of(st.text(max_size=12), st.sampled_from(["float64", "int64", "uint16", "Float32",
                                                                           "float32 ", "bool"]),
                                    st.sampled_from(sorted(WIRE_DTYPES)), leaves))
    elif how == "shape_off":
        at = draw(st.integers(0, len(t["shape"]) - 1))
        t["shape"][at] = max(0, t["shape"][at] + draw(st.integers(-3, 3).filter(bool)))
    elif how == "shape_huge":
        huge = st.sampled_from([2**31, 2**32 + 1, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]) | st.integers(2**22, 2**64 - 1)
        t["shape"] = draw(st.lists(st.integers(0, 4) | huge, min_size=1, max_size=4).filter(
            lambda s: math.prod(s) > MAX_ELEMENTS or 0 in s))
    elif how == "shape_rank":
        t["shape"] = draw(st.lists(st.integers(0, 2), min_size=0, max_size=40))
    elif how == "shape_odd":
        t["shape"] = draw(st.one_of(st.lists(st.integers(-(2**63), -1) | floats | st.booleans() | st.text(max_size=3),
                                             min_size=1, max_size=4), leaves, st.dictionaries(keys, leaves, max_size=3)))
    elif how == "data_short":
        t["data"] = t["data"][: max(0, len(t["data"]) - draw(st.integers(1, 9)))]
    elif how == "data_long":
        t["data"] = t["data"] + draw(st.binary(min_size=1, max_size=9))
    elif how == "data_type":
        t["data"] = draw(st.one_of(st.text(max_size=16), leaves.filter(lambda v: not isinstance(v, bytes)),
                                   st.lists(st.integers(0, 255), max_size=8)))
    elif how == "tensor_keys":
        if draw(st.booleans()):
            del t[draw(st.sampled_from(["dtype", "shape", "data"]))]
        else:
            t[draw(st.text(max_size=8).filter(lambda k: k not in t))] = draw(leaves)
    elif how == "tensor_type":
        document[tensor] = draw(st.one_of(leaves, st.lists(leaves, max_size=4)))
    elif how == "attribute":
        name = draw(st.sampled_from(["top_k", "drop_pad_mode", "active_num"]))
        document[name] = draw(st.one_of(
            ints, floats, st.booleans(), st.sampled_from([float("nan"), float("inf"), -float("inf"), 2.0, -0.0, 1e300]),
            st.text(max_size=8), st.none(), st.lists(ints, max_size=3)))
    elif how == "order":
        document["order"] = draw(st.one_of(st.text(max_size=16), leaves))
    elif how == "allow":
        document["allow_duplicate_indices"] = draw(leaves)
    elif how == "index_value":
        idx = np.frombuffer(document["expanded_row_idx"]["data"], dtype="<i4").copy()
        idx[draw(st.integers(0, idx.size - 1))] = draw(st.integers(-(2**31), 2**31 - 1)
                                                       | st.sampled_from([-1, -2, 2**31 - 1, int(idx.max()) + 1]))
        document["expanded_row_idx"]["data"] = idx.tobytes()
    elif how == "missing":
        del document[draw(st.sampled_from(["grad_expanded_x", "expanded_row_idx", "top_k"]))]
    elif how == "unknown_key":
        document[draw(st.text(max_size=12).filter(lambda k: k not in FIELDS))] = draw(leaves)
    elif how == "ext":
        where = draw(st.sampled_from(["top_k", "order", "shape", "dtype", "data"]))
        if where in ("shape", "dtype", "data"):
            t[where] = draw(ext)
        else:
            document[where] = draw(ext)
    if how != "deep":
        return pack(document)
    # deep nesting: a placeholder string in one place, then replaced by hand-packed nested bytes
    where = draw(st.sampled_from(["top_k", "order", "allow_duplicate_indices", "unknown", "dtype", "shape", "data",
                                  "tensor"]))
    if where in ("dtype", "shape", "data"):
        t[where] = PLACEHOLDER
    elif where == "tensor":
        document[tensor] = PLACEHOLDER
    else:
        document["extra" if where == "unknown" else where] = PLACEHOLDER
    depth = draw(st.integers(1, 1100) | st.integers(960, 1030))  # msgpack's own stack stops at 1024
    body = pack(document)
    marker = pack(PLACEHOLDER)
    assert body.count(marker) == 1
    return body.replace(marker, nested(depth, draw(st.sampled_from(["list", "map"]))))


any_body = st.one_of(st.binary(max_size=512), msgpack_bodies(), broken_bodies())


# --- the decoder ----------------------------------------------------------------------------------

@given(body=any_body)
@settings(max_examples=500, **FUZZ)
def test_decoder_raises_only_client_errors(body):
    """decode_body + from_wire either build a call or raise MalformedRequest (400, and its subclass
    PayloadTooLarge, 413) or InvalidArgument (422): never anything that maps to a 5xx."""
    try:
        MoeInitRoutingV2GradCall.from_wire(decode_body(body), max_elements=MAX_ELEMENTS)
    except (MalformedRequest, InvalidArgument):
        pass


# --- the endpoint ---------------------------------------------------------------------------------

@pytest.mark.parametrize("depth", [100, 900, 1000, 1023, 1024, 5000])
@pytest.mark.parametrize("where", ["top_k", "order", "extra", "dtype", "shape", "data", "tensor", "key"])
def test_deep_nesting_anywhere_is_a_400_or_422(client, depth, where):
    """A value nested up to (and past) msgpack's own 1024-level stack in any position: a client error.

    Nesting is also what Python's recursion limit (1000) trips on when an error message shows the
    value, so depths around 1000 are the interesting ones."""
    document = {"grad_expanded_x": {"dtype": "float32", "shape": [4, 2], "data": bytes(32)},
                "expanded_row_idx": {"dtype": "int32", "shape": [4], "data": np.arange(4, dtype="<i4").tobytes()},
                "top_k": 2}
    if where in ("dtype", "shape", "data"):
        document["grad_expanded_x"][where] = PLACEHOLDER
    elif where == "tensor":
        document["grad_expanded_x"] = PLACEHOLDER
    elif where == "key":  # a container as a map key: msgpack lets a client send one
        document[PLACEHOLDER] = 1
    else:
        document[where] = PLACEHOLDER
    for kind in ("list", "map"):
        body = pack(document).replace(pack(PLACEHOLDER), nested(depth, kind))
        response = client.post(GRAD_PATH, content=body, headers=MSGPACK_HEADERS)
        assert response.status_code in (400, 422), (kind, response.status_code, response.text[:300])
        assert_client_error(response)


def assert_client_error(response) -> None:
    """A 2xx msgpack reply, or a 4xx problem document whose ``status`` is the response's."""
    if response.status_code == 200:
        reply = msgpack.unpackb(response.content, raw=False)
        assert set(reply["grad_x"]) == {"dtype", "shape", "data"}
        return
    assert response.status_code in CLIENT_ERRORS, (response.status_code, response.text[:500])
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["status"] == response.status_code
    assert isinstance(problem["title"], str) and problem["title"]
    assert isinstance(problem["detail"], str) and problem["detail"]


def fuzz_endpoint(client: TestClient, strategy: st.SearchStrategy[bytes], examples: int, sent: list[int]) -> None:
    @given(body=strategy)
    @settings(max_examples=examples, **FUZZ)
    def check(body: bytes) -> None:
        sent.append(len(body))
        response = client.post(GRAD_PATH, content=body, headers=MSGPACK_HEADERS)
        assert_client_error(response)

    check()


def warm_up_documents() -> list[dict]:
    """One valid document for every mode, dtype and order, about as large as the large strategy's:
    whatever the server builds lazily (kernels compiled on first use, allocator arenas) is built
    before the memory baseline is taken."""
    documents = []
    for seed, (mode, dtype, order) in enumerate((m, d, o) for m in ("dropless", "active", "drop_pad")
                                                for d in ("float16", "bfloat16", "float32")
                                                for o in ("ascend910b", "sequential")):
        rng = np.random.default_rng(seed)
        r = routing.route(rng, 48, 4, 8, mode)
        bits = np.uint16 if WIRE_DTYPES[dtype].itemsize == 2 else np.uint32
        grad = rng.integers(0, 1 << 10, size=r.grad_shape(8192), dtype=bits)  # small finite values
        documents.append({
            "grad_expanded_x": {"dtype": dtype, "shape": list(r.grad_shape(8192)), "data": grad.tobytes()},
            "expanded_row_idx": {"dtype": "int32", "shape": [r.expanded_row_idx.size],
                                 "data": r.expanded_row_idx.astype("<i4").tobytes()},
            "top_k": r.top_k, "drop_pad_mode": r.drop_pad_mode, "active_num": r.active_num, "order": order})
    return documents


@pytest.mark.serial  # its RSS bound needs the machine to itself: beside two other lanes, a clean-clone run once read 179 MiB
def test_endpoint_answers_every_fuzzed_body_with_a_4xx_problem_and_memory_stays_bounded(monkeypatch):
    # the readings trim the heap themselves (rss_bytes); the service's own trims, at moments of its
    # choosing on another thread, are kept out of them
    monkeypatch.setattr(heap, "TRIM_AFTER_BYTES", 1 << 62)
    settings_ = Settings(backend="reference", max_elements=MAX_ELEMENTS, max_body_bytes=8 << 20)
    with TestClient(create_app(settings_), raise_server_exceptions=False) as client:
        for _ in range(3):
            for document in warm_up_documents():
                body = pack(document)
                assert client.post(GRAD_PATH, content=body, headers=MSGPACK_HEADERS).status_code == 200
                assert client.post(GRAD_PATH, content=body[:-1], headers=MSGPACK_HEADERS).status_code == 400
        # and the large family once (the same bodies again below: the run is derandomized), so that the
        # allocator's arenas have grown to the sizes these bodies need before the baseline is taken
        fuzz_endpoint(client, broken_bodies(large=True), LARGE_EXAMPLES, [])
        baseline = rss_bytes()
        peak = baseline
        families: list[tuple[str, st.SearchStrategy[bytes], int]] = [
            ("random bytes", st.binary(max_size=2048), 800),
            ("random msgpack structures", msgpack_bodies(), 400),
            ("valid documents with one field broken", broken_bodies(), 800),
            ("large valid documents with one field broken", broken_bodies(large=True), LARGE_EXAMPLES),
        ]
        total, total_bytes = 0, 0
        for name, strategy, examples in families:
            sent: list[int] = []
            fuzz_endpoint(client, strategy, examples, sent)
            assert len(sent) >= examples, f"{name}: only {len(sent)} bodies generated"
            total, total_bytes = total + len(sent), total_bytes + sum(sent)
            peak = max(peak, rss_bytes())
        assert total >= 2000
        # the bound means something only if keeping what was sent would break it, twice over
        assert total_bytes >= 2 * RSS_BOUND_BYTES, f"only {total_bytes >> 20} MiB sent"
        assert peak - baseline <= RSS_BOUND_BYTES, (
            f"RSS grew {(peak - baseline) >> 20} MiB over {total} bodies ({total_bytes >> 20} MiB)")
        assert client.post(GRAD_PATH, content=pack(warm_up_documents()[0]), headers=MSGPACK_HEADERS).status_code == 200


# --- schemathesis: the JSON routes against the OpenAPI document -----------------------------------
# Operations with a msgpack body (the v1 calls) are left out: they are fuzzed above.
# The schema is loaded when the module is collected (schemathesis 4.32's fixture-based loader reads a
# pytest-internal attribute that pytest 9 removed). Loading it only asks the app for /openapi.json;
# schemathesis runs the app's lifespan around the calls and ends it when each test ends.
json_operations = schemathesis.openapi.from_asgi("/openapi.json", create_app(Settings(backend="reference"))).exclude(
    lambda ctx: "application/msgpack" in ctx.operation.definition.raw.get("requestBody", {}).get("content", {}))
SCHEMATHESIS = dict(deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@json_operations.exclude(path_regex="^/v2").parametrize()
@settings(max_examples=25, **SCHEMATHESIS)
def test_health_metrics_and_info_conform_to_the_openapi_document(case):
    """Every check schemathesis has: no 5xx, documented statuses, content types, headers, bodies."""
    response = case.call_and_validate()
    assert response.status_code < 500


@json_operations.include(path_regex="^/v2").parametrize()
@settings(max_examples=25, **SCHEMATHESIS)
def test_v2_json_routes_never_fail_and_documented_answers_conform(case):
    """No 5xx, and every answer the document describes matches it. Two checks are left out until
    the v2 routes document them: an unknown model's 404, and a 404 (not 405) for a method a v2 path
    does not have."""
    response = case.call_and_validate(excluded_checks=[status_code_conformance, unsupported_method])
    assert response.status_code < 500
