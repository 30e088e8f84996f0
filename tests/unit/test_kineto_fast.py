"""The compiled path of the Kineto parser (_kscan: the C event scanner; libdeflate, through ctypes, for a gzip file
that is one member) gives the same tables as the pure path (msgspec and zlib), on the real traces and on arbitrary
events.

The pure path is what a machine without a C compiler or without the deflate wheel runs; `pure_path` below switches
the compiled parts off the way LAYOUTLAB_KINETO_PURE=1 does, and the subprocess tests make their imports fail.
Comparisons are by repr, so 1 vs 1.0 vs True differ.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import sysconfig
import zlib
from importlib.util import find_spec
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analysis.analyzers import trace_analysis as ta
from analysis.parsers import kineto, kineto_source
from analysis.parsers.kineto import parse_kineto
from tests.unit.test_kineto import _SMALL, _event

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "kineto"
TRACES = sorted(FIX.glob("*.json.gz"))

needs_fast = pytest.mark.skipif(kineto._kscan is None, reason="C fast path not built (no compiler at install time)")


@contextlib.contextmanager
def pure_path():
    saved = kineto._kscan, kineto_source._libdeflate
    kineto._kscan = kineto_source._libdeflate = None
    try:
        yield
    finally:
        kineto._kscan, kineto_source._libdeflate = saved


def _pure(path, **kw):
    with pure_path():
        return parse_kineto(path, **kw)


ANALYSES = (ta.temporal_breakdown, ta.comm_comp_overlap, ta.exposed_communication, ta.kernel_breakdown,
            ta.kernel_type_breakdown, ta.collective_summary, ta.stragglers)


def _analyses(table) -> list:
    out = [[{k: repr(v) for k, v in r.items()} for r in f(table).rows()] for f in ANALYSES]
    out.append([{k: repr(v) for k, v in r.items()} for r in ta.temporal_breakdown(table, hta_rounding=False).rows()])
    return out


def _same(a, b):
    assert list(a.columns) == list(b.columns)
    for c in a.columns:
        assert [repr(v) for v in a.columns[c]] == [repr(v) for v in b.columns[c]], c
    assert a.warnings == b.warnings
    assert a.meta == b.meta


def test_fast_path_is_built_where_a_compiler_is():
    """setup.py builds the extensions as optional: a failed build would pass silently and leave
    every report several times slower. Where this Python could compile them, they must be there."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None or not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        pytest.skip(f"no C compiler ({cc}) or Python headers here: the pure path is the only one")
    assert find_spec("analysis.parsers._kscan"), "analysis/parsers/_kscan.c was not built: run `pip install -e .`"


def test_libdeflate_loads_from_the_pinned_wheel():
    """deflate==0.9.0 is a dependency: where it is installed its library must load, or every gzipped trace would
    stream through zlib, the same bytes three times slower, and no other test would tell."""
    if kineto_source.PURE:
        pytest.skip("LAYOUTLAB_KINETO_PURE=1 switches libdeflate off")
    assert find_spec("deflate"), "the deflate wheel is a dependency: run `pip install -e .`"
    assert kineto_source._libdeflate is not None, "deflate/_deflate's libdeflate symbols could not be loaded"


@needs_fast
@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name)
@pytest.mark.parametrize("cats", [None, ta.GPU_ANALYSIS_CATEGORIES], ids=["all", "gpu"])
def test_real_traces_read_the_same(path, cats):
    fast = parse_kineto(path, categories=cats)
    assert len(fast) > 0
    pure = _pure(path, categories=cats)
    _same(fast, pure)
    # the analyses' interval helpers (hta_merge, sweep) have C versions too
    with pure_path():
        expected = _analyses(pure)
    assert _analyses(fast) == expected


@needs_fast
@settings(max_examples=200, deadline=None)
@given(groups=st.lists(st.lists(st.tuples(st.integers(0, 60) | st.floats(0, 60, allow_nan=False),
                                          st.integers(0, 60) | st.floats(0, 60, allow_nan=False)), max_size=12),
                       max_size=4))
def test_interval_helpers_match_the_python(groups):
    """hta_merge and sweep in C against the Python, ties and int/float mixes included."""
    blocks = [ta._hta_merge(list(g)) for g in groups]
    with pure_path():
        assert [repr(b) for b in blocks] == [repr(ta._hta_merge(list(g))) for g in groups]
        expected = dict(ta._sweep(blocks))
    assert repr(ta._sweep(blocks)) == repr(expected) and list(ta._sweep(blocks)) == list(expected)


@needs_fast
@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("cut", [150, 250000, 1200000])
def test_cut_short_traces_read_the_same(tmp_path, cut, gz):
    text = gzip.decompress((FIX / "hta_trace_diff_test.json.gz").read_bytes())[:3000000]
    data = gzip.compress(text)[:cut // 4] if gz else text[:cut]
    p = tmp_path / ("cut.json.gz" if gz else "cut.json")
    p.write_bytes(data)
    _same(parse_kineto(p), _pure(p))


@needs_fast
def test_garbage_and_odd_events_read_the_same(tmp_path):
    """Events the scanner leaves to msgspec (string stream, null name, escaped keys, big integers,
    duplicate keys) and bytes that are not JSON, between ordinary events."""
    text = gzip.decompress((FIX / "hta_trace_filter__sampled_rank-0.json.gz").read_bytes())
    # Timestamps among the trace's own (an event far from them is dropped as senseless, as "big" is).
    t0 = int(min(parse_kineto(FIX / "hta_trace_filter__sampled_rank-0.json.gz").column("ts_us")))
    odd = [b'{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": %d, "dur": 1, ' % (t0 + 5)
           + b'"args": {"stream": "7", "correlation": 1}}',
           b'{"ph": "X", "cat": "cpu_op", "name": null, "pid": 0, "tid": 1, "ts": %d, "dur": 1}' % (t0 + 6),
           b'{"ph": "X", "c\\u0061t": "kernel", "name": "k2", "pid": 0, "tid": 7, "ts": %d, "dur": 1}' % (t0 + 7),
           b'{"ph": "X", "cat": "cpu_op", "name": "big", "pid": 0, "tid": 1, "ts": 123456789012345678901, "dur": 1}',
           b'{"ph": "X", "cat": "cpu_op", "name": "dup", "name": "dup2", "pid": 0, "tid": 1, "ts": %d, "dur": 1}'
           % (t0 + 8),
           b'{"ph": "\\u0058", "cat": "cpu_op", "name": "esc\\"aped \\u00e9", "pid": "p", "tid": 1.0, "ts": %d, '
           b'"dur": 1}' % (t0 + 9),
           b'{"ph": "X", "cat": "cpu_op", "name": "n\\u00e9", "pid": 0, "tid": 1, "ts": %d.5, "dur": 2.5}' % t0]
    at = range(200000, 900000, 100000)
    pieces, last = [], 0
    for k, pos in enumerate(at):
        cut = text.index(b', {"ph"', pos) + 1
        pieces += [text[last:cut], b" " + odd[k % len(odd)] + b","]
        last = cut
    pieces.append(text[last:])
    data = b"".join(pieces)
    garbled = data[:900000] + b"\x00\xff]]} {{ ,, NaN garbage" + data[900000:]
    for name, body in (("odd.json", data), ("garbled.json", garbled)):
        p = tmp_path / name
        p.write_bytes(body)
        fast = parse_kineto(p)
        _same(fast, _pure(p))
    assert {"k", "dup2", "esc\"aped é", "né"} <= set(fast.column("name"))
    # ts 1.2e20 us is no timestamp: dropped, and counted in a warning
    assert "big" not in set(fast.column("name"))
    assert any("event(s) dropped whose time makes no physical sense" in w for w in fast.warnings)


@needs_fast
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=st.lists(_event, max_size=40), gz=st.booleans(), indent=st.sampled_from([None, 1]))
def test_arbitrary_events_read_the_same(tmp_path, events, gz, indent):
    doc = json.dumps({"distributedInfo": {"rank": 1}, "traceEvents": events}, indent=indent).encode()
    p = tmp_path / ("e.json.gz" if gz else "e.json")
    p.write_bytes(gzip.compress(doc) if gz else doc)
    _same(parse_kineto(p), _pure(p))


@needs_fast
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, len(_SMALL)), junk=st.binary(max_size=40), at=st.integers(0, len(_SMALL)))
def test_any_truncation_or_garbage_reads_the_same(tmp_path, cut, junk, at):
    p = tmp_path / "x.json"
    p.write_bytes((_SMALL[:at] + junk + _SMALL[at:])[:cut + len(junk)])
    _same(parse_kineto(p), _pure(p))


# --- gzip: libdeflate's one call, zlib's stream ----------------------------------------------------------

def test_damage_inside_the_stream_keeps_what_precedes_it(tmp_path):
    """Bytes overwritten in the middle of the deflate data: libdeflate refuses the member; zlib's stream gives all that
    the bytes before the damage hold (what a file cut there gives), then what the damaged bytes decode to until zlib
    sees the damage, and one warning in zlib's words whose offset lies before the damage; both paths keep the same
    events."""
    real = (FIX / "hta_trace_diff_test.json.gz").read_bytes()
    doc = gzip.decompress(real)
    at = len(real) // 2
    bad = bytearray(real)
    bad[at:at + 64] = b"\xff" * 64
    p = tmp_path / "damaged.json.gz"
    p.write_bytes(bytes(bad))
    warnings: list[str] = []
    data = b"".join(kineto_source.Source(p, "damaged", warnings.append).chunks())
    intact = zlib.decompressobj(31).decompress(real[:at])
    assert doc.startswith(intact) and data.startswith(intact) and len(intact) <= len(data) < len(doc)
    (w,) = warnings
    m = re.fullmatch(r"damaged: gzip data corrupt after compressed byte (\d+) \(Error -3 while decompressing data: "
                     r".+\); the events before the damage are kept, which lies within the last ([\d,]+) compressed "
                     r"bytes", w)
    assert m, w
    fed = int(m.group(1))
    assert at - (1 << 16) < fed <= at and int(m.group(2).replace(",", "")) == len(real) - fed
    fast = parse_kineto(p)
    _same(fast, _pure(p))
    assert 0 < len(fast) < len(parse_kineto(FIX / "hta_trace_diff_test.json.gz"))


def test_a_gzip_that_fails_its_check_keeps_every_event_on_both_paths(tmp_path):
    """A flipped byte in the CRC trailer: libdeflate refuses the member, and zlib's stream, which inflated every block
    before the check failed, keeps every event, with a warning."""
    whole = (FIX / "hta_trace_diff_test.json.gz").read_bytes()
    bad = bytearray(whole)
    bad[-6] ^= 0xFF
    p = tmp_path / "damaged.json.gz"
    p.write_bytes(bytes(bad))
    fast, pure = parse_kineto(p), _pure(p)
    _same(fast, pure)
    assert len(fast) == len(parse_kineto(FIX / "hta_trace_diff_test.json.gz"))
    assert any("gzip data corrupt" in w and "compressed bytes" in w for w in fast.warnings), fast.warnings


def _source_bytes(path: Path) -> bytes:
    return b"".join(kineto_source.Source(path, str(path), lambda w: None).chunks())


@pytest.mark.skipif(kineto_source._libdeflate is None, reason="LAYOUTLAB_KINETO_PURE=1: no compiled path")
def test_one_member_is_inflated_in_one_call_and_anything_else_streams(tmp_path, monkeypatch):
    """libdeflate takes a file only when it is one whole gzip member (its trailer the file's last eight bytes) of at
    most WHOLE_GUNZIP_BYTES; members, padding, a cut, a damaged trailer and a larger member go to zlib's stream, which
    reads them as before: the bytes equal Python's gzip module's (or zlib's up to a cut), and the whole-member path
    gives the profiler's own file the same bytes as zlib."""
    taken = []
    whole_of = kineto_source._gunzip_whole
    monkeypatch.setattr(kineto_source, "_gunzip_whole", lambda fh: taken.append(whole_of(fh)) or taken[-1])
    real = (FIX / "hta_trace_diff_test.json.gz").read_bytes()
    doc = gzip.decompress(real)
    cases = {  # name: (file bytes, what it holds, whether the one call takes it)
        "profiler": (real, doc, True),
        "members": (gzip.compress(doc[:1000]) + gzip.compress(doc[1000:]), doc, False),
        "padded": (real + b"\0" * 700, doc, False),
        "short padding": (real + b"\0" * 4, doc, False),
        "same member twice": (gzip.compress(b"{}") * 2, b"{}{}", False),
        # the member's trailer again at the end: the file's last eight bytes agree with the member, the file does not
        "bytes after the member": (real + b"junk" + real[-8:], doc, False),
    }
    for name, (data, held, one_call) in cases.items():
        taken.clear()
        p = tmp_path / "t.json.gz"
        p.write_bytes(data)
        assert _source_bytes(p) == held, name
        assert (taken[0] is not None) == one_call, name
    cut = real[:len(real) // 2]
    p.write_bytes(cut)
    taken.clear()
    inflater = zlib.decompressobj(31)
    assert _source_bytes(p) == inflater.decompress(cut) and taken == [None]
    bad = bytearray(real)
    bad[-6] ^= 0xFF  # the CRC: libdeflate refuses, zlib's stream keeps every event (test above)
    p.write_bytes(bytes(bad))
    taken.clear()
    assert _source_bytes(p) == doc and taken == [None]
    monkeypatch.setattr(kineto_source, "WHOLE_GUNZIP_BYTES", len(doc) - 1)
    p.write_bytes(real)
    taken.clear()
    assert _source_bytes(p) == doc and taken == [None]


def test_pure_switch_turns_the_fast_path_off():
    code = ("from analysis.parsers import kineto, kineto_source; "
            "print(kineto._kscan is None, kineto_source._libdeflate is None)")
    env = dict(os.environ, LAYOUTLAB_KINETO_PURE="1", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


# A process whose compiled parts cannot be had, as `how` says: `import` of the C scanner and of the deflate wheel
# fails (nothing built, the wheel missing), or a deflate package whose library lacks libdeflate's symbols, or is no
# library at all. It says which parts it got, then pickles each trace's table and analyses.
_CRIPPLED = """
import pickle, sys, types
how, library, out, traces = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
if how == "imports fail":
    sys.modules["analysis.parsers._kscan"] = None
    sys.modules["deflate"] = None
else:
    sys.modules["deflate"] = types.SimpleNamespace(_deflate=types.SimpleNamespace(__file__=library))
from analysis.parsers import kineto, kineto_source
from tests.unit.test_kineto_fast import _analyses
print(kineto._kscan is None, kineto_source._libdeflate is None)
tables = {p: kineto.parse_kineto(p) for p in traces}
with open(out, "wb") as fh:
    pickle.dump({p: (t.columns, t.warnings, t.meta, _analyses(t)) for p, t in tables.items()}, fh)
"""


@pytest.mark.parametrize("how", ["imports fail", "symbols missing", "not a library"])
def test_without_its_compiled_parts_the_parser_gives_the_same_tables(tmp_path, how):
    """The fallbacks as a machine without them runs them (the imports and the library lookup fail in a fresh
    process, not module attributes set afterwards): msgspec where the C scanner is missing, zlib's stream where
    libdeflate is; every fixture's table and analyses equal this process's, on its compiled path where built."""
    import msgspec._core

    library = {"imports fail": "", "symbols missing": msgspec._core.__file__, "not a library": str(TRACES[0])}[how]
    out = tmp_path / "tables.pickle"
    run = subprocess.run([sys.executable, "-c", _CRIPPLED, how, library, str(out), *map(str, TRACES)], cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == [str(how == "imports fail" or kineto._kscan is None), "True"]
    with open(out, "rb") as fh:
        crippled = pickle.load(fh)
    assert list(crippled) == list(map(str, TRACES))
    for path in TRACES:
        columns, warnings, meta, analyses = crippled[str(path)]
        table = parse_kineto(path)
        assert list(columns) == list(table.columns)
        for c in columns:
            assert [repr(v) for v in columns[c]] == [repr(v) for v in table.columns[c]], (path.name, c)
        assert warnings == table.warnings and meta == table.meta
        assert analyses == _analyses(table), path.name


def test_kineto_suite_passes_on_the_pure_path():
    """Every parser test of test_kineto.py again with the C path switched off (what a machine without
    a compiler runs)."""
    env = dict(os.environ, LAYOUTLAB_KINETO_PURE="1", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_kineto.py"],
                         env=env, cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]


# --- regressions from the review of the C code -------------------------------------------------------------

def _events_file(tmp_path: Path, events: list[bytes], name: str = "r.json") -> Path:
    p = tmp_path / name
    p.write_bytes(b'{"traceEvents": [' + b", ".join(events) + b"]}")
    return p


@needs_fast
def test_values_msgspec_refuses_leave_the_event_to_the_python_path(tmp_path):
    """Lone surrogates and numbers out of float range: the scanner must neither raise nor differ."""
    ok = b'{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1, "dur": 1, "args": {"stream": 7}}'
    odd = [b'{"ph": "X", "cat": "cpu_op", "name": "a\\ud800b", "pid": 0, "tid": 1, "ts": 2, "dur": 1}',
           b'{"ph": "X", "cat": "ker\\udc00", "name": "k", "pid": 0, "tid": 1, "ts": 3, "dur": 1}',
           b'{"ph": "X", "cat": "cpu_op", "name": "smile \\ud83d\\ude00", "pid": 0, "tid": 1, "ts": 4, "dur": 1}',
           b'{"ph": "X", "cat": "kernel", "name": "ncclKernel_AllReduce_RING_LL_Sum_float", "pid": 0, "tid": 7, '
           b'"ts": 5, "dur": 1, "args": {"stream": 7, "correlation": 9, "dtype": "\\udfff"}}',
           b'{"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": 1e400}}',
           b'{"ph": "M", "name": "a\\ud800", "pid": "x\\ty", "tid": 1, "args": {"name": "t"}}',
           b'{"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 0, "tid": 1, "ts": 6, "dur": 1, '
           b'"args": {"Collective name": "allreduce", "Group size": 1e999, "Process Group Ranks": [1, 2e400]}}']
    for k, bad in enumerate(odd):
        p = _events_file(tmp_path, [ok, bad, ok, ok], f"odd{k}.json")
        fast = parse_kineto(p)
        _same(fast, _pure(p))
        assert len(fast) >= 3


@needs_fast
def test_an_event_that_never_closes_is_given_up_as_in_the_pure_path(tmp_path, monkeypatch):
    """An unclosed array swallows every later event; past _MAX_PENDING_BYTES both paths resync."""
    monkeypatch.setattr(kineto, "_MAX_PENDING_BYTES", 1 << 20)
    ev = b'{"ph": "X", "cat": "cpu_op", "name": "op", "pid": 0, "tid": 1, "ts": 1, "dur": 1, "args": {"a": 1}}'
    bad = b'{"ph": "X", "cat": "cpu_op", "name": "bad", "pid": 0, "tid": 1, "ts": 1, "dur": 1, "args": {"z": ['
    p = tmp_path / "open.json"
    p.write_bytes(b'{"traceEvents": [' + ev + b", " + bad + b", ".join([ev] * 40000) + b"]}")
    fast = parse_kineto(p)
    _same(fast, _pure(p))
    assert len(fast) > 10000


@needs_fast
def test_phase_counts_keep_first_seen_order_past_the_cache():
    events = [{"ph": f"p{k % 40}", "name": "x"} for k in range(200)]
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "ph.json"
        p.write_text(json.dumps({"traceEvents": events}))
        fast, pure = parse_kineto(p), _pure(p)
    assert list(fast.meta.events_skipped.items()) == list(pure.meta.events_skipped.items())
    assert list(fast.meta.events_skipped)[:3] == ["ph=p0", "ph=p1", "ph=p2"]


@needs_fast
def test_sweep_with_overlapping_blocks_in_one_group_falls_back():
    groups = [[]] * 7 + [[(0, 10), (5, 15)]]
    with pure_path():
        expected = dict(ta._sweep(groups))
    assert expected == {128: 10.0, 256: 5.0} and ta._sweep(groups) == expected


@needs_fast
def test_scan_refuses_a_position_outside_the_buffer():
    ctx = kineto._Collector(None, None).scan_context()
    with pytest.raises(ValueError, match="pos outside"):
        kineto._kscan.scan(b"{}]", -3, ctx)
    with pytest.raises(ValueError, match="pos outside"):
        kineto._kscan.scan(b"{}]", 4, ctx)
    assert kineto._kscan.scan(b"{}]", 0, ctx)[:3] == (2, 1, 1)


# Columns that pick apart the C twins of the row selections and time bounds: ties between 1 and 1.0 (min and max
# keep the first), ints past 2**52 (their sums would round as doubles), NaN, bools, mixed types, one row.
BOUND_COLUMNS = [
    ([5, 1.0, 1, 7, 7.0], [2, 0, 0.0, 3, 3]),
    ([2**53 + 1, 3], [1, 2]),
    ([2**52, 2**52], [2**52, 2**52 - 1]),
    ([1.5, float("nan"), 0.5], [1.0, 1.0, 1.0]),
    ([True, 2], [0, 1]),
    ([10], [-4.25]),
    ([1e300, -1e300], [1e300, 1e300]),
]


@needs_fast
@pytest.mark.parametrize("ts,dur", BOUND_COLUMNS)
def test_time_bounds_in_c_are_the_pure_bounds(ts, dur):
    with pure_path():
        expected = kineto.time_bounds(ts, dur)
    got = kineto.time_bounds(ts, dur)
    assert repr(got) == repr(expected)
    assert repr(expected.first_start) == repr(min(ts)) and repr(expected.last_end) == repr(
        max(t + d for t, d in zip(ts, dur, strict=True)))


@needs_fast
def test_row_selections_in_c_are_the_pure_selections():
    nan = float("nan")
    col = [None, "communication", 3, None, 3.0, nan, "communication", True, 1, b"x", ("t",)]
    cases = [(kineto.rows_not, None), (kineto.rows_not, nan), (kineto.rows_equal, "communication"),
             (kineto.rows_equal, 3), (kineto.rows_equal, 1), (kineto.rows_equal, nan),
             (kineto.rows_in, {3: 0, None: 1}), (kineto.rows_in, {1, "communication"}), (kineto.rows_in, frozenset())]
    for f, value in cases:
        with pure_path():
            expected = f(col, value)
        assert f(col, value) == expected, (f.__name__, value)
    # by hand, for the cases a reader checks at a glance
    assert kineto.rows_not(col, None) == [1, 2, 4, 5, 6, 7, 8, 9, 10]
    assert kineto.rows_equal(col, 3) == [2, 4]
    assert kineto.rows_in(col, {1}) == [7, 8]  # True == 1
    with pytest.raises(TypeError):
        kineto.rows_in([[1]], {1: 0})  # an unhashable item, as dict.__contains__ says
    with pytest.raises(TypeError):
        kineto._kscan.rows_where(col, 2, [1])  # a list is not a dict or set


def test_an_int_start_too_large_for_a_float_is_dropped_not_raised(tmp_path):
    """A garbled trace's 401-digit ts with a float dur: int + float overflows, so the row is dropped with the other
    senseless ones (both paths), not an OverflowError out of a parser that never raises."""
    p = tmp_path / "huge.json"
    event = '{{"ph": "X", "cat": "cpu_op", "name": "{}", "pid": 1, "tid": 1, "ts": {}, "dur": {}}}'
    p.write_text('{"traceEvents": [' + event.format("a", 100, 1.5) + ", " + event.format("b", "1" + "0" * 400, 2.5)
                 + "]}")
    for t in (parse_kineto(p), _pure(p)):
        assert t.columns["name"] == ["a"] and t.meta.ts_last_us == 101.5
        assert any("1 event(s) dropped" in w for w in t.warnings), t.warnings


def test_damaged_complete_events_are_warned_about_not_only_counted(tmp_path):
    """A NaN duration (Python's json writes the literal), a missing ts, a string dur: each event is left out and
    counted, and the table's warnings say so, on both paths; the events around them stay."""
    p = tmp_path / "damaged.json"
    good = '{"ph": "X", "cat": "cpu_op", "name": "ok", "pid": 1, "tid": 1, "ts": 10, "dur": 1}'
    p.write_text('{"traceEvents": [' + ", ".join([
        good, '{"ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, "tid": 1, "ts": 11, "dur": NaN}',
        '{"ph": "X", "cat": "cpu_op", "name": "b", "pid": 1, "tid": 1, "dur": 2}',
        '{"ph": "X", "cat": "cpu_op", "name": "c", "pid": 1, "tid": 1, "ts": 12, "dur": "3"}', good]) + "]}")
    for t in (parse_kineto(p), _pure(p)):
        assert t.columns["name"] == ["ok", "ok"]
        (w,) = [w for w in t.warnings if "cannot be read as one" in w]
        assert w.startswith(f"{p}: 3 complete event(s) left out") and "1: ts or dur not finite" in w, w
    clean = parse_kineto(Path(__file__).resolve().parents[1] / "fixtures" / "kineto" / "hta_trace_diff_test.json.gz")
    assert not [w for w in clean.warnings if "cannot be read as one" in w]
