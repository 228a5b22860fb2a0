"""``compare --cases DIR --reports OUT --plots none|failing|all``: each case's report, its plot as asked.

Oracles: each case's status from tests/support/oracle.py (the device result of a K=2 float32 call is
one float32 add; a candidate scaled by 1 + 2^-12 fails); what each file is, by its format's own
signature (a PNG starts with the 8 bytes of the PNG specification, section 5.2) and the markdown's
link to it; the report's verdict read back from its JSON.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moegrad import accuracy
from moegrad.cli._main import main
from support.oracle import device_k2, float32_statuses, golden_and_scale, oracle_call, oracle_candidate

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def cases(tmp_path) -> tuple[Path, dict[str, str]]:
    """Four cases, one scaled by 1 + 2^-12 (it fails), the others the device's own result."""
    folder = tmp_path / "cases"
    folder.mkdir()
    expected = {}
    for i in range(4):
        call = oracle_call(seed=i, tokens=8, hidden=8)
        candidate = oracle_candidate("scaled_up" if i == 1 else "device", device_k2(call))
        accuracy.save_case(folder / f"c{i}.npz", grad_expanded_x=call.grad_expanded_x,
                           expanded_row_idx=call.expanded_row_idx, top_k=2, candidate=candidate)
        golden, scale = golden_and_scale(call)
        statuses = float32_statuses(candidate, device_k2(call), golden, scale)
        expected[f"c{i}"] = "fail" if any(s == "fail" for k, s in statuses.items() if k != "bitwise") else "pass"
    assert sorted(expected.values()) == ["fail", "pass", "pass", "pass"]
    return folder, expected


@pytest.mark.parametrize("plots", ["none", None, "all"])
def test_every_case_gets_its_reports_and_a_plot_as_plots_says(cases, tmp_path, plots):
    pytest.importorskip("matplotlib")
    folder, expected = cases
    reports = tmp_path / "reports"
    flags = [] if plots is None else ["--plots", plots]
    assert main(["compare", "--local", "--cases", str(folder), "--no-progress", "--reports", str(reports),
                 *flags]) == 1
    drawn = {"none": set(), "failing": {"c1"}, "all": set(expected), None: {"c1"}}[plots]  # default: failing
    assert {p.stem for p in reports.glob("*.png")} == drawn
    for name, status in expected.items():
        assert {p.suffix for p in reports.glob(f"{name}.*")} == {".md", ".json", ".csv"} | (
            {".png"} if name in drawn else set())
        assert accuracy.read_json_report(reports / f"{name}.json").verdict == status
        markdown = (reports / f"{name}.md").read_text()
        if name in drawn:
            assert (reports / f"{name}.png").read_bytes()[:8] == PNG_SIGNATURE and f"]({name}.png)" in markdown
        else:
            assert ".png" not in markdown and f"Histogram skipped: not drawn: --plots {plots or 'failing'}" in markdown


def test_plots_without_reports_is_a_usage_error(cases, capsys):
    folder, _ = cases
    assert main(["compare", "--local", "--cases", str(folder), "--plots", "all"]) == 2
    assert "--plots all needs --reports OUT" in capsys.readouterr().err
    assert not (folder / "summary.csv").exists()  # refused before any case was judged


def test_the_installed_command_draws_in_spawned_workers(cases, tmp_path):
    """``moegrad`` as a console script (its own ``__main__``, which the spawned workers import again)."""
    pytest.importorskip("matplotlib")
    folder, _ = cases
    done = subprocess.run([sys.executable, "-m", "moegrad", "compare", "--local", "--cases", str(folder),
                           "--no-progress", "--reports", str(tmp_path / "r")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1, done.stderr
    assert {p.name for p in (tmp_path / "r").glob("*.png")} == {"c1.png"} and not done.stderr
