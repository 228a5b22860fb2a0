"""The CANN simulator the ascend tests run against, built from tests/ascend/sim with the system C compiler.

CANN-like install trees are built under tests/ascend/_build/<source hash>/ (gitignored), each with
``lib64/`` (libascendcl.so and libnnopbase.so, plus the operator libraries below) and ``opp/`` (its
ASCEND_OPP_PATH):

- ``split``: libopapi.so *without* the operator and libopapi_transformer.so with it. The tests of
  this process use it (ASCEND_OPP_PATH is set to its ``opp/`` for the session).
- ``single``: libopapi.so *with* the operator (CANN before 8.3).
- ``both``: libopapi.so and libopapi_transformer.so both with the operator (CANN 8.3 to 8.5).
- ``transformer``: libopapi_transformer.so only (no aggregate libopapi.so).
- ``vendors``: libopapi.so with the operator, and custom packages under ``opp/vendors``: one without
  the operator (``aaa_other``, first in config.ini's load_priority) and one with it
  (``newer_transformer``), as users install newer ops-transformer builds.

Every home records the CANN release of its operator package as CANN does, in
``share/info/ops_transformer/version.info`` (``Version=`` :data:`DEFAULT_VERSION`); during a test
``ASCEND_HOME_PATH`` is the split layout's home, so the simulated runtime's ``aclsysGetVersionStr``
reads it too. :func:`release_home` makes a home of another release for one test.

A library loaded into a process stays there, so tests of the other layouts run in subprocesses.
Every library has a soname, so one loaded from a custom package finds the runtime already loaded.
Without a C compiler every test here is skipped, with that reason.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SIM_SOURCES = Path(__file__).parent / "sim"
BUILD_ROOT = Path(__file__).parent / "_build"
CFLAGS = ["-std=gnu11", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-ffp-contract=off",
          "-Wall", "-Wextra", "-pthread"]
#: The release every built home records (the newest of moegrad.operator._profiles.RELEASES).
DEFAULT_VERSION = "9.1.0"
#: Bumped when what _build writes besides the libraries changes, so that older builds are rebuilt.
BUILD_RECIPE = b"share/info/ops_transformer/version.info " + DEFAULT_VERSION.encode()
#: moegradSimCounts' output, in order (tests/ascend/sim/sim.h, SIM_COUNT_*).
COUNT_NAMES = ("allocations", "allocated_bytes", "tensors", "executors", "streams", "pending", "device_refs",
               "initialized", "violations", "reclaimed", "mallocs", "launches", "syncs", "context_errors",
               "streams_created", "phase_one", "queries", "forced", "blocked", "acl_refs")
#: The layouts and their operator libraries: file (relative to the home) -> simulator source.
LAYOUTS = {
    "split": {"lib64/libopapi.so": "opapi_stub.c", "lib64/libopapi_transformer.so": "opapi.c"},
    "single": {"lib64/libopapi.so": "opapi.c"},
    "both": {"lib64/libopapi.so": "opapi.c", "lib64/libopapi_transformer.so": "opapi.c"},
    "transformer": {"lib64/libopapi_transformer.so": "opapi.c"},
    "vendors": {"lib64/libopapi.so": "opapi.c",
                "opp/vendors/aaa_other/op_api/lib/libcust_opapi.so": "opapi_stub.c",
                "opp/vendors/newer_transformer/op_api/lib/libcust_opapi.so": "opapi.c"},
}


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(compiler: str, home: Path, libraries: dict[str, str]) -> None:
    """Build ``libraries`` (file relative to ``home`` -> its sources, space-separated) in order; the
    runtime ones come first."""
    lib64 = home / "lib64"
    for relative, source in libraries.items():
        target = home / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        link = ["-L", str(lib64), "-Wl,-rpath,$ORIGIN", f"-Wl,-soname,{target.name}"]
        needs = {"libascendcl.so": [], "libnnopbase.so": ["-lascendcl"]}.get(
            target.name, ["-lnnopbase", "-lascendcl", "-ldl"]
        )
        command = [compiler, *CFLAGS, "-o", str(target), *(str(SIM_SOURCES / name) for name in source.split()), *link,
                   *needs]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"building the CANN simulator failed:\n{' '.join(command)}\n{done.stderr}")
    (home / "opp").mkdir(exist_ok=True)
    write_version_info(home, DEFAULT_VERSION)


def write_version_info(home: Path, version: str | None) -> None:
    """``home``'s ops_transformer package records ``version`` (None: no version.info at all)."""
    info = home / "share" / "info" / "ops_transformer"
    info.mkdir(parents=True, exist_ok=True)
    if version is not None:
        (info / "version.info").write_text(f"Version={version}\n")


@pytest.fixture(scope="session")
def sim_homes() -> dict[str, Path]:
    """{layout: home} for every layout of :data:`LAYOUTS`: ASCEND_HOME_PATH-like trees of the simulator.

    Sets ASCEND_OPP_PATH to the split layout's ``opp/`` for the session (as set_env.sh would);
    ASCEND_HOME_PATH is set per test (:func:`_ascend_home`), so that no test outside this folder
    finds the simulator through it (``backend="auto"`` would).
    """
    compiler = _compiler()
    if compiler is None:
        pytest.skip("no C compiler (cc, gcc or clang) on PATH: the CANN simulator cannot be built")
    digest = hashlib.sha256(BUILD_RECIPE)
    for source in sorted(SIM_SOURCES.iterdir()):
        digest.update(source.name.encode() + source.read_bytes())
    root = BUILD_ROOT / digest.hexdigest()[:16]
    if not root.exists():
        staging = BUILD_ROOT / f"staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        base = {"lib64/libascendcl.so": "runtime.c sysinfo.c", "lib64/libnnopbase.so": "nnopbase.c"}
        for layout, libraries in LAYOUTS.items():
            _build(compiler, staging / layout, {**base, **libraries})
        config = staging / "vendors" / "opp" / "vendors" / "config.ini"
        config.write_text("load_priority=aaa_other,newer_transformer\n")
        try:
            staging.rename(root)  # atomic: a concurrent session either sees all of it or builds its own
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
        for stale in BUILD_ROOT.iterdir():  # builds of older sources
            if stale != root and not stale.name.startswith("staging-"):
                shutil.rmtree(stale, ignore_errors=True)
    homes = {layout: root / layout for layout in LAYOUTS}
    os.environ["ASCEND_OPP_PATH"] = str(homes["split"] / "opp")
    os.environ.pop("MOEGRAD_SIM_RELEASE", None)
    return homes


@pytest.fixture(scope="session")
def sim_home(sim_homes) -> Path:
    return sim_homes["split"]


class Sim:
    """The simulator's own test interface (moegradSim* in libascendcl.so)."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.lib = ctypes.CDLL(str(home / "lib64" / "libascendcl.so"), mode=ctypes.RTLD_GLOBAL)
        self.lib.moegradSimCounts.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int32]
        self.lib.moegradSimCounts.restype = ctypes.c_int32
        self.lib.moegradSimInjectFault.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64]
        self.lib.moegradSimInjectFault.restype = ctypes.c_int32
        self.lib.moegradSimClearFaults.argtypes = []
        self.lib.moegradSimClearFaults.restype = None
        self.lib.moegradSimReleaseHung.argtypes = []
        self.lib.moegradSimReleaseHung.restype = ctypes.c_int64
        self.lib.moegradSimHasContext.argtypes = []
        self.lib.moegradSimHasContext.restype = ctypes.c_int32

    def counts(self) -> dict[str, int]:
        out = (ctypes.c_int64 * len(COUNT_NAMES))()
        assert self.lib.moegradSimCounts(out, len(COUNT_NAMES)) == len(COUNT_NAMES)
        return dict(zip(COUNT_NAMES, out, strict=True))

    def inject(self, kind: str, nth: int = 1, arg: int = 0) -> None:
        """Make the ``nth`` next ``kind`` call fail (malloc, memcpy, launch, sync, health, tiling), or the
        ``nth`` next kernel hang for ``arg`` ms (kind ``hang``; -1: until :meth:`release_hung`)."""
        assert self.lib.moegradSimInjectFault(kind.encode(), nth, arg) == 0, kind

    def clear(self) -> None:
        self.lib.moegradSimClearFaults()
        self.lib.moegradSimReleaseHung()

    def release_hung(self) -> int:
        return self.lib.moegradSimReleaseHung()

    def has_context(self) -> bool:
        return bool(self.lib.moegradSimHasContext())


@pytest.fixture(scope="session")
def sim(sim_home) -> Sim:
    return Sim(sim_home)


@pytest.fixture(autouse=True)
def _ascend_home(request, monkeypatch):
    """ASCEND_HOME_PATH is the split layout's home during a test that uses the simulator (as
    set_env.sh would set it), and is restored after it."""
    if "sim_homes" in request.fixturenames:
        monkeypatch.setenv("ASCEND_HOME_PATH", str(request.getfixturevalue("sim_homes")["split"]))


@pytest.fixture(autouse=True)
def _clean_faults(request):
    """No fault armed by one test may fire in the next."""
    if "sim" not in request.fixturenames:
        yield
        return
    simulator = request.getfixturevalue("sim")
    simulator.clear()
    yield
    simulator.clear()


@pytest.fixture
def release_home(sim, sim_home, tmp_path, monkeypatch):
    """``make(version)``: a home whose operator package records CANN ``version``, made the process's.

    The home's ``lib64`` and ``opp`` are links to the split layout's (the libraries stay the ones
    loaded), its ``share/info/ops_transformer/version.info`` says ``Version=<version>`` (None: the
    file is missing). ASCEND_HOME_PATH is set to it, and MOEGRAD_SIM_RELEASE to ``version`` (empty
    for None) so that the simulated operator, loaded once per process, behaves as that release.
    """

    def make(version: str | None) -> Path:
        home = tmp_path / f"cann-{version}"
        home.mkdir()
        for name in ("lib64", "opp"):
            (home / name).symlink_to(sim_home / name, target_is_directory=True)
        write_version_info(home, version)
        monkeypatch.setenv("ASCEND_HOME_PATH", str(home))
        monkeypatch.setenv("MOEGRAD_SIM_RELEASE", version or "")
        return home

    return make


@pytest.fixture
def backend(sim, sim_home):
    """An AscendBackend over the simulator, closed after the test."""
    from moegrad_service.engine.ascend import AscendBackend

    opened = AscendBackend(device_id=0, ascend_home_path=sim_home)
    try:
        yield opened
    finally:
        opened.close()
