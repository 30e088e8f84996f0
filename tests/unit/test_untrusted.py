"""Untrusted files never run code: a checkpoint or weights file whose pickle would create a marker file when
unpickled is refused in one line (export, resume, model.weights), and the marker never appears; our own kinds of
checkpoint objects still load weights-only."""
import json
import os
import subprocess
import sys

import pytest
import torch

from launch.config.resolve import resolve_path
from launch.torchtools import untrusted
from launch.run.checkpoints import marker_info, write_marker
from tests.conftest import RECIPES, REPO

TINY = RECIPES / "tiny_zero2"


class Boom:
    """Unpickling this runs `touch MARKER`: what a hostile checkpoint does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _crafted(path, marker):
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"module": {"w": torch.zeros(2)}, "extra": Boom(marker)}, path)
    return path


def _run_with_crafted_checkpoint(root, marker):
    """A run directory as ours looks, whose checkpoint's model states carry the payload."""
    resolved = resolve_path(TINY, [])
    run = root / "tiny_zero2" / "20261201-000000"
    (run / "checkpoints" / "step5").mkdir(parents=True)
    (run / "resolved.json").write_text(resolved.to_json())
    _crafted(run / "checkpoints" / "step5" / "mp_rank_00_model_states.pt", marker)
    write_marker(run / "checkpoints", "step5", marker_info(resolved, 5))
    return run


def test_the_check_names_the_file_and_object_without_unpickling(tmp_path):
    marker = tmp_path / "MARKER"
    f = _crafted(tmp_path / "ckpt" / "states.pt", marker)
    with pytest.raises(untrusted.UntrustedFileError, match=r"states\.pt: names (posix|os)\.system"):
        untrusted.check([tmp_path / "ckpt"])
    assert not marker.exists()
    bare = tmp_path / "bare.pt"  # a plain pickle, not torch's zip format
    bare.write_bytes(b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x94\x8c\x06system\x94\x93\x94.")
    with pytest.raises(untrusted.UntrustedFileError, match="cannot be checked"):
        untrusted.check([bare])
    assert f.exists()


def test_the_guard_loads_weights_only_and_admits_the_libraries_own_objects(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    ours = tmp_path / "optim.pt"
    torch.save({"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.gradients, "w": torch.ones(3)}, ours)
    marker = tmp_path / "MARKER"
    bad = _crafted(tmp_path / "bad.pt", marker)
    code = (f"import torch; from launch.torchtools import untrusted; untrusted.guard(); "
            f"d = torch.load({str(ours)!r}, weights_only=False); print(d['w'].sum().item(), d['zero_stage'].value); "
            f"torch.load({str(bad)!r}, weights_only=False)")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.stdout.splitlines()[-1].split() == ["3.0", "2"], p.stdout + p.stderr  # asked False, done weights-only
    said = p.stderr.strip().splitlines()[-1]
    assert said.startswith("launch.torchtools.untrusted.UntrustedFileError: "), said
    assert "bad.pt: " in said and "system" in said
    assert "weights_only set to `False`" not in said and not marker.exists()


def test_export_refuses_a_crafted_checkpoint_in_one_line(tmp_path):
    marker = tmp_path / "MARKER"
    run = _run_with_crafted_checkpoint(tmp_path / "runs", marker)
    p = subprocess.run([sys.executable, "-m", "launch", "export", str(run), f"out={tmp_path / 'out'}"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr[-3000:]
    assert "mp_rank_00_model_states.pt: names" in p.stderr and "system" in p.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_resume_refuses_a_crafted_checkpoint_before_any_rank_starts(tmp_path):
    marker = tmp_path / "MARKER"
    runs = tmp_path / "runs"
    run = _run_with_crafted_checkpoint(runs, marker)
    p = subprocess.run(["bash", "launch/run.sh", str(TINY), f"run.resume={run}"], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "LAYOUTLAB_RUNS": str(runs)})
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("error: resume: ") and "mp_rank_00_model_states.pt: names" in line
    assert not marker.exists()
    assert sorted(d.name for d in (runs / "tiny_zero2").iterdir()) == [run.name]  # no run directory was made


def test_model_weights_must_be_safetensors_without_custom_code(tmp_path):
    marker = tmp_path / "MARKER"
    weights = tmp_path / "weights"
    _crafted(weights / "pytorch_model.bin", marker)
    (weights / "config.json").write_text((REPO / "launch/config/catalogue/models/tiny-llama.json").read_text())
    env = {**os.environ, "LAYOUTLAB_RUNS": str(tmp_path / "runs")}
    p = subprocess.run(["bash", "launch/run.sh", str(TINY), f"model.weights={weights}"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr[-3000:]
    assert "pickle-based weights (pytorch_model.bin)" in p.stderr and "save_pretrained" in p.stderr
    assert not marker.exists() and not (tmp_path / "runs").exists()
    (weights / "pytorch_model.bin").unlink()
    (weights / "model.safetensors").write_bytes(b"")
    config = json.loads((weights / "config.json").read_text())
    (weights / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "x.Model"}}))
    p = subprocess.run(["bash", "launch/run.sh", str(TINY), f"model.weights={weights}"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "auto_map" in p.stderr and not (tmp_path / "runs").exists(), p.stderr


def test_dcp_metadata_is_read_with_its_own_objects_only(tmp_path):
    """torch.distributed.checkpoint (the torch backend's checkpoints) unpickles `.metadata` with a bare pickle.load;
    ours reads it with DCP's own classes only. A real one loads; a crafted one is refused and never runs."""
    import pickle

    import torch.distributed.checkpoint as dcp

    real = tmp_path / "real"
    dcp.save({"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 5}, checkpoint_id=str(real), no_dist=True)
    meta = untrusted.read_dcp_metadata(real / ".metadata")
    assert tuple(meta.state_dict_metadata["model.w"].size) == (2, 3)
    untrusted.check([real])
    back = {"model": {"w": torch.zeros(2, 3)}}
    dcp.load(back, storage_reader=untrusted.dcp_reader(real), no_dist=True)
    assert back["model"]["w"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]

    marker = tmp_path / "MARKER"
    crafted = tmp_path / "crafted"
    crafted.mkdir()
    (crafted / ".metadata").write_bytes(pickle.dumps(Boom(marker)))
    with pytest.raises(untrusted.UntrustedFileError, match=r"\.metadata: names (posix|os)\.system"):
        untrusted.check([crafted])
    # DCP wraps what its reader raises in its CheckpointException (a BaseException); the refusal is what it says
    with pytest.raises(BaseException, match=r"\.metadata: names (posix|os)\.system"):
        dcp.load({"w": torch.zeros(1)}, storage_reader=untrusted.dcp_reader(crafted), no_dist=True)
    assert not marker.exists()
    (crafted / ".metadata").write_bytes(pickle.dumps(meta)[:40])  # truncated
    with pytest.raises(untrusted.UntrustedFileError, match="not readable"):
        untrusted.check([crafted])


def _torch_run_with_checkpoint(root):
    """A torch-backend run directory as ours looks, whose step-5 DCP checkpoint holds the seeded tiny model."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from launch.torchtools.hf import hf_config

    resolved = resolve_path(RECIPES / "tiny_fsdp2", [])
    run = root / "tiny_fsdp2" / "20261201-000000"
    (run / "checkpoints").mkdir(parents=True)
    (run / "resolved.json").write_text(resolved.to_json())
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(hf_config(resolved.model)).state_dict()
    dcp.save({"model": state}, checkpoint_id=str(run / "checkpoints" / "step5"), no_dist=True)
    write_marker(run / "checkpoints", "step5", marker_info(resolved, 5))
    return run, state


def test_export_of_a_damaged_dcp_checkpoint_is_one_line(tmp_path):
    """A whole DCP checkpoint exports the tensors it holds; the same with a truncated data file is one line, exit 2,
    and writes nothing."""
    from safetensors.torch import load_file

    run, state = _torch_run_with_checkpoint(tmp_path / "runs")
    good = tmp_path / "good"
    p = subprocess.run([sys.executable, "-m", "launch", "export", str(run), f"out={good}"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    back = load_file(good / "model.safetensors")
    assert set(back) == set(state) and all(torch.equal(back[k], v) for k, v in state.items())
    (data,) = sorted((run / "checkpoints" / "step5").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    bad = tmp_path / "bad"
    p = subprocess.run([sys.executable, "-m", "launch", "export", str(run), f"out={bad}"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr[-3000:]
    # named before any read, by the file and the item whose bytes it lacks
    assert f"{data}: 100 bytes, where the metadata places model." in p.stderr and "cut short" in p.stderr, p.stderr
    assert not bad.exists()


def test_a_dcp_checkpoint_is_checked_item_by_item_before_any_rank(tmp_path):
    """The pre-launch check read .metadata but not the .distcp shards: an item whose pickle names os.system, a shard
    cut short and a FIFO in a shard's place were met only on the ranks (the FIFO hung export for ever). Each is now
    one refusal naming the file, from the items' opcodes and the files' sizes; nothing is unpickled or opened."""
    import os

    import torch.distributed.checkpoint as dcp

    def saved(name, state):
        folder = tmp_path / name
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
        (data,) = sorted(folder.glob("*.distcp"))
        return folder, data

    ok, _ = saved("ok", {"model": {"w": torch.ones(4, 4)}, "step": 5})
    untrusted.check([ok])
    payload, _ = saved("payload", {"model": {"w": torch.ones(4, 4)}, "extra": os.system})
    with pytest.raises(untrusted.UntrustedFileError, match=r"extra names (posix|os)\.system"):
        untrusted.check([payload])
    cut, data = saved("cut", {"model": {"w": torch.ones(64, 64)}})
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(untrusted.UntrustedFileError, match=r"where the metadata places model\.w at bytes 0\+"):
        untrusted.check([cut])
    fifo, data = saved("fifo", {"model": {"w": torch.ones(4, 4)}})
    data.unlink()
    os.mkfifo(data)
    with pytest.raises(untrusted.UntrustedFileError, match="is a FIFO"):
        untrusted.check([fifo])


def test_a_dcp_data_file_named_with_a_nul_byte_is_refused_in_one_line(tmp_path):
    """A crafted .metadata whose data file name holds a NUL: Path.stat raised ValueError through the check."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "ckpt"
    dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=str(folder), no_dist=True)
    meta = untrusted.read_dcp_metadata(folder / ".metadata")
    for info in meta.storage_data.values():
        info.relative_path = "a\x00b.distcp"
    import pickle

    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(untrusted.UntrustedFileError, match="is not a file of this checkpoint folder"):
        untrusted.check([folder])
