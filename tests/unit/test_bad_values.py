"""Values that cannot work are refused before anything starts: one line naming the field, value and fix, exit 2."""
from pathlib import Path

import pytest

from launch.cli import main

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.mark.parametrize("override, says", [
    ("train.lr=inf", "train.lr=inf is out of range"),
    ("train.grad_clip=inf", "train.grad_clip=inf is out of range"),
    ("train.weight_decay=inf", "train.weight_decay=inf is out of range"),
    ("train.seed=-1", "must be between 0 and 18,446,744,073,709,551,615"),
    (f"train.seed={2**64}", "must be between 0 and 18,446,744,073,709,551,615"),
    ("run.timeout_s=99999999999999", "must be between 1 and 604,800"),
    ("extends=../base", "cannot be overridden"),
])
def test_values_that_cannot_work_are_one_line_exit_2(capsys, override, says):
    assert main(["run", str(RECIPES / "tiny_zero2"), override, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and override.split("=")[0] in err


@pytest.mark.parametrize("override", ["train.seed=0", f"train.seed={2**64 - 1}", "run.timeout_s=604800"])
def test_the_edges_are_accepted(override):
    assert main(["run", str(RECIPES / "tiny_zero2"), override, "--dry-run"]) == 0


def test_markup_in_a_value_is_printed_as_text(capsys):
    assert main(["run", str(RECIPES / "tiny_zero2"), "description=[/red] [bold]x", "--dry-run"]) == 0
    assert "overrides: description=[/red] [bold]x" in capsys.readouterr().out


@pytest.mark.parametrize("gpus", ["0", "-3,4", "4,0", ""])
def test_plan_blames_gpus_not_the_batch_it_is_derived_from(capsys, gpus):
    assert main(["plan", f"gpus={gpus}"]) == 2
    err = capsys.readouterr().err
    assert f'gpus="{gpus}"' in err and "global_batch_size" not in err and err.count("\n") == 1
