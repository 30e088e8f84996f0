"""The collective sweep's settings, sizes, groups and correctness checker, without starting ranks."""
import typing

import pytest

from launch.comm.commbench_spec import (
    DTYPES,
    OPS,
    REDUCING,
    Shape,
    shape,
    shapes,
    sweep_sizes,
    unsupported,
)
from launch.config.commbench import groups_of
from launch.config.resolve import Resolved, resolve_path
from launch.config.schema import COMMBENCH_DTYPE
from launch.errors import ConfigError
from launch.ranks.commbench import (
    count_wrong,
    expected_output,
    pattern,
    put,
    value_plan,
)
from tests.conftest import RECIPES

TINY = RECIPES / "tiny_zero2"
BENCH = ("run.mode=commbench",)


def err(*overrides, recipe=TINY) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        resolve_path(recipe, [*BENCH, *overrides])
    return e.value


# --- settings -------------------------------------------------------------------------------------

def test_max_bytes_default_comes_from_the_profile_and_survives_resolved_json():
    cpu = resolve_path(TINY, [*BENCH, 'commbench.ops=["all_reduce"]', "commbench.ranks=[0, 1]"])
    assert cpu.recipe.commbench.max_bytes == 4 << 20
    assert cpu.recipe.commbench.ops == ("all_reduce",) and cpu.recipe.commbench.ranks == (0, 1)
    assert Resolved.from_json(cpu.to_json()) == cpu
    gpu = resolve_path(TINY, [*BENCH, "hardware.profile=h100-sxm"])
    assert gpu.recipe.commbench.max_bytes == 256 << 20
    assert resolve_path(TINY, [*BENCH, "commbench.max_bytes=1024"]).recipe.commbench.max_bytes == 1024


@pytest.mark.parametrize("comma, toml", [("commbench.ops=all_reduce,all_gather", 'commbench.ops=["all_reduce", "all_gather"]'),
                                         ("commbench.ops=all_reduce", 'commbench.ops=["all_reduce"]'),
                                         ("commbench.ranks=0,1", "commbench.ranks=[0, 1]")])
def test_a_list_field_takes_the_comma_form_as_plan_does(comma, toml):
    """`plan model=a,b` took commas while commbench.ops refused them: every list takes both forms."""
    assert resolve_path(TINY, [*BENCH, comma]).recipe.commbench == resolve_path(TINY, [*BENCH, toml]).recipe.commbench


@pytest.mark.parametrize("override, shows", [("commbench.ops=5", 'a list of strings (a,b or ["a", "b"])'),
                                             ("commbench.ranks=0,x", "a list of integers (0,1 or [0, 1])")])
def test_a_bad_list_shows_the_forms_it_takes(override, shows):
    assert shows in str(err(override))


def test_dtype_names_agree_between_schema_and_sweep():
    assert set(typing.get_args(COMMBENCH_DTYPE)) == set(DTYPES)


@pytest.mark.parametrize("overrides, field, words", [
    (['commbench.ops=["allreduce"]'], "commbench.ops", "did you mean 'all_reduce'?"),
    (['commbench.ops=["all_reduce", "gather"]'], "commbench.ops", "names 'gather', which is not a collective"),
    (["commbench.ops=[]"], "commbench.ops", "is empty"),
    (["commbench.min_bytes=65536", "commbench.max_bytes=1024"], "commbench.min_bytes", "the size range is empty"),
    (["commbench.min_bytes=8388608"], "commbench.min_bytes", "(the cpu profile's default, as commbench.max_bytes=0)"),
    (["commbench.min_bytes=0"], "commbench.min_bytes", "must be at least 1"),
    (["commbench.step_factor=1"], "commbench.step_factor", "must be at least 2"),
    (["commbench.iters=0"], "commbench.iters", "must be at least 1"),
    (["commbench.ranks=[0, 5]"], "commbench.ranks", "names rank 5, outside the world of 2 ranks (0-1)"),
    (["commbench.ranks=[1, 1]"], "commbench.ranks", "names a rank twice"),
    (["commbench.ranks=[1]"], "commbench.ranks", "gives groups of 1 rank"),
    (['commbench.group="tp"'], "commbench.group", "gives groups of 1 rank (parallel.tp=1)"),
    (['commbench.group="inter_node"'], "commbench.group", "(hardware.nodes=1)"),
    (['commbench.group="dp"', "commbench.ranks=[0, 1]"], "commbench.ranks", "both choose the group"),
    (['commbench.dtype="float8_e4m3"'], "commbench.dtype", "cannot run all_reduce on gloo"),
    (["commbench.min_bytes=4", "commbench.max_bytes=4"], "commbench.max_bytes",
     "leaves all_gather on 2 ranks no message"),
    (['commbench.dtype="int4"'], "commbench.dtype", "is not"),
    (["commbench.ranks=[0, \"a\"]"], "commbench.ranks", "is not a list of integers"),
])
def test_bad_settings_name_file_field_value_and_fix(overrides, field, words):
    e = err(*overrides)
    assert e.field == field and words in str(e), str(e)
    assert str(e).startswith("override ") and "\n" not in str(e) and "; " in str(e)


def test_settings_are_only_checked_in_commbench_mode():
    r = resolve_path(TINY, ['commbench.group="tp"', "commbench.ops=[]"])
    assert r.recipe.run.mode == "train"


def test_float8_where_the_backend_can_move_it():
    assert resolve_path(TINY, [*BENCH, 'commbench.dtype="float8_e5m2"', 'commbench.ops=["send_recv"]'])
    e = err('commbench.dtype="float8_e4m3"', 'commbench.ops=["all_reduce"]', "hardware.profile=h100-sxm")
    assert "refuses float8 reductions" in str(e)
    assert resolve_path(TINY, [*BENCH, 'commbench.dtype="float8_e4m3"', 'commbench.ops=["all_gather", "all_to_all"]',
                               "hardware.profile=h100-sxm"])


def test_what_each_backend_cannot_run():
    standard = [d for d in DTYPES if not d.startswith("float8")]
    for backend in ("gloo", "nccl"):
        assert all(unsupported(backend, op, d) is None for op in OPS for d in standard)
    assert [op for op in OPS if unsupported("gloo", op, "float8_e4m3")] == [op for op in OPS if op != "send_recv"]
    assert [op for op in OPS if unsupported("nccl", op, "float8_e5m2")] == ["all_reduce", "reduce_scatter"]


# --- sizes and groups -----------------------------------------------------------------------------

def test_sizes_step_like_nccl_tests():
    assert sweep_sizes(8, 128, 2) == [8, 16, 32, 64, 128]
    assert sweep_sizes(8, 100, 4) == [8, 32]
    assert sweep_sizes(8, 8, 2) == [8]


def test_shapes_follow_nccl_tests_counts():
    # all_gather on 4 ranks: the printed size is the gathered buffer, the count one rank's chunk
    assert shape("all_gather", 8, 4, 4) is None
    assert shape("all_gather", 16, 4, 4) == Shape(16, 1, 1, 4)
    assert shape("all_gather", 100, 4, 4) == Shape(96, 6, 6, 24)
    assert shape("reduce_scatter", 64, 4, 2) == Shape(64, 8, 16, 8)
    assert shape("all_to_all", 64, 4, 2) == Shape(64, 8, 16, 16)
    assert shape("all_reduce", 6, 4, 8) == Shape(4, 1, 1, 1)
    assert shape("broadcast", 2, 4, 2) is None
    assert [s.size_bytes for s in shapes("all_gather", sweep_sizes(8, 64, 2), 4, 4)] == [16, 32, 64]


def test_groups_come_from_the_rank_grid():
    def groups(*overrides, gpus=4, nodes=1):
        r = resolve_path(TINY, [f"hardware.gpus_per_node={gpus}", f"hardware.nodes={nodes}", "batch.global_batch_size=16",
                                *overrides])
        return groups_of(r.recipe.commbench, r.grid)

    assert groups() == ((0, 1, 2, 3),)
    assert groups("parallel.tp=2", 'commbench.group="dp"') == ((0, 2), (1, 3))
    assert groups("parallel.tp=2", 'commbench.group="tp"') == ((0, 1), (2, 3))
    assert groups('commbench.group="inter_node"', gpus=2, nodes=2) == ((0, 2),)
    assert groups("commbench.ranks=[3, 1]") == ((3, 1),)


# --- inputs, expected values and the checker --------------------------------------------------------

def simulate(op, n, s, lo, span):
    """Each rank's result of `op`, computed here from every rank's input independently of expected_output."""
    import torch

    c = s.count
    inputs = [pattern(q, 0, s.in_numel, lo, span) for q in range(n)]
    if op == "all_reduce":
        return [torch.stack(inputs).sum(0)] * n
    if op == "all_gather":
        return [torch.cat(inputs)] * n
    if op == "reduce_scatter":
        total = torch.stack(inputs).sum(0)
        return [total[r * c:(r + 1) * c] for r in range(n)]
    if op == "all_to_all":
        return [torch.cat([inputs[q][r * c:(r + 1) * c] for q in range(n)]) for r in range(n)]
    if op == "broadcast":
        return [inputs[0]] * n
    return [inputs[(r - 1) % n] for r in range(n)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8", "uint8", "int64", "float8_e5m2"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_checker_accepts_the_right_result_and_counts_each_wrong_element(op, n, dtype):
    import torch

    d = DTYPES[dtype]
    lo, span, poison = value_plan(d, n if op in REDUCING else 1)
    s = shape(op, 48 * d.size * n, d.size, n)
    for r, right in enumerate(simulate(op, n, s, lo, span)):
        got = torch.empty(right.numel(), dtype=getattr(torch, d.torch_name))
        put(got, right)  # the result as the collective would leave it, in the benchmark's dtype
        expected = expected_output(op, r, n, s, lo, span)
        assert count_wrong(got, expected) == 0
        bad = got.clone()
        bad[5] = poison  # an element the collective did not write
        assert count_wrong(bad, expected) == 1
        bad[-1] = bad[-1].to(torch.float32) + 1
        assert count_wrong(bad, expected) == 2


def test_checker_sees_chunks_from_the_wrong_rank():
    import torch

    lo, span, _ = value_plan(DTYPES["float32"], 1)
    s = shape("all_gather", 4 * 16 * 4, 4, 4)
    right = simulate("all_gather", 4, s, lo, span)[0]
    swapped = torch.cat([right[16:32], right[:16], right[32:]]).float()
    assert count_wrong(swapped, expected_output("all_gather", 0, 4, s, lo, span)) > 0
    shifted = simulate("send_recv", 4, shape("send_recv", 64, 4, 4), lo, span)
    assert count_wrong(shifted[2].float(), expected_output("send_recv", 1, 4, shape("send_recv", 64, 4, 4), lo, span)) > 0


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("n", [2, 8, 64])
def test_inputs_keep_sums_exact_and_poison_out_of_reach(dtype, n):
    import torch

    d = DTYPES[dtype]
    lo, span, poison = value_plan(d, n)
    sums_hi, sums_lo = n * (lo + span - 1), n * lo
    assert max(abs(sums_hi), abs(sums_lo), poison) <= d.exact
    assert poison > sums_hi or span == 1
    values = torch.arange(lo, lo + span)
    stored = torch.empty(span, dtype=getattr(torch, d.torch_name))
    put(stored, values)
    assert torch.equal(stored.to(torch.float64), values.to(torch.float64))  # every input value is exact
