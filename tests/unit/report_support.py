"""Builders shared by the analysis/report tests: fixture paths and a run directory written by our own
code (resolver, planner, launch.run.metrics.MetricsWriter) with the committed gloo traces, so the report
can be tested on our format without training anything."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Sequence

from launch.config.adapters import adapted
from launch.config.resolve import resolve_path
from launch.plan.build import plan_resolved
from launch.plan.time import model_flops_per_token
from launch.run.metrics import (
    SCHEMA_VERSION,
    MetaRecord,
    MetricsWriter,
    flops_formula,
    StepRecord,
)

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures"
LOGS = FIX / "logs"
NCCL = FIX / "nccl"
KINETO = FIX / "kineto"
NSYS = FIX / "nsys"
BIGSCIENCE = LOGS / "real_megatron_lm_2021_bigscience_tp4_pp8_EXCERPT.out"
ALCF = LOGS / "real_ds_0_17_5_megatron_deepspeed_alcf_cooldown_EXCERPT.txt"
GLOO = [KINETO / "gloo_rank0.json.gz", KINETO / "gloo_rank1.json.gz"]
HTA = [KINETO / "hta_trace_filter__sampled_rank-0.json.gz", KINETO / "hta_trace_filter__sampled_rank-1.json.gz"]
ALLREDUCE_8XH100 = NCCL / "c_allreduce_v2_13_8xh100.txt"


def build_nsys_exports(out: Path) -> dict[str, Path]:
    spec = importlib.util.spec_from_file_location("nsys_make_fixtures", NSYS / "make_fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_all(out)


def default_step_times(steps: int, warmup: int) -> list[float]:
    # warm-up steps slow, then a steady 0.1 s with a small deterministic wobble
    return [0.5 if s < warmup else 0.1 + 0.002 * ((s * 7) % 5) for s in range(steps)]


def make_run_dir(root: Path, name: str = "20260101-000000", *, overrides: Sequence[str] = (), steps: int = 12,
                 step_times: Sequence[float] | None = None, rss_bytes: int = 600 * 2**20, traces: bool = True,
                 plan: bool = True, cut_last_line: bool = False, losses: Sequence[float] | None = None,
                 valid_losses: dict[int, float] | None = None, params: tuple[int, int] | None = None) -> Path:
    """runs/tiny_zero2/<name>/ as our trainer leaves it: resolved.json, plan.json, metrics/rank{0,1}.jsonl
    (written by MetricsWriter), traces/ (the committed gloo traces) and an empty checkpoints/. `params`: the meta
    records' (trainable_params, frozen_params); None: a run recorded before the meta record held them."""
    resolved = resolve_path(REPO / "recipes" / "tiny_zero2", [f"train.steps={steps}", *overrides])
    d = root / "tiny_zero2" / name
    (d / "checkpoints" / "step12").mkdir(parents=True)
    (d / "checkpoints" / "step12" / "mp_rank_00_model_states.pt").write_bytes(b"\x80\x02binary")
    (d / "resolved.json").write_text(resolved.to_json())
    if plan:
        (d / "plan.json").write_text(plan_resolved(resolved).to_json())
    rc = resolved.recipe
    warm = rc.train.warmup_steps
    times = list(step_times) if step_times is not None else default_step_times(steps, warm)
    fpt = model_flops_per_token(resolved.model, rc.batch.seq_len, rc.peft)
    formula = flops_formula(adapted(rc.peft))
    peak = resolved.hardware.peak_flops(rc.precision.dtype)
    tokens = resolved.tokens_per_step
    g = resolved.grid
    for rank in range(resolved.world_size):
        meta = MetaRecord(schema_version=SCHEMA_VERSION, rank=rank, world_size=resolved.world_size, tp=g.tp, pp=g.pp,
                          dp=g.dp, recipe=resolved.recipe_name, backend=rc.backend,
                          hardware_profile=resolved.hardware.name, device="cpu", peak_flops_per_device=peak,
                          flops_per_token=fpt, flops_formula=formula, tokens_per_step=tokens, warmup_steps=warm,
                          zero_stage=rc.parallel.zero_stage, dtype=rc.precision.dtype,
                          micro_batch_size=rc.batch.micro_batch_size, global_batch_size=rc.batch.global_batch_size,
                          seq_len=rc.batch.seq_len, param_numel_local=1000, start_step=0, resumed_from=None,
                          trainable_params=params[0] if params else None, frozen_params=params[1] if params else None)
        w = MetricsWriter(d / "metrics" / f"rank{rank}.jsonl", meta)
        for s, t in enumerate(times):
            tflops = fpt * tokens / t / resolved.world_size / 1e12
            w.step(StepRecord(step=s + 1, warmup=s < warm, loss=6.0 - 0.05 * s if losses is None else losses[s],
                              lr=1e-3, grad_norm=1.0,
                              step_time_s=t, tokens_per_s=tokens / t,
                              tokens_per_s_per_device=tokens / t / resolved.world_size, tflops_per_device=tflops,
                              mfu=tflops * 1e12 / peak, rss_max_bytes=rss_bytes + rank * 2**20 + s * 1024,
                              valid_loss=(valid_losses or {}).get(s + 1)))
        w.close()
        if cut_last_line:
            f = d / "metrics" / f"rank{rank}.jsonl"
            data = f.read_bytes()
            f.write_bytes(data[:-40])
    if traces:
        (d / "traces").mkdir()
        for rank, src in enumerate(GLOO):
            shutil.copy(src, d / "traces" / f"rank{rank}.json.gz")
    (d / "launch_cmd.txt").write_text("torchrun --nproc-per-node 2 -m launch.ranks.train\n")
    return d
