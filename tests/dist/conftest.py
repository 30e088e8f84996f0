"""Real runs through `bash launch/run.sh`, on gloo CPU ranks, each in its own runs/ folder."""
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from launch.run.checkpoints import MARKER, complete_checkpoints
from launch.run.metrics import read_metrics
from tests.conftest import REPO

TINY = "recipes/tiny_zero2"
MEGATRON = "recipes/tiny_tp2_sp"  # any tiny Megatron recipe; every layout field is overridden by the layouts below
# Short, deterministic fp32 runs: the parity tests compare them to 1e-5.
SHORT = ("train.steps=10", "train.warmup_steps=2", "train.lr_warmup_steps=2", "train.checkpoint_every=0",
         "batch.seq_len=32", "batch.global_batch_size=8", "train.lr=3e-3")
# A torch profiler trace of one step, for the tests that count collectives in it; it leaves the losses alone
# (the parity tests compare those runs to the one-rank reference like the others).
PROFILE_ONE_STEP = ("run.profile=torch", "run.profile_active_steps=1")
# Checkpoints at steps 5 and 10 (the profiled step is 4): the checkpoint tests resume, reshard and export copies of
# the shared runs that carry these instead of training their own (saving leaves the losses alone).
EVERY_5 = ("train.checkpoint_every=5",)

# DeepSpeed backend (tiny_zero2) on 2 ranks at each ZeRO stage, and with AutoTP 2 on 2 or 4 ranks. The ZeRO-2 and
# ZeRO-3 runs also serve the run-directory, launcher, checkpoint and report tests.
DS_DP2 = {z: (*SHORT, "hardware.gpus_per_node=2", "batch.micro_batch_size=2", f"parallel.zero_stage={z}",
              *((*EVERY_5, *PROFILE_ONE_STEP) if z >= 2 else ())) for z in range(4)}


def ds_autotp(gpus: int, zero: int) -> tuple[str, ...]:
    return (*SHORT, f"hardware.gpus_per_node={gpus}", "parallel.tp=2",
            "batch.micro_batch_size=2" if gpus == 4 else "batch.micro_batch_size=4", f"parallel.zero_stage={zero}",
            *(EVERY_5 if (gpus, zero) == (4, 1) else ()))


# Megatron-Core layouts (on MEGATRON), each the whole global batch of SHORT; tp2_sp, pp2, tp2_dp2_zero3 and the ZeRO-1
# (distributed optimizer) ones serve the Megatron checkpoint tests too.
MEGATRON_LAYOUTS = {
    "tp2": ("hardware.gpus_per_node=2", "parallel.tp=2", "parallel.sp=false", "parallel.zero_stage=0",
            "batch.micro_batch_size=4", *PROFILE_ONE_STEP),
    "tp2_sp": ("hardware.gpus_per_node=2", "parallel.tp=2", "parallel.sp=true", "parallel.zero_stage=0",
               "batch.micro_batch_size=4", *PROFILE_ONE_STEP, *EVERY_5),
    "pp2": ("hardware.gpus_per_node=2", "parallel.tp=1", "parallel.sp=false", "parallel.pp=2",
            "parallel.zero_stage=0", "batch.micro_batch_size=4", *EVERY_5),
    "pp2_vpp2": ("hardware.gpus_per_node=2", "parallel.tp=1", "parallel.sp=false", "parallel.pp=2", "parallel.vpp=2",
                 "parallel.zero_stage=0", "batch.micro_batch_size=2"),
    "tp2_pp2": ("hardware.gpus_per_node=4", "parallel.tp=2", "parallel.sp=false", "parallel.pp=2",
                "parallel.zero_stage=0", "batch.micro_batch_size=4", *PROFILE_ONE_STEP),
    "dp2_zero1": ("hardware.gpus_per_node=2", "parallel.tp=1", "parallel.sp=false", "parallel.zero_stage=1",
                  "batch.micro_batch_size=2", *EVERY_5, *PROFILE_ONE_STEP),
    "tp2_dp2_zero3": ("hardware.gpus_per_node=4", "parallel.tp=2", "parallel.sp=false", "parallel.zero_stage=3",
                      "batch.micro_batch_size=2", *EVERY_5),
    "tp2_dp2_zero2": ("hardware.gpus_per_node=4", "parallel.tp=2", "parallel.sp=false", "parallel.zero_stage=2",
                      "batch.micro_batch_size=2"),
    "pp2_dp2_zero1": ("hardware.gpus_per_node=4", "parallel.tp=1", "parallel.sp=false", "parallel.pp=2",
                      "parallel.zero_stage=1", "batch.micro_batch_size=2"),
    "pp2_vpp2_dp2_zero1": ("hardware.gpus_per_node=4", "parallel.tp=1", "parallel.sp=false", "parallel.pp=2",
                           "parallel.vpp=2", "parallel.zero_stage=1", "batch.micro_batch_size=2"),
    "tp2_sp_dp2_zero1": ("hardware.gpus_per_node=4", "parallel.tp=2", "parallel.sp=true", "parallel.zero_stage=1",
                         "batch.micro_batch_size=2", *EVERY_5),
}


# The torch backend (DDP, FSDP2, DTensor TP/SP, pipelining) on TORCH, each the whole global batch of SHORT. fsdp2_z3,
# tp2_dp2 and pp2_dp2_z2 carry checkpoints for the torch checkpoint tests; the profiled ones serve the collective tests.
TORCH = "recipes/tiny_fsdp2"
TORCH_LAYOUTS = {
    "ddp": ("hardware.gpus_per_node=2", "parallel.zero_stage=0", "batch.micro_batch_size=2", *PROFILE_ONE_STEP),
    "fsdp2_z2": ("hardware.gpus_per_node=2", "parallel.zero_stage=2", "batch.micro_batch_size=2", *PROFILE_ONE_STEP),
    "fsdp2_z3": ("hardware.gpus_per_node=2", "parallel.zero_stage=3", "batch.micro_batch_size=2", *PROFILE_ONE_STEP,
                 *EVERY_5),
    "tp2": ("hardware.gpus_per_node=2", "parallel.tp=2", "parallel.zero_stage=3", "batch.micro_batch_size=4",
            *PROFILE_ONE_STEP),
    "tp2_sp": ("hardware.gpus_per_node=2", "parallel.tp=2", "parallel.sp=true", "parallel.zero_stage=3",
               "batch.micro_batch_size=4", *PROFILE_ONE_STEP),
    "tp2_dp2": ("hardware.gpus_per_node=4", "parallel.tp=2", "parallel.zero_stage=3", "batch.micro_batch_size=2",
                *PROFILE_ONE_STEP, *EVERY_5),
    "tp2_dp2_sp": ("hardware.gpus_per_node=4", "parallel.tp=2", "parallel.sp=true", "parallel.zero_stage=3",
                   "batch.micro_batch_size=2", *PROFILE_ONE_STEP),
    "ac_full": ("hardware.gpus_per_node=2", "parallel.zero_stage=3", "batch.micro_batch_size=2",
                "train.activation_checkpointing=full"),
    "pp2_vpp2": ("hardware.gpus_per_node=2", "parallel.pp=2", "parallel.vpp=2", "parallel.zero_stage=3",
                 "batch.micro_batch_size=2", *PROFILE_ONE_STEP),
    "tp2_pp2_sp": ("hardware.gpus_per_node=4", "parallel.tp=2", "parallel.pp=2", "parallel.sp=true",
                   "parallel.zero_stage=3", "batch.micro_batch_size=4"),
    "pp2_dp2_z2": ("hardware.gpus_per_node=4", "parallel.pp=2", "parallel.zero_stage=2", "batch.micro_batch_size=2",
                   *PROFILE_ONE_STEP, *EVERY_5),
    "fsdp2_offload": ("hardware.gpus_per_node=2", "parallel.zero_stage=3", "batch.micro_batch_size=2",
                      "parallel.offload_params=cpu", "parallel.offload_optimizer=cpu"),
    "hsdp": ("hardware.gpus_per_node=4", "parallel.zero_hpz_partition_size=2", "parallel.zero_stage=3",
             "batch.micro_batch_size=2", *PROFILE_ONE_STEP),
    "tp2_sp_selective": ("hardware.gpus_per_node=2", "parallel.tp=2", "parallel.sp=true", "parallel.zero_stage=3",
                         "batch.micro_batch_size=4", "train.activation_checkpointing=selective", *PROFILE_ONE_STEP),
    "compile_ac_full": ("hardware.gpus_per_node=2", "parallel.zero_stage=3", "batch.micro_batch_size=2",
                        "train.activation_checkpointing=full", "train.compile=true"),
}


# README's command trains each backend's parallel dimensions on 2 ranks; a layout of 4 ranks (two dimensions combined:
# TP x DP, TP x PP, PP x DP, hybrid sharding) trains under -m full, which CI runs after it: each costs ~25 s of a
# 2-core machine, and together they put README's command past its 12 minutes.
FOUR_RANKS = "hardware.gpus_per_node=4"


def two_ranks_first(cases, *full: str) -> list:
    """Parametrize values for `cases` (name -> the overrides of its run): a name whose run takes 4 ranks, or is one of
    `full` (for another reason its caller gives), is marked full."""
    return [pytest.param(n, marks=pytest.mark.full) if FOUR_RANKS in o or n in full else n for n, o in cases.items()]


# A small collective sweep (8 B .. 16 KiB): read back by the commbench tests; on 2 ranks, the report test's ceiling.
BENCH = ("run.mode=commbench", "commbench.max_bytes=16384", "commbench.warmup_iters=1", "commbench.iters=2")


def commbench(gpus: int, dtype: str) -> tuple[str, ...]:
    return (*BENCH, f"hardware.gpus_per_node={gpus}", "batch.global_batch_size=16", f'commbench.dtype="{dtype}"')


def exported_losses(folder: Path, meta, steps: tuple[int, ...]) -> list[float]:
    """The loss an exported Hugging Face folder gives, loaded by `transformers` itself, on the global batch of each
    0-based step of a run (`meta`: its metrics' meta record; the Synthetic data every tiny recipe trains on). The run
    logs the mean of per-micro-batch means; with equal-length rows that is the batch mean."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from launch.data.rows import Synthetic, global_batch_indices

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    src = Synthetic(512, meta.seq_len, 1234)
    out = []
    for step in steps:
        rows = torch.from_numpy(np.stack([src.row(i) for i in global_batch_indices(step, meta.global_batch_size, None)]))
        with torch.no_grad():
            out.append(model(input_ids=rows, labels=rows).loss.item())
    return out


# README's test command runs on two pytest-xdist workers (pyproject: -n 2 --dist loadgroup): a multi-rank run leaves a
# core idle ~40% of its time (one process imports torch, torchrun starts, ranks rendezvous), which the other worker's
# tests fill. The session's shared runs live in one worker each, so the tests that read one backend's shared runs
# are one group, kept on one worker; the other tests spread.
XDIST_GROUPS = {"test_deepspeed_": "deepspeed", "test_report_e2e": "deepspeed", "test_commbench": "deepspeed",
                "test_megatron_": "megatron", "test_torch_": "torch", "test_fp16_scaling": "torch", "test_lora": "lora",
                # modules whose tests share a module fixture: trained once, on one worker
                "test_data_runs": "data", "test_multinode": "slurm"}


def xdist_group(item) -> str | None:
    """The group of a test that reads shared runs: by its module, or for test_state_bytes by the backend it checks."""
    module = item.module.__name__.rsplit(".", 1)[-1]
    if module == "test_state_bytes":
        return item.callspec.params["name"].split("_", 1)[0]
    return next((group for prefix, group in XDIST_GROUPS.items() if module.startswith(prefix)), None)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the marker into the item's group
def pytest_collection_modifyitems(config, items):
    # `-m full` runs after README's command, whose shared runs it finds in pytest's cache: a backend's tests need not
    # share a worker there, and kept together they left one worker with most of the work; a module's tests still do
    # (several share a module fixture's runs).
    full = (config.option.markexpr or "").strip() == "full"  # CI's second command; README's reads "not full and ..."
    for item in items:
        group = xdist_group(item) if item.path.parent.name == "dist" else None
        if group and full:
            group = item.module.__name__.rsplit(".", 1)[-1]
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


def worst(a: list[float], b: list[float]) -> float:
    """The largest difference of two runs' curves, step by step (their lengths must agree)."""
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


class Trained:
    def __init__(self, root: Path, proc: subprocess.CompletedProcess):
        self.root, self.proc = root, proc

    def metrics(self, rank: int = 0):
        return read_metrics(self.root / "metrics" / f"rank{rank}.jsonl")

    def losses(self, rank: int = 0) -> list[float]:
        return [s.loss for s in self.metrics(rank).steps]


def train(runs: Path, *overrides: str, recipe: str = TINY, timeout: int = 300, check: bool = True,
          env_extra: dict | None = None) -> Trained:
    # No MASTER_PORT: the launcher's own choice (torchrun binds port 0) is what keeps runs side by side apart.
    env = {**{k: v for k, v in os.environ.items() if k != "MASTER_PORT"}, "LAYOUTLAB_RUNS": str(runs), **(env_extra or {})}
    before = set(runs.glob("*/*")) if runs.exists() else set()
    p = subprocess.run(["bash", "launch/run.sh", recipe, *overrides], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=timeout)
    new = sorted(set(runs.glob("*/*")) - before)
    assert len(new) == 1, (p.stdout[-3000:], p.stderr[-3000:])
    t = Trained(new[0], p)
    if check:
        logs = "".join((new[0] / "logs" / f).read_text()[-3000:] for f in sorted(os.listdir(new[0] / "logs")))
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:] + logs
    return t


def interrupted_copy(t: Trained, runs: Path) -> Trained:
    """A copy of the EVERY_5 run `t` in the runs folder `runs` (as runs/<recipe>/<stamp>) whose final save never
    completed, so that its last good checkpoint is step 5: each checkpoint test resumes, reshards or exports its
    own copy, and no test finds another's checkpoints beside it."""
    dest = runs / t.root.parent.name / t.root.name
    shutil.copytree(t.root, dest)  # copy2 keeps the markers' mtimes, by which resume picks the newest
    (dest / "checkpoints" / "step10" / MARKER).unlink()
    assert [c.step for c in complete_checkpoints(dest / "checkpoints")] == [5]
    return Trained(dest, t.proc)


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


def code_digest() -> str:
    """What a shared run's outcome depends on: the launcher and rank code, the recipes and DeepSpeed configs, this
    file's layouts, and the versions of the libraries that train."""
    h = hashlib.sha256()
    for folder in ("launch", "recipes", "ds_configs"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".so", ".o"):
                h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    h.update(Path(__file__).read_bytes())
    for package in ("torch", "deepspeed", "megatron-core", "transformers"):
        h.update(importlib.metadata.version(package).encode())
    return h.hexdigest()[:16]


# Written last beside a cached run's folder (not in it: the report reads every file there): the run completed, where
# it is, and its launch's output.
CACHED = "cached_run.json"


@pytest.fixture(scope="session")
def shared_run(request, runs_root):
    """`shared_run(*overrides, recipe=...)`: the run of that recipe and those overrides, trained the first time a
    test asks and handed to every later test that asks for the same one. A run costs ~15-30 s of start-up on 2
    cores whatever its steps, so tests that can read one run (parity, partitions, state bytes, collectives) share
    it instead of each training its own. Callers only read it; a test that changes a run works on a copy.

    The runs are kept in pytest's cache (.pytest_cache/d/layoutlab-shared-runs/<code digest>/), so CI's second
    invocation (`-m full`, after README's command) and a developer's next one read the runs the first trained
    instead of training them again; any change to the code, recipes or library versions (code_digest) trains anew.
    A file lock per run keeps the two xdist workers from training one run twice; `--cache-clear` empties it."""
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider: this session's runs only
    root = (Path(cache.mkdir("layoutlab-shared-runs")) if cache else runs_root / "shared") / code_digest()
    done: dict[tuple[str, tuple[str, ...]], Trained] = {}

    def get(*overrides: str, recipe: str = TINY) -> Trained:
        key = (recipe, overrides)
        if key not in done:
            done[key] = _cached(root / hashlib.sha256(repr(key).encode()).hexdigest()[:16], recipe, overrides)
        return done[key]

    return get


def _cached(entry: Path, recipe: str, overrides: tuple[str, ...]) -> Trained:
    """The run of `recipe` and `overrides` kept in `entry`, trained there first when it is not complete."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker, asking for the same run, waits and then reads it
        if not (entry / CACHED).is_file():
            shutil.rmtree(entry, ignore_errors=True)  # a run cut short (a failed or killed session): train again
            t = train(entry, *overrides, recipe=recipe)
            (entry / CACHED).write_text(json.dumps({"recipe": recipe, "overrides": list(overrides),
                                                    "run": str(t.root.relative_to(entry)), "args": t.proc.args,
                                                    "stdout": t.proc.stdout, "stderr": t.proc.stderr}))
            return t
    said = json.loads((entry / CACHED).read_text())
    return Trained(entry / said["run"], subprocess.CompletedProcess(said["args"], 0, said["stdout"], said["stderr"]))


@pytest.fixture(scope="session")
def one_rank_reference(shared_run) -> Trained:
    """tiny_zero2 SHORT on one rank, ZeRO-0, the whole global batch in two micro-batches: the oracle that every
    layout, launcher and restart of the same global batch must reproduce (fp32, to 1e-5)."""
    t = shared_run(*SHORT, "hardware.gpus_per_node=1", "batch.micro_batch_size=4", "parallel.zero_stage=0")
    losses = t.losses()
    assert len(losses) == 10
    t.norms = [s.grad_norm for s in t.metrics().steps]
    assert all(n is not None and n > 0 for n in t.norms)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, f"loss did not fall: {losses}"
    return t
