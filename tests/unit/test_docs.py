"""The documentation names what the code has: every setting in the README, every route in docs/protocol.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from moegrad_service.app import create_app
from moegrad_service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(Settings.model_fields))
def test_every_setting_is_in_the_readme_configuration_table(name):
    assert f"| `MOEGRAD_{name.upper()}` |" in (ROOT / "README.md").read_text()


def test_every_route_is_in_the_protocol_document():
    protocol = (ROOT / "docs" / "protocol.md").read_text().replace("[/versions/1]", "")
    app = create_app(Settings(backend="reference"))
    # v2 routes are documented for the one model they serve, the version segment shown as optional
    paths = {path.replace("{model_name}", "moe_init_routing_v2_grad").replace("/versions/{model_version}", "")
             for path in app.openapi()["paths"]}
    missing = sorted(path for path in paths if path not in protocol)
    assert not missing, f"routes not documented in docs/protocol.md: {missing}"


def test_readme_gives_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    assert "make serve" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
