"""`python -m analysis`'s command line (analysis/__main__.py): a usage error is one `error:` line and one usage line
(exit 2); each command's --help is its own (exit 0); options are read by launch.options' rules."""
from __future__ import annotations

import subprocess
import sys

import pytest

from analysis.__main__ import COMMANDS, USAGE, main
from tests.conftest import REPO

USAGE_LINE = "usage: python -m analysis "


@pytest.mark.parametrize("argv, says", [
    ([], "error: give a command: report, doctor, recognize, busbw"),
    (["reprot", "x"], "error: unknown command 'reprot'; did you mean report?"),
    (["report", "{tmp}"], "error: give -o OUT.html or -o OUT.md"),
    (["report", "{tmp}", "--bogus"], "error: unknown flag --bogus; options are key=value (ceiling, hardware, "
                                     "device_memory_gib), -o OUT and --jobs N"),
    (["doctor", "{tmp}", "--job", "2"], "error: unknown flag --job; did you mean --jobs?"),
    (["doctor", "{tmp}", "--jobs"], "error: --jobs needs a number of worker processes"),
    (["doctor", "{tmp}", "--jobs", "2", "--jobs=3"], "error: --jobs given twice"),
    (["doctor", "{tmp}", "ceiling=a", "ceiling=b"], "error: ceiling= given twice"),
    (["report", "=x", "-o", "r.md"], "error: =x: empty label"),
    (["recognize", "--all"], "error: unknown flag --all; recognize takes no flags"),
    (["busbw", "{tmp}", "--placement", "mean", "-o", "b.png"],
     "error: --placement mean: is not one of median, out-of-place, in-place"),
])
def test_a_usage_error_is_one_error_line_and_one_usage_line(tmp_path, capsys, argv, says):
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    out, err = capsys.readouterr()
    error, usage = err.splitlines()  # exactly two lines
    assert out == "" and error.startswith(says) and usage.startswith(USAGE_LINE)
    command = COMMANDS.get(argv[0]) if argv else None
    assert usage == f"usage: {command.usage if command is not None else USAGE}"


def test_a_missing_path_is_one_line_without_the_usage(tmp_path, capsys):
    assert main(["doctor", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'nope'}: no such file or folder\n"


def _help(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "analysis", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def test_doctor_help_is_its_own_not_reports():
    report, doctor = _help("report", "--help"), _help("doctor", "-h")
    assert report.returncode == doctor.returncode == 0 and report.stderr == doctor.stderr == ""
    assert doctor.stdout != report.stdout
    assert doctor.stdout.splitlines()[0] == f"usage: {COMMANDS['doctor'].usage}"
    assert report.stdout.splitlines()[0] == f"usage: {COMMANDS['report'].usage}"
    # report writes -o files and doctor writes nothing: only report's help lists -o
    assert "-o, --output OUT" in report.stdout and "--output" not in doctor.stdout
    assert "--jobs N" in doctor.stdout and "device_memory_gib=" in doctor.stdout


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["busbw", "-h"], ["recognize", "--help"], ["nope", "--help"]])
def test_every_help_exits_0(argv):
    p = _help(*argv)
    assert p.returncode == 0 and p.stdout.startswith(USAGE_LINE) and p.stderr == "", p.stderr


def test_values_are_read_by_launchs_option_rules(tmp_path, capsys):
    """A Unicode digit is no number to --jobs, as to launch's whole-number options (launch.options.whole)."""
    assert main(["doctor", str(tmp_path), "--jobs", "²"]) == 2
    assert "error: --jobs ²: must be a whole number from 1 to 4096" in capsys.readouterr().err
