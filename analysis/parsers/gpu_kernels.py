"""What a GPU kernel's name says, one home for every trace parser (analysis.parsers.kineto, analysis.parsers.nsys):
HTA's kernel kind, and the NCCL operation an NCCL kernel runs.

- `kernel_kind(name)`: HTA 0.5's classes (hta/utils/utils.py KernelType, is_comm_kernel, is_memory_kernel,
  is_compute_kernel), lower-cased: communication, memory, computation, other.
- `nccl_kernel_info(name)`: collective, algorithm, protocol, reduction and type of an NCCL kernel name.
- `kernel_collective(name)`: the collective alone ('unknown' for a kernel that names none).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# hta/utils/utils.py, applied to the name as the trace prints it
_HTA_COMM = re.compile(r"^nccl.*Kernel")
_HTA_MEMORY = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
_HTA_NOT_COMPUTE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")


def kernel_kind(name: str) -> str:
    """HTA's kernel type for a GPU event name, lower-cased: computation, communication, memory, other."""
    if _HTA_COMM.match(name):
        return "communication"
    if _HTA_MEMORY.match(name):
        return "memory"
    if not _HTA_NOT_COMPUTE.match(name):
        return "computation"
    return "other"


COLLECTIVES = {
    "allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
    "broadcast": "broadcast", "bcast": "broadcast", "reduce": "reduce", "sendrecv": "send_recv",
    "send": "send_recv", "recv": "send_recv", "alltoall": "all_to_all", "alltoallv": "all_to_all",
    "gather": "gather", "scatter": "scatter",
}
_ALGOS = ("COLLNET_DIRECT", "COLLNET_CHAIN", "NVLS_TREE", "RING", "TREE", "COLLNET", "NVLS", "PAT")
_PROTOS = ("LL128", "LL", "SIMPLE")
# NCCL 2.4-2.6 spelled the whole operation in camel case: ncclAllReduceRingLLKernel_sum_f32.
_NCCL_OLDEST = re.compile(r"^nccl(?P<coll>AllReduce|AllGather|ReduceScatter|Broadcast|Reduce|SendRecv)"
                          r"(?P<algo>Ring|Tree|CollNet)?(?P<proto>LL128|LL)?Kernel"
                          r"(?:_(?P<redop>[a-z]+)_(?P<dtype>\w+))?$")


@dataclass(frozen=True)
class NcclKernel:
    """What an NCCL kernel name says about the operation it runs."""
    collective: str | None
    algo: str | None
    proto: str | None
    redop: str | None
    dtype: str | None


def base_name(name: str) -> str:
    name = name.strip()
    if name.startswith("void "):
        name = name[5:]
    return name.split("(", 1)[0].split("<", 1)[0].strip()


def _split_algo(tokens: list[str]) -> tuple[str | None, str | None, list[str]]:
    """Find the ALGO_PROTO pair wherever the naming scheme put it; return it and the other tokens."""
    for i in range(len(tokens) - 1):
        for width in (2, 1):
            algo = "_".join(tokens[i:i + width])
            if algo in _ALGOS and i + width < len(tokens) and tokens[i + width] in _PROTOS:
                return algo, tokens[i + width], tokens[:i] + tokens[i + width + 1:]
    return None, None, tokens


def nccl_kernel_info(name: str | None) -> NcclKernel | None:
    """Collective, algorithm, protocol, reduction and type encoded in an NCCL kernel name.

    Three schemes: NCCL >= 2.19 `ncclDevKernel_AllReduce_Sum_bf16_RING_LL` (collectives without a
    reduction drop redop and type: `ncclDevKernel_AllGather_RING_LL`, `ncclDevKernel_SendRecv`),
    NCCL 2.7-2.18 `ncclKernel_AllReduce_RING_LL_Sum_float`, NCCL 2.4-2.6
    `ncclAllReduceRingLLKernel_sum_f32`. Returns None for a name that is not an NCCL kernel.

    >>> nccl_kernel_info("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
    NcclKernel(collective='all_reduce', algo='RING', proto='LL', redop='Sum', dtype='bf16')
    >>> nccl_kernel_info("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclWorkElem)").dtype
    'int8_t'
    """
    if not name:
        return None
    base = base_name(name)
    m = _NCCL_OLDEST.match(base)
    if m:
        return NcclKernel(COLLECTIVES.get(m["coll"].lower()), m["algo"].upper() if m["algo"] else None,
                          (m["proto"] or "SIMPLE").upper(), m["redop"], m["dtype"])
    for prefix in ("ncclDevKernel_", "ncclKernel_"):
        if base.startswith(prefix):
            tokens = [t for t in base[len(prefix):].split("_") if t]
            if not tokens:
                break
            algo, proto, rest = _split_algo(tokens[1:])
            redop = dtype = None
            if len(rest) >= 2:
                redop, dtype = rest[0], "_".join(rest[1:])
            return NcclKernel(COLLECTIVES.get(tokens[0].lower()), algo, proto, redop, dtype)
    if base.startswith("nccl"):
        return NcclKernel(None, None, None, None, None)
    return None


def kernel_collective(name: str) -> str:
    """The collective an NCCL kernel name encodes ('unknown' for ncclDevKernel_Generic, a name that is not NCCL's,
    and the like)."""
    info = nccl_kernel_info(name)
    return info.collective if info is not None and info.collective else "unknown"
