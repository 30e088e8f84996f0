"""`python -m launch export RUN_DIR [step=N] [out=DIR]`: a checkpoint as a Hugging Face safetensors folder.

This side checks the arguments; the consolidation needs torch and the backend's own code, so it runs as a process
(`python -m launch.torchtools.export`, launch/torchtools/export.py), like every torch program of the driver.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from launch.commands.args import Option, boolean, read, text, whole
from launch.config import adapters
from launch.config.resolve import Resolved
from launch.errors import ConfigError
from launch.inputs import weights_fingerprint
from launch.run.checkpoints import complete_checkpoints
from launch.run.launcher import local_gpu_count
from launch.run.rundir import RunDir, export_inputs, export_target_problem

USAGE = "usage: python -m launch export RUN_DIR [step=N] [out=DIR] [merge=true]"
OPTIONS = (Option("step", "the checkpoint's step (default: the newest complete one)", whole()),
           Option("out", "the folder to write (default: RUN_DIR/export/<tag>)", text),
           Option("merge", "a fine-tune's ([peft]): also the merged model, in OUT/merged (default: false, the "
                           "adapters alone)", boolean))


def cmd_export(args: Sequence[str]) -> int:
    a = read(args, command="export", usage=USAGE, options=OPTIONS, positional=(1, 1))
    run_dir, step, out, merge = a.positional[0], a.options["step"], a.options["out"], a.options["merge"]
    if not RunDir.is_run_dir(run_dir):
        raise ConfigError(run_dir, "run_dir", run_dir, "is not a run directory (no resolved.json)", "pass runs/<recipe>/<stamp>")
    run = RunDir.open(run_dir)
    resolved = Resolved.load(run.resolved)  # damaged: one line here, not a traceback in the export process
    if merge and not adapters.adapted(resolved.recipe.peft):
        raise ConfigError("command line", "merge", "true", f"has nothing to merge: {run_dir} trained every parameter "
                          "(no [peft] adapters), and its export is the whole model", "leave merge unset")
    if merge and resolved.weights_fingerprint:  # set for a fine-tune of model.weights (commands.run.check_inputs)
        # The merge adds the adapters to the base the recipe names, read again now: other weights put there since
        # the run would merge into a model the adapters were never trained with, silently.
        base = Path(resolved.recipe.model.weights)
        try:
            gone = (None if weights_fingerprint(base) == resolved.weights_fingerprint else
                    "its content's fingerprint differs from the run's") if base.is_dir() else "missing"
        except OSError as e:
            gone = f"unreadable ({e.strerror or type(e).__name__})"
        if gone:
            raise ConfigError(str(run.resolved), "model.weights", str(base),
                              f"no longer holds the base this run fine-tuned ({gone})",
                              "put the run's base weights back at that path to merge, or leave merge unset to export "
                              "the adapters alone")
    inputs = export_inputs(run, resolved.recipe)
    problem = export_target_problem(Path(out), inputs=inputs) if out else None
    if problem:  # before the export starts: nothing of the user's is touched
        raise ConfigError("command line", "out", out, problem, "name a new folder, or an earlier export's")
    damaged: list[str] = []
    found = [c for c in complete_checkpoints(run.checkpoints, damaged) if step is None or c.step == step]
    if not found:
        listed = ", ".join(str(c.step) for c in complete_checkpoints(run.checkpoints))
        raise ConfigError(str(run.checkpoints), "step", "newest" if step is None else step,
                          "has no complete checkpoint" + (f" ({'; '.join(damaged)})" if damaged else ""),
                          f"pick one of the complete steps ({listed})" if listed else
                          "train with train.checkpoint_every>0 (a final checkpoint is always written)")
    default = run.root / "export" / found[-1].tag
    # Inside a run directory (perhaps someone else's) no link is followed to write: RUN/export -> elsewhere was
    linked = next((p for p in (run.root / "export", default) if p.is_symlink()), None)
    problem = None if out else (f"is a symbolic link inside the run directory ({linked} -> {os.readlink(linked)})"
                                if linked else export_target_problem(default, inputs=inputs))
    if problem:
        raise ConfigError(str(run.root), "export", str(default), problem, "name another folder with out=")
    cmd = [sys.executable, "-m", "launch.torchtools.export", run_dir, "-" if step is None else str(step), out or "-",
           "true" if merge else "false"]
    # weights-only for every load of the process, whatever the caller asks (launch.torchtools.untrusted guards it too)
    env = {**os.environ, "TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"}
    if local_gpu_count() == 0:  # DeepSpeed would say on stderr that it fell back to the CPU: the error stays one line
        env.setdefault("DS_ACCELERATOR", "cpu")
    return subprocess.run(cmd, check=False, env=env).returncode
