"""`bash launch/run.sh recipes/7b_tp2_zero3 --dry-run` as a user runs it."""
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO


def run(*args, env=None):
    t0 = time.perf_counter()
    p = subprocess.run(["bash", "launch/run.sh", *args], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env=env)
    return p, time.perf_counter() - t0


def test_dry_run_flagship(tmp_path):
    import os

    env = {**os.environ, "LAYOUTLAB_RUNS": str(tmp_path / "runs")}
    p, seconds = run("recipes/7b_tp2_zero3", "--dry-run", env=env)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "rank grid t×p×d = 2×1×2 = 4 ranks" in out
    assert "node 0: 0:(t0,d0,p0) 1:(t1,d0,p0) 2:(t0,d1,p0) 3:(t1,d1,p0)" in out
    assert "memory per rank" in out and "zero_paper" in out and "megatron" in out and "deepspeed *" in out
    assert "plan: fits" in out
    assert "-m torch.distributed.run --nnodes 1 --nproc-per-node 4" in out and "-m launch.ranks.train" in out
    assert seconds < 2.0, f"dry-run took {seconds:.2f}s"
    # the command it shows writes where the real run would: under $LAYOUTLAB_RUNS, not ./runs
    assert f"LAYOUTLAB_RUN_DIR='{tmp_path / 'runs'}/7b_tp2_zero3/<UTC yyyymmdd-hhmmss>'" in out
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


def test_empty_runs_variable_means_the_default_folder():
    import os

    p, _ = run("recipes/tiny_zero2", "--dry-run", env={**os.environ, "LAYOUTLAB_RUNS": ""})
    assert p.returncode == 0, p.stderr
    assert "LAYOUTLAB_RUN_DIR='runs/tiny_zero2/<UTC yyyymmdd-hhmmss>'" in p.stdout


def test_dry_run_never_imports_torch():
    code = ("import sys; from launch.commands.cli import main; rc = main(['run', 'recipes/7b_tp2_zero3', '--dry-run']); "
            "heavy = [m for m in ('torch', 'deepspeed', 'megatron', 'transformers') if m in sys.modules]; "
            "print('HEAVY', heavy); sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "HEAVY []" in p.stdout


def test_bad_override_one_line_exit_2():
    p, _ = run("recipes/7b_tp2_zero3", "parallel.tp=3", "--dry-run")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr
    assert lines[0].startswith("error: override parallel.tp=3: parallel.tp=3 × parallel.pp=1 = 3 does not divide the world size 4")


def test_unknown_flag_and_missing_recipe():
    p, _ = run("recipes/7b_tp2_zero3", "--tp=2")
    assert p.returncode == 2 and "--dry-run is the only one" in p.stderr
    p, _ = run("recipes/nope", "--dry-run")
    assert p.returncode == 2 and "has no recipe.toml" in p.stderr


def test_gpu_recipe_without_gpus_exits_2_without_a_run(tmp_path):
    import glob
    import os

    if glob.glob("/dev/nvidia[0-9]*"):
        pytest.skip("this machine has NVIDIA GPUs: the flagship would really train")
    env = {**os.environ, "LAYOUTLAB_RUNS": str(tmp_path / "runs")}
    p, _ = run("recipes/7b_tp2_zero3", env=env)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == ("error: recipes/7b_tp2_zero3/recipe.toml: hardware.profile=\"h100-sxm\" needs 4 GPU(s) per "
                                "node; this machine has 0; run it on the GPU machine (--dry-run shows the plan anywhere), "
                                "or train on CPU ranks with hardware.profile=cpu and a tiny model")
    assert not (tmp_path / "runs").exists()


def test_plan_command_writes_chart(tmp_path):
    out = tmp_path / "p"
    p = subprocess.run([sys.executable, "-m", "launch", "plan", "model=llama-2-7b", "world_size=4,8", "hardware=h100-sxm",
                        "activation_checkpointing=none", f"out={out}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    png = (tmp_path / "p.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "p.html").read_text()
    import re

    # self-contained: nothing loaded from anywhere (the policy would refuse it, launch/pages.py)
    assert not re.search(r"\b(src|href)=", page) and "http" not in page.lower().replace("http-equiv", "")
    import json

    rows = json.loads((tmp_path / "p.json").read_text())
    fits = {(r["world_size"], r["layout"]): r["plan"]["fits"] for r in rows}
    assert fits[(4, "DP")] is False and fits[(4, "ZeRO-3")] is True and fits[(8, "ZeRO-1")] is True
    p = subprocess.run([sys.executable, "-m", "launch", "plan", "world_size=x"], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 2 and "world_size" in p.stderr


@pytest.mark.full  # the one-model chart is test_plan_command_writes_chart's, in the default suite
def test_plan_of_several_models_charts_each_under_a_title_without_escapes(tmp_path):
    """A chart per model (a newcomer's finding: the PNG named after four models drew the first alone), and the
    table's two-line title printed as two lines, not with a literal backslash-n."""
    out = tmp_path / "p"
    p = subprocess.run([sys.executable, "-m", "launch", "plan", "model=llama-2-7b,tinyllama-1.1b", "world_size=4",
                        f"out={out}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    charts = [(tmp_path / f"p_{m}.png").read_bytes() for m in ("llama-2-7b", "tinyllama-1.1b")]
    assert all(c[:8] == b"\x89PNG\r\n\x1a\n" for c in charts) and charts[0] != charts[1]
    assert not (tmp_path / "p.png").exists()
    assert "\\n" not in p.stdout
    titles = [line for line in p.stdout.splitlines() if "memory per GPU by layout" in line]
    assert [t.split(" on ")[0].strip() for t in titles] == ["llama-2-7b", "tinyllama-1.1b"], p.stdout


def test_nsys_profile_wraps_the_launch_and_exports_sqlite():
    p, _ = run("recipes/7b_zero3_ac", "run.profile=nsys", "--dry-run")
    assert p.returncode == 0, p.stderr
    cmd = p.stdout.split("launch command")[1]
    assert "nsys profile" in cmd and "--export sqlite" in cmd and "traces/nsys_node%q{NODE_RANK}" in cmd
    assert cmd.index("nsys profile") < cmd.index("torch.distributed.run")
    # only the profiled steps: the ranks open and close the capture range
    assert "--capture-range cudaProfilerApi --capture-range-end stop" in cmd


@pytest.mark.parametrize("steps, warmup, active, start, want", [
    (10, 2, 1, 0, range(3, 4)),  # the dist tests' SHORT runs: step 4 (1-based) is traced
    (50, 10, 3, 0, range(11, 14)),  # after 10 warm-up steps and the profiler's own warm-up step
    # resumed at step 5: cold again; of the 5 steps left, 1 skipped (warm-up shortened so that all 3 fit), 1 for the
    # profiler's own warm-up, 3 traced
    (10, 2, 3, 5, range(7, 10)),
    (2, 1, 3, 0, range(1, 2)),  # too short for warm-up: one step still traced
])
def test_profiled_steps_by_hand(steps, warmup, active, start, want):
    from launch.config.resolve import resolve_path
    from launch.ranks.trainers.common import profiled_steps

    r = resolve_path(REPO / "recipes/tiny_zero2", [f"train.steps={steps}", f"train.warmup_steps={min(warmup, steps - 1)}",
                                                  f"run.profile_active_steps={active}"])
    assert profiled_steps(r, start) == want


def test_preflight_refuses_nsys_missing_and_multinode_deepspeed_without_hostfile(monkeypatch):
    import pytest

    from launch.config.resolve import resolve_path
    from launch.errors import ConfigError
    from launch.run.launcher import preflight

    r = resolve_path(REPO / "recipes/7b_zero3_ac", ["run.profile=nsys"])
    with pytest.raises(ConfigError, match="needs Nsight Systems"):
        preflight(r, which=lambda _: None, gpus=8)
    preflight(r, which=lambda _: "/usr/bin/nsys", gpus=8)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ConfigError, match="needs MASTER_ADDR"):
        preflight(resolve_path(REPO / "recipes/8b_tp8_sp_zero1"), gpus=8)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    preflight(resolve_path(REPO / "recipes/8b_tp8_sp_zero1"), gpus=8)
    monkeypatch.delenv("LAYOUTLAB_HOSTFILE", raising=False)
    r = resolve_path(REPO / "recipes/7b_zero3_ac", ["run.launcher=deepspeed", "hardware.nodes=2"])
    with pytest.raises(ConfigError, match="LAYOUTLAB_HOSTFILE"):
        preflight(r, gpus=8)
    with pytest.raises(ConfigError, match="needs 4 GPU"):
        preflight(resolve_path(REPO / "recipes/7b_zero3_ac"), gpus=2)


def test_plan_figure_is_sorted_marks_the_best_and_is_named_from_the_whole_model_name(tmp_path):
    env = {**os.environ, "LAYOUTLAB_RUNS": str(tmp_path / "runs")}
    p = subprocess.run([sys.executable, "-m", "launch", "plan", "model=llama-3.1-8b", "world_size=4"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    stem = tmp_path / "runs" / "plans" / "llama-3.1-8b_h100-sxm"  # not plans/llama-3.png, and not in the cwd
    assert not (tmp_path / "plans").exists()
    png = (stem.parent / (stem.name + ".png")).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1400  # IHDR width
    import json

    rows = json.loads((stem.parent / (stem.name + ".json")).read_text())
    fitting = [r for r in rows if r["plan"]["fits"]]
    best = max(fitting, key=lambda r: r["plan"]["step"]["tokens_per_s_per_device"])["layout"]
    page = (stem.parent / (stem.name + ".html")).read_text()
    import html
    import re

    bars = [(kind.split(), html.unescape(label))
            for kind, label in re.findall(r'<div class="row ([\w ]+)" data-layout="([^"]*)"', page)]
    assert [label for kind, label in bars if "best" in kind] == [best] and page.count(" · best<") == 1
    # sorted: the fitting layouts fastest first, then the ones that do not fit
    order = sorted(rows, key=lambda r: (not r["plan"]["fits"], -r["plan"]["step"]["tokens_per_s_per_device"]
                                        if r["plan"]["fits"] else r["plan"]["ranks"][0]["memory"]["deepspeed"]["total"]))
    assert len(bars) == len(order)
    assert all(label == r["layout"] for (_, label), r in zip(bars, order, strict=True))


@pytest.mark.parametrize("theirs", ["resolved.json", "notes.html", "photo.png"])
def test_plan_out_never_overwrites_a_file_it_did_not_write(tmp_path, theirs):
    """`plan out=RUN/resolved` replaced a run's resolved.json with a plan list (issue 29); its own files it replaces."""
    stem, ext = theirs.rsplit(".", 1)
    mine = tmp_path / theirs
    mine.write_bytes(b"\x89PNG\r\n\x1a\n not ours" if ext == "png" else b'{"recipe_name": "x"}')
    argv = [sys.executable, "-m", "launch", "plan", "world_size=4", f"out={tmp_path / stem}"]
    p = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "never overwritten" in p.stderr, p.stderr
    assert mine.read_bytes().endswith((b"not ours", b'"x"}')) and not any(
        (tmp_path / f"{stem}.{e}").exists() for e in ("png", "html", "json") if e != ext)
    ours = [sys.executable, "-m", "launch", "plan", "world_size=4", f"out={tmp_path / 'p'}"]
    for _ in range(2):  # the second time it replaces its own three files
        assert subprocess.run(ours, cwd=tmp_path, capture_output=True, timeout=120).returncode == 0


@pytest.mark.parametrize("out", ["/", ".", "..", "{tmp}/"])
def test_plan_out_naming_a_folder_is_refused(tmp_path, out):
    out = out.format(tmp=tmp_path)
    p = subprocess.run([sys.executable, "-m", "launch", "plan", "world_size=4", f"out={out}"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "names a folder" in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert not list(tmp_path.glob(".*.png")) and not list(tmp_path.parent.glob(".png"))


@pytest.mark.parametrize("recipe, overrides, want", [
    # Megatron TP on GPUs: one hardware queue, so its collectives overlap (Megatron-LM asserts it without FSDP)
    ("recipes/7b_tp4", (), "1"),
    ("recipes/8b_tp8_sp_zero1", (), "1"),  # with the distributed optimizer too (NeMo's setting)
    # ZeRO-3 shards the parameters: Megatron-LM refuses 1 under FSDP and, given TP beside it, warns and leaves it unset
    ("recipes/7b_tp2_zero3", (), None),
    ("recipes/7b_tp2_zero3", ("parallel.zero_stage=2",), "1"),
    ("recipes/7b_tp2_zero3", ("parallel.tp=1",), None),  # no TP
    ("recipes/7b_zero3_ac", ("parallel.tp=2", "parallel.zero_stage=2"), None),  # DeepSpeed AutoTP: not Megatron's rule
    ("recipes/tiny_tp2_sp", (), None),  # CPU ranks
])
def test_megatron_tp_on_gpus_gets_one_device_connection(recipe, overrides, want):
    from launch.config.resolve import resolve_path
    from launch.run.launcher import rank_env

    env = rank_env(resolve_path(REPO / recipe, list(overrides)), "runs/x", environ={})
    assert env.get("CUDA_DEVICE_MAX_CONNECTIONS") == want
    if want:  # the user's own setting is kept
        kept = rank_env(resolve_path(REPO / recipe, list(overrides)), "runs/x", environ={"CUDA_DEVICE_MAX_CONNECTIONS": "8"})
        assert kept["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"


def test_transformer_engine_attention_is_megatron_on_gpus_with_te_installed(monkeypatch):
    """train.attention=te: refused on another backend or CPU ranks when resolved, and at launch where
    transformer_engine is not installed (looked up, never imported); the plan names it and plans it as fused."""
    import importlib.util

    import pytest

    from launch.config.resolve import resolve_path
    from launch.errors import ConfigError
    from launch.plan.build import plan_resolved
    from launch.run import envinfo
    from launch.run.launcher import preflight

    with pytest.raises(ConfigError, match='runs on GPUs only \\(here backend "deepspeed"'):
        resolve_path(REPO / "recipes/7b_zero3_ac", ["train.attention=te"])
    with pytest.raises(ConfigError, match="runs on GPUs only"):
        resolve_path(REPO / "recipes/tiny_tp2_sp", ["train.attention=te"])
    r = resolve_path(REPO / "recipes/7b_tp2_zero3", ["train.attention=te"])
    sdpa = plan_resolved(resolve_path(REPO / "recipes/7b_tp2_zero3"), envinfo.machine())
    te = plan_resolved(r, envinfo.machine())
    assert any("Transformer Engine's fused attention" in n for n in te.notes)
    assert te.worst().memory[te.worst().implementation].total == sdpa.worst().memory[sdpa.worst().implementation].total
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformer_engine" else real(name, *a))
    with pytest.raises(ConfigError, match="needs Transformer Engine, which is not installed here"):
        preflight(r, gpus=4)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "transformer_engine" else real(name, *a))
    preflight(r, gpus=4)


@pytest.mark.parametrize("recipe, refused", [("7b_tp2_zero3", True), ("7b_fsdp2", True), ("7b_tp4", False),
                                             ("7b_zero2", False)])
def test_one_device_connection_from_the_environment_is_refused_where_parameters_are_gathered(recipe, refused):
    """The launcher keeps a CUDA_DEVICE_MAX_CONNECTIONS the user set; =1 under ZeRO-3 or FSDP2 would queue each
    prefetched parameter gather behind compute, which the plan counts as hidden: one line before launch. Megatron's TP
    (which wants it, and gets it from the launcher) and DeepSpeed's ZeRO-2 (which gathers nothing) run with it."""
    from launch.config.resolve import resolve_path
    from launch.errors import ConfigError
    from launch.run.launcher import preflight

    r = resolve_path(REPO / "recipes" / recipe)
    environ = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    if refused:
        with pytest.raises(ConfigError, match="^environment: CUDA_DEVICE_MAX_CONNECTIONS=\"1\" puts every kernel on one"):
            preflight(r, gpus=8, environ=environ)
    else:
        preflight(r, gpus=8, environ=environ)
    preflight(r, gpus=8, environ={})
