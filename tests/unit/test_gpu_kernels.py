"""The Kineto and the nsys parser classify a kernel name alike (analysis/parsers/gpu_kernels.py, their one home), by
HTA's rule: the expected kinds are HTA 0.5's (hta/utils/utils.py: a communication kernel matches `^nccl.*Kernel`,
memory `^Memcpy|^Memset|^dma`, computation is neither of those nor `Sync`), worked out by hand for each name."""
import pytest

from analysis.parsers import kineto, nsys

CASES = [
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication", "all_reduce"),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclWorkElem)", "communication", "send_recv"),
    ("ncclAllGatherRingLLKernel_copy_i8", "communication", "all_gather"),
    ("ncclDevKernel_Generic", "communication", "unknown"),
    # an NCCL helper that is not a kernel name of NCCL's scheme: HTA counts it as computation (nsys used to
    # call every nccl* name communication)
    ("nccl_pack_helper", "computation", "unknown"),
    ("Memcpy DtoH (Device -> Pinned)", "memory", "unknown"),
    ("Memset (Device)", "memory", "unknown"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, float)", "computation",
     "unknown"),
    ("cudaStreamSyncKernel", "other", "unknown"),
]


@pytest.mark.parametrize("name, kind, collective", CASES)
def test_both_parsers_classify_a_kernel_as_hta_does(name, kind, collective):
    assert kineto.kernel_kind(name) == kind
    assert nsys.kernel_kind(name) == kind
    if not name.startswith("void "):  # nsys prints C++ kernel names with `void `; the class is the same
        assert nsys.kernel_kind(f"void {name}") == kind
    assert kineto.kernel_collective(name) == collective
    info = nsys.nccl_kernel_info(name)
    assert (info.collective if info and info.collective else "unknown") == collective


def test_nsys_memory_operations_are_memory():
    assert nsys.kernel_kind("[CUDA memcpy Host-to-Device]") == "memory"
    assert nsys.kernel_kind("[CUDA memset]") == "memory"
