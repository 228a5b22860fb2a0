"""Which profile the device is: its chip (aclrtGetSocName) and the CANN release of its operator package.

The release is the ``Version=`` of ``<home>/share/info/ops_transformer/version.info`` (CANN's layout;
the runtime's ``aclsysGetVersionStr`` reads that file of ``$ASCEND_HOME_PATH``). The simulator's homes
record a release as CANN does; ``release_home`` (conftest) makes one of any release. The expected
names are written here from the profile naming rule ``"<chip>@<major>.<minor>"`` and the SoC
families (Ascend910B* = Atlas A2, Ascend910_93* = Atlas A3, Ascend950* = Ascend 950PR/950DT).
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest

from moegrad_service.engine.ascend import AscendBackend, operator_release
from moegrad_service.engine.ascend._abi import load
from moegrad_service.engine.ascend._release import read_version_info

#: SoC the simulator reports -> the chip part of the profile name.
SOCS = {"Ascend910B3": "ascend910b", "Ascend910_9391": "ascend910_93", "Ascend950PR": "ascend950"}
#: The version a package records -> the release part of the profile name.
VERSIONS = {"8.5.0": "8.5", "9.0.0": "9.0", "9.1.0": "9.1", "9.0.RC1": "9.0"}


@pytest.fixture
def open_backend(sim, monkeypatch):
    opened = []

    def make(home, soc="Ascend910B3"):
        monkeypatch.setenv("MOEGRAD_SIM_SOC_NAME", soc)
        opened.append(AscendBackend(ascend_home_path=home))
        return opened[-1]

    yield make
    for backend in opened:
        backend.close()


@pytest.mark.parametrize("soc", sorted(SOCS))
@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_each_chip_at_each_release_names_its_profile(open_backend, release_home, soc, version):
    backend = open_backend(release_home(version), soc)
    assert backend.order == f"{SOCS[soc]}@{VERSIONS[version]}"
    assert backend.profile is not None and backend.profile.name == backend.order
    assert backend.chip == SOCS[soc] and backend.release.version == version
    assert backend.release.method == "aclsysGetVersionStr"  # ASCEND_HOME_PATH is the operator's home
    assert backend.device == f"{soc} #0, CANN {version} (aclsysGetVersionStr)"


@pytest.mark.parametrize(("version", "suffix"), [
    ("10.0.0", "CANN 10.0.0 (aclsysGetVersionStr): release unknown to moegrad"),  # newer than every profile
    ("8.3.0", "CANN 8.3.0 (aclsysGetVersionStr): release unknown to moegrad"),    # older than every profile
    (None, "CANN release unknown"),                                                # no version.info at all
])
def test_an_unknown_release_is_served_unnamed(open_backend, release_home, version, suffix):
    backend = open_backend(release_home(version), "Ascend950PR")
    assert backend.chip == "ascend950"
    assert backend.profile is None and backend.order is None  # never another release's name
    assert backend.device == f"Ascend950PR #0, {suffix}"
    worker = backend.open_worker(0)  # and it still serves
    worker.close()


def test_the_file_is_read_when_ascend_home_path_is_another_install(open_backend, release_home, tmp_path,
                                                                   monkeypatch):
    home = release_home("9.0.0")
    other = tmp_path / "other"
    (other / "share" / "info" / "ops_transformer").mkdir(parents=True)
    (other / "share" / "info" / "ops_transformer" / "version.info").write_text("Version=9.1.0\n")
    monkeypatch.setenv("ASCEND_HOME_PATH", str(other))  # aclsysGetVersionStr would answer for that install
    backend = open_backend(home)
    assert backend.order == "ascend910b@9.0"
    assert backend.release.method == "version.info"
    assert backend.release.source == str(home / "share" / "info" / "ops_transformer" / "version.info")
    monkeypatch.delenv("ASCEND_HOME_PATH")
    assert open_backend(home).release.source == backend.release.source


def test_the_runtime_exports_aclsysGetVersionStr_with_its_prototype(sim, sim_home, release_home):
    api = load(sim_home)
    assert api.where["aclsysGetVersionStr"] == str(sim_home / "lib64" / "libascendcl.so")
    release_home("9.0.RC1")  # ASCEND_HOME_PATH names it
    assert api.version_str("ops_transformer") == (0, "9.0.RC1")
    assert api.version_str("ops-transformer") == (0, "9.0.RC1")  # the runtime retries '-' as '_'
    assert api.version_str("no_such_package") == (100003, None)  # ACL_ERROR_INVALID_FILE
    raw = ctypes.CDLL(str(sim_home / "lib64" / "libascendcl.so"))  # char *pkgName, char *versionStr[128]
    buffer = ctypes.create_string_buffer(128)
    assert raw.aclsysGetVersionStr(b"ops_transformer", buffer) == 0 and buffer.value == b"9.0.RC1"


def test_version_info_is_read_as_the_runtime_reads_it(tmp_path):
    info = tmp_path / "share" / "info" / "ops_transformer"
    info.mkdir(parents=True)
    (info / "version.info").write_text("version_dir=cann-9.1.0\r\n  Version= 9.1.0 \r\ntimestamp=20260528\r\n")
    assert read_version_info(tmp_path) == ("9.1.0", info / "version.info")
    (info / "version.info").write_text("Version=\n")
    assert read_version_info(tmp_path)[0] is None
    (info / "version.info").unlink()
    assert read_version_info(tmp_path)[0] is None
    dashed = tmp_path / "share" / "info" / "ops-transformer"
    dashed.mkdir()
    (dashed / "version.info").write_text("Version=8.5.0\n")  # the '-' spelling of the package name
    assert read_version_info(tmp_path) == ("8.5.0", dashed / "version.info")


def _api(library, status=-1, version=None):
    """A loaded runtime as operator_release sees it: the operator library and aclsysGetVersionStr."""
    return SimpleNamespace(operator_library=str(library), where={}, version_str=lambda package: (status, version))


def test_a_runtime_without_aclsysGetVersionStr_reads_the_operators_version_info(tmp_path):
    info = tmp_path / "share" / "info" / "ops_transformer"
    info.mkdir(parents=True)
    (info / "version.info").write_text("Version=8.5.0\n")
    release = operator_release(_api(tmp_path / "lib64" / "libopapi_transformer.so"),
                               {"ASCEND_HOME_PATH": str(tmp_path)})
    assert (release.version, release.method) == ("8.5.0", "version.info")
    failing = operator_release(_api(tmp_path / "lib64" / "libopapi.so", 100003), {"ASCEND_HOME_PATH": str(tmp_path)})
    assert failing.version == "8.5.0" and failing.method == "version.info"
    by_name = operator_release(_api("libopapi_transformer.so"), {})  # from the loader path, no ASCEND_HOME_PATH
    assert by_name.version is None and "loader path" in by_name.source
    custom = tmp_path / "opp" / "vendors" / "newer" / "op_api" / "lib" / "libcust_opapi.so"
    from_custom = operator_release(_api(custom, 0, "9.1.0"), {"ASCEND_HOME_PATH": str(tmp_path)})
    assert from_custom.version is None and str(tmp_path / "opp" / "vendors" / "newer") in from_custom.source
