"""Checkpoint bookkeeping, torch-free: which checkpoints are complete, which one a run continues, whether
its layout can load it, and DeepSpeed's universal conversion for a new layout.

The deepspeed and megatron backends save through a DeepSpeed engine into `checkpoints/step{N}/`, the torch backend
a torch.distributed.checkpoint folder there; rank 0 writes the marker
(`layoutlab_checkpoint.json`) last, after every rank finished, so a save killed half-way is never resumed.
The CLI uses this before any rank starts (to refuse an impossible resume in one line), the training
loop on the ranks, and `launch export`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launch import inputs
from launch.config import adapters
from launch.config.backends import traits
from launch.config.resolve import Resolved
from launch.config.schedule import lr_at
from launch.errors import ConfigError
from launch.outputs import write_text_atomic

MARKER = "layoutlab_checkpoint.json"  # written last, by rank 0, after every rank finished saving


@dataclass(frozen=True)
class Checkpoint:
    path: Path  # the checkpoints/ folder
    tag: str  # step{N}
    info: dict[str, Any]  # the marker: step, layout, backend

    @property
    def step(self) -> int:
        return int(self.info["step"])

    @property
    def dir(self) -> Path:
        return self.path / self.tag


class ResumeError(RuntimeError):
    pass


def check_resume_compatible(ckpt: Checkpoint, resolved: Resolved) -> bool:
    """Refuse what cannot load; True when the checkpoint must go through DeepSpeed's universal format
    (another data- or tensor-parallel degree)."""
    info, par = ckpt.info, resolved.recipe.parallel
    if info.get("backend") != resolved.recipe.backend:
        raise ResumeError(f"{ckpt.dir}: checkpoint was written by backend {info.get('backend')!r}; "
                          "resume it with the same backend, or set run.resume=never")
    if info.get("model") != resolved.model.name:
        raise ResumeError(f"{ckpt.dir}: checkpoint holds model {info.get('model')!r}, this run trains "
                          f"{resolved.model.name!r}; set run.resume=never to start fresh")
    if traits(resolved.recipe.backend).checkpoint_format == "dcp":
        return False  # torch.distributed.checkpoint reshards onto any tp, dp and zero stage as it loads
    z_old, z_new = info["zero_stage"], par.zero_stage  # complete_checkpoints checked the marker's fields
    bt = traits(resolved.recipe.backend)
    if bt.distributed_optimizer(z_old) != bt.distributed_optimizer(z_new):
        ours, theirs = (z_old, z_new) if bt.distributed_optimizer(z_old) else (z_new, z_old)
        raise ResumeError(
            f"{ckpt.dir}: checkpoint was saved with parallel.zero_stage={z_old}; this run has zero_stage={z_new}. "
            f"The {resolved.recipe.backend} backend trains ZeRO-{ours} with its own distributed optimizer and "
            f"ZeRO-{theirs} with DeepSpeed's, whose checkpoints hold different files; set "
            f"parallel.zero_stage={z_old}, or run.resume=never to start fresh")
    if z_old != z_new and not {z_old, z_new} <= {1, 2}:
        raise ResumeError(
            f"{ckpt.dir}: checkpoint was saved with parallel.zero_stage={z_old}; this run has zero_stage={z_new}. "
            f"DeepSpeed 0.19.8 cannot load one into the other (its loader fails with a bare AssertionError); "
            f"set parallel.zero_stage={z_old}, or run.resume=never to start fresh")
    old = {k: info.get(k, 1) for k in LAYOUT_KEYS}
    new = layout_of(resolved)
    changed = old != new
    if changed and not traits(resolved.recipe.backend).reshard_on_resume:
        diff = ", ".join(f"parallel.{k}={old[k]} (now {new[k]})" for k in LAYOUT_KEYS if old[k] != new[k])
        raise ResumeError(f"{ckpt.dir}: checkpoint was saved with {diff}; the {resolved.recipe.backend} backend "
                          f"resumes only onto the layout it was saved with; set those fields back, or "
                          "run.resume=never to start fresh")
    if changed and z_old == 0:
        raise ResumeError(f"{ckpt.dir}: a ZeRO-0 checkpoint (tp={info['tp']}, dp={info['dp']}) cannot be resharded to "
                          f"tp={par.tp}, dp={par.dp} (DeepSpeed's universal format needs ZeRO >= 1); keep the layout "
                          "or set run.resume=never")
    return changed


LAYOUT_KEYS = ("tp", "pp", "vpp", "dp")


def layout_of(resolved: Resolved) -> dict[str, int]:
    par = resolved.recipe.parallel
    return {"tp": par.tp, "pp": par.pp, "vpp": par.vpp, "dp": int(par.dp)}


def marker_info(resolved: Resolved, step: int) -> dict[str, Any]:
    """What the completion marker records: the step, the layout that wrote it and the training it continues."""
    return {"step": step, "backend": resolved.recipe.backend, **layout_of(resolved),
            "zero_stage": resolved.recipe.parallel.zero_stage, "model": resolved.model.name,
            "train_steps": resolved.recipe.train.steps, "identity": run_identity(resolved)}


def planned_steps(ckpt: Checkpoint) -> int | None:
    """train.steps of the run that wrote `ckpt`: its marker's, else (a marker from before it recorded them) its run
    directory's resolved.json; None where neither says."""
    steps = ckpt.info.get("train_steps")
    if isinstance(steps, int) and not isinstance(steps, bool):
        return steps
    try:
        return Resolved.load(ckpt.path.parent / "resolved.json").recipe.train.steps
    except (OSError, ConfigError):
        return None


def schedule_break(step: int, was: int | None, resolved: Resolved) -> str:
    """Why continuing a checkpoint of `step`, written by a run laid over `was` steps (planned_steps), under `resolved`
    would break the learning-rate schedule that run followed ('' when it continues): a decaying schedule is laid over
    train.steps, so another step count re-stretches it and the rate jumps at the first step resumed (3e-4 to 7.5e-4
    when a finished cosine run was extended). Constant schedules, and warm-ups not yet over, continue whatever the
    step count."""
    t = resolved.recipe.train
    if was is None or was == t.steps:
        return ""
    rate = {"lr": t.lr, "min_lr": t.min_lr, "warmup": t.lr_warmup_steps, "schedule": t.lr_schedule}
    before, after = lr_at(step, total=was, **rate), lr_at(step, total=t.steps, **rate)
    if abs(after - before) <= 1e-9 * max(abs(before), abs(after)):
        return ""
    return (f"train.steps={t.steps} re-stretches the {t.lr_schedule} learning-rate schedule its run laid over {was} "
            f"steps: step {step + 1} would train at {after:.3g} where that schedule gives {before:.3g}")


def to_universal(ckpt: Checkpoint) -> Path:
    """Convert a checkpoint to DeepSpeed's universal format once (cached beside it), in a subprocess."""
    out = ckpt.path / f"{ckpt.tag}_universal"
    done = out / "layoutlab_converted"
    if done.is_file():
        return out
    # through launch.torchtools.untrusted: DeepSpeed's converter unpickles every shard, weights-only there
    cmd = [sys.executable, "-m", "launch.torchtools.untrusted", "ds_to_universal", "--input_folder", str(ckpt.dir),
           "--output_folder", str(out)]
    if ckpt.info["zero_stage"] in (1, 2):
        cmd.append("--inject_missing_state")  # ZeRO-1/2 shards lack what the universal loader expects
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"})
    if p.returncode != 0:
        said = (p.stderr.strip().splitlines() or ["no message"])[-1]
        raise ResumeError(f"{ckpt.dir}: ds_to_universal failed ({p.returncode}): {said}")
    done.write_text("ok")
    return out


def training_identity(resolved: Resolved) -> dict[str, Any]:
    """What a checkpoint must share with a run to continue it: model, data, batch, sequence length, dtype and
    optimizer settings. The layout (tp, dp, ZeRO stage, offload, nodes) may differ: resharding is supported,
    within the limits check_resume_compatible states; train.steps may change where the schedule continues
    (schedule_break)."""
    r = resolved.recipe
    t = r.train
    return {
        "model": resolved.model.name, "hf_config": resolved.model.to_dict()["hf_config"], "dtype": r.precision.dtype,
        "global_batch_size": r.batch.global_batch_size, "seq_len": r.batch.seq_len,
        "optimizer": [t.lr, t.min_lr, t.lr_schedule, t.lr_warmup_steps, t.weight_decay, t.adam_beta1, t.adam_beta2,
                      t.grad_clip, t.seed],
        # the fields that choose the rows (synthetic data has none of them, so its older markers still match)
        "data": [r.data.source, r.data.path, r.data.tokenizer]
        + ([] if r.data.source == "synthetic" else [r.data.text_field, r.data.valid_fraction, r.data.valid_path,
                                                    resolved.data_fingerprint]),
        # a fine-tune's checkpoint holds its adapters alone: the base they continue from is the recipe's weights,
        # built again at start-up, known by their content wherever they lie (both absent without [peft], so markers
        # of full training still match)
        **({"peft": [r.peft.method, r.peft.rank, r.peft.alpha, r.peft.dropout, sorted(r.peft.target_modules)],
            "base_weights": resolved.weights_fingerprint} if adapters.adapted(r.peft) else {}),
    }


def run_identity(resolved: Resolved) -> dict[str, Any]:
    """What `run.resume=auto` requires of a checkpoint: the training it continues (training_identity) and the
    configuration that wrote it: backend, layout, ZeRO stage, offload and micro-batch size. Another layout is resumed
    only when named (`run.resume=RUN_DIR`), never picked up by itself."""
    par = resolved.recipe.parallel
    return {**training_identity(resolved), "backend": resolved.recipe.backend, **layout_of(resolved),
            "zero_stage": par.zero_stage, "offload_optimizer": par.offload_optimizer,
            "offload_params": par.offload_params, "micro_batch_size": resolved.recipe.batch.micro_batch_size}


def _differs(want: dict[str, Any], have: dict[str, Any]) -> list[str]:
    """The identity keys two runs differ in; a key the checkpoint's marker does not record (one written before that
    key was part of a run's identity) is named as such."""
    return sorted(k if k in have else f"{k} (not recorded)" for k in set(want) | set(have) if want.get(k) != have.get(k))


def _identity_of(ckpt: Checkpoint) -> dict[str, Any]:
    """The run identity a marker records; for a marker written before the identity held the layout, its top-level
    backend and layout fields stand in (offload and micro-batch size it never recorded)."""
    return {**{k: ckpt.info[k] for k in ("backend", *LAYOUT_KEYS, "zero_stage")}, **ckpt.info.get("identity", {})}


@dataclass(frozen=True)
class ResumeChoice:
    """Which checkpoint a run continues (None: it starts fresh), and what to tell the user about it."""

    checkpoint: Checkpoint | None
    lines: tuple[str, ...]


def choose_resume(resolved: Resolved, runs_dir: Path) -> ResumeChoice:
    """The checkpoint `run.resume` names: "never" none; "auto" the newest one of a run of this recipe with the same
    identity (find_resume); a path, the newest complete checkpoint of that run directory, or that checkpoint folder,
    which must continue the same training (its layout may differ: check_resume_compatible says what can load).
    Raises ResumeError for a path that holds none."""
    how = resolved.recipe.run.resume
    if how == "never":
        return ResumeChoice(None, ())
    if how == "auto":
        return find_resume(runs_dir, resolved)
    ckpt = explicit_resume(Path(how), resolved)
    return ResumeChoice(ckpt, (f"resuming {ckpt.dir} at step {ckpt.step} (run.resume names it)",))


def explicit_resume(path: Path, resolved: Resolved) -> Checkpoint:
    """The checkpoint a `run.resume=PATH` names: PATH is a run directory (its newest complete checkpoint) or one
    checkpoint folder (checkpoints/step{N}, with its completion marker)."""
    damaged: list[str] = []
    if (path / MARKER).is_file():
        found = [c for c in complete_checkpoints(path.parent, damaged) if c.tag == path.name]
        damaged = [d for d in damaged if d.startswith(str(path / MARKER))]
    else:
        found = complete_checkpoints(path / "checkpoints", damaged)
    if not found:
        # a marker that lies (step99 in folder step3) or is damaged is named: "no complete checkpoint" alone hid it
        raise ResumeError(f"run.resume={path} holds no complete checkpoint (a run directory with checkpoints/step*/"
                          f"{MARKER}, or one such step folder)" + (f" ({damaged[-1]})" if damaged else "")
                          + "; name one that does, or set run.resume=auto or never")
    ckpt = found[-1]
    want = json.loads(json.dumps(training_identity(resolved)))
    diff = _differs(want, {k: v for k, v in ckpt.info.get("identity", {}).items() if k in want})
    if diff:
        raise ResumeError(f"{ckpt.dir}: trains a different configuration (differs in {', '.join(diff)}); resume it "
                          "with the recipe and overrides that wrote it, or set run.resume=never")
    was = planned_steps(ckpt)
    broken = schedule_break(ckpt.step, was, resolved)
    if broken:
        raise ResumeError(f"{ckpt.dir}: {broken}; resume it with train.steps={was}, or train with "
                          "train.lr_schedule=constant where a run is to be extended")
    return ckpt


def find_resume(runs_dir: Path, resolved: Resolved) -> ResumeChoice:
    """`run.resume=auto`: the newest complete checkpoint of an unfinished run of this recipe (runs/<recipe>/*) of the
    same identity (run_identity) whose learning-rate schedule it continues, and what to tell the user, in as few
    lines as there are kinds of run passed over: damaged markers (each named), runs of another configuration (counted,
    the newest named with how it differs), and runs of this configuration that finished or whose schedule another
    train.steps would re-stretch (the newest named: a new run starts beside it)."""
    if not runs_dir.is_dir():
        return ResumeChoice(None, ())
    want = json.loads(json.dumps(run_identity(resolved)))
    # Newest first by when each run last completed a checkpoint: folder names do not sort by time once SLURM's
    # `slurm-<job id>` folders sit beside UTC stamps.
    damaged: list[str] = []
    latest = [found[-1] for d in runs_dir.iterdir() if (found := complete_checkpoints(d / "checkpoints", damaged))]
    latest.sort(key=lambda c: (_marker_mtime(c), c.path.parent.name), reverse=True)
    other: list[tuple[Checkpoint, list[str]]] = []
    done: list[tuple[Checkpoint, str]] = []
    chosen = None
    for newest in latest:
        diff = _differs(want, _identity_of(newest))
        if diff:
            other.append((newest, diff))
            continue
        was = planned_steps(newest)
        if was is not None and newest.step >= was:
            done.append((newest, f"finished at step {newest.step}"))
        elif broken := schedule_break(newest.step, was, resolved):
            done.append((newest, broken))
        else:
            chosen = newest
            break
    lines = list(damaged)
    if other:
        ckpt, diff = other[0]
        more = f"{len(other)} earlier runs of this recipe train" if len(other) > 1 else "an earlier run trains"
        lines.append(f"not resumed: {more} a different configuration (the newest, {ckpt.path.parent}, differs in "
                     f"{', '.join(diff)})")
    if done and chosen is None:
        ckpt, why = done[0]
        lines.append(f"starting a new run: the newest run of this configuration, {ckpt.path.parent}, {why} "
                     f"(run.resume={ckpt.path.parent} continues it where its schedule allows)")
    if chosen is not None:
        lines.append(f"resuming {chosen.path.parent} at step {chosen.step} (run.resume=auto: the newest unfinished run "
                     "of this configuration; run.resume=never starts fresh)")
    elif lines and not done:
        lines.append("starting fresh: no earlier run of this recipe has this configuration")
    return ResumeChoice(chosen, tuple(lines))


def _marker_mtime(ckpt: Checkpoint) -> float:
    try:
        return (ckpt.dir / MARKER).stat().st_mtime
    except OSError:
        return 0.0


def write_marker(ckpt_root: Path, tag: str, info: dict[str, Any]) -> None:
    write_text_atomic(ckpt_root / tag / MARKER, json.dumps(info, indent=2))


def complete_checkpoints(root: Path, damaged: list[str] | None = None) -> list[Checkpoint]:
    """The checkpoints under `root` whose completion marker is whole and sane, by step; a marker that is not (a run
    directory from elsewhere, a file cut short or edited) makes its checkpoint incomplete, and is named in `damaged`
    when given."""
    out = []
    if root.is_dir():
        for d in root.iterdir():
            marker = d / MARKER
            if os.path.lexists(marker):  # a FIFO or link there is named by _marker, not passed over in silence
                info = _marker(marker)
                if isinstance(info, str):
                    if damaged is not None:
                        damaged.append(f"{marker}: {info}; that checkpoint is not resumed")
                    continue
                out.append(Checkpoint(root, d.name, info))
    return sorted(out, key=lambda c: c.step)


def _marker(path: Path) -> dict[str, Any] | str:
    """A completion marker as marker_info wrote it, or what is wrong with it."""
    info = inputs.load_json(path)  # a FIFO, a folder, nesting past the parser's recursion, not JSON, NaN
    if inputs.unusable(info):
        return str(info)
    if not isinstance(info, dict):
        return "is not a JSON object"
    info = {"pp": 1, "vpp": 1, **info}  # markers written before pipelines held no pp / vpp
    for key, low in (("step", 0), ("zero_stage", 0), ("tp", 1), ("pp", 1), ("vpp", 1), ("dp", 1)):
        v = info.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or not low <= v < 2**63:
            return f"{key}={v!r} is not a whole number from {low}"
    if not isinstance(info.get("backend"), str) or not isinstance(info.get("identity", {}), dict):
        return "names no backend, or its identity is not an object"
    if path.parent.name != f"step{info['step']}":  # resume and the schedule go by the step: the folder must agree
        return f"step={info['step']} is not its folder's ({path.parent.name})"
    return info
