"""`python -m launch plan` lists only layouts the backend builds: every row resolves as a recipe with its fields, and
the lists per backend are the ones written out by hand from launch/config/backends.py's notes (issue 43)."""
import re

import pytest

from launch.commands.args import read
from launch.commands.cli import main
from launch.commands.plan import OPTIONS, USAGE, layouts
from launch.config.backends import BACKENDS
from launch.config.resolve import resolve_path
from tests.conftest import RECIPES


def _rows(monkeypatch, tmp_path, *args):
    monkeypatch.setenv("LAYOUTLAB_RUNS", str(tmp_path / "runs"))  # no calibration of this machine is picked up
    return layouts(read(list(args), command="plan", usage=USAGE, options=OPTIONS).options)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_every_layout_plan_lists_resolves_with_its_backend(backend, monkeypatch, tmp_path):
    rows = _rows(monkeypatch, tmp_path, f"backend={backend}", "model=llama-2-7b,tiny-llama", "world_size=1,4,16",
                 "hardware=h100-sxm")
    assert rows
    for row in rows:
        lay = row.layout
        g = lay.grid
        # The oracle: the shipped base recipe with the row's fields, through the recipe loader and the resolver.
        resolved = resolve_path(RECIPES / "base", [
            f"backend={backend}", f"model.name={lay.model.name}", f"hardware.profile={lay.hardware.name}",
            f"hardware.nodes={g.nodes}", f"hardware.gpus_per_node={g.gpus_per_node}", f"parallel.tp={g.tp}",
            f"parallel.pp={g.pp}", f"parallel.zero_stage={lay.zero_stage}", f"parallel.sp={str(lay.sp).lower()}",
            f"precision.dtype={lay.dtype}", f"batch.micro_batch_size={lay.micro_batch_size}",
            f"batch.global_batch_size={lay.global_batch_size}", f"batch.seq_len={lay.seq_len}",
            f"train.activation_checkpointing={lay.activation_checkpointing}"])
        assert (resolved.world_size, resolved.grid.dp) == (row.world_size, g.dp), row.label
        bt = BACKENDS[backend]
        assert lay.zero_stage in bt.zero_stages, row.label
        if g.tp > 1:
            assert lay.zero_stage in bt.tp_zero_stages, row.label


def _labels(rows, model, world_size):
    return {r.label for r in rows if r.model == model and r.world_size == world_size}


# From launch/config/backends.py by hand: torch builds DDP (0) and FSDP2 (2, 3), tensor parallelism with FSDP2 only,
# sequence parallelism wherever it has TP; the deepspeed backend every stage, with TP too, and no SP.
BY_HAND = {
    "torch": {"DP", "ZeRO-2", "ZeRO-3", "TP2×ZeRO-2 (dp2)", "TP2×ZeRO-3 (dp2)", "TP4"},
    "deepspeed": {"DP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "TP2×DP (dp2)", "TP2×ZeRO-1 (dp2)", "TP2×ZeRO-2 (dp2)",
                  "TP2×ZeRO-3 (dp2)", "TP4"},
}


@pytest.mark.parametrize("backend", sorted(BY_HAND))
def test_the_layouts_of_llama_2_7b_on_4_gpus_are_the_backends_own(backend, monkeypatch, tmp_path):
    rows = _rows(monkeypatch, tmp_path, f"backend={backend}", "world_size=4", "activation_checkpointing=none,full")
    want = BY_HAND[backend] | {f"{label} +AC(full)" for label in BY_HAND[backend]}
    assert _labels(rows, "llama-2-7b", 4) == want
    sp = {r.label for r in rows if r.layout.sp}
    assert sp == ({label for label in want if label.startswith("TP")} if backend == "torch" else set())


def test_torch_lists_no_zero1_at_any_world_size(monkeypatch, tmp_path):
    rows = _rows(monkeypatch, tmp_path, "backend=torch", "model=llama-2-7b,llama-3.1-8b", "world_size=2,8,16")
    assert rows and not [r.label for r in rows if "ZeRO-1" in r.label or r.layout.zero_stage == 1]
    # nor DDP under tensor parallelism: torch DDP takes no DTensor parameters
    assert not [r.label for r in rows if r.layout.grid.tp > 1 and r.layout.zero_stage == 0]


def test_megatron_keeps_sequence_parallelism_where_it_builds_it(monkeypatch, tmp_path):
    rows = _rows(monkeypatch, tmp_path, "backend=megatron", "world_size=4", "activation_checkpointing=selective")
    sp = {r.label: r.layout.sp for r in rows if r.layout.grid.tp == 2}
    # SP with ZeRO 0-1 only (its norm gradients are summed before DeepSpeed reduces them); the layout stays without
    assert sp == {"TP2×DP (dp2) +AC(selective)": True, "TP2×ZeRO-1 (dp2) +AC(selective)": True,
                  "TP2×ZeRO-2 (dp2) +AC(selective)": False, "TP2×ZeRO-3 (dp2) +AC(selective)": False}


@pytest.mark.parametrize("args, option", [
    (["activation_checkpointing=none,selective"], "activation_checkpointing"),  # the deepspeed backend has none
    (["backend=megatron", "dtype=fp16"], "dtype"),
])
def test_what_the_backend_cannot_build_at_all_is_one_line_naming_the_option(args, option, tmp_path, capsys):
    assert main(["plan", *args, f"out={tmp_path / 'p'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: command line: {option}="), err
    assert not list(tmp_path.iterdir())


def test_plan_help_names_every_backend(capsys):
    assert main(["plan", "--help"]) == 0
    lines = {x.split("=", 1)[0].strip(): x for x in capsys.readouterr().out.splitlines() if "=" in x}
    assert re.search(r"backend=\s+deepspeed \| megatron \| torch \(default deepspeed\)", lines["backend"])
    assert "none, full, selective" in lines["activation_checkpointing"]  # the recipe's own three policies
