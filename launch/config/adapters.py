"""The adapters a recipe's [peft] section adds to its model: which linear layers take them, their parameters (peft's
names and shapes), and how many parameters train and how many stay frozen. Stdlib only: the resolver validates a
recipe with it, the planner sizes the adapters from it, and the trainers name what they build after it.

peft's LoRA (peft.tuners.lora.layer.Linear) wraps each chosen nn.Linear: the original weight moves under
`<module>.base_layer` and two adapter matrices are added, `lora_A` (rank × in, Kaiming-uniform) and `lora_B` (out ×
rank, zeros: the adapted model starts equal to the base), without biases; the output is
base(x) + B(A(dropout(x))) · alpha / rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from launch.config.models import ModelSpec, ParamInfo
from launch.config.schema import PeftSection
from launch.errors import ConfigError

ADAPTER_NAME = "default"  # peft's name for a model's one adapter: `<module>.lora_A.default.weight`
BASE_LAYER = "base_layer"  # peft keeps the wrapped linear layer under this name


@dataclass(frozen=True)
class LinearModule:
    """One linear layer of a decoder block, as Hugging Face names and stores it."""

    name: str  # the module's own name: q_proj, ..., down_proj
    path: str  # its place in a block: self_attn.q_proj
    out_features: int
    in_features: int


def block_linears(model: ModelSpec) -> dict[str, LinearModule]:
    """The linear layers of one decoder block, by module name, in the block's order (from the model's own parameter
    list: every 2-D weight of layer 0)."""
    out = {}
    for p in model.parameters():
        if p.layer == 0 and p.name.endswith(".weight") and len(p.shape) == 2:
            path = p.name.removeprefix("model.layers.0.").removesuffix(".weight")
            name = path.rsplit(".", 1)[-1]
            out[name] = LinearModule(name, path, p.shape[0], p.shape[1])
    return out


def adapted(peft: PeftSection) -> bool:
    return peft.method != "none"


def draws_random(peft: PeftSection) -> bool:
    """Whether a training step draws random numbers: adapter dropout (the base models have no dropout)."""
    return adapted(peft) and peft.dropout > 0


def adapted_linears(model: ModelSpec, peft: PeftSection) -> list[LinearModule]:
    """The block linears that take an adapter, in the block's order; none without [peft]."""
    return [lin for lin in block_linears(model).values() if lin.name in peft.target_modules] if adapted(peft) else []


def linear_params_per_block(model: ModelSpec) -> int:
    """The weights of one block's linear layers (what QLoRA stores in NF4)."""
    return sum(lin.out_features * lin.in_features for lin in block_linears(model).values())


def adapter_parameters(model: ModelSpec, peft: PeftSection) -> list[ParamInfo]:
    """Every adapter tensor peft adds, in module order, under the names peft's modules give them (lora_A before
    lora_B); none without [peft]."""
    out = []
    chosen = adapted_linears(model, peft)
    for layer in range(model.num_layers):
        for lin in chosen:
            pre = f"model.layers.{layer}.{lin.path}"
            a, b = (peft.rank, lin.in_features), (lin.out_features, peft.rank)
            out.append(ParamInfo(f"{pre}.lora_A.{ADAPTER_NAME}.weight", a, "replicated", layer))
            out.append(ParamInfo(f"{pre}.lora_B.{ADAPTER_NAME}.weight", b, "replicated", layer))
    return out


def checkpointed_parameters(model: ModelSpec, peft: PeftSection) -> list[ParamInfo]:
    """The tensors a run's checkpoints hold of its model: a fine-tune's adapters alone (the frozen base is the recipe's
    weights, built again at start-up), else every parameter."""
    return adapter_parameters(model, peft) if adapted(peft) else model.parameters()


@dataclass(frozen=True)
class ParameterSplit:
    """A model's parameters (or one rank's share of them: launch.plan.adapters.rank_split) under [peft]: what trains and
    what stays frozen (every parameter trains without it)."""

    trainable: int
    frozen: int
    # of the frozen: the parameters of the adapted blocks' linear layers, the ones QLoRA stores in 4-bit NF4 (every
    # linear layer of every block, as bitsandbytes' load_in_4bit quantizes them, adapted or not)
    frozen_linear: int

    @property
    def total(self) -> int:
        return self.trainable + self.frozen


def parameter_split(model: ModelSpec, peft: PeftSection) -> ParameterSplit:
    base = model.param_counts().total
    if not adapted(peft):
        return ParameterSplit(base, 0, 0)
    return ParameterSplit(sum(p.numel for p in adapter_parameters(model, peft)), base,
                          linear_params_per_block(model) * model.num_layers)


def base_name(name: str) -> str:
    """The model's own name of a parameter of the adapted model (peft moves a wrapped weight under base_layer)."""
    return name.replace(f".{BASE_LAYER}.", ".")


def check(peft: PeftSection, model: ModelSpec, where: Callable[[str], str]) -> None:
    """What [peft] must hold for `model`, before anything starts: a target each block has, a rank no larger than the
    smallest adapted layer, a finite positive alpha, a dropout in [0, 1). Raises ConfigError."""
    if not adapted(peft):
        return
    linears = block_linears(model)
    if not peft.target_modules:
        raise ConfigError(where("peft.target_modules"), "peft.target_modules", [], "names no module",
                          f"name some of the blocks' linear layers: {', '.join(linears)}")
    for name in peft.target_modules:
        if name not in linears:
            raise ConfigError(where("peft.target_modules"), "peft.target_modules", name,
                              f"is not a linear layer of {model.name}'s decoder blocks",
                              f"name some of: {', '.join(linears)}")
    if len(set(peft.target_modules)) != len(peft.target_modules):
        raise ConfigError(where("peft.target_modules"), "peft.target_modules", list(peft.target_modules),
                          "names a module twice", "name each once")
    smallest = min((min(lin.out_features, lin.in_features), lin.name) for lin in linears.values()
                   if lin.name in peft.target_modules)
    if peft.rank > smallest[0]:
        raise ConfigError(where("peft.rank"), "peft.rank", peft.rank,
                          f"is larger than {smallest[1]} ({smallest[0]} features): a rank past a layer's smaller side "
                          "adds parameters and no expressiveness", f"set peft.rank={min(16, smallest[0])} or less")
    if not 0 < peft.alpha < float("inf"):
        raise ConfigError(where("peft.alpha"), "peft.alpha", peft.alpha, "must be a positive finite number",
                          f"set peft.alpha={2 * peft.rank} (twice the rank, a common choice)")
    if not 0 <= peft.dropout < 1:
        raise ConfigError(where("peft.dropout"), "peft.dropout", peft.dropout, "must be in [0, 1)",
                          "set peft.dropout=0.05 (or 0 for none)")
