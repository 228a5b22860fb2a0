"""What the start-up log says of numba's compiled kernels: loaded from numba's on-disk cache (a warm
cache), or compiled in this process (a cold one), told apart by numba's own cache counters
(:class:`moegrad.KernelCache`) once the warm-up is done.

Used for the reference kernel (:class:`~moegrad_service.engine.reference.ReferenceBackend`, before
the service listens) and the accuracy comparison (:func:`moegrad_service.app.create_app`, in the
background).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from moegrad import KernelCache

__all__ = ["warm_up_logged"]


def outcome(what: str, cache: KernelCache, seconds: float) -> str:
    """The log line for ``what`` (e.g. "the reference kernel") once warmed up: what numba's cache
    gave it during the warm-up (``cache``, counted since it started) and how long it took."""
    took = f"{seconds:.1f} s"
    if cache.compiled == 0:
        if cache.loaded == 0:
            return f"{what} was already compiled in this process ({took})"
        return f"{what} is loaded from numba's cache in {cache.folder} ({took})"
    if cache.folder is None:
        return (
            f"{what} is compiled ({took}); numba has no writable cache folder, so every start compiles it: "
            "set NUMBA_CACHE_DIR to a writable folder that outlives the process"
        )
    cold = (
        "was cold"
        if cache.loaded == 0
        else f"had part of it ({cache.loaded} functions loaded, {cache.compiled} compiled)"
    )
    return f"{what} is compiled ({took}): numba's cache in {cache.folder} {cold}; it is saved there for the next start"


def warm_up_logged(
    log: logging.Logger,
    what: str,
    warm_up: Callable[[], bool],
    cache: Callable[[], KernelCache],
    *,
    waiting: str,
) -> None:
    """Run ``warm_up`` (:func:`moegrad.warm_up` or :func:`moegrad.accuracy.warm_up_compare`),
    saying before what it does and what waits on it (``waiting``), and after whether numba's cache
    was warm or cold (``cache``: :func:`moegrad.kernel_cache` or :func:`moegrad.accuracy.compare_cache`).
    """
    log.info("loading %s from numba's cache, or compiling it if the cache is cold (%s)", what, waiting)
    started, before = time.perf_counter(), cache()
    if not warm_up():
        log.info("numba cannot be imported: %s runs on the NumPy path (nothing to compile)", what)
        return
    log.info("%s", outcome(what, cache().since(before), time.perf_counter() - started))
