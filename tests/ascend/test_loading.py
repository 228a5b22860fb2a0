"""Finding and loading CANN: lazy import, search order, the older single-library layout, clear errors.

A shared library stays loaded for the life of a process, so the layouts other than the one the rest
of the tests use are exercised in subprocesses (with LD_LIBRARY_PATH cleared, so nothing on this
machine can stand in for what is missing).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from moegrad import DeviceFault
from moegrad_service.engine import open_backend
from moegrad_service.engine.ascend import AscendBackend, ascend_available
from moegrad_service.settings import Settings


def run_python(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON document, returned here."""
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "ASCEND_HOME_PATH")
             and not k.startswith(("MOEGRAD_", "ASCEND_"))}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**clean, **env}, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_loads_nothing_and_the_single_library_layout_works(sim_homes, tmp_path):
    # The operator in libopapi.so (no libopapi_transformer.so); a fault armed through the environment.
    result = run_python(f"""
        import json, numpy as np
        import moegrad_service.engine.ascend as ascend
        def loaded():
            names = ("libascendcl.so", "libacl_rt.so", "libnnopbase.so", "libopapi.so", "libopapi_transformer.so")
            with open("/proc/self/maps") as maps:
                return sorted({{line.split()[-1] for line in maps if line.rstrip().endswith(names)}})
        out = {{"after_import": loaded()}}
        out["available_empty"] = ascend.ascend_available({str(tmp_path)!r})
        try:
            ascend.AscendBackend(ascend_home_path={str(tmp_path)!r})
        except ascend.CannUnavailable as exc:
            out["missing"] = str(exc)
        out["after_failed_load"] = loaded()
        from moegrad import MoeInitRoutingV2GradCall, DeviceFault
        backend = ascend.AscendBackend(ascend_home_path={str(sim_homes["single"])!r})
        out["op_from"] = backend._api.where["aclnnMoeInitRoutingV2Grad"]
        out["after_open"] = loaded()
        worker = backend.open_worker(0)
        call = MoeInitRoutingV2GradCall(grad_expanded_x=np.array([[0.1, 0.1], [0.3, 0.3], [0.2, 0.2], [0.4, 0.4]],
                                        np.float32), expanded_row_idx=np.array([2, 0, 1, 3], np.int32), top_k=2)
        outcomes = []
        for _ in range(3):
            try:
                outcomes.append(worker.run(call, timeout_s=None).view(np.uint32).tolist())
            except DeviceFault as exc:
                outcomes.append(exc.device_message)
        out["outcomes"] = outcomes
        worker.close()
        backend.close()
        print(json.dumps(out))
    """, MOEGRAD_SIM_FAULTS="launch@2", ASCEND_OPP_PATH=str(sim_homes["single"] / "opp"))
    assert result["after_import"] == [] and result["after_failed_load"] == []
    assert result["available_empty"] is False
    assert "libascendcl.so" in result["missing"] and "set_env.sh" in result["missing"]
    assert str(tmp_path / "lib64" / "libascendcl.so") in result["missing"]  # ascend_home_path/lib64 first
    assert "loader path" in result["missing"]                               # then the loader's path
    single = sim_homes["single"] / "lib64"
    assert result["after_open"] == sorted(str(single / name) for name in ("libascendcl.so", "libnnopbase.so",
                                                                          "libopapi.so"))
    assert result["op_from"] == str(single / "libopapi.so")
    bits_03, bits_07 = 1050253722, 1060320052  # float32 0.3 and 0.70000005
    assert result["outcomes"][0] == result["outcomes"][2] == [[bits_03, bits_03], [bits_07, bits_07]]
    assert "injected kernel launch failure (launch #2)" in result["outcomes"][1]


def test_an_incomplete_cann_names_the_missing_operator(sim_homes, tmp_path):
    lib64 = tmp_path / "lib64"
    lib64.mkdir()
    for name in ("libascendcl.so", "libnnopbase.so", "libopapi.so"):  # the split layout without the transformer
        shutil.copy(sim_homes["split"] / "lib64" / name, lib64 / name)
    result = run_python(f"""
        import json
        import moegrad_service.engine.ascend as ascend
        try:
            ascend.AscendBackend(ascend_home_path={str(tmp_path)!r})
        except ascend.CannUnavailable as exc:
            print(json.dumps({{"error": str(exc), "is_device_fault": isinstance(exc, ascend.DeviceFault)}}))
    """)
    assert "aclnnMoeInitRoutingV2GradGetWorkspaceSize is not exported" in result["error"]
    assert "set_env.sh" in result["error"] and result["is_device_fault"] is True


def test_the_split_layout_takes_the_operator_from_libopapi_transformer(backend, sim_home):
    assert backend._api.where["aclnnMoeInitRoutingV2Grad"] == str(sim_home / "lib64" / "libopapi_transformer.so")
    assert backend._api.where["aclCreateTensor"] == str(sim_home / "lib64" / "libnnopbase.so")


def test_ascend_available_needs_a_device(sim, sim_home, monkeypatch):
    assert ascend_available(sim_home) is True
    monkeypatch.setenv("MOEGRAD_SIM_DEVICE_COUNT", "0")
    assert ascend_available(sim_home) is False


def test_an_unknown_soc_is_described_but_no_order_is_claimed(sim, sim_home, monkeypatch):
    monkeypatch.setenv("MOEGRAD_SIM_SOC_NAME", "Ascend310P3")
    backend = AscendBackend(ascend_home_path=sim_home)
    try:
        assert backend.device == "Ascend310P3 #0, CANN 9.1.0 (aclsysGetVersionStr)"
        assert backend.chip is None and backend.profile is None and backend.order is None
    finally:
        backend.close()


def test_open_backend_names_ascend_and_auto(sim, sim_home, tmp_path):
    chosen = open_backend(Settings(backend="ascend", ascend_home_path=sim_home))
    try:
        assert isinstance(chosen, AscendBackend)
    finally:
        chosen.close()
    chosen = open_backend(Settings(backend="auto", ascend_home_path=sim_home))
    try:
        assert chosen.name == "ascend"
    finally:
        chosen.close()
    with pytest.raises(DeviceFault, match="NPU 5 is not visible"):
        open_backend(Settings(backend="ascend", ascend_home_path=sim_home, device_id=5))
    counts = sim.counts()
    assert counts["initialized"] == counts["device_refs"] == counts["allocations"] == 0


#: Where each layout's operator must come from (conftest.LAYOUTS): custom packages first, then the
#: per-repository libopapi_transformer.so, then the aggregate libopapi.so.
OPERATOR_FROM = {
    "split": "lib64/libopapi_transformer.so",
    "single": "lib64/libopapi.so",
    "both": "lib64/libopapi_transformer.so",
    "transformer": "lib64/libopapi_transformer.so",
    "vendors": "opp/vendors/newer_transformer/op_api/lib/libcust_opapi.so",
}


@pytest.mark.parametrize("layout", sorted(OPERATOR_FROM))
def test_each_layout_loads_exactly_one_operator_library(sim_homes, layout):
    home = sim_homes[layout]
    result = run_python(f"""
        import ctypes, json, numpy as np
        import moegrad_service.engine.ascend as ascend
        from moegrad import MoeInitRoutingV2GradCall
        backend = ascend.AscendBackend(ascend_home_path={str(home)!r})
        names = ("libopapi.so", "libopapi_transformer.so", "libcust_opapi.so")
        with open("/proc/self/maps") as maps:
            mapped = sorted({{line.split()[-1] for line in maps if line.rstrip().endswith(names)}})
        worker = backend.open_worker(0)
        call = MoeInitRoutingV2GradCall(grad_expanded_x=np.array([[0.1, 0.1], [0.3, 0.3], [0.2, 0.2], [0.4, 0.4]],
                                        np.float32), expanded_row_idx=np.array([2, 0, 1, 3], np.int32), top_k=2)
        bits = worker.run(call, timeout_s=None).view(np.uint32).tolist()
        worker.close()
        backend.close()
        print(json.dumps({{"mapped": mapped, "op_from": backend._api.where["aclnnMoeInitRoutingV2Grad"],
                          "global": hasattr(ctypes.CDLL(None), "aclnnMoeInitRoutingV2Grad"), "bits": bits,
                          "order": backend.order, "release": backend.release.source}}))
    """, ASCEND_OPP_PATH=str(home / "opp"))
    expected = str(home / OPERATOR_FROM[layout])
    assert result["op_from"] == expected
    assert result["mapped"] == [expected]       # one operator library in the process, never two
    assert result["global"] is False            # loaded RTLD_LOCAL: its symbols do not leak into the process
    bits_03, bits_07 = 1050253722, 1060320052   # float32 0.3 and 0.70000005
    assert result["bits"] == [[bits_03, bits_03], [bits_07, bits_07]]
    if layout == "vendors":  # a custom package records no release: its results are never named
        assert result["order"] is None and "custom package" in result["release"]
    else:  # no ASCEND_HOME_PATH here: the release is read from the operator's home, 9.1.0 (conftest)
        assert result["order"] == "ascend910b@9.1"
        assert result["release"] == str(home / "share" / "info" / "ops_transformer" / "version.info")


def test_the_search_order_of_operator_libraries(sim_homes, tmp_path):
    from moegrad_service.engine.ascend._abi import operator_candidates

    home = sim_homes["vendors"]
    custom = tmp_path / "custom"
    (custom / "op_api" / "lib").mkdir(parents=True)
    (custom / "op_api" / "lib" / "libcust_opapi.so").touch()
    got = operator_candidates(home, {"ASCEND_OPP_PATH": str(home / "opp"), "ASCEND_CUSTOM_OPP_PATH": str(custom)})
    vendors = home / "opp" / "vendors"
    assert got == [str(custom / "op_api" / "lib" / "libcust_opapi.so"),
                   str(vendors / "aaa_other" / "op_api" / "lib" / "libcust_opapi.so"),
                   str(vendors / "newer_transformer" / "op_api" / "lib" / "libcust_opapi.so"),
                   "libopapi_transformer.so",
                   str(home / "lib64" / "libopapi.so"), "libopapi.so"]
