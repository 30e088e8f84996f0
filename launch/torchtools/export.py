"""The torch half of `python -m launch export`: `python -m launch.torchtools.export RUN_DIR STEP OUT MERGE` (STEP and
OUT may be "-"; MERGE "true" or "false"), started by launch/commands/export.py after it has checked the arguments.

Each backend consolidates its own shards (`export_hf_state` of its rank module, see
launch/ranks/trainers/protocol.py); this module checks the result against the model in resolved.json and
writes the folder.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from launch.config import adapters
from launch.config.backends import traits
from launch.config.resolve import Resolved
from launch.data.tokenizer import TOKENIZER_FILE, tokenizer_file, tokenizer_folder
from launch.errors import ConfigError
from launch.torchtools import untrusted
from launch.torchtools.hf import byte_tokenizer, offline_bitsandbytes
from launch.run.checkpoints import ResumeError, complete_checkpoints
from launch.run.rundir import EXPORT_MARKER, RunDir, export_inputs, export_target_problem


def consolidated_state_dict(run: RunDir, resolved: Resolved, step: int | None = None):
    """The newest complete checkpoint (or the one of `step`) as one Hugging Face state dict, by its backend."""
    found = complete_checkpoints(run.checkpoints)
    if step is not None:
        found = [c for c in found if c.step == step]
    if not found:
        raise ConfigError(str(run.checkpoints), "step", step, "has no complete checkpoint",
                          "train with train.checkpoint_every>0 (a final checkpoint is always written), or pick a listed step")
    ckpt = found[-1]
    untrusted.check([ckpt.dir])  # a run directory from elsewhere: nothing it holds is unpickled unless allowed
    return ckpt, traits(resolved.recipe.backend).rank_module().export_hf_state(resolved, ckpt)


MERGED = "merged"  # a fine-tune's export with merge=true: the merged model's folder, inside the adapters'


def export(run_dir: str | Path, step: int | None = None, out: str | Path | None = None,
           merge: bool = False) -> "Exported":
    """A checkpoint as a Hugging Face folder; a fine-tune's ([peft]) as a PEFT folder of its adapters, and with `merge`
    the merged model beside them (folder MERGED)."""
    import torch
    from transformers import AutoModelForCausalLM

    from launch.torchtools.hf import hf_config

    run = RunDir.open(run_dir)
    resolved = Resolved.load(run.resolved)
    ckpt, state = consolidated_state_dict(run, resolved, step)
    config = hf_config(resolved.model)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    # ZeRO-3's universal tensors are stored flat; give each its module shape back.
    state = {k: v.reshape(shapes[k]) if k in shapes and v.numel() == shapes[k].numel() else v
             for k, v in state.items()}
    tuned = adapters.adapted(resolved.recipe.peft)
    trained = {k: state.pop(k) for k in [k for k in state if ".lora_" in k]} if tuned else {}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if resolved.model.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ConfigError(str(ckpt.dir), "parameters", sorted(set(missing) - tied)[:5] or sorted(unexpected)[:5],
                          "do not match the model in resolved.json", "export a checkpoint of this run's own model")
    if tuned:
        model = _with_adapters(model, resolved, trained, ckpt)
    target = Path(out) if out else run.root / "export" / ckpt.tag
    problem = export_target_problem(target, inputs=export_inputs(run, resolved.recipe))
    if problem:
        raise ConfigError("command line", "out", str(target), problem, "name a new folder, or an earlier export's")
    # Written whole beside the target, marked, then swapped in: an earlier export of ours is replaced only once the
    # new one is complete, and save_pretrained never sees a folder with anyone's files in it.
    staging = target.parent / f".{target.name}.export-{os.getpid()}"
    target.parent.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards: 100%": the command prints what it wrote, once
    model.save_pretrained(staging, safe_serialization=True)  # a PeftModel writes its adapters and their config
    tokenizer = save_tokenizer(resolved, staging)
    if merge:
        model.merge_and_unload().save_pretrained(staging / MERGED, safe_serialization=True)
        save_tokenizer(resolved, staging / MERGED)
    files = sorted(p.name for p in staging.iterdir())  # what a later export may replace (rundir.is_our_export)
    (staging / EXPORT_MARKER).write_text(json.dumps({"run": str(run.root), "checkpoint": str(ckpt.dir),
                                                     "files": files}) + "\n")
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.replaced-{os.getpid()}"
        target.rename(old)
    staging.rename(target)
    if old is not None:
        shutil.rmtree(old)
    return Exported(target, tokenizer, tuned, resolved.recipe.model.weights, merge)


def _with_adapters(model, resolved: Resolved, trained: dict, ckpt):
    """The base `model` with the run's adapters, as peft builds them (its LoraConfig of the recipe's [peft]), each
    adapter tensor the checkpoint's, every one there."""
    from peft import get_peft_model

    from launch.torchtools.hf import lora_config

    config = lora_config(resolved.recipe.peft)
    # where the adapters' base lives, for peft's own loading (None: a seeded base, which no folder holds)
    config.base_model_name_or_path = resolved.recipe.model.weights
    tuned = get_peft_model(model, config, adapter_name=adapters.ADAPTER_NAME)
    inner = "base_model.model."  # peft's prefix for the wrapped model's own names
    missing, unexpected = tuned.load_state_dict({inner + k: v for k, v in trained.items()}, strict=False)
    missing = [k for k in missing if ".lora_" in k]
    if missing or unexpected or not trained:
        raise ConfigError(str(ckpt.dir), "adapters", sorted(missing)[:3] or sorted(unexpected)[:3] or "none",
                          "do not match the adapters the run's [peft] makes", "export a checkpoint of this run's own")
    return tuned


@dataclass(frozen=True)
class Exported:
    folder: Path
    tokenizer: str  # what the folder holds of the tokenizer, in words ('' where it holds none)
    tuned: bool = False  # a fine-tune's ([peft]): its adapters, as a PEFT folder
    base: str | None = None  # the folder of the base they load onto (model.weights; None: a seeded base)
    merged: bool = False  # with the merged model in MERGED

    def lines(self) -> list[str]:
        """What the command prints: the folder, then how to load it."""
        if self.tuned:
            return self._adapter_lines()
        how = [f"{self.folder}", f"load it with: AutoModelForCausalLM.from_pretrained({str(self.folder)!r})"]
        if self.tokenizer:
            return [*how, f"and AutoTokenizer.from_pretrained({str(self.folder)!r}) ({self.tokenizer})"]
        return [*how, "(no tokenizer: the run trained on synthetic token ids)"]

    def _adapter_lines(self) -> list[str]:
        base = repr(self.base) if self.base else "<the base model's folder>"
        out = [f"{self.folder}", f"the adapters (PEFT): PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("
                                 f"{base}), {str(self.folder)!r})"]
        if self.merged:
            merged = str(self.folder / MERGED)
            out.append(f"the merged model: AutoModelForCausalLM.from_pretrained({merged!r})")
        if self.tokenizer:
            out.append(f"and AutoTokenizer.from_pretrained({str(self.folder)!r}) ({self.tokenizer})")
        return out


# What a Hugging Face tokenizer folder holds that AutoTokenizer reads (tokenizer.model: a slow tokenizer's own file).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model")


def save_tokenizer(resolved: Resolved, folder: Path) -> str:
    """The tokenizer the run read its rows with, into the export `folder`, so that AutoTokenizer loads it beside the
    model: the files of its tokenizer folder, or the byte tokenizer written as a transformers one. Returns what it
    wrote, in words; '' for synthetic rows, which no tokenizer made."""
    data = resolved.recipe.data
    if data.source == "synthetic":
        return ""
    named = tokenizer_folder(data.tokenizer, resolved.recipe.model.weights, resolved.recipe_path)
    if named is None:
        byte_tokenizer().save_pretrained(folder)
        return "the byte tokenizer the run read its rows with: ids 0-255 are UTF-8 bytes, 256 ends a document"
    source = tokenizer_file(named).parent  # data.tokenizer may name the folder or its tokenizer.json
    if not (source / TOKENIZER_FILE).is_file():
        raise ConfigError(resolved.recipe_path, "data.tokenizer", data.tokenizer,
                          f"no longer holds the {TOKENIZER_FILE} the run read its rows with ({source})",
                          "restore it, or load the export with the tokenizer you trained with")
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    for name in copied:  # read and written, not linked: the export stands alone
        (folder / name).write_bytes((source / name).read_bytes())
    return f"copied from {source}: {', '.join(copied)}"


def warnings_to(path: Path) -> None:
    """Python warnings of the libraries (torch deprecations, Megatron's Apex/TE fallbacks) into a log file, not the
    terminal: the user asked for an export, not for their advice; errors still reach the terminal. A run directory
    we may not write (a colleague's), or whose log is a link, a FIFO or anything but a file, keeps them in a temporary
    file instead."""
    import tempfile

    try:
        if path.parent.is_symlink():  # RUN/logs pointing elsewhere: nothing is written through it
            raise OSError("logs is a symbolic link")
        path.parent.mkdir(parents=True, exist_ok=True)
        # Appended only to a regular file of its own: never through a link at the name (O_NOFOLLOW), never into a
        # FIFO (O_NONBLOCK: the open fails without a reader instead of waiting for one)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError("not a regular file")
        log = os.fdopen(fd, "a", encoding="utf-8")  # noqa: SIM115 - open for the life of the process
    except OSError:
        log = tempfile.NamedTemporaryFile("a", prefix="layoutlab-export-", suffix=".err", delete=False)  # noqa: SIM115

    def show(message, category, filename, lineno, file=None, line=None):
        log.write(warnings.formatwarning(message, category, filename, lineno, line))
        log.flush()

    warnings.showwarning = show


def main(argv: list[str]) -> int:
    run_dir, step, out, merge = argv
    offline_bitsandbytes()
    warnings_to(RunDir.open(run_dir).logs / "export.err")
    untrusted.guard()
    try:
        print("\n".join(export(run_dir, None if step == "-" else int(step), None if out == "-" else out,
                               merge == "true").lines()))
    except (ConfigError, untrusted.UntrustedFileError, ResumeError) as e:  # the user's to mend: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
