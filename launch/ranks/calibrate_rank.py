"""The per-rank half of `python -m launch calibrate`: `python -m launch.ranks.calibrate_rank CALIB_DIR INDEX`.

`calibrate` starts one of these per rank of a node at the same time (so they share the machine as training ranks
do), each a world of 1 with the threads a training rank gets. Each times, at the recipe's sizes
(`calibrate_spec.json`): torch Adam over flat fp32 partitions of several sizes, making the micro-batches, and what
the compute model's figures are fitted to (launch.config.calibration.Fitted): GEMMs of the recipe's dtype from
small squares to the model's own shapes, an elementwise add streaming through memory, and torch's fused attention
(sdpa, causal) at the model's heads and sequence. It writes `compute_INDEX.json`. No communication is timed here (the collectives come from the commbench sweep), nor
the passes and the engine (launch/ranks/calibrate_pass.py times them in situ).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from launch.config.calibration import RANK_SPEC_FILE, compute_file


def _timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def _data(resolved, spec: dict) -> dict[str, float]:
    """Seconds to make one micro-batch of each size the way the training loop does (the recipe's data source)."""
    import torch

    from launch.data.rows import micro_batch
    from launch.ranks.data import sources

    source = sources(resolved, Path(spec["data"])).train  # the corpus the training loop maps, as it maps it
    out = {}
    for b in spec["micro_batch_sizes"]:
        times = []
        for it in range(spec["warmup_iters"] + spec["iters"]):
            t0 = time.perf_counter()
            torch.from_numpy(micro_batch(source, it, global_batch=b, micro=b, dp=1, dp_rank=0, micro_step=0))
            times.append(time.perf_counter() - t0)
        out[str(b)] = statistics.fmean(times[spec["warmup_iters"]:])
    return out


def _adam(spec: dict, cuda: bool, sync) -> list[list[float]]:
    """(numel, seconds) of torch AdamW steps over one flat fp32 partition (ZeRO-1/2/3 step flat partitions)."""
    import torch

    points = []
    for numel in spec["adam_numels"]:
        p = torch.zeros(numel, device="cuda" if cuda else "cpu", requires_grad=True)
        p.grad = torch.full_like(p, 1e-3)
        opt = torch.optim.AdamW([p], lr=1e-3)
        times = [_timed(opt.step, sync) for _ in range(spec["warmup_iters"] + spec["iters"])][spec["warmup_iters"]:]
        points.append([numel, statistics.fmean(times)])
        del p, opt
    return points


# Each timing runs a call this many times over between two synchronisations, at least once: the time of a call
# itself, not of a launch and a sync (a 32-wide GEMM is microseconds; on a GPU a sync alone is more).
REPEAT_FOR_S = 1e-3


def _median(fn, sync, spec: dict) -> float:
    """Seconds per call of `fn`: the median over `fitted_iters` timings, each of enough calls to take REPEAT_FOR_S."""
    for _ in range(spec["warmup_iters"]):
        fn()
    once = max(_timed(fn, sync), 1e-9)
    repeat = max(1, min(1000, int(REPEAT_FOR_S / once)))

    def calls():
        for _ in range(repeat):
            fn()

    return statistics.median(_timed(calls, sync) for _ in range(spec["fitted_iters"])) / repeat


def _fitted(spec: dict, device: str, sync) -> dict:
    """Seconds per call of each GEMM shape, of an add over `memory_numel` elements, and of sdpa's forward and, alone,
    its backward."""
    import torch

    from launch.ranks.trainers.common import torch_dtype

    dtype = torch_dtype(spec["dtype"])
    gemms = []
    for m, n, k in spec["gemm_shapes"]:
        a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
        gemms.append({"m": m, "n": n, "k": k, "seconds": _median(lambda: torch.mm(a, b), sync, spec)})
    x, y = (torch.randn(spec["memory_numel"], dtype=dtype, device=device) for _ in range(2))
    z = torch.empty_like(x)
    add_s = _median(lambda: torch.add(x, y, out=z), sync, spec)
    att = spec["attention"]
    q, k, v = (torch.randn(att["batch"], att["heads"], att["seq"], att["head_dim"], dtype=dtype, device=device,
                           requires_grad=True) for _ in range(3))
    grad = torch.randn(att["batch"], att["heads"], att["seq"], att["head_dim"], dtype=dtype, device=device)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    forward_s = _median(lambda: sdpa(q, k, v, is_causal=True), sync, spec)
    out = sdpa(q, k, v, is_causal=True)  # the backward timed alone, over the one graph kept for it
    backward_s = _median(lambda: out.backward(grad, retain_graph=True), sync, spec)
    return {"gemms": gemms, "add_s": add_s, "memory_bytes": 3 * x.numel() * x.element_size(),
            "attention_forward_s": forward_s, "attention_backward_s": backward_s}


def main(argv: list[str]) -> int:
    from launch.config.calibration import fit_alpha_beta
    from launch.config.resolve import Resolved
    from launch.ranks.trainers.common import die_with_parent

    die_with_parent()
    calib_dir, index = Path(argv[0]), int(argv[1])
    spec = json.loads((calib_dir / RANK_SPEC_FILE).read_text())
    resolved = Resolved.load(spec["resolved"])
    cuda = resolved.hardware.device_type == "cuda"
    import torch

    if cuda:
        torch.cuda.set_device(0)  # calibrate sets CUDA_VISIBLE_DEVICES to this process's device
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    adam_points = _adam(spec, cuda, sync)
    alpha, beta = fit_alpha_beta(adam_points)  # the same straight-line fit: seconds = alpha + numel / beta
    doc = {"index": index, "pid": os.getpid(), "threads": torch.get_num_threads(),
           "data_s": _data(resolved, spec),
           "adam_points": adam_points, "adam_alpha_s": alpha, "adam_s_per_param": 0.0 if beta == float("inf") else 1 / beta,
           "fitted": _fitted(spec, "cuda" if cuda else "cpu", sync)}
    compute_file(calib_dir, index).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
