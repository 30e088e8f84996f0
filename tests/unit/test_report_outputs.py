"""`-o` never overwrites what a user has, and says so before anything is read (one line, exit 2)."""
import shutil

import pytest

from analysis.__main__ import main
from tests.conftest import REPO

LOG = REPO / "tests/fixtures/logs/c_megatron_lm_2024_max_and_all_ranks_timers.txt"


@pytest.fixture
def inputs(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copy(LOG, folder / "train.log")
    return folder


def refused(capsys, *argv) -> str:
    assert main(["report", *map(str, argv)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_output_over_an_input_file_or_into_an_input_folder(inputs, capsys):
    log = inputs / "train.md"  # an input may have any name: files are recognised by content
    shutil.copy(LOG, log)
    before = log.read_bytes()
    assert "is an input of this command" in refused(capsys, log, "-o", log)
    assert log.read_bytes() == before
    assert "lies inside an input of this command" in refused(capsys, inputs, "-o", inputs / "report.html")
    assert not (inputs / "report.html").exists()
    # a Markdown report's figure folder (<name>_plots) may not replace an input folder either
    plots_input = inputs.parent / "r_plots"
    plots_input.mkdir()
    (plots_input / "figure1.png").write_bytes(b"\x89PNG")
    assert "is an input of this command" in refused(capsys, plots_input, "-o", inputs.parent / "r.md")
    assert "given twice" in refused(capsys, inputs, "-o", inputs.parent / "x.md", "-o", inputs.parent / "x.md")


def test_output_over_a_users_file_folder_or_figures(inputs, tmp_path, capsys):
    notes = tmp_path / "notes.md"
    notes.write_text("my notes\n")
    assert "was not written by python -m analysis report" in refused(capsys, inputs, "-o", notes)
    assert notes.read_text() == "my notes\n"
    (tmp_path / "dir.html").mkdir()
    assert "is a folder" in refused(capsys, inputs, "-o", tmp_path / "dir.html")
    plots = tmp_path / "r_plots"
    plots.mkdir()
    (plots / "keep.txt").write_text("mine")
    assert "r_plots holds files that python -m analysis report did not write" in refused(capsys, inputs, "-o", tmp_path / "r.md")
    assert (plots / "keep.txt").read_text() == "mine"
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "which is a file" in refused(capsys, inputs, "-o", blocker / "sub" / "r.html")


def test_an_earlier_report_is_replaced_and_said(inputs, tmp_path, capsys):
    out = tmp_path / "r.md"
    assert main(["report", str(inputs), "-o", str(out)]) == 0
    first = capsys.readouterr().out
    assert "replacing" not in first and out.read_text().startswith("# layoutlab report")
    assert main(["report", str(inputs), "-o", str(out)]) == 0
    assert f"replacing the earlier report {out}" in capsys.readouterr().out


def test_a_file_that_only_mentions_a_report_is_never_replaced(inputs, tmp_path, capsys):
    """Recognised by the exact head our renderer writes, not by a search of the first 4 KiB."""
    notes = tmp_path / "notes.md"
    notes.write_text("my notes\n\nsee the old output:\n# layoutlab report\n<title>layoutlab report</title>\n")
    heading = tmp_path / "mine.md"
    heading.write_text("# layoutlab report\nmy own page with the same title\n")
    for f in (notes, heading):
        before = f.read_bytes()
        assert "was not written by python -m analysis report" in refused(capsys, inputs, "-o", f)
        assert f.read_bytes() == before


def test_a_new_report_inside_the_run_it_describes_is_accepted_and_ignored_by_the_next(tmp_path, capsys):
    from analysis.report import build_report
    from tests.unit.report_support import make_run_dir

    run = make_run_dir(tmp_path, traces=False)
    for _ in range(2):  # the second time it replaces its own earlier report there
        assert main(["report", str(run), "-o", str(run / "report.md"), "-o", str(run / "report.html")]) == 0
    capsys.readouterr()
    rep = build_report([("run", run)])
    ours = {p for p, _ in rep.runs[0].run.ours}
    assert {"report.md", "report.html"} <= ours and not rep.runs[0].run.skipped
    assert any(p.startswith("report_plots/figure") for p in ours) or not (run / "report_plots").exists()


def test_our_report_is_ours_wherever_it_lies(inputs, tmp_path, capsys):
    """Told by its exact head: in a run directory whose resolved.json is damaged, in a folder of foreign files, or
    given alone, it was 'text without lines from any supported tool'; a user's page with the same title is not
    ours."""
    from analysis.report import build_report
    from tests.unit.report_support import make_run_dir

    run = make_run_dir(tmp_path / "runs", traces=False)
    assert main(["report", str(run), "-o", str(run / "report.md"), "-o", str(run / "report.html")]) == 0
    capsys.readouterr()
    for name in ("report.md", "report.html"):
        shutil.copy(run / name, inputs / name)
    (inputs / "mine.md").write_text("# layoutlab report\nmy own page with the same title\n")
    (run / "resolved.json").write_text("{}")
    rep = build_report([("run", run), ("foreign", inputs), ("alone", inputs / "report.html")])
    for r in rep.runs:
        ours = {p for p, _ in r.run.ours}
        skipped = {p for p, _ in r.run.skipped}
        assert {"report.md", "report.html"} & ours and not {"report.md", "report.html"} & skipped, (r.label, ours)
    assert rep.runs[0].run.run_dir
    assert "mine.md" in {p for p, _ in rep.runs[1].run.skipped}
