"""Collectives per transformer layer, counted in a real profiler trace of one step, against the layout.

The expectation is the one model of collectives the planner times and the report compares with
(launch.plan.collectives.tp_calls inside the forward-backward, launch.plan.collectives.communication for the whole step): TP issues 2 all-reduces per layer forward and 2 backward; with SP each forward
all-reduce becomes an all-gather + reduce-scatter and the backward adds the re-gathered input; around the
layers, the embedding, the output layer and the vocab-parallel loss. The counts must be equal, not merely
bounded: one extra gather around a norm adds a call per layer per micro-batch, one around the loss a call
per micro-batch, and either breaks the equality.

The trace is read here with json (not with the project's parser): on gloo every collective leaves a
`gloo:<op>` CPU range; a reduce-scatter is `c10d::_reduce_scatter_base_`, which gloo carries out as an
all-reduce (so its `gloo:all_reduce` is not another all-reduce). Counted inside the step's
`forward-backward` range: what the optimizer step adds (gradient norm, SP norm-gradient sum) is outside.
"""
import json
from collections import Counter

import pytest

from analysis.report import build_report
from launch.plan.collectives import tp_calls
from launch.config.resolve import Resolved
from tests.dist.conftest import MEGATRON, MEGATRON_LAYOUTS, SHORT

pytestmark = [pytest.mark.dist, pytest.mark.slow]
# The parity tests' runs of these layouts, which carry a profiler trace of one step (conftest.PROFILE_ONE_STEP).
RUNS = {"tp2_pp2": (*SHORT, *MEGATRON_LAYOUTS["tp2_pp2"]),
        "tp2": (*SHORT, *MEGATRON_LAYOUTS["tp2"]),
        "tp2_sp": (*SHORT, *MEGATRON_LAYOUTS["tp2_sp"]),
        "tp2_full_recompute": (*SHORT, *MEGATRON_LAYOUTS["tp2"], "train.activation_checkpointing=full")}


def counted(trace_path) -> Counter:
    events = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e.get("ph") == "X"]
    (window,) = [e for e in events if e["name"] == "forward-backward"]
    inside = [e for e in events if window["ts"] <= e["ts"] <= window["ts"] + window["dur"]]
    names = Counter(e["name"] for e in inside)
    reduce_scatters = names["c10d::_reduce_scatter_base_"]
    out = Counter({"all_reduce": names["gloo:all_reduce"] - reduce_scatters, "all_gather": names["gloo:all_gather"],
                   "reduce_scatter": reduce_scatters})
    return +out


def expected(resolved: Resolved, rank: int) -> Counter:
    par = resolved.recipe.parallel
    stage = resolved.grid.coords(rank)[2]
    return Counter({c.collective: c.layers + c.head + c.loss + c.logits
                    for c in tp_calls("megatron", sp=par.sp, layers=resolved.model.num_layers // par.pp,
                                      micro_batches=resolved.grad_accum,
                                      activation_checkpointing=resolved.recipe.train.activation_checkpointing,
                                      first_stage=stage == 0, last_stage=stage == par.pp - 1)})


@pytest.mark.full  # 4 ranks (conftest.two_ranks_first)
def test_tp_by_pp_stage_counts(shared_run):
    """TP2 × PP2: the first stage has the embedding's collectives, the last the output layer's and the loss's."""
    t = shared_run(*RUNS["tp2_pp2"], recipe=MEGATRON)
    resolved = Resolved.load(t.root / "resolved.json")
    for rank in range(4):
        assert counted(t.root / "traces" / f"rank{rank}.json") == expected(resolved, rank), rank
    # hand-counted: 2 layers per stage × 4 all-reduces, + 1 (embedding) or 1 + 3 (output layer, loss), × 2 micro-batches
    assert expected(resolved, 0) == Counter({"all_reduce": (2 * 4 + 1) * 2})
    assert expected(resolved, 2) == Counter({"all_reduce": (2 * 4 + 1 + 3) * 2})
    # The report's whole step (the trace's mean over the 4 ranks) against the planner's per stage: after the
    # micro-batches, one all-reduce of the gradient norm over TP × PP (the backend clips at ZeRO-0) and the loss
    # broadcast from the last stage; one send and one receive per micro-batch at the boundary.
    vs = {r["collective"]: r for r in build_report([("run", t.root)]).runs[0].vs_layout.rows()}
    assert set(vs) == {"all_reduce", "broadcast", "send_recv"}
    assert (vs["all_reduce"]["expected_min_per_step"], vs["all_reduce"]["expected_max_per_step"]) == (18 + 1, 24 + 1)
    assert vs["all_reduce"]["observed_per_step"] == ((18 + 1) + (24 + 1)) / 2
    for coll, n in (("broadcast", 1), ("send_recv", 2 * 2)):
        assert vs[coll]["observed_per_step"] == vs[coll]["expected_min_per_step"] == vs[coll]["expected_max_per_step"] == n


@pytest.mark.parametrize("name, sp, recompute", [("tp2", False, "none"), ("tp2_sp", True, "none"),
                                                ("tp2_full_recompute", False, "full")],
                         ids=["tp2", "tp2_sp", "tp2_full_recompute"])
def test_collectives_per_layer_match_the_layout(shared_run, name, sp, recompute):
    t = shared_run(*RUNS[name], recipe=MEGATRON)
    resolved = Resolved.load(t.root / "resolved.json")
    assert (resolved.recipe.parallel.sp, resolved.recipe.train.activation_checkpointing) == (sp, recompute)
    layers, micro = resolved.model.num_layers, resolved.grad_accum
    want = expected(resolved, 0)
    for rank in (0, 1):
        assert counted(t.root / "traces" / f"rank{rank}.json") == want == expected(resolved, rank), rank
    # Per layer, in the words of the issue: 2 + 2 all-reduces (TP), the forward ones again under full recompute;
    # under SP 2 + 4 all-gathers and 2 + 2 reduce-scatters.
    per_layer = {c.collective: c.layers / layers / micro
                 for c in tp_calls("megatron", sp=sp, layers=layers, micro_batches=micro, activation_checkpointing=recompute)}
    assert per_layer == ({"all_gather": 6, "reduce_scatter": 4, "all_reduce": 0} if sp else
                         {"all_reduce": 6 if recompute == "full" else 4})

    # The report puts the planner's whole step beside the trace's and they are equal: the calls above, and after
    # the micro-batches the backend's own, hand-counted: the gradient norm over TP (it clips at ZeRO-0) and under
    # SP the norm weights' gradient sum (without data parallelism there is no gradient reduction at all).
    rep = build_report([("run", t.root)])
    vs = {r["collective"]: r for r in rep.runs[0].vs_layout.rows()}
    step = want + Counter({"all_reduce": 1 + int(sp)})
    assert set(vs) == set(step)
    for coll, n in step.items():
        assert vs[coll]["observed_per_step"] == vs[coll]["expected_min_per_step"] == vs[coll]["expected_max_per_step"] == n
        assert vs[coll]["excess_per_layer"] == 0


def test_distributed_optimizer_traffic_matches_the_plan(shared_run):
    """Megatron's distributed optimizer (ZeRO-1, dp 2) in the profiled step's trace against the plan's data-parallel
    rows (launch.plan.collectives.communication): one reduce-scatter of the gradient buffer (the tiny model is one
    bucket), one all-gather of the updated parameters (dispatched in the next step's forward: overlap_param_gather),
    and two one-element all-reduces (the loop's loss mean and Megatron's clip norm). Message sizes from the ops'
    recorded input shapes: the buffer as Megatron padded it, within 1% of the plan's unpadded parameters. The
    vocab-parallel loss's all-reduces over its TP group of one are left out (the plan times no group of one)."""
    from launch.plan.collectives import communication
    from launch.plan.layout import Layout

    t = shared_run(*SHORT, *MEGATRON_LAYOUTS["dp2_zero1"], recipe=MEGATRON)
    resolved = Resolved.load(t.root / "resolved.json")
    assert resolved.recipe.parallel.zero_stage == 1 and resolved.grid.dp == 2 and resolved.grad_accum == 2
    dp_rows = [c for c in communication(Layout.from_resolved(resolved)) if c.parallelism == "dp"]
    calls = Counter()
    for c in dp_rows:
        calls[c.collective] += c.calls_per_step
    assert calls == {"reduce_scatter": 1, "all_gather": 1, "all_reduce": 2}
    planned = {c.collective: c for c in dp_rows if c.collective != "all_reduce"}
    for rank in (0, 1):
        ops = [e for e in json.loads((t.root / "traces" / f"rank{rank}.json").read_text())["traceEvents"]
               if e.get("ph") == "X" and e.get("name", "").startswith("c10d::")]
        # both ops record (outputs, inputs): the reduce-scatter's input and the all-gather's output are the whole
        # fp32 buffer, the other this rank's half of it
        (scatter,) = [e["args"]["Input Dims"] for e in ops if e["name"] == "c10d::reduce_scatter_tensor_coalesced_"]
        (gather,) = [e["args"]["Input Dims"] for e in ops if e["name"] == "c10d::allgather_into_tensor_coalesced_"]
        assert scatter[1][0][0] == gather[0][0][0] == 2 * scatter[0][0][0] == 2 * gather[1][0][0]
        assert scatter[1][0][0] * 4 == pytest.approx(planned["reduce_scatter"].message_bytes, rel=0.01)
        assert gather[0][0][0] * 4 == pytest.approx(planned["all_gather"].message_bytes, rel=0.01)
        scalars = [e for e in ops if e["name"] == "c10d::allreduce_" and e["args"]["Input Dims"][0][0] in ([], [1])]
        assert len(scalars) == calls["all_reduce"]
