"""The one owner of a run directory's layout; everything else asks it for paths.

runs/<recipe>/<UTC yyyymmdd-hhmmss>/
  resolved.json  plan.json  env.json  launch_cmd.txt
  metrics/rank{R}.jsonl   logs/rank{R}.out|err, state_bytes_rank{R}.json, layout_rank{R}.json   traces/   nccl/   commbench/   tensorboard/   checkpoints/
  commbench/<op>.txt|json   commbench/nccl-tests/<op>.txt   (run.mode = "commbench")
"""
from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass
from pathlib import Path

from launch import inputs
from launch.config.schema import TOKENIZER_NAMES
from launch.outputs import claim_folder, folder_problem, write_text_atomic

SUBDIRS = ("metrics", "logs", "traces", "nccl", "commbench", "tensorboard", "checkpoints")
# The named range (torch.profiler record_function, NVTX) a rank puts around each checkpointed block's recomputation in
# the backward, so that its traces measure recomputation apart from compute (analysis.analyzers.trace_analysis).
RECOMPUTE_REGION = "recompute"
# Files of a run directory that are ours but no evidence for a report (glob relative to the root -> what it is): the
# analysis lists them as ours instead of as files it could not read.
NOT_EVIDENCE = {
    "data/*.npy": "the corpus as the run tokenized it (launch/data/check.py)",
    "launch_cmd.txt": "the launch command", "launch_cmd_node*.txt": "a node's launch command",
    "env_node*.json": "a node's environment record", "deepspeed_env": "DeepSpeed's launcher environment",
    "logs/rank*.out": "a rank's stdout", "logs/rank*.err": "a rank's stderr",
    "logs/failure_rank*.json": "why a rank ended early", "logs/layout_rank*.json": "what a rank's backend built",
    "logs/state_bytes_rank*.json": "a rank's model-state bytes", "logs/stall_rank*.json": "where a stalled rank was",
    "logs/build_memory_rank*.json": "a rank's host memory growth while it built its model",
    "logs/export.err": "the libraries' warnings during export", "ds_config.json": "the DeepSpeed config (accelerate)",
    "accelerate_config.yaml": "the Accelerate config", "*.md": "a report of this run (or your notes)",
    "*.html": "a report of this run", "*_plots/figure*.png": "a Markdown report's figure",
}


def runs_root() -> Path:
    """`$LAYOUTLAB_RUNS` when set, else ./runs (relative to where run.sh is called). Set but empty counts as
    unset: Path("") is the working directory, where runs would land beside the user's files."""
    return Path(os.environ.get("LAYOUTLAB_RUNS") or "runs")


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def resolved(self) -> Path:
        return self.root / "resolved.json"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def env(self) -> Path:
        return self.root / "env.json"

    @property
    def launch_cmd(self) -> Path:
        return self.root / "launch_cmd.txt"

    @property
    def deepspeed_env(self) -> Path:
        """The ranks' environment as DS_ENV_FILE lines: what DeepSpeed's runner exports to every host."""
        return self.root / "deepspeed_env"

    @property
    def data(self) -> Path:
        """The token streams the launch's data check wrote for the ranks (launch/data/check.py)."""
        return self.root / "data"

    @property
    def metrics_dir(self) -> Path:
        return self.root / "metrics"

    def metrics(self, rank: int) -> Path:
        return self.metrics_dir / f"rank{rank}.jsonl"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def stdout(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.out"

    def stderr(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.err"

    def failure(self, rank: int) -> Path:
        """Why the rank ended early, as it said itself (JSON: rank, step, phase, kind, message); absent after a
        clean finish, or when the rank was killed before it could say."""
        return self.logs / f"failure_rank{rank}.json"

    def layout(self, rank: int) -> Path:
        """What a rank's backend built: process groups, model chunks and their layers, seeds (JSON)."""
        return self.logs / f"layout_rank{rank}.json"

    def build_memory(self, rank: int) -> Path:
        """How much the rank's peak host memory grew while it built its part of the model (JSON)."""
        return self.logs / f"build_memory_rank{rank}.json"

    def state_bytes(self, rank: int) -> Path:
        """Model-state bytes the rank held after its first optimizer step (weights, grads, optimizer)."""
        return self.logs / f"state_bytes_rank{rank}.json"

    @property
    def traces(self) -> Path:
        return self.root / "traces"

    @property
    def nccl(self) -> Path:
        return self.root / "nccl"

    def nccl_log(self, rank: int) -> Path:
        return self.nccl / f"rank{rank}.log"

    @property
    def commbench(self) -> Path:
        return self.root / "commbench"

    def commbench_text(self, op: str) -> Path:
        """The built-in sweep's result for one collective, in nccl-tests' text layout."""
        return self.commbench / f"{op}.txt"

    def commbench_json(self, op: str) -> Path:
        return self.commbench / f"{op}.json"

    @property
    def nccl_tests(self) -> Path:
        return self.commbench / "nccl-tests"

    def nccl_tests_text(self, op: str) -> Path:
        """NVIDIA nccl-tests' own output for one collective (named by our op name)."""
        return self.nccl_tests / f"{op}.txt"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @classmethod
    def create(cls, recipe_name: str, *, root: Path | None = None, now: _dt.datetime | None = None) -> "RunDir":
        path = claim_folder((root or runs_root()) / recipe_name, field="LAYOUTLAB_RUNS", now=now)
        for sub in SUBDIRS:
            (path / sub).mkdir(exist_ok=True)
        return cls(path)

    @classmethod
    def join(cls, path: str | Path) -> "RunDir":
        """The run directory node 0 created, joined by the other nodes of a multi-node job."""
        run = cls(Path(path).resolve())
        for sub in SUBDIRS:
            (run.root / sub).mkdir(parents=True, exist_ok=True)
        return run

    @classmethod
    def open(cls, path: str | Path) -> "RunDir":
        return cls(Path(path))

    @staticmethod
    def is_run_dir(path: str | Path) -> bool:
        return (Path(path) / "resolved.json").is_file()

    def siblings(self) -> list["RunDir"]:
        """Earlier runs of the same recipe, oldest first (for resume=auto)."""
        parent = self.root.parent
        return [RunDir(p) for p in sorted(parent.iterdir()) if p != self.root and RunDir.is_run_dir(p)]

    def write_text_atomic(self, path: Path, text: str) -> None:
        write_text_atomic(path, text)


EXPORT_MARKER = "layoutlab_export.json"  # written last into every folder `python -m launch export` fills


def export_target_problem(out: Path, inputs: tuple[Path, ...] = ()) -> str | None:
    """Why `out` may not receive an export (None: it may): a file, a dangling link, an input of the export, or a
    folder holding anything but an earlier export of ours. transformers' save_pretrained deletes the shard files it
    finds in its target, so a folder of someone else's files is never handed to it."""
    return folder_problem(out, ours=is_our_export, writer="`python -m launch export`", inputs=inputs)


def is_our_export(folder: Path) -> bool:
    """Whether `folder` holds an earlier export and nothing else: its marker lists the files the export wrote, and a
    file added since (a model card, an adapter) makes the folder the user's, never replaced."""
    doc = inputs.load_json(folder / EXPORT_MARKER)
    if not isinstance(doc, dict):  # unreadable (load_json's problem), or not our marker's object
        return False
    written = doc.get("files")
    try:
        held = {p.name for p in folder.iterdir()}
    except OSError:
        return False
    return isinstance(written, list) and held <= {*map(str, written), EXPORT_MARKER}


def export_inputs(run: RunDir, recipe) -> tuple[Path, ...]:
    """What an export reads, which its folder may neither be, lie in nor hold: the run's record, its checkpoints, the
    weights the run started from (`model.weights`: an export over them would lose the run's starting point) and the
    tokenizer folder it copies (`data.tokenizer`, where it names one)."""
    tokenizer = recipe.data.tokenizer if recipe.data.tokenizer not in TOKENIZER_NAMES else None
    return (run.resolved, run.checkpoints) + tuple(Path(p) for p in (recipe.model.weights, tokenizer) if p)
