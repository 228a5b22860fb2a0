"""The public surface of ``moegrad``: a deliberate, sorted, complete ``__all__``; a light import.

The layering rule: ``moegrad`` never imports ``moegrad_service`` (nor the service's web stack), so
a host that only installs the client never loads FastAPI or Starlette.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types

import moegrad

SERVICE_ONLY = ("fastapi", "starlette", "moegrad_service", "uvicorn", "pydantic_settings", "prometheus_client")


def isort_key(name: str) -> tuple[int, str]:
    """CONSTANTS, then Classes, then functions and dunders; each group in code-point order."""
    if name.isupper():
        return 0, name
    if name[0].isupper():
        return 1, name
    return 2, name


def test_all_is_sorted():
    assert moegrad.__all__ == sorted(moegrad.__all__, key=isort_key)
    assert len(set(moegrad.__all__)) == len(moegrad.__all__)


def test_all_is_complete():
    public = {
        name for name, value in vars(moegrad).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public | {"__version__"} == set(moegrad.__all__)


def test_every_exported_name_exists():
    for name in moegrad.__all__:
        assert hasattr(moegrad, name), name


def test_the_core_names_are_exported():
    core = {
        "DTYPES", "GRAD_DTYPES", "ORDERS", "AclnnStatus", "InvalidArgument", "MalformedRequest",
        "MoeInitRoutingV2GradCall", "MoegradError", "PayloadTooLarge", "decode_body", "decode_tensor",
        "dtype_name", "encode_body", "encode_tensor", "moe_init_routing_v2_grad", "moe_init_routing_v2_grad_golden",
    }
    assert core <= set(moegrad.__all__)
    assert {"PROFILES", "Profile", "resolve_profile"} <= set(moegrad.__all__)
    # every device profile (3 chips x CANN 8.5, 9.0, 9.1, and Huawei's golden), then the aliases
    assert moegrad.ORDERS == (
        "ascend910b@8.5", "ascend910b@9.0", "ascend910b@9.1", "ascend910_93@8.5", "ascend910_93@9.0",
        "ascend910_93@9.1", "ascend950@8.5", "ascend950@9.0", "ascend950@9.1", "sequential",
        "ascend910b", "ascend910_93", "ascend950", "ascend950@2025-12",
    )
    assert moegrad.GRAD_DTYPES == ("float16", "bfloat16", "float32")


def test_importing_moegrad_does_not_load_the_service_stack():
    code = "import json, sys, moegrad; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = json.loads(result.stdout)
    offending = sorted(m for m in loaded if m.split(".")[0] in SERVICE_ONLY)
    assert not offending, f"import moegrad loaded {offending}"
    assert "moegrad" in loaded
