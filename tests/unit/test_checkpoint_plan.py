"""The plan of a checkpoint save (launch/plan/checkpoint.py) by hand: Llama-2-7B's 6,738,415,616 parameters (its Hugging
Face config's count, embedding and lm_head untied), the bytes each backend's files hold per parameter, the busiest
rank's part and the times at the H100 profile's figures; the checkpoint record the loop writes per save, through both
readers; and the refusal of run.checkpoint_async where the backend has no asynchronous save."""
import json
import re
import subprocess

import pytest

from analysis.parsers.metrics import parse_metrics
from launch.config.resolve import resolve_path
from launch.plan.build import plan_resolved
from launch.run.metrics import MetricsError, read_metrics, validate
from tests.conftest import REPO, RECIPES

PARAMS = 6_738_415_616
# a one-rank run's meta record, as launch.run.metrics.MetaRecord writes it
META = {"schema_version": 2, "rank": 0, "world_size": 1, "tp": 1, "pp": 1, "dp": 1, "recipe": "r", "backend": "torch",
        "hardware_profile": "cpu", "device": "cpu", "peak_flops_per_device": 1e12, "flops_per_token": 1e6,
        "flops_formula": "f", "tokens_per_step": 64, "warmup_steps": 0, "zero_stage": 3, "dtype": "fp32",
        "micro_batch_size": 1, "global_batch_size": 2, "seq_len": 32, "param_numel_local": 10, "start_step": 0,
        "resumed_from": None, "kind": "meta"}


def _plan(recipe: str, *overrides: str):
    return plan_resolved(resolve_path(RECIPES / recipe, list(overrides)))


def test_fsdp2_checkpoint_by_hand():
    sync = _plan("7b_fsdp2").checkpoint  # torch, FSDP2 full sharding over 4 ranks of one node
    assert sync.bytes_per_parameter == 4 + 8  # DCP: fp32 parameters, AdamW's two fp32 moments
    assert sync.bytes_total == 12 * PARAMS
    assert sync.bytes_held_per_rank == pytest.approx(12 * PARAMS / 4, abs=12 * 4 * 10)  # shards rounded up per tensor
    assert sync.write_s == pytest.approx(12 * PARAMS / 5e9) and sync.blocked_s == sync.write_s and not sync.asynchronous
    a = _plan("7b_fsdp2", "run.checkpoint_async=true").checkpoint
    assert a.asynchronous and a.write_s == sync.write_s
    assert a.blocked_s == pytest.approx(a.bytes_held_per_rank / 25e9)  # the copy to host memory alone
    assert a.blocked_s < sync.blocked_s / 15


def test_deepspeed_and_megatron_files_hold_the_16_bit_model_beside_the_fp32_state():
    zero3 = _plan("7b_zero3").checkpoint  # deepspeed ZeRO-3 over 4 ranks, bf16
    assert zero3.bytes_total == (2 + 4 + 8) * PARAMS
    assert zero3.bytes_held_per_rank == pytest.approx(14 * PARAMS / 4, rel=1e-9)
    zero1 = _plan("7b_zero1").checkpoint  # ZeRO-1: the whole 16-bit model on every rank, the rest sharded
    assert zero1.bytes_held_per_rank == pytest.approx(2 * PARAMS + 12 * PARAMS / 4, rel=1e-9)


def test_asynchronous_copies_are_held_in_host_memory():
    sync, a = _plan("7b_ddp"), _plan("7b_ddp", "run.checkpoint_async=true")  # DDP: every rank's whole replica
    assert a.checkpoint.bytes_held_per_rank == 12 * PARAMS
    # 4 local ranks each keep a copy of their 80.9 GB beside nothing offloaded: more than their start-up, each holding
    # one whole tensor at a time (the embedding, 32000 × 4096 in fp32) with the estimators' buffer factor 1.5
    assert a.host_bytes_per_node == 4 * 12 * PARAMS > sync.host_bytes_per_node == int(1.5 * 4 * 4 * 32000 * 4096)
    assert any("asynchronous: training blocked" in n for n in a.notes)


@pytest.mark.parametrize("recipe", ["7b_tp2_zero3", "7b_zero2"])  # megatron, deepspeed
def test_asynchronous_saves_are_refused_where_the_backend_has_none(recipe):
    p = subprocess.run(["bash", "launch/run.sh", f"recipes/{recipe}", "run.checkpoint_async=true", "--dry-run"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "run.checkpoint_async=true needs backend = \"torch\"" in lines[0], p.stderr
    assert "set run.checkpoint_async=false" in lines[0]


def test_checkpoint_records_are_read_beside_the_steps(tmp_path):
    rank = tmp_path / "metrics" / "rank0.jsonl"
    rank.parent.mkdir()
    step = {"step": 1, "warmup": False, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "step_time_s": 0.5,
            "tokens_per_s": 128.0, "tokens_per_s_per_device": 128.0, "tflops_per_device": 0.1, "mfu": 0.1, "kind": "step"}
    save = {"step": 1, "asynchronous": True, "blocked_s": 0.25, "kind": "checkpoint"}
    rank.write_text("\n".join(json.dumps(r) for r in (META, step, save)) + "\n")
    m = read_metrics(rank)
    assert [s.step for s in m.steps] == [1] and not m.warnings
    assert [(c.step, c.asynchronous, c.blocked_s) for c in m.checkpoints] == [(1, True, 0.25)]
    table = parse_metrics(tmp_path)
    assert len(table) == 1 and not table.warnings
    assert table.meta.checkpoints == ({"step": 1, "asynchronous": True, "blocked_s": 0.25, "rank": 0},)
    for bad, said in (({**save, "blocked_s": -1.0}, "negative or not finite"),
                      ({**save, "blocked_s": float("nan")}, "negative or not finite"),
                      ({**save, "blocked_s": 1e9}, "longer than a week"), ({**save, "step": 0}, "positive"),
                      ({**save, "asynchronous": "yes"}, "is not bool"), ({**META, "startup_s": -3.0}, "negative"),
                      ({k: v for k, v in save.items() if k != "blocked_s"}, "missing ['blocked_s']")):
        with pytest.raises(MetricsError, match=re.escape(said)):
            validate(bad)


def test_a_restart_drops_the_saves_recorded_after_its_checkpoint(tmp_path):
    """A resumed run appends a meta record from its checkpoint's step: the saves recorded after that step were made
    again (or never finished), and both readers keep only the later records, as they do the steps."""
    rank = tmp_path / "metrics" / "rank0.jsonl"
    rank.parent.mkdir()
    saves = [{"step": s, "asynchronous": False, "blocked_s": 0.5, "kind": "checkpoint"} for s in (2, 4)]
    records = [META, saves[0], saves[1], {**META, "start_step": 2, "resumed_from": "x", "startup_s": 3.0},
               {**saves[1], "blocked_s": 0.75}]
    rank.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert [(c.step, c.blocked_s) for c in read_metrics(rank).checkpoints] == [(2, 0.5), (4, 0.75)]
    kept = parse_metrics(tmp_path).meta.checkpoints
    assert [(c["step"], c["blocked_s"]) for c in kept] == [(2, 0.5), (4, 0.75)]
