"""A DCP checkpoint holding another model's tensors is refused before any rank starts, naming the checkpoint and the
first tensors that differ (the ranks found it only after they had started: issue 49's third hostile pass). The
checkpoints here are written by torch.distributed.checkpoint itself, in one process, from the model's own tensor
list (launch.config.models: the oracle for names and shapes)."""
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from launch.commands.run import untrusted_files
from launch.config.resolve import resolve_path
from tests.conftest import RECIPES


def _save(folder: Path, shapes: dict[str, tuple[int, ...]]) -> Path:
    dcp.save({"model": {name: torch.zeros(shape) for name, shape in shapes.items()}}, checkpoint_id=str(folder))
    return folder


def test_a_dcp_checkpoint_of_another_model_is_refused_before_launch_and_its_own_passes(tmp_path):
    resolved = resolve_path(RECIPES / "tiny_fsdp2", [])
    want = {p.name: p.shape for p in resolved.model.parameters()}
    assert untrusted_files(_save(tmp_path / "own", want), resolved) is None
    # another model: every hidden dimension halved, one tensor left out
    other = {name: tuple(d // 2 if d == resolved.model.hidden_size else d for d in shape) for name, shape in want.items()}
    missing = "model.norm.weight"
    del other[missing]
    said = untrusted_files(_save(tmp_path / "other", other), resolved)
    first = next(iter(want))
    assert said is not None and "\n" not in said
    assert said.startswith(f"{tmp_path / 'other'}: checkpoint does not fit this model: {first}: checkpoint "
                           f"{other[first]}, model {want[first]}"), said
    assert f"(and {len(want) - 3} more)" in said and "run.resume=never" in said


def test_the_shape_check_is_the_torch_backends_alone(tmp_path):
    # DeepSpeed and Megatron checkpoints are no DCP folders: a DCP folder under them is checked for code only
    resolved = resolve_path(RECIPES / "tiny_zero2", [])
    assert untrusted_files(_save(tmp_path / "x", {"model.norm.weight": (3,)}), resolved) is None
