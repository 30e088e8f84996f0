"""A run's traces read rank by rank (analysis.analyzers.rank_traces): the report's tables equal the analyzers' on the
stacked table of every rank, each rank's events are dropped before the next file is read, worker processes give the
same report as one process, a bar shows progress on a terminal only, and a run of many ranks reads as distributions."""
from __future__ import annotations

import gc
import gzip
import io
import json
import re
import statistics
import weakref
from pathlib import Path

import pytest

from analysis.__main__ import main
from analysis.analyzers import rank_traces as rt
from analysis.analyzers import trace_analysis as ta
from analysis.analyzers.arrivals import collective_arrivals
from analysis.analyzers.breakdown import exposed_by_collective, stragglers, time_breakdown
from analysis.analyzers.collective_calls import collective_bandwidth, collective_calls
from analysis.analyzers.distributions import PER_RANK_ROWS_MAX
from analysis.parsers.kineto import parse_kineto_ranks
from analysis.report import build_report
from analysis.table import Table
from tests.unit.report_support import GLOO, HTA
from tests.unit.test_kineto import _modern_trace


def _copies(sources: list[Path], folder: Path, ranks: int) -> list[Path]:
    """`ranks` trace files in `folder`, rank r a copy of sources[r % len(sources)] that states rank r."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = [json.loads(gzip.decompress(s.read_bytes())) for s in sources]
    out = []
    for rank in range(ranks):
        doc = docs[rank % len(docs)]
        doc["distributedInfo"] = {**doc["distributedInfo"], "rank": rank, "world_size": ranks}
        out.append(folder / f"trace_rank{rank}.json")
        out[-1].write_text(json.dumps(doc))
    return out


def _rows(t: Table) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "source"} for r in t.rows()]


@pytest.mark.parametrize("files", [HTA, GLOO], ids=["hta_gpu", "gloo_cpu"])
def test_the_report_tables_equal_the_stacked_tables(files):
    traces = rt.read_traces(files, jobs=1)
    whole = parse_kineto_ranks(files)
    assert traces.meta == whole.meta and traces.warnings == whole.warnings and len(traces) == len(whole)
    assert _rows(traces.breakdown()) == _rows(time_breakdown(whole))
    assert _rows(traces.exposed()) == _rows(exposed_by_collective(whole))
    assert list(traces.stragglers(threshold_pct=10).rows()) == list(stragglers(whole, threshold_pct=10).rows())
    kinds = traces.kernel_types()
    assert (kinds is None and files == GLOO) or _rows(kinds) == _rows(ta.kernel_type_breakdown(whole))
    calls = collective_calls(whole)
    assert traces.window_steps() == ta.window_steps(whole)
    got = _rows(traces.bandwidth(None, no_ceiling_reason="none"))
    want = _rows(collective_bandwidth(calls, ta.window_steps(whole), None, no_ceiling_reason="none"))
    for g, w in zip(got, want, strict=True):  # the same sums, added up rank by rank
        assert g.keys() == w.keys()
        for k in g:
            assert g[k] == (pytest.approx(w[k], rel=1e-12) if isinstance(w[k], float) else w[k]), k
    assert [_rows(t) for t in traces.arrivals()] == [_rows(t) for t in collective_arrivals(calls,
                                                                                          ta.window_steps(whole))]


def test_a_rank_with_one_step_is_scoped_as_its_job(tmp_path):
    """HTA's step filter applies when the job shows two ProfilerStep names; a rank that alone shows one is
    summarised again with the job's."""
    full = _modern_trace(0, world=2)
    one = _modern_trace(1, world=2)
    one["traceEvents"] = [e for e in one["traceEvents"] if e.get("name") not in ("ProfilerStep#8", "ProfilerStep#9")]
    paths = []
    for rank, doc in enumerate((full, one)):
        doc["distributedInfo"] = {"rank": rank, "world_size": 2}
        paths.append(tmp_path / f"r{rank}.json")
        paths[-1].write_text(json.dumps(doc))
    alone = rt.read_traces(paths[1:], jobs=1).breakdown()
    together = rt.read_traces(paths, jobs=1).breakdown()
    assert _rows(together) == _rows(time_breakdown(parse_kineto_ranks(paths)))
    assert _rows(together)[1] != _rows(alone)[0]  # the filter changed rank 1's numbers


def test_a_rank_read_from_two_files_is_pooled_as_before(tmp_path):
    paths = _copies(GLOO, tmp_path, 2)
    twice = tmp_path / "trace_rank0_again.json"
    twice.write_text(paths[0].read_text())
    files = [*paths, twice]
    traces = rt.read_traces(files, jobs=1)
    whole = parse_kineto_ranks(files)
    assert any("rank 0 was already read" in w for w in traces.warnings)
    assert _rows(traces.breakdown()) == _rows(time_breakdown(whole)) and len(traces) == len(whole)


def test_each_rank_is_dropped_before_the_next_is_read(tmp_path, monkeypatch):
    files = _copies(HTA, tmp_path, 4)
    tables: list[weakref.ref] = []

    def parse(files):
        gc.collect()
        assert all(t() is None for t in tables), "an earlier rank's table is still alive"
        t = parse_kineto_ranks(files)
        tables.append(weakref.ref(t))
        return t

    monkeypatch.setattr(rt, "parse_kineto_ranks", parse)
    traces = rt.read_traces(files, jobs=1)
    assert len(tables) == 4 and len(traces.breakdown()) == 4


def _reports(folder: Path, out: Path, *extra: str) -> str:
    assert main(["report", str(folder), "-o", str(out), *extra]) == 0
    return out.read_text().replace(out.stem + "_plots", "PLOTS")


def test_workers_write_the_same_report_as_one_process(tmp_path):
    _copies(HTA, tmp_path / "job", 4)
    serial = _reports(tmp_path / "job", tmp_path / "serial.md", "--jobs", "1")
    parallel = _reports(tmp_path / "job", tmp_path / "parallel.md", "--jobs", "2")
    assert serial == parallel and "### Where each collective waited" in serial


@pytest.mark.parametrize("bad", ["0", "two", "-1", ""])
def test_jobs_must_be_a_whole_number(tmp_path, capsys, bad):
    assert main(["doctor", str(GLOO[0]), "--jobs", bad]) == 2
    assert "--jobs" in capsys.readouterr().err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_bar_on_a_terminal_only(tmp_path, monkeypatch, capsys, terminal):
    _copies(GLOO, tmp_path / "job", 3)
    err = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    assert main(["doctor", str(tmp_path / "job"), "--jobs", "1"]) == 0
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", err.getvalue())  # rich's colours and cursor moves
    # rich's bar: the run's label, the ranks read of its three, and the bar left standing when it ends
    assert ("job" in shown and "3/3 ranks" in shown and "━" in shown and shown.endswith("\n")) == terminal
    assert ("ranks" in shown) == terminal


def test_many_ranks_read_as_distributions(tmp_path):
    """A run of more than PER_RANK_ROWS_MAX ranks reads as its distributions alone; smaller runs of several ranks have
    their row per run too, and every rank's row in the appendix (test_a_few_ranks_fold_into_the_appendix)."""
    ranks = PER_RANK_ROWS_MAX + 2
    _copies(GLOO, tmp_path / "job", ranks)
    (r,) = build_report([(None, tmp_path / "job")], jobs=2).runs
    assert len(r.breakdown) == ranks
    assert {"breakdown", "exposed", "stragglers", "rank_arrivals"} <= r.distributions.keys()
    idle = {d["quantity"]: d for d in r.distributions["breakdown"].rows()}["idle_pct"]
    values = sorted(b["idle_pct"] for b in r.breakdown.rows())
    assert (idle["ranks"], idle["min"], idle["max"]) == (ranks, values[0], values[-1])
    assert [v for _, v in idle["worst"]] == values[::-1][:3]
    out = tmp_path / "r.md"
    assert main(["report", str(tmp_path / "job"), "-o", str(out), "--jobs", "2"]) == 0
    md = out.read_text()
    assert "A row per run of several ranks: each quantity's median over its ranks" in md
    assert f"| job | {ranks - 1} | cpu_ops |" not in md  # no row per rank, not even in the appendix
    # the run's one row: idle % as its median (range; the rank furthest on the bad side), the files as one pattern
    row = next(line for line in md.splitlines() if line.startswith(f"| job | {ranks} |"))
    low, high = f"{values[0]:.1f}", f"{values[-1]:.1f}"
    assert f"{statistics.median(values):.1f} ({low}–{high}; highest rank " in row and f"({ranks} files)" in row, row


def test_a_few_ranks_fold_into_the_appendix(tmp_path):
    """Two ranks: the section holds the run's row (its distribution), the appendix every rank's, the HTML a <details>."""
    _copies(GLOO, tmp_path / "job", 2)
    out = tmp_path / "r.md"
    assert main(["report", str(tmp_path / "job"), "-o", str(out), "-o", str(tmp_path / "r.html")]) == 0
    md = out.read_text()
    section, appendix = md.split("## Where the time went", 1)[1].split("\n## ", 1)[0], md.split("## Appendix: every rank")[1]
    assert "| job | 2 |" in section and "| job | 1 | cpu_ops |" not in section  # the run's row: 2 ranks
    assert "| job | 0 | cpu_ops |" in appendix and "| job | 1 | cpu_ops |" in appendix
    assert "<details><summary>Where the time went, every rank</summary><table>" in (tmp_path / "r.html").read_text()
