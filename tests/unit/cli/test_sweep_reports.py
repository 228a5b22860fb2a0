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


@pytest.mark.parametrize("plots", ["none", None, "failing", "all"])
def test_every_case_gets_its_reports_and_a_plot_as_plots_says(cases, tmp_path, plots):
    pytest.importorskip("matplotlib")
    folder, expected = cases
    reports = tmp_path / "reports"
    flags = [] if plots is None else ["--plots", plots]
    assert main(["compare", "--local", "--cases", str(folder), "--no-progress", "--reports", str(reports),
                 *flags]) == 1
    drawn = {"none": set(), "failing": {"c1"}, "all": set(expected), None: set()}[plots]  # default: none
    assert {p.stem for p in reports.glob("*.png")} == drawn
    for name, status in expected.items():
        assert {p.suffix for p in reports.glob(f"{name}.*")} == {".md", ".json", ".csv"} | (
            {".png"} if name in drawn else set())
        assert accuracy.read_json_report(reports / f"{name}.json").verdict == status
        assert (reports / f"{name}.json").read_text().count("\n") == 1  # one line, the C encoder's
        markdown = (reports / f"{name}.md").read_text()
        if name in drawn:
            assert (reports / f"{name}.png").read_bytes()[:8] == PNG_SIGNATURE and f"]({name}.png)" in markdown
        else:
            assert ".png" not in markdown and f"Histogram skipped: not drawn: --plots {plots or 'none'}" in markdown


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
                           "--no-progress", "--reports", str(tmp_path / "r"), "--plots", "failing"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert {p.name for p in (tmp_path / "r").glob("*.png")} == {"c1.png"} and not done.stderr


def test_a_report_that_cannot_be_written_is_a_usage_error_naming_it(cases, tmp_path, capsys):
    folder, _ = cases
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "c2.json").mkdir()  # a folder where c2's JSON report goes: it cannot be written
    assert main(["compare", "--local", "--cases", str(folder), "--no-progress", "--reports", str(reports)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write --reports {reports}" in err and "c2.json" in err


class _Pool:
    """A stand-in for one plot worker: its tasks never finish."""

    def __init__(self):
        self.submitted = []

    def submit(self, *args):
        self.submitted.append(args)
        return _Pending()

    def shutdown(self, wait=True, cancel_futures=False):
        pass


class _Pending:
    def done(self):
        return False

    def result(self):
        return None


@pytest.mark.parametrize(("cpus", "shares"), [(1, [33]), (2, [17, 16]), (64, [16, 16, 1])])
def test_a_plot_worker_is_started_per_plots_per_worker_waiting_up_to_the_cpus(monkeypatch, tmp_path, cpus, shares):
    pytest.importorskip("matplotlib")
    from moegrad.cli import _reports

    pools = []
    monkeypatch.setattr(_reports, "_worker", lambda: (pools.append(_Pool()) or pools[-1], []))
    monkeypatch.setattr(_reports, "_cpus", lambda: cpus)
    call = oracle_call(seed=0, tokens=2, hidden=2)
    report = accuracy.compare(call, device_k2(call))
    reports = _reports.CaseReports(str(tmp_path / "r"), "all", None)
    assert len(pools) == 1  # --plots all: the first worker starts with the reports
    assert _reports.PLOTS_PER_WORKER == 16
    for i in range(33):
        reports.add(accuracy.CaseResult(f"c{i}", "pass", report, None, str(tmp_path / f"c{i}.npz")))
    # a second worker once 16 wait on the first, a third once 32 wait on two; each plot to the one with fewest
    assert [len(pool.submitted) for pool in pools] == shares
    reports.close()


@pytest.mark.parametrize(("held", "reads"), [(None, 0), (0, 4)])
def test_the_reports_use_the_inputs_the_sweep_read_within_held_bytes(cases, tmp_path, monkeypatch, held, reads):
    from moegrad.cli import _reports

    folder, expected = cases
    read = []
    monkeypatch.setattr(_reports, "load_case", lambda path: read.append(path) or accuracy.load_case(path))
    if held is not None:
        monkeypatch.setattr(_reports, "HELD_BYTES", held)  # nothing held: each case file is read again
    reports = tmp_path / "reports"
    assert main(["compare", "--local", "--cases", str(folder), "--no-progress", "--reports", str(reports)]) == 1
    assert len(read) == reads
    for name, status in expected.items():
        report = accuracy.read_json_report(reports / f"{name}.json")
        assert report.verdict == status and report.row_errors is not None and report.row_errors.rows == 8
