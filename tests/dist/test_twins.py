"""Every recipe's tiny twin trains: the catalogue's layouts on CPU ranks, a few steps each, in one sweep per group of
twins held equal (the seed's 7B matrix; the T4 ladder; the multi-node layouts), each sweep ending in its report.

The oracle is the run's own metrics read here: every step recorded, the loss finite and lower at the end than at the
start (a tiny model at lr 3e-3 falls from ln 512 ≈ 6.24 within a few steps), and the report naming every run.

README's test command trains every layout of 2 ranks once, not every twin: a twin of 4 ranks (conftest.two_ranks_first)
whose layout (backend, which of tp, pp and dp it splits, sp, vpp, ZeRO stage, offload, checkpointing, dtype) no default
test trains (tests/dist/conftest.py's layouts, the default sweeps) sweeps under `-m full`, which CI runs after README's
command: between them every layout of the catalogue trains in CI. The twins whose layout another twin or test already
trains sweep under `-m twins` (every twin trained once more; CI's 30 minutes do not hold them)."""
import math
import os
import re
import subprocess
from pathlib import Path

import pytest

from launch.config.resolve import resolve_path
from launch.run.metrics import read_metrics
from tests.conftest import REPO, RECIPES
from tests.dist.conftest import DS_DP2, MEGATRON, MEGATRON_LAYOUTS, SHORT, TINY, TORCH, TORCH_LAYOUTS

pytestmark = [pytest.mark.dist, pytest.mark.slow]
STEPS = 6
# Half the twins' global batch: TP 4 has no data parallelism, so each step is 8 micro-batches at the recipes' 8; at 4
# the layouts train the same way in half the time (the suite's budget), and the loss still falls within the steps.
GLOBAL_BATCH = 4
TWINS = sorted(p.parent.name for p in RECIPES.glob("tiny_*/recipe.toml")
               if (RECIPES / p.parent.name.removeprefix("tiny_") / "recipe.toml").is_file())
FINE_TUNES = [t for t in TWINS if resolve_path(RECIPES / t).recipe.peft.method != "none"]
GROUPS = {  # sweeps hold the batch, the sequence and the steps equal; each group also shares its rank count
    "7b_matrix": [t for t in TWINS if t.startswith("tiny_7b_") and t not in FINE_TUNES],
    "t4_ladder": [t for t in TWINS if "_t4_" in t and t not in FINE_TUNES],
    "multi_node": [t for t in TWINS if t.startswith(("tiny_8b_", "tiny_70b_")) and t not in FINE_TUNES],
    # the [peft] recipes' twins: adapters over the tiny models' saved weights, on Genesis, with a validation loss.
    # All under -m full: README's command trains their adapters' layouts in tests/dist/test_lora.py (one rank, DDP,
    # FSDP2 with checkpointing), and the twins' fp16, QLoRA and checkpointed one-rank variants would cost it a minute more
    "fine_tune": FINE_TUNES,
}


def layout(recipe, *overrides: str) -> tuple:
    """What a run's parallel layout is, as the resolver settles it: which dimensions it splits (tp, pp, dp: a degree of
    2 runs the same code as 4 or 8, and a CPU twin has 2 or 4 ranks where its sibling has 8 or more), and the fields a
    twin shares with its GPU sibling (backend, sp, vpp, ZeRO stage, offload, checkpointing, dtype)."""
    r = resolve_path(recipe, overrides)
    par, g = r.recipe.parallel, r.grid
    return (r.recipe.backend, g.tp > 1, g.pp > 1, g.dp > 1, par.sp, par.vpp, par.zero_stage, par.offload_params,
            par.offload_optimizer, r.recipe.train.activation_checkpointing, r.recipe.precision.dtype,
            r.recipe.peft.method)


def _trained_elsewhere() -> set[tuple]:
    """The layouts README's test command trains outside this file (the parity, checkpoint and collective tests)."""
    from tests.dist.test_lora import LAYOUTS as LORA_LAYOUTS, LORA
    from tests.dist.test_megatron_collectives import RUNS as MEGATRON_PROFILED

    return ({layout(TINY, *o) for o in DS_DP2.values()} | {layout(MEGATRON, *SHORT, *o) for o in MEGATRON_LAYOUTS.values()}
            | {layout(MEGATRON, *o) for o in MEGATRON_PROFILED.values()}
            | {layout(TORCH, *SHORT, *o) for o in TORCH_LAYOUTS.values()}
            | {layout(TORCH, *LORA, *o) for o in LORA_LAYOUTS.values()}
            # test_deepspeed_run's checkpointed ZeRO-3; fp16 DDP (test_fp16_scaling) and FSDP2 (test_torch_parity)
            | {layout(TINY, *DS_DP2[3], "train.activation_checkpointing=full")}
            | {layout(recipe, "precision.dtype=fp16", "hardware.gpus_per_node=2", "batch.micro_batch_size=2")
               for recipe in (RECIPES / "tiny_ddp", RECIPES / "tiny_fsdp2")})


def _two_ranks(twin: str) -> bool:
    return resolve_path(RECIPES / twin, [f"batch.global_batch_size={GLOBAL_BATCH}"]).world_size <= 2


def _split() -> tuple[dict[str, list[str]], dict[str, list[str]], dict[str, list[str]]]:
    """Each group's twins as (README's command trains them, `-m full` does: a layout nothing else trains, `-m twins`
    does: the others). A sweep compares two or more recipes: a group's one new layout sweeps beside a twin trained
    elsewhere."""
    seen = _trained_elsewhere()
    default: dict[str, list[str]] = {}
    full: dict[str, list[str]] = {}
    rest: dict[str, list[str]] = {}
    for group, twins in GROUPS.items():
        for twin in twins:
            key = layout(RECIPES / twin, f"batch.global_batch_size={GLOBAL_BATCH}")
            new = key not in seen
            if group == "fine_tune":  # all five in CI, as their issue asks: one sweep, beside README's test_lora
                full.setdefault(group, []).append(twin)
                continue
            (default if new and _two_ranks(twin) else full if new else rest).setdefault(group, []).append(twin)
            seen.add(key)
        for chosen in (default, full):
            if len(chosen.get(group, ())) == 1:  # a partner from the twins trained elsewhere, else from the others
                partner = next(iter(rest.get(group, ())), None) or next(t for t in twins if t not in chosen[group])
                chosen[group].append(partner)
                if partner in rest.get(group, ()):
                    rest[group].remove(partner)
        if len(rest.get(group, ())) == 1:  # trained once more beside one that CI trains
            rest[group].append(next(t for t in twins if t not in rest[group]))
    return default, full, {g: twins for g, twins in rest.items() if twins}


DEFAULT, FULL, REST = _split()
# A sweep of more twins than this is split into sweeps of at most as many: one sweep of 13 four-rank twins took 206 s
# of one xdist worker while the other idled at the end of the suite.
SWEEP_MAX = 6


def _parts(twins: list[str]) -> list[list[str]]:
    n = -(-len(twins) // SWEEP_MAX)
    return [twins[i::n] for i in range(n)]


SWEEPS = [pytest.param(twins, id=group) for group, twins in sorted(DEFAULT.items())] + [
    pytest.param(part, id=f"{group}-{kind}{'' if len(twins) <= SWEEP_MAX else i + 1}", marks=mark)
    for kind, mark, chosen in (("new", pytest.mark.full, FULL), ("rest", pytest.mark.twins, REST))
    for group, twins in sorted(chosen.items()) for i, part in enumerate(_parts(twins))]


def test_the_groups_hold_every_twin():
    assert sorted(t for group in GROUPS.values() for t in group) == TWINS and len(GROUPS["7b_matrix"]) >= 10


def test_the_default_sweeps_train_every_layout_of_the_twins():
    """README's command (default sweeps and conftest's layouts) trains every layout of 2 ranks some twin has, and with
    `-m full` (CI) every layout of every twin; with `-m twins` the three lists hold every twin once."""
    default, full, rest = ([t for twins in chosen.values() for t in twins] for chosen in (DEFAULT, FULL, REST))
    assert sorted(set(default + full + rest)) == TWINS and not set(default) & set(full)
    assert all(len(twins) >= 2 for chosen in (DEFAULT, FULL, REST) for twins in chosen.values())  # sweep.sh's least
    key = {t: layout(RECIPES / t, f"batch.global_batch_size={GLOBAL_BATCH}") for t in TWINS}
    trained = _trained_elsewhere() | {key[t] for t in default}
    for twin in filter(_two_ranks, TWINS):
        assert key[twin] in trained or twin in FINE_TUNES, twin
    trained |= {key[t] for t in full}
    assert {key[t] for t in TWINS} <= trained
    # a layout the conftest runs train is left to -m twins: the 7B matrix's DDP cell is the torch DDP parity run's
    assert "tiny_7b_ddp" in rest and key["tiny_7b_ddp"] == layout(TORCH, *SHORT, *TORCH_LAYOUTS["ddp"])


def _losses(run: Path) -> list[float]:
    """The loss curve of a run: the rank that records losses (the last pipeline stage holds the loss under PP)."""
    for path in sorted((run / "metrics").glob("rank*.jsonl")):
        losses = [s.loss for s in read_metrics(path).steps if s.loss is not None]
        if losses:
            return losses
    return []


@pytest.mark.parametrize("twins", SWEEPS)
def test_every_twin_trains(tmp_path, twins):
    p = subprocess.run(["bash", "launch/sweep.sh", *(f"recipes/{t}" for t in twins), f"train.steps={STEPS}",
                        f"batch.global_batch_size={GLOBAL_BATCH}"],
                       cwd=REPO, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "LAYOUTLAB_RUNS": str(tmp_path / "runs")})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    sweep = Path(re.search(r"^report: (\S+)$", p.stdout, re.M).group(1)).parent
    for twin in twins:
        runs = [d for d in (sweep / twin).glob("*") if (d / "resolved.json").is_file()]
        assert len(runs) == 1, (twin, runs)
        losses = _losses(runs[0])
        assert len(losses) == STEPS and all(map(math.isfinite, losses)), (twin, losses)
        assert losses[-1] < losses[0], (twin, losses)
        data = resolve_path(RECIPES / twin).recipe.data
        if data.valid_fraction or data.valid_path:  # the fine-tunes' held-out Genesis rows, evaluated at the last step
            valid = [s.valid_loss for s in read_metrics(runs[0] / "metrics" / "rank0.jsonl").steps]
            assert valid[-1] is not None and math.isfinite(valid[-1]), (twin, valid)
    report = (sweep / "report.md").read_text()
    named = set(re.findall(r"^\| (tiny_\S+) \|", report, re.M))
    assert set(twins) <= named, set(twins) - named
    # every file a run of ours writes is read or known as ours: none listed as unreadable
    assert not re.findall(r"^- .* — skipped: .*$", report, re.M), re.findall(r"^- .* — skipped: .*$", report, re.M)
