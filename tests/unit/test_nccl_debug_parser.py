"""NCCL_DEBUG=INFO parser and transport verdict (fixtures described in fixtures/nccl/README.md)."""
from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.analyzers.comm_tables import transports
from analysis.parsers.nccl_debug import (
    COLUMNS,
    Finding,
    find_log_line,
    normalise_transport,
    parse_nccl_debug,
    verdict,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "nccl"
DEBUG_FIXTURES = sorted(FIXTURES.glob("*debug*.txt"))


def excerpt(letter: str) -> str:
    """One `### (x)` section of the real excerpts file (each comes from a different log)."""
    text = (FIXTURES / "real_debug_transport_excerpts_from_issues.txt").read_text()
    sections = {part.lstrip()[1]: "###" + part for part in text.split("###")[1:]}
    return sections[letter]


def rows(table, **equals):
    return [r for r in table.rows() if all(r[k] == v for k, v in equals.items())]


# --- real excerpts --------------------------------------------------------------------------------

def test_real_ib_gdrdma_and_p2p_ipc_issue687():
    t = parse_nccl_debug(excerpt("a"), source="issue687")
    assert t.warnings == ()
    assert len(t) == 11
    first = rows(t, line=2)[0]
    assert first == {"host": "cosmos-hpc-100a45", "pid": 985927, "rank": 3, "cuda_dev": 3, "comm": None,
                     "channel": 0, "conn_index": None, "peer_from": 3, "peer_to": 6, "peer_host": None,
                     "direction": "send", "transport": "NET/IB/GDRDMA", "via_detail": "NET/IB/0/GDRDMA",
                     "kind": None, "line": 2}
    # The bracket after the prefix is the local CUDA device, not the rank: rank 4 logs as [0].
    r = rows(t, line=5)[0]
    assert (r["rank"], r["cuda_dev"], r["peer_from"], r["peer_to"]) == (4, 0, 4, 7)
    # Its thread later prints `Connected all rings`, so this connection was a ring connection.
    assert r["kind"] == "ring" and r["transport"] == "P2P/IPC" and r["via_detail"] == "P2P/IPC/read"
    assert Counter(t.column("transport")) == {"NET/IB/GDRDMA": 4, "P2P/IPC": 7}
    assert verdict(t) == []


def test_real_socket_fallback_issue952():
    t = parse_nccl_debug(excerpt("b"))
    assert len(t) == 5
    sock = rows(t, transport="NET/Socket")
    assert [(r["rank"], r["cuda_dev"], r["channel"], r["conn_index"], r["direction"]) for r in sock] == \
        [(15, 7, 3, 0, "send"), (15, 7, 7, 0, "send")]
    assert sock[0]["host"] == "<cluster_name>"
    findings = verdict(t)
    assert [f.severity for f in findings] == ["info"]
    assert "rank 15 on host <cluster_name> talks to other nodes over NET/Socket" in findings[0].message
    warn = verdict(t, expect_net="IB")
    assert [f.severity for f in warn] == ["warn"]
    assert "expected NET/IB" in warn[0].message and "the profile expects IB" in warn[0].message
    assert warn[0].evidence == ("line 4: 15 -> 6 via NET/Socket/3", "line 5: 15 -> 6 via NET/Socket/3")


def test_real_ib_device_discovery_issue228():
    t = parse_nccl_debug(excerpt("c"))
    assert len(t) == 0 and t.warnings == ()
    assert t.meta.ib_devices == [{"host": "user", "device": "mlx5_0", "port": 1, "link": "IB", "line": 4},
                                 {"host": "user", "device": "mlx5_2", "port": 1, "link": "IB", "line": 4}]
    assert t.meta.net_plugins == [{"host": "user", "name": "IB"}]
    assert t.meta.env == {"NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "mlx5_2:1,mlx5_0:1"}
    assert [f.severity for f in verdict(t)] == ["info"]


def test_real_ib_without_gdrdma_and_direct_pointer_issue1412():
    t = parse_nccl_debug(excerpt("d"))
    assert [r["transport"] for r in t.rows()] == ["P2P/direct pointer", "NET/IB", "NET/IB"]
    recv = rows(t, direction="receive")[0]
    assert (recv["rank"], recv["cuda_dev"], recv["peer_from"], recv["peer_to"], recv["channel"]) == (4, 4, 13, 4, 3)
    findings = verdict(t)
    assert [f.severity for f in findings] == ["info"]
    assert findings[0].message.startswith("ranks 4–5 on host swat1-04 use NET/IB without GPUDirect RDMA")


def test_real_legacy_ring_lines_without_host_issue392():
    t = parse_nccl_debug(excerpt("e"))
    assert (t.meta.nccl_version, t.meta.cuda_runtime) == ("2.5.7", "10.0")
    assert t.meta.ib_devices == [{"host": None, "device": "mlx5_0", "port": 1, "link": "RoCE", "line": 2}]
    assert [(r["transport"], r["kind"], r["host"], r["rank"]) for r in t.rows()] == [
        ("NET/RoCE", "ring", None, 0), ("P2P/IPC", "ring", None, 0), ("SHM", "ring", None, 0)]
    assert rows(t, transport="SHM")[0]["via_detail"] == "direct shared memory"
    # SHM next to P2P on the same machine: pairs that cross the CPU interconnect, noted not warned.
    assert [f.severity for f in verdict(t)] == ["info", "info"]


def test_real_roce_connection_is_reported_as_roce_issue392():
    # NCCL prints `via NET/IB/0` over RoCE too; device 0 of this process's list is `mlx5_0:1/RoCE`.
    t = parse_nccl_debug(excerpt("e"))
    (net,) = rows(t, direction="receive")
    assert (net["via_detail"], net["transport"]) == ("NET/IB/0", "NET/RoCE")
    assert [f.message for f in verdict(t) if "GPUDirect" in f.message] == [(
        "rank 0 uses NET/RoCE without GPUDirect RDMA: data is staged through host memory (nvidia-peermem not "
        "loaded, or GPU and NIC too far apart in PCIe)")]


# Two hosts whose processes list different devices (NCCL 2.18 format strings, as the c_debug_* fixtures): the
# device index in `via NET/IB/<dev>` refers to the printing process's own list.
TWO_FABRICS = """\
rc-01:100:150 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/RoCE [1]mlx5_1:1/RoCE [RO]; OOB eth0:10.0.0.1<0>
rc-01:100:150 [0] NCCL INFO Using network IB
ib-02:200:250 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [RO]; OOB ib0:10.0.1.2<0>
ib-02:200:250 [0] NCCL INFO Using network IB
rc-01:100:150 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/IB/1/GDRDMA
rc-01:100:150 [0] NCCL INFO Channel 01/0 : 1[0] -> 0[0] [receive] via NET/IB/0
ib-02:200:250 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [receive] via NET/IB/0/GDRDMA
"""


def test_roce_is_told_from_ib_by_the_printing_process_own_device_list():
    t = parse_nccl_debug(TWO_FABRICS)
    assert [(r["host"], r["transport"]) for r in t.rows()] == [
        ("rc-01", "NET/RoCE/GDRDMA"), ("rc-01", "NET/RoCE"), ("ib-02", "NET/IB/GDRDMA")]
    assert {g["transport"]: g["gdrdma"] for g in transports(t).rows()} == {
        "NET/RoCE/GDRDMA": True, "NET/RoCE": False, "NET/IB/GDRDMA": True}
    assert [f.message.split(":")[0] for f in verdict(t)] == [
        "rank 0 on host rc-01 uses NET/RoCE without GPUDirect RDMA"]


def test_a_socket_finding_cites_only_what_its_own_host_printed():
    # The real excerpts are logs of different machines: host <cluster_name> (b) uses NET/Socket and lists no IB
    # device; host `user` (c) lists two. The finding names each host with its own lines, never user's devices as
    # <cluster_name>'s.
    t = parse_nccl_debug(FIXTURES / "real_debug_transport_excerpts_from_issues.txt")
    (sock,) = [f for f in verdict(t) if "NET/Socket" in f.message]
    assert sock.severity == "warn"
    assert sock.message == (
        "rank 15 on host <cluster_name> talks to other nodes over NET/Socket: no IB or RoCE device listed by host "
        "<cluster_name>, while the log has mlx5_0:1/RoCE listed by the lines without a host at line 35; "
        "mlx5_0:1/IB, mlx5_2:1/IB listed by host user at line 26")
    assert sock.evidence == ("line 19: 15 -> 6 via NET/Socket/3", "line 20: 15 -> 6 via NET/Socket/3")
    # Alone, the same lines are a note: nothing in that log says the fabric exists.
    assert [f.severity for f in verdict(parse_nccl_debug(excerpt("b")))] == ["info"]


def test_whole_real_file_parses_cleanly():
    t = parse_nccl_debug(FIXTURES / "real_debug_transport_excerpts_from_issues.txt")
    assert t.warnings == () and len(t) == 22
    assert list(t.columns) == list(COLUMNS)


# --- constructed logs -----------------------------------------------------------------------------

def test_two_node_ib_gdrdma_log_kinds_ranks_and_meta():
    t = parse_nccl_debug(FIXTURES / "c_debug_v2_21_2node_ib_gdrdma.txt")
    assert t.warnings == ()
    m = t.meta
    assert (m.nccl_version, m.cuda_runtime, m.cuda_driver) == ("2.21.5", "12.4", "12.4")
    assert m.nranks == 8 and m.nnodes == 2 and m.hosts == ["gpu-a017", "gpu-a018"]
    assert m.ranks[5] == {"host": "gpu-a018", "pid": 52202, "cuda_dev": 1, "nvml_dev": 1, "busid": "2a000",
                             "nranks": 8}
    assert [(d["host"], d["device"], d["line"]) for d in m.ib_devices] == [
        (host, f"mlx5_{i}", line) for host, line in (("gpu-a017", 12), ("gpu-a018", 32)) for i in range(4)]
    assert m.net_plugins == [{"host": "gpu-a017", "name": "IB"}, {"host": "gpu-a018", "name": "IB"}]
    assert m.algo_proto == {"NCCL_ALGO": "Ring,Tree"}
    assert m.rings[1] == {"channel": 1, "order": [0, 1, 2, 3, 4, 5, 6, 7], "line": 60}
    assert m.channel_counts == {"coll": 2, "collnet": 2, "nvls": 0, "p2p": 2, "per_peer": 2}
    assert Counter(zip(t.column("transport"), t.column("kind"))) == {
        ("P2P/CUMEM", "ring"): 12, ("NET/IB/GDRDMA", "ring"): 8, ("P2P/CUMEM", "tree"): 6,
        ("NET/IB/GDRDMA", "tree"): 4, ("NET/IB/GDRDMA", "p2p"): 2, ("P2P/CUMEM", "p2p"): 2}
    assert set(t.column("comm")) == {"0x7b3a9e41c2d05f11"}
    for r in t.rows():  # NET between the hosts, P2P inside them
        assert (r["peer_host"] != r["host"]) == r["transport"].startswith("NET/")
    assert verdict(t) == []


def test_socket_between_nodes_with_ib_disabled():
    t = parse_nccl_debug(FIXTURES / "c_debug_v2_18_socket_ib_disabled.txt")
    assert t.meta.env["NCCL_IB_DISABLE"] == "1"
    assert t.meta.net_plugins == [{"host": "cn041", "name": "Socket"}, {"host": "cn042", "name": "Socket"}]
    assert t.meta.socket_interfaces[0] == {"host": "cn041", "interface": "eth0", "address": "192.168.10.11"}
    assert [f.severity for f in verdict(t)] == ["info", "info"]
    warn = verdict(t, expect_net="IB")
    assert [f.message.split(":")[0] for f in warn] == [
        "ranks 0–1 on host cn041 talk to host cn042 over NET/Socket",
        "ranks 2–3 on host cn042 talk to host cn041 over NET/Socket"]
    assert all(f.severity == "warn" and "expected NET/IB" in f.message for f in warn)


def test_socket_used_although_roce_devices_are_listed():
    t = parse_nccl_debug(FIXTURES / "c_debug_v2_19_roce_listed_socket_used.txt")
    findings = verdict(t)
    assert [f.severity for f in findings] == ["warn", "warn"]
    # Each host's finding cites the devices that host listed, and the link layer they name.
    assert findings[0].message.startswith("rank 0 on host roce-07 talks to host roce-08 over NET/Socket: expected "
                                          "NET/RoCE (mlx5_0:1/RoCE, mlx5_1:1/RoCE listed by host roce-07 at line 2")
    assert findings[1].message.startswith("rank 1 on host roce-08 talks to host roce-07 over NET/Socket: expected "
                                          "NET/RoCE (mlx5_0:1/RoCE, mlx5_1:1/RoCE listed by host roce-08 at line 6")
    assert all("Using network Socket" in f.message for f in findings)


def test_shm_instead_of_p2p_inside_a_node():
    t = parse_nccl_debug(FIXTURES / "c_debug_v2_20_shm_p2p_disabled.txt")
    assert set(t.column("transport")) == {"SHM"} and set(t.column("via_detail")) == {"SHM/direct/direct"}
    findings = verdict(t)
    assert len(findings) == 1 and findings[0].severity == "warn"
    assert findings[0].message.startswith("ranks 0–3 on host pcie-box exchange data over SHM instead of P2P: "
                                          "NCCL_P2P_DISABLE=1 is set")


def test_mpirun_tags_timestamps_nvls_and_collnet():
    t = parse_nccl_debug(FIXTURES / "c_debug_v2_26_mpirun_nvls_collnet.txt")
    assert t.warnings == ()
    nvls = rows(t, transport="NVLS")
    assert [(r["host"], r["rank"], r["kind"]) for r in nvls] == [
        ("dgx-b01", 0, "nvls"), ("dgx-b01", 1, "nvls"), ("dgx-b02", 2, "nvls"), ("dgx-b02", 3, "nvls")]
    collnet = rows(t, transport="CollNet")
    assert len(collnet) == 8 and {r["via_detail"] for r in collnet} == {"COLLNET/SHARP/0/GDRDMA",
                                                                       "COLLNET/SHARP/1/GDRDMA"}
    # NET connections made for the NVLS tree are closed by `Connected NVLS tree`.
    assert Counter(r["kind"] for r in rows(t, transport="NET/IB/GDRDMA")) == {"nvls": 8, "ring": 4}
    assert t.meta.nccl_warnings == ["line 6: NET/IB : mlx5_3:1 Got async event : port error"]
    assert t.meta.algo_proto == {"NCCL_PROTO": "Simple"}
    assert t.meta.ranks[3]["host"] == "dgx-b02"


def test_legacy_nccl_2_4_ring_lines():
    t = parse_nccl_debug(FIXTURES / "c_debug_v2_4_legacy_ring.txt")
    assert t.meta.nccl_version == "2.4.8" and t.meta.rings[0]["order"] == [0, 1, 2, 3]
    assert [(r["peer_from"], r["peer_to"], r["rank"], r["transport"], r["kind"]) for r in t.rows()] == [
        (3, 0, 0, "NET/IB", "ring"), (0, 1, 0, "P2P/IPC", "ring"), (1, 2, 1, "NET/IB", "ring"),
        (1, 2, 2, "NET/IB", "ring"), (2, 3, 2, "P2P/IPC", "ring"), (3, 0, 3, "NET/IB", "ring")]
    assert rows(t, line=7)[0]["peer_host"] == "k80b"  # rank 3 lives on k80b (Init COMPLETE lines)


# --- pieces ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("via, expected", [
    ("P2P/IPC/read", "P2P/IPC"), ("P2P/IPC", "P2P/IPC"), ("P2P/CUMEM/read", "P2P/CUMEM"), ("P2P/CUMEM/CE", "P2P/CUMEM"),
    ("P2P/direct pointer/read", "P2P/direct pointer"), ("P2P/direct pointer", "P2P/direct pointer"),
    ("P2P/indirect/3[3]/read", "P2P/indirect"), ("P2P/MNNVL", "P2P/MNNVL"), ("SHM/direct/direct", "SHM"),
    ("SHM/CE/direct", "SHM"), ("direct shared memory", "SHM"), ("NET/IB/0/GDRDMA", "NET/IB/GDRDMA"),
    ("NET/IB/3", "NET/IB"), ("NET/IB/0(3)/GDRDMA/Shared", "NET/IB/GDRDMA"), ("NET/IB/1/GDRDMA(PCI)", "NET/IB/GDRDMA"),
    ("NET/IBext_v8/3/GDRDMA", "NET/IB/GDRDMA"), ("NET/Socket/3", "NET/Socket"),
    ("NET/AWS Libfabric/0/GDRDMA", "NET/AWS Libfabric/GDRDMA"), ("COLLNET/SHARP/0/GDRDMA", "CollNet"),
])
def test_normalise_transport(via, expected):
    assert normalise_transport(via) == expected


@pytest.mark.parametrize("raw, host, dev, message", [
    ("node1:12:34 [3] NCCL INFO Using network IB", "node1", 3, "Using network IB"),
    ("[1,2]<stdout>:node1:12:34 [0] NCCL INFO x", "node1", 0, "x"),
    ("[0] h100clust-worker-1:227602:227667 [0] NCCL INFO y", "h100clust-worker-1", 0, "y"),
    ("[2025-06-02 14:03:10] n:1:2 [1] NCCL INFO z", "n", 1, "z"),
    (" [0] NCCL INFO NCCL version 2.5.7+cuda10.0", None, 0, "NCCL version 2.5.7+cuda10.0"),
    ("n:1:2 [1] transport/net_ib.cc:512 NCCL WARN oops", "n", 1, "oops"),
])
def test_find_log_line_prefixes(raw, host, dev, message):
    log = find_log_line(raw)
    assert (log.host, log.cuda_dev, log.message) == (host, dev, message)


def test_finding_is_frozen():
    f = Finding("warn", "x", ("line 1",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.severity = "info"


def test_empty_and_cut_inputs_warn_instead_of_raising(tmp_path):
    t = parse_nccl_debug("just a shell prompt\n")
    assert len(t) == 0 and "no NCCL log lines" in t.warnings[0]
    assert [f.severity for f in verdict(t)] == ["info"]
    t = parse_nccl_debug(tmp_path / "missing.log")
    assert len(t) == 0 and t.warnings[0].endswith("missing.log: does not exist; not read")
    text = (FIXTURES / "c_debug_v2_20_shm_p2p_disabled.txt").read_text()
    cut = text[:text.index("via SHM/direct/direct") + len("via SHM/dir")]
    t = parse_nccl_debug(cut, source="cut.log")
    assert len(t) == 0 and t.warnings == ("cut.log:12: last line is cut short; ignored",)


def test_unreadable_connection_line_is_reported():
    t = parse_nccl_debug("h:1:2 [0] NCCL INFO Channel 00 : x -> y via P2P/IPC\n", source="odd.log")
    assert len(t) == 0 and t.warnings[0].startswith("odd.log:1: connection line not understood")


# --- properties -----------------------------------------------------------------------------------

TEXTS = {p.name: p.read_text() for p in DEBUG_FIXTURES}
FULL = {name: list(parse_nccl_debug(text, source=name).rows()) for name, text in TEXTS.items()}
# What a line says by itself survives truncation unchanged. The rest comes from later lines
# (the `Connected all ...` marker, Init COMPLETE), so a truncated log may not know it yet.
LATER = ("kind", "peer_host", "comm", "rank", "peer_from")


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(TEXTS)), fraction=st.floats(0.0, 1.0))
def test_truncation_yields_a_prefix_of_the_rows(name, fraction):
    text = TEXTS[name]
    got = list(parse_nccl_debug(text[:int(len(text) * fraction)], source=name).rows())
    want = FULL[name][:len(got)]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert {k: v for k, v in a.items() if k not in LATER} == {k: v for k, v in b.items() if k not in LATER}
        for k in LATER:
            # Before its Init COMPLETE line a communicator is known by its process-local pointer.
            assert a[k] in (None, b[k]) or (k == "comm" and a[k].startswith("0x")), k


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(sorted(TEXTS)), data=st.data())
def test_garbage_spliced_into_logs_never_raises(name, data):
    lines = TEXTS[name].split("\n")
    for _ in range(data.draw(st.integers(1, 5))):
        lines.insert(data.draw(st.integers(0, len(lines))), data.draw(st.text(max_size=120)))
    t = parse_nccl_debug("\n".join(lines), source=name)
    verdict(t)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab0123:[] ->NCCLINFOChanel/viaP2PSHMNETIB\n")), max_size=300))
def test_arbitrary_text_never_raises(text):
    verdict(parse_nccl_debug(text))
