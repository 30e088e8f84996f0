"""The NCCL sweep on real GPUs, next to NVIDIA nccl-tests run by the same command (skipped without 2+ GPUs).

LAYOUTLAB_GPU_PROFILE names the hardware profile of the machine (default h100-sxm); nccl-tests'
all_reduce_perf must be on PATH for the comparison.
"""
import os
import shutil
import statistics
import subprocess

import pytest

from analysis.parsers.nccl_tests import parse_nccl_tests
from launch.comm.commbench_spec import OPS, read_result
from tests.conftest import REPO

torch = pytest.importorskip("torch")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(GPUS < 2, reason="needs CUDA and at least 2 GPUs")]
PROFILE = os.environ.get("LAYOUTLAB_GPU_PROFILE", "h100-sxm")
LARGE = 64 << 20  # bandwidth-bound sizes: where busbw is meant to match the link


def bench(runs, *overrides):
    before = set(runs.glob("*/*")) if runs.exists() else set()
    p = subprocess.run(["bash", "launch/run.sh", "recipes/tiny_zero2", "run.mode=commbench", f"hardware.profile={PROFILE}",
                        f"hardware.gpus_per_node={GPUS}", f"batch.global_batch_size={4 * GPUS}", *overrides],
                       cwd=REPO, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "LAYOUTLAB_RUNS": str(runs)})
    new = sorted(set(runs.glob("*/*")) - before)
    assert p.returncode == 0 and len(new) == 1, p.stdout[-3000:] + p.stderr[-3000:]
    return new[0], p


@pytest.mark.skipif(shutil.which("all_reduce_perf") is None, reason="nccl-tests' all_reduce_perf is not on PATH")
def test_all_reduce_busbw_within_10_percent_of_nccl_tests(tmp_path):
    root, p = bench(tmp_path / "runs", 'commbench.ops=["all_reduce"]')  # 8 B .. 256 MiB, float32, 20 iterations
    ours = read_result(root / "commbench" / "all_reduce.json")
    assert ours["backend"] == "nccl" and ours["group_size"] == GPUS
    assert all(r["wrong"] == 0 for r in ours["rows"])
    theirs = parse_nccl_tests(root / "commbench" / "nccl-tests" / "all_reduce.txt")
    assert theirs.meta.nranks == GPUS and theirs.meta.out_of_bounds == 0, theirs.warnings
    # In-place: torch's all_reduce works in place, so that is the placement without an extra copy on our side.
    ref = {r["size_bytes"]: r["busbw_GBps"] for r in theirs.rows() if r["placement"] == "in-place"}
    got = {r["size_bytes"]: r["busbw_GBps"] for r in ours["rows"] if r["placement"] == "in-place"}
    large = sorted(s for s in ref if s >= LARGE and s in got)
    assert large, (sorted(ref), sorted(got))
    ratio = statistics.median(got[s] for s in large) / statistics.median(ref[s] for s in large)
    print(f"busbw at >= 64 MiB: ours/nccl-tests = {ratio:.3f} over {len(large)} sizes")
    assert 0.9 <= ratio <= 1.1, {s: (got[s], ref[s]) for s in large}
    # What NCCL chose is on record for both: our ranks' logs and nccl-tests' own.
    assert "NCCL INFO" in (root / "nccl" / "rank0.log").read_text()
    assert list((root / "commbench" / "nccl-tests").glob("all_reduce.nccl.*.log"))


def test_every_collective_is_correct_on_nccl(tmp_path):
    root, _ = bench(tmp_path / "runs", "commbench.max_bytes=16777216", 'commbench.dtype="bfloat16"',
                    "commbench.nccl_tests=false")
    for op in OPS:
        result = read_result(root / "commbench" / f"{op}.json")
        assert result["backend"] == "nccl" and result["nccl_version"]
        assert all(r["wrong"] == 0 for r in result["rows"]), (op, [r for r in result["rows"] if r["wrong"]])
        assert parse_nccl_tests(root / "commbench" / f"{op}.txt").warnings == ()
