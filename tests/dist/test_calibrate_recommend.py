"""`python -m launch calibrate` then `python -m launch recommend ... verify=true` as a user runs them, on 2 gloo ranks."""
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO
from tests.dist.conftest import TINY

# -m full (CI): calibrate's in-situ timing on three backends, then recommend verify: a feature, its layouts the parity tests'.
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.full]

SMALL = ("batch.global_batch_size=4", "batch.micro_batch_size=2")
ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+\w+\s+\w+\s+-?\d+\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+\d+\s+([\d.]+)\s")


def _run(args, runs, timeout):
    env = {**os.environ, "LAYOUTLAB_RUNS": str(runs), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "launch", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_calibrate_then_recommend_verify(tmp_path):
    runs, cal = tmp_path / "runs", tmp_path / "cal.json"
    p = _run(["calibrate", TINY, *SMALL, f"out={cal}", "iters=3"], runs, 600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(cal.read_text())
    assert doc["kind"] == "layoutlab-calibration" and doc["world_size"] == 2
    fits = {(c["op"], c["group_size"]): c for c in doc["collectives"]}
    assert set(fits) == {(op, 2) for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "broadcast")}
    # The fit against numpy's weighted least squares (weights 1/t: relative error) over both sweeps' own text
    # output (before and after the compute figures), read back with this test's regex.
    txts = sorted((runs / "calibration").glob("*/commbench_2_*/*/commbench/all_reduce.txt"))
    assert [t.parent.parent.parent.name for t in txts] == ["commbench_2_first", "commbench_2_last"]
    lines = [line for t in txts for line in t.read_text().splitlines()]
    pts = [(float(m[1]), float(m[3]) * 1e-6) for m in map(ROW.match, lines) if m]
    pts += [(float(m[1]), float(m[4]) * 1e-6) for m in map(ROW.match, lines) if m]
    # the fit's rule: a call timed at 0 µs (interleaved compute subtracted on a loaded machine) is no measurement
    pts = [(x, y) for x, y in pts if y > 0]
    s, t = np.array([x for x, _ in pts]), np.array([y for _, y in pts])
    slope, alpha = np.polyfit(s, t, 1, w=1 / t)
    if alpha < 0:  # the fit's rule: a negative latency is refitted through the origin
        alpha, slope = 0.0, float(np.sum(s * t / t**2) / np.sum(s * s / t**2))
    ar = fits[("all_reduce", 2)]
    assert ar["alpha_s"] == pytest.approx(alpha, rel=1e-3, abs=1e-9)  # the text rounds times to 0.01 µs
    if slope > 0:
        assert ar["beta_Bps"] == pytest.approx(1 / slope, rel=1e-3)
    else:
        assert math.isinf(ar["beta_Bps"])
    passes = {(x["backend"], x["tp"], x["sp"], x["micro_batch_size"], x["activation_checkpointing"])
              for x in doc["compute"]["passes"]}
    # Every backend at every TP degree of 2 ranks, micro-batch sizes dividing the global batch of 4, each backend's
    # checkpointing modes (Megatron's and torch's selective too) and their sequence parallelism at tp=2.
    want = {("deepspeed", tp, False, b, ac) for tp in (1, 2) for b in (1, 2, 4) for ac in ("none", "full")}
    want |= {(backend, tp, sp, b, ac) for backend in ("megatron", "torch")
             for tp, sp in ((1, False), (2, False), (2, True)) for b in (1, 2, 4) for ac in ("none", "full", "selective")}
    assert passes == want
    assert all(x["forward_s"] > 0 and x["backward_s"] > 0 for x in doc["compute"]["passes"])
    # Where the forward went: some of it before the first decoder layer, some inside the layers, some after, in every
    # pass; most inside the layers over the passes (one pass's order is a timing a loaded machine can upset: CI saw it).
    assert all(0 < x["embedding_forward_s"] and 0 < x["layers_forward_s"]
               and x["embedding_forward_s"] + x["layers_forward_s"] < x["forward_s"] for x in doc["compute"]["passes"])
    shares = [(x["embedding_forward_s"] / x["forward_s"], x["layers_forward_s"] / x["forward_s"])
              for x in doc["compute"]["passes"]]
    assert sum(e < layers for e, layers in shares) > 0.8 * len(shares), shares
    assert [(e["backend"], e["zero_stage"]) for e in doc["compute"]["engine"]] == [
        (b, z) for b in ("deepspeed", "megatron") for z in (0, 1, 2, 3)] + [("torch", z) for z in (0, 2, 3)]
    # The duration it announced counted the launches it then made (each announced by its own line).
    (every, passes), = [(int(a), int(b)) for a, b in re.findall(r"\((\d+) launches of ranks, (\d+) of them timing",
                                                               p.stdout)]
    made = re.findall(r"^calibrate: (collectives on|Adam and making|\w+ at tp=)", p.stdout, re.M)
    assert (every, passes) == (len(made), sum(m.endswith("at tp=") for m in made)), made
    # What calibrate prints is what it wrote (it once printed the zeros the engine costs were fitted from).
    printed = re.findall(r"(\w+) engine ZeRO-(\d): \+([\d.]+) ms per micro-step, \+([\d.]+) ms per step, "
                         r"\+([\d.]+) ms per micro-step under full", p.stdout)
    for (backend, zero, *shown), e in zip(printed, doc["compute"]["engine"], strict=True):
        assert (backend, int(zero)) == (e["backend"], e["zero_stage"])
        for text, part in zip(shown, ("micro_step_s", "step_s", "recompute_s"), strict=True):
            assert float(text) == pytest.approx(e[part] * 1e3, abs=0.0051)
    assert any(e["step_s"] > 0 for e in doc["compute"]["engine"])
    # The engine costs are what real steps spent beyond the rest: the planner, given the file, predicts the measured
    # train_step of each sample (taken from the probe's own output) exactly where no part was clamped at zero.
    (sample_doc,) = (runs / "calibration").glob("*/in_situ_deepspeed_tp1/*/passes.json")
    steps = {(x["zero_stage"], x["grad_accum"], x["activation_checkpointing"]): x["step_s"]
             for x in json.loads(sample_doc.read_text())["steps"]}
    assert set(steps) == {(z, ga, ac) for z in (0, 1, 2, 3) for ga, ac in ((1, "none"), (2, "none"), (1, "full"))}
    assert all(v > 0 for v in steps.values())
    from launch.config.resolve import resolve_path
    from launch.plan.build import plan_resolved
    from launch.run import envinfo

    clamped = " ".join(n for n in doc["notes"] if "taken as 0" in n)
    for (z, ga, ac), measured in steps.items():
        if f"deepspeed ZeRO-{z} engine" in clamped:
            continue
        r = resolve_path(TINY, [*SMALL, "backend=deepspeed", "parallel.tp=1", "batch.micro_batch_size=1",
                                f"batch.global_batch_size={2 * ga}", f"parallel.zero_stage={z}",
                                f"train.activation_checkpointing={ac}", f"hardware.profile={cal}"])
        assert plan_resolved(r, envinfo.machine()).step.total_s == pytest.approx(measured, rel=1e-6), (z, ga, ac)

    # The compute model's figures: fitted to GEMMs every rank timed at once, each point the ranks' mean (their own
    # files, read here); a layout the passes miss (seq_len 32) is timed on them, and its per-micro-batch work is of
    # the order of the measured pass of the same layout at seq_len 64 (a work-only model: below it, as it counts half
    # the tokens and no per-op overhead, which is most of a tiny model's pass; above a tenth of it).
    fitted = doc["compute"]["fitted"]
    assert fitted["dtype"] == "fp32" and all(fitted[k] > 0 for k in ("gemm_tflops", "gemm_half_dim", "memory_GBps"))
    ranks = [json.loads(f.read_text())["fitted"] for f in sorted((runs / "calibration").glob("*/compute_*.json"))]
    assert len(ranks) == 2
    for i, point in enumerate(fitted["gemm_points"]):
        assert point["seconds"] == pytest.approx(statistics.fmean(r["gemms"][i]["seconds"] for r in ranks), rel=1e-9)
        assert all((r["gemms"][i]["m"], r["gemms"][i]["n"], r["gemms"][i]["k"]) == (point["m"], point["n"], point["k"])
                   for r in ranks)
    miss = resolve_path(TINY, [*SMALL, "backend=torch", "parallel.zero_stage=0", "batch.seq_len=32",
                               f"hardware.profile={cal}"])
    plan = plan_resolved(miss, envinfo.machine())
    assert plan.step.timing == "fitted"
    from launch.plan.compute import compute
    from launch.plan.layout import Layout

    (per_micro_batch,) = compute(Layout.from_resolved(miss)).per_micro_batch_s
    (measured_pass,) = [x["forward_s"] + x["backward_s"] for x in doc["compute"]["passes"]
                        if (x["backend"], x["tp"], x["micro_batch_size"], x["activation_checkpointing"]) == ("torch", 1, 2, "none")]
    assert measured_pass / 10 < per_micro_batch < measured_pass, (per_micro_batch, measured_pass)

    held = [*SMALL, f"hardware.profile={cal}", "train.warmup_steps=2"]
    p = _run(["recommend", TINY, *held, "verify=true", "top=2", "steps=8"], runs, 600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "verified: re-ranked by measured" in p.stdout and "measured fastest:" in p.stdout
    (fed,) = tmp_path.glob("cal.verified-*.json")
    verified = json.loads(fed.read_text())
    assert len(verified["verified"]) == 2
    ratios = []
    for v in verified["verified"]:
        run = v["run_dir"]
        plan = json.loads(open(os.path.join(run, "plan.json")).read())
        assert plan["step"]["timing"] == "calibrated"
        # a step takes as long as its slowest rank (as the report counts it), warm-up left out
        slowest: dict[int, float] = {}
        for f in sorted(Path(run, "metrics").glob("rank*.jsonl")):
            for r in [json.loads(line) for line in f.read_text().splitlines()][1:]:
                if not r["warmup"]:
                    slowest[r["step"]] = max(slowest.get(r["step"], 0.0), r["step_time_s"])
        measured = statistics.median(slowest.values())
        assert v["measured_s"] == pytest.approx(measured, rel=1e-12)
        ratios.append(measured / plan["step"]["total_s"])
    assert verified["correction"] == pytest.approx(math.exp(statistics.fmean(map(math.log, ratios))), rel=1e-9)
    # The fed-back file is a calibration the planner applies: the same layout is predicted × the ratio.
    p = _run(["run", TINY, *SMALL, f"hardware.profile={fed}", "--dry-run"], runs, 60)
    assert p.returncode == 0 and "verified run(s)" in p.stdout
    assert cal.is_file() and json.loads(cal.read_text()) == doc  # the original is untouched
