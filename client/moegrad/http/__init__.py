"""The HTTP client: :class:`Client` and :class:`AsyncClient` over one sans-I/O core, the replicas,
the transports, and the sweep adapter (docs/protocol.md).

The public face of :mod:`moegrad.http` (``moegrad`` re-exports each of these names).
"""

from moegrad.http._answers import CompareResult, ExplainResult, GradResult
from moegrad.http._async_client import AsyncClient
from moegrad.http._client import Client
from moegrad.http._documents import BatchCompare
from moegrad.http._replicas import ReplicaStats

__all__ = ["AsyncClient", "BatchCompare", "Client", "CompareResult", "ExplainResult", "GradResult", "ReplicaStats"]
