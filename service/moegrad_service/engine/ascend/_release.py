"""The CANN release of the package that ships the operator, which names the device's profile.

The bits of aclnnMoeInitRoutingV2Grad depend on the chip *and* on the release of the operator
package (moegrad.operator's profiles). CANN records each installed package's release in
``<home>/share/info/<package>/version.info``, on a line ``Version=9.1.0``; the operator ships in the
ops-transformer package, whose folder there is ``ops_transformer`` (hicann/ops-transformer,
``scripts/package/ops_transformer/scripts/opp_install.sh`` @ 048aca7e: ``OPP_PLATFORM_DIR`` is
``ops_transformer``, its install info goes to ``share/info/ops_transformer/`` and its version.info
sits one level above the installed ``script/``; ``docs/zh/install/compile.md`` @ 37b9e45d
uninstalls it from ``<install>/cann/share/info/ops_transformer/script``).

The runtime reads that file for ``aclError aclsysGetVersionStr(char *pkgName, char *versionStr)``
(hicann/runtime ``src/acl/aclrt_impl/acl.cpp`` @ 0252848d, ``aclsysGetVersionStrImpl``: the path
is ``realpath($ASCEND_HOME_PATH)/share/info/<pkgName>/version.info``, a name with ``_`` is retried
with ``-`` and the reverse, the value is what follows ``Version=`` on the first line holding it,
trimmed; a missing file or key is 100003 ACL_ERROR_INVALID_FILE). It is exported by
``libacl_rt.so`` from CANN 9.0; :func:`operator_release` asks it when it reads the operator's own
install, and reads the file itself otherwise (an older runtime, or ``$ASCEND_HOME_PATH`` naming
another install than the one the operator library was loaded from).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from moegrad_service.engine.ascend._abi import Cann, code_name

__all__ = ["OPERATOR_PACKAGE", "Release", "operator_release", "read_version_info"]

#: The package whose release is the operator's: its folder under ``<home>/share/info``.
OPERATOR_PACKAGE = "ops_transformer"
#: The key of the release in version.info (the runtime's ``kVersionInfoKey``).
VERSION_KEY = "Version="


@dataclass(frozen=True)
class Release:
    """The release of the operator's package, and how it was read.

    Attributes:
        version: the package's ``Version=`` value (``"9.1.0"``), or None when it could not be read.
        method: ``"aclsysGetVersionStr"`` or ``"version.info"`` when read; ``"none"`` otherwise.
        source: the details, for logs and messages: the runtime asked and the install, or the
            file read, or why no release could be read.
    """

    version: str | None
    method: str
    source: str


def read_version_info(home: Path, package: str = OPERATOR_PACKAGE) -> tuple[str | None, Path]:
    """The ``Version=`` value of ``<home>/share/info/<package>/version.info``, as the runtime reads it.

    The value follows ``Version=`` on the first line that holds it, trimmed. As the runtime does, a
    package name with ``_`` is retried with ``-`` (and the reverse) when its file does not exist.

    Returns:
        (version, path): the value (None when the file is missing or unreadable, or has no non-empty
        ``Version=``) and the file read (the first name's when neither exists).
    """
    names = [package]
    if "_" in package or "-" in package:
        names.append(package.replace("_", "-") if "_" in package else package.replace("-", "_"))
    paths = [home / "share" / "info" / name / "version.info" for name in names]
    path = next((candidate for candidate in paths if candidate.is_file()), paths[0])
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None, path
    for line in lines:
        at = line.find(VERSION_KEY)
        if at >= 0:
            return line[at + len(VERSION_KEY) :].strip() or None, path
    return None, path


def _operator_home(operator_library: str) -> Path | None:
    """The install an operator library came from: ``<home>`` of ``<home>/lib64/<library>``, else None."""
    path = Path(operator_library)
    if "/" in operator_library and path.parent.name == "lib64":
        return path.parent.parent
    return None


def _same_directory(one: Path, other: Path) -> bool:
    try:
        return one.resolve() == other.resolve()
    except OSError:
        return False


def operator_release(api: Cann, environ: Mapping[str, str] = os.environ) -> Release:
    """The release of the package whose operator library ``api`` loaded.

    - A custom package's ``libcust_opapi.so`` (``op_api/lib/``): unknown. It is built from some
      ops-transformer source, and the release of that source is recorded nowhere moegrad can read.
    - A built-in library loaded from ``<home>/lib64``: ``aclsysGetVersionStr("ops_transformer")``
      when the runtime exports it and ``$ASCEND_HOME_PATH`` is ``<home>`` (the function reads
      ``$ASCEND_HOME_PATH``'s file), else ``<home>/share/info/ops_transformer/version.info`` read here.
    - A built-in library found on the loader path (no directory known): the same, for
      ``$ASCEND_HOME_PATH``'s install (what ``set_env.sh`` puts on the loader path).

    Never raises: what could not be read is a Release with version None and the reason in ``source``.
    """
    library = api.operator_library
    if library.endswith("libcust_opapi.so"):
        package = Path(library).parent.parent.parent
        return Release(
            None,
            "none",
            f"the operator comes from the custom package {package}, built from an ops-transformer source whose "
            "release it does not record",
        )
    home = _operator_home(library)
    env_value = environ.get("ASCEND_HOME_PATH") or None
    env_home = None if env_value is None else Path(env_value)
    notes = []
    if env_home is not None and (home is None or _same_directory(home, env_home)):
        status, version = api.version_str(OPERATOR_PACKAGE)
        runtime = api.where.get("aclsysGetVersionStr")
        if version is not None:
            return Release(
                version,
                "aclsysGetVersionStr",
                f'aclsysGetVersionStr("{OPERATOR_PACKAGE}") of {runtime}, ASCEND_HOME_PATH={env_value}',
            )
        if status != -1:
            notes.append(f'aclsysGetVersionStr("{OPERATOR_PACKAGE}") answered {code_name(status)}')
    install = home or env_home
    if install is None:
        notes.append(f"the operator library {library} came from the loader path and ASCEND_HOME_PATH is not set")
        return Release(None, "none", "; ".join(notes))
    version, path = read_version_info(install)
    if version is not None:
        return Release(version, "version.info", str(path))
    notes.append(f"{path} is missing or has no {VERSION_KEY} line")
    return Release(None, "none", "; ".join(notes))
