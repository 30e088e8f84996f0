"""`--help` of `python -m launch`, run.sh and sweep.sh and of each subcommand: its usage, an example, its own options
and, for the commands that take a recipe, every recipe key with its type, default and the schema's own comment
(launch/config/reference.py, the source docs/recipes.md is generated from too) and the recipes shipped."""
from __future__ import annotations

import importlib
from typing import Mapping

from launch import REPO_ROOT
from launch.config import reference
from launch.config.reference import REQUIRED, toml_value

# What each subcommand does, and one example of it that runs as written from the repository root.
ABOUT = {
    "run": ("resolve, plan and train a recipe (what launch/run.sh runs)",
            "bash launch/run.sh recipes/tiny_zero2 parallel.zero_stage=3 --dry-run"),
    "plan": ("memory and step time of every layout of a model on N GPUs, as a table and a chart",
             "python -m launch plan model=llama-2-7b world_size=4,8 hardware=h100-sxm"),
    "calibrate": ("measure this machine for the planner (writes a calibration file)",
                  "python -m launch calibrate recipes/tiny_zero2 iters=5"),
    "recommend": ("every layout of a recipe's model on its devices, ranked; verify=true runs the best",
                  "python -m launch recommend recipes/tiny_zero2 top=5"),
    "sweep": ("a set of recipes held equal, run one after another, then one report (what launch/sweep.sh runs)",
              "bash launch/sweep.sh recipes/tiny_zero2 recipes/tiny_tp2_zero3 --dry-run"),
    "export": ("a run's checkpoint as a Hugging Face safetensors folder",
               "python -m launch export runs/tiny_zero2/<stamp> step=10 out=exported/"),
    "export-accelerate": ("a run directory and the command for `accelerate launch`",
                          "python -m launch export-accelerate recipes/tiny_zero2"),
    "prepare-data": ("tokenize a corpus once into Megatron's indexed format (data.source=megatron)",
                     "python -m launch prepare-data tests/fixtures/text/corpus.jsonl out=data/corpus "
                     "data.tokenizer=tests/fixtures/tokenizer"),
    "rehearse": ("the recipe's own training step at its real shapes on this CPU (fake process group, fake tensors), "
                 "its memory, FLOPs and collectives beside the plan's",
                 "python -m launch rehearse recipes/7b_fsdp2"),
    "docs": ("write the generated docs: the field table from the schema, the recipe index and each recipe's numbers",
             "python -m launch docs check=true"),
}
TAKES_A_RECIPE = ("run", "sweep", "recommend", "calibrate", "export-accelerate", "rehearse")


def overview(commands: Mapping[str, str]) -> str:
    """`python -m launch --help`: every subcommand with the first line of its module's docstring."""
    lines = ["usage: python -m launch COMMAND [arguments]   (COMMAND --help for its keys)", ""]
    lines += [f"  {name:<18} {ABOUT[name][0]}" for name in commands]
    lines += ["", f"recipes: {', '.join(recipe_names())}", "",
              "Every error is one line naming the file, the field, the value and the fix, and exits 2."]
    return "\n".join(lines)


def command_help(name: str, module_name: str) -> str:
    module = importlib.import_module(f"launch.commands.{module_name}")
    lines = [getattr(module, "USAGE", ""), f"example: {ABOUT[name][1]}"]
    options = getattr(module, "OPTIONS", ())
    if options:
        lines += ["", "options:"] + [f"  {o.name + '=':<26} {o.doc}" for o in options]
    if name in TAKES_A_RECIPE:
        lines += ["", f"recipes: {', '.join(recipe_names())}", "",
                  "recipe keys (override any as section.key=value; docs/recipes.md has the same table):"]
        section = None
        for f in reference.fields():
            if f.section != section:
                section = f.section
                lines.append(f"  [{section}]" if section else "  (top level)")
            default = "required" if f.default is REQUIRED else "unset" if f.default is None else toml_value(f.default)
            lines.append(f"    {f.dotted:<34} {f.type} = {default}" + (f"  -- {f.doc}" if f.doc else ""))
    return "\n".join(lines)


def recipe_names() -> list[str]:
    """The recipes shipped beside the package (recipes/<name>/recipe.toml)."""
    folder = REPO_ROOT / "recipes"
    return sorted(p.name for p in folder.iterdir() if (p / "recipe.toml").is_file()) if folder.is_dir() else []
