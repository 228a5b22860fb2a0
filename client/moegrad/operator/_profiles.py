"""Device profiles: a chip running one CANN release, and everything of the operator that depends on both.

The bits of aclnnMoeInitRoutingV2Grad depend on the chip (its kernel's schedule of adds) *and* on the
CANN release (the 950 kernel's schedule and its handling of invalid slots changed between releases,
and release 9.1 changed the API edge for every chip). A profile, named ``"<chip>@<release>"``, fixes
all of it; :data:`PROFILES` is the one table of them, and docs/semantics.md's profile table is
tested against it.

Chips: ``ascend910b`` (Atlas A2), ``ascend910_93`` (Atlas A3), ``ascend950`` (Ascend 950PR/950DT).
Releases: ``8.5``, ``9.0``, ``9.1``. ``"sequential"`` is Huawei's public test golden (no chip, no
release). A bare chip name means its newest release; the order names of earlier moegrad versions
are aliases (:data:`ALIASES`).
"""

from __future__ import annotations

from dataclasses import dataclass

from moegrad._dtypes import brief
from moegrad._errors import AclnnStatus

__all__ = [
    "ALIASES",
    "BINS",
    "CHAIN",
    "CHIPS",
    "DEFAULT_PROFILE",
    "GROUPS_OF_FOUR",
    "PROFILES",
    "PROFILE_NAMES",
    "RELEASES",
    "Profile",
    "profile_of_release",
    "resolve_profile",
]

#: chip name -> the product line it is (the chip names are the SoC families ``aclrtGetSocName`` reports).
CHIPS: dict[str, str] = {
    "ascend910b": "Atlas A2",
    "ascend910_93": "Atlas A3",
    "ascend950": "Ascend 950PR/950DT",
}
#: The CANN releases a profile names, oldest first.
RELEASES: tuple[str, ...] = ("8.5", "9.0", "9.1")

# The kernels' schedules of adds (docs/semantics.md sections 3 and 7; moegrad.numerics._schedules writes each out).
BINS = "bins"  # A2/A3: B accumulators over interleaved slots, then a pairwise tree
CHAIN = "chain"  # one float32 accumulator from +0.0, slot by slot
GROUPS_OF_FOUR = "groups_of_four"  # 950: s += ((v0 + v1) + (v2 + v3)) per K chunk, leftovers one by one

_A2A3_KERNEL = "hicann/ops-transformer moe/moe_init_routing_v2_grad/op_kernel/*.h"
_950_KERNEL = "mirror-cann/ops-transformer moe/moe_init_routing_v2_grad/op_kernel/arch35/*_base.h"


@dataclass(frozen=True)
class Profile:
    """One chip running one CANN release: what aclnnMoeInitRoutingV2Grad computes there.

    Attributes:
        name: ``"<chip>@<release>"``, or ``"sequential"``.
        chip: a key of :data:`CHIPS`, or None for ``"sequential"``.
        release: one of :data:`RELEASES`, or None for ``"sequential"``.
        schedule: the kernel's schedule of adds: ``"bins"`` (A2/A3), ``"groups_of_four"`` (950
            from 9.0) or ``"chain"`` (950 at 8.5, and the sequential golden).
        skips_any_negative: True when every negative index, in every mode, contributes a +0.0 row
            (950 from 9.1); False when only -1 in drop/pad mode does, other negatives being read
            outside the buffer by the kernel (undefined, so refused).
        skips_dropless_overflow: True when a dropless index >= N*K contributes a +0.0 row (950
            from 9.1); False when the kernel reads outside its buffer (undefined, so refused).
            Every kernel skips an active-mode index >= A, but moegrad accepts one >= N*K (outside
            the documented range) only where this is True.
        attribute_status: the status of a phase-one attribute or shape failure: 561002
            ACLNN_ERR_INNER_TILING_ERROR before 9.1, 561103 ACLNN_ERR_INNER_NULLPTR from 9.1 (the
            tiling now runs in an l0 layer whose failure the API reports as a null result).
        empty_out_skips_checks: True from 9.1: an empty ``out`` succeeds in phase one with no
            launch and no attribute checks.
        empty_skips_dtype_checks: True from 9.1: the dtype checks are skipped for empty tensors.
        checks_out_dtype: True from 9.1: ``out``'s dtype must equal ``gradExpandedX``'s (161002).
        source: where the kernel's schedule and the invalid-slot rule were read (repo, path, commit).
    """

    name: str
    chip: str | None
    release: str | None
    schedule: str
    skips_any_negative: bool
    skips_dropless_overflow: bool
    attribute_status: AclnnStatus
    empty_out_skips_checks: bool
    empty_skips_dtype_checks: bool
    checks_out_dtype: bool
    source: str

    @property
    def order(self) -> str:
        """:attr:`schedule` under its former name (kept so that code reading it goes on working)."""
        return self.schedule

    @property
    def product(self) -> str:
        """The product line (``"Atlas A2"``...), or ``"Huawei's sequential test golden"``."""
        return CHIPS[self.chip] if self.chip else "Huawei's sequential test golden"

    @property
    def product_line(self) -> str:
        """The product line and release (``"Atlas A2, CANN 9.1"``), or ``"sequential golden (no device)"``."""
        return f"{self.product}, CANN {self.release}" if self.release else "sequential golden (no device)"


def _profile(chip: str, release: str) -> Profile:
    edge_91 = release == "9.1"  # the 9.1 API edge has no chip branch
    if chip == "ascend950":
        schedule = CHAIN if release == "8.5" else GROUPS_OF_FOUR
        commit = {"8.5": "a5d6f9dc", "9.0": "8c1f71ff", "9.1": "49e0de82"}[release]
        source = f"{_950_KERNEL} @ {commit} (release branch {release}.0)"
        skips = edge_91
    else:
        schedule, source, skips = BINS, f"{_A2A3_KERNEL} (unchanged in every release)", False
    return Profile(
        name=f"{chip}@{release}",
        chip=chip,
        release=release,
        schedule=schedule,
        skips_any_negative=skips,
        skips_dropless_overflow=skips,
        attribute_status=(AclnnStatus.ACLNN_ERR_INNER_NULLPTR if edge_91 else AclnnStatus.ACLNN_ERR_INNER_TILING_ERROR),
        empty_out_skips_checks=edge_91,
        empty_skips_dtype_checks=edge_91,
        checks_out_dtype=edge_91,
        source=source,
    )


SEQUENTIAL = Profile(
    name="sequential",
    chip=None,
    release=None,
    schedule=CHAIN,
    skips_any_negative=False,
    skips_dropless_overflow=False,
    attribute_status=AclnnStatus.ACLNN_ERR_INNER_TILING_ERROR,
    empty_out_skips_checks=False,
    empty_skips_dtype_checks=False,
    checks_out_dtype=False,
    source="Huawei's public test golden (moe_init_routing_v2_grad tests): float32 from +0.0, slot by slot",
)

#: Every profile by name: each chip at each release, then ``"sequential"``.
PROFILES: dict[str, Profile] = {
    **{p.name: p for p in (_profile(chip, release) for chip in CHIPS for release in RELEASES)},
    SEQUENTIAL.name: SEQUENTIAL,
}
#: Accepted names that are not profiles -> the profile each means: a bare chip its newest release,
#: and the order names of earlier moegrad versions.
ALIASES: dict[str, str] = {
    **{chip: f"{chip}@{RELEASES[-1]}" for chip in CHIPS},
    "ascend950@2025-12": "ascend950@8.5",
}
#: Every name :func:`resolve_profile` accepts: the profiles, then the aliases.
PROFILE_NAMES: tuple[str, ...] = (*PROFILES, *ALIASES)
#: The profile a call names when it names none: the Atlas A2 at the newest release.
DEFAULT_PROFILE = f"ascend910b@{RELEASES[-1]}"


def resolve_profile(name: str) -> Profile:
    """The profile ``name`` means: a profile name, or an alias of :data:`ALIASES`.

    Raises:
        ValueError: a name that is neither (the message lists the accepted names).
    """
    if name in PROFILES:
        return PROFILES[name]
    if name in ALIASES:
        return PROFILES[ALIASES[name]]
    raise ValueError(
        f"{brief(name)} is not a device profile: use '<chip>@<release>' with chip one of {', '.join(CHIPS)} "
        f"and release one of {', '.join(RELEASES)}, a bare chip (its newest release), 'sequential', "
        f"or an alias ({', '.join(f'{a} = {p}' for a, p in ALIASES.items())})"
    )


def profile_of_release(chip: str, version: str | None) -> Profile | None:
    """The profile of ``chip`` at the CANN release ``version`` (``"9.1.0"``, ``"9.1.RC1"``...).

    Returns None when the version's major.minor is not one of :data:`RELEASES` (or is None): such a
    device's results are served unnamed, never under another release's name.
    """
    if version is None or chip not in CHIPS:
        return None
    major_minor = ".".join(version.strip().split(".")[:2])
    return PROFILES.get(f"{chip}@{major_minor}")
