"""`python -m launch export-accelerate (RUN_DIR | recipes/NAME [key=value ...]) [out=DIR]`: a run directory that
Hugging Face Accelerate launches.

It holds the resolved recipe (resolved.json, plan.json, as `run.sh` writes them), the resolved DeepSpeed JSON
(`ds_config.json`), and `accelerate_config.yaml`, whose DeepSpeed plugin points at that JSON with the layout's
machine and process counts. `accelerate launch --config_file DIR/accelerate_config.yaml -m launch.ranks.train DIR` then
trains exactly what `run.sh` trains (tests/dist/test_accelerate.py compares the losses); a user's own Accelerate
script can take the same file. Mixed precision stays in the DeepSpeed JSON (its bf16/fp16 sections): Accelerate
refuses a `mixed_precision` key next to a `deepspeed_config_file`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from launch.commands.args import Option, read, text
from launch.config.resolve import Resolved, resolve_path
from launch.commands.run import check_inputs, check_resume
from launch.config.schema import TOKENIZER_NAMES
from launch.errors import ConfigError, printable
from launch.plan.build import plan_resolved
from launch.run import envinfo, launcher, nodes
from launch.outputs import input_problem, place_problem, write_atomic
from launch.run.rundir import RunDir

CONFIG_NAME = "accelerate_config.yaml"
DS_CONFIG_NAME = "ds_config.json"
USAGE = "usage: python -m launch export-accelerate (RUN_DIR | recipes/NAME [key=value ...]) [out=DIR]"
OPTIONS = (Option("out", "the run directory to create (default runs/<recipe>/<stamp>)", text),)


def accelerate_config(resolved: Resolved, ds_config_path: str, place: nodes.Placement) -> dict:
    """accelerate's own config keys (as `accelerate config` writes them) for this layout."""
    hw = resolved.recipe.hardware
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"deepspeed_config_file": ds_config_path,
                             # ZeRO-3 partitions at construction only when the script asks (deepspeed.zero.Init).
                             "zero3_init_flag": resolved.recipe.parallel.zero_stage == 3},
        "num_machines": hw.nodes,
        "num_processes": resolved.world_size,
        "machine_rank": 0,
        "main_training_function": "main",
        "use_cpu": False,
        "main_process_port": 0,  # accelerate takes a free port: two jobs on one host never share a store
    }
    if hw.nodes > 1:
        config["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"  # torchrun on every node
        config["main_process_ip"] = place.master_addr
        # every machine must arrive at the same one
        config["main_process_port"] = int(place.master_port or nodes.DEFAULT_PORT)
    return config


def export_accelerate(resolved: Resolved, out: Path | None, environ) -> tuple[RunDir, str]:
    """Write the run directory; return it and the command that launches it."""
    import yaml  # accelerate's own dependency, and what it reads the file with

    if not resolved.ds_config:
        raise ConfigError(resolved.recipe_path, "backend", resolved.recipe.backend, "trains without a DeepSpeed engine",
                          "export a recipe whose backend trains through DeepSpeed")
    place = nodes.placement(environ, resolved.recipe.hardware.nodes)  # MASTER_ADDR/PORT, or SLURM's
    if resolved.recipe.hardware.nodes > 1 and not place.master_addr:
        raise ConfigError("environment", "MASTER_ADDR", None, f"is needed for {resolved.recipe.hardware.nodes} nodes "
                          "(accelerate's main_process_ip)", "export MASTER_ADDR=<node 0's address>")
    resolved, data = check_inputs(resolved)  # before the folder exists: bad input is one line, nothing is written
    # Decided here, as run.sh decides (an unfinished run of this configuration, or the one run.resume names), and
    # pinned in the printed command: the ranks Accelerate starts later do not choose again among whatever runs of
    # the recipe exist by then (they resumed another run's finished step-80 checkpoint of a 60-step recipe).
    resumed = None if resolved.recipe.run.resume == "never" else check_resume(resolved, None)
    if out is not None:
        try:  # exclusive: a folder that appeared since the check is never joined
            out.parent.mkdir(parents=True, exist_ok=True)
            out.mkdir()
        except FileExistsError:
            raise ConfigError("command line", "out", str(out), "already exists (nothing is overwritten)",
                              "give a new folder") from None
        run = RunDir.join(out)
    else:
        run = RunDir.create(resolved.recipe_name)
    ds_path = run.root / DS_CONFIG_NAME
    run.write_text_atomic(ds_path, json.dumps(resolved.ds_config, indent=2) + "\n")
    run.write_text_atomic(run.resolved, resolved.to_json() + "\n")
    run.write_text_atomic(run.plan, plan_resolved(resolved, envinfo.machine()).to_json() + "\n")
    if data is not None:
        data.save(run.data, write_atomic)
    config = accelerate_config(resolved, str(ds_path), place)
    header = ("# Written by `python -m launch export-accelerate` for recipe "
              f"{resolved.recipe_name}: {resolved.world_size} process(es) on {resolved.recipe.hardware.nodes} machine(s).\n"
              "# Precision lives in the DeepSpeed JSON. On CPU ranks, Accelerator.num_processes reads 1 under DeepSpeed:\n"
              "# take rank and world size from torch.distributed in your own script.\n")
    run.write_text_atomic(run.root / CONFIG_NAME, header + yaml.safe_dump(config, sort_keys=False))
    env = launcher.rank_env(resolved, str(run.root), environ, resume="" if resumed is None else str(resumed.dir))
    argv = ["accelerate", "launch", "--config_file", str(run.root / CONFIG_NAME), "-m", launcher.TRAIN_MODULE,
            str(run.root)]
    command = launcher.LaunchCommand(tuple(argv), env).shell()
    if resolved.recipe.hardware.nodes > 1:
        command += "    # on node N > 0 also: --machine_rank N"
    run.write_text_atomic(run.launch_cmd, command + "\n")
    return run, command


def cmd_export_accelerate(args: Sequence[str], environ=None) -> int:
    import os

    environ = os.environ if environ is None else environ
    a = read(args, command="export-accelerate", usage=USAGE, options=OPTIONS, positional=(1, 1), overrides=True)
    source, rest, out = a.positional[0], list(a.overrides), a.options["out"]
    if RunDir.is_run_dir(source):
        if rest:
            raise ConfigError("command line", rest[0], rest[0], "overrides a finished run's recipe",
                              "export from the recipe with its overrides instead: " + USAGE)
        resolved = Resolved.load(RunDir.open(source).resolved)
    else:
        resolved = resolve_path(source, rest)
    if out:
        recipe = resolved.recipe  # what the exported run will read: the folder may neither be, lie in nor hold it
        inputs = [Path(p) for p in (source, recipe.model.weights, recipe.data.path, recipe.data.valid_path,
                                  recipe.data.tokenizer if recipe.data.tokenizer not in TOKENIZER_NAMES else None) if p]
        problem = place_problem(Path(out)) or input_problem(Path(out), inputs, folder=True)
        if problem or Path(out).exists():  # checked before any work: nothing of the user's is touched
            raise ConfigError("command line", "out", out, problem or "already exists (nothing is overwritten)",
                              "give a new folder")
    run, command = export_accelerate(resolved, Path(out) if out else None, environ)
    # a path's newline or escape shown as text: it can neither split the line nor recolour the terminal
    print(printable(f"wrote {run.root / CONFIG_NAME} and {run.root / DS_CONFIG_NAME}; launch with:"))
    print(printable(command))
    return 0
