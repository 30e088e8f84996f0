"""`python -m launch plan model=llama-2-7b[,llama-3.1-8b ...] world_size=4,8 hardware=h100-sxm [out=plans/NAME] ...`

Compares layouts of models on GPU counts (the seed's "7B on 4 GPUs, then raise the GPU count"): every
t × d × ZeRO stage (× activation checkpointing) that the backend builds for each model (each layout goes through the
resolver, as `recommend`'s do, with sequence parallelism where the backend builds it), stacked memory bars per layout
against the device-memory line, green where the plan fits and red where it does not. Writes a JSON of the numbers, an
HTML page whose two selectors (model, GPU count) show the bars of one pair at a time (launch/commands/plan_page.py),
and a PNG of the first model's bars (launch/commands/plan_figure.py).
"""
from __future__ import annotations

import json
import typing
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from launch.commands import render
from launch.commands.args import Option, choice, choice_list, distinct, read, text, text_list, whole, whole_list
from launch.commands.plan_figure import chart_png, ours
from launch.commands.plan_page import render_page
from launch.commands.render import make_console
from launch.config.backends import BACKENDS, BackendTraits, traits
from launch.config.calibration import newest_for
from launch.config.hardware import is_profile_path, load_profile
from launch.config.models import load_model
from launch.config.resolve import Resolved, resolve
from launch.config.schema import (
    BatchSection,
    HardwareSection,
    LoadedRecipe,
    ModelSection,
    PeftSection,
    PrecisionSection,
    Recipe,
    TrainSection,
    with_overrides,
)
from launch.errors import ConfigError
from launch.plan.build import make_plan
from launch.plan.layout import Layout, Plan
from launch.run import envinfo
from launch.outputs import file_problem, write_bytes_atomic, write_text_atomic
from launch.run.rundir import runs_root

USAGE = ("usage: python -m launch plan [key=value ...]  "
         "(e.g. model=llama-2-7b,llama-3.1-8b world_size=4,8 hardware=h100-sxm)")
DTYPES = typing.get_args(typing.get_type_hints(PrecisionSection)["dtype"])
AC_POLICIES = typing.get_args(typing.get_type_hints(TrainSection)["activation_checkpointing"])
PEFT_METHODS = typing.get_args(typing.get_type_hints(PeftSection)["method"])
OPTIONS = (
    Option("model", "catalogue model names, comma separated (default llama-2-7b)", text_list, ("llama-2-7b",)),
    Option("world_size", "GPU counts (world sizes), comma separated (default 4)", distinct(whole_list(1, 1_000_000)),
           (4,)),
    Option("hardware", "hardware profile (default h100-sxm)", text, "h100-sxm"),
    Option("gpus_per_node", "devices per node (default 8, or the GPU count when smaller)", whole(1, 1_000_000)),
    Option("backend", f"{' | '.join(BACKENDS)} (default deepspeed): the layouts it builds, with sequence parallelism "
           f"where it has it ({', '.join(n for n, b in BACKENDS.items() if 'sp' in b.features)})",
           choice(*BACKENDS), "deepspeed"),
    Option("dtype", f"{' | '.join(DTYPES)} (default bf16)", choice(*DTYPES), "bf16"),
    Option("seq_len", "tokens per sequence (default 4096)", whole(1, 1 << 24), 4096),
    Option("micro_batch_size", "default 1", whole(1, 1 << 20), 1),
    Option("global_batch_size", "default 8 × the largest GPU count", whole(1, 1 << 40)),
    Option("activation_checkpointing", f"policies to compare, comma separated, of {', '.join(AC_POLICIES)} "
           "(default none,full)", choice_list(*AC_POLICIES), ("none", "full")),
    Option("peft", f"{' | '.join(PEFT_METHODS)} (default none): plan a fine-tune's adapters (peft's defaults: rank "
           f"{PeftSection.rank} on every linear layer of the blocks), on the layouts the backend trains them with",
           choice(*PEFT_METHODS), "none"),
    Option("out", "output path without suffix: .png, .html and .json are added "
           "(default runs/plans/<model>[+<model>...]_<hardware>)", text),
)
# The recipe field behind each option, for the resolver's refusals of what the command line asked for as a whole.
OPTION_OF_FIELD = {"model.name": "model", "hardware.profile": "hardware", "backend": "backend",
                   "peft.method": "peft", "precision.dtype": "dtype", "batch.seq_len": "seq_len", "batch.micro_batch_size": "micro_batch_size",
                   "train.activation_checkpointing": "activation_checkpointing"}


@dataclass(frozen=True)
class Row:
    world_size: int
    label: str
    plan: Plan
    layout: Layout

    @property
    def model(self) -> str:
        return self.layout.model.name


def layouts(opts: Mapping[str, Any]) -> list[Row]:
    """Every layout of each of the options' models on each world size, model by model in the order given;
    `opts` as commands.args.read returns them."""
    models = [load_model(name=name, context="command line") for name in opts["model"]]
    named = opts["hardware"]
    nominal = load_profile(named, context="command line", field="hardware") if not is_profile_path(named) else None
    hw = nominal or load_profile(named, context="command line", field="hardware", path=Path(named))
    gpu_counts = opts["world_size"]
    backend = opts["backend"]
    bt = traits(backend, where="command line")
    dtype = opts["dtype"]
    if not hw.supports(dtype):
        raise ConfigError("command line", "dtype", dtype, f"is not supported by {hw.device}",
                          f"use dtype={'fp16' if hw.supports('fp16') else 'fp32'}")
    policies = opts["activation_checkpointing"]
    seq, micro = opts["seq_len"], opts["micro_batch_size"]
    gbs = opts["global_batch_size"] or 8 * max(gpu_counts)
    machine = envinfo.machine()
    for gpus in gpu_counts:  # every world size checked before any model is planned
        gpn = opts["gpus_per_node"] or min(8, gpus)
        if gpus % gpn:
            raise ConfigError("command line", "world_size", gpus, f"is not a multiple of gpus_per_node={gpn}",
                              "choose world sizes of whole nodes")
    rows: list[Row] = []
    for model in models:
        for gpus in gpu_counts:
            gpn = opts["gpus_per_node"] or min(8, gpus)
            timed = _newest_calibration(nominal, machine, gpus, gpn, model.name, dtype, seq) if nominal else None
            recipe = Recipe(backend=backend, batch=BatchSection(micro, gbs, seq), model=ModelSection(name=model.name),
                            precision=PrecisionSection(dtype=dtype), peft=PeftSection(method=opts["peft"]),
                            hardware=HardwareSection(gpus // gpn, gpn, str(timed) if timed else named))
            # Every field is the command line's: the resolver's refusals name it (paths resolve from the cwd).
            loaded = LoadedRecipe("plan", Path("command line"), recipe, MappingProxyType({}), (), ())
            for tp in [t for t in (1, 2, 4, 8) if t <= min(gpus, gpn) and gpus % t == 0]:
                dp = gpus // tp
                for z in bt.zero_stages:
                    built = [r for r in (_resolved(loaded, bt, tp, z, rc) for rc in policies) if r is not None]
                    for res in built:
                        rc = res.recipe.train.activation_checkpointing
                        name = ("DP" if z == 0 and tp == 1 else f"ZeRO-{z}" if tp == 1 else
                                f"TP{tp}" if dp == 1 else f"TP{tp}×" + ("DP" if z == 0 else f"ZeRO-{z}")
                                + f" (dp{dp})")
                        if rc != "none":
                            name += f" +AC({rc})"
                        if opts["peft"] != "none":
                            name += f" {opts['peft']}"
                        lay = Layout.from_resolved(res)
                        rows.append(Row(gpus, name, make_plan(lay, name, machine), lay))
                    if dp == 1 and built:
                        break  # one data-parallel rank: every ZeRO stage holds the same; the first the backend builds
    return rows


def _resolved(loaded: LoadedRecipe, bt: BackendTraits, tp: int, zero: int, ac: str) -> Resolved | None:
    """The layout as the resolver accepts it: with sequence parallelism where the backend builds it at this tp and
    ZeRO stage, else without. None: refused for its own fields (parallel.*, or the global batch its dp must divide);
    a refusal of what the command line asked for as a whole (a dtype or checkpointing policy the backend lacks) is
    raised, named as the option."""
    sps = (True, False) if tp > 1 and "sp" in bt.features else (False,)
    for sp in sps:
        try:
            return resolve(with_overrides(loaded, (f"parallel.tp={tp}", f"parallel.zero_stage={zero}",
                                                   f"parallel.sp={str(sp).lower()}",
                                                   f"train.activation_checkpointing={ac}")))
        except ConfigError as e:
            if sp or e.field.startswith("parallel.") or e.field == "batch.global_batch_size":
                continue
            option = OPTION_OF_FIELD.get(e.field, e.field)
            fix = e.fix
            for field, name in OPTION_OF_FIELD.items():
                fix = fix.replace(field, name)
            raise ConfigError("command line", option, e.value, e.problem, fix) from None
    return None


def _newest_calibration(nominal, machine, world_size: int, gpus_per_node: int, model: str, dtype: str,
                        seq_len: int) -> Path | None:
    """The calibration `calibrate` left for this machine at this world size, model and shape (the one time source
    run.sh and recommend use, launch/run/timesource.py), announced; None: the nominal profile times it."""
    newest = newest_for(runs_root(), machine_kind=machine.kind, versions=machine.versions, base_profile=nominal.name,
                        world_size=world_size, ranks_per_node=gpus_per_node, model=model, dtype=dtype, seq_len=seq_len)
    if newest.path is not None:
        print(f"world size {world_size}: timed with {newest.path}, the newest calibration of this machine for it")
    return newest.path


def _title(model: str, first: Layout) -> str:
    return (f"{model} on {first.hardware.name}: memory per GPU by layout\n"
            f"(seq {first.seq_len}, micro-batch {first.micro_batch_size}, {first.dtype}, {first.backend})")


def cmd_plan(args: Sequence[str]) -> int:
    opts = read(args, command="plan", usage=USAGE, options=OPTIONS).options
    rows = layouts(opts)
    if not rows:
        raise ConfigError("command line", "global_batch_size", opts["global_batch_size"],
                          "admits no layout (it must divide by micro_batch_size × dp)", "choose a multiple of the GPU count")
    models = opts["model"]
    first = rows[0].layout
    # The whole model names: a suffix swap would cut llama-3.1-8b at its dot.
    stem = opts["out"] or str(runs_root() / "plans" / f"{'+'.join(models)}_{first.hardware.name}")
    if Path(stem).is_dir() or stem.endswith(("/", ".")):
        raise ConfigError("command line", "out", stem, "names a folder, not a file name",
                          f"give a name in it, e.g. out={Path(stem) / 'plan'} (.png, .html and .json are added)")
    html_path, json_path = (Path(f"{stem}.{ext}") for ext in ("html", "json"))
    # A static chart per model, each readable at its size (STEM.png for one model, STEM_MODEL.png for several); the
    # page shows every model.
    charted = [m for m in models if any(r.model == m for r in rows)]
    pngs = {m: Path(f"{stem}.png") if len(models) == 1 else Path(f"{stem}_{m}.png") for m in charted}
    for path in (*pngs.values(), html_path, json_path):  # every file checked before any is written
        problem = file_problem(path, ours=ours, writer="`python -m launch plan`")
        if problem:
            raise ConfigError("command line", "out", opts["out"] or stem, f"{path} {problem}",
                              "choose another out= (.png, .html and .json are added to it)")
    html_path.parent.mkdir(parents=True, exist_ok=True)
    for model, png_path in pngs.items():
        mine = [r for r in rows if r.model == model]
        write_bytes_atomic(png_path, chart_png(mine, _title(model, mine[0].layout)))
    write_text_atomic(html_path, render_page(rows, models, opts["world_size"],
                                             _title(" · ".join(models), first)))
    write_text_atomic(json_path, json.dumps(
        [{"model": r.model, "world_size": r.world_size, "layout": r.label, "plan": json.loads(r.plan.to_json())}
         for r in rows], indent=1))
    console = make_console()
    for model in models:
        mine = [r for r in rows if r.model == model]
        if mine:
            render.layouts_table(mine, _title(model, mine[0].layout), console)
        else:
            console.print(f"{model}: no layout on these GPU counts (global batch size {first.global_batch_size} must "
                          f"divide by micro_batch_size × dp)", soft_wrap=True)
    console.print(f"wrote {', '.join(map(str, pngs.values()))}, {html_path}, {json_path}", soft_wrap=True)
    return 0
