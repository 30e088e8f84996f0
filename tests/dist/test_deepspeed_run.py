"""What one real DeepSpeed run leaves behind, and what the planner said about it."""
import json

import pytest

from launch.run.metrics import iter_records, read_metrics
from launch.plan.layout import Layout
from launch.plan.memory import zero3_partition_numel
from launch.config.resolve import Resolved
from tests.dist.conftest import DS_DP2, SHORT, ds_autotp, train

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.mark.parametrize("gpus, tp", [pytest.param(2, 1, id="zero3_dp2"),
                                      pytest.param(4, 2, id="tp2_zero3_dp2", marks=pytest.mark.full)])  # 4 ranks
def test_zero3_partitions_match_planner(shared_run, gpus, tp):
    t = shared_run(*(DS_DP2[3] if tp == 1 else ds_autotp(gpus, 3)))  # the parity tests' runs of these layouts
    resolved = Resolved.load(t.root / "resolved.json")
    predicted = zero3_partition_numel(Layout.from_resolved(resolved))
    total = resolved.model.param_counts().total
    for rank in range(gpus):
        meta = t.metrics(rank).meta
        assert meta.param_numel_local == predicted, (rank, meta.param_numel_local, predicted)
    assert predicted < total / (gpus - 1)  # really partitioned, not replicated


def test_run_directory_metrics_tensorboard_and_trace(shared_run):
    t = shared_run(*DS_DP2[2])  # ZeRO-2 on 2 ranks with a profiler trace of one step
    root = t.root
    for name in ("resolved.json", "plan.json", "env.json", "launch_cmd.txt"):
        assert (root / name).is_file(), name
    env = json.loads((root / "env.json").read_text())
    assert env["packages"]["deepspeed"] == "0.19.8" and env["packages"]["torch"].startswith("2.13.0")
    assert "torch.distributed.run" in (root / "launch_cmd.txt").read_text()
    for rank in (0, 1):
        lines = list(iter_records(root / "metrics" / f"rank{rank}.jsonl"))
        assert all(problem is None for _, _, problem in lines)  # every record validates against the schema
        m = read_metrics(root / "metrics" / f"rank{rank}.jsonl")
        assert m.meta.rank == rank and m.meta.world_size == 2 and m.meta.dp == 2 and m.meta.flops_formula
        assert [s.step for s in m.steps] == list(range(1, 11))
        assert [s.warmup for s in m.steps] == [True, True] + [False] * 8
        s = m.steps[-1]
        assert s.rss_max_bytes > 50e6 and s.tokens_per_s == pytest.approx(8 * 32 / s.step_time_s)
        assert s.mfu == pytest.approx(s.tflops_per_device * 1e12 / m.meta.peak_flops_per_device)
        assert (root / "logs" / f"rank{rank}.out").is_file() and (root / "logs" / f"rank{rank}.err").is_file()
    # TensorBoard events are readable with tensorboard's own reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(root / "tensorboard"))
    acc.Reload()
    losses = [e.value for e in acc.Scalars("train/loss")]
    assert losses == pytest.approx(t.losses(0), rel=1e-6)
    # one profiler trace per rank, covering the active steps, with our step / forward / backward ranges
    for rank in (0, 1):
        trace = json.loads((root / "traces" / f"rank{rank}.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert {"forward", "backward", "optimizer"} <= names
        assert any(n.startswith("ProfilerStep#") for n in names)
        assert any(n.startswith("step ") for n in names)
    # the plan predicted the same tokens per step the run measured
    plan = json.loads((root / "plan.json").read_text())
    assert plan["grid"]["dp"] == 2 and plan["fits"] is True


def test_activation_checkpointing_same_losses_and_recomputes(runs_root, shared_run):
    off = shared_run(*DS_DP2[3])
    on = train(runs_root / "ac_on", *DS_DP2[3], "train.activation_checkpointing=full")
    assert max(abs(a - b) for a, b in zip(on.losses(), off.losses(), strict=True)) <= 1e-6
    calls = json.loads((on.root / "logs" / "layer_calls_rank0.json").read_text())
    plain = json.loads((off.root / "logs" / "layer_calls_rank0.json").read_text())
    # 10 steps × 2 micro-batches: with checkpointing each decoder layer runs again in backward (recompute)
    assert plain["forward_calls_per_layer"] == [20, 20, 20, 20]
    assert calls["forward_calls_per_layer"] == [40, 40, 40, 40]


@pytest.mark.full  # text data on the ranks; tests/unit/test_data.py reads the same rows in README's suite
def test_real_text_trains_and_matches_one_rank(runs_root, repo):
    corpus = repo / "tests" / "fixtures" / "text" / "corpus.jsonl"
    args = (*SHORT, "data.source=text", f'data.path="{corpus}"', "batch.seq_len=64", "parallel.zero_stage=2")
    two = train(runs_root / "text2", *args)
    one = train(runs_root / "text1", *args, "hardware.gpus_per_node=1", "batch.micro_batch_size=8")
    losses = two.losses()
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, losses
    assert max(abs(a - b) for a, b in zip(losses, one.losses())) <= 1e-5


@pytest.mark.full  # the deepspeed launcher: a feature over a layout README's suite trains
def test_deepspeed_launcher_gives_the_same_run(runs_root, shared_run):
    a = shared_run(*DS_DP2[2])  # torchrun, the default launcher
    b = train(runs_root / "launch_ds", *DS_DP2[2], "run.launcher=deepspeed")
    assert "deepspeed.launcher.runner" in (b.root / "launch_cmd.txt").read_text()
    assert b.losses(0) == pytest.approx(a.losses(0), abs=1e-6) and b.losses(1) == b.losses(0)


@pytest.mark.full  # torch.compile's first compile (~20 s); test_torch_parity's compile_ac_full stays in README's suite
def test_compiled_engine_trains_the_same_and_attention_implementations_agree(runs_root, shared_run):
    """train.compile on the DeepSpeed backend is DeepSpeed's engine.compile(); train.attention=eager is Hugging Face's
    unfused attention. Both must leave the losses of the shared ZeRO-2 run (SDPA, eager mode) as they are."""
    ref = shared_run(*DS_DP2[2]).losses()
    compiled = train(runs_root / "ds_compile", *DS_DP2[2], "train.compile=true").losses()
    eager = train(runs_root / "ds_eager", *DS_DP2[2], "train.attention=eager").losses()
    for a, b, c in zip(ref, compiled, eager, strict=True):
        assert abs(a - b) <= 1e-5 and abs(a - c) <= 1e-5, (ref, compiled, eager)
