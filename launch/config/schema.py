"""The recipe schema: typed, frozen sections loaded from `recipes/<name>/recipe.toml`.

A recipe states only its differences from the base it `extends`. Loading merges the chain of
TOML files (child wins), applies `key=value` overrides with the same dotted names, and checks every
key and type against the dataclasses below. Each value remembers the file (or override) that set
it, so a later validation error can name where the user must change it.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Mapping, Sequence, Union, get_args, get_origin

from launch import inputs, sense
from launch.config.backends import BACKENDS
from launch.errors import ConfigError

BACKEND_NAMES = tuple(BACKENDS)

OFFLOAD = Literal["none", "cpu", "nvme"]


@dataclass(frozen=True)
class Bounds:
    """The whole numbers a field can work with, written beside the field (`Annotated[int, Bounds(1)]`) and checked by
    `check_bounds`; `high` None: no upper limit."""

    low: int
    high: int | None = None


POSITIVE = Bounds(1)
NOT_NEGATIVE = Bounds(0)
SEED = Bounds(0, 2**64 - 1)  # a torch seed is 64 bits unsigned
# the process-group timeout becomes a datetime.timedelta (at most 999,999,999 days); a week is already far beyond any
# stalled collective
TIMEOUT_S = Bounds(1, sense.MAX_DURATION_S)
MAX_RESTARTS = Bounds(0, 100)


@dataclass(frozen=True)
class ModelSection:
    """Exactly one of `name` (catalogue) or `config` (path to an HF config.json, relative to the recipe)."""

    name: str | None = None
    config: str | None = None
    weights: str | None = None  # local HF folder (safetensors); random init when absent


@dataclass(frozen=True)
class ParallelSection:
    tp: Annotated[int, POSITIVE] = 1
    pp: Annotated[int, POSITIVE] = 1
    dp: int | Literal["auto"] = "auto"  # "auto": world / (tp * pp)
    sp: bool = False  # Megatron sequence parallel
    vpp: Annotated[int, POSITIVE] = 1  # virtual pipeline stages per rank (interleaved 1F1B)
    zero_stage: int = 0
    # ZeRO++ hpZ: ZeRO-3 also keeps a secondary partition of the 16-bit parameters over groups of this many
    # consecutive ranks (one node), so that backward re-gathers stay inside the node. Backend "torch": FSDP2's hybrid
    # sharding, parameters sharded within groups of this many data-parallel ranks and replicated across them. 1: off.
    zero_hpz_partition_size: Annotated[int, POSITIVE] = 1
    offload_optimizer: OFFLOAD = "none"
    offload_params: OFFLOAD = "none"
    nvme_path: str = "/local_nvme"


@dataclass(frozen=True)
class PrecisionSection:
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    # fp16 only: dynamic loss scaling starts at 2**this (16: torch's GradScaler's and DeepSpeed's default); a step
    # whose scaled gradients overflow is skipped and the scale halved (DeepSpeed: after fp16.hysteresis overflows)
    initial_loss_scale_power: int = 16
    # The dtype data parallelism reduces gradients in: fp32 (torchtitan's and Megatron-LM's default with 16-bit
    # training) or bf16 (half the bytes; NeMo's performance recipes), bf16 needing precision.dtype=bf16. DeepSpeed's
    # communication_data_type, FSDP2's reduce_dtype, DDP's bf16 compression hook.
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"


@dataclass(frozen=True)
class BatchSection:
    micro_batch_size: Annotated[int, POSITIVE]
    global_batch_size: Annotated[int, POSITIVE]
    seq_len: Annotated[int, POSITIVE]


ADAM_EPS = 1e-8  # AdamW's epsilon in every backend (not a recipe field)


@dataclass(frozen=True)
class TrainSection:
    steps: Annotated[int, POSITIVE] = 100
    warmup_steps: Annotated[int, NOT_NEGATIVE] = 10  # first steps excluded from measured metrics (not the LR warm-up)
    lr: float = 3e-4
    min_lr: float = 3e-5
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    lr_warmup_steps: Annotated[int, NOT_NEGATIVE] = 10
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    # selective: Megatron recomputes its core attention; the torch backend runs torchtitan's op policy. every_other_block:
    # torchtitan's layer policy (the torch backend), every second block recomputed whole
    activation_checkpointing: Literal["none", "full", "selective", "every_other_block"] = "none"
    compile: bool = False  # torch: each decoder block compiled; deepspeed: engine.compile() (ZeRO 0-2)
    # sdpa: fused attention through torch's scaled_dot_product_attention on every backend (flash / memory-efficient
    # kernels on GPUs), keeping no s × s scores; eager: the scores materialised (Hugging Face's eager attention,
    # Megatron-Core's DotProductAttention), for comparison; te: Megatron-Core's Transformer Engine layer spec (TE's
    # fused attention, its layer norms fused into the following linear layers), Megatron on GPUs with TE installed
    attention: Literal["sdpa", "eager", "te"] = "sdpa"
    checkpoint_every: Annotated[int, NOT_NEGATIVE] = 0  # 0: only at the end
    eval_every: int = 0  # validation loss every N steps and at the last (needs data.valid_fraction or data.valid_path)
    eval_batches: int = 2  # global batches of validation rows per evaluation (the same rows every time)
    seed: Annotated[int, SEED] = 1234


TOKENIZER_NAMES = ("byte", "model")  # data.tokenizer values that are not a folder


@dataclass(frozen=True)
class DataSection:
    # synthetic: a learnable bigram walk (no files); text: .txt / .jsonl; parquet: a column of .parquet files;
    # megatron: an indexed dataset (PREFIX.bin + PREFIX.idx, `python -m launch prepare-data` writes one)
    source: Literal["synthetic", "text", "parquet", "megatron"] = "synthetic"
    # a file, a folder (its files of the source's kind, recursively) or a glob, relative to the recipe; megatron: a
    # prefix, or a folder of prefixes
    path: str | None = None
    # "byte" (256 byte ids + a separator), "model" (the tokenizer files in model.weights) or a local Hugging Face
    # tokenizer folder (its tokenizer.json)
    tokenizer: str = "byte"
    text_field: str = "text"  # the JSONL field or Parquet column that holds each document
    valid_fraction: float = 0.0  # the corpus's last rows held out for the validation loss (0: none)
    valid_path: str | None = None  # or a separate corpus of the same source kind for it


@dataclass(frozen=True)
class RunSection:
    launcher: Literal["torchrun", "deepspeed"] = "torchrun"
    # auto: continue the newest checkpoint of a run of this recipe with the same backend, layout, model, data, batch,
    # precision and optimizer; never: start fresh; or a run directory / checkpoint folder to continue (another layout
    # is resharded where the backend can)
    resume: str = "auto"
    profile: Literal["none", "torch", "nsys"] = "none"
    profile_active_steps: Annotated[int, POSITIVE] = 3
    mode: Literal["train", "commbench"] = "train"
    timeout_s: Annotated[int, TIMEOUT_S] = 600  # process-group timeout: a stalled collective fails after this
    # the rank's start-up (process group, model build, checkpoint load) must reach the first step within this, however
    # steadily it progresses (its progress, tensor by tensor, keeps the stall watchdog above quiet)
    startup_timeout_s: Annotated[int, TIMEOUT_S] = 1800
    # torchrun restarts the whole group this many times after a worker fails; it resumes from the last checkpoint.
    max_restarts: Annotated[int, MAX_RESTARTS] = 0
    log_every: Annotated[int, POSITIVE] = 1  # TensorBoard and progress line every N steps (metrics JSONL: every step)
    # the last step writes a checkpoint; false for benchmark runs (a 7B model's is ~80 GB): sweeps default to false
    save_final: bool = True
    # Write checkpoints behind training (torch.distributed.checkpoint's async_save: training waits only while the state
    # is copied to host memory; the files are written by a thread, and the completion marker follows them)
    checkpoint_async: bool = False


# Every linear layer of a decoder block, by the model's own module names (QLoRA's choice, and NeMo's default)
LORA_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class PeftSection:
    """Parameter-efficient fine-tuning: the base model frozen, low-rank adapters (peft's LoRA) trained beside the
    chosen linear layers. lora: the frozen base held in precision.dtype; qlora: in 4-bit NF4 (bitsandbytes), the
    adapters computing in precision.dtype. none: every parameter trains."""

    method: Literal["none", "lora", "qlora"] = "none"
    rank: Annotated[int, POSITIVE] = 16  # r: each adapter is B (out × r) · A (r × in)
    alpha: float = 32.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input only
    # the decoder blocks' linear layers that get adapters, by the model's own names
    target_modules: tuple[str, ...] = LORA_ALL_LINEAR


@dataclass(frozen=True)
class HardwareSection:
    nodes: Annotated[int, POSITIVE] = 1
    gpus_per_node: Annotated[int, POSITIVE] = 1  # on the CPU profile: ranks per node
    profile: str = "cpu"


@dataclass(frozen=True)
class DeepSpeedSection:
    config: str | None = None  # base JSON, relative to the recipe; chosen from zero_stage/offload when absent


@dataclass(frozen=True)
class PlanSection:
    headroom: float = 0.10  # fraction of device memory kept free by the fit check
    ignore_fit: bool = False  # launch even when the plan predicts out-of-memory
    # false: a catalogue recipe shipped to show a layout that does not fit (its plan says why); the run refuses it as
    # any predicted out-of-memory, and the catalogue's test checks that it indeed does not fit
    expect_fit: bool = True


COMMBENCH_DTYPE = Literal["float32", "bfloat16", "float16", "float64", "int8", "uint8", "int32", "int64",
                          "float8_e4m3", "float8_e5m2"]


@dataclass(frozen=True)
class CommbenchSection:
    """The collective sweep of `run.mode = "commbench"` (launch/comm/commbench_spec.py), nccl-tests' knobs by our names."""

    ops: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
    min_bytes: int = 8
    max_bytes: int = 0  # 0: the profile's default (256 MiB on GPUs, 4 MiB on the CPU profile)
    step_factor: int = 2  # sizes min_bytes, min_bytes × f, ... up to max_bytes
    dtype: COMMBENCH_DTYPE = "float32"
    warmup_iters: int = 5
    iters: int = 20
    group: Literal["world", "tp", "dp", "pp", "inter_node"] = "world"  # tp/dp/pp: every such group at once
    ranks: tuple[int, ...] = ()  # an explicit group instead of `group`; the other ranks wait
    nccl_tests: bool = True  # also run NVIDIA nccl-tests (*_perf on PATH) before the sweep, on GPUs
    # Busy compute (µs of matmul work, the same amount on every rank) before each timed call, subtracted again: a
    # training step's calls wait for ranks that arrive apart, and gloo wakes its threads per call. 0: back-to-back
    # calls as nccl-tests times them. `python -m launch calibrate` sets it.
    interleave_us: float = 0.0


@dataclass(frozen=True)
class Recipe:
    backend: Literal[BACKEND_NAMES]  # the registry's names (launch/config/backends.py)
    batch: BatchSection
    model: ModelSection = ModelSection()
    parallel: ParallelSection = ParallelSection()
    precision: PrecisionSection = PrecisionSection()
    train: TrainSection = TrainSection()
    data: DataSection = DataSection()
    run: RunSection = RunSection()
    hardware: HardwareSection = HardwareSection()
    deepspeed: DeepSpeedSection = DeepSpeedSection()
    plan: PlanSection = PlanSection()
    commbench: CommbenchSection = CommbenchSection()
    peft: PeftSection = PeftSection()
    extends: str | None = None
    description: str = ""


@dataclass(frozen=True)
class LoadedRecipe:
    """A recipe after merging its `extends` chain and the overrides."""

    name: str
    path: Path  # the recipe.toml named on the command line
    recipe: Recipe
    origin: Mapping[str, str]  # dotted key -> file (or "override") that set it
    chain: tuple[str, ...]  # files merged, base first
    overrides: tuple[str, ...]

    def where(self, dotted: str) -> str:
        """The file to name in an error about `dotted` (the one that set it, else the recipe)."""
        return self.origin.get(dotted, str(self.path))

    def path_of(self, dotted: str, value: str) -> Path:
        """A path field made absolute: relative to the file that set it, or to the working directory for
        a command-line override."""
        p = Path(value).expanduser()
        origin = self.where(dotted)
        base = Path.cwd() if origin.startswith("override ") else Path(origin).parent
        try:
            full = p if p.is_absolute() else (base / p).resolve()
            full.exists()  # raises for a name longer than the file system takes
            return full
        except (OSError, RuntimeError) as e:  # a name longer than the file system takes; a symlink loop
            raise ConfigError(origin, dotted, value, f"cannot be used as a path ({getattr(e, 'strerror', None) or e})",
                              "give the path of the file you meant") from None


# --------------------------------------------------------------------------- loading


def recipe_file(path: str | Path) -> Path:
    p = Path(path)
    return p / "recipe.toml" if p.is_dir() or p.suffix != ".toml" else p


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> LoadedRecipe:
    top = recipe_file(path)
    if not top.is_file():
        folder = Path(path) if top.name == "recipe.toml" and top.parent == Path(path) else top.parent
        siblings = sorted(p.name for p in _listing(folder.parent) if (p / "recipe.toml").is_file())
        close = _close_names(folder.name, siblings)
        hint = f"did you mean {folder.parent / close}? " if close else ""
        raise ConfigError(str(path), "recipe", str(path), "has no recipe.toml",
                          f"{hint}pass a folder under recipes/ that contains recipe.toml")
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    chain = _read_chain(top)
    for f in chain:
        data = _read_toml(f)
        data.pop("extends", None)
        _drop_other_model_source(merged, data.get("model", {}) if isinstance(data.get("model"), dict) else {})
        _merge(merged, data, origin, str(f), "")
    model_sources = [o for o in overrides if o.split("=", 1)[0].strip() in ("model.name", "model.config")]
    if len({o.split("=", 1)[0].strip() for o in model_sources}) == 2:
        # each would drop the other (a layer names the model one way): the later one silently winning is a guess
        raise ConfigError(f"override {model_sources[-1]}", "model", model_sources,
                          "names the model twice (by catalogue name and by config.json)", "give one of them")
    for item in overrides:
        key, value = _parse_override(item)
        if key == "extends":  # the chain is read from the files before any override applies
            raise ConfigError(f"override {item}", "extends", value, "cannot be overridden: the recipe files name their chain",
                              "write a recipe whose recipe.toml extends the one you want, or override its fields")
        if key in ("model.name", "model.config"):
            _drop_other_model_source(merged, {key.split(".")[1]: value})
        _set_dotted(merged, key, value)
        parts = key.split(".")
        for i in range(1, len(parts)):
            origin.setdefault(".".join(parts[:i]), f"override {item}")
        origin[key] = f"override {item}"
    recipe = _build(Recipe, merged, "", origin, str(top))
    return LoadedRecipe(
        # Its folder's own name, `.` and `..` spelled out (a recipe given as `..` would put its runs outside runs/);
        # lexically, so that a symlinked recipe folder keeps the name the user gave it.
        name=Path(os.path.abspath(top.parent)).name or "recipe",
        path=top,
        recipe=recipe,
        origin=types.MappingProxyType(origin),
        chain=tuple(str(c) for c in chain),
        overrides=tuple(overrides),
    )


def with_overrides(loaded: LoadedRecipe, items: Sequence[str]) -> LoadedRecipe:
    """What `load_recipe(loaded.path, [*loaded.overrides, *items])` returns for overrides of fields below a section
    (the planner's search sets thousands of layouts on one recipe), without reading, merging and typing the recipe files
    again: each parsed and typed by the loader's own rules (_parse_override, _coerce) and named as the place that set
    it."""
    recipe = loaded.recipe
    origin = dict(loaded.origin)
    for item in items:
        key, value = _parse_override(item)
        where = f"override {item}"
        *section, name = key.split(".")
        if section:
            (part,) = section
            old = getattr(recipe, part)
            typed = _coerce(typing.get_type_hints(type(old))[name], value, key, {key: where}, where)
            recipe = dataclasses.replace(recipe, **{part: dataclasses.replace(old, **{name: typed})})
            origin.setdefault(part, where)
        else:
            typed = _coerce(typing.get_type_hints(Recipe)[name], value, key, {key: where}, where)
            recipe = dataclasses.replace(recipe, **{name: typed})
        origin[key] = where
    return dataclasses.replace(loaded, recipe=recipe, origin=types.MappingProxyType(origin),
                               overrides=(*loaded.overrides, *items))


def _drop_other_model_source(merged: dict, model_layer: Mapping[str, Any]) -> None:
    """A layer naming the model one way replaces an inherited model named the other way (a recipe with
    `model.config` extends a base with `model.name`); a layer naming it both ways is caught by the resolver."""
    model = merged.get("model")
    if not isinstance(model, dict):
        return
    if "config" in model_layer and "name" not in model_layer:
        model.pop("name", None)
    if "name" in model_layer and "config" not in model_layer:
        model.pop("config", None)


def _read_toml(f: Path) -> dict[str, Any]:
    return inputs.parse_toml(f, context=str(f), field="(file)", fix="name a recipe folder holding recipe.toml")


def _read_chain(top: Path) -> list[Path]:
    """The recipe files from the base the chain ends at down to `top`. Read in a loop, not by recursion, so a chain
    is limited only by a cycle (refused), never by Python's recursion limit."""
    chain: list[Path] = []
    seen: set[Path] = set()
    f = top
    while True:
        resolved = f.resolve()
        if resolved in seen:
            raise ConfigError(str(f), "extends", str(f), "forms a cycle",
                              "make the chain of `extends` end at a base without `extends`")
        seen.add(resolved)
        chain.append(f)
        parent = _read_toml(f).get("extends")
        if parent is None:
            return chain[::-1]
        if not isinstance(parent, str) or "\x00" in parent:
            raise ConfigError(str(f), "extends", parent, "must be a string path", 'write extends = "../base"')
        try:
            pf = recipe_file(f.parent / parent)
            found = pf.is_file()
        except OSError:  # a name too long for the file system
            pf, found = f.parent / parent, False
        if not found:
            raise ConfigError(str(f), "extends", parent, f"points to {pf}, which does not exist",
                              "name a recipe folder relative to this file, e.g. \"../base\"")
        f = pf


def _merge(dst: dict, src: Mapping, origin: dict, file: str, prefix: str) -> None:
    for k, v in src.items():
        dotted = f"{prefix}{k}"
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v, origin, file, dotted + ".")
        else:
            dst[k] = _copy(v)
            if isinstance(v, dict):
                for sub in _dotted_keys(v, dotted + "."):
                    origin[sub] = file
            origin[dotted] = file


def _copy(v: Any) -> Any:
    return {k: _copy(x) for k, x in v.items()} if isinstance(v, dict) else v


def _dotted_keys(d: Mapping, prefix: str) -> list[str]:
    out = []
    for k, v in d.items():
        out.append(prefix + k)
        if isinstance(v, dict):
            out += _dotted_keys(v, prefix + k + ".")
    return out


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError("command line", item, item, "is not key=value",
                          "write overrides as dotted.name=value, e.g. parallel.tp=2")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError("command line", key, raw, "has an empty name", "write e.g. parallel.tp=2")
    if inputs.nesting(raw) > inputs.MAX_DEPTH:  # the recipe files' limit: the TOML parser recurses per level
        raise ConfigError(f"override {item[:60]}...", key, f"more than {inputs.MAX_DEPTH} levels", "nests too deep",
                          "flatten the array")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word (e.g. train.activation_checkpointing=full) is a string
    except ValueError:  # an integer past Python's digit limit
        raise ConfigError(f"override {item[:60]}", key, raw[:20] + "...", "holds a number no field can take",
                          "write the number you meant") from None
    found = sense.bad_number(value)
    if found is not None:
        raise ConfigError(f"override {item}", key, value, "is not a finite number within 64 bits",
                          "write the number you meant")
    return key, value


def _set_dotted(d: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        nxt = d.setdefault(p, {})
        if not isinstance(nxt, dict):
            d[p] = nxt = {}
        d = nxt
    d[parts[-1]] = value


# --------------------------------------------------------------------------- typing


def _build(cls: type, data: Any, prefix: str, origin: Mapping[str, str], top: str) -> Any:
    section = prefix.rstrip(".") or "recipe"
    if not isinstance(data, dict):
        raise ConfigError(origin.get(section, top), section, data, "must be a table",
                          f"write [{section}] with its keys")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        k = unknown[0]
        dotted, value = prefix + k, data[k]
        close = _close_names(k, list(fields))
        # A mistyped section (paralel.tp=2) names the key the user wrote, not the table it became.
        while isinstance(value, dict) and len(value) == 1 and not isinstance(hints.get(k), type):
            (sub, value), = value.items()
            dotted, close = f"{dotted}.{sub}", close and f"{close}.{sub}"
        fix = f"did you mean {prefix}{close}?" if close else f"known keys here: {', '.join(fields)}"
        raise ConfigError(origin.get(dotted, origin.get(prefix + k, top)), dotted, value, "is not a known key", fix)
    kwargs = {}
    for name, f in fields.items():
        dotted = prefix + name
        typ = hints[name]
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
                if dataclasses.is_dataclass(typ):
                    kwargs[name] = _build(typ, {}, dotted + ".", origin, top)
                    continue
                raise ConfigError(top, dotted, None, "is missing",
                                  f"set {dotted} in the recipe or its base")
            continue
        kwargs[name] = _coerce(typ, data[name], dotted, origin, top)
    return cls(**kwargs)


def _coerce(typ: Any, value: Any, dotted: str, origin: Mapping[str, str], top: str) -> Any:
    where = origin.get(dotted, top)
    if dataclasses.is_dataclass(typ):
        return _build(typ, value, dotted + ".", origin, top)
    if any(isinstance(v, str) and "\x00" in v for v in (value if isinstance(value, list) else [value])):
        # no path or name can hold one, and the OS calls that would meet it raise ValueError, not an OSError
        raise ConfigError(where, dotted, value, "holds a NUL byte", f"set {dotted} without it")
    options = get_args(typ) if get_origin(typ) in (Union, types.UnionType) else (typ,)
    for opt in options:
        ok, out = _try(opt, value)
        if ok:
            return out
    words = [a for opt in options if get_origin(opt) is Literal for a in get_args(opt) if isinstance(a, str)]
    close = _close_names(value, words) if isinstance(value, str) else None
    hint = f'did you mean "{close}"? ' if close else ""
    raise ConfigError(where, dotted, value, f"is not {_describe(typ)}", f"{hint}set {dotted} to {_describe(typ)}")


def _try(opt: Any, value: Any) -> tuple[bool, Any]:
    if opt is type(None):
        return value is None, None
    if get_origin(opt) is Literal:
        return (value in get_args(opt) and type(value) is type(get_args(opt)[0])), value
    if opt is bool:
        return isinstance(value, bool), value
    if opt is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if opt is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else None
    if opt is str:
        return isinstance(value, str), value
    if get_origin(opt) is tuple:  # tuple[T, ...]: a TOML array of T, or the comma form a command line writes
        item = get_args(opt)[0]
        if isinstance(value, str):  # a,b: as `plan model=a,b` takes its lists; an empty item stays one (refused)
            value = [int(w) if item is int and re.fullmatch(r"[+-]?[0-9]{1,18}", w) else w
                     for w in (w.strip() for w in value.split(","))]
        if not isinstance(value, (list, tuple)):
            return False, None
        items = [_try(item, v) for v in value]
        return all(ok for ok, _ in items), tuple(v for _, v in items)
    return False, None


def _describe(typ: Any) -> str:
    options = get_args(typ) if get_origin(typ) in (Union, types.UnionType) else (typ,)
    words = []
    for opt in options:
        if opt is type(None):
            continue
        if get_origin(opt) is Literal:
            words.append(" | ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in get_args(opt)))
        elif get_origin(opt) is tuple:
            item = get_args(opt)[0]
            words.append("a list of " + {int: "integers", str: "strings"}.get(item, _describe(item))
                         + (' (a,b or ["a", "b"])' if item is str else " (0,1 or [0, 1])"))
        else:
            words.append({int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(opt, str(opt)))
    return " or ".join(words)


def _listing(folder: Path) -> list[Path]:
    """The entries of a folder, or none when it cannot be listed (missing, a file, no permission)."""
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def _close_names(word: str, names: list[str]) -> str | None:
    import difflib

    m = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return m[0] if m else None


# --------------------------------------------------------------------------- bounds


def check_bounds(recipe: Recipe, where: Callable[[str], str]) -> None:
    """Every field's `Bounds` (written beside the field above), in the schema's order; `where(dotted)` names the file or
    override that set it. Raises ConfigError."""
    for dotted, bounds in _bounded_fields(Recipe, ""):
        value = functools.reduce(getattr, dotted.split("."), recipe)
        if bounds.high is None and value < bounds.low:
            raise ConfigError(where(dotted), dotted, value, f"must be at least {bounds.low}",
                              f"set {dotted}={bounds.low} or more")
        if bounds.high is not None and not bounds.low <= value <= bounds.high:
            raise ConfigError(where(dotted), dotted, value, f"must be between {bounds.low} and {bounds.high:,}",
                              f"set {dotted} within that range")


@functools.cache
def _bounded_fields(cls: type, prefix: str) -> tuple[tuple[str, Bounds], ...]:
    """(dotted name, bounds) of each field of `cls` and its sections that carries `Bounds`."""
    out: list[tuple[str, Bounds]] = []
    for name, typ in typing.get_type_hints(cls, include_extras=True).items():
        if dataclasses.is_dataclass(typ):
            out += _bounded_fields(typ, f"{prefix}{name}.")
        elif get_origin(typ) is Annotated:
            out += [(prefix + name, m) for m in typ.__metadata__ if isinstance(m, Bounds)]
    return tuple(out)


def to_dict(obj: Any) -> Any:
    """A recipe (or section) as plain JSON data."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return obj


def from_dict(cls: type, data: Mapping[str, Any]) -> Any:
    """Inverse of `to_dict` for data this program wrote (resolved.json)."""
    return _build(cls, dict(data), "", {}, "resolved.json")
