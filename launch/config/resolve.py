"""Resolution: recipe + DeepSpeed base + overrides + world size → one frozen `Resolved`.

This is the one place where defaults are derived and cross-field rules are checked. Everything
downstream (planner, launcher, trainers, report) reads `resolved.json`, never the recipe.
"""
from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from launch import inputs
from launch.comm import commbench_spec
from launch.config import adapters, commbench, dsconfig
from launch.config.backends import BACKENDS, BackendTraits, traits
from launch.config.grid import RankGrid, divisors
from launch.config.hardware import HardwareProfile, is_profile_path, load_profile
from launch.config.models import ModelSpec, load_model
from launch.config.schema import (
    ADAM_EPS,
    TOKENIZER_NAMES,
    LoadedRecipe,
    Recipe,
    check_bounds,
    from_dict,
    load_recipe,
    to_dict,
)
from launch.errors import ConfigError

SCHEMA_VERSION = 1

Where = Callable[[str], str]  # a dotted field -> the file (or override) that set it


@dataclass(frozen=True)
class Resolved:
    recipe_name: str
    recipe_path: str
    chain: tuple[str, ...]
    overrides: tuple[str, ...]
    recipe: Recipe  # parallel.dp is always an int here
    model: ModelSpec
    hardware: HardwareProfile
    grid: RankGrid
    grad_accum: int
    ds_config: Mapping[str, Any]  # the DeepSpeed engine's config (both backends train through one)
    ds_base: str
    warnings: tuple[str, ...]
    schema_version: int = SCHEMA_VERSION
    # sha256 of the corpus the data check read (launch/data/check.py), set before launch; None for synthetic data.
    # A checkpoint continues only a run that reads the same rows: the path alone would not see the file change.
    data_fingerprint: str | None = None
    # launch.inputs.weights_fingerprint of model.weights, set before launch of a fine-tune: its checkpoints hold the
    # adapters alone, which continue only on the base they were trained on, wherever that folder now lies.
    weights_fingerprint: str | None = None

    @property
    def world_size(self) -> int:
        return self.grid.world

    @property
    def tokens_per_step(self) -> int:
        return self.recipe.batch.global_batch_size * self.recipe.batch.seq_len

    def to_json(self) -> str:
        return json.dumps({
            "schema_version": self.schema_version,
            "recipe_name": self.recipe_name,
            "recipe_path": self.recipe_path,
            "chain": list(self.chain),
            "overrides": list(self.overrides),
            "recipe": to_dict(self.recipe),
            "model": self.model.to_dict(),
            "hardware": self.hardware.to_dict(),
            "grid": self.grid.to_dict(),
            "world_size": self.world_size,
            "grad_accum": self.grad_accum,
            "ds_config": self.ds_config,
            "ds_base": self.ds_base,
            "warnings": list(self.warnings),
            "data_fingerprint": self.data_fingerprint,
            "weights_fingerprint": self.weights_fingerprint,
        }, indent=2)

    @classmethod
    def from_json(cls, text: str, *, source: str = "resolved.json") -> "Resolved":
        try:
            d = json.loads(text)
            version = d.get("schema_version")
        except (ValueError, AttributeError, RecursionError) as e:  # cut short, not JSON, not an object, nested past any parser
            raise ConfigError(source, "(contents)", f"{type(e).__name__}: {e}", f"are damaged ({len(text)} characters)",
                              "use an intact copy of the run directory, or resolve the recipe again") from None
        if version != SCHEMA_VERSION:
            raise ConfigError(source, "schema_version", d.get("schema_version"),
                              f"is not {SCHEMA_VERSION}, the version this code reads",
                              "re-resolve the recipe with this checkout (run.sh --dry-run shows it)")
        try:
            return cls._from_dict(d)
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # a field missing or of the wrong kind
            raise ConfigError(source, "(contents)", f"{type(e).__name__}: {e}", "are damaged",
                              "use an intact copy of the run directory, or resolve the recipe again") from None

    @classmethod
    def _from_dict(cls, d: dict) -> "Resolved":
        hardware, grid = HardwareProfile.from_dict(d["hardware"]), RankGrid.from_dict(d["grid"])
        for section, record in (("hardware", hardware), ("grid", grid)):
            _check_kinds(record, section)
        return cls(
            recipe_name=d["recipe_name"], recipe_path=d["recipe_path"], chain=tuple(d["chain"]),
            overrides=tuple(d["overrides"]), recipe=from_dict(Recipe, d["recipe"]),
            model=ModelSpec.from_dict(d["model"]), hardware=hardware, grid=grid, grad_accum=d["grad_accum"], ds_config=d["ds_config"],
            ds_base=d["ds_base"], warnings=tuple(d["warnings"]), schema_version=d["schema_version"],
            data_fingerprint=d.get("data_fingerprint"), weights_fingerprint=d.get("weights_fingerprint"),
        )

    @classmethod
    def load(cls, path: str | Path) -> "Resolved":
        problem = inputs.not_a_file(Path(path))  # looked at first: a FIFO in a run directory would hang the read
        if problem:
            raise ConfigError(str(path), "(file)", str(path), problem, "use an intact copy of the run directory")
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(str(path), "(file)", str(path), f"cannot be read ({type(e).__name__})",
                              "use an intact copy of the run directory") from None
        return cls.from_json(text, source=str(path))


def _check_kinds(record: Any, section: str) -> None:
    """A record read back from resolved.json holds numbers where its fields are numbers and text where they are
    text (`"memory_bytes": "80GB"` failed far away, multiplying a string); raises TypeError naming the field."""
    hints = typing.get_type_hints(type(record))
    for f in dataclasses.fields(record):
        value, kind = getattr(record, f.name), hints[f.name]
        if kind is int:
            ok = type(value) is int
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif kind is str:
            ok = isinstance(value, str)
        else:
            continue
        if not ok:
            raise TypeError(f"{section}.{f.name}={value!r} is not {kind.__name__}")


def resolve_path(path: str | Path, overrides: Sequence[str] = (), world_size: int | None = None) -> Resolved:
    return resolve(load_recipe(path, overrides), world_size)


def resolve(loaded: LoadedRecipe, world_size: int | None = None) -> Resolved:
    """Each section's rules in a fixed order (the first broken one is the error), then the fields derived from them."""
    r, w = loaded.recipe, loaded.where
    _check_model_source(r, w)
    paths = _absolute_paths(loaded)
    resume = _resume(loaded)
    model = _model(loaded, paths)
    hw = _hardware(loaded)
    check_bounds(r, w)
    _check_restarts(r, w)
    _check_real_ranges(r, w)
    dp = _layout(r, w, world_size, model)
    bt = traits(r.backend, where=w("backend"))
    _check_parallel(r, w, bt, dp)
    grad_accum = _grad_accum(r, w, dp)
    _check_offload(r, w, hw)
    _check_backend(r, w, bt, model)
    _check_precision(loaded, hw, bt)
    _check_gpu_features(r, w, hw)
    _check_peft(r, w, bt, model)
    _check_data(r, w)
    if bt.check is not None:
        bt.check(w, r, model, grad_accum)

    grid = RankGrid(r.parallel.tp, r.parallel.pp, dp, r.hardware.gpus_per_node, r.hardware.nodes)
    recipe = _completed(r, paths, resume, dp, hw)
    if r.run.mode == "commbench":
        commbench.check(w, recipe.commbench, r.commbench.max_bytes, grid, hw)
    # The deepspeed backend, and the megatron backend except at its distributed optimizer's stage, train through a
    # DeepSpeed engine (ZeRO over the data-parallel group).
    ds_config, ds_base = (_deepspeed_config(loaded, recipe, grad_accum, hw, model)
                          if bt.uses_deepspeed(r.parallel.zero_stage) else ({}, ""))
    return Resolved(
        recipe_name=loaded.name, recipe_path=str(loaded.path), chain=loaded.chain, overrides=loaded.overrides,
        recipe=recipe, model=model, hardware=hw, grid=grid, grad_accum=grad_accum, ds_config=ds_config,
        ds_base=ds_base, warnings=_warnings(r, model, bt),
    )


def _check_model_source(r: Recipe, w: Where) -> None:
    if (r.model.name is None) == (r.model.config is None):
        raise ConfigError(w("model.name"), "model.name", r.model.name,
                          "and model.config: exactly one must be set",
                          "set model.name to a catalogue model or model.config to a config.json path")


def _absolute_paths(loaded: LoadedRecipe) -> dict[str, str]:
    """The path fields that are set, by dotted name, made absolute here, so that resolved.json means the same from any
    directory."""
    r, w = loaded.recipe, loaded.where
    paths = {}
    for dotted, value in (("model.config", r.model.config), ("model.weights", r.model.weights),
                          ("data.path", r.data.path), ("data.valid_path", r.data.valid_path),
                          ("data.tokenizer", None if r.data.tokenizer in TOKENIZER_NAMES else r.data.tokenizer),
                          ("deepspeed.config", r.deepspeed.config)):
        if value is not None and not value.strip():
            raise ConfigError(w(dotted), dotted, value, "is an empty path", f"give a path, or leave {dotted} unset")
        if value:
            paths[dotted] = str(loaded.path_of(dotted, value))
    return paths


def _resume(loaded: LoadedRecipe) -> str:
    """run.resume: auto, never, or a run directory or checkpoint to continue, named (made absolute)."""
    resume = loaded.recipe.run.resume
    if resume in ("auto", "never"):
        return resume
    if resume.strip().lower() in ("auto", "never") or not resume.strip() or "\0" in resume:
        raise ConfigError(loaded.where("run.resume"), "run.resume", resume, "is neither auto, never nor a path",
                          "set run.resume=auto, never, or the run directory to continue")
    return str(loaded.path_of("run.resume", resume))


def _model(loaded: LoadedRecipe, paths: Mapping[str, str]) -> ModelSpec:
    m, w = loaded.recipe.model, loaded.where
    if m.name is not None:
        model = load_model(name=m.name, context=w("model.name"))
    else:
        model = load_model(config_path=paths["model.config"], context=w("model.config"))
    if m.weights and not Path(paths["model.weights"]).is_dir():
        raise ConfigError(w("model.weights"), "model.weights", m.weights, f"is not a folder ({paths['model.weights']})",
                          "give a local Hugging Face model folder (config.json + *.safetensors), relative to the recipe")
    return model


def _hardware(loaded: LoadedRecipe) -> HardwareProfile:
    profile = loaded.recipe.hardware.profile
    return load_profile(profile, context=loaded.where("hardware.profile"),
                        path=loaded.path_of("hardware.profile", profile) if is_profile_path(profile) else None)


def _check_restarts(r: Recipe, w: Where) -> None:
    if r.run.max_restarts > 0 and r.run.launcher != "torchrun":
        raise ConfigError(w("run.max_restarts"), "run.max_restarts", r.run.max_restarts,
                          f"needs torchrun's elastic agent; run.launcher={r.run.launcher} does not restart workers",
                          "set run.launcher=torchrun, or run.max_restarts=0")
    if r.run.max_restarts > 0 and r.run.resume != "auto":
        raise ConfigError(w("run.max_restarts"), "run.max_restarts", r.run.max_restarts,
                          "restarts training from step 0 each time with run.resume=never",
                          "set run.resume=auto (restarted ranks continue from the last complete checkpoint)")


def _check_real_ranges(r: Recipe, w: Where) -> None:
    """The fit check's headroom and the optimizer's numbers (whole-number fields carry their bounds in the schema)."""
    t = r.train
    for dotted, ok, want in [
        ("plan.headroom", 0.0 <= r.plan.headroom < 1.0, "a fraction in [0, 1), e.g. 0.1"),
        ("train.lr", 0 < t.lr < math.inf, "a positive, finite learning rate"),
        ("train.min_lr", 0 <= t.min_lr <= t.lr, f"between 0 and train.lr={t.lr:g}"),
        ("train.grad_clip", 0 <= t.grad_clip < math.inf, "0 (off) or a positive, finite norm"),
        ("train.weight_decay", 0 <= t.weight_decay < math.inf, "0 or more, finite"),
        ("train.adam_beta1", 0 <= t.adam_beta1 < 1, "in [0, 1), e.g. 0.9"),
        ("train.adam_beta2", 0 <= t.adam_beta2 < 1, "in [0, 1), e.g. 0.95"),
    ]:
        if not ok:
            value = getattr(r.plan if dotted.startswith("plan") else t, dotted.split(".")[1])
            raise ConfigError(w(dotted), dotted, value, "is out of range", f"set {dotted} to {want}")


def _layout(r: Recipe, w: Where, world_size: int | None, model: ModelSpec) -> int:
    """The ZeRO stage, tp × pp × dp over the machine and the model's split by it; returns dp."""
    par, hw_s = r.parallel, r.hardware
    if par.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(w("parallel.zero_stage"), "parallel.zero_stage", par.zero_stage, "is not a ZeRO stage",
                          "set parallel.zero_stage to 0, 1, 2 or 3")

    # World size: nodes × gpus_per_node is the machine; tp × pp × dp must fill it.
    machine = hw_s.nodes * hw_s.gpus_per_node
    world = machine if world_size is None else world_size
    if world != machine:
        raise ConfigError(w("hardware.gpus_per_node"), "hardware.gpus_per_node", hw_s.gpus_per_node,
                          f"× hardware.nodes={hw_s.nodes} = {machine} does not match the world size {world}",
                          f"set hardware.nodes × hardware.gpus_per_node = {world}")
    tp_pp = par.tp * par.pp
    if world % tp_pp:
        raise ConfigError(w("parallel.tp"), "parallel.tp", par.tp,
                          f"× parallel.pp={par.pp} = {tp_pp} does not divide the world size {world}",
                          "choose tp × pp that divides nodes × gpus_per_node")
    dp = world // tp_pp
    if par.dp != "auto" and par.dp != dp:
        raise ConfigError(w("parallel.dp"), "parallel.dp", par.dp,
                          f"disagrees with world {world} / (tp {par.tp} × pp {par.pp}) = {dp}",
                          f'set parallel.dp={dp} or parallel.dp="auto"')

    # Divisibility of the model by the layout.
    for size, what in ((model.num_heads, f"{model.num_heads} attention heads"),
                       (model.num_kv_heads, f"{model.num_kv_heads} KV heads"),
                       (model.intermediate_size, f"MLP width {model.intermediate_size}")):
        if size % par.tp:
            raise ConfigError(w("parallel.tp"), "parallel.tp", par.tp, f"does not divide the {what} of {model.name}",
                              f"choose tp among {_divisors(size)}")
    stages = par.pp * par.vpp
    if model.num_layers % stages:
        raise ConfigError(w("parallel.pp"), "parallel.pp", par.pp,
                          f"× parallel.vpp={par.vpp} = {stages} does not divide the {model.num_layers} layers of {model.name}",
                          f"choose pp × vpp among {_divisors(model.num_layers)}")
    return dp


def _check_parallel(r: Recipe, w: Where, bt: BackendTraits, dp: int) -> None:
    """Sequence parallelism, the features only some backends have, hpZ and the interleaved pipeline."""
    par, batch = r.parallel, r.batch
    if par.sp and par.tp == 1:
        raise ConfigError(w("parallel.sp"), "parallel.sp", True, "needs parallel.tp > 1 (got 1)",
                          "set parallel.tp=2 or parallel.sp=false")
    if par.sp and batch.seq_len % par.tp:
        raise ConfigError(w("batch.seq_len"), "batch.seq_len", batch.seq_len,
                          f"is not divisible by parallel.tp={par.tp}; sequence parallelism splits the sequence over tp",
                          f"set batch.seq_len to a multiple of {par.tp}")
    _check_features(r, w, bt)
    hpz = par.zero_hpz_partition_size
    if hpz > 1:
        # DeepSpeed forms the secondary groups of `hpz` consecutive global ranks (groups._create_zero_param_parallel_
        # group): they are data-parallel peers only without tensor or pipeline parallelism. The torch backend's hybrid
        # sharding groups data-parallel peers on its mesh, whatever tp and pp are.
        for ok, problem, fix in [
            (par.zero_stage == 3, f"needs parallel.zero_stage=3 (got {par.zero_stage}); hpZ partitions ZeRO-3's "
                                  "parameters", "set parallel.zero_stage=3 or parallel.zero_hpz_partition_size=1"),
            (par.tp == 1 and par.pp == 1 or not bt.uses_deepspeed(par.zero_stage),
             f"needs tp = pp = 1 (got tp={par.tp}, pp={par.pp}): DeepSpeed groups consecutive ranks",
             "set parallel.zero_hpz_partition_size=1 with tp or pp, or backend = \"torch\" (FSDP2's hybrid sharding)"),
            (dp % hpz == 0, f"does not divide the data-parallel size {dp}",
             f"set parallel.zero_hpz_partition_size to a divisor of {dp}, normally hardware.gpus_per_node"),
        ]:
            if not ok:
                raise ConfigError(w("parallel.zero_hpz_partition_size"), "parallel.zero_hpz_partition_size", hpz,
                                  problem, fix)
    if par.vpp > 1 and par.pp == 1:
        raise ConfigError(w("parallel.vpp"), "parallel.vpp", par.vpp, "needs parallel.pp > 1 (got 1)",
                          "set parallel.pp=2 or parallel.vpp=1")


def _check_features(r: Recipe, w: Where, bt: BackendTraits) -> None:
    """Features that only some backends have (launch/config/backends.py)."""
    par, train, run = r.parallel, r.train, r.run
    with_feature = {f: sorted(n for n, b in BACKENDS.items() if f in b.features)
                    for f in ("pp", "sp", "vpp", "selective", "every_other_block", "hpz", "compile", "async_checkpoint")}
    ac = train.activation_checkpointing
    for dotted, value, feature, used, off in [("parallel.pp", par.pp, "pp", par.pp > 1, "1"),
                                              ("parallel.sp", par.sp, "sp", par.sp, "false"),
                                              ("parallel.vpp", par.vpp, "vpp", par.vpp > 1, "1"),
                                              ("train.activation_checkpointing", ac, "selective", ac == "selective",
                                               '"full"'),
                                              ("train.activation_checkpointing", ac, "every_other_block",
                                               ac == "every_other_block", '"full"'),
                                              ("parallel.zero_hpz_partition_size", par.zero_hpz_partition_size, "hpz",
                                               par.zero_hpz_partition_size > 1, "1"),
                                              ("train.compile", train.compile, "compile", train.compile, "false"),
                                              ("run.checkpoint_async", run.checkpoint_async, "async_checkpoint",
                                               run.checkpoint_async, "false")]:
        if used and feature not in bt.features:
            others = " or ".join(f'backend = "{n}"' for n in with_feature[feature])
            why = f": {bt.why_not[feature]}" if feature in bt.why_not else ""
            raise ConfigError(w(dotted), dotted, value, f'needs {others} (got "{r.backend}"{why})',
                              f"set {dotted}={off} or {others}")


def _grad_accum(r: Recipe, w: Where, dp: int) -> int:
    """Micro-batches per step: the global batch over micro_batch_size × dp; and the steps that are measured."""
    par, batch, train = r.parallel, r.batch, r.train
    per_step = batch.micro_batch_size * dp
    if batch.global_batch_size % per_step:
        raise ConfigError(w("batch.global_batch_size"), "batch.global_batch_size", batch.global_batch_size,
                          f"is not divisible by micro_batch_size {batch.micro_batch_size} × dp {dp} = {per_step}",
                          f"set batch.global_batch_size to a multiple of {per_step}")
    grad_accum = batch.global_batch_size // per_step
    if par.vpp > 1 and grad_accum % par.pp:
        # Megatron's interleaved schedule runs micro-batches in groups of pp per model chunk; a short last
        # group would wait on itself (schedules.py refuses it).
        raise ConfigError(w("batch.global_batch_size"), "batch.global_batch_size", batch.global_batch_size,
                          f"gives {grad_accum} micro-batches per step (global / (micro_batch_size {batch.micro_batch_size} "
                          f"× dp {dp})); the interleaved schedule (parallel.vpp={par.vpp}) needs a multiple of "
                          f"parallel.pp={par.pp}",
                          f"set batch.global_batch_size to a multiple of {per_step * par.pp}, or parallel.vpp=1")
    if train.warmup_steps >= train.steps:
        raise ConfigError(w("train.warmup_steps"), "train.warmup_steps", train.warmup_steps,
                          f"leaves no measured step out of train.steps={train.steps}",
                          f"set train.warmup_steps below {train.steps}")
    return grad_accum


def _check_offload(r: Recipe, w: Where, hw: HardwareProfile) -> None:
    par = r.parallel
    if par.offload_params != "none" and par.zero_stage != 3:
        raise ConfigError(w("parallel.offload_params"), "parallel.offload_params", par.offload_params,
                          f"needs parallel.zero_stage=3 (got {par.zero_stage})",
                          'set parallel.zero_stage=3 or parallel.offload_params="none"')
    if par.offload_optimizer != "none" and par.zero_stage == 0:
        raise ConfigError(w("parallel.offload_optimizer"), "parallel.offload_optimizer", par.offload_optimizer,
                          "needs parallel.zero_stage >= 1 (got 0)",
                          'set parallel.zero_stage=2 or parallel.offload_optimizer="none"')
    if "nvme" in (par.offload_optimizer, par.offload_params):
        nvme_field = "parallel.offload_optimizer" if par.offload_optimizer == "nvme" else "parallel.offload_params"
        if par.zero_stage != 3:
            raise ConfigError(w("parallel.zero_stage"), "parallel.zero_stage", par.zero_stage,
                              f"must be 3 for NVMe offload ({nvme_field}=\"nvme\", ZeRO-Infinity)",
                              "set parallel.zero_stage=3")
        if hw.device_type == "cpu":
            raise ConfigError(w(nvme_field), nvme_field, "nvme",
                              "needs a GPU machine; DeepSpeed's async I/O swaps to GPU memory",
                              f'use hardware.profile for your GPU or {nvme_field}="cpu"')
        if not par.nvme_path.startswith("/"):
            raise ConfigError(w("parallel.nvme_path"), "parallel.nvme_path", par.nvme_path,
                              "must be an absolute path on a local NVMe drive", "set e.g. parallel.nvme_path=\"/local_nvme\"")


def _check_backend(r: Recipe, w: Where, bt: BackendTraits, model: ModelSpec) -> None:
    """What the backend supports; combinations it cannot make correct (launch/config/backends.py says why), with the
    nearest that it can."""
    par = r.parallel
    if r.precision.dtype not in bt.dtypes:
        raise ConfigError(w("precision.dtype"), "precision.dtype", r.precision.dtype,
                          f'is not supported by backend "{r.backend}" (launch/config/backends.py says why)',
                          f'set precision.dtype to one of {", ".join(bt.dtypes)}')
    for dotted, value in (("parallel.offload_optimizer", par.offload_optimizer), ("parallel.offload_params", par.offload_params)):
        if value != "none" and not bt.offload:
            raise ConfigError(w(dotted), dotted, value, f'is not supported by backend "{r.backend}" yet (untested)',
                              f'set {dotted}="none" or backend = "deepspeed"')
    if par.pp > 1 and model.tie_word_embeddings and not bt.pp_tied_embeddings:
        raise ConfigError(w("parallel.pp"), "parallel.pp", par.pp,
                          f"needs untied embeddings on backend \"{r.backend}\"; {model.name} ties its output layer "
                          "to the embedding", "set parallel.pp=1 (use tp or ZeRO), or a model with untied embeddings")
    for dotted, used, stages, value, off in (("parallel.pp", par.pp > 1, bt.pp_zero_stages, par.pp, "1"),
                                             ("parallel.sp", par.sp, bt.sp_zero_stages, "true", "false"),
                                             ("parallel.tp", par.tp > 1, bt.tp_zero_stages, par.tp, "1")):
        if used and par.zero_stage not in stages:
            raise ConfigError(w("parallel.zero_stage"), "parallel.zero_stage", par.zero_stage,
                              f"cannot combine with {dotted}={value} on backend \"{r.backend}\" "
                              f"(supported: zero_stage {', '.join(map(str, stages))})",
                              f"set parallel.zero_stage={max(stages)}, or {dotted}={off}")


def _check_precision(loaded: LoadedRecipe, hw: HardwareProfile, bt: BackendTraits) -> None:
    """The dtype against the hardware, and the fp16 loss scale."""
    r, w = loaded.recipe, loaded.where
    if not hw.supports(r.precision.dtype):
        raise ConfigError(w("precision.dtype"), "precision.dtype", r.precision.dtype,
                          f"is not supported by {hw.device}", "set precision.dtype=\"fp16\" (with loss scaling)")
    if hw.device_type == "cpu" and r.precision.dtype == "fp16" and bt.uses_deepspeed(r.parallel.zero_stage):
        raise ConfigError(w("precision.dtype"), "precision.dtype", "fp16",
                          "is not supported by DeepSpeed on CPU ranks", 'set precision.dtype="fp32" or "bf16"')
    if r.precision.grad_reduce_dtype == "bf16" and r.precision.dtype != "bf16":
        # fp16 gradients cast to bf16 would lose precision for no bytes saved; fp32 ones would halve their precision
        raise ConfigError(w("precision.grad_reduce_dtype"), "precision.grad_reduce_dtype", "bf16",
                          f'reduces gradients in bf16, which needs precision.dtype="bf16" (got "{r.precision.dtype}")',
                          'set precision.grad_reduce_dtype="fp32", or precision.dtype="bf16"')
    power, dotted = r.precision.initial_loss_scale_power, "precision.initial_loss_scale_power"
    if dotted in loaded.origin and r.precision.dtype != "fp16":
        # bf16 and fp32 keep fp32's exponent range and scale no loss: the power set would change nothing
        raise ConfigError(w(dotted), dotted, power, f'is set but precision.dtype="{r.precision.dtype}" scales no loss',
                          f'set precision.dtype="fp16", or leave {dotted} unset')
    if not 0 <= power <= 64:
        # 2**64 is already 2**48 times fp16's largest number (each power above what the gradients fit costs one skipped
        # step), and the scaled loss stays far inside fp32's range
        raise ConfigError(w(dotted), dotted, power, "must be between 0 and 64",
                          f"set {dotted} within that range (16, the default, starts at 65536)")


def _check_peft(r: Recipe, w: Where, bt: BackendTraits, model: ModelSpec) -> None:
    """[peft]: the adapters against the model (launch.config.adapters), then what the backend trains them with."""
    peft, par = r.peft, r.parallel
    adapters.check(peft, model, w)
    if not adapters.adapted(peft):
        return
    method = f'peft.method="{peft.method}"'
    if peft.method not in bt.peft_zero_stages:
        others = " or ".join(f'backend = "{n}"' for n, b in BACKENDS.items() if peft.method in b.peft_zero_stages)
        raise ConfigError(w("backend"), "backend", r.backend,
                          f'cannot train {method} ({bt.why_not.get(peft.method, "not built")})',
                          f'set {others + ", or " if others else ""}peft.method="none"')
    stages = bt.peft_zero_stages[peft.method]
    if par.zero_stage not in stages:
        why = f" ({bt.why_not[peft.method]})" if peft.method in bt.why_not else ""
        raise ConfigError(w("parallel.zero_stage"), "parallel.zero_stage", par.zero_stage,
                          f'cannot combine with {method} on backend "{r.backend}"{why}; it trains adapters at zero_stage '
                          f"{', '.join(map(str, stages))}", f"set parallel.zero_stage={max(stages)}")
    for dotted, value, used, off in (("parallel.tp", par.tp, par.tp > 1, "1"), ("parallel.pp", par.pp, par.pp > 1, "1"),
                                     ("parallel.offload_optimizer", par.offload_optimizer,
                                      par.offload_optimizer != "none", '"none"'),
                                     ("train.compile", r.train.compile, r.train.compile, "false")):
        if used:
            # The adapters are plain nn.Linear modules peft adds: no backend's TP plan or pipeline split covers them,
            # and offload and compile with them are not tested here.
            raise ConfigError(w(dotted), dotted, value, f"cannot combine with {method} (adapters are trained with data "
                              "parallelism, ZeRO/FSDP sharding and activation checkpointing alone)",
                              f"set {dotted}={off}: a fine-tune's model states are small, and data parallelism "
                              "scales it")
    if peft.method == "qlora" and r.precision.dtype == "fp32":
        raise ConfigError(w("precision.dtype"), "precision.dtype", "fp32",
                          'cannot compute a QLoRA fine-tune: the 4-bit NF4 weights are dequantized to a 16-bit compute '
                          "dtype", 'set precision.dtype="bf16" (or "fp16" on a GPU without bf16)')


def _check_gpu_features(r: Recipe, w: Where, hw: HardwareProfile) -> None:
    """Profilers and layer specs that run on NVIDIA GPUs only."""
    if r.run.profile == "nsys" and hw.device_type == "cpu":
        raise ConfigError(w("run.profile"), "run.profile", "nsys", "needs NVIDIA GPUs (Nsight Systems traces CUDA)",
                          'set run.profile="torch" on CPU ranks')
    if r.train.attention == "te" and (r.backend != "megatron" or hw.device_type != "cuda"):
        raise ConfigError(w("train.attention"), "train.attention", "te",
                          f"is Megatron-Core's Transformer Engine spec, which runs on GPUs only (here backend "
                          f"\"{r.backend}\" on {hw.device})",
                          'set train.attention="sdpa" (fused attention through torch on every backend)')
    kernels = hw.efficiency.attention if hw.efficiency else {}
    if r.train.attention != "eager" and r.train.attention not in kernels:
        # The step-time model times a fused kernel at the profile's measured shares of peak; without them it cannot.
        raise ConfigError(w("train.attention"), "train.attention", r.train.attention,
                          f"has no efficiency figures in the {hw.name} profile (efficiency.attention lists "
                          f"{', '.join(sorted(kernels)) or 'none'})",
                          f'set train.attention to one of {", ".join(sorted(kernels))}, or add the kernel\'s measured '
                          "forward and backward shares to the profile")


def _warnings(r: Recipe, model: ModelSpec, bt: BackendTraits) -> tuple[str, ...]:
    """What works but is likely not what the user wants; the recipe has passed every check."""
    par, hw_s, batch = r.parallel, r.hardware, r.batch
    out = []
    hpz = par.zero_hpz_partition_size
    if hpz > 1 and hw_s.gpus_per_node % hpz:
        out.append(f"parallel.zero_hpz_partition_size={hpz} does not divide hardware.gpus_per_node="
                   f"{hw_s.gpus_per_node}: secondary groups cross nodes, and the backward gathers with them")
    if batch.seq_len > model.max_position_embeddings:
        out.append(f"batch.seq_len={batch.seq_len} exceeds {model.name}'s max_position_embeddings "
                   f"{model.max_position_embeddings}: RoPE extrapolates beyond what the model was built for")
    if r.run.max_restarts > 0 and r.train.checkpoint_every == 0:
        out.append(f"run.max_restarts={r.run.max_restarts} with train.checkpoint_every=0: a restarted group trains "
                   "again from step 0 (only the final step is saved); set train.checkpoint_every")
    # Placement warnings.
    if par.tp > hw_s.gpus_per_node:
        out.append(f"parallel.tp={par.tp} > hardware.gpus_per_node={hw_s.gpus_per_node}: TP all-reduces "
                   "cross nodes on every layer; keep tp within a node (the plan's placement note times both links)")
    if not adapters.adapted(r.peft) and any(f.name != "method" and getattr(r.peft, f.name) != f.default
                                            for f in dataclasses.fields(r.peft)):
        out.append('[peft] sets adapter fields but peft.method="none": every parameter trains and they are unused; '
                   'set peft.method="lora" or "qlora" to fine-tune')
    if adapters.adapted(r.peft) and not r.model.weights:
        out.append(f'peft.method="{r.peft.method}" without model.weights: the adapters fine-tune a randomly initialised '
                   "base; set model.weights to the model's Hugging Face folder")
    if par.tp > 1 and bt.autotp and par.zero_stage == 3:
        out.append("AutoTP with ZeRO-3 goes beyond DeepSpeed's documented AutoTP training support (ZeRO 0-2); "
                   "layoutlab's parity tests cover it")
    return tuple(out)


def _completed(r: Recipe, paths: Mapping[str, str], resume: str, dp: int, hw: HardwareProfile) -> Recipe:
    """The recipe as resolved.json holds it: dp a number, paths absolute, commbench.max_bytes the profile's default
    where unset."""
    commbench_s = dataclasses.replace(r.commbench,
                                      max_bytes=r.commbench.max_bytes or commbench_spec.default_max_bytes(hw.device_type))
    return dataclasses.replace(
        r, parallel=dataclasses.replace(r.parallel, dp=dp), commbench=commbench_s,
        model=dataclasses.replace(r.model, config=paths.get("model.config"), weights=paths.get("model.weights")),
        data=dataclasses.replace(r.data, path=paths.get("data.path"), valid_path=paths.get("data.valid_path"),
                                 tokenizer=paths.get("data.tokenizer", r.data.tokenizer)),
        deepspeed=dataclasses.replace(r.deepspeed, config=paths.get("deepspeed.config")),
        run=dataclasses.replace(r.run, resume=resume))


def _deepspeed_config(loaded: LoadedRecipe, r: Recipe, grad_accum: int, hw: HardwareProfile,
                      model: ModelSpec) -> tuple[dict, str]:
    par = r.parallel
    if r.deepspeed.config:
        base_path = Path(r.deepspeed.config)  # already absolute (resolve)
        if not base_path.is_file() and (dsconfig.DS_CONFIGS / Path(base_path).name).is_file():
            base_path = dsconfig.DS_CONFIGS / Path(base_path).name  # "zero2.json" names a shipped base
    else:
        base_path = dsconfig.default_base(par.zero_stage, par.offload_optimizer, par.offload_params)
    base = dsconfig.read_json(base_path, context=loaded.where("deepspeed.config"), field="deepspeed.config")
    t = r.train
    # DeepSpeedCPUAdam runs the optimizer step on the host when the optimizer is offloaded; otherwise
    # torch's AdamW avoids DeepSpeed's JIT-built fused Adam on machines without a prebuilt op.
    offloaded = par.offload_optimizer != "none"
    owned: dict[str, tuple[Any, str]] = {
        "train_batch_size": (r.batch.global_batch_size, "batch.global_batch_size"),
        "train_micro_batch_size_per_gpu": (r.batch.micro_batch_size, "batch.micro_batch_size"),
        "gradient_accumulation_steps": (grad_accum, "batch.global_batch_size / (micro_batch_size × dp)"),
        "gradient_clipping": (t.grad_clip, "train.grad_clip"),
        "zero_optimization.stage": (par.zero_stage, "parallel.zero_stage"),
        "bf16.enabled": (r.precision.dtype == "bf16", "precision.dtype"),
        "fp16.enabled": (r.precision.dtype == "fp16", "precision.dtype"),
        # DeepSpeed reduces in the model's 16-bit dtype unless told otherwise
        **({"communication_data_type": (r.precision.grad_reduce_dtype, "precision.grad_reduce_dtype")}
           if r.precision.dtype != "fp32" else {}),
        # the deepspeed backend's loss scaler (the megatron backend refuses fp16: launch/config/backends.py)
        **({"fp16.initial_scale_power": (r.precision.initial_loss_scale_power, "precision.initial_loss_scale_power")}
           if r.precision.dtype == "fp16" else {}),
        "optimizer.type": ("AdamW", "train (AdamW)"),
        "optimizer.params.lr": (t.lr, "train.lr"),
        "optimizer.params.betas": ([t.adam_beta1, t.adam_beta2], "train.adam_beta1/adam_beta2"),
        "optimizer.params.eps": (ADAM_EPS, "train (AdamW eps)"),
        "optimizer.params.weight_decay": (t.weight_decay, "train.weight_decay"),
        "optimizer.params.torch_adam": (not offloaded, "parallel.offload_optimizer"),
    }
    if hw.device_type == "cuda" and not offloaded:
        # torch's AdamW (torch_adam) with its fused kernel on GPUs: one launch per parameter group, where DeepSpeed's own
        # FusedAdam would be a JIT build
        owned["optimizer.params.fused"] = (True, "hardware.profile (a GPU: torch's fused AdamW)")
    if par.zero_hpz_partition_size > 1:
        owned["zero_optimization.zero_hpz_partition_size"] = (par.zero_hpz_partition_size,
                                                              "parallel.zero_hpz_partition_size")
    for kind, dev in (("offload_optimizer", par.offload_optimizer), ("offload_param", par.offload_params)):
        field = "parallel.offload_optimizer" if kind == "offload_optimizer" else "parallel.offload_params"
        if dev != "none":
            owned[f"zero_optimization.{kind}.device"] = (dev, field)
            if dev == "nvme":
                owned[f"zero_optimization.{kind}.nvme_path"] = (par.nvme_path, "parallel.nvme_path")
    recipe_owned = dict(owned)
    owned = traits(r.backend).compose_ds_config(owned, r)
    # A shipped base's tuning gives way where the backend decides a field itself (Megatron's overlap_comm); the
    # recipe's own fields (stage, batch, offload) are refused when any base contradicts them, shipped or not: a user
    # naming deepspeed.config=ds_configs/zero3.json with parallel.zero_stage=2 gets told, not stage 2.
    backend_owned = {k for k, (value, _) in owned.items() if k not in recipe_owned or recipe_owned[k][0] != value}
    base_file = str(base_path.relative_to(dsconfig.DS_CONFIGS.parent)) if base_path.is_relative_to(dsconfig.DS_CONFIGS.parent) else str(base_path)
    zo = base.setdefault("zero_optimization", {})
    for kind, dev, field in (("offload_optimizer", par.offload_optimizer, "parallel.offload_optimizer"),
                             ("offload_param", par.offload_params, "parallel.offload_params")):
        have = zo.get(kind)
        if dev == "none":
            if isinstance(have, dict) and have.get("device", "none") != "none":
                raise ConfigError(base_file, f"zero_optimization.{kind}.device", have["device"],
                                  f'contradicts the recipe ({field} is "none")',
                                  f"pick a base without {kind} or set {field}")
        elif not isinstance(have, dict):
            # The recipe owns the offload choice; a base need not spell it out.
            zo[kind] = dict(dsconfig.OFFLOAD_DEFAULTS[(kind, dev)])
    if "nvme" in (par.offload_optimizer, par.offload_params):
        base.setdefault("aio", dict(dsconfig.AIO_DEFAULTS))
    cfg = dsconfig.compose(base, base_file, owned,
                           yields=backend_owned if base_path.parent == dsconfig.DS_CONFIGS else frozenset())
    if r.precision.dtype != "fp32":
        # The shipped precision fragment (the loss scaler's tuning: window, hysteresis, floor) fills only what neither
        # the base nor the recipe set; the initial scale is the recipe's (precision.initial_loss_scale_power).
        frag = dsconfig.DS_CONFIGS / f"{r.precision.dtype}.json"
        cfg = dsconfig.merge_fragment(cfg, dsconfig.read_json(frag, context=str(frag), field="precision"))
    dsconfig.fill_auto(cfg, model, par.tp, base_file)
    return cfg, base_file


def _divisors(n: int) -> list[int]:
    return [d for d in divisors(n) if d <= 64]  # an error message lists the small ones


_DATA_FILES = {"text": "a .txt/.jsonl file, folder or glob", "parquet": "a .parquet file, folder or glob",
               "megatron": "an indexed-dataset prefix (PREFIX.bin + PREFIX.idx) or a folder of them"}


def _check_data(r, w) -> None:
    """The data fields' sense; the files themselves are opened by launch/data/check.py before launch."""
    d, t = r.data, r.train
    for dotted, value, low in (("train.eval_every", t.eval_every, 0), ("train.eval_batches", t.eval_batches, 1)):
        if value < low:
            raise ConfigError(w(dotted), dotted, value, f"is below {low}", f"set {dotted} >= {low}")
    if not (0.0 <= d.valid_fraction <= 0.5):
        raise ConfigError(w("data.valid_fraction"), "data.valid_fraction", d.valid_fraction, "is not within 0 to 0.5",
                          "hold out a fraction such as 0.05 (0: none)")
    if d.valid_fraction and d.valid_path:
        raise ConfigError(w("data.valid_path"), "data.valid_path", d.valid_path, "and data.valid_fraction are both set",
                          "hold out rows one way: set data.valid_fraction=0 or unset data.valid_path")
    if not d.text_field.strip():
        raise ConfigError(w("data.text_field"), "data.text_field", d.text_field, "is empty",
                          "name the JSONL field or Parquet column that holds the text (default \"text\")")
    if d.source == "synthetic":
        for dotted, value in (("data.path", d.path), ("data.valid_path", d.valid_path),
                              ("data.valid_fraction", d.valid_fraction),
                              ("data.tokenizer", None if d.tokenizer == "byte" else d.tokenizer)):
            if value:
                raise ConfigError(w(dotted), dotted, value, "is set but data.source=\"synthetic\" reads no corpus",
                                  "set data.source to text, parquet or megatron, or unset it")
        return
    if not d.path:
        raise ConfigError(w("data.source"), "data.source", d.source, "needs data.path",
                          f"set data.path to {_DATA_FILES[d.source]} (relative to the recipe)")
    # The files themselves (globs and prefixes expanded) are opened by the data check before launch.
