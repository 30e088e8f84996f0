"""analysis.parsers.recognize: every kind of file is told by its content, on renamed copies of the real fixtures;
analysis.parsers.metrics reads our own JSONL (all ranks) into one table."""
from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from analysis.parsers import metrics as metrics_parser
from analysis.parsers.recognize import classify, group_runs, recognize
from analysis.report import build_report
from tests.unit.report_support import (
    ALCF,
    ALLREDUCE_8XH100,
    BIGSCIENCE,
    GLOO,
    HTA,
    LOGS,
    NCCL,
    NSYS,
    build_nsys_exports,
    make_run_dir,
)


@pytest.fixture(scope="module")
def nsys_exports(tmp_path_factory):
    return build_nsys_exports(tmp_path_factory.mktemp("nsys"))


def _tensorboard_file(folder: Path) -> Path:
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    w = EventFileWriter(str(folder))
    for step in range(1, 4):
        w.add_event(event_pb2.Event(wall_time=1.7e9 + step, step=step, summary=summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag="iteration-time", simple_value=0.5)])))
    w.close()
    return next(folder.iterdir())


CASES = [
    (BIGSCIENCE, {"megatron_log"}),
    (ALCF, {"deepspeed_log", "megatron_log"}),
    (LOGS / "c_ds_v0_9_forward_names_gas2_pdsh.txt", {"deepspeed_log"}),
    (LOGS / "c_megatron_lm_2025_minmax_moe.txt", {"megatron_log"}),
    (ALLREDUCE_8XH100, {"nccl_tests"}),
    (NCCL / "c_allreduce_2017_ms.txt", {"nccl_tests"}),
    (NCCL / "c_reduce_v2_13_mpirun_tagged.txt", {"nccl_tests", "nccl_debug"}),
    (NCCL / "real_reducescatter_2node_4gpu_issue128_EXCERPT.txt", {"nccl_tests"}),
    (NCCL / "c_debug_v2_18_socket_ib_disabled.txt", {"nccl_debug"}),
    (NCCL / "real_debug_transport_excerpts_from_issues.txt", {"nccl_debug"}),
    (GLOO[0], {"kineto_trace"}),
    (HTA[1], {"kineto_trace"}),
    (NSYS / "stats" / "profile_stats_column_2024.txt", {"nsys_stats_csv"}),
    (NSYS / "stats" / "legacy_2020.csv", {"nsys_stats_csv"}),
]


@pytest.mark.parametrize("src,kinds", CASES, ids=[c[0].name for c in CASES])
def test_renamed_fixture_is_recognised_by_content(tmp_path, src, kinds):
    dst = tmp_path / "blob_0001.dat"  # no telling name, no telling suffix
    shutil.copy(src, dst)
    assert set(classify(dst).kinds) == kinds


def test_documents_and_scripts_that_quote_log_lines_are_not_logs():
    # The fixture folders' README and generator quote every format in table cells and string literals.
    for folder in (LOGS, NCCL):
        inv = recognize(folder)
        assert not {"README.md", "make_fixtures.py"} & {f.path.name for f in inv.files}, folder
        assert {"README.md"} <= {s.path.name for s in inv.skipped}


_LINES = {"deepspeed_log": "step=10, skipped=0, lr=[0.0001], mom=[(0.9, 0.95)]",
          "megatron_log": " iteration       10/    1000 | consumed samples:   40 | elapsed time per iteration (ms): 3171.3 |",
          "nccl_debug": "node7:2210:2226 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC",
          "nccl_tests": "#       size         count      type   redop    root     time   algbw   busbw #wrong"}


@pytest.mark.parametrize("prefix", ["", "    ", "[1,0]<stdout>:", "worker-0: ", "[default3]:",
                                    "[2024-04-04 09:09:53,313] [INFO] [logging.py:96:log_dist] [Rank 0] "])
@pytest.mark.parametrize("kind", sorted(_LINES))
def test_log_lines_count_at_a_line_start_behind_launcher_prefixes(tmp_path, prefix, kind):
    line = _LINES[kind]
    f = tmp_path / "x"
    f.write_text(f"{prefix}{line}\n" * 2)
    assert kind in classify(f).kinds
    f.write_text(f"{prefix}{line}\n")  # one line is a quotation as likely as a log
    assert kind not in classify(f).kinds
    f.write_text(f"| `{prefix}{line}` | a table cell |\n" * 3 + f'    lines = ["{prefix}{line}"]\n' * 3)
    assert kind not in classify(f).kinds


def test_uncompressed_trace_nsys_export_tensorboard_and_our_files(tmp_path, nsys_exports):
    plain = tmp_path / "a"
    plain.write_bytes(gzip.decompress(GLOO[1].read_bytes()))
    assert classify(plain).kinds == ("kineto_trace",)
    db = tmp_path / "b"
    shutil.copy(nsys_exports["legacy"], db)
    assert classify(db).kinds == ("nsys_sqlite",)
    tbdir = tmp_path / "tb"
    tbdir.mkdir()
    ev = _tensorboard_file(tbdir)
    renamed = tmp_path / "c"
    shutil.copy(ev, renamed)
    assert classify(renamed).kinds == ("tensorboard",)
    run = make_run_dir(tmp_path / "runs", traces=False)
    for name, kind in (("resolved.json", "resolved"), ("plan.json", "plan"), ("metrics/rank1.jsonl", "metrics_jsonl")):
        copy = tmp_path / f"x_{kind}"
        shutil.copy(run / name, copy)
        assert classify(copy).kinds == (kind,)


def test_a_damaged_resolved_or_plan_keeps_the_run_directory_and_warns(tmp_path):
    run = make_run_dir(tmp_path / "runs", traces=False)
    for name, keep in (("resolved.json", 200), ("plan.json", 300)):
        f = run / name
        f.write_bytes(f.read_bytes()[:keep])  # cut short: no longer JSON
    assert classify(run / "resolved.json").kinds == ("resolved",)
    assert classify(run / "plan.json").kinds == ("plan",)
    assert recognize(tmp_path / "runs").run_dirs == (run,)
    (r,) = build_report([(None, run)]).runs
    assert r.run.run_dir and r.label == "tiny_zero2/20260101-000000"
    warned = "\n".join(r.run.warnings)
    assert "resolved.json: cannot be read as a resolved config" in warned
    assert "plan.json: cannot be read as a plan" in warned
    other = tmp_path / "other.json"
    other.write_text('{"recipe_name": "x", "seed": ')  # damaged, and not with our first keys
    assert classify(other).kinds == ()


def test_unknown_files_are_skipped_with_a_reason(tmp_path):
    (tmp_path / "notes.txt").write_text("nothing a tool wrote\n")
    (tmp_path / "weights.bin").write_bytes(b"\x00\x01\x02" * 100)
    (tmp_path / "empty.log").write_text("")
    (tmp_path / "other.json").write_text(json.dumps({"a": 1}))
    inv = recognize(tmp_path)
    assert not inv.files
    reasons = {s.path.name: s.reason for s in inv.skipped}
    assert "no supported tool" in reasons["notes.txt"] or "supported tool" in reasons["notes.txt"]
    assert reasons["weights.bin"].startswith("binary")
    assert reasons["empty.log"] == "empty file"
    assert "other.json" in reasons


def test_run_directory_is_found_by_its_resolved_config_and_checkpoints_are_skipped(tmp_path):
    run = make_run_dir(tmp_path / "runs")
    shutil.copy(BIGSCIENCE, tmp_path / "runs" / "stray.log")  # a foreign file beside the run
    inv = recognize(tmp_path / "runs")
    assert inv.run_dirs == (run,)
    runs = group_runs(inv)
    ours = next(r for r in runs if r.run_dir)
    assert ours.label == "tiny_zero2/20260101-000000"
    assert {p.name for p in ours.of("kineto_trace")} == {"rank0.json.gz", "rank1.json.gz"}
    assert len(ours.of("metrics_jsonl")) == 2
    assert any(s.path.name == "checkpoints" and "model state" in s.reason for s in ours.skipped)
    assert not any("mp_rank_00" in str(f.path) for f in inv.files + inv.skipped)
    foreign = next(r for r in runs if not r.run_dir)
    assert foreign.label == "runs" and [p.name for p in foreign.of("megatron_log")] == ["stray.log"]


def test_labels_given_and_several_runs_under_one_path(tmp_path):
    make_run_dir(tmp_path / "runs", "a")
    make_run_dir(tmp_path / "runs", "b", traces=False)
    runs = group_runs(recognize(tmp_path / "runs"), "z2")
    assert [r.label for r in runs] == ["z2/tiny_zero2/a", "z2/tiny_zero2/b"]
    one = group_runs(recognize(tmp_path / "runs" / "tiny_zero2" / "a"), "mine")
    assert [r.label for r in one] == ["mine"]


# ------------------------------------------------------------------------------- metrics parser

def test_metrics_table_stacks_all_ranks_with_file_and_line(tmp_path):
    run = make_run_dir(tmp_path, traces=False, steps=8)
    t = metrics_parser.parse_metrics(run, relative_to=run)
    assert set(t.columns) == set(metrics_parser.COLUMNS)
    assert len(t) == 16 and sorted(set(t.column("rank"))) == [0, 1]
    first = next(t.rows())
    assert (first["rank"], first["step"], first["file"], first["line"]) == (0, 1, "metrics/rank0.jsonl", 2)
    raw = json.loads((run / "metrics" / "rank0.jsonl").read_text().splitlines()[1])
    assert first["step_time_s"] == raw["step_time_s"] and first["warmup"] is True
    m = t.meta
    assert m.world_size == 2 and m.warmup_steps == 5 and m.global_batch_size == 8
    assert "torchtitan" in m.flops_formula and set(m.ranks) == {0, 1}
    assert not t.warnings


def test_metrics_cut_last_line_gives_partial_table_and_a_warning(tmp_path):
    run = make_run_dir(tmp_path, traces=False, steps=6, cut_last_line=True)
    t = metrics_parser.parse_metrics(run, relative_to=run)
    assert len(t) == 10  # the sixth step of each rank is cut
    assert any(w.startswith("metrics/rank0.jsonl:7: not JSON") for w in t.warnings)


def test_metrics_sniff_rejects_other_jsonl(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text('{"text": "a corpus line"}\n')
    assert metrics_parser.sniff(f) is None
    assert metrics_parser.sniff(NCCL / "c_allreduce_2017_ms.txt") is None


# ------------------------------------------------------------------ our own files, damaged inside

def _rank0(run: Path) -> Path:
    return run / "metrics" / "rank0.jsonl"


_DAMAGED_STARTS = {
    "garbage-line": lambda data: b"garbage\n" + data,
    "damaged-meta": lambda data: b'{"schema_version": 2, "rank": 0, "kind": "meta"\n' + data.split(b"\n", 1)[1],
}


@pytest.mark.parametrize("damage", sorted(_DAMAGED_STARTS))
def test_damage_at_the_start_of_our_metrics_is_reported_with_its_line(tmp_path, damage):
    """A garbage first line or a damaged meta record made rank 0's metrics 'text without lines from any supported
    tool': its steps vanished from the report without a warning."""
    run = make_run_dir(tmp_path / "runs", traces=False, steps=6)
    _rank0(run).write_bytes(_DAMAGED_STARTS[damage](_rank0(run).read_bytes()))
    (r,) = build_report([(None, run)]).runs
    assert r.run.run_dir and not r.run.skipped
    assert len(r.run.metrics) == 12 and set(r.run.metrics.column("rank")) == {0, 1}
    assert any(w.startswith("metrics/rank0.jsonl:1: ") for w in r.run.warnings), r.run.warnings
    loose = tmp_path / "loose.jsonl"  # outside a run directory: told by the records that follow the damage
    shutil.copy(_rank0(run), loose)
    assert classify(loose).kinds == ("metrics_jsonl",)


@pytest.mark.parametrize("encoding", ["utf-16", "latin-1"])
def test_our_metrics_in_another_encoding_is_said_to_be(tmp_path, encoding):
    """Re-saved as UTF-16 (an editor, PowerShell's `>`), rank 0's metrics were skipped as unrecognised text; a
    Latin-1 byte inside a record was read as U+FFFD without a word."""
    run = make_run_dir(tmp_path / "runs", traces=False, steps=6)
    text = _rank0(run).read_text(encoding="utf-8")
    _rank0(run).write_bytes(text.replace("tiny_zero2", "tiny_z\u00e9ro2", 1).encode(encoding))
    (r,) = build_report([(None, run)]).runs
    assert r.run.run_dir and not r.run.skipped
    if encoding == "utf-16":
        assert any(w.startswith("metrics/rank0.jsonl: UTF-16 text") for w in r.run.warnings), r.run.warnings
        assert set(r.run.metrics.column("rank")) == {1}
    else:
        assert any(w.startswith("metrics/rank0.jsonl:1: bytes that are not UTF-8") for w in r.run.warnings), \
            r.run.warnings
        assert len(r.run.metrics) == 12


@pytest.mark.parametrize("content", ["", "{}", "[]", "5", '{"a": ' + "[" * 3000],
                         ids=["empty", "empty-object", "list", "number", "deep"])
@pytest.mark.parametrize("name", ["resolved.json", "plan.json"])
def test_an_unreadable_resolved_or_plan_of_our_run_is_said_to_be_damaged(tmp_path, name, content):
    """An empty or non-object resolved.json / plan.json was listed as skipped, and the run with a damaged
    resolved.json became 'foreign files'."""
    run = make_run_dir(tmp_path / "runs", traces=False)
    (run / name).write_text(content)
    (r,) = build_report([(None, run)]).runs
    assert r.run.run_dir and r.label == "tiny_zero2/20260101-000000"
    assert not r.run.skipped, r.run.skipped
    warned = "\n".join(r.run.warnings)
    what = {"": "an empty file", "{}": "", "[]": "an array, not a JSON object", "5": "a number, not a JSON object",
            '{"a": ' + "[" * 3000: "nested deeper than JSON can be read here"}
    if name == "resolved.json":
        assert f"resolved.json: cannot be read as a resolved config ({what[content]}" in warned, warned
        assert "the layout comes from the metrics' meta record" in warned
        assert r.run.resolved is None and r.run.metrics is not None and len(r.run.metrics)
    else:
        assert f"plan.json: cannot be read as a plan ({what[content]}" in warned, warned
        assert "the plan is recomputed from resolved.json" in warned
        assert r.run.plan is not None and r.run.plan_source.startswith("recomputed from resolved.json")


def test_a_resolved_config_with_a_figure_of_the_wrong_type_is_unreadable(tmp_path):
    """hardware.memory_bytes as text was believed: without a plan.json the memory table raised TypeError (the check of
    the fields' kinds is launch.config.resolve's)."""
    run = make_run_dir(tmp_path / "runs", traces=False, plan=False)
    doc = json.loads((run / "resolved.json").read_text())
    doc["hardware"]["memory_bytes"] = "80 GB"
    (run / "resolved.json").write_text(json.dumps(doc))
    (r,) = build_report([(None, run)]).runs
    assert r.run.resolved is None and r.run.hardware is None
    assert any(w.startswith("resolved.json: cannot be read as a resolved config (") and "hardware.memory_bytes='80 GB'"
               in w and "the layout comes from the metrics' meta record" in w for w in r.run.warnings), r.run.warnings


def test_binary_garbage_where_our_metrics_belong_is_named_in_few_lines(tmp_path):
    """Read by its place, a blob of binary garbage at metrics/rank0.jsonl gives the first damaged lines by number and a
    count of the rest, not a warning per line."""
    run = make_run_dir(tmp_path / "runs", traces=False, steps=6)
    _rank0(run).write_bytes(bytes(range(256)).replace(b"\n", b"") * 64 + b"\n" + b"\x00\x01garbage\n" * 500)
    (r,) = build_report([(None, run)]).runs
    mine = [w for w in r.run.warnings if w.startswith("metrics/rank0.jsonl")]
    assert "metrics/rank0.jsonl: 491 more damaged line(s) skipped, not named one by one" in mine, mine
    assert len(mine) <= 13 and not r.run.skipped
    assert mine[0].startswith("metrics/rank0.jsonl:1: bytes that are not UTF-8")


def test_a_meta_record_whose_schema_version_is_a_list_is_damage_on_its_line(tmp_path):
    """A meta record whose schema_version is a list raised TypeError out of launch.run.metrics' reader (unhashable
    in `current`), and with it the whole report; now that line is named as damage and every step is kept."""
    run = make_run_dir(tmp_path / "runs", traces=False, steps=6)
    lines = _rank0(run).read_text().splitlines()
    bad = json.loads(lines[0])
    bad["schema_version"] = [1, 2]
    _rank0(run).write_text("\n".join(lines[:3] + [json.dumps(bad)] + lines[3:]) + "\n")
    (r,) = build_report([(None, run)]).runs
    assert r.run.warnings == ["metrics/rank0.jsonl:4: meta.schema_version=[1, 2], expected 2"]
    assert r.run.metrics.where(rank=0).column("step") == [1, 2, 3, 4, 5, 6]
