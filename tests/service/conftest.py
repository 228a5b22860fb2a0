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
