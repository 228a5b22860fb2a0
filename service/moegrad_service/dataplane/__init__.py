"""The dataplane: what every protocol shares, with no HTTP in it.

- :mod:`~moegrad_service.dataplane.core`: :class:`DataPlane`: admission, the order policy of a
  device, running calls, batches and comparisons, readiness and metadata.
- :mod:`~moegrad_service.dataplane.records`: what it is handed (validated requests, a lender of
  result buffers) and what it answers (outcomes).
- :mod:`~moegrad_service.dataplane.batching`: a batch's plan (shares and parts), a pure function.
- :mod:`~moegrad_service.dataplane.statistics`: the inference statistics in Triton's schema.
"""

from moegrad_service.dataplane.batching import BatchPlan, Part, plan_batch
from moegrad_service.dataplane.core import DataPlane
from moegrad_service.dataplane.records import (
    BatchAnswer,
    BatchItem,
    ClientDisconnected,
    CompareOutcome,
    Comparison,
    ExplainOutcome,
    ExplainRequest,
    GradOutcome,
    GroupMember,
    GroupOutcome,
    MemberOutcome,
    ResultLender,
)
from moegrad_service.dataplane.statistics import Duration, InferenceStatistics

__all__ = [
    "BatchAnswer",
    "BatchItem",
    "BatchPlan",
    "ClientDisconnected",
    "CompareOutcome",
    "Comparison",
    "DataPlane",
    "Duration",
    "ExplainOutcome",
    "ExplainRequest",
    "GradOutcome",
    "GroupMember",
    "GroupOutcome",
    "InferenceStatistics",
    "MemberOutcome",
    "Part",
    "ResultLender",
    "plan_batch",
]
