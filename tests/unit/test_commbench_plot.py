"""`python -m analysis busbw` (analysis/parsers/commbench.py loads, analysis/analyzers/ceilings.py computes,
analysis/report/plots.py draws): busbw vs size per collective, one line per run, the profile's nominal busbw dashed."""
import subprocess
import sys

import pytest

from analysis.__main__ import main
from analysis.analyzers import ceilings
from analysis.parsers import commbench
from analysis.parsers.nccl_tests import parse_nccl_tests
from analysis.report.plots import busbw_plot
from launch.comm.commbench_spec import write_result
from launch.config.resolve import resolve_path
from launch.run.rundir import RunDir
from tests.conftest import RECIPES, REPO
from tests.unit.test_commbench_format import make_result

FIXTURES = REPO / "tests" / "fixtures" / "nccl"


def fake_run(tmp_path, *overrides, ops=("all_reduce", "all_to_all")) -> RunDir:
    """A run directory as a commbench run leaves it (resolved.json + results), without starting ranks."""
    resolved = resolve_path(RECIPES / "tiny_zero2", ["run.mode=commbench", *overrides])
    run = RunDir.create(resolved.recipe_name, root=tmp_path / "runs")
    run.write_text_atomic(run.resolved, resolved.to_json())
    for op in ops:
        write_result(run, make_result(op, 2, lambda i, p: 1e-5 * (1.4 ** i) * (1 + p), lambda i, p: 0))
    return run


def test_the_plotted_curve_is_the_ceilings_curve_the_median_of_both_placements():
    """One curve for the plot and the report's ceilings table (it was the better placement in the plot, the median
    in the table): per size the median of out-of-place and in-place, busbw from size and time x the bus factor."""
    t = parse_nccl_tests(FIXTURES / "c_allreduce_v2_13_8xh100.txt")
    curve = ceilings.busbw_curve(t, "all_reduce")
    oop = ceilings.busbw_curve(t, "all_reduce", "out-of-place")
    inp = ceilings.busbw_curve(t, "all_reduce", "in-place")
    sizes = [s for s, _ in curve]
    assert sizes == sorted(sizes) == [s for s, _ in oop] == [s for s, _ in inp]
    assert [b for _, b in curve] == pytest.approx([(a + b) / 2 for (_, a), (_, b) in zip(oop, inp, strict=True)])
    assert next(ceilings.nccl_ceilings([t]).rows())["curve"] == curve
    ((op, lines),) = ceilings.busbw_panels({"sweep": t})
    assert op == "all_reduce" and lines == [(0, "sweep (n=8)", curve)]
    assert ceilings.ceiling_curves([t]) == [("all_reduce", t.source, curve)]


def test_plot_of_runs_and_files(tmp_path):
    run = fake_run(tmp_path)
    tables, warnings = commbench.load([run.root, FIXTURES / "c_sweep_four_collectives_concatenated.txt"])
    label = f"tiny_zero2/{run.root.name}"
    assert warnings == [] and set(tables) == {label, "c_sweep_four_collectives_concatenated"}
    assert {r["op"] for r in tables[label].rows()} == {"all_reduce", "alltoall"}
    out = busbw_plot(ceilings.busbw_panels(tables), nominal_GBps=1.0, out_png=tmp_path / "plot.png")
    assert out.stat().st_size > 20_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="placement"):
        ceilings.busbw_panels(tables, placement="both")


def test_files_inside_a_run_carry_its_label(tmp_path):
    run = fake_run(tmp_path)
    tables, _ = commbench.load([run.commbench_json("all_reduce"), run.commbench_text("all_to_all")])
    assert list(tables) == [f"tiny_zero2/{run.root.name}"]  # one line: the JSON and the text of one run merge
    assert {r["op"] for r in tables[f"tiny_zero2/{run.root.name}"].rows()} == {"all_reduce", "alltoall"}


def test_nominal_busbw_comes_from_the_hardware_profile(tmp_path):
    assert commbench.nominal_from_run(fake_run(tmp_path / "a").root) == 1.0  # cpu profile, one node
    h100 = fake_run(tmp_path / "b", "hardware.profile=h100-sxm")
    assert commbench.nominal_from_run(h100.root) == 370.0
    two_nodes = fake_run(tmp_path / "c", "hardware.profile=h100-sxm", "hardware.nodes=2", "batch.global_batch_size=16")
    assert commbench.nominal_from_run(two_nodes.root) == 340.0


def test_command_line_writes_the_png_without_importing_torch(tmp_path):
    run = fake_run(tmp_path)
    out = tmp_path / "busbw.png"
    code = ("import sys; from analysis.__main__ import main; rc = main(['busbw', *sys.argv[1:]]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code, str(run.root), "-o", str(out)], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert out.is_file() and p.stdout.strip() == str(out)
    p = subprocess.run([sys.executable, "-m", "analysis", "busbw", str(tmp_path / "nope"), "-o", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "does not exist" in p.stderr


def test_unreadable_results_are_warned_about_and_skipped(tmp_path):
    run = fake_run(tmp_path)
    good = run.commbench_json("all_reduce")
    cut = tmp_path / "cut.json"
    cut.write_bytes(good.read_bytes()[:300])
    other = tmp_path / "other.json"
    other.write_text('{"a": 1}')
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    tables, warnings = commbench.load([cut, other, listed, good])
    assert list(tables) == [f"tiny_zero2/{run.root.name}"]
    assert [w.split(": ")[0] for w in warnings] == [str(cut), str(other), str(listed)]
    assert all("cannot be read as a commbench result" in w and w.endswith("skipped") for w in warnings)
    for op in ("all_reduce", "all_to_all"):  # a run directory whose results are all damaged
        f = run.commbench_json(op)
        f.write_bytes(f.read_bytes()[:300])
    tables, warnings = commbench.load([run.root])
    assert tables == {} and len(warnings) == 3 and "no readable commbench/*.json" in warnings[-1]


def test_dollar_signs_are_drawn_as_written_without_pyplot(tmp_path):
    run = fake_run(tmp_path)
    code = ("import sys; from analysis.analyzers.ceilings import busbw_panels; "
            "from analysis.parsers.commbench import load; from analysis.report.plots import busbw_plot; "
            "t, _ = load([sys.argv[1]]); "
            "busbw_plot(busbw_panels({'cost $5 vs $10': next(iter(t.values()))}), out_png=sys.argv[2], "
            "title='a $ b $^'); "
            "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot imported'")
    p = subprocess.run([sys.executable, "-c", code, str(run.root), str(tmp_path / "p.png")], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_a_damaged_resolved_json_costs_only_the_nominal_line(tmp_path, capsys):
    run = fake_run(tmp_path)
    run.resolved.write_bytes(run.resolved.read_bytes()[:200])
    assert main(["busbw", str(run.root), "-o", str(tmp_path / "p.png")]) == 0
    assert "its resolved.json cannot be read" in capsys.readouterr().err and (tmp_path / "p.png").is_file()
