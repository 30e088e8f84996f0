"""Beyond one launcher: two "nodes" on this machine through launch/slurm.sbatch, and a group that torchrun restarts
after a worker is killed. Both must train exactly as the one-rank reference does (fp32, gloo, loopback only)."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from launch.run.metrics import read_metrics
from tests.conftest import REPO
from tests.dist.conftest import SHORT, train
from tests.dist.test_deepspeed_checkpoint import no_rank_left

pytestmark = [pytest.mark.dist, pytest.mark.slow]
TOL = 1e-5

# Stands in for SLURM's srun on one machine: one task per node of the allocation, each with the variables srun
# sets for it, all started at once; like --kill-on-bad-exit, a task that fails ends the others (a node left alone
# would wait in the rendezvous for its join timeout).
FAKE_SRUN = r"""#!/usr/bin/env bash
printf '%s\n' "$@" > "$FAKE_SRUN_DIR/argv"
while [[ $1 == --* ]]; do shift; done
pids=()
for n in $(seq 0 $((SLURM_NNODES - 1))); do
  SLURM_NODEID=$n SLURM_PROCID=$n SLURM_LOCALID=0 SLURM_STEP_NUM_NODES=$SLURM_NNODES "$@" \
    > "$FAKE_SRUN_DIR/node$n.out" 2> "$FAKE_SRUN_DIR/node$n.err" &
  pids+=($!)
done
rc=0
for _ in "${pids[@]}"; do
  if ! wait -n; then rc=1; kill -TERM "${pids[@]}" 2>/dev/null || true; fi
done
exit $rc
"""


def free_slurm_job_id() -> int:
    """A job id whose derived rendezvous port (launch/run/nodes.py: 20000 + id mod 20000) is free on this machine."""
    import random
    import socket

    for _ in range(200):
        job = random.randrange(1, 20000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", 20000 + job))
            except OSError:
                continue
        return job
    raise AssertionError("no free port in 20000-39999")


def test_two_slurm_nodes_train_like_one_rank(tmp_path, one_rank_reference):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    job = free_slurm_job_id()
    port = 20000 + job
    runs = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
                                                            "LAYOUTLAB_RUN_DIR")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_SRUN_DIR=str(tmp_path), LAYOUTLAB_RUNS=str(runs),
               PYTHON=sys.executable, SLURM_JOB_ID=str(job), SLURM_NNODES="2", SLURM_JOB_NUM_NODES="2",
               SLURM_JOB_NODELIST="127.0.0.1,127.0.0.2", SLURM_SUBMIT_DIR=str(REPO))
    p = subprocess.Popen(["bash", "launch/slurm.sbatch", "recipes/tiny_zero2", "hardware.nodes=2", *SHORT], cwd=REPO,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        said, _ = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        said, _ = p.communicate()

    def node_logs():
        return "".join(f"--- node{n}.{s}\n" + (tmp_path / f"node{n}.{s}").read_text()[-3000:]
                       for n in (0, 1) for s in ("out", "err") if (tmp_path / f"node{n}.{s}").is_file())
    assert p.returncode == 0, said[-2000:] + node_logs()
    argv = (tmp_path / "argv").read_text().split("\n")
    assert argv[:4] == ["--ntasks-per-node=1", "--nodes=2", "--kill-on-bad-exit=1", "--label"], argv
    # One run directory for the job, named after it, written by both nodes.
    root = runs / "tiny_zero2" / f"slurm-{job}"
    assert sorted(x.name for x in (root / "metrics").iterdir()) == [f"rank{r}.jsonl" for r in range(4)]
    cmd1 = (root / "launch_cmd_node1.txt").read_text()
    assert f"--node-rank 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} --rdzv-id {job}" in cmd1, cmd1
    assert "--node-rank 0 " in (root / "launch_cmd.txt").read_text()
    assert (root / "env_node1.json").is_file() and (root / "env.json").is_file()
    ref = one_rank_reference.losses()
    for rank in range(4):
        losses = [s.loss for s in read_metrics(root / "metrics" / f"rank{rank}.jsonl").steps]
        assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) <= TOL, (rank, losses, ref)
    assert no_rank_left(root)


def test_killed_worker_restarts_the_group_and_training_continues(runs_root, one_rank_reference):
    t = train(runs_root / "elastic", *SHORT, "train.checkpoint_every=3", "run.max_restarts=1",
              env_extra={"LAYOUTLAB_FAULT": "kill:1:5"}, timeout=400)
    # Rank 1 died by SIGKILL at the start of step 5; torchrun ended rank 0, started both again, and they resumed
    # from the step-3 checkpoint.
    assert (t.root / "logs" / "fault_kill_rank1_step5").is_file()
    log = (t.root / "logs" / "rank0.out").read_text()
    assert re.search(r"resumed from \S+step3\S* at step 3", log), log[-2000:]
    records = [json.loads(line) for line in (t.root / "metrics" / "rank0.jsonl").read_text().splitlines()]
    metas = [r for r in records if r["kind"] == "meta"]
    assert [(m["start_step"], m["resumed_from"] is not None) for m in metas] == [(0, False), (3, True)], metas
    ref = one_rank_reference.losses()
    for rank in (0, 1):
        losses = t.losses(rank)
        assert [s.step for s in t.metrics(rank).steps] == list(range(1, 11))
        assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) <= TOL, (rank, losses, ref)
    assert no_rank_left(t.root)
