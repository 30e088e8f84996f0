"""What a Kineto event's args say about a collective call: which collective a CPU op or annotation stands for,
its message size in nccl-tests' convention and where that came from, its process group and size, and its sequence
number in the group (the columns collective, message_bytes, message_from, group, group_size and seq of
analysis.parsers.kineto.COLUMNS).
The NCCL kernel names are analysis.parsers.gpu_kernels'."""
from __future__ import annotations

import math
import re
from typing import Any

# CPU-side names: c10d::allreduce_, c10d::_allgather_base_, record_param_comms' 'Collective name'
# (allreduce, _reduce_scatter_base, allgather_into_tensor_coalesced, ...), nccl:all_reduce,
# gloo:all_to_all, _c10d_functional::reduce_scatter_tensor. Order matters: reduce_scatter before
# reduce and scatter, all_gather before gather.
_CPU_COLLECTIVE_PREFIX = re.compile(r"^(?:c10d::|nccl:|gloo:|mpi:|ucc:|_?c10d_functional::|record_param_comms$)")
_COLLECTIVE_WORDS = (
    ("reduce_scatter", re.compile(r"reduce_?scatter")), ("all_reduce", re.compile(r"all_?reduce")),
    ("all_gather", re.compile(r"all_?gather")), ("all_to_all", re.compile(r"all_?to_?all")),
    ("broadcast", re.compile(r"broadcast")), ("send_recv", re.compile(r"send|recv")),
    ("barrier", re.compile(r"barrier")), ("reduce", re.compile(r"reduce")),
    ("gather", re.compile(r"gather")), ("scatter", re.compile(r"scatter")),
)

# Element sizes for args 'dtype' (c10 ScalarType names) and 'Input type' (C++ type names).
_DTYPE_BYTES = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "c10::half": 2,
    "bfloat16": 2, "c10::bfloat16": 2, "long": 8, "long int": 8, "int64": 8, "int": 4, "int32": 4,
    "short": 2, "short int": 2, "int16": 2, "char": 1, "signed char": 1, "int8": 1, "byte": 1,
    "unsigned char": 1, "uint8": 1, "bool": 1, "complexfloat": 8, "c10::complex<float>": 8,
    "complexdouble": 16, "c10::complex<double>": 16, "unsigned int": 4, "uint32": 4,
    "unsigned long": 8, "uint64": 8, "unsigned short": 2, "uint16": 2,
}
_FLOAT8 = re.compile(r"float8|fp8", re.IGNORECASE)


def cpu_collective(name: str, collective_name: Any = None) -> str | None:
    """The collective a CPU op or annotation stands for; None when it is not a collective call.

    `collective_name` is record_param_comms' args 'Collective name'; 'wait' and 'init' there are
    bookkeeping, not collectives.
    """
    if not _CPU_COLLECTIVE_PREFIX.match(name):
        return None
    text = (collective_name if name == "record_param_comms" and isinstance(collective_name, str) else name)
    text = text.lower().split("::")[-1].split(":")[-1]
    for op, rx in _COLLECTIVE_WORDS:
        if rx.search(text):
            return op
    return None


def dtype_bytes(dtype: Any) -> int | None:
    """Bytes per element of a dtype name as Kineto writes it ('Float', 'c10::BFloat16', 'long int')."""
    if not isinstance(dtype, str):
        return None
    key = dtype.strip().lower()
    if key in _DTYPE_BYTES:
        return _DTYPE_BYTES[key]
    if _FLOAT8.search(key):
        return 1
    return None


def int_or_none(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def _tensor_bytes(dims: Any, dtype: Any) -> int | None:
    size = dtype_bytes(dtype)
    if size is None or not isinstance(dims, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        return None
    return math.prod(dims) * size


def _raw_json(raw: Any) -> Any:
    """Raw JSON (msgspec.Raw, or bytes from the C scanner) decoded; None when empty or not JSON.
    By the json module: Input Dims / Input type are small, and msgspec's import costs more than
    their decoding (where the two differ, on NaN or 1e400, no dimension list comes out either way)."""
    if not len(raw):
        return None
    import json

    try:
        return json.loads(bytes(raw))
    except (ValueError, RecursionError):  # not JSON: the size is just unknown
        return None


def message_of(args: Any) -> tuple[int | None, str | None]:
    """(message_bytes, message_from) from a collective event's args; see COLUMNS."""
    if (args.in_size is None and args.out_size is None and args.in_nelems is None and args.out_nelems is None
            and not len(args.input_dims)):
        return None, None  # e.g. the kernels of traces that record sizes only on the CPU side
    sizes = [v for v in (int_or_none(args.in_size), int_or_none(args.out_size)) if v is not None and v >= 0]
    if sizes:
        return max(sizes), "msg_size"
    nelems = [v for v in (int_or_none(args.in_nelems), int_or_none(args.out_nelems)) if v is not None and v >= 0]
    elem = dtype_bytes(args.dtype)
    if nelems and elem is not None:
        return max(nelems) * elem, "msg_nelems"
    dims, types = _raw_json(args.input_dims), _raw_json(args.input_types)
    if isinstance(dims, list) and isinstance(types, list):
        best = None
        for d, t in zip(dims, types):
            b = _tensor_bytes(d, t)
            if b is not None and (best is None or b > best):
                best = b
        if best is not None:
            return best, "input_dims"
    return None, None


def group_of(args: Any, pg_sizes: dict[str, int]) -> tuple[str | None, int | None]:
    name, ranks = args.pg_name, args.pg_ranks
    if name is None and ranks is None and args.group_size is None:
        return None, None
    group = str(name) if name not in (None, "") else (str(ranks) if ranks not in (None, "", "[]") else None)
    size = int_or_none(args.group_size)
    if size is None or size <= 0:
        size = None
        if isinstance(ranks, str) and ranks.strip().startswith("["):
            inner = ranks.strip()[1:-1].strip()
            size = len(inner.split(",")) if inner else None
        elif isinstance(ranks, list) and ranks:
            size = len(ranks)
        if size is None and name is not None:
            size = pg_sizes.get(str(name))
    return group, size


def seq_of(args: Any) -> int | None:
    """args 'Seq', the call's number in its process group (PyTorch writes -1 where it has none); None when absent."""
    seq = int_or_none(args.seq)
    return seq if seq is not None and seq >= 0 else None
