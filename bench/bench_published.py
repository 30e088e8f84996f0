"""The planner's tokens/s/GPU and memory against published BF16 runs of dense Llama training, in one invocation.

    python bench/bench_published.py

Plans each row below (the torch backend: FSDP2, DTensor TP with sequence parallelism, as torchtitan trains) on the
hardware profile of the GPUs that ran it, and prints predicted / measured tokens/s/GPU and memory for each, with
the mean absolute percentage error (MAPE) of the rows the profiles' figures were fitted on ("fit") and of the rows
kept aside to check the model ("check"). Baseline, computed in the same run: the old model, the same plan with its
compute at a fixed 40% of dense peak (45% on A100), the planner's step time before launch/plan/compute.py.
Target: MAPE <= 15% on the check rows; no row that ran in 80 GB planned not to fit an 80 GB card.

Then the published LoRA fine-tunes (LORA_ROWS), planned with their [peft] section, printed apart and in no MAPE: they
are plan only, since their layouts use TP (and Megatron's PP) with adapters, which our trainers refuse
(launch/config/resolve.py); the Megatron-Bridge row ran in FP8 and is planned in bf16 (the profiles have no FP8 peak).
"""
from _cli import help_or_usage  # bench/ is the folder of the script run (python bench/NAME.py)

help_or_usage(__doc__)

import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launch.config.grid import RankGrid  # noqa: E402
from launch.config.hardware import load_profile  # noqa: E402
from launch.config.models import load_model  # noqa: E402
from launch.config.schema import PeftSection  # noqa: E402
from launch.plan.build import make_plan  # noqa: E402
from launch.plan.layout import Layout  # noqa: E402

GiB = 2**30
TT_H100 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Dec 2024; H100 96GB HBM2e, 500 W)"
TT_ASYNC = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (vanilla TP column)"
TT_A100 = "pytorch/torchtitan docs/performance.md @3faaa1a0d (Aug 2024; 64 A100 80GB, local batch 1)"
# The old model's fixed share of dense peak, by profile (the shipped profiles' achievable_mfu before the compute model).
OLD_MFU = {"h100-hbm2e-96gb": 0.40, "h100-sxm": 0.40, "a100-80gb": 0.45}
OLD_PEAK = {"h100-hbm2e-96gb": 989e12}  # the old model knew only the SXM datasheet's peak


@dataclass(frozen=True)
class Row:
    label: str
    source: str
    model: str
    hardware: str
    world: int
    tp: int
    activation_checkpointing: str  # torchtitan's "selective" rows ran its op policy, ours under that name
    compile: bool
    local_batch: int
    seq_len: int
    tokens_per_s: float  # per GPU
    memory_gib: float | None  # the largest rank's, as published (None: not published)
    role: str  # "fit": the profile's efficiency figures were fitted on it; "check": kept aside


ROWS = (
    Row("8B FSDP 8, selective", TT_H100, "llama-3.1-8b", "h100-hbm2e-96gb", 8, 1, "selective", False, 2, 8192, 5762,
        82.4, "fit"),
    Row("8B FSDP 8, selective, compile", TT_H100, "llama-3.1-8b", "h100-hbm2e-96gb", 8, 1, "selective", True, 2, 8192,
        6667, 77.0, "check"),
    Row("8B FSDP 128, selective", TT_H100, "llama-3.1-8b", "h100-hbm2e-96gb", 128, 1, "selective", False, 2, 8192,
        5605, 67.0, "check"),
    Row("8B FSDP 128, selective, compile", TT_H100, "llama-3.1-8b", "h100-hbm2e-96gb", 128, 1, "selective", True, 2,
        8192, 6514, 62.0, "check"),
    Row("8B FSDP 8 x TP 8, selective, compile", TT_ASYNC, "llama-3.1-8b", "h100-hbm2e-96gb", 64, 8, "selective", True,
        12, 8192, 4378, None, "check"),
    Row("70B FSDP 32 x TP 8, full, compile", TT_ASYNC, "llama-3.1-70b", "h100-hbm2e-96gb", 256, 8, "full", True, 16,
        8192, 597.3, None, "check"),
    Row("8B FSDP 64, selective", TT_A100, "llama-3.1-8b", "a100-80gb", 64, 1, "selective", False, 1, 8192, 2904, None,
        "fit"),
    Row("70B FSDP 64, full", TT_A100, "llama-3.1-70b", "a100-80gb", 64, 1, "full", False, 1, 8192, 331, None, "check"),
)


AUTOMODEL = ("NVIDIA-NeMo/Automodel docs/performance-summary.mdx @ cb976544 (NeMo AutoModel, PyTorch FSDP2 + TP; "
             "https://docs.nvidia.com/nemo/automodel/latest/performance-summary.html), Fine-Tuning (LoRA), DGX-H100, BF16; "
             "layouts from its examples/llm_benchmark recipes: rank 16, alpha 32, every *_proj")
MEGATRON_BRIDGE = ("NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md @ 4ab94dfa, 26.06 NeMo Container, "
                   "LoRA Performance (https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary-archive.html)")

# Why the 8B row ran in 80 GB where peft's layout, planned here, does not fit: read in NVIDIA-NeMo/Automodel @ 507bfb75
# (the commit that added the row and its recipe, examples/llm_finetune/llama3_1/llama3_1_8b_peft_benchmark.yaml).
AUTOMODEL_DROPOUT = ("AutoModel's LoRA (nemo_automodel/components/_peft/lora.py) drops the adapter's output "
                     "(dropout_position='post': a 1-byte mask per output) in the base's bf16, where peft, which our "
                     "trainers run and the plan follows (recipes/rehearsed.json), saves a dropped-out fp32 copy of each "
                     "adapter's input; and Liger's SwiGLU and RMSNorm (applied to its HF Llama by default) save less "
                     "than transformers' own")


@dataclass(frozen=True)
class LoraRow:
    label: str
    source: str
    model: str
    backend: str  # torch: FSDP2 (+ DTensor TP); megatron: its distributed optimizer, TP, interleaved PP
    world: int
    tp: int
    pp: int
    vpp: int
    micro_batch: int
    global_batch: int
    seq_len: int
    activation_checkpointing: str
    compile: bool  # AutoModel's enable_compile
    dropout: float
    tokens_per_s: float  # per GPU, as published
    precision: str  # as published; planned in bf16


LORA_ROWS = (
    LoraRow("8B LoRA, 1 GPU", AUTOMODEL, "llama-3.1-8b", "torch", 1, 1, 1, 1, 2, 32, 4096, "none", False, 0.1, 12472.87,
            "bf16"),
    LoraRow("70B LoRA, FSDP 4 x TP 2", AUTOMODEL, "llama-3.1-70b", "torch", 8, 2, 1, 1, 2, 32, 4096, "full", True, 0.0,
            1091.85, "bf16"),
    LoraRow("70B LoRA, FSDP 8 x TP 2 (2 nodes)", AUTOMODEL, "llama-3.1-70b", "torch", 16, 2, 1, 1, 2, 32, 4096, "full",
            True, 0.0, 984.85, "bf16"),
    LoraRow("70B LoRA, TP 2 x PP 4, VP 20", MEGATRON_BRIDGE, "llama-3.1-70b", "megatron", 8, 2, 4, 20, 1, 32, 4096,
            "none", False, 0.0, 2643, "fp8"),
)


def lora_layout(row: LoraRow) -> Layout:
    dp = row.world // (row.tp * row.pp)
    grid = RankGrid(row.tp, row.pp, dp, min(8, row.world), max(1, row.world // 8))
    return Layout(backend=row.backend, model=load_model(row.model), hardware=load_profile("h100-sxm"), grid=grid,
                  zero_stage=3 if row.backend == "torch" else 1, dtype="bf16", micro_batch_size=row.micro_batch,
                  global_batch_size=row.global_batch, seq_len=row.seq_len,
                  activation_checkpointing=row.activation_checkpointing, compile=row.compile, sp=False, vpp=row.vpp,
                  peft=PeftSection(method="lora", rank=16, alpha=32.0, dropout=row.dropout))


def lora_main() -> None:
    print(f"\nLoRA fine-tunes (plan only: TP/PP with adapters; bf16 plans)\n{'row':36} {'prec':4} {'pred':>7} {'meas':>7} "
          f"{'p/m':>5} {'MFU':>5} {'mem GiB':>7} {'80 GB':>6}")
    notes = []
    for row in LORA_ROWS:
        plan = make_plan(lora_layout(row))
        worst = plan.worst()
        pred = plan.step.tokens_per_s_per_device
        print(f"{row.label:36} {row.precision:4} {pred:7.0f} {row.tokens_per_s:7.0f} {pred / row.tokens_per_s:5.2f} "
              f"{plan.step.mfu:5.1%} {worst.memory[worst.implementation].total / GiB:7.1f} "
              f"{'fits' if plan.fits else 'no':>6}")
        if row.dropout > 0 and row.source == AUTOMODEL:
            bare = make_plan(lora_layout(replace(row, dropout=0.0)))
            print(f"  {'without adapter dropout':34} {'':4} {'':7} {'':7} {'':5} {'':5} "
                  f"{bare.worst().memory[bare.worst().implementation].total / GiB:7.1f} {'fits' if bare.fits else 'no':>6}")
            notes.append(f"{row.label}: {AUTOMODEL_DROPOUT}")
    print("sources: " + "; ".join(sorted({r.source for r in LORA_ROWS})))
    for note in notes:
        print(f"note: {note}")


def layout(row: Row) -> Layout:
    dp = row.world // row.tp
    grid = RankGrid(row.tp, 1, dp, min(8, row.world), max(1, row.world // 8))
    return Layout(backend="torch", model=load_model(row.model), hardware=load_profile(row.hardware), grid=grid,
                  zero_stage=3, dtype="bf16", micro_batch_size=row.local_batch, global_batch_size=row.local_batch * dp,
                  seq_len=row.seq_len, activation_checkpointing=row.activation_checkpointing, compile=row.compile,
                  sp=row.tp > 1)


def old_tokens_per_s(row: Row, plan) -> float:
    """The same plan with the old fixed-MFU compute in place of the compute model's."""
    s, lay = plan.step, layout(row)
    peak = OLD_PEAK.get(row.hardware, lay.hardware.peak_flops("bf16"))
    old_compute = s.hardware_flops_per_step / lay.grid.world / (peak * OLD_MFU[row.hardware])
    # the bubble is 0 here (no pipeline); the exposed communication hides behind the old compute as it did
    total = s.total_s - s.compute_s + old_compute
    return lay.global_batch_size * lay.seq_len / total / lay.grid.world


def mape(pairs) -> float:
    return 100 * statistics.fmean(abs(p / m - 1) for p, m in pairs) if pairs else float("nan")


def main() -> None:
    print(f"{'row':40} {'role':5} {'pred':>7} {'meas':>7} {'p/m':>5} {'old':>7} {'old/m':>5} "
          f"{'MFU':>5} {'mem GiB':>7} {'meas':>5} {'80 GB':>6}")
    now, before, refused = {"fit": [], "check": []}, {"fit": [], "check": []}, []
    for row in ROWS:
        plan = make_plan(layout(row))
        s = plan.step
        worst = plan.worst()
        mem = worst.memory[worst.implementation].total / GiB
        on_80 = make_plan(replace(layout(row), hardware=replace(load_profile(row.hardware), memory_bytes=80 * 10**9)))
        fits_80 = on_80.fits
        if row.memory_gib is not None and row.memory_gib * GiB <= 80 * 10**9 * 0.9 and not fits_80:
            refused.append(row.label)
        old = old_tokens_per_s(row, plan)
        now[row.role].append((s.tokens_per_s_per_device, row.tokens_per_s))
        before[row.role].append((old, row.tokens_per_s))
        print(f"{row.label:40} {row.role:5} {s.tokens_per_s_per_device:7.0f} {row.tokens_per_s:7.0f} "
              f"{s.tokens_per_s_per_device / row.tokens_per_s:5.2f} {old:7.0f} {old / row.tokens_per_s:5.2f} "
              f"{s.mfu:5.1%} {mem:7.1f} {row.memory_gib if row.memory_gib else '-':>5} {'fits' if fits_80 else 'no':>6}")
    print()
    for role in ("fit", "check"):
        print(f"MAPE {role:5} rows: compute model {mape(now[role]):5.1f}%   old fixed-MFU model {mape(before[role]):5.1f}%"
              f"   ({len(now[role])} rows)")
    print(f"MAPE all rows:   compute model {mape(now['fit'] + now['check']):5.1f}%   "
          f"old fixed-MFU model {mape(before['fit'] + before['check']):5.1f}%")
    print("rows that ran within 90% of 80 GB but are planned not to fit an 80 GB card: "
          + (", ".join(refused) if refused else "none"))
    print("sources: " + "; ".join(sorted({r.source for r in ROWS})))
    lora_main()


if __name__ == "__main__":
    main()
