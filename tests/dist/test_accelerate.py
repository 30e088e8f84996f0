"""`python -m launch export-accelerate` + `accelerate launch`: the same training as run.sh, started by Accelerate."""
import json
import os
import subprocess
import sys

import pytest

from launch.run.metrics import read_metrics
from tests.conftest import REPO
from tests.dist.conftest import SHORT
from tests.dist.test_deepspeed_checkpoint import no_rank_left

# -m full (CI): the Accelerate launch: a feature over tiny_zero2's layout.
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.full]
TOL = 1e-5


def test_accelerate_launch_trains_like_run_sh(tmp_path, one_rank_reference):
    out = tmp_path / "acc"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "LAYOUTLAB_RUN_DIR")}
    p = subprocess.run([sys.executable, "-m", "launch", "export-accelerate", "recipes/tiny_zero2", *SHORT,
                        f"out={out}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    command = p.stdout.strip().splitlines()[-1]
    assert " accelerate launch --config_file " in f" {command}" and command.endswith(f"-m launch.ranks.train {out}"), command

    # Accelerate's own reader takes the file: a DeepSpeed plugin built from the resolved JSON, 2 processes.
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DeepSpeedPlugin

    config = load_config_from_file(str(out / "accelerate_config.yaml"))
    assert (config.distributed_type, config.num_processes, config.num_machines) == ("DEEPSPEED", 2, 1)
    ds_path = config.deepspeed_config["deepspeed_config_file"]
    assert json.loads(open(ds_path).read()) == json.loads((out / "resolved.json").read_text())["ds_config"]
    plugin = DeepSpeedPlugin(hf_ds_config=ds_path)
    assert plugin.zero_stage == 2
    assert plugin.deepspeed_config["train_batch_size"] == 8

    # The printed command, as a user pastes it.
    run = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    logs = "".join((out / "logs" / f).read_text()[-2000:] for f in sorted(os.listdir(out / "logs")))
    assert run.returncode == 0, run.stderr[-3000:] + logs
    ref = one_rank_reference.losses()
    for rank in (0, 1):
        losses = [s.loss for s in read_metrics(out / "metrics" / f"rank{rank}.jsonl").steps]
        assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) <= TOL, (rank, losses, ref)
    assert no_rank_left(out)
