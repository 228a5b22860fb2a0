"""In-process service fixtures: ``TestClient(create_app(Settings(...)))`` as a context manager (lifespan runs)."""

from __future__ import annotations

import contextlib
import gc

import pytest
from fastapi.testclient import TestClient

from moegrad_service.app import create_app
from moegrad_service.engine import ReferenceBackend
from moegrad_service.settings import Settings
from support.servicekit import GateHook


@pytest.fixture
def serve():
    """``with serve(backend=..., **settings) as client``: an in-process service with its lifespan."""

    @contextlib.contextmanager
    def start(backend=None, **settings):
        settings.setdefault("backend", "reference")
        app = create_app(Settings(**settings), backend=backend)
        with TestClient(app, raise_server_exceptions=False) as client:
            yield client

    return start


@pytest.fixture
def client(serve):
    with serve() as c:
        yield c


@pytest.fixture
def gate():
    hook = GateHook()
    yield hook
    hook.release.set()


@pytest.fixture
def gated_backend(gate):
    return ReferenceBackend(fault_hook=gate)


@pytest.fixture
def collector_off():
    """The garbage collector off for the test: only reference counts free anything."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


#: The test modules whose v1 msgpack bodies and replies are checked against the old decoder and
#: encoder (support.msgpack_oracle): every body they send, the same document or the same error.
ORACLE_CHECKED = frozenset({"test_v1", "test_compare", "test_fuzz", "test_batch_groups", "test_batch_frames",
                            "test_batching", "test_dispatch", "test_order950", "test_v1_in_place"})


@pytest.fixture(autouse=True)
def msgpack_oracle(request, monkeypatch):
    """In the modules of ORACLE_CHECKED: the v1 routes' msgpack decoding and reply packing checked
    against the oracle on every request (a mismatch is an AssertionError: the request's 500)."""
    if request.module.__name__.rsplit(".", 1)[-1] not in ORACLE_CHECKED:
        yield None
        return
    import importlib

    from support.msgpack_oracle import checking

    yield checking(importlib.import_module("moegrad_service.api.v1.routes"), monkeypatch)
