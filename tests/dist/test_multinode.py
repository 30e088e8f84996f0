"""Beyond one launcher: two "nodes" on this machine through launch/slurm.sbatch (trained through, and stopped by
SLURM's time-limit signal, requeued and continued), and a group that torchrun restarts after a worker is killed. Each
must train exactly as the one-rank reference or the uninterrupted job does (fp32, gloo, loopback only)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from launch.run.checkpoints import complete_checkpoints
from launch.run.metrics import read_metrics
from tests.conftest import REPO
from tests.dist.conftest import SHORT, train
from tests.dist.test_deepspeed_checkpoint import no_rank_left

# -m full (CI): SLURM stand-in, requeue and elastic restart: features over the one-rank reference's layout.
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.full]
TOL = 1e-5

# Stands in for SLURM's srun on one machine: one task per node of the allocation, each with the variables srun
# sets for it, all started at once; like --kill-on-bad-exit, a task that fails ends the others (a node left alone
# would wait in the rendezvous for its join timeout). srun passes the USR1 it gets on to every task, each node's
# launcher seeing it at its own moment; this one passes it to the last node's only, the extreme of that: the other
# node's ranks stop only because all ranks vote.
FAKE_SRUN = r"""#!/usr/bin/env bash
printf '%s\n' "$@" > "$FAKE_SRUN_DIR/argv"
while [[ $1 == --* ]]; do shift; done
pids=()
trap 'forwarded=1; kill -USR1 "${pids[-1]}" 2>/dev/null || true' USR1
for n in $(seq 0 $((SLURM_NNODES - 1))); do
  SLURM_NODEID=$n SLURM_PROCID=$n SLURM_LOCALID=0 SLURM_STEP_NUM_NODES=$SLURM_NNODES "$@" \
    > "$FAKE_SRUN_DIR/node$n.out" 2> "$FAKE_SRUN_DIR/node$n.err" &
  pids+=($!)
done
rc=0
left=${#pids[@]}
while (( left > 0 )); do
  forwarded=0
  if wait -n; then left=$((left - 1)); continue; fi
  (( forwarded )) && continue  # the trap ended the wait, not a task
  left=$((left - 1)); rc=1; kill -TERM "${pids[@]}" 2>/dev/null || true
done
exit $rc
"""
# Stands in for SLURM's scontrol: records what it was asked.
FAKE_SCONTROL = r"""#!/usr/bin/env bash
printf '%s\n' "$*" >> "$FAKE_SRUN_DIR/scontrol"
"""


def free_slurm_job_id() -> int:
    """A job id whose derived rendezvous port (launch/run/nodes.py: 20000 + id mod 12000) is free on this machine."""
    import random
    import socket

    for _ in range(200):
        job = random.randrange(1, 12000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", 20000 + job))
            except OSError:
                continue
        return job
    raise AssertionError("no free port in 20000-31999")


@dataclass
class Job:
    root: Path  # runs/tiny_zero2/slurm-<job id>
    job: int
    rc: int
    said: str  # the batch script's output
    logs: str  # each node's output, as the stand-in srun kept it
    argv: list[str]  # srun's options and command

    def losses(self, rank: int) -> list[float]:
        return [s.loss for s in read_metrics(self.root / "metrics" / f"rank{rank}.jsonl").steps]


def sbatch(folder: Path, job: int, *, signal_when=None, env_extra: dict | None = None) -> Job:
    """launch/slurm.sbatch on tiny_zero2 SHORT over two nodes of this machine, as SLURM would run job `job`, with the
    stand-in srun and scontrol; `signal_when(root)` true: SLURM's time-limit warning (USR1 to the batch script)."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    runs = folder / "runs"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
                                                            "LAYOUTLAB_RUN_DIR", "LAYOUTLAB_CONTAINER")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_SRUN_DIR=str(folder), LAYOUTLAB_RUNS=str(runs),
               PYTHON=sys.executable, SLURM_JOB_ID=str(job), SLURM_NNODES="2", SLURM_JOB_NUM_NODES="2",
               SLURM_JOB_NODELIST="127.0.0.1,127.0.0.2", SLURM_SUBMIT_DIR=str(REPO), SLURM_JOB_CPUS_PER_NODE="2(x2)",
               **(env_extra or {}))
    root = runs / "tiny_zero2" / f"slurm-{job}"
    p = subprocess.Popen(["bash", "launch/slurm.sbatch", "recipes/tiny_zero2", "hardware.nodes=2", *SHORT], cwd=REPO,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while signal_when is not None and p.poll() is None and time.monotonic() < deadline:
        if signal_when(root):
            p.send_signal(signal.SIGUSR1)
            break
        time.sleep(0.02)
    try:
        said, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        said, _ = p.communicate()
    logs = "".join(f"--- node{n}.{s}\n" + (folder / f"node{n}.{s}").read_text()[-3000:]
                   for n in (0, 1) for s in ("out", "err") if (folder / f"node{n}.{s}").is_file())
    argv = folder / "argv"
    return Job(root, job, p.returncode, said, logs, argv.read_text().split("\n") if argv.is_file() else [])


@pytest.fixture(scope="module")
def slurm_job(tmp_path_factory) -> Job:
    """The two-node job trained through, no signal: the one-rank reference's equal, and the interrupted job's."""
    folder = tmp_path_factory.mktemp("slurm")
    t = sbatch(folder, free_slurm_job_id())
    assert t.rc == 0, t.said[-2000:] + t.logs
    return t


def test_two_slurm_nodes_train_like_one_rank(slurm_job, one_rank_reference):
    argv = slurm_job.argv
    assert argv[:6] == ["--ntasks-per-node=1", "--nodes=2", "--kill-on-bad-exit=1", "--label", "--cpus-per-task=2",
                        "--mem=0"], argv
    # One run directory for the job, named after it, written by both nodes.
    root, job = slurm_job.root, slurm_job.job
    assert sorted(x.name for x in (root / "metrics").iterdir()) == [f"rank{r}.jsonl" for r in range(4)]
    cmd1 = (root / "launch_cmd_node1.txt").read_text()
    assert f"--node-rank 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{20000 + job} --rdzv-id {job}" in cmd1, cmd1
    assert "--node-rank 0 " in (root / "launch_cmd.txt").read_text()
    assert (root / "env_node1.json").is_file() and (root / "env.json").is_file()
    ref = one_rank_reference.losses()
    for rank in range(4):
        losses = slurm_job.losses(rank)
        assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) <= TOL, (rank, losses, ref)
    assert no_rank_left(root)


def ranks_started(root: Path) -> bool:
    """Rank 0 opened its log: its launcher catches the signal. Signalled then, the ranks stop at one of the first
    steps, and the stop never races the end of this 10-step run (about 50 ms a step here)."""
    return (root / "logs" / "rank0.out").is_file()


def test_a_time_limit_signal_saves_requeues_and_the_requeued_job_trains_on_alike(tmp_path, slurm_job):
    job = free_slurm_job_id()
    first = sbatch(tmp_path, job, signal_when=ranks_started)
    assert first.rc == 0, first.said[-2000:] + first.logs
    # All ranks agreed on one step (node 0's launcher never got the signal), saved it and ended; the batch script
    # asked SLURM to requeue the job.
    assert (tmp_path / "scontrol").read_text().splitlines() == [f"requeue {job}"], first.said[-2000:]
    [saved] = [c.step for c in complete_checkpoints(first.root / "checkpoints")]
    assert 1 <= saved < 10, saved
    assert f"stopped at step {saved} of 10 on SIGUSR1" in first.logs, first.logs
    for rank in range(4):
        assert [s.step for s in read_metrics(first.root / "metrics" / f"rank{rank}.jsonl").steps] == \
            list(range(1, saved + 1))
    assert no_rank_left(first.root)
    # SLURM starts the requeued job with its id, so its run directory, and no signal this time.
    second = sbatch(tmp_path, job, env_extra={"SLURM_RESTART_COUNT": "1"})
    assert second.rc == 0, second.said[-2000:] + second.logs
    assert second.root == first.root
    assert len((tmp_path / "scontrol").read_text().splitlines()) == 1  # not requeued again
    assert re.search(rf"resumed from \S+step{saved} at step {saved}", (second.root / "logs" / "rank0.out").read_text())
    for rank in range(4):
        metas = [r for r in map(json.loads, (second.root / "metrics" / f"rank{rank}.jsonl").read_text().splitlines())
                 if r["kind"] == "meta"]
        assert [(m["start_step"], m["resumed_from"] is not None) for m in metas] == [(0, False), (saved, True)]
        resumed, uninterrupted = second.losses(rank), slurm_job.losses(rank)
        assert max(abs(a - b) for a, b in zip(resumed, uninterrupted, strict=True)) <= 1e-6, (rank, resumed,
                                                                                              uninterrupted)
    assert no_rank_left(second.root)


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
