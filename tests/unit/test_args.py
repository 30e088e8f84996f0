"""The one argument reader (launch/commands/args.py) and `--help` on every subcommand."""
import subprocess

import pytest

from launch.commands.args import Option, boolean, read, whole, whole_list
from launch.commands.cli import COMMANDS, main
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
    assert out.strip() and ("usage" in out or "launch" in out), out


def test_run_sh_answers_h():
    p = subprocess.run(["bash", "launch/run.sh", "-h"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "run.sh" in p.stdout, p.stderr


def test_export_refuses_a_unicode_digit_before_any_process_starts(capsys):
    assert main(["export", str(REPO), "step=¹"]) == 2
    assert 'step="¹"' in capsys.readouterr().err
