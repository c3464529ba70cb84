"""`carma report` read away from the checkout: definitions on the page, one CDF line per group of identical
runs, captions that stay unambiguous when a configuration's name holds a comma."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from carma.reports.page import write_report
from carma.reports.record import from_run_result
from carma.sim.experiment import RunConfig, simulate
from carma.traces.catalog import load_catalog
from carma.traces.loaders import Trace, load_trace

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def records():
    """Trace 1's first 20 tasks under MAGM and RR, and MAGM's run again under another name: the runs of a
    sweep that place tasks alike (its oracle MAGM, BF and LUG on trace 1) have the same times."""
    trace = load_trace("carma-t1", load_catalog())
    short = Trace("t1-20", trace.entries[:20])
    magm, rr = (from_run_result(simulate(short, RunConfig(p))) for p in ("magm", "rr"))
    return [magm, rr, replace(magm, label="LUG recovery only")]


def test_the_page_holds_its_definitions_and_links_nothing_outside_its_folder(records, tmp_path):
    """ "Definitions: docs/metrics.md" was a dead relative path from results/report/."""
    page = write_report(records, tmp_path / "report", ["a test"]).read_text()
    assert "docs/metrics.md" not in page
    for term in ("Makespan:", "Energy:", "OOM crashes:", "JCT (job completion time):", "Wait:", "p95"):
        assert term in page
    for target in re.findall(r'(?:src|href)="([^"]+)"', page):
        assert (tmp_path / "report" / target).is_file(), target


def test_identical_runs_share_one_cdf_line_named_together(records, tmp_path, monkeypatch):
    from carma.reports import plots

    assert plots._same_cdfs(records) == [[records[0], records[2]], [records[1]]]
    legends: list[list[str]] = []
    monkeypatch.setattr(plots, "_legend", lambda fig, handles, labels: legends.append(list(labels)))
    plots.plot_cdfs(records, tmp_path / "cdf.png")
    assert legends == [["“MAGM recovery only”, “LUG recovery only”", "RR recovery only"]]


def test_a_configuration_name_with_a_comma_is_quoted_in_captions(records, tmp_path):
    named = [replace(records[0], label="MAGM, tuned"), replace(records[1], label="RR")]
    page = write_report(named, tmp_path / "report", ["a test"]).read_text()
    assert "<p>“MAGM, tuned”, “RR”</p>" in page
