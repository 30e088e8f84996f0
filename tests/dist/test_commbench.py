"""The collective sweep as a user runs it: `bash launch/run.sh recipes/tiny_zero2 run.mode=commbench` on gloo ranks."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from analysis.parsers.nccl_tests import parse_nccl_tests
from launch.comm.commbench_spec import NCCL_TESTS_OP, OPS, read_result
from launch.comm.nccl_format import BW_WIDTH, TIME_WIDTH, bus_factor, float_field
from tests.conftest import REPO
from tests.dist.conftest import BENCH, TINY, commbench, train

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def printed(value: float, width: int) -> float:
    return float(float_field(value, width))


def check_op(root, op, n, participants=None):
    """Every size correct, busbw = algbw × factor(n), and the text reads back to the JSON's numbers."""
    result = read_result(root / "commbench" / f"{op}.json")
    rows = result["rows"]
    assert result["group_size"] == n and result["participants"] == (participants or n)
    assert rows and all(r["wrong"] == 0 for r in rows), [r for r in rows if r["wrong"]]
    factor = bus_factor(NCCL_TESTS_OP[op], n)
    assert all(r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor, rel=1e-12) for r in rows)
    assert all(r["algbw_GBps"] == pytest.approx(r["size_bytes"] / r["time_us"] / 1e3, rel=1e-9) for r in rows)
    t = parse_nccl_tests(root / "commbench" / f"{op}.txt")
    assert t.warnings == () and t.meta.nranks == n and t.meta.op == NCCL_TESTS_OP[op]
    assert t.meta.out_of_bounds == 0
    assert t.meta.avg_busbw_GBps == pytest.approx(result["avg_busbw_GBps"], rel=1e-5, abs=1e-6)
    for got, want in zip(t.rows(), rows, strict=True):
        assert (got["size_bytes"], got["count"], got["placement"], got["wrong"]) == \
               (want["size_bytes"], want["count"], want["placement"], want["wrong"])
        assert got["time_us"] == printed(want["time_us"], TIME_WIDTH)
        assert (got["algbw_GBps"], got["busbw_GBps"]) == (printed(want["algbw_GBps"], BW_WIDTH),
                                                          printed(want["busbw_GBps"], BW_WIDTH))
    return result, t


@pytest.mark.parametrize("gpus, dtype", [(2, "float32"), pytest.param(4, "bfloat16", marks=pytest.mark.full)])
def test_sweep_all_collectives_correct_and_read_back(shared_run, gpus, dtype):
    t = shared_run(*commbench(gpus, dtype))
    for op in OPS:
        result, table = check_op(t.root, op, gpus)
        assert [d["rank"] for d in table.meta.devices] == list(range(gpus))
        assert len({d["pid"] for d in result["devices"]}) == gpus  # one process per rank
        assert result["backend"] == "gloo" and result["dtype"] == dtype
        assert {r["dtype"] for r in table.rows()} == {"float" if dtype == "float32" else "bfloat16"}
    sizes = [r["size_bytes"] for r in read_result(t.root / "commbench" / "all_reduce.json")["rows"]][::2]
    assert sizes == [8 << i for i in range(12)]  # 8 B .. 16 KiB, factor 2
    assert "commbench results" in t.proc.stdout and "nccl-tests skipped" in t.proc.stdout
    assert not any((t.root / "metrics").iterdir())  # no trainer ran


@pytest.mark.full  # 4 ranks (conftest.two_ranks_first)
def test_dp_sub_group_of_a_tp2_layout_is_what_gets_measured(runs_root):
    # llama-2-7b does not fit 4 CPU ranks for training; the sweep does not care.
    layout = ("hardware.gpus_per_node=4", "parallel.tp=2", "batch.global_batch_size=16", 'model.name="llama-2-7b"')
    t = train(runs_root / "dp", *BENCH, *layout, 'commbench.group="dp"', 'commbench.dtype="int32"',
              'commbench.ops=["all_reduce", "all_gather", "send_recv"]', timeout=240)
    for op in ("all_reduce", "all_gather", "send_recv"):
        result, table = check_op(t.root, op, 2, participants=4)  # a world-wide sum would make #wrong non-zero
        assert result["groups"] == [[0, 2], [1, 3]]
        assert [d["rank"] for d in table.meta.devices] == [0, 2]
        text = (t.root / "commbench" / f"{op}.txt").read_text()
        assert "#  Rank  0 Group  0" in text and "#  Rank  2 Group  0" in text and "Rank  1 " not in text
    ar = read_result(t.root / "commbench" / "all_reduce.json")["rows"]
    assert all(r["busbw_GBps"] == pytest.approx(r["algbw_GBps"]) for r in ar)  # 2(n-1)/n = 1 for n = 2, not 1.5
    p = subprocess.run(["bash", "launch/run.sh", TINY, *layout], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "LAYOUTLAB_RUNS": str(runs_root / "dp_train")})
    assert p.returncode == 2 and "exceeds the usable" in p.stderr  # the same layout cannot train


@pytest.mark.parametrize("overrides, words", [
    (['commbench.ops=["all_reduce", "allgather"]'], "commbench.ops=['all_reduce', 'allgather'] names 'allgather'"),
    (["commbench.min_bytes=1024", "commbench.max_bytes=512"], "the size range is empty"),
    (["commbench.ranks=[0, 2]"], "names rank 2, outside the world of 2 ranks"),
    (['commbench.group="tp"'], "gives groups of 1 rank (parallel.tp=1)"),
    (['commbench.dtype="float8_e5m2"'], "cannot run all_reduce on gloo"),
], ids=["unknown_op", "inverted_sizes", "rank_outside", "group_of_one", "gloo_float8"])
def test_bad_settings_exit_2_with_one_line_before_any_rank(runs_root, overrides, words):
    runs = runs_root / "bad"
    p = subprocess.run(["bash", "launch/run.sh", TINY, "run.mode=commbench", *overrides], cwd=REPO, capture_output=True,
                       text=True, timeout=60, env={**os.environ, "LAYOUTLAB_RUNS": str(runs)})
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: override ") and words in lines[0], p.stderr
    assert not runs.exists() and "torch.distributed.run" not in p.stdout  # nothing was created or started


PROBE = textwrap.dedent("""
    import datetime, json, sys, torch, torch.distributed as dist
    from launch.ranks import commbench as cb
    from launch.comm import commbench_spec as spec
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    r, n = dist.get_rank(), dist.get_world_size()
    seen = {}
    for name, d in spec.DTYPES.items():
        send, recv, scratch = (torch.empty(64, dtype=getattr(torch, d.torch_name)) for _ in range(3))
        for op in spec.OPS:
            s = spec.shape(op, 16 * d.size * n, d.size, n)
            lo, span, poison = cb.value_plan(d, n if op in spec.REDUCING else 1)
            coll = cb.Collective(op, None, range(n), r)
            for placement in spec.PLACEMENTS:
                call = (coll.out_of_place if placement == "out-of-place" else coll.in_place)(send, recv, scratch, s)
                coll.load_input(placement, send, recv, s, lo, span, poison)
                try:
                    call()
                    got = cb.count_wrong(coll.result(placement, recv, s), cb.expected_output(op, r, n, s, lo, span))
                except RuntimeError as e:
                    got = str(e).splitlines()[0]
                seen[f"{name} {op} {placement}"] = got
                # no barrier between calls: gloo's barrier re-raises a failed earlier call's error on one rank only
    if r == 0:
        print("SEEN " + json.dumps(seen))
    dist.destroy_process_group()
""")


def test_what_gloo_can_run_is_what_the_validation_says(tmp_path):
    """Re-measure on 2 gloo ranks the table resolve.py enforces: every allowed (op, dtype) gives exact
    results in both placements; every refused one fails inside torch."""
    from launch.comm.commbench_spec import DTYPES, unsupported

    (tmp_path / "probe.py").write_text(PROBE)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", "127.0.0.1:0", str(tmp_path / "probe.py")], cwd=REPO,
                       capture_output=True, text=True, timeout=180,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr[-3000:]
    seen = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("SEEN "))[5:])
    for dtype in DTYPES:
        for op in OPS:
            for placement in ("out-of-place", "in-place"):
                got = seen[f"{dtype} {op} {placement}"]
                if unsupported("gloo", op, dtype):
                    assert got == "Invalid scalar type", (dtype, op, placement, got)
                else:
                    assert got == 0, (dtype, op, placement, got)
