"""The operator: one call checked as aclnnMoeInitRoutingV2Grad's phase one checks it, on the device
profile (a chip at one CANN release) the call names (docs/operator.md, docs/semantics.md).

The public face of :mod:`moegrad.operator`; the service imports these names from here.
"""

from moegrad.operator._call import GRAD_DTYPES, ORDERS, CallGroup, MoeInitRoutingV2GradCall, names_profile
from moegrad.operator._profiles import (
    ALIASES,
    CHIPS,
    DEFAULT_PROFILE,
    PROFILE_NAMES,
    PROFILES,
    RELEASES,
    Profile,
    profile_of_release,
    resolve_profile,
)

__all__ = [
    "ALIASES",
    "CHIPS",
    "DEFAULT_PROFILE",
    "GRAD_DTYPES",
    "ORDERS",
    "PROFILES",
    "PROFILE_NAMES",
    "RELEASES",
    "CallGroup",
    "MoeInitRoutingV2GradCall",
    "Profile",
    "names_profile",
    "profile_of_release",
    "resolve_profile",
]
