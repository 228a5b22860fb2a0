"""``moegrad compare --html FILE`` read in a real headless browser (Debian's chromium).

The page is written by the command (one case, then a sweep), loaded by chromium over the DevTools
protocol (``support.browser``; the test setup installs the package when it is missing), and must:
load with no console error, exception or failed request; ask for nothing but itself and its
``data:`` images, which decode; hold no script; and show the numbers of the JSON report and the
explanation the same command wrote, and of the error map that ``support.row_oracle`` recomputes
element by element from docs/accuracy.md. The sweep's page lists the cases in the summary's order,
each differing case linking to a section of the same file.
"""

from __future__ import annotations

import csv
import json
import math
import re

import numpy as np
import pytest

from moegrad.accuracy import save_case
from moegrad.cli._main import main
from support import browser, planted
from support.row_oracle import scaled_map

# What the test reads off the page, by the DevTools protocol (the page has no script of its own).
PROBE = """JSON.stringify({
  scripts: document.scripts.length,
  images: [...document.images].map(i => [i.complete, i.naturalWidth, i.getAttribute('src').slice(0, 22)]),
  links: [...document.querySelectorAll('[href]')].map(a => a.getAttribute('href')),
  sources: [...document.querySelectorAll('[src]')].map(a => a.getAttribute('src').slice(0, 22)),
  ids: [...document.querySelectorAll('[id]')].map(e => e.id),
  sections: [...document.querySelectorAll('section')].map(s => ({
    id: s.id,
    title: s.querySelector('h2').textContent,
    fields: Object.fromEntries([...s.querySelectorAll('[data-field]')].map(c => [c.dataset.field, c.textContent])),
  })),
  cases: (() => {
    const heading = [...document.querySelectorAll('h2')].find(h => h.textContent.startsWith('Cases'));
    return heading ? [...heading.nextElementSibling.querySelectorAll('tbody tr')].map(r => r.cells[0].textContent) : [];
  })(),
  factors: [...document.querySelectorAll('p')].map(p => p.textContent).filter(t => t.startsWith('which factor')),
})"""


@pytest.fixture(scope="module")
def chromium() -> str:
    found, why = browser.find_chromium()
    if found is None:
        pytest.skip(why)
    return found


def number(text: str) -> float | int | None:
    if text == "-":
        return None
    value = float(text)
    return int(value) if re.fullmatch(r"-?\d+", text) else value


def equal(shown: float | int | None, want) -> bool:
    if isinstance(want, str):  # the JSON's words for non-finite floats
        want = float(want)
    if want is None or shown is None:
        return shown is want
    return (math.isnan(want) and math.isnan(shown)) or shown == want


def check_loaded(loaded: browser.Loaded) -> dict:
    page = json.loads(loaded.value)
    assert loaded.errors == [] and loaded.failed == []
    assert all(url.startswith(("file:", "data:image/png;base64,")) for url in loaded.requests), loaded.requests
    assert page["scripts"] == 0
    assert page["images"] and all(complete and width > 0 and src == "data:image/png;base64,"
                                  for complete, width, src in page["images"])
    assert all(link.startswith("#") and link[1:] in page["ids"] for link in page["links"])
    return page


def check_section(fields: dict[str, str], report: dict, explanation: dict | None) -> None:
    """Every number the section shows against the JSON report (and explanation) the command wrote."""
    rows = report["row_errors"]
    for key in ("rows", "differing", "failing", "device_failing", "outside_bound", "nonfinite", "device_nonfinite"):
        assert equal(number(fields[f"row_errors.{key}"]), rows[key]), key
    for side in ("relative_error", "device_relative_error", "ulp_error", "device_ulp_error"):
        for key in ("rows", "p50", "p90", "p99", "max", "max_row"):
            assert equal(number(fields[f"row_errors.{side}.{key}"]), rows[side][key]), (side, key)
    for label, count in report["explained"].items():
        assert number(fields[f"explained.{label}"]) == count
    shown_rows = {int(k.split(".")[1]) for k in fields if k.startswith("worst.")}
    assert shown_rows
    given = {row["row"]: row for row in (explanation or {"rows": []})["rows"]}
    for row in shown_rows:
        if row in given:
            assert fields[f"worst.{row}.label"] == given[row]["label"]
            assert equal(number(fields[f"worst.{row}.slot"]), given[row]["slot"])
            assert equal(number(fields[f"worst.{row}.source_row"]), given[row]["source_row"])
    for label in ("missing", "duplicated", "replaced", "extra", "nonfinite"):
        per_slot = [row["slot"] for row in given.values() if row["label"] == label]
        for t in range(64):
            key = f"slots.{label}.{t}"
            if key in fields:
                assert number(fields[key]) == per_slot.count(t)


def check_map(fields: dict[str, str], case) -> None:
    _, _, cells = scaled_map(case.grad, case.index, case.top_k, case.drop_pad_mode, case.candidate)
    for i, line in enumerate(cells):
        for j, want in enumerate(line):
            shown = number(fields[f"map.{i}.{j}"])
            assert equal(shown, want) or shown == pytest.approx(want, rel=1e-12), (i, j, shown, want)


def npy_args(tmp_path, case) -> list[str]:
    for name, array in (("x", case.grad), ("idx", case.index), ("candidate", case.candidate)):
        np.save(tmp_path / f"{name}.npy", array)
    return ["--grad-expanded-x", str(tmp_path / "x.npy"), "--expanded-row-idx", str(tmp_path / "idx.npy"),
            "--top-k", str(case.top_k), "--candidate", str(tmp_path / "candidate.npy"),
            "--drop-pad-mode", str(case.drop_pad_mode), "--active-num", str(case.active_num), "--order", case.profile]


@pytest.mark.parametrize("entry", [("drop_pad", planted.F32, 3, 7, "nan_input", "ascend910b@9.1"),
                                   ("dropless", planted.F32, 8, 7, "drop", "ascend950@9.1")],
                         ids=["drop_pad-nan", "dropless-drop"])
def test_one_case_page_loads_clean_and_shows_the_json_numbers(tmp_path, capsys, chromium, entry):
    case = planted.build(*entry)
    page_path, report_path = tmp_path / "page.html", tmp_path / "r.json"
    code = main(["compare", "--local", *npy_args(tmp_path, case), "--html", str(page_path),
                 "--report-json", str(report_path), "--no-profiles"])
    assert code == 1 and f"wrote {page_path}" in capsys.readouterr().out
    report = json.loads(report_path.read_text())
    explanation = json.loads((tmp_path / "r.explain.json").read_text())  # --html explains, as --explain
    page = check_loaded(browser.load(chromium, page_path, PROBE))
    (section,) = page["sections"]
    check_section(section["fields"], report, explanation)
    check_map(section["fields"], case)
    if case.drop_pad_mode:  # the map is per expert x capacity row
        assert "per expert x capacity row" in page_path.read_text()


def test_a_sweep_page_lists_the_cases_worst_first_each_linking_to_its_section(tmp_path, capsys, chromium):
    cases = tmp_path / "cases"
    cases.mkdir()
    built = {}
    for name, entry in {"a-drop": ("dropless", planted.F32, 4, 7, "drop", "ascend910b@9.1"),
                        "b-order": ("dropless", planted.F32, 4, 7, "sequential", "ascend910b@9.1"),
                        "c-extra": ("drop_pad", planted.F32, 3, 7, "extra_last", "ascend910b@9.1")}.items():
        case = built[name] = planted.build(*entry)
        save_case(cases / f"{name}.npz", grad_expanded_x=case.grad, expanded_row_idx=case.index, top_k=case.top_k,
                  drop_pad_mode=case.drop_pad_mode, active_num=case.active_num, order=case.profile,
                  candidate=case.candidate)
    save_case(cases / "d-device.npz", grad_expanded_x=built["a-drop"].grad, expanded_row_idx=built["a-drop"].index,
              top_k=4, order="ascend910b@9.1", candidate=built["a-drop"].device)
    page_path, reports = tmp_path / "sweep.html", tmp_path / "reports"
    code = main(["compare", "--local", "--cases", str(cases), "--html", str(page_path), "--reports", str(reports)])
    assert code == 1 and f"wrote {page_path}" in capsys.readouterr().out
    page = check_loaded(browser.load(chromium, page_path, PROBE))
    with open(cases / "summary.csv", encoding="utf-8-sig", newline="") as file:
        order = [row["API Name"] for row in csv.DictReader(file)]
    assert page["cases"] == order  # worst first, as the summary
    assert page["factors"] and page["factors"][0].startswith("which factor makes cases fail")
    sections = {section["title"].split(":")[0]: section for section in page["sections"]}
    assert set(sections) == {"a-drop", "b-order", "c-extra"}  # the device's own bits need no section
    assert {link[1:] for link in page["links"]} == {section["id"] for section in page["sections"]}
    for name, section in sections.items():
        report = json.loads((reports / f"{name}.json").read_text())
        fields = section["fields"]
        for key in ("rows", "differing", "failing", "outside_bound"):
            assert number(fields[f"row_errors.{key}"]) == report["row_errors"][key]
        check_map(fields, built[name])
    assert number(sections["a-drop"]["fields"]["explained.missing"]) == len(built["a-drop"].planted)
