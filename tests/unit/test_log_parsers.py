"""DeepSpeed / Megatron training-log parsers and the TensorBoard scalar reader.

Real fixtures are checked number by number against their own text; constructed ones (`c_*`, see
tests/fixtures/logs/README.md) pin each layout variant. Property tests cut and garble the inputs.
"""
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analysis.parsers import deepspeed_log, megatron_log, tensorboard
from analysis.parsers.deepspeed_log import is_deepspeed_timer_line, parse_deepspeed_log
from analysis.parsers.megatron_log import parse_megatron_log
from analysis.parsers.tensorboard import parse_tensorboard
from analysis.table import Table

LOGS = Path(__file__).resolve().parent.parent / "fixtures" / "logs"
ALCF = LOGS / "real_ds_0_17_5_megatron_deepspeed_alcf_cooldown_EXCERPT.txt"
BIGSCIENCE = LOGS / "real_megatron_lm_2021_bigscience_tp4_pp8_EXCERPT.out"
DS_2023 = LOGS / "c_ds_v0_9_forward_names_gas2_pdsh.txt"
DS_2020 = LOGS / "c_ds_v0_3_2020_memory_breakdown.txt"
DS_PIPE = LOGS / "c_ds_v0_14_pipe_engine.txt"
DS_FLOPS = LOGS / "c_ds_v0_17_flops_profiler.txt"
DS_FLOPS_2021 = LOGS / "c_ds_v0_5_flops_profiler_2021.txt"
MEGATRON_2025 = LOGS / "c_megatron_lm_2025_minmax_moe.txt"
MEGATRON_TIMERS = LOGS / "c_megatron_lm_2024_max_and_all_ranks_timers.txt"
MDS_COLON = LOGS / "c_megatron_deepspeed_2024_colon_with_ds.txt"
DS_FILES = [ALCF, DS_2023, DS_2020, DS_PIPE, DS_FLOPS, DS_FLOPS_2021, MDS_COLON]
MEGATRON_FILES = [ALCF, BIGSCIENCE, MEGATRON_2025, MEGATRON_TIMERS, MDS_COLON]
GIB = 1024 ** 3
MIB = 1024 ** 2


def line_of(path: Path, n: int) -> str:
    return path.read_text(encoding="utf-8").split("\n")[n - 1]


def rows(table: Table, **equals):
    return list(table.where(**equals).rows())


# ---------------------------------------------------------------------------------------------
# DeepSpeed


def test_deepspeed_alcf_real_steps_timers_throughput():
    t = parse_deepspeed_log(ALCF)
    # Only the comms logger's four overflowed (negative) totals are warned about (test_comm_tables reads them).
    assert len(t.warnings) == 4 and all("counter overflowed" in w for w in t.warnings)
    assert t.meta.deepspeed_version == "0.17.5"
    steps = rows(t, kind="step")
    assert [r["step"] for r in steps] == list(range(136005, 136012))
    first = steps[0]
    assert "step=136005, skipped=0" in line_of(ALCF, first["line"])
    assert first["skipped"] == 0 and first["rank"] == 0
    assert first["lr"] == 2.012568679065123e-05 and first["lr_groups"] == [2.012568679065123e-05] * 2
    assert first["mom"] == [(0.9, 0.95), (0.9, 0.95)]
    assert first["timestamp"] == "2025-11-10 09:43:39,573"

    # ZeRO's optimizer timers are printed just before `step=` of the same step.
    allgather = rows(t, kind="timer", name="optimizer_allgather")
    assert [r["step"] for r in allgather] == list(range(136005, 136012))
    assert allgather[0]["time_ms"] == 167.02
    assert "optimizer_allgather: 167.02" in line_of(ALCF, allgather[0]["line"])

    # The clipped excerpt starts mid-step: its first block counts back from the next `step=`.
    fwd = rows(t, kind="timer", name="fwd")
    assert [r["step"] for r in fwd] == list(range(136004, 136012))
    assert fwd[0]["time_ms"] == 715.40 and "fwd: 715.40" in line_of(ALCF, fwd[0]["line"])
    micro = rows(t, kind="timer", name="bwd_allreduce_microstep", step=136009)
    assert len(micro) == 1 and micro[0]["time_ms"] == 1175.49
    step_timer = rows(t, kind="timer", name="step", step=136011)[0]
    assert step_timer["time_ms"] == 138.30

    tput = rows(t, kind="throughput")
    assert [r["tput_global_step"] for r in tput] == list(range(5, 12))
    assert [r["step"] for r in tput] == list(range(136005, 136012))   # the tput counter restarted
    assert tput[0]["samples_per_s_avg"] == 2443.9516881034883
    assert tput[0]["samples_per_s"] == 2553.443452275532
    assert tput[0]["allocated_bytes"] == round(3.71 * GIB)
    assert tput[0]["max_allocated_bytes"] == round(39.0 * GIB)
    assert (tput[0]["epoch"], tput[0]["micro_step"]) == (0, 5)

    after = rows(t, kind="memory", name="After Building Model")[0]
    assert after["step"] is None  # set-up, before any step
    assert after["allocated_bytes"] == round(3.71 * GIB) and after["reserved_bytes"] == round(3.72 * GIB)
    assert after["max_reserved_bytes"] == 4 * GIB
    # Megatron's own lines in the same file (`forward-backward ...: (a, b)`) are not DeepSpeed records.
    assert all(re.fullmatch(r"[a-z_]+", r["name"]) for r in rows(t, kind="timer"))


def test_deepspeed_2023_forward_names_gradient_accumulation_and_pdsh():
    t = parse_deepspeed_log(DS_2023)
    assert t.warnings == ()
    assert t.meta.deepspeed_version == "0.9.0"
    assert set(t.column("host")) == {"worker-0"}
    # Two micro-step lines per step (GAS 2); steps 1 and 3 print no `step=` and are counted.
    fwd_micro = rows(t, kind="timer", name="forward_microstep")
    assert [r["step"] for r in fwd_micro] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert all(r["rank"] == 0 for r in fwd_micro)
    assert fwd_micro[4]["time_ms"] == 100.40  # the line with a tqdm bar glued in front
    assert "75%|" in line_of(DS_2023, fwd_micro[4]["line"])
    global_timers = ("forward", "backward", "step")
    per_step = {s: sum(r["time_ms"] for r in rows(t, kind="timer", step=s) if r["name"] in global_timers)
                for s in (1, 2, 3, 4)}
    assert per_step[3] == pytest.approx(200.40 + 404.50 + 44.55)
    overflow = rows(t, kind="overflow")[0]
    assert (overflow["step"], overflow["loss_scale"], overflow["new_loss_scale"]) == (2, 65536.0, 32768.0)
    tput = rows(t, kind="throughput")
    assert tput[0]["samples_per_s_avg"] is None  # printed -inf before the timer's start step
    assert tput[0]["samples_per_s"] == 51.61290322580645 and tput[1]["samples_per_s_avg"] == 50.72
    assert rows(t, kind="memory")[0]["name"] == "Engine after init"
    assert rows(t, kind="memory")[0]["max_reserved_bytes"] == 2 * GIB
    assert len(t) == 75  # the wandb line is nobody's record


def test_deepspeed_2020_bare_timers_memory_breakdown_and_old_throughput():
    t = parse_deepspeed_log(DS_2020)
    assert t.warnings == ()
    assert t.meta.deepspeed_version == "0.3.0"
    memory = rows(t, kind="memory")
    assert [m["step"] for m in memory] == [9, 10]
    assert memory[0]["allocated_bytes"] == round(3.25 * GIB) and memory[0]["max_reserved_bytes"] == 9 * GIB
    assert "mem_allocated" not in t.column("name")
    step = rows(t, kind="step")[0]
    assert (step["step"], step["rank"], step["mom"]) == (10, 0, [[0.9, 0.999]])
    tput = rows(t, kind="throughput")[0]
    assert (tput["epoch"], tput["micro_step"], tput["tput_global_step"]) == (0, 10, None)
    assert tput["samples_per_s_avg"] == 25.7
    assert rows(t, kind="timer", name="step", step=9)[0]["time_ms"] == 90.50
    # Megatron's `forward-compute | batch generator` line on the last line is not DeepSpeed's...
    assert max(t.column("line")) == 7
    # ...but it is Megatron's.
    meg = parse_megatron_log(DS_2020)
    assert [(r["line"], r["name"], r["time_ms"]) for r in meg.rows()] == [
        (8, "forward-compute", 12.00), (8, "batch generator", 0.50)]


def test_deepspeed_pipeline_engine_lines_join_the_step_they_follow():
    t = parse_deepspeed_log(DS_PIPE)
    assert t.warnings == ()
    pipe = rows(t, kind="pipe_step")
    assert [(r["step"], r["loss"], r["iter_time_s"], r["samples_per_s"]) for r in pipe] == [
        (10, 7.2145, 2.54, 100.787), (20, 6.9031, 2.532, 101.106)]
    assert all(r["host"] is None for r in pipe)
    recv = rows(t, kind="timer", name="pipe_recv_input")
    assert [(r["step"], r["time_ms"]) for r in recv] == [(10, 210.40), (20, 209.90)]
    assert rows(t, kind="timer", name="batch_input", step=20)[0]["time_ms"] == 4.05


def test_deepspeed_flops_profiler_current_layout():
    t = parse_deepspeed_log(DS_FLOPS)
    assert t.warnings == ()
    p = rows(t, kind="flops_profile")[0]
    assert p["step"] == 3 and p["line"] == 3
    assert (p["world_size"], p["dp"], p["mp"], p["micro_batch_size"]) == (16, 8, 2, 2)
    expected = {"params_per_gpu": 3.37e9, "params_total": 6.74e9, "fwd_macs_per_gpu": 27.6e12,
                "fwd_flops_per_gpu": 55.21e12, "fwd_flops_total": 110.42e12, "fwd_latency_ms": 402.5,
                "bwd_latency_ms": 1050.0, "step_latency_ms": 85.2, "iter_latency_ms": 1540.0,
                "fwd_flop_per_s_per_gpu": 137.17e12, "bwd_flop_per_s_per_gpu": 105.16e12,
                "fwd_bwd_flop_per_s_per_gpu": 114.03e12, "flop_per_s_per_gpu": 107.55e12, "samples_per_s": 20.78}
    for column, value in expected.items():
        assert p[column] == pytest.approx(value, rel=1e-12), column
    # The timer line after the block still closes step 3.
    assert rows(t, kind="timer", name="fwd")[0]["step"] == 3


def test_deepspeed_flops_profiler_2021_layout():
    p = rows(parse_deepspeed_log(DS_FLOPS_2021), kind="flops_profile")[0]
    assert p["step"] == 5 and p["params_per_gpu"] == pytest.approx(124.44e6)
    assert p["fwd_macs_per_gpu"] == pytest.approx(1.02e12)
    assert p["fwd_flops_per_gpu"] == pytest.approx(2.04e12)  # `fwd flops per GPU = 2 * fwd MACs per GPU`
    assert p["fwd_flop_per_s_per_gpu"] == pytest.approx(52.85e12)
    assert p["step_latency_ms"] == pytest.approx(0.8505)      # printed `850.5 us`
    assert p["samples_per_s"] == 574.79


def test_megatron_deepspeed_file_is_split_between_the_two_parsers():
    ds = parse_deepspeed_log(MDS_COLON)
    assert [r["step"] for r in rows(ds, kind="step")] == [1, 2]
    assert {r["name"] for r in rows(ds, kind="timer")} >= {"optimizer_allgather", "fwd", "bwd_inner_microstep"}
    meg = parse_megatron_log(MDS_COLON)
    assert meg.warnings == ()
    assert {r["kind"] for r in meg.rows()} == {"iteration", "memory"}
    it = rows(meg, kind="iteration")[0]
    assert (it["consumed_tokens"], it["seq_length"], it["samples_per_s"], it["tokens_per_s_per_gpu"],
            it["throughput_tflops_per_gpu"], it["lm_loss"]) == (131072, 4096, 1.524, 780.190, 47.53, 11.20155)
    assert [r["rank"] for r in rows(meg, kind="memory")] == [1, 0]


@pytest.mark.parametrize("line,expected", [
    ("[2023-06-03 00:10:23,345] [INFO] [logging.py:96:log_dist] [Rank 0] rank=0 time (ms) | forward_microstep: 1.0",
     True),
    ("[Rank 0] time (ms) | fwd_microstep: 1136.68 | bwd_microstep: 2443.19", True),
    ("time (ms) | optimizer_allgather: 26.19 | optimizer_gradients: 26.06 | optimizer_step: 128.20", True),
    ("time (ms) | forward-compute: 265.42 | backward-compute: 462.83", False),
    ("time (ms) | forward: 659.86 | backward: 2164.69 | backward-backward: 2164.66 | batch generator: 0.83", False),
    ("time (ms) | load-checkpoint: 0.36", False),
    ("no timers here", False),
])
def test_is_deepspeed_timer_line(line, expected):
    assert is_deepspeed_timer_line(line) is expected


# ---------------------------------------------------------------------------------------------
# Megatron


def test_megatron_bigscience_real_2021():
    t = parse_megatron_log(BIGSCIENCE)
    assert t.warnings == ()
    layout = t.meta.layout
    assert {k: layout[k] for k in ("world_size", "tp", "pp", "dp", "micro_batch_size", "global_batch_size",
                                   "seq_length", "hidden_size", "num_layers", "num_attention_heads",
                                   "ffn_hidden_size", "train_iters")} == {
        "world_size": 32, "tp": 4, "pp": 8, "dp": 1, "micro_batch_size": 1, "global_batch_size": 4,
        "seq_length": 1024, "hidden_size": 7168, "num_layers": 48, "num_attention_heads": 32,
        "ffn_hidden_size": 28672, "train_iters": 1000}
    args = t.meta.args
    assert len(args) == 138
    assert args["lr"] == 0.00015 and args["fp16"] is True and args["bert_load"] is None
    assert args["split"] == "949,50,1" and args["params_dtype"] == "torch.float16"
    ranks = {(p["tp_rank"], p["pp_rank"]): p["params"] for p in t.meta.rank_parameters}
    assert len(ranks) == 32 and ranks[(0, 0)] == 1023350272 and ranks[(3, 7)] == 1016024576

    its = rows(t, kind="iteration")
    assert [r["iteration"] for r in its] == list(range(10, 210, 10))
    first = its[0]
    assert "iteration       10/    1000" in line_of(BIGSCIENCE, first["line"])
    assert (first["train_iters"], first["consumed_samples"], first["elapsed_ms_per_iteration"],
            first["learning_rate"], first["global_batch_size"], first["loss_scale"], first["skipped_iterations"],
            first["nan_iterations"]) == (1000, 40, 3171.3, 0.0, 4, 8388608.0, 10, 0)
    assert first["lm_loss"] is None and first["grad_norm"] is None and first["losses"] == {}
    third = its[2]
    assert (third["lm_loss"], third["grad_norm"], third["loss_scale"]) == (26.48119, 67.033, 16384.0)
    assert third["timestamp"] is None

    setup = rows(t, kind="timer", name="load-checkpoint")[0]
    assert setup["iteration"] is None and setup["time_ms"] == 0.36
    fc = rows(t, kind="timer", name="forward-compute")
    assert (fc[0]["iteration"], fc[0]["time_ms"]) == (10, 265.42)
    assert len(fc) == 20
    assert rows(t, kind="timer", name="batch-generator", iteration=10)[0]["time_ms"] == 2.87

    memory = rows(t, kind="memory")
    assert len(memory) == 32 and sorted(m["rank"] for m in memory) == list(range(32))
    assert all(m["iteration"] == 20 and m["name"] == "(after 20 iterations)" for m in memory)
    r3 = next(m for m in memory if m["rank"] == 3)
    assert r3["allocated_bytes"] == round(19539.361328125 * MIB)
    assert r3["max_allocated_bytes"] == round(22112.8125 * MIB) and r3["max_reserved_bytes"] == round(26880.0 * MIB)
    # Ranks 25 and 27 were printed onto one line.
    assert next(m for m in memory if m["rank"] == 25)["line"] == next(m for m in memory if m["rank"] == 27)["line"]

    val = rows(t, kind="validation")
    assert [(v["iteration"], v["lm_loss"], v["extra"]["lm loss PPL"]) for v in val] == [
        (100, 8.095942, 3281.128), (200, 7.645013, 2090.196)]


def test_megatron_deepspeed_alcf_key_value_lines_and_minmax_timers():
    t = parse_megatron_log(ALCF)
    assert t.warnings == ()
    its = rows(t, kind="iteration")
    assert [r["iteration"] for r in its] == list(range(136004, 136011))
    it = its[0]
    assert (it["train_iters"], it["consumed_samples"], it["consumed_tokens"], it["elapsed_ms_per_iteration"],
            it["learning_rate"], it["global_batch_size"], it["lm_loss"], it["loss_scale"], it["grad_norm"],
            it["seq_length"], it["skipped_iterations"], it["nan_iterations"], it["samples_per_s"],
            it["tokens_per_s_per_gpu"], it["throughput_tflops_per_gpu"]) == (
        136100, 835608576, 6845305454592, 3415.3, 2.0127e-05, 6144, 12.316531, 1.0, 1020.352, 8192, 0, 0,
        1798.971, 4797.255, 53.66)
    assert it["timestamp"] == "2025-11-10 09:43:36,161992"
    fb = rows(t, kind="timer", name="forward-backward")
    assert [(r["iteration"], r["time_min_ms"], r["time_max_ms"]) for r in fb][:2] == [
        (136004, 3198.27, 3199.53), (136005, 3194.05, 3195.63)]
    assert fb[0]["time_ms"] == fb[0]["time_max_ms"]
    assert not rows(t, name="fwd_microstep")  # DeepSpeed's timers stay out
    val = rows(t, kind="validation")[0]
    # `lm loss value=2.697780lm loss PPL=14.846734`: two fields glued together.
    assert (val["iteration"], val["lm_loss"], val["extra"]) == (137650, 2.69778, {"lm loss PPL": 14.846734})
    assert val["name"] == "on 122880-sample draw from validation set"
    assert t.meta.rank_parameters == [{"tp_rank": 0, "pp_rank": 0, "params": 1986054144}]


def test_megatron_2025_minmax_moe_layout():
    t = parse_megatron_log(MEGATRON_2025)
    assert t.warnings == ()
    layout = t.meta.layout
    assert {k: layout[k] for k in ("world_size", "tp", "pp", "dp", "cp", "ep", "sp", "vpp", "zero_stage")
            if k in layout} == {"world_size": 16, "tp": 4, "pp": 2, "dp": 2, "cp": 1, "ep": 2, "sp": True,
                                "vpp": None}
    assert t.meta.theoretical_memory_bytes == {"weight_and_optimizer": round(14932.50 * MIB),
                                                  "activation": round(22118.75 * MIB),
                                                  "total": round(37051.25 * MIB)}
    setup = rows(t, kind="timer", name="model-and-optimizer-setup")[0]
    assert (setup["iteration"], setup["time_min_ms"], setup["time_max_ms"]) == (None, 5012.33, 5020.87)
    its = rows(t, kind="iteration")
    assert its[0]["timestamp"] == "2025-03-04 11:00:41"
    assert its[0]["losses"] == {"lm loss": 10.93125, "load_balancing_loss": 1.05231, "mtp_1 loss": 11.01245}
    assert (its[0]["throughput_tflops_per_gpu"], its[0]["num_zeros"]) == (98.4, 0.0)
    third = its[2]
    assert third["skipped_samples"] == 16 and math.isnan(third["grad_norm"])
    assert third["extra"] == {"energy per GPU (J/iter/GPU)": 17250.4, "power per GPU (W/GPU)": 597.3}
    assert (third["skipped_iterations"], third["nan_iterations"]) == (1, 1)
    memory = rows(t, kind="memory", iteration=1)
    assert [(m["rank"], m["max_allocated_bytes"]) for m in memory] == [
        (0, round(36210.80 * MIB)), (4, round(35890.10 * MIB))]
    assert len(rows(t, kind="timer", iteration=2)) == 9
    val = rows(t, kind="validation")
    assert [(v["name"], v["lm_loss"]) for v in val] == [("on validation set", 10.89012), ("on test set", 10.9011)]
    assert val[0]["losses"] == {"lm loss": 10.89012, "mtp_1 loss": 10.9773}


def test_megatron_max_only_and_all_ranks_timers():
    t = parse_megatron_log(MEGATRON_TIMERS)
    assert t.warnings == ()
    fc = rows(t, kind="timer", name="forward-compute")[0]
    assert (fc["iteration"], fc["time_ms"], fc["time_max_ms"], fc["time_min_ms"]) == (4, 470.12, 470.12, None)
    fb = rows(t, kind="timer", name="forward-backward", iteration=5)
    assert [(r["rank"], r["time_ms"]) for r in fb] == [(0, 1475.20), (1, 1476.05)]
    mem = rows(t, kind="memory")[0]
    assert (mem["iteration"], mem["name"]) == (5, "(before save_checkpoint for iteration 5)")
    assert rows(t, kind="validation")[0]["name"] is None


def test_megatron_world_line_without_arguments_dump():
    text = ("using world size: 8, data-parallel-size: 2, tensor-model-parallel size: 2, "
            "pipeline-model-parallel size: 2 \n"
            " iteration        1/      10 | consumed samples:            8 | elapsed time per iteration (ms): 10.0 |\n")
    t = parse_megatron_log(text, source="inline.log")
    assert t.meta.layout == {"world_size": 8, "dp": 2, "tp": 2, "pp": 2}
    assert t.source == "inline.log" and len(t) == 1


# ---------------------------------------------------------------------------------------------
# Truncated and garbled input


def test_deepspeed_cut_last_line_keeps_complete_fields_and_warns(tmp_path):
    text = ALCF.read_text(encoding="utf-8")
    cut_at = text.index("step: 160.79") + len("step: 16")
    path = tmp_path / "cut.log"
    path.write_text(text[:cut_at], encoding="utf-8")
    t = parse_deepspeed_log(path)
    n = text[:cut_at].count("\n") + 1
    assert any(w.startswith(f"{path}:{n}:") and "cut short" in w for w in t.warnings)
    last = rows(t, line=n)
    assert [r["name"] for r in last] == ["fwd", "bwd", "bwd_inner", "bwd_allreduce"]  # `step: 16` dropped
    assert last[0]["time_ms"] == 715.40


def test_megatron_cut_iteration_line_and_unterminated_arguments(tmp_path):
    text = BIGSCIENCE.read_text(encoding="utf-8")
    marker = "number of skipped iterations:   8 | number of nan it"
    cut_at = text.index(marker) + len(marker)
    t = parse_megatron_log(text[:cut_at], source="cut.out")
    n = text[:cut_at].count("\n") + 1
    assert any(w.startswith(f"cut.out:{n}:") and "cut short" in w for w in t.warnings)
    last = rows(t, kind="iteration")[-1]
    assert last["iteration"] == 20 and last["skipped_iterations"] == 8 and last["nan_iterations"] is None

    args_cut = text[:text.index("  hidden_size ....") + 20]
    t = parse_megatron_log(args_cut, source="args.out")
    assert any("arguments dump has no end line" in w and w.startswith("args.out:") for w in t.warnings)
    assert t.meta.layout["global_batch_size"] == 4 and "hidden_size" not in t.meta.args


def test_garbled_lines_are_skipped_with_a_warning_never_raised(tmp_path):
    garbage = "\n".join([
        "[2024-01-01 00:00:00,000] [INFO] [logging.py:96:log_dist] [Rank 0] step=5, skipped=0, lr=[nan], mom=[(0.9, ",
        "[Rank 0] time (ms) | fwd: 1e999999 | bwd: ??? | step: 1.0",
        "epoch=0/micro_step=1/global_step=1, RunningAvgSamplesPerSec=inf, CurrSamplesPerSec=nan, MemAllocated=xGB",
        " iteration 99999999999999999999999/1 | consumed samples: 1e400 | lm loss: nan | grad norm: abc |",
        "[Rank 7] (after 3 iterations) memory (MB) | allocated: 1.0 | reserved:",
        "(min, max) time across ranks (ms):",
        "    forward-backward ......: (1.0, ",
        "-------------------------- DeepSpeed Flops Profiler --------------------------",
        "fwd latency:                        12 parsecs",
        "\x00\x01\x02 binary \ufffd",
        "",
    ])
    path = tmp_path / "garbage.log"
    path.write_bytes(garbage.encode("utf-8") + b"\xff\xfe not utf-8\n")
    ds = parse_deepspeed_log(path)
    meg = parse_megatron_log(path)
    assert isinstance(ds, Table) and isinstance(meg, Table)
    assert any("not UTF-8" in w for w in ds.warnings)
    assert any(w.startswith(f"{path}:2:") and "'bwd: ???' not understood" in w for w in ds.warnings)
    assert any(w.startswith(f"{path}:9:") and "parsecs" in w for w in ds.warnings)
    step = rows(ds, kind="step")[0]
    assert step["step"] == 5 and step["mom"] is None and math.isnan(step["lr"])
    it = rows(meg, kind="iteration")[0]
    assert it["consumed_samples"] is None and math.isnan(it["lm_loss"]) and it["extra"]["grad norm"] == "abc"
    assert rows(meg, kind="memory")[0]["rank"] == 7
    assert any("memory report without" in w for w in meg.warnings)


def test_empty_and_foreign_inputs_give_empty_tables_and_a_warning(tmp_path):
    for parse in (parse_deepspeed_log, parse_megatron_log):
        t = parse("", source="empty.log")
        assert len(t) == 0 and t.warnings and t.warnings[-1].startswith("empty.log:")
        t = parse(Path(tmp_path / "missing.log"))
        assert len(t) == 0 and any(w.endswith("missing.log: does not exist; not read") for w in t.warnings)


# ---------------------------------------------------------------------------------------------
# Sniffing by content


def test_sniff_recognises_content_not_names(tmp_path):
    for src, ds, meg in [(ALCF, "deepspeed_log", "megatron_log"), (BIGSCIENCE, None, "megatron_log"),
                         (DS_2023, "deepspeed_log", None), (DS_FLOPS_2021, "deepspeed_log", None),
                         (DS_PIPE, "deepspeed_log", None), (MEGATRON_TIMERS, None, "megatron_log")]:
        renamed = tmp_path / f"events.out.tfevents.{src.stem}"  # a misleading name changes nothing
        shutil.copy(src, renamed)
        assert deepspeed_log.sniff(renamed) == ds, src.name
        assert megatron_log.sniff(renamed) == meg, src.name
        assert tensorboard.sniff(renamed) is None
    # 200 KB of launcher noise before training: the tail window still finds Megatron's lines.
    noisy = tmp_path / "slurm-123.out"
    noisy.write_text("+ export FOO=bar\n" * 12_000 + BIGSCIENCE.read_text(encoding="utf-8")[-30_000:])
    assert megatron_log.sniff(noisy) == "megatron_log"
    plain = tmp_path / "notes.txt"
    plain.write_text("step 1: buy milk\niteration is fun\n")
    assert deepspeed_log.sniff(plain) is None and megatron_log.sniff(plain) is None
    assert deepspeed_log.sniff(tmp_path / "missing") is None


# ---------------------------------------------------------------------------------------------
# TensorBoard


def _write_events(logdir: Path) -> None:
    from tensorboard.compat.proto import (
        event_pb2,
        summary_pb2,
        tensor_pb2,
        tensor_shape_pb2,
    )
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    def scalar_tensor(x: float) -> tensor_pb2.TensorProto:
        return tensor_pb2.TensorProto(dtype=1, float_val=[x], tensor_shape=tensor_shape_pb2.TensorShapeProto())

    # torch-SummaryWriter style: simple_value, no metadata.
    writer = EventFileWriter(str(logdir / "megatron"))
    for step in range(1, 6):
        writer.add_event(event_pb2.Event(wall_time=1_700_000_000.0 + step, step=step, summary=summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag="lm loss", simple_value=10.0 / step),
                   summary_pb2.Summary.Value(tag="iteration-time", simple_value=0.5)])))
    writer.close()
    # TF2 style: scalars-plugin metadata on the first value only; a text summary to be skipped.
    writer = EventFileWriter(str(logdir / "tf2" / "train"))
    scalars = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
    text = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
    for step in range(3):
        values = [summary_pb2.Summary.Value(tag="throughput", tensor=scalar_tensor(100.0 + step),
                                            metadata=scalars if step == 0 else None),
                  summary_pb2.Summary.Value(tag="notes", metadata=text if step == 0 else None,
                                            tensor=tensor_pb2.TensorProto(dtype=7, string_val=[b"hi"]))]
        writer.add_event(event_pb2.Event(wall_time=1_700_000_100.0 + step, step=step,
                                         summary=summary_pb2.Summary(value=values)))
    writer.close()


def _event_file(directory: Path) -> Path:
    return next(p for p in directory.iterdir() if p.is_file())


def test_tensorboard_reads_scalars_of_both_writer_styles(tmp_path):
    _write_events(tmp_path)
    t = parse_tensorboard(tmp_path)
    assert t.warnings == ()
    assert len(rows(t, tag="lm loss")) == 5 and len(rows(t, tag="iteration-time")) == 5
    loss = rows(t, tag="lm loss")
    assert [(r["step"], r["value"], r["wall_time_s"], r["run"]) for r in loss][:2] == [
        (1, 10.0, 1_700_000_001.0, "megatron"), (2, 5.0, 1_700_000_002.0, "megatron")]
    tput = rows(t, tag="throughput")
    assert [(r["step"], r["value"], r["run"]) for r in tput] == [
        (0, 100.0, os.path.join("tf2", "train")), (1, 101.0, os.path.join("tf2", "train")),
        (2, 102.0, os.path.join("tf2", "train"))]
    assert not rows(t, tag="notes")
    assert sorted(f["records"] for f in t.meta.files) == [4, 6]  # + the file_version event each
    assert tensorboard.sniff(tmp_path) == "tensorboard"
    assert tensorboard.sniff(_event_file(tmp_path / "megatron")) == "tensorboard"
    single = parse_tensorboard(_event_file(tmp_path / "megatron"), source="one")
    assert len(single) == 10 and set(single.column("run")) == {"."} and single.source == "one"


def test_tensorboard_truncated_final_record_keeps_the_rest_and_warns(tmp_path):
    _write_events(tmp_path)
    path = _event_file(tmp_path / "megatron")
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(size - 7)
    t = parse_tensorboard(tmp_path)
    assert len(rows(t, tag="lm loss")) == 4 and len(rows(t, tag="throughput")) == 3
    warning = next(w for w in t.warnings if str(path) in w)
    assert "byte " in warning and "not a complete record" in warning


def test_tensorboard_corrupt_and_foreign_files(tmp_path):
    _write_events(tmp_path)
    path = _event_file(tmp_path / "megatron")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte fails the record's CRC
    path.write_bytes(bytes(data))
    t = parse_tensorboard(tmp_path / "megatron")
    assert 0 < len(t) < 10 and any("not a complete record" in w for w in t.warnings)
    text_file = tmp_path / "log.txt"
    text_file.write_text("not an event file\n")
    assert tensorboard.sniff(text_file) is None
    t = parse_tensorboard(text_file)
    assert len(t) == 0 and t.warnings
    assert parse_tensorboard(tmp_path / "nowhere").warnings[0].endswith("no such file or directory")
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    assert tensorboard.sniff(empty) is None and "no TensorBoard event files" in parse_tensorboard(empty).warnings[0]


# ---------------------------------------------------------------------------------------------
# Properties: any cut or garbage is read without an exception, and what is read agrees with the
# whole file.

_TEXTS = {p: p.read_text(encoding="utf-8") for p in set(DS_FILES + MEGATRON_FILES)}
_FULL_DS = {p: parse_deepspeed_log(_TEXTS[p]) for p in DS_FILES}
_FULL_MEGATRON = {p: parse_megatron_log(_TEXTS[p]) for p in MEGATRON_FILES}
_PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _agrees(part: dict, whole: dict, fields) -> bool:
    for f in fields:
        a, b = part[f], whole[f]
        if a is None:
            continue
        if isinstance(a, dict):
            if any(k not in b or not (b[k] == v or (v != v and b[k] != b[k])) for k, v in a.items()):
                return False
        elif not (a == b or (isinstance(a, float) and a != a and b != b)):
            return False
    return True


@_PROPERTY
@given(st.sampled_from(DS_FILES), st.floats(0, 1))
def test_property_deepspeed_prefix_agrees_with_whole(path, fraction):
    text = _TEXTS[path]
    part = parse_deepspeed_log(text[:int(len(text) * fraction)])
    whole = {(r["line"], r["kind"], r["name"]): r for r in _FULL_DS[path].rows()}
    for row in part.rows():
        if row["kind"] in ("timer", "step", "throughput", "pipe_step"):
            key = (row["line"], row["kind"], row["name"])
            assert key in whole
            assert _agrees(row, whole[key], ("time_ms", "skipped", "lr", "samples_per_s", "allocated_bytes",
                                              "epoch", "micro_step", "loss"))


@_PROPERTY
@given(st.sampled_from(MEGATRON_FILES), st.floats(0, 1))
def test_property_megatron_prefix_agrees_with_whole(path, fraction):
    text = _TEXTS[path]
    part = parse_megatron_log(text[:int(len(text) * fraction)])
    whole = {(r["line"], r["kind"], r["name"], r["rank"]): r for r in _FULL_MEGATRON[path].rows()}
    fields = [c for c in megatron_log.COLUMNS if c not in ("kind", "line", "name", "rank")]
    for row in part.rows():
        key = (row["line"], row["kind"], row["name"], row["rank"])
        assert key in whole
        assert _agrees(row, whole[key], fields)


@_PROPERTY
@given(st.sampled_from(sorted(set(DS_FILES + MEGATRON_FILES))), st.floats(0, 1),
       st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200))
def test_property_garbage_anywhere_never_raises(path, fraction, junk):
    text = _TEXTS[path]
    at = int(len(text) * fraction)
    garbled = text[:at] + junk + text[at:]
    for parse in (parse_deepspeed_log, parse_megatron_log):
        table = parse(garbled, source="garbled.log")
        assert isinstance(table, Table)
        assert all(w.startswith("garbled.log") for w in table.warnings)


@pytest.fixture(scope="module")
def event_bytes(tmp_path_factory):
    root = tmp_path_factory.mktemp("tb")
    _write_events(root)
    return _event_file(root / "megatron").read_bytes()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 10_000), st.binary(max_size=64))
def test_property_tensorboard_any_cut_never_raises(tmp_path, event_bytes, cut, junk):
    path = tmp_path / f"cut_{cut}_{len(junk)}"
    data = event_bytes[:cut % (len(event_bytes) + 1)] + junk
    path.write_bytes(data)
    t = parse_tensorboard(path)
    assert len(t) <= 10
    assert all(r["tag"] in ("lm loss", "iteration-time") for r in t.rows())


def test_analysis_parsers_do_not_import_torch(tmp_path):
    _write_events(tmp_path)
    code = ("import sys\n"
            "from analysis.parsers.deepspeed_log import parse_deepspeed_log\n"
            "from analysis.parsers.megatron_log import parse_megatron_log\n"
            "from analysis.parsers.tensorboard import parse_tensorboard\n"
            f"parse_deepspeed_log({str(ALCF)!r}); parse_megatron_log({str(BIGSCIENCE)!r})\n"
            f"assert len(parse_tensorboard({str(tmp_path)!r})) == 13\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_tensorboard_values_past_float32_and_negative_steps_are_dropped(tmp_path):
    """A float64 tensor summary can hold 1e300 and a damaged event a negative step; inf stays (a diverged loss)."""
    from tensorboard.compat.proto import (
        event_pb2,
        summary_pb2,
        tensor_pb2,
        tensor_shape_pb2,
    )
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(tmp_path / "run"))
    scalars = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
    for step, x in ((1, 2.0), (2, 1e300), (3, float("inf")), (-4, 1.0)):
        value = summary_pb2.Summary.Value(tag="loss", metadata=scalars, tensor=tensor_pb2.TensorProto(
            dtype=2, double_val=[x], tensor_shape=tensor_shape_pb2.TensorShapeProto()))
        writer.add_event(event_pb2.Event(wall_time=1_700_000_000.0 + abs(step), step=step,
                                         summary=summary_pb2.Summary(value=[value])))
    writer.close()
    t = parse_tensorboard(tmp_path)
    assert [(r["step"], r["value"]) for r in t.rows()] == [(1, 2.0), (2, None), (3, float("inf")), (None, 1.0)]
    assert sorted(w.split(": ", 1)[1] for w in t.warnings) == [
        "1 value(s) of step dropped as physically impossible (negative or past 64 bits)",
        "1 value(s) of value dropped as physically impossible (finite but past float32's range)"]
