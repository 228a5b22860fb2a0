"""What moegrad's start-up log stands on in numba beyond its documented API: each dispatcher's
cache counters, ``Dispatcher.stats`` (numba/numba numba/core/dispatcher.py: a ``_CompileStats``
of ``cache_path``, ``cache_hits`` and ``cache_misses``, undocumented), which
:meth:`moegrad.numerics._fast.CompiledModule.cache` sums into :class:`moegrad.KernelCache`
(:data:`moegrad.numerics._fast.PRIVATE_MEMBERS` names them).

Shown on a live dispatcher: a signature loaded from the on-disk cache counts in ``cache_hits``,
one compiled counts in ``cache_misses`` (both keyed by signature), a cached kernel's
``cache_path`` is its cache folder and an uncached one's is None. pyproject.toml bounds numba to
the releases this file passed on; requirements.lock holds the exact one.

Oracle: numba itself (a kernel compiled in a fresh process, then loaded in another).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import numba.core.dispatcher
import pytest
from numba.extending import is_jitted

from moegrad.numerics._fast import PRIVATE_MEMBERS

TESTS = Path(__file__).resolve().parents[1]

_PROBE = """
import json, numpy as np
from support import tiny_kernels
from support.tiny_kernels import add_one, _double
add_one(np.arange(3.0))
print(json.dumps({name: {"path": kernel.stats.cache_path,
                         "hits": sum(kernel.stats.cache_hits.values()),
                         "misses": sum(kernel.stats.cache_misses.values()),
                         "counters": [type(kernel.stats.cache_hits).__name__, type(kernel.stats.cache_misses).__name__]}
                  for name, kernel in (("add_one", add_one), ("_double", _double))}))
"""


def _probe(cache_dir: Path) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    done = subprocess.run([sys.executable, "-c", _PROBE], cwd=TESTS, env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout)


@pytest.mark.parametrize(("owner", "name"), PRIVATE_MEMBERS)
def test_each_member_is_where_moegrad_reads_it(owner, name):
    module, _, cls = owner.rpartition(".")
    assert module == "numba.core.dispatcher"
    assert isinstance(getattr(getattr(numba.core.dispatcher, cls), name, None), property), f"{owner}.{name} is gone"


def test_a_dispatcher_counts_a_compile_as_a_miss_and_a_load_from_disk_as_a_hit(tmp_path):
    cold = _probe(tmp_path)
    assert cold["add_one"]["hits"] == 0 and cold["add_one"]["misses"] == 1
    folder = Path(cold["add_one"]["path"])
    assert folder.parent == tmp_path and any(folder.glob("tiny_kernels.add_one-*.nbi"))  # numba's index, on disk
    assert cold["_double"] == {"path": None, "hits": 0, "misses": 1, "counters": ["Counter", "Counter"]}
    warm = _probe(tmp_path)
    assert warm["add_one"] == {"path": str(folder), "hits": 1, "misses": 0, "counters": ["Counter", "Counter"]}
    assert warm["_double"]["hits"] == warm["_double"]["misses"] == 0  # inside add_one's cached code: never asked


def test_the_counters_are_counters_by_signature():
    from support.tiny_kernels import add_one

    assert is_jitted(add_one)
    stats = add_one.stats
    assert stats._fields == ("cache_path", "cache_hits", "cache_misses")
    assert isinstance(stats.cache_hits, collections.Counter) and isinstance(stats.cache_misses, collections.Counter)
