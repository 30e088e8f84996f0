"""Nsight Systems parsers: SQLite exports of three schema generations, and `nsys stats` text.

The SQLite fixtures are built per session by tests/fixtures/nsys/make_fixtures.py (see the README
beside it for where each table definition comes from); the stats texts are committed.
"""
from __future__ import annotations

import importlib.util
import shutil
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analysis.parsers.nsys import (
    COLUMNS,
    kernel_kind,
    nccl_kernel_info,
    parse_nsys_sqlite,
    phase_of,
    sniff,
    split_global_id,
    step_number,
)
from analysis.parsers.nsys_stats import STATS_COLUMNS, parse_nsys_stats_csv

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "nsys"
STATS = FIXTURES / "stats"


def _load_builder():
    spec = importlib.util.spec_from_file_location("nsys_make_fixtures", FIXTURES / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    return _load_builder().build_all(tmp_path_factory.mktemp("nsys"))


@pytest.fixture(scope="module")
def modern(exports):
    return parse_nsys_sqlite(exports["modern"], rank={4101: 0, 4102: 1})


def _one(table, **equals):
    rows = list(table.where(**equals).rows())
    assert len(rows) == 1, f"{equals}: {len(rows)} rows"
    return rows[0]


# --- SQLite: modern schema (3.x), two ranks in one report ---------------------------------------

def test_columns_are_documented_and_carry_units(modern):
    assert list(modern.columns) == list(COLUMNS)
    assert {"start_ns", "end_ns", "dur_ns", "launch_start_ns", "bytes"} <= set(modern.columns)
    assert modern.meta.counts == {"nvtx": 9, "cuda_runtime": 10, "kernel": 7, "memcpy": 2, "memset": 1}


def test_kernel_name_duration_and_launch_join(modern):
    gemm = _one(modern, short_name="ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn")
    assert gemm["name"] == "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn"
    assert (gemm["start_ns"], gemm["end_ns"], gemm["dur_ns"]) == (1_110_000, 1_310_000, 200_000)
    assert (gemm["device"], gemm["stream"], gemm["pid"], gemm["tid"], gemm["rank"]) == (0, 7, 4101, 4101, 0)
    assert (gemm["launch_api"], gemm["launch_start_ns"]) == ("cudaLaunchKernel", 1_100_000)
    assert (gemm["kind"], gemm["collective"], gemm["step"], gemm["phase"]) == ("computation", None, 1, "forward")


def test_nccl_kernel_is_communication_and_keeps_its_launch_context(modern):
    ar = _one(modern, short_name="ncclDevKernel_AllReduce_Sum_bf16_RING_LL")
    assert ar["name"] == "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    assert (ar["kind"], ar["collective"], ar["nccl_algo"], ar["nccl_proto"]) == ("communication", "all_reduce",
                                                                                 "RING", "LL")
    assert ar["dur_ns"] == 390_000
    # It runs until 1.90 ms, inside the CPU's `optimizer` range, but was launched during `backward`.
    assert (ar["step"], ar["phase"], ar["launch_start_ns"]) == (1, "backward", 1_500_000)


def test_step_comes_from_the_launch_not_from_gpu_time(modern):
    late = _one(modern, short_name="vectorized_elementwise_kernel")
    assert late["start_ns"] == 1_905_000 and late["end_ns"] == 2_010_000     # ends after `step 2` began
    assert (late["step"], late["phase"]) == (1, "optimizer")
    triton = _one(modern, short_name="triton_poi_fused_add_0")
    assert (triton["launch_api"], triton["step"], triton["phase"]) == ("cuLaunchKernel", 2, "forward")


def test_correlation_ids_are_joined_per_process(modern):
    rs = _one(modern, short_name="ncclKernel_ReduceScatter_RING_LL_Sum_half")
    # Rank 0 also has correlation id 10 (a memcpy launched at 1.01 ms); rank 1's own launch is at 1.10 ms.
    assert (rs["pid"], rs["correlation"], rs["launch_start_ns"], rs["rank"]) == (4102, 10, 1_100_000, 1)
    assert (rs["collective"], rs["step"], rs["device"]) == ("reduce_scatter", 7, 1)
    sr = _one(modern, short_name="ncclDevKernel_SendRecv")
    assert (sr["collective"], sr["kind"], sr["step"]) == ("send_recv", "communication", 7)


def test_memcpy_and_memset(modern):
    h2d = _one(modern, category="memcpy", pid=4101)
    assert (h2d["name"], h2d["bytes"], h2d["copy_kind"], h2d["dur_ns"]) == (
        "[CUDA memcpy Host-to-Device]", 4 * 1024 * 1024, "Host-to-Device", 40_000)
    assert (h2d["kind"], h2d["launch_api"], h2d["step"], h2d["phase"]) == ("memory", "cudaMemcpyAsync", 1, None)
    d2h = _one(modern, category="memcpy", pid=4102)
    assert (d2h["copy_kind"], d2h["bytes"], d2h["rank"]) == ("Device-to-Host", 2048, 1)
    ms = _one(modern, category="memset")
    assert (ms["name"], ms["bytes"], ms["kind"], ms["copy_kind"], ms["phase"]) == (
        "[CUDA memset]", 1024 * 1024, "memory", None, "backward")


def test_runtime_rows_lose_version_suffix_and_backtrace_twins(modern):
    api = modern.where(category="cuda_runtime")
    assert sorted(set(api.column("name"))) == ["cuLaunchKernel", "cudaLaunchKernel", "cudaMemcpyAsync",
                                               "cudaMemsetAsync", "cudaStreamSynchronize"]
    assert len(api.where(correlation=13, pid=4101)) == 1
    assert modern.meta.backtrace_rows_skipped == 1
    sync = _one(modern, name="cudaStreamSynchronize")
    assert (sync["dur_ns"], sync["step"], sync["kind"], sync["device"]) == (50_000, 2, None, None)


def test_nvtx_ranges_text_ids_domains_and_open_ranges(modern):
    nvtx = modern.where(category="nvtx")
    names = nvtx.column("name")
    assert names.count("forward") == 2                  # textId resolved through StringIds
    assert "checkpoint" not in names and "NCCL" not in names   # a mark and a domain creation are not ranges
    nccl = _one(modern, name="ncclAllReduce")
    assert (nccl["nvtx_domain"], nccl["collective"], nccl["step"], nccl["phase"]) == ("NCCL", "all_reduce", 1,
                                                                                       "backward")
    assert _one(modern, name="forward", start_ns=1_050_000)["nvtx_domain"] is None
    wait = _one(modern, name="dataloader wait")
    assert (wait["end_ns"], wait["dur_ns"], wait["step"]) == (None, None, 2)
    assert any("1 NVTX range(s) never ended" in w and "modern.sqlite" in w for w in modern.warnings)
    assert _one(modern, name="ProfilerStep#7")["step"] == 7


def test_gpu_activity_without_launch_call(modern):
    orphan = _one(modern, short_name="orphan_kernel")
    assert (orphan["launch_api"], orphan["launch_start_ns"], orphan["tid"], orphan["step"]) == (None, None, None,
                                                                                                 None)
    assert any("1 GPU activities have no CUDA runtime/driver call" in w for w in modern.warnings)


def test_meta(modern):
    meta = modern.meta
    assert (meta.nsys_version, meta.schema_version) == ("2024.6.2.225", "3.16.1")
    assert meta.devices == {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H100 80GB HBM3"}
    assert meta.processes == {4101: "python3", 4102: "python3"}
    assert meta.cuda_devices == [{"pid": 4101, "cuda_id": 0, "gpu_id": 0}, {"pid": 4102, "cuda_id": 1, "gpu_id": 1}]
    assert meta.missing_tables == [] and meta.duration_ns == 4_000_000


def test_rows_are_in_time_order_and_rank_can_be_one_int(exports):
    table = parse_nsys_sqlite(exports["modern"], rank=3, source="rank3.sqlite")
    starts = [s for s in table.column("start_ns")]
    assert starts == sorted(starts)
    assert set(table.column("rank")) == {3}
    assert table.source == "rank3.sqlite"
    assert set(parse_nsys_sqlite(exports["modern"]).column("rank")) == {None}


# --- SQLite: older generations and lazily missing tables ------------------------------------------

def test_mid2022_schema_without_enum_tables(exports):
    t = parse_nsys_sqlite(exports["mid2022"], rank=0)
    assert t.warnings == ()
    assert (t.meta.nsys_version, t.meta.schema_version) == ("2022.2.1.31", "2.9.1")
    ar = _one(t, category="kernel")
    assert ar["name"] == "ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)"
    assert (ar["collective"], ar["nccl_algo"], ar["kind"], ar["dur_ns"], ar["step"]) == (
        "all_reduce", "RING", "communication", 500_000, 3)
    d2h = _one(t, category="memcpy")
    assert (d2h["copy_kind"], d2h["bytes"], d2h["launch_api"]) == ("Device-to-Host", 262_144_000, "cudaMemcpy")
    mpi = _one(t, name="MPI_Allreduce")
    assert (mpi["nvtx_domain"], mpi["step"]) == ("MPI", 3)


def test_legacy_schema_inline_nvtx_text_and_cuda_gpu_table(exports):
    t = parse_nsys_sqlite(exports["legacy"])
    assert t.warnings == ()
    assert t.meta.devices == {0: "Tesla V100-SXM2-16GB"}
    assert t.meta.nsys_version is None
    gemm = _one(t, short_name="sgemm_largek_lds64")
    assert gemm["name"].startswith("void sgemm_largek_lds64<true, false, 5, 5, 4, 4, 4, 34>(")
    assert (gemm["dur_ns"], gemm["launch_api"], gemm["step"], gemm["phase"]) == (12_500, "cudaLaunchKernel", 0,
                                                                                 "forward")
    nccl = _one(t, short_name="ncclAllReduceRingLLKernel_sum_f32")
    assert (nccl["collective"], nccl["nccl_algo"], nccl["nccl_proto"], nccl["step"]) == ("all_reduce", "RING",
                                                                                          "LL", 0)
    h2d = _one(t, category="memcpy")
    assert (h2d["copy_kind"], h2d["bytes"], h2d["dur_ns"]) == ("Host-to-Device", 65_536, 2_000)
    ms = _one(t, category="memset")
    assert (ms["step"], ms["bytes"]) == (1, 4096)
    assert t.where(category="nvtx").column("name") == ["iteration 0", "forward", "iteration 1"]


def test_steps_counted_from_optimizer_ranges_when_none_are_named(exports, tmp_path):
    path = tmp_path / "phases.sqlite"
    shutil.copy(exports["legacy"], path)
    con = sqlite3.connect(path)
    con.execute("UPDATE NVTX_EVENTS SET text = 'dataloader' WHERE text LIKE 'iteration%'")
    gtid = con.execute("SELECT globalTid FROM NVTX_EVENTS LIMIT 1").fetchone()[0]
    for start, end in [(30_000, 40_000), (100_000, 105_000)]:
        con.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid) "
                    "VALUES (?, ?, 59, 'optimizer', ?)", (start, end, gtid))
    con.commit()
    con.close()
    t = parse_nsys_sqlite(path)
    assert t.meta.step_source == {2001: "optimizer"}
    assert _one(t, short_name="sgemm_largek_lds64")["step"] == 0          # launched at 15 us, before optimizer #0 ends
    assert _one(t, short_name="ncclAllReduceRingLLKernel_sum_f32")["step"] == 1   # launched at 40 us, as it ends
    assert _one(t, category="memset")["step"] == 1
    assert _one(t, name="dataloader", start_ns=10_000)["step"] is None     # before the first phase range
    assert parse_nsys_sqlite(exports["legacy"]).meta.step_source == {2001: "named"}


def test_missing_tables_are_not_errors(exports):
    t = parse_nsys_sqlite(exports["no_nvtx"])
    assert t.warnings == ()
    assert t.meta.missing_tables == ["CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET", "NVTX_EVENTS"]
    kernels = t.where(category="kernel")
    assert kernels.column("collective") == ["all_gather", "broadcast"]
    assert kernels.column("dur_ns") == [10_000, 1_000]
    assert set(t.column("step")) == {None} and set(t.column("phase")) == {None}


# --- SQLite: damaged input --------------------------------------------------------------------

@pytest.fixture(scope="module")
def grown(exports, tmp_path_factory) -> Path:
    """modern.sqlite plus 3000 kernels, so that data pages (not the schema) fill the end of the file."""
    path = tmp_path_factory.mktemp("grown") / "grown.sqlite"
    shutil.copy(exports["modern"], path)
    con = sqlite3.connect(path)
    template = con.execute("SELECT * FROM CUPTI_ACTIVITY_KIND_KERNEL "
                           "WHERE correlationId = 11 AND streamId = 7").fetchone()
    for i in range(3000):
        row = list(template)
        row[0], row[1] = 5_000_000 + 1000 * i, 5_000_500 + 1000 * i
        con.execute(f"INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES ({', '.join('?' * len(row))})", row)
    con.commit()
    con.close()
    return path


@pytest.mark.parametrize("keep", [0, 60, 100, 4096, 8192])
def test_export_cut_inside_its_schema_gives_no_rows_and_a_warning(exports, tmp_path, keep):
    cut = tmp_path / "cut.sqlite"
    cut.write_bytes(exports["modern"].read_bytes()[:keep])
    t = parse_nsys_sqlite(cut)
    assert len(t) == 0
    assert t.warnings and all(w.startswith(f"{cut}: ") for w in t.warnings)
    assert list(t.columns) == list(COLUMNS)


@pytest.mark.parametrize("fraction", [0.5, 0.8, 0.97])
def test_export_cut_inside_its_data_gives_partial_rows(grown, tmp_path, fraction):
    full = parse_nsys_sqlite(grown)
    data = grown.read_bytes()
    cut = tmp_path / "cut.sqlite"
    cut.write_bytes(data[:int(len(data) * fraction)])
    t = parse_nsys_sqlite(cut)
    kernels = len(t.where(category="kernel"))
    assert 0 < kernels < len(full.where(category="kernel")) == 3007
    assert len(t.where(category="nvtx")) == 9          # tables written before the cut are whole
    assert any("truncated" in w for w in t.warnings)
    assert any("table CUPTI_ACTIVITY_KIND_KERNEL stopped after" in w for w in t.warnings)
    assert all(w.startswith(f"{cut}: ") for w in t.warnings)
    assert sniff(cut) == "nsys_sqlite"


def test_rows_whose_time_makes_no_sense_are_dropped_and_counted(exports, tmp_path):
    """Text in a start column raised TypeError while the rows were sorted; an end far past the capture gave a
    kernel longer than a week, without a word."""
    from analysis.parsers.nsys_adapter import as_kineto

    path = tmp_path / "damaged.sqlite"
    shutil.copy(exports["modern"], path)
    con = sqlite3.connect(path)
    kernels = [r[0] for r in con.execute("SELECT rowid FROM CUPTI_ACTIVITY_KIND_KERNEL ORDER BY rowid")]
    con.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = 'garbage' WHERE rowid = ?", (kernels[0],))
    con.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = 9000000000000000000 WHERE rowid = ?", (kernels[1],))
    con.execute("UPDATE CUPTI_ACTIVITY_KIND_RUNTIME SET end = start - 5 WHERE rowid = 1")
    con.commit()
    con.close()
    t = parse_nsys_sqlite(path, source="damaged.sqlite")
    full = parse_nsys_sqlite(exports["modern"])
    assert len(t.where(category="kernel")) == len(full.where(category="kernel")) - 2
    assert len(t.where(category="cuda_runtime")) == len(full.where(category="cuda_runtime")) - 1
    assert ("damaged.sqlite: 3 row(s) dropped whose time makes no physical sense (1 with a start or end that is "
            "not a timestamp, 1 ending before it starts, 1 lasting longer than a week)") in t.warnings, t.warnings
    assert max(d for d in t.column("dur_ns") if d is not None) < 10**9
    assert len(as_kineto([t]))


def test_file_that_is_not_sqlite(tmp_path):
    junk = tmp_path / "report.sqlite"
    junk.write_text("Time (%),Total Time (ns)\n1,2\n")
    t = parse_nsys_sqlite(junk)
    assert len(t) == 0
    assert t.warnings == (f"{junk}: not an SQLite database (no 'SQLite format 3' header); expected an "
                          f"`nsys export --type sqlite` file",)
    missing = parse_nsys_sqlite(tmp_path / "absent.sqlite")
    assert len(missing) == 0 and "absent.sqlite: cannot read" in missing.warnings[0]


def test_overwritten_pages_do_not_raise(exports, tmp_path):
    data = bytearray(exports["modern"].read_bytes())
    for offset in range(4096 * 3, len(data), 4096 * 2):
        data[offset:offset + 512] = bytes(range(256)) * 2
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(bytes(data))
    t = parse_nsys_sqlite(bad)
    assert t.warnings and all("bad.sqlite" in w for w in t.warnings)


def test_sqlite_without_nsys_tables(tmp_path):
    other = tmp_path / "other.sqlite"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE t (x INTEGER)")
    con.commit()
    con.close()
    t = parse_nsys_sqlite(other)
    assert len(t) == 0 and "no Nsight Systems tables" in t.warnings[0]
    assert sniff(other) is None


# --- name rules -------------------------------------------------------------------------------

@pytest.mark.parametrize("name, expected", [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
     ("all_reduce", "RING", "LL", "Sum", "bf16")),
    ("ncclDevKernel_AllGather_RING_LL", ("all_gather", "RING", "LL", None, None)),
    ("ncclDevKernel_ReduceScatter_Sum_f32_COLLNET_DIRECT_SIMPLE",
     ("reduce_scatter", "COLLNET_DIRECT", "SIMPLE", "Sum", "f32")),
    ("ncclDevKernel_AllReduce_Sum_f16_NVLS_TREE_LL128", ("all_reduce", "NVLS_TREE", "LL128", "Sum", "f16")),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", ("send_recv", None, None, None, None)),
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", ("all_reduce", "RING", "LL", "Sum", "float")),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t", ("send_recv", "RING", "SIMPLE", "Sum", "int8_t")),
    ("ncclKernel_Broadcast_RING_LL_Sum_int8_t", ("broadcast", "RING", "LL", "Sum", "int8_t")),
    ("ncclAllReduceTreeLL128Kernel_sum_f16(ncclColl)", ("all_reduce", "TREE", "LL128", "sum", "f16")),
    ("ncclBroadcastRingKernel_copy_i8", ("broadcast", "RING", "SIMPLE", "copy", "i8")),
    ("ncclDevKernel_Generic_4", (None, None, None, None, None)),
])
def test_nccl_kernel_names(name, expected):
    info = nccl_kernel_info(name)
    assert (info.collective, info.algo, info.proto, info.redop, info.dtype) == expected
    assert kernel_kind(name) == "communication"


def test_kinds_steps_phases_and_global_ids():
    assert nccl_kernel_info("void at::native::vectorized_elementwise_kernel<4>(int)") is None
    assert kernel_kind("[CUDA memcpy Host-to-Device]") == "memory"
    assert kernel_kind("Memset (Device)") == "memory"
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "computation"
    for text, step in [("step 3", 3), ("step_12", 12), ("ProfilerStep#5", 5), ("ProfilerStep#5, op_id = 9", 5),
                       ("iteration 0", 0), ("train_step 4", 4), ("stepper", None), ("forward", None)]:
        assert step_number(text) == step, text
    for text, phase in [("forward", "forward"), ("forward-compute", "forward"), ("DeepSpeedEngine.backward",
                        "backward"), ("bwd", "backward"), ("optimizer.step", "optimizer"), ("forward-backward", None),
                        ("forwarding", None), ("aten::mm", None)]:
        assert phase_of(text) == phase, text
    # The two real exports: globalTid 302119224788637 is pid 1230493, tid 1230493 (VM id 1).
    assert split_global_id(302119224788637) == (1230493, 1230493)
    assert split_global_id(302119223558144) == (1230493, 0)
    assert split_global_id(None) == (None, None)


# --- nsys stats --------------------------------------------------------------------------------

def test_stats_bundle_with_banners():
    t = parse_nsys_stats_csv(STATS / "bundle_banners_2024.csv")
    assert list(t.columns) == list(STATS_COLUMNS)
    assert t.warnings == ()
    assert t.meta.reports == ["nvtx_sum", "cuda_api_sum", "cuda_gpu_kern_sum", "cuda_gpu_mem_time_sum",
                                 "cuda_gpu_mem_size_sum"]
    k = _one(t, report="cuda_gpu_kern_sum")
    assert k["name"] == "vectorAdd(const float *, const float *, float *, int)"
    assert (k["time_pct"], k["total_ns"], k["instances"], k["avg_ns"], k["med_ns"], k["min_ns"], k["max_ns"],
            k["stddev_ns"], k["kind"]) == (100.0, 1_831_281, 1010, 1813.1, 1823.0, 1791, 4705, 93.3, "computation")
    assert t.where(report="nvtx_sum").column("name") == ["Profile_Loop", "Warmup"]
    assert _one(t, name="cudaLaunchKernel")["instances"] == 1010
    size = t.where(report="cuda_gpu_mem_size_sum")
    assert size.column("total_bytes") == [0, 0] and size.column("kind") == ["memory", "memory"]


def test_stats_column_format_2024():
    t = parse_nsys_stats_csv(STATS / "profile_stats_column_2024.txt")
    assert t.warnings == ()
    assert t.meta.reports == ["nvtx_sum", "osrt_sum", "cuda_api_sum", "cuda_gpu_kern_sum",
                                 "cuda_gpu_mem_time_sum", "cuda_gpu_mem_size_sum"]
    loop = _one(t, name="Profile_Loop")
    assert (loop["style"], loop["total_ns"], loop["avg_ns"], loop["line"]) == ("PushPop", 3_481_709, 3_481_709.0, 8)
    malloc = _one(t, name="cudaMalloc")
    assert (malloc["total_ns"], malloc["instances"], malloc["stddev_ns"]) == (106_912_410, 3, 61_716_139.1)
    kern = _one(t, report="cuda_gpu_kern_sum")
    assert (kern["name"], kern["instances"], kern["max_ns"]) == (
        "vectorAdd(const float *, const float *, float *, int)", 1010, 4705)
    assert _one(t, report="cuda_gpu_mem_time_sum", name="[CUDA memcpy DtoH]")["total_ns"] == 2336


def test_stats_column_format_2020_old_titles_and_kib():
    t = parse_nsys_stats_csv(STATS / "column_2020_dli.txt")
    assert t.warnings == ()
    assert t.meta.reports == ["cuda_api_sum", "cuda_gpu_kern_sum", "cuda_gpu_mem_time_sum",
                                 "cuda_gpu_mem_size_sum", "osrt_sum"]
    k = _one(t, report="cuda_gpu_kern_sum")
    assert (k["name"], k["total_ns"], k["avg_ns"], k["med_ns"], k["stddev_ns"]) == (
        "addVectorsInto(float*, float*, float*, int)", 2_299_046_069, 2_299_046_069.0, None, None)
    htod = _one(t, report="cuda_gpu_mem_size_sum", name="[CUDA Unified Memory memcpy HtoD]")
    assert (htod["total_bytes"], htod["instances"], htod["min_bytes"], htod["max_bytes"]) == (
        393_216 * 1024, 2304, 4096, 1020 * 1024)
    assert _one(t, report="cuda_gpu_mem_time_sum", instances=768)["total_ns"] == 20_958_699


def test_stats_legacy_csv_headers_without_banners():
    t = parse_nsys_stats_csv(STATS / "legacy_2020.csv")
    assert [g["report"] for g in t.meta.guessed] == ["cuda_gpu_kern_sum", "cuda_gpu_mem_time_sum",
                                                        "cuda_gpu_mem_size_sum", "cuda_api_sum"]
    k = _one(t, report="cuda_gpu_kern_sum")
    assert (k["name"], k["avg_ns"], k["min_ns"]) == ("addVectorsInto(float*, float*, float*, int)",
                                                      2_299_046_069.0, 2_299_046_069)
    assert _one(t, report="cuda_gpu_mem_size_sum", instances=768)["total_bytes"] == 131_072 * 1024
    assert _one(t, name="cudaMallocManaged")["instances"] == 3


def test_stats_real_nvtx_sum_csv():
    t = parse_nsys_stats_csv(STATS / "nvtx_sum_2024.csv")
    assert t.meta.reports == ["nvtx_sum"] and t.warnings == ()
    assert t.column("name")[:3] == ["step_0", "data_load", "backward"]
    bwd = _one(t, name="backward")
    assert (bwd["instances"], bwd["total_ns"], bwd["med_ns"], bwd["max_ns"]) == (50, 694_057_698, 1_392_122.5,
                                                                                 620_707_110)


def test_stats_trace_csv_without_banner():
    t = parse_nsys_stats_csv(STATS / "nvtx_pushpop_trace_2022_pipit.csv")
    assert t.meta.reports == ["nvtx_pushpop_trace"]
    first = next(t.rows())
    assert (first["name"], first["start_ns"], first["dur_ns"]) == ("main", 982_845_927, 1_005_098_329)
    assert first["extra"]["End (ns)"] == "1987944256" and first["extra"]["PID"] == "3086332"


def test_stats_variants_aliases_units_skips_and_damage():
    t = parse_nsys_stats_csv(STATS / "variants.csv")
    assert t.meta.reports == ["cuda_gpu_kern_sum", "cuda_api_sum", "cuda_gpu_kern_sum"]
    assert t.meta.skipped == [{"report": "nvtx_sum",
                                  "why": "rank0.sqlite does not contain NV Tools Extension (NVTX) data."}]
    ar = _one(t, collective="all_reduce")
    assert (ar["total_ns"], ar["instances"], ar["kind"], ar["time_pct"]) == (8_000_000, 20, "communication", 61.5)
    quoted = _one(t, total_ns=4_000_000)
    assert quoted["name"].startswith("void at::native::vectorized_elementwise_kernel<4, at::native::")
    launch = _one(t, name="cudaLaunchKernel")
    assert (launch["total_ns"], launch["avg_ns"], launch["max_ns"]) == (250_500, 2505.0, 9100)
    assert _one(t, name="cudaStreamSynchronize")["stddev_ns"] is None
    unquoted = _one(t, line=15)
    assert unquoted["name"] == ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl<"
                                "at::native::AddFunctor<float>>>(int, T3)")
    assert t.warnings == (f"{STATS / 'variants.csv'}: line 16: 4 fields where the header at line 14 has 9; "
                          f"row skipped",)


def test_stats_from_text_and_sniff(exports, tmp_path):
    text = (STATS / "nvtx_sum_2024.csv").read_text()
    t = parse_nsys_stats_csv(text, source="pasted")
    assert len(t) == 8 and t.source == "pasted"
    for path in STATS.iterdir():
        assert sniff(path) == "nsys_stats_csv", path
    for path in exports.values():
        assert sniff(path) == "nsys_sqlite", path
    # Content decides, not the name.
    renamed = tmp_path / "kernels.txt"
    shutil.copy(exports["legacy"], renamed)
    assert sniff(renamed) == "nsys_sqlite"
    # Cut inside its schema, an SQLite file no longer says what wrote it.
    damaged = tmp_path / "damaged.sqlite"
    damaged.write_bytes(exports["modern"].read_bytes()[:8192])
    assert sniff(damaged) is None
    prose = tmp_path / "notes.csv"
    prose.write_text("name,value\nstep,3\n")
    assert sniff(prose) is None
    assert sniff(tmp_path / "absent") is None


# --- properties ----------------------------------------------------------------------------------

_STATS_TEXTS = {p.name: p.read_text() for p in sorted(STATS.iterdir())}
_ALPHABET = st.sampled_from(list(",\"\n :()%-*[]#.0123456789") + ["Time (%)", "Total Time (ns)", "Name", "Range",
                                                                 "Instances", "Avg (ns)", " ** X (cuda_api_sum):",
                                                                 "Processing [a] with [b/nvtx_sum.py]", "-----",
                                                                 "Style", "Total (MB)", "N/A", "\u2026", "\x00"])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_ALPHABET, max_size=80).map("".join))
def test_stats_parser_never_raises_on_garbage(text):
    t = parse_nsys_stats_csv(text + "\n", source="garbage")
    n = text.count("\n") + 1
    assert all(isinstance(line, int) and 1 <= line <= n for line in t.column("line"))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(_STATS_TEXTS)), st.floats(min_value=0.0, max_value=1.0))
def test_stats_parser_truncation_is_partial_never_fatal(name, fraction):
    text = _STATS_TEXTS[name]
    full = parse_nsys_stats_csv(text, source=name)
    cut = parse_nsys_stats_csv(text[:int(len(text) * fraction)], source=name)
    assert len(cut) <= len(full)
    assert all(w.startswith(f"{name}:") for w in cut.warnings)


_NAMES = st.text(st.characters(whitelist_categories=("Lu", "Ll", "Nd"), whitelist_characters="_:<>*& "),
                 min_size=1, max_size=30).map(str.strip).filter(bool)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10**12), st.integers(1, 10**6), _NAMES), min_size=1, max_size=8))
def test_stats_csv_round_trips_numbers(rows):
    lines = ['"Time (%)","Total Time (ns)","Instances","Avg (ns)","Med (ns)","Min (ns)","Max (ns)",'
             '"StdDev (ns)","Name"']
    for total, count, name in rows:
        lines.append(f'"1.0","{total}","{count}","{total / count:.1f}","0.0","0","{total}","0.0","{name}"')
    text = " ** CUDA GPU Kernel Summary (cuda_gpu_kern_sum):\n\n" + "\n".join(lines) + "\n"
    t = parse_nsys_stats_csv(text)
    assert t.warnings == ()
    assert t.column("total_ns") == [total for total, _, _ in rows]
    assert t.column("instances") == [count for _, count, _ in rows]
    assert t.column("name") == [name for _, _, name in rows]
    assert set(t.column("report")) == {"cuda_gpu_kern_sum"}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(min_value=0, max_value=200_000), st.binary(min_size=1, max_size=64))
def test_sqlite_parser_never_raises_on_damage(exports, tmp_path, offset, junk):
    data = bytearray(exports["mid2022"].read_bytes())
    offset = offset % len(data)
    data[offset:offset + len(junk)] = junk
    damaged = tmp_path / "damaged.sqlite"
    damaged.write_bytes(bytes(data))
    t = parse_nsys_sqlite(damaged)
    assert list(t.columns) == list(COLUMNS)
