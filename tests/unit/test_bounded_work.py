"""Work bounded by the answer: the planner, the recommender and SLURM's host list cost what their output needs, not
what walking the sizes they are given would cost (a world of a million ranks, thousands of layouts the resolver
refuses for their tp or pp alone, a host list of 2^40 names). Each test counts the work done, or gives a size that
walking would need gigabytes for; none of them times anything. Beside each, the answer is checked against the
walk it replaces, on sizes small enough to walk."""
from __future__ import annotations

import json
import os
import random
import re
import resource
import subprocess
from collections import Counter

import pytest

from launch.commands.cli import main
from launch.config import resolve as resolve_module
from launch.config.backends import traits
from launch.config.grid import RankGrid, divisors
from launch.config.hardware import load_profile
from launch.config.models import load_model
from launch.config.resolve import resolve_path
from launch.config.schema import load_recipe
from launch.errors import ConfigError
from launch.plan import search as search_module
from launch.plan.build import make_plan, plan_resolved
from launch.plan.layout import Layout, Plan
from launch.plan.memory import HOST_BUFFER_FACTOR, host_bytes_per_node
from launch.config.schema import with_overrides
from launch.plan.search import candidates, layouts, recommend, search
from launch.run import nodes
from tests.conftest import RECIPES, REPO

H100 = load_profile("h100-sxm")
LLAMA7 = load_model("llama-2-7b")
TINY = load_model("tiny-llama")


def _counting_grid(monkeypatch) -> Counter:
    """Calls of the grid's per-rank questions (coords, rank, node), counted."""
    calls: Counter = Counter()

    def counted(name, method):
        def wrapped(self, *args):
            calls[name] += 1
            return method(self, *args)
        return wrapped
    for name in ("coords", "rank", "node"):
        monkeypatch.setattr(RankGrid, name, counted(name, getattr(RankGrid, name)))
    return calls


def _layout(tp, pp, dp, gpn, backend="deepspeed", zero=3, model=LLAMA7, **kw) -> Layout:
    world = tp * pp * dp
    return Layout(backend=backend, model=model, hardware=H100, grid=RankGrid(tp, pp, dp, gpn, -(-world // gpn)),
                  zero_stage=zero, dtype="bf16", micro_batch_size=1, global_batch_size=dp * kw.pop("ga", pp),
                  seq_len=4096, **kw)


# --------------------------------------------------------------------------- the planner


@pytest.mark.parametrize("lay", [
    _layout(8, 1, 1 << 17, 8),  # a million ranks, TP inside 8-GPU nodes, ZeRO-3 over 131,072
    _layout(2, 4, 1 << 17, 8, backend="megatron", zero=1),  # pipeline stages of 262,144 ranks each
    _layout(1, 1, 1 << 20, 6, backend="torch", zero=3, zero_hpz_partition_size=4),  # nodes that split no group evenly
], ids=["deepspeed-tp8", "megatron-pp4", "torch-hpz"])
def test_a_plan_of_a_million_ranks_asks_about_no_rank_one_by_one(monkeypatch, lay):
    calls = _counting_grid(monkeypatch)
    plan = make_plan(lay)
    # The stages' ranks, the groups' links and the busiest node's host memory are arithmetic on ranges: a few
    # hundred questions about single ranks, where walking them asked ~10^7.
    assert sum(calls.values()) < 1_000, calls
    assert sum(len(rp.ranks) for rp in plan.ranks) == lay.grid.world
    text = plan.to_json()
    assert len(text) < 100_000  # the ranks as first and last, not 2^20 numbers per rank type
    assert Plan.from_json(text) == plan
    assert all(set(rp) == {"first", "last"} for rp in (r["ranks"] for r in json.loads(text)["ranks"]))


def _walked_host_bytes(layout: Layout, ranks) -> int:
    """host_bytes_per_node as it was, rank by rank: the reference the arithmetic must equal."""
    g, counts = layout.grid, layout.model.param_counts()
    whole = 4 * counts.total
    bt = traits(layout.backend)
    partitioned = bt.builds_partitioned(layout.zero_stage, g.tp)
    held = max(counts.largest_layer, counts.per_layer) if bt.host_build == "sharded" and not bt.hf_modules else (
        counts.largest_layer)
    load: dict[int, int] = {}
    offloaded: dict[int, int] = {}
    for rp in ranks:
        for rank in rp.ranks:
            node = rank // g.gpus_per_node
            built = 4 * held if partitioned else whole
            load[node] = load.get(node, 0) + built
            offloaded[node] = offloaded.get(node, 0) + rp.memory[rp.implementation].host_bytes
    return max((int(HOST_BUFFER_FACTOR * max(load[n], offloaded[n])) for n in load), default=0)


def test_groups_and_host_memory_by_arithmetic_equal_the_walk_on_small_grids():
    rng = random.Random(7)
    for _ in range(300):
        tp, pp, dp, gpn = (rng.randint(1, 6) for _ in range(4))
        g = RankGrid(tp, pp, dp, gpn, -(-tp * pp * dp // gpn))
        for r in range(g.world):
            for span, group in ((g.tp_span(r), g.tp_group(r)), (g.dp_span(r), g.dp_group(r)),
                                (g.pp_span(r), g.pp_group(r))):
                assert tuple(span) == group
                assert g.spans_nodes(span) == g.spans_nodes(group)
                assert g.ranks_per_node_in(span) == g.ranks_per_node_in(group)
                assert g.ranks_per_node_in(span[::2]) == g.ranks_per_node_in(group[::2])
    for _ in range(150):
        tp, pp, gpn = rng.choice((1, 2, 4)), rng.choice((1, 2, 4, 8)), rng.randint(1, 9)
        dp = rng.randint(1, 5)
        backend = rng.choice(("deepspeed", "megatron", "torch"))
        zero = rng.choice((0, 1, 3) if backend == "deepspeed" else (1,) if backend == "megatron" else (2, 3))
        offload = {"offload_optimizer": "cpu"} if backend == "deepspeed" and zero and rng.random() < 0.5 else {}
        lay = _layout(tp, pp if backend != "deepspeed" else 1, dp, gpn, backend, zero, **offload)
        plan = make_plan(lay)
        assert plan.host_bytes_per_node == _walked_host_bytes(lay, plan.ranks) > 0, lay.grid
        assert host_bytes_per_node(lay, [*plan.ranks]) == _walked_host_bytes(lay, plan.ranks)


def test_divisors_are_found_up_to_the_square_root():
    assert [divisors(n) for n in (1, 12, 49)] == [[1], [1, 2, 3, 4, 6, 12], [1, 7, 49]]
    assert divisors(10**12, at_most=16) == [1, 2, 4, 5, 8, 10, 16]
    assert len(divisors(963761198400)) == 6720  # the most divisors below 10^12: found without 10^12 trials


def test_plan_command_at_a_million_gpus_writes_what_it_shows(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LAYOUTLAB_RUNS", str(tmp_path / "runs"))
    calls = _counting_grid(monkeypatch)
    assert main(["plan", "model=tiny-llama", "world_size=1000000", f"out={tmp_path / 'plan'}"]) == 0
    assert "wrote" in capsys.readouterr().out
    rows = json.loads((tmp_path / "plan.json").read_text())
    # Every layout of tp 1 and 2 at ZeRO 0-3, both checkpointing modes: 16 plans, none walked rank by rank.
    assert len(rows) == 16 and sum(calls.values()) < 16 * 200, calls
    assert (tmp_path / "plan.json").stat().st_size < 1_000_000  # it was 222 MB of rank numbers


# --------------------------------------------------------------------------- the recommender


def _counting_resolver(monkeypatch) -> Counter:
    calls: Counter = Counter()
    real = resolve_module.resolve

    def counted(*args, **kw):
        calls["resolve"] += 1
        return real(*args, **kw)
    monkeypatch.setattr(resolve_module, "resolve", counted)  # resolve_path's
    monkeypatch.setattr(search_module, "resolve", counted, raising=False)
    return calls


def test_recommend_asks_the_resolver_once_per_tp_or_pp_the_model_cannot_split_by(monkeypatch, capsys):
    calls = _counting_resolver(monkeypatch)
    rc = main(["recommend", str(RECIPES / "tiny_zero2"), "hardware.gpus_per_node=2048", "batch.global_batch_size=8192"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("recommend tiny_zero2: 15471 layouts tried, 545 fit (545 ranked)"), out[:300]
    assert "dropped 9810: parallel.tp: does not divide the 4 attention heads of tiny-llama" in out
    assert re.search(r"dropped 315: parallel\.pp: × parallel\.vpp=1 = 8 does not divide the 4 layers", out)
    # 14,575 of the layouts are refused for a tp that does not divide the heads or a pp that does not divide the
    # layers: the resolver is asked once for each such tp and pp, and for each of the ~900 others.
    assert calls["resolve"] < 1_100, calls


def _every_layout_resolved(recipe, overrides):
    """candidates() as it was: every layout through load_recipe and the resolver, offload skipped where the same
    layout fits without it. The reference the pruned search must equal."""
    out, fitting = [], set()
    for label, ov in layouts(resolve_path(recipe, overrides)):
        offloaded = " off=" in label
        if offloaded and label.split(" off=")[0] in fitting:
            continue
        try:
            plan = plan_resolved(resolve_path(recipe, [*overrides, *ov]))
        except ConfigError as e:
            out.append((label, ov, f"{e.field}: {e.problem}", None))
            continue
        if plan.fits and not offloaded:
            fitting.add(label)
        out.append((label, ov, plan))
    return out


SMALL = [
    # tp 3 and 6 do not divide tiny-llama's 4 heads, pp 3 and 6 not its 4 layers
    ("tiny_zero2", ["hardware.gpus_per_node=6", "batch.global_batch_size=6", "batch.micro_batch_size=1"]),
    # offloaded variants where the plain layout does not fit on H100s
    ("7b_tp2_zero3", ["hardware.nodes=1", "hardware.gpus_per_node=2", "batch.global_batch_size=2",
                      "batch.micro_batch_size=1"]),
    # pp 3 does not divide Llama-2-7B's 32 layers
    ("7b_tp2_zero3", ["hardware.nodes=3", "hardware.gpus_per_node=1", "batch.global_batch_size=3",
                      "batch.micro_batch_size=1", "parallel.tp=1"]),
]


@pytest.mark.parametrize("name, overrides", SMALL, ids=["tiny-6", "7b-offload", "7b-pp3"])
def test_the_pruned_search_equals_resolving_every_layout(monkeypatch, name, overrides):
    recipe = str(RECIPES / name)
    want = _every_layout_resolved(recipe, overrides)
    calls = _counting_resolver(monkeypatch)
    got = candidates(recipe, overrides)
    asked = calls["resolve"]
    assert [(c.label, c.overrides) for c in got] == [w[:2] for w in want]
    for c, w in zip(got, want, strict=True):
        if c.plan is None:
            assert (c.refused, None) == (w[2], w[3]), c.label
        else:
            assert c.plan.to_json() == w[2].to_json(), c.label
    # Once for the recipe, once for each layout not refused for its shape, once for each tp or pp that is.
    shape = [c for c in got if c.plan is None and c.refused.startswith(("parallel.tp: does not divide the",
                                                                        "parallel.pp: × parallel.vpp=1 ="))]
    assert asked <= 1 + len(got) - len(shape) + len({tuple(c.label.split()[:3]) for c in shape})
    assert search(recipe, overrides) == recommend(got)
    # Each layout's recipe, set on the loaded one, is the one load_recipe reads with the layout's overrides.
    loaded = load_recipe(recipe, overrides)
    for label, ov in layouts(resolve_path(recipe, overrides)):
        assert with_overrides(loaded, ov) == load_recipe(recipe, [*overrides, *ov]), label


def test_search_counts_the_layouts_it_does_not_list(monkeypatch):
    # 720,720 devices per node: 240 tp degrees × the pp degrees of each, 3.6 million layouts, all but ~800 refused
    # for their tp or pp alone. Listed, they took 3 GB; counted, the resolver sees a few thousand. None of the rest fits:
    # every one of 720,720 ranks on the node holds a whole tensor at a time while it builds, 132 GiB of host memory.
    calls = _counting_resolver(monkeypatch)
    rec = search(str(RECIPES / "tiny_zero2"), ["hardware.gpus_per_node=720720", "batch.global_batch_size=1441440"])
    assert rec.tried == 3_594_010 and rec.fitting == len(rec.ranked) == 0
    assert rec.tried == len(rec.ranked) + sum(n for _, n in rec.dropped)
    assert calls["resolve"] < 5_000, calls


@pytest.mark.timeout(60)
def test_recommend_refuses_a_machine_too_large_to_enumerate_up_front(capsys):
    # 2^42 devices on one node: its divisors, tried up to the square root, would be 2^21 trials per tp degree of
    # 43; one line and exit 2 instead, naming the field that set it.
    rc = main(["recommend", str(RECIPES / "tiny_zero2"), "hardware.gpus_per_node=4398046511104",
               "batch.global_batch_size=8796093022208"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: override hardware.gpus_per_node=4398046511104: ") and "at most 1,099,511,627,776" in err


# --------------------------------------------------------------------------- SLURM's host list


HOST_LISTS = ["cpu[01-02]", "gpu[01-03,07],login1", "r[1-2]n[8-9]", "node7", "a[098-101]", "a[5-3],b[2-4]c",
              "a[5-3]x[q],b1", "x[1-2]y[3-1],z9", "n[1,x]", "n[1-2][x]", "n[3-1]", "n[3-1,2]m", "cpu[01-x]", ","]


@pytest.mark.parametrize("nodelist", HOST_LISTS)
def test_first_host_is_the_expanded_lists_first_with_the_same_refusals(nodelist):
    def answer(f):
        try:
            return f(nodelist)
        except ConfigError as e:
            return str(e)
    assert answer(nodes.first_host) == answer(lambda x: nodes.expand_hostlist(x)[0])


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def test_slurm_dry_run_finds_the_rendezvous_host_of_a_list_too_large_to_expand():
    # 2^40 hosts, then 10^14 more: expanded, the list needs terabytes; the dry run needs its first host only, and
    # runs within 1 GiB of address space.
    nodelist = "n" + "[1-2]" * 40 + ",x[0-99999999999999]"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in ("NODE_RANK", "MASTER_ADDR")}
    env.update(SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_JOB_NUM_NODES="2", SLURM_NODEID="1", SLURM_PROCID="1",
               SLURM_LOCALID="0", SLURM_JOB_NODELIST=nodelist, LAYOUTLAB_RUNS="/nonexistent/never-created")
    p = subprocess.run(["bash", "launch/run.sh", "recipes/tiny_zero2", "hardware.nodes=2", "--dry-run"], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env=env, preexec_fn=_limit_memory,
                       check=False)
    assert p.returncode == 0, (p.stdout[-1500:], p.stderr[-1500:])
    assert f"--rdzv-endpoint n{'1' * 40}:24242" in p.stdout
    assert nodes.placement(env, 2).master_addr == "n" + "1" * 40
