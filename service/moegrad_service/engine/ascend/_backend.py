"""The ascend backend's lifecycle: the device opened, its profile read (chip and CANN release) and
probed at startup, workers made, health checked, and everything released in order at close."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import time
from pathlib import Path

import numpy as np

from moegrad import DeviceFault, Profile
from moegrad.operator import RELEASES, profile_of_release
from moegrad_service.engine.ascend._abi import (
    ACL_DATA_TYPES,
    ACL_HBM_MEM,
    ACL_MEMCPY_HOST_TO_DEVICE,
    SET_ENV_HINT,
    CannUnavailable,
    load,
)
from moegrad_service.engine.ascend._buffers import aligned
from moegrad_service.engine.ascend._call import SOC_CHIPS, chip_of_soc, phase_one_error
from moegrad_service.engine.ascend._device import Device, acl_acquire, acl_release, left
from moegrad_service.engine.ascend._release import Release, operator_release
from moegrad_service.engine.ascend._worker import AscendWorker, Workers
from moegrad_service.engine.base import Backend

__all__ = ["AscendBackend"]

log = logging.getLogger("moegrad_service.engine.ascend")

#: The documentation's example, run through phase one at startup: grad_expanded_x [4, 2] float32,
#: expanded_row_idx [2, 0, 1, 3], top_k 2, dropless; grad_x [2, 2].
_PROBE_GRAD = np.array([[0.1, 0.1], [0.3, 0.3], [0.2, 0.2], [0.4, 0.4]], dtype=np.float32)
_PROBE_IDX = np.array([2, 0, 1, 3], dtype=np.int32)


class AscendBackend(Backend):
    """An Ascend NPU running aclnnMoeInitRoutingV2Grad (Atlas A2/A3, Ascend 950PR/950DT).

    Args:
        device_id: the NPU, an index among those ``ASCEND_RT_VISIBLE_DEVICES`` exposes.
        ascend_home_path: the CANN install whose ``lib64`` holds the libraries; None searches the
            loader path only (what CANN's ``set_env.sh`` sets up).
        cache_bytes_per_stream: device memory each worker keeps for reuse between calls, in bytes.
        drain_timeout_s: how long closing waits for a stream to finish, in seconds.

    Attributes:
        name: ``"ascend"``.
        soc_name: what ``aclrtGetSocName`` reports (``"Ascend910B3"``), or None when it reports nothing.
        chip: the chip of that SoC (:data:`~._call.SOC_CHIPS`: ``"ascend910b"``, ``"ascend910_93"``,
            ``"ascend950"``), or None for an SoC not in the table.
        release: the CANN release of the operator's package and how it was read
            (:func:`~._release.operator_release`: ``aclsysGetVersionStr`` or version.info).
        profile: ``moegrad.operator.profile_of_release(chip, release.version)``, or None when the
            chip or the release is not in the profile table (or the release could not be read).
        order: the profile's name (``"ascend910b@9.1"``): the bits this device's results are; None
            when the profile is unknown (such a device's results are never named as a profile's).
        device: ``"<SoC name> #<id>, CANN <version> (<how it was read>)"`` (``"Ascend910B3 #0, CANN
            9.1.0 (aclsysGetVersionStr)"``); ``"..., CANN release unknown"`` when it could not be
            read, ``"..., CANN 10.0.0 (version.info): release unknown to moegrad"`` when it is not
            one of RELEASES. ``"ascend device <id>"`` stands for the SoC when it reports no name.
            Read-only.

    Raises:
        CannUnavailable: the libraries, a symbol or the device cannot be found, ``ASCEND_OPP_PATH`` is
            not a directory, or phase one of the documentation's example fails (its aclnn code
            attached: 561003, 561107, ...). A startup error.
        DeviceFault: ``aclInit`` or ``aclrtSetDevice`` failed (the runtime's message attached).
    """

    name = "ascend"

    def __init__(
        self,
        *,
        device_id: int = 0,
        ascend_home_path: str | Path | None = None,
        cache_bytes_per_stream: int = 1 << 30,
        drain_timeout_s: float = 10.0,
    ) -> None:
        self.device_id = int(device_id)
        self.cache_bytes_per_stream = cache_bytes_per_stream
        self.drain_timeout_s = drain_timeout_s
        self._api = load(ascend_home_path)
        _check_opp_path(ascend_home_path)
        self._device = Device(self._api, self.device_id)
        self._workers = Workers()
        with contextlib.ExitStack() as undo:  # on failure: reset the device, then release ACL
            acl_acquire(self._api)
            undo.callback(acl_release, self._api)
            undo.callback(self._device.reset_all)
            count = ctypes.c_uint32(0)
            self._device.check("aclrtGetDeviceCount", self._api.aclrtGetDeviceCount(ctypes.byref(count)))
            if not 0 <= self.device_id < count.value:
                raise CannUnavailable(
                    f"NPU {self.device_id} is not visible to this process: CANN reports "
                    f"{count.value} device(s). Check /dev/davinci*, the container's device "
                    "mounts and ASCEND_RT_VISIBLE_DEVICES."
                )
            self._device.ensure()
            soc = self._api.soc_name()
            self.soc_name = soc
            self.chip = chip_of_soc(soc)
            self.release = operator_release(self._api)
            self.profile = None if self.chip is None else profile_of_release(self.chip, self.release.version)
            self.order = None if self.profile is None else self.profile.name
            named = f"{soc} #{self.device_id}" if soc else f"ascend device {self.device_id}"
            self._device.description = f"{named}, {_describe(self.release, self.profile, self.chip)}"
            self._probe()
            undo.pop_all()
        self._log_profile()

    @property
    def device(self) -> str:
        return self._device.description

    def _log_profile(self) -> None:
        """One log line: the profile and where its release was read, or why the profile is unknown."""
        release = self.release
        if self.profile is not None:
            log.info("%s computes profile %s (release read by %s)", self.device, self.order, release.source)
            return
        if self.chip is None:
            why = (
                f"{self.soc_name or 'its SoC'} is not a chip moegrad has a profile for ("
                + ", ".join(prefix + "*" for prefix, _ in SOC_CHIPS)
                + ")"
            )
        elif release.version is None:
            why = f"the CANN release of the operator package could not be read ({release.source})"
        else:
            releases = ", ".join(RELEASES)
            why = f"CANN {release.version} ({release.source}) is not a release moegrad has a profile for ({releases})"
        log.warning(
            "%s: %s; its results are served with the profile unknown, to calls that name none", self.device, why
        )

    def __repr__(self) -> str:
        return f"AscendBackend(device={self.device!r}, closed={self._workers.closed})"

    def _probe(self) -> None:
        """Phase one of the documentation's example, so a host that cannot run the operator never starts.

        Raises:
            CannUnavailable: phase one fails (a missing kernel package, ASCEND_OPP_PATH, ...).
        """
        device = self._device
        with contextlib.ExitStack() as cleanup:
            pointers = []
            for array in (_PROBE_GRAD, _PROBE_IDX, np.empty((2, 2), np.float32)):
                pointer = device.malloc(aligned(array.nbytes))
                cleanup.callback(device.free, pointer)
                pointers.append(pointer)
            for probe, pointer in zip((_PROBE_GRAD, _PROBE_IDX), pointers, strict=False):
                device.check(
                    "aclrtMemcpy (host to device)",
                    self._api.aclrtMemcpy(
                        pointer, aligned(probe.nbytes), probe.ctypes.data, probe.nbytes, ACL_MEMCPY_HOST_TO_DEVICE
                    ),
                )
            tensors = []
            for shape, acl_type, pointer in (
                ((4, 2), ACL_DATA_TYPES["float32"], pointers[0]),
                ((4,), ACL_DATA_TYPES["int32"], pointers[1]),
                ((2, 2), ACL_DATA_TYPES["float32"], pointers[2]),
            ):
                tensors.append(device.create_tensor(shape, acl_type, pointer))
                cleanup.callback(device.destroy_tensor, tensors[-1])
            workspace_size, executor = ctypes.c_uint64(0), ctypes.c_void_p()
            status = self._api.aclnnMoeInitRoutingV2GradGetWorkspaceSize(
                tensors[0], tensors[1], 2, 0, 0, tensors[2], ctypes.byref(workspace_size), ctypes.byref(executor)
            )
            if status:
                error = phase_one_error(status, self._api.recent_error(), self.device, self.profile)
                raise CannUnavailable(
                    f"{self.device} cannot run aclnnMoeInitRoutingV2Grad: the documentation's "
                    f"example fails at startup: {error}. {SET_ENV_HINT}",
                    aclnn_status=status,
                    device_message=getattr(error, "device_message", None),
                )
            device.discard_executor(executor.value)

    # --- the protocol ------------------------------------------------------------------------------

    def open_worker(self, index: int) -> AscendWorker:
        """A worker owning one stream; call it on the thread that will run the worker's calls."""
        if self._workers.closed:
            raise DeviceFault("the ascend backend is closed")
        return AscendWorker(
            self._api,
            self._device,
            index,
            workers=self._workers,
            profile=self.profile,
            cache_bytes_per_stream=self.cache_bytes_per_stream,
            drain_timeout_s=self.drain_timeout_s,
        )

    def check_health(self) -> None:
        """Query the NPU's HBM (``aclrtGetMemInfo``) from this thread.

        Raises:
            DeviceFault: the backend is closed or the runtime reports an error (message attached).
        """
        if self._workers.closed:
            raise DeviceFault("the ascend backend is closed")
        self._device.ensure()
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self._device.check(
            "aclrtGetMemInfo", self._api.aclrtGetMemInfo(ACL_HBM_MEM, ctypes.byref(free), ctypes.byref(total))
        )
        if total.value == 0:
            raise DeviceFault(f"{self.device} reports no HBM")

    def close(self) -> None:
        """Synchronise, free the caches, destroy the streams, reset the device, release ACL (in that order).

        Workers still open are shut down from this thread. Bounded: every wait shares one budget of
        ``drain_timeout_s``; a stream whose kernel is still running after it is destroyed with
        ``aclrtDestroyStreamForce`` (no wait), and the memory that kernel used is left to
        ``aclrtResetDevice``. Never raises; failures are logged.
        """
        workers = self._workers.close()
        if workers is None:  # closed already
            return
        deadline = time.monotonic() + self.drain_timeout_s
        try:
            self._device.ensure()
        except DeviceFault:
            log.exception("closing %s: cannot set the device on this thread", self.device)
        for worker in workers:
            worker._shutdown(deadline)
        for retired in self._workers.take_abandoned():
            if self._device.wait_idle(retired.stream, left(deadline)):
                self._device.release_retired(retired)
                continue
            forced = self._device.force_destroy_stream(retired.stream)
            log.error(
                "closing %s: a kernel that missed its deadline is still running; its stream was %s and its "
                "%d buffers are left to aclrtResetDevice",
                self.device,
                "destroyed by force" if forced else "left too",
                len(retired.pointers),
            )
        self._device.reset_all()
        acl_release(self._api)


def _describe(release: Release, profile: Profile | None, chip: str | None) -> str:
    """The release part of the device's description (see :class:`AscendBackend`'s ``device``)."""
    if release.version is None:
        return "CANN release unknown"
    read = f"CANN {release.version} ({release.method})"
    if profile is None and chip is not None:
        return f"{read}: release unknown to moegrad"
    return read


def _check_opp_path(ascend_home_path: str | Path | None) -> None:
    """ASCEND_OPP_PATH must name a directory: opbase finds the operator's kernels through it.

    Raises:
        CannUnavailable: it is unset, empty or not a directory.
    """
    opp = os.environ.get("ASCEND_OPP_PATH", "")
    if opp and Path(opp).is_dir():
        return
    guess = None if ascend_home_path is None else Path(ascend_home_path) / "opp"
    suggestion = f" (for this install: export ASCEND_OPP_PATH={guess})" if guess is not None and guess.is_dir() else ""
    problem = "is not set" if not opp else f"={opp} is not a directory"
    raise CannUnavailable(
        f"ASCEND_OPP_PATH {problem}: CANN's operator library finds the kernels of "
        f"aclnnMoeInitRoutingV2Grad through it, so every call would fail (561107){suggestion}. "
        f"{SET_ENV_HINT}"
    )
