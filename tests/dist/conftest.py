"""Real runs through `bash launch/run.sh`, on gloo CPU ranks, each in its own runs/ folder."""
import os
import socket
import subprocess
from pathlib import Path

import pytest

from launch.metrics import read_metrics
from tests.conftest import REPO

TINY = "recipes/tiny_zero2"
# Short, deterministic fp32 runs: the parity tests compare them to 1e-5.
SHORT = ("train.steps=10", "train.warmup_steps=2", "train.lr_warmup_steps=2", "train.checkpoint_every=0",
         "batch.seq_len=32", "batch.global_batch_size=8", "train.lr=3e-3")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Trained:
    def __init__(self, root: Path, proc: subprocess.CompletedProcess):
        self.root, self.proc = root, proc

    def metrics(self, rank: int = 0):
        return read_metrics(self.root / "metrics" / f"rank{rank}.jsonl")

    def losses(self, rank: int = 0) -> list[float]:
        return [s.loss for s in self.metrics(rank).steps]


def train(runs: Path, *overrides: str, recipe: str = TINY, timeout: int = 300, check: bool = True,
          env_extra: dict | None = None) -> Trained:
    env = {**os.environ, "LAYOUTLAB_RUNS": str(runs), "MASTER_PORT": str(free_port()), **(env_extra or {})}
    before = set(runs.glob("*/*")) if runs.exists() else set()
    p = subprocess.run(["bash", "launch/run.sh", recipe, *overrides], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=timeout)
    new = sorted(set(runs.glob("*/*")) - before)
    assert len(new) == 1, (p.stdout[-3000:], p.stderr[-3000:])
    t = Trained(new[0], p)
    if check:
        logs = "".join((new[0] / "logs" / f).read_text()[-3000:] for f in sorted(os.listdir(new[0] / "logs")))
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:] + logs
    return t


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="session")
def one_rank_reference(runs_root) -> Trained:
    """tiny_zero2 SHORT on one rank, ZeRO-0, the whole global batch in two micro-batches: the oracle that every
    layout, launcher and restart of the same global batch must reproduce (fp32, to 1e-5)."""
    t = train(runs_root / "ref", *SHORT, "hardware.gpus_per_node=1", "batch.micro_batch_size=4",
              "parallel.zero_stage=0")
    losses = t.losses()
    assert len(losses) == 10
    t.norms = [s.grad_norm for s in t.metrics().steps]
    assert all(n is not None and n > 0 for n in t.norms)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, f"loss did not fall: {losses}"
    return t
