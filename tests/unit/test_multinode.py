"""Multi-node launch without a cluster: node placement from the user's or SLURM's variables, the per-node commands
(torchrun, and DeepSpeed's runner against DeepSpeed's own PDSH command builder), and bad input in one line."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch.commands.render import node_lines
from launch.config.resolve import resolve_path
from launch.errors import ConfigError
from launch.run import launcher, nodes
from launch.run.nodes import shared_run_dir
from tests.conftest import REPO

TWO_NODES = ("hardware.nodes=2",)


def tiny(*overrides):
    return resolve_path(REPO / "recipes/tiny_zero2", [*TWO_NODES, *overrides])


def slurm_env(node: int, **extra) -> dict:
    """What srun sets for one task per node on a 2-node allocation (job 4242 on cpu01, cpu02)."""
    return {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": str(node),
            "SLURM_PROCID": str(node), "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "cpu[01-02]", **extra}


@pytest.mark.parametrize("nodelist, hosts", [
    ("cpu[01-02]", ["cpu01", "cpu02"]),
    ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
    ("r[1-2]n[8-9]", ["r1n8", "r1n9", "r2n8", "r2n9"]),
    ("node7", ["node7"]),
    ("a[098-101]", ["a098", "a099", "a100", "a101"]),
])
def test_slurm_host_lists_expand_as_scontrol_show_hostnames_does(nodelist, hosts):
    assert nodes.expand_hostlist(nodelist) == hosts


def test_slurm_nodes_derive_rank_address_port_and_run_dir_without_exports(monkeypatch, tmp_path):
    monkeypatch.setenv("LAYOUTLAB_RUNS", str(tmp_path))
    r = tiny()
    for node in (0, 1):
        argv = launcher.build(r, "RUN", environ=slurm_env(node)).argv
        i = argv.index("--node-rank")
        # 20000 + 4242 mod 12000: both nodes reach the same port without talking.
        assert argv[i:i + 8] == ("--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", "cpu01:24242",
                                 "--rdzv-id", "4242")
        assert shared_run_dir(r, slurm_env(node)) == str(tmp_path / "tiny_zero2" / "slurm-4242")
    # What the user exported wins over SLURM's values.
    argv = launcher.build(r, "RUN", environ=slurm_env(1, NODE_RANK="0", MASTER_ADDR="10.0.0.9",
                                                      MASTER_PORT="31000")).argv
    assert "--node-rank 0 --rdzv-backend c10d --rdzv-endpoint 10.0.0.9:31000" in " ".join(argv)
    # One node, outside SLURM: a fresh run directory of its own.
    assert shared_run_dir(resolve_path(REPO / "recipes/tiny_zero2"), {}) is None


def test_torchrun_node_commands_name_their_node_rank():
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600"}
    per_node = launcher.node_commands(tiny(), "RUN", environ=env)
    assert [nc.node_rank for nc in per_node] == [0, 1]
    for nc in per_node:
        assert nc.command.env["NODE_RANK"] == str(nc.node_rank)
        assert f"--nnodes 2 --nproc-per-node 2 --node-rank {nc.node_rank} " in nc.command.shell()
        assert "--rdzv-endpoint 10.0.0.1:29600" in nc.command.shell()


def test_dry_run_prints_one_command_per_node():
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "NODE_RANK", "SLURM_JOB_ID")}
    p = subprocess.run(["bash", "launch/run.sh", "recipes/tiny_zero2", "hardware.nodes=2", "--dry-run"], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    lines = [line for line in p.stdout.splitlines() if line.startswith("  node ") and "torch.distributed.run" in line]
    assert [line.split(":")[0] for line in lines] == ["  node 0", "  node 1"]
    for n, line in enumerate(lines):
        assert f"NODE_RANK={n} " in line and f"--node-rank {n} " in line


def test_thousands_of_nodes_are_summarised():
    from launch.config.grid import RankGrid, shown_nodes

    assert shown_nodes(3) == [0, 1, 2] and shown_nodes(4000) == [0, 1, 2, 3999]
    per_node = [launcher.NodeCommand(n, None, launcher.LaunchCommand(("torchrun", f"--node-rank={n}"), {}))
                for n in shown_nodes(4000)]
    lines = node_lines(per_node)
    assert [line.split(":")[0].strip() for line in lines] == ["node 0", "node 1", "node 2", "... nodes 3-3998",
                                                              "node 3999"]
    assert lines[-1].endswith("--node-rank=3999")
    grid = RankGrid(1, 1, 32000, 8, 4000).describe()
    assert len(grid) == 6 and grid[4].startswith("  ... nodes 3-3998")
    assert grid[5].startswith("  node 3999: 31992:(t0,d31992,p0) ") and grid[5].endswith("31999:(t0,d31999,p0)")


def test_dry_run_of_4000_nodes_is_quick_and_short():
    import time

    t0 = time.perf_counter()
    p = subprocess.run(["bash", "launch/run.sh", "recipes/7b_zero3_ac", "hardware.nodes=4000", "hardware.gpus_per_node=8",
                        "batch.global_batch_size=32000", "batch.micro_batch_size=1", "--dry-run"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr
    # 9.6 s and 4,047 lines before the summary; a loaded 2-core machine takes about 0.5 s now
    assert len(p.stdout.splitlines()) < 80 and seconds < 8, (len(p.stdout.splitlines()), seconds)


def test_deepspeed_node_commands_equal_what_deepspeeds_runner_builds(tmp_path, monkeypatch):
    """The oracle is DeepSpeed's own runner.main with a hostfile: only pdsh itself (and the ssh check) is replaced,
    so its PDSHRunner builds the command it would start; each node's part, `%n` filled in, must be ours."""
    import shutil

    import deepspeed.launcher.runner as ds_runner

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# the cluster\nhostA slots=2\n\nhostB slots=4\nhostC slots=2\n")
    env = {"LAYOUTLAB_HOSTFILE": str(hostfile), "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29700"}
    r = tiny("run.launcher=deepspeed")
    runner_cmd = launcher.build(r, "/shared/runs/x", environ=env)
    per_node = launcher.node_commands(r, "/shared/runs/x", environ=env)
    assert [(nc.node_rank, nc.host) for nc in per_node] == [(0, "hostA"), (1, "hostB")]
    # What our runner command leaves in its files: the ranks' environment, for DeepSpeed to export to every host.
    env_file = runner_cmd.env["DS_ENV_FILE"]
    assert runner_cmd.files[env_file].splitlines() == [f"{k}={v}" for k, v in runner_cmd.env.items()
                                                       if k != "DS_ENV_FILE"]
    env_path = tmp_path / "deepspeed_env"
    env_path.write_text(runner_cmd.files[env_file])

    started = []

    class Started:
        returncode = 0

        def __init__(self, cmd, env=None):
            started.append(cmd)

        def wait(self):
            return 0

    monkeypatch.setattr(ds_runner.subprocess, "Popen", Started)
    monkeypatch.setattr(ds_runner.subprocess, "check_call", lambda *a, **k: 0)  # the ssh reachability check
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: f"/usr/bin/{name}")
    monkeypatch.setenv("DS_ENV_FILE", str(env_path))
    monkeypatch.setattr(ds_runner, "DEEPSPEED_ENVIRONMENT_NAME", str(env_path))  # read at import time
    monkeypatch.chdir(tmp_path)
    argv = list(runner_cmd.argv)
    assert argv[1:3] == ["-m", "deepspeed.launcher.runner"]
    ds_runner.main(argv[3:])
    assert len(started) == 1
    cmd = started[0]
    assert cmd[:6] == ["pdsh", "-S", "-f", "1024", "-w", "hostA,hostB"]
    exports = cmd[6]
    for k, v in runner_cmd.env.items():
        if k != "DS_ENV_FILE":
            assert f"export {k}={v};" in exports, (k, exports)
    at = cmd.index(sys.executable)
    theirs = cmd[at:]
    for nc in per_node:
        filled = [a.replace("%n", str(nc.node_rank)) for a in theirs]
        assert filled == list(nc.command.argv)
    # The world DeepSpeed encodes: each host's first gpus_per_node slots.
    info = next(a for a in theirs if a.startswith("--world_info="))
    import base64

    assert json.loads(base64.urlsafe_b64decode(info.split("=", 1)[1])) == {"hostA": [0, 1], "hostB": [0, 1]}


def one_line_exit_2(*args, env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in ("NODE_RANK", "MASTER_ADDR")}
    p = subprocess.run(["bash", "launch/run.sh", "recipes/tiny_zero2", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env={**env, "LAYOUTLAB_RUNS": "/nonexistent/never-created", **env_extra})
    assert p.returncode == 2, (p.stdout[-1500:], p.stderr[-1500:])
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    return p.stderr.strip()


def test_bad_multinode_input_is_one_line_and_exit_2(tmp_path):
    err = one_line_exit_2("hardware.nodes=2", env_extra=slurm_env(0, SLURM_NNODES="3", SLURM_JOB_NUM_NODES="3"))
    assert "hardware.nodes=2" in err and "SLURM_NNODES" in err and "--nodes=2" in err
    err = one_line_exit_2("hardware.nodes=2", env_extra={"NODE_RANK": "2", "MASTER_ADDR": "127.0.0.1"})
    assert "NODE_RANK=2" in err and "out of range" in err and "0..1" in err
    err = one_line_exit_2("hardware.nodes=2", env_extra={"NODE_RANK": "one", "MASTER_ADDR": "127.0.0.1"})
    assert 'NODE_RANK="one"' in err and "whole number" in err
    err = one_line_exit_2("hardware.nodes=2", env_extra={})
    assert "needs MASTER_ADDR" in err
    err = one_line_exit_2("--dry-run", env_extra={"MASTER_PORT": "99999"})
    assert 'MASTER_PORT="99999" is not a TCP port' in err
    err = one_line_exit_2("hardware.nodes=2", env_extra=slurm_env(0, SLURM_JOB_NODELIST="cpu[01-x]"))
    assert "SLURM_JOB_NODELIST" in err and "not N or N-M" in err
    few = tmp_path / "hosts"
    few.write_text("hostA slots=2\n")
    err = one_line_exit_2("hardware.nodes=2", "run.launcher=deepspeed", env_extra={"LAYOUTLAB_HOSTFILE": str(few)})
    assert f"{few}: hosts=1 are fewer than hardware.nodes=2" in err
    few.write_text("hostA slots=2\nhostB slots=1\n")
    err = one_line_exit_2("hardware.nodes=2", "run.launcher=deepspeed", env_extra={"LAYOUTLAB_HOSTFILE": str(few)})
    assert f"{few}:2: hostB slots=1 is fewer than hardware.gpus_per_node=2" in err
    few.write_text("hostA slots=2\nhostB\n")
    err = one_line_exit_2("hardware.nodes=2", "run.launcher=deepspeed", env_extra={"LAYOUTLAB_HOSTFILE": str(few)})
    assert f"{few}:2: line=\"hostB\" is not `host slots=N`" in err
    assert not os.path.exists("/nonexistent/never-created")


@pytest.mark.parametrize("overrides, message", [
    (("run.max_restarts=1", "run.launcher=deepspeed"), "needs torchrun's elastic agent"),
    (("run.max_restarts=1", "run.resume=never"), "set run.resume=auto"),
    (("run.max_restarts=101",), "must be between 0 and 100"),
    (("run.max_restarts=-1",), "must be between 0 and 100"),
])
def test_restarts_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        resolve_path(REPO / "recipes/tiny_zero2", list(overrides))


def test_restarts_without_checkpoints_are_warned_about():
    r = resolve_path(REPO / "recipes/tiny_zero2", ["run.max_restarts=2", "train.checkpoint_every=0"])
    assert any("trains again from step 0" in w for w in r.warnings)
    assert "--max-restarts 2" in launcher.build(r, "RUN", environ={}).shell()


def test_a_restarted_run_replaces_the_steps_it_trained_again(tmp_path):
    import launch.run.metrics as M
    from analysis.parsers.metrics import parse_metrics
    from launch.run.metrics import read_metrics

    path = tmp_path / "rank0.jsonl"
    lines = []

    base = dict(kind="meta", schema_version=M.SCHEMA_VERSION, rank=0, world_size=2, tp=1, pp=1, dp=2, recipe="tiny_zero2",
                backend="deepspeed", hardware_profile="cpu", device="cpu", peak_flops_per_device=1e12,
                flops_per_token=1e6, flops_formula="6N", tokens_per_step=512, warmup_steps=0, zero_stage=2,
                dtype="fp32", micro_batch_size=4, global_batch_size=8, seq_len=64, param_numel_local=1000,
                start_step=0, resumed_from=None)
    step = dict(kind="step", lr=1e-3, grad_norm=1.0, step_time_s=0.1, tokens_per_s=10.0, mfu=0.0, warmup=False,
                tokens_per_s_per_device=5.0, tflops_per_device=0.0)
    lines.append(base)
    lines += [{**step, "step": n, "loss": 10.0 - n} for n in (1, 2, 3, 4)]
    lines.append({**base, "start_step": 3, "resumed_from": "ckpt/step3"})
    lines += [{**step, "step": n, "loss": 20.0 - n} for n in (4, 5)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    m = read_metrics(path)
    assert [(s.step, s.loss) for s in m.steps] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 16.0), (5, 15.0)]
    assert m.warnings == ()
    t = parse_metrics(tmp_path)
    assert [(row["step"], row["loss"]) for row in t.rows()] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 16.0), (5, 15.0)]
    assert any("continues from step 3" in w and "1 step(s)" in w for w in t.warnings)


def test_a_version_1_meta_record_reads_its_world_as_world_size(tmp_path):
    """Schema version 1 named the world size `world`; run directories written then stay readable."""
    from launch.run.metrics import read_metrics

    meta = dict(kind="meta", schema_version=1, rank=1, world=4, tp=2, pp=1, dp=2, recipe="tiny_zero2",
                backend="deepspeed", hardware_profile="cpu", device="cpu", peak_flops_per_device=1e12,
                flops_per_token=1e6, flops_formula="6N", tokens_per_step=512, warmup_steps=0, zero_stage=2,
                dtype="fp32", micro_batch_size=4, global_batch_size=8, seq_len=64, param_numel_local=1000,
                start_step=0, resumed_from=None)
    (tmp_path / "rank1.jsonl").write_text(json.dumps(meta) + "\n")
    m = read_metrics(tmp_path / "rank1.jsonl")
    assert m.warnings == () and (m.meta.world_size, m.meta.rank) == (4, 1)
    (tmp_path / "rank1.jsonl").write_text(json.dumps({**meta, "schema_version": 0}) + "\n")
    assert read_metrics(tmp_path / "rank1.jsonl").meta is None  # an unknown version is still refused


# ZeRO-3 that gathers every parameter on every use (no persistent parameters, no reuse across forward and
# backward): the case where ZeRO++ hpZ changes the traffic. The tiny model's default base keeps every parameter.
GATHER_EVERY_USE = f"deepspeed.config={REPO / 'tests/fixtures/ds/zero3_gather_every_use.json'}"
HPZ_LAYOUT = ("parallel.zero_stage=3", "hardware.gpus_per_node=4", "batch.micro_batch_size=2", GATHER_EVERY_USE)


def test_hpz_moves_the_backward_gathers_into_its_group_and_adds_the_secondary_partition():
    from launch.plan.build import plan_resolved

    plain = plan_resolved(resolve_path(REPO / "recipes/tiny_zero2", list(HPZ_LAYOUT)))
    hpz = plan_resolved(resolve_path(REPO / "recipes/tiny_zero2", [*HPZ_LAYOUT, "parallel.zero_hpz_partition_size=2"]))
    gathers = lambda plan: [(c.group_size, c.calls_per_step) for c in plan.comm  # noqa: E731
                            if c.collective == "all_gather" and not c.after_step]
    [(group, calls)] = gathers(plain)
    assert group == 4
    # Forward over the data-parallel group, the backward re-gather within the secondary group, half the calls each.
    assert gathers(hpz) == [(4, calls // 2), (2, calls // 2)]
    params = 213_568  # tiny-llama, hand-counted in test_calibration.py
    extra = hpz.ranks[0].memory["deepspeed"].weights - plain.ranks[0].memory["deepspeed"].weights
    assert extra == 4 * params // 2  # fp32: the secondary partition of every parameter over 2 ranks
    # The paper's accounting has no hpZ.
    assert hpz.ranks[0].memory["zero_paper"] == plain.ranks[0].memory["zero_paper"]


@pytest.mark.parametrize("overrides, message", [
    (("parallel.zero_hpz_partition_size=2", "parallel.zero_stage=2", "hardware.gpus_per_node=4",
      "batch.micro_batch_size=2"), "needs parallel.zero_stage=3"),
    (("parallel.zero_hpz_partition_size=2", "parallel.zero_stage=3", "hardware.gpus_per_node=4", "parallel.tp=2"),
     "needs tp = pp = 1"),
    (("parallel.zero_hpz_partition_size=3", "parallel.zero_stage=3", "hardware.gpus_per_node=4",
      "batch.micro_batch_size=2"), "does not divide the data-parallel size 4"),
    (("parallel.zero_hpz_partition_size=2", "parallel.zero_stage=1", "backend=megatron"),
     'needs backend = "deepspeed"'),
    (("parallel.zero_hpz_partition_size=0",), "must be at least 1"),
])
def test_hpz_that_cannot_work_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        resolve_path(REPO / "recipes/tiny_zero2", list(overrides))


def test_hpz_reaches_the_deepspeed_config_and_warns_when_its_groups_cross_nodes():
    r = resolve_path(REPO / "recipes/tiny_zero2", ["parallel.zero_stage=3", "hardware.gpus_per_node=4",
                                                   "batch.micro_batch_size=2", "parallel.zero_hpz_partition_size=4"])
    assert r.ds_config["zero_optimization"]["zero_hpz_partition_size"] == 4
    assert "zero_hpz_partition_size" not in resolve_path(REPO / "recipes/tiny_zero2").ds_config["zero_optimization"]
    r = resolve_path(REPO / "recipes/tiny_zero2", ["parallel.zero_stage=3", "hardware.nodes=2", "batch.micro_batch_size=1",
                                                   "parallel.zero_hpz_partition_size=4"])
    assert any("secondary groups cross nodes" in w for w in r.warnings)


def test_a_one_node_run_inside_a_slurm_allocation_keeps_its_own_port_and_run_directory():
    r = resolve_path(REPO / "recipes/tiny_zero2")
    env = slurm_env(1)  # a one-node recipe started on the second node of a 2-node allocation
    launcher.preflight(r, environ=env)  # neither "out of range" nor "does not match SLURM_NNODES"
    argv = launcher.build(r, "RUN", environ=env).argv
    endpoint = argv[argv.index("--rdzv-endpoint") + 1]
    assert endpoint == "127.0.0.1:0"  # torchrun binds a free port itself, not the job's
    assert shared_run_dir(r, env) is None


def test_a_port_chosen_ahead_of_its_launcher_lies_below_the_ephemeral_range():
    """DeepSpeed's runner must be told its port; one chosen by binding port 0 sits in the range every other
    process's gloo sockets are drawn from, and CI lost a run to one taken in the seconds before the launcher bound it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    r = resolve_path(REPO / "recipes/tiny_zero2", ["run.launcher=deepspeed"])
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "SLURM_JOB_ID")}
    ports = []
    for _ in range(20):
        argv = launcher.build(r, "RUN", environ=env).argv
        ports.append(int(argv[argv.index("--master_port") + 1]))
    assert all(20000 <= port < low for port in ports), ports
    assert len(set(ports)) > 1  # drawn at random, so two jobs starting together rarely meet


def test_an_empty_hostfile_is_refused_in_one_line(tmp_path):
    empty = tmp_path / "hosts"
    empty.write_text("# no hosts yet\n\n")
    err = one_line_exit_2("hardware.nodes=2", "run.launcher=deepspeed", "--dry-run",
                          env_extra={"LAYOUTLAB_HOSTFILE": str(empty), "MASTER_ADDR": ""})
    assert "hosts=0 are listed nowhere in it" in err


def test_the_deepspeed_launcher_is_refused_under_a_multi_node_slurm_job():
    r = tiny("run.launcher=deepspeed")
    with pytest.raises(ConfigError, match="under SLURM starts the job once per node"):
        launcher.preflight(r, environ={**slurm_env(0), "LAYOUTLAB_HOSTFILE": "/nonexistent"})


GPU_RECIPE = ("hardware.profile=h100-sxm",)  # tiny_zero2 on 2 GPUs (hardware.gpus_per_node=2)


@pytest.mark.parametrize("granted, refused", [
    ({}, 'SLURM_GPUS_ON_NODE="" gives this SLURM job 0 GPU(s) on this node'),
    ({"SLURM_GPUS_ON_NODE": "1"}, 'SLURM_GPUS_ON_NODE="1" gives this SLURM job 1 GPU(s)'),
    ({"SLURM_GPUS_PER_NODE": "h100:1", "CUDA_VISIBLE_DEVICES": "0,1"}, 'SLURM_GPUS_PER_NODE="h100:1" gives'),
    ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, 'CUDA_VISIBLE_DEVICES="NoDevFiles" gives this SLURM job 0 GPU(s)'),
    ({"SLURM_GPUS_ON_NODE": "two"}, 'SLURM_GPUS_ON_NODE="two" is not a GPU count'),
    ({"SLURM_GPUS_ON_NODE": "2"}, None),
    ({"SLURM_GPUS_PER_NODE": "h100:2"}, None),
    ({"CUDA_VISIBLE_DEVICES": "4,5"}, None),
])
def test_a_slurm_job_granted_fewer_gpus_than_the_recipe_needs_is_refused(granted, refused):
    """Under SLURM every /dev/nvidiaN of the node exists whatever the job was granted: SLURM's own count decides."""
    r = resolve_path(REPO / "recipes/tiny_zero2", list(GPU_RECIPE))
    env = {"SLURM_JOB_ID": "4242", **granted}
    if refused is None:
        launcher.preflight(r, environ=env)
        return
    with pytest.raises(ConfigError, match=re.escape(refused)) as e:
        launcher.preflight(r, environ=env)
    assert "--gpus-per-node=2" in str(e.value) or "not a GPU count" in str(e.value)
    # A CPU-rank recipe needs no GPU, granted or not.
    launcher.preflight(resolve_path(REPO / "recipes/tiny_zero2"), environ=env)


def test_a_gpu_job_without_gpus_exits_2_in_one_line_before_any_rank_starts():
    err = one_line_exit_2(*GPU_RECIPE, env_extra={"SLURM_JOB_ID": "4242"})
    assert err.startswith('error: environment: SLURM_GPUS_ON_NODE="" gives this SLURM job 0 GPU(s)'), err
    assert "sbatch --gpus-per-node=2" in err


# Stands in for the launcher (torchrun): says where the stop request will appear and whether SIGUSR1 is ignored, then
# waits for the request and exits 0, as the ranks do after their checkpoint.
STOPPABLE = r"""
import os, signal, sys, time
from pathlib import Path
path = os.environ["LAYOUTLAB_STOP_REQUEST"]
Path(sys.argv[1]).write_text(path + " " + str(signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN))
t = time.monotonic()
while not os.path.exists(path):
    if time.monotonic() - t > 30:
        sys.exit(3)
    time.sleep(0.02)
sys.exit(0)
"""


def test_the_stop_signal_reaches_the_ranks_as_a_file_and_ends_nobody(tmp_path):
    import signal
    import time

    told = tmp_path / "told"
    launch = (f"import sys; from launch.run import launcher; sys.exit(launcher.execute(launcher.LaunchCommand("
              f"({sys.executable!r}, '-c', {STOPPABLE!r}, {str(told)!r}), {{}})))")
    cli = subprocess.Popen([sys.executable, "-c", launch], cwd=REPO, env={**os.environ, "SLURM_JOB_ID": "4242"})
    t0 = time.monotonic()
    while not told.is_file() or not told.read_text():
        assert cli.poll() is None and time.monotonic() - t0 < 30
        time.sleep(0.02)
    path, ignored = told.read_text().split(" ")
    assert ignored == "True" and not os.path.exists(path)  # SLURM may signal every process of the step
    cli.send_signal(signal.SIGUSR1)
    assert cli.wait(timeout=30) == 0  # the launcher survived it and its child saw the request
    assert not os.path.exists(os.path.dirname(path))  # gone with the launcher: a requeued job finds no old request


def test_outside_slurm_no_stop_request_is_given_and_the_ranks_post_no_vote(tmp_path):
    """The stop vote is a collective every rank must join: only a SLURM job (every node alike) posts it; a run by hand
    adds nothing to its steps."""
    told = tmp_path / "told"
    child = f"import os, pathlib; pathlib.Path({str(told)!r}).write_text(str('LAYOUTLAB_STOP_REQUEST' in os.environ))"
    launch = (f"import sys; from launch.run import launcher; sys.exit(launcher.execute(launcher.LaunchCommand("
              f"({sys.executable!r}, '-c', {child!r}), {{}})))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    assert subprocess.run([sys.executable, "-c", launch], cwd=REPO, env=env, timeout=60).returncode == 0
    assert told.read_text() == "False"


def batch(tmp_path, srun: str, *args, env_extra=None, signal_after=None):
    """launch/slurm.sbatch as SLURM runs it on 2 nodes, with `srun` (a bash script body) standing in for srun and a
    scontrol that records its arguments; `signal_after`: a file whose appearance SLURM's USR1 to the script awaits."""
    import signal
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("srun", srun), ("scontrol", f'printf "%s\\n" "$*" >> {tmp_path}/scontrol')):
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LAYOUTLAB_"))}
    env = {**env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2",
           "SLURM_JOB_CPUS_PER_NODE": "72(x2),36", "SLURM_SUBMIT_DIR": str(REPO), "OUT": str(tmp_path),
           **(env_extra or {})}
    p = subprocess.Popen(["bash", "launch/slurm.sbatch", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    if signal_after is not None:
        t0 = time.monotonic()
        while not signal_after.exists():
            assert p.poll() is None and time.monotonic() - t0 < 30
            time.sleep(0.02)
        p.send_signal(signal.SIGUSR1)
    said, _ = p.communicate(timeout=60)
    requeued = (tmp_path / "scontrol").read_text().splitlines() if (tmp_path / "scontrol").is_file() else []
    return p.returncode, said, requeued


RECORD_SRUN = 'printf "%s\\n" "$@" > "$OUT/argv"'


def test_the_batch_script_gives_each_node_all_its_cpus_and_memory():
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        rc, said, _ = batch(Path(folder), RECORD_SRUN, "recipes/tiny_zero2", "hardware.nodes=2")
        argv = (Path(folder) / "argv").read_text().splitlines()
    assert rc == 0, said
    # The smallest node's CPUs (36 of "72(x2),36"), not srun's default of one for the launcher and all its ranks.
    assert argv == ["--ntasks-per-node=1", "--nodes=2", "--kill-on-bad-exit=1", "--label", "--cpus-per-task=36",
                    "--mem=0", "bash", "launch/run.sh", "recipes/tiny_zero2", "hardware.nodes=2"]
    header = [line for line in (REPO / "launch/slurm.sbatch").read_text().splitlines() if line.startswith("#SBATCH")]
    for want in ("--mem=0", "--signal=B:USR1@120", "--requeue", "--open-mode=append"):
        assert f"#SBATCH {want}" in header, header


def test_a_container_image_runs_each_node_in_it_with_the_submit_dir_mounted(tmp_path):
    rc, said, _ = batch(tmp_path, RECORD_SRUN, "recipes/tiny_zero2",
                        env_extra={"LAYOUTLAB_CONTAINER": "nvcr.io#me/layoutlab:1", "LAYOUTLAB_RUNS": "/scratch/runs",
                                   "LAYOUTLAB_CONTAINER_MOUNTS": "/data:/data:ro"})
    assert rc == 0, said
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[6:] == ["--container-image=nvcr.io#me/layoutlab:1",
                        f"--container-mounts={REPO}:{REPO},/scratch/runs:/scratch/runs,/data:/data:ro",
                        f"--container-workdir={REPO}", "env", "-u", "PYTHON", "bash", "launch/run.sh",
                        "recipes/tiny_zero2"]


# Stands in for srun with the launchers running: says it started, and on USR1 (which srun passes on to its tasks)
# records it and ends as the tasks would, with $SRUN_RC.
SIGNALLED_SRUN = 'trap \'echo USR1 >> "$OUT/tasks"; exit "$SRUN_RC"\' USR1; touch "$OUT/started"; ' \
                 'while :; do sleep 0.05; done'


def test_the_time_limit_signal_reaches_the_tasks_and_requeues_only_a_clean_stop(tmp_path):
    for tasks_rc, requeued in ((0, ["requeue 4242"]), (3, [])):  # a failed step is not run again
        folder = tmp_path / str(tasks_rc)
        folder.mkdir()
        rc, said, asked = batch(folder, SIGNALLED_SRUN, "recipes/tiny_zero2", env_extra={"SRUN_RC": str(tasks_rc)},
                                signal_after=folder / "started")
        assert (folder / "tasks").read_text() == "USR1\n"  # passed on once, and the script waited for srun's end
        assert rc == tasks_rc and asked == requeued, (tasks_rc, rc, asked, said)
