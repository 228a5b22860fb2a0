"""The start-up log of numba's compiled kernels (moegrad_service.engine.compiling): loaded from a
warm on-disk cache, or compiled where it is cold, told by numba's own cache counters.

Oracle: numba's cache folder itself (empty: cold; after a run: its index file, so warm), in fresh
processes of support.tiny_kernels; the lines for the other outcomes by hand.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import moegrad
import moegrad_service.app
from moegrad import KernelCache
from moegrad_service.engine import ReferenceBackend
from moegrad_service.engine.compiling import outcome

TESTS = Path(__file__).resolve().parents[1]


def _start(cache_dir: Path) -> list[str]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    done = subprocess.run([sys.executable, "-m", "support.tiny_kernels"], cwd=TESTS, env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stdout.splitlines()


def test_an_empty_cache_folder_is_said_cold_and_the_next_start_loads_from_it(tmp_path):
    first = _start(tmp_path)
    assert first[0] == ("loading the tiny kernel from numba's cache, or compiling it if the cache is cold "
                        "(a second)")
    (folder,) = tmp_path.iterdir()
    assert any(folder.glob("tiny_kernels.add_one-*.nbi"))  # numba wrote its index: the next start is warm
    assert first[1].startswith("the tiny kernel is compiled (")
    assert first[1].endswith(f"numba's cache in {folder} was cold; it is saved there for the next start")
    second = _start(tmp_path)
    assert second[1].startswith(f"the tiny kernel is loaded from numba's cache in {folder} (")
    assert "cold" not in second[1] and "compiled" not in second[1]


@pytest.mark.parametrize(
    ("cache", "line"),
    [
        (KernelCache(0, 0, "/c"), "the kernel was already compiled in this process (1.5 s)"),
        (KernelCache(6, 0, "/c"), "the kernel is loaded from numba's cache in /c (1.5 s)"),
        (KernelCache(2, 3, "/c"), "the kernel is compiled (1.5 s): numba's cache in /c had part of it "
                                  "(2 functions loaded, 3 compiled); it is saved there for the next start"),
        (KernelCache(0, 3, None), "the kernel is compiled (1.5 s); numba has no writable cache folder, so every "
                                  "start compiles it: set NUMBA_CACHE_DIR to a writable folder that outlives the "
                                  "process"),
    ],
)
def test_each_outcome_s_line(cache, line):
    assert outcome("the kernel", cache, 1.46) == line


def _scripted(*caches: KernelCache):
    left = list(caches)
    return lambda: left.pop(0)


@pytest.mark.parametrize(
    ("before", "after", "said"),
    [
        (KernelCache(), KernelCache(6, 0, "/warm"), "the reference kernel is loaded from numba's cache in /warm ("),
        (KernelCache(), KernelCache(0, 9, "/cold"), "the reference kernel is compiled ("),
    ],
)
def test_the_reference_backend_says_what_numba_s_cache_gave_it(monkeypatch, caplog, before, after, said):
    monkeypatch.setattr(moegrad, "warm_up", lambda: True)
    monkeypatch.setattr(moegrad, "kernel_cache", _scripted(before, after))
    with caplog.at_level(logging.INFO, logger="moegrad_service.engine"):
        ReferenceBackend(warm_up=True).open_worker(0)
    start, end = caplog.messages
    assert "a cold numba cache" not in start and "compiling takes one to two minutes" in start
    assert end.startswith(said)
    assert ("was cold" in end) is (after.compiled > 0)


def test_without_numba_the_numpy_path_is_said(monkeypatch, caplog):
    monkeypatch.setattr(moegrad, "warm_up", lambda: False)
    with caplog.at_level(logging.INFO, logger="moegrad_service.engine"):
        ReferenceBackend(warm_up=True).open_worker(0)
    assert caplog.messages[-1] == "numba cannot be imported: the reference kernel runs on the NumPy path (nothing to compile)"


def test_the_comparison_s_warm_up_says_what_numba_s_cache_gave_it(monkeypatch, caplog):
    monkeypatch.setattr(moegrad_service.app, "warm_up_compare", lambda: True)
    monkeypatch.setattr(moegrad_service.app, "compare_cache", _scripted(KernelCache(), KernelCache(5, 0, "/c")))
    with caplog.at_level(logging.INFO, logger="moegrad_service"):
        moegrad_service.app._warm_up_compare()
    assert caplog.messages[-1].startswith("the accuracy comparison is loaded from numba's cache in /c (")


def test_the_real_kernel_s_counts_cover_every_dtype_of_both_kernels():
    moegrad.warm_up()
    cache = moegrad.kernel_cache()
    # warm_up calls run_rows and run_rows_950 once per dtype (float32, float16, bfloat16): 6 signatures at least,
    # each loaded or compiled once in this process
    assert cache.loaded + cache.compiled >= 6
    assert cache.folder is None or Path(cache.folder).is_dir()
