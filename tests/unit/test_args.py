"""The one argument reader (launch/commands/args.py) and `--help` on every subcommand."""
import os
import subprocess
import sys

import pytest

from launch.commands.args import Option, boolean, read, whole, whole_list
from launch.commands.cli import COMMANDS, main
from launch.commands.help import ABOUT, TAKES_A_RECIPE
from launch.errors import ConfigError
from tests.conftest import REPO

OPTS = (Option("top", "how many", whole(1, 100)), Option("verify", "run them", boolean, False),
        Option("sizes", "list", whole_list()))


def test_reads_positional_options_and_overrides():
    a = read(["recipes/x", "top=3", "parallel.tp=2", "backend=megatron", "--dry-run"], command="c", usage="u",
             options=OPTS, positional=(1, 1), overrides=True, dry_run=True)
    assert (a.dry_run, a.positional, a.overrides) == (True, ("recipes/x",), ("parallel.tp=2", "backend=megatron"))
    assert a.options == {"top": 3, "verify": False, "sizes": None}


@pytest.mark.parametrize("arg,problem", [
    ("top=²", "not a whole number"),  # str.isdigit() is true for it, int() refuses it
    ("top=1²", "not a whole number"),
    ("top=99999999999999999999999", "not a whole number from 1 to 100"),
    ("top=0", "not a whole number from 1 to 100"),
    ("verify=yes", "true or false"),
    ("sizes=4,,8", "comma-separated"),
    ("tpo=3", "did you mean top=?"),
])
def test_refuses_in_one_line(arg, problem):
    with pytest.raises(ConfigError) as e:
        read(["recipes/x", arg], command="c", usage="u", options=OPTS, positional=(1, 1))
    assert problem in str(e.value) and "\n" not in str(e.value)


def test_flags_and_positionals_are_checked():
    with pytest.raises(ConfigError, match="not a flag of c"):
        read(["--force"], command="c", usage="u", dry_run=True)
    with pytest.raises(ConfigError, match="is missing"):
        read([], command="c", usage="u", positional=(1, 1))
    with pytest.raises(ConfigError, match="not an option of c"):
        read(["parallel.tp=2"], command="c", usage="u")  # a command without a recipe takes no overrides


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_answers_help(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and f"example: {ABOUT[command][1]}" in out, out
    if command in TAKES_A_RECIPE:  # every recipe key, with its type, default and the schema's comment
        for key, shown in (("parallel.tp", "int = 1"), ("run.resume", 'str = "auto"'),
                           ("train.activation_checkpointing", '"none" | "full" | "selective" | "every_other_block" = "none"')):
            line = next(ln for ln in out.splitlines() if ln.split() and ln.split()[0] == key)
            assert shown in line, line
        assert "tiny_zero2" in out.split("recipes: ", 1)[1].splitlines()[0]


def test_the_overview_names_every_subcommand(capsys):
    assert set(ABOUT) == set(COMMANDS)
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in COMMANDS)


@pytest.mark.parametrize("command", ["run", "plan", "sweep", "recommend", "docs", "export-accelerate"])
def test_each_help_example_runs_as_written(command, tmp_path):
    """The example --help shows (those that need no earlier run and finish in seconds)."""
    argv = ABOUT[command][1].split()
    argv = argv[1:] if argv[0] == "bash" else argv[2:]
    if argv[0].startswith("launch/"):
        argv = [str(REPO / argv[0]), *argv[1:]]
    cmd = ["bash", *argv] if argv[0].endswith(".sh") else [sys.executable, *ABOUT[command][1].split()[1:]]
    env = {**os.environ, "LAYOUTLAB_RUNS": str(tmp_path / "runs")}
    cwd = REPO if command in ("docs", "run", "sweep", "recommend", "export-accelerate") else tmp_path
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]


@pytest.mark.parametrize("arg, says", [
    ("recipes/tiny_zer2", "recipes/tiny_zero2? pass a folder"),
    ("hardware.profile=h100sxm", "did you mean h100-sxm?"),
    ("backend=deepspeeed", 'did you mean "deepspeed"?'),
    ("paralel.tp=2", "paralel.tp=2 is not a known key; did you mean parallel.tp?"),
    ("parallel.tpp=2", "did you mean parallel.tp?"),
])
def test_did_you_mean_for_recipes_profiles_backends_and_keys(arg, says, capsys):
    args = [arg, "--dry-run"] if arg.startswith("recipes/") else [str(REPO / "recipes/tiny_zero2"), arg, "--dry-run"]
    if arg.startswith("recipes/"):
        args[0] = str(REPO / arg)
    assert main(["run", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


@pytest.mark.parametrize("command", ["report", "doctor", "recognize", "busbw"])
def test_every_analysis_subcommand_answers_help(command):
    p = subprocess.run([sys.executable, "-m", "analysis", command, "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith(f"usage: python -m analysis {command} "), p.stdout + p.stderr


def test_run_sh_answers_h():
    p = subprocess.run(["bash", "launch/run.sh", "-h"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "run.sh" in p.stdout, p.stderr


def test_export_refuses_a_unicode_digit_before_any_process_starts(capsys):
    assert main(["export", str(REPO), "step=¹"]) == 2
    assert 'step="¹"' in capsys.readouterr().err


def test_a_misspelt_top_level_recipe_key_gets_its_name(capsys):
    assert main(["run", str(REPO / "recipes/tiny_zero2"), "backedn=megatron", "--dry-run"]) == 2
    assert "did you mean backend=?" in capsys.readouterr().err


def test_one_input_past_the_limit_is_named_as_such(capsys):
    """prepare-data takes 10,000 inputs: the 10,001st was "not key=value", which it was never asked to be."""
    assert main(["prepare-data", *["corpus.txt"] * 10_001, "out=/nonexistent/x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[0].endswith("is one more than the 10,000 inputs prepare-data takes; usage: python -m "
                                        "launch prepare-data FILE|FOLDER|GLOB... out=PREFIX [data.tokenizer=byte|model|DIR]")


def test_one_override_past_the_limit_is_named_as_such(capsys):
    """10,001 overrides were each parsed, typed and echoed in one huge summary line; the limit is said before any is."""
    many = [f"train.seed={i}" for i in range(10_001)]
    assert main(["run", str(REPO / "recipes/tiny_zero2"), *many, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert 'argument="train.seed=10000" is one more than the 10,000 overrides run.sh takes' in err, err
