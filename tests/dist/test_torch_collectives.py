"""The torch backend's collectives per step, counted in a real profiler trace of one step, against the planner's model
(launch.plan.collectives.communication, which the plan times and the report compares with).

Counted here with json (not with the project's parser), by the c10d operator each collective enters through:
DDP's bucket all-reduce and the plain reductions are `c10d::allreduce_`; FSDP2 gathers with `c10d::_allgather_base_`
and reduce-scatters with `c10d::_reduce_scatter_base_`; DTensor's TP/SP collectives are
`c10d::allgather_into_tensor_coalesced_`, `c10d::reduce_scatter_tensor_coalesced_` and `c10d::allreduce_`. The
whole step is the `step N` range (forward, backward and optimizer of every micro-batch); the loop's loss mean comes
one step later, after it.

Hand-counted expectations for tiny-llama (4 decoder layers), per micro-batch unless said:
  * FSDP2 units: 4 blocks + the root = 5; all-gathers 5 before the forwards and, at stage 3, 5 again before the
    backwards; reduce-scatters 5. After the micro-batches the gradient norm: one all-reduce per sharded mesh
    dimension (dp; and tp), plus one over dp for the norms' own mesh when TP runs without SP.
  * DDP: the whole model's gradients (854 KiB) in one bucket, reduced at the last micro-batch only.
  * TP: per layer 2 all-reduces forward (o_proj, down_proj), 5 backward (q, k, v, gate, up input gradients); the
    embedding 1 and lm_head 1; the vocabulary-parallel loss 3 (max, sum of exponentials, target logit).
  * TP + SP: per layer 2 reduce-scatters and 2 all-gathers forward, mirrored backward; the embedding and lm_head one
    of each; the loss 3; 9 norm-weight gradient all-reduces (2 per layer + the final norm).
  * Pipelines: `c10d::send` and `c10d::recv_` (one each per micro-batch and chunk boundary), the loss broadcast
    (`c10d::broadcast_`) and the norm's sum over the stages.
"""
import json
from collections import Counter

import pytest

from analysis.analyzers.breakdown import time_breakdown
from analysis.parsers.kineto import parse_kineto_ranks
from launch.config.resolve import Resolved
from launch.plan.collectives import communication
from launch.plan.layout import Layout
from launch.run.rundir import RECOMPUTE_REGION
from tests.dist.conftest import SHORT, TORCH, TORCH_LAYOUTS, two_ranks_first

pytestmark = [pytest.mark.dist, pytest.mark.slow]
OPS = {"c10d::allreduce_": "all_reduce", "c10d::_allgather_base_": "all_gather",
       "c10d::_reduce_scatter_base_": "reduce_scatter", "c10d::allgather_into_tensor_coalesced_": "all_gather",
       "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter", "c10d::send": "send_recv",
       "c10d::recv_": "send_recv", "c10d::broadcast_": "broadcast"}


def counted(trace_path) -> Counter:
    events = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e.get("ph") == "X"]
    (window,) = [e for e in events if e["name"].startswith("step ")]
    inside = [e for e in events if window["ts"] <= e["ts"] <= window["ts"] + window["dur"]]
    return Counter(OPS[e["name"]] for e in inside if e["name"] in OPS)


def planned(t, stage: int = 0) -> Counter:
    """The planner's calls per step on a rank of pipeline stage `stage`, without the loop's loss mean (it runs after the
    traced step)."""
    layout = Layout.from_resolved(Resolved.load(t.root / "resolved.json"))
    out = Counter()
    for c in communication(layout, stage=stage):
        out[c.collective] += c.calls_per_step - ("loss mean" in c.note)
    return +out


# (layout, hand-counted calls per step): 2 micro-batches per step on 2 data-parallel ranks, 1 on one (TP 2 alone).
HAND = {
    "ddp": {"all_reduce": 1},
    "fsdp2_z2": {"all_gather": 2 * 5, "reduce_scatter": 2 * 5, "all_reduce": 1},
    "fsdp2_z3": {"all_gather": 2 * 10, "reduce_scatter": 2 * 5, "all_reduce": 1},
    "tp2": {"all_reduce": 2 * (4 * 2 + 1 + 3) + 2 * (4 * 5 + 1) + 1},
    "tp2_sp": {"all_gather": 2 * 2 * (4 * 2 + 1), "reduce_scatter": 2 * 2 * (4 * 2 + 1), "all_reduce": 2 * (3 + 9) + 1},
    "tp2_dp2": {"all_gather": 2 * 10, "reduce_scatter": 2 * 5,
                "all_reduce": 2 * (4 * 2 + 1 + 3) + 2 * (4 * 5 + 1) + 3},
    "tp2_dp2_sp": {"all_gather": 2 * 10 + 2 * 2 * (4 * 2 + 1), "reduce_scatter": 2 * 5 + 2 * 2 * (4 * 2 + 1),
                   "all_reduce": 2 * (3 + 9) + 2},
    # Pipelines (4 micro-batches on one data-parallel rank, 2 on two): per micro-batch one send and one receive at each
    # chunk boundary (vpp 2: 3 boundaries on every rank), the loss broadcast from the last stage, the norm summed
    # over pp (and over dp); FSDP2 gathers each of 3 units once at stage 2 and reduces them once, at the last
    # micro-batch.
    "pp2_vpp2": {"send_recv": 2 * 4 * 3, "broadcast": 1, "all_reduce": 1},
    "pp2_dp2_z2": {"send_recv": 2 * 2 * 1, "broadcast": 1, "all_reduce": 2, "all_gather": 3, "reduce_scatter": 3},
    # Hybrid sharding, DP 4 in shard groups of 2 (one micro-batch): gathers and reduce-scatters within the group as
    # at DP 2, then each reduced shard all-reduced across the 2 replicas, one call per unit; the norm in the group.
    "hsdp": {"all_gather": 10, "reduce_scatter": 5, "all_reduce": 5 + 1},
    # selective (the op policy) recomputes every block but keeps the reductions' outputs: each block's two input
    # gathers run again, no reduce-scatter does.
    "tp2_sp_selective": {"all_gather": 2 * (2 * 4 + 2 * 4 + 1 + 2 * 4 + 1), "reduce_scatter": 2 * (2 * 4 + 1 + 2 * 4 + 1),
                         "all_reduce": 2 * (3 + 9) + 1},
}


@pytest.mark.parametrize("name", two_ranks_first({n: TORCH_LAYOUTS[n] for n in HAND}))
def test_trace_counts_equal_the_plan(shared_run, name):
    t = shared_run(*SHORT, *TORCH_LAYOUTS[name], recipe=TORCH)
    resolved = Resolved.load(t.root / "resolved.json")
    assert planned(t) == Counter(HAND[name]), planned(t)
    for rank in range(resolved.world_size):
        stage = resolved.grid.coords(rank)[2]
        assert counted(t.root / "traces" / f"rank{rank}.json") == planned(t, stage), rank


def test_each_recomputation_is_marked_and_the_report_measures_it(shared_run):
    """Selective checkpointing (the op policy) recomputes each of the 4 blocks in each micro-batch's backward (2 per
    step here), each inside one RECOMPUTE_REGION range: counted here with json in the traced step, then measured by
    the report's breakdown on every rank, a part of its compute."""
    t = shared_run(*SHORT, *TORCH_LAYOUTS["tp2_sp_selective"], recipe=TORCH)
    resolved = Resolved.load(t.root / "resolved.json")
    assert (resolved.grad_accum, resolved.model.num_layers) == (2, 4)
    for rank in range(resolved.world_size):
        events = [e for e in json.loads((t.root / "traces" / f"rank{rank}.json").read_text())["traceEvents"]
                  if e.get("ph") == "X"]
        (window,) = [e for e in events if e["name"].startswith("step ")]
        marks = [e for e in events if e["name"] == RECOMPUTE_REGION and e.get("cat") == "user_annotation"
                 and window["ts"] <= e["ts"] <= window["ts"] + window["dur"]]
        assert len(marks) == 4 * 2, rank  # 4 blocks × 2 micro-batches
    rows = list(time_breakdown(parse_kineto_ranks(sorted((t.root / "traces").glob("rank*.json")))).rows())
    assert len(rows) == resolved.world_size
    assert all(0 < b["recompute_us"] <= b["compute_us"] for b in rows), rows
