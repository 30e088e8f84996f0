"""Whether bitsandbytes runs QLoRA's 4-bit NF4 layers on this machine's device: `python -m launch.torchtools.four_bit
DEVICE_TYPE DTYPE`, the check the CLI runs before any rank of a QLoRA run starts (launch.commands.run.check_inputs).

bitsandbytes imports without its native library (a build for another CUDA, a CPU-only wheel on a GPU machine) and
fails only when a kernel is called: here that would be every rank, minutes into start-up, inside the sharded load.
So the check runs what a rank runs, once and small: a weight quantized to NF4 on the device as the ranks quantize
theirs (blocks of NF4_BLOCKSIZE, double-quantized scales), then a forward and backward through bitsandbytes' Linear4bit
at the run's compute dtype, compared with the same layer unquantized. It prints one line and exits 2 when that fails
or is wrong (NF4's rounding moves this layer's outputs by ~11% of their largest; garbage moves them by ~100%).
"""
from __future__ import annotations

import sys

from launch.plan.adapters import NF4_BLOCKSIZE
from launch.torchtools.hf import offline_bitsandbytes

# Largest output error, relative to the largest output, that still reads as NF4 rounding (measured: 0.11 in bf16).
TOLERANCE = 0.3


def problem(device_type: str, dtype_name: str) -> str | None:
    """None when a bitsandbytes NF4 layer trains on `device_type` ("cpu" | "cuda") at `dtype_name`; else why not."""
    import torch

    offline_bitsandbytes()
    try:
        import bitsandbytes as bnb
    except Exception as e:  # ImportError, or a backend of its own that fails as it loads
        return f"bitsandbytes does not import ({type(e).__name__}: {_first_line(e)})"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    dense = torch.nn.Linear(4 * NF4_BLOCKSIZE, NF4_BLOCKSIZE, bias=False, dtype=dtype)
    x = torch.randn(4, 4 * NF4_BLOCKSIZE, dtype=dtype)
    try:
        layer = bnb.nn.Linear4bit(dense.in_features, dense.out_features, bias=False, compute_dtype=dtype,
                                  quant_type="nf4", compress_statistics=True)
        layer.weight = bnb.nn.Params4bit(dense.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                         blocksize=NF4_BLOCKSIZE, compress_statistics=True)
        layer.to(device)
        x_dev = x.to(device, copy=True).requires_grad_()
        y = layer(x_dev)
        y.float().sum().backward()
        y, grad = y.detach().float().cpu(), x_dev.grad.float().cpu()
    except Exception as e:  # the native library's own message says which build is missing
        return (f"bitsandbytes {bnb.__version__} cannot run a 4-bit NF4 layer on {device} "
                f"({type(e).__name__}: {_first_line(e)})")
    weight = dense.weight.detach().float()
    want, want_grad = x.float() @ weight.T, weight.sum(0).expand_as(grad)
    for what, got, ref in (("forward", y, want), ("backward", grad, want_grad)):
        err = float((got - ref).abs().max() / ref.abs().max())
        if not err <= TOLERANCE:  # NaN included
            return (f"bitsandbytes {bnb.__version__}'s 4-bit NF4 layer on {device} computes a wrong {what} "
                    f"(largest error {err:.2f} of the largest value; NF4's rounding gives ~0.1)")
    return None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


USAGE = "usage: python -m launch.torchtools.four_bit cpu|cuda bf16|fp16"

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("cpu", "cuda") or sys.argv[2] not in ("bf16", "fp16"):
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    said = problem(sys.argv[1], sys.argv[2])
    if said:
        print(f"error: {said}", file=sys.stderr)
    sys.exit(2 if said else 0)
