"""Which nccl-tests commands a commbench run starts, for each topology (nothing is executed here)."""
from pathlib import Path

from launch.config.resolve import resolve_path
from launch.run.nccl_tests_runner import invocations
from launch.run.rundir import RunDir
from tests.conftest import RECIPES

TINY = RECIPES / "tiny_zero2"
LAUNCH_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,GRAPH,ENV", "LAYOUTLAB_RUN_DIR": "x"}


def plan(*overrides, environ=None, on_path=("all_reduce_perf", "alltoall_perf", "sendrecv_perf", "mpirun")):
    r = resolve_path(TINY, ["run.mode=commbench", "hardware.profile=h100-sxm", 'commbench.ops=["all_reduce", "all_to_all"]',
                            *overrides])
    which = lambda name: f"/opt/nccl-tests/{name}" if name in on_path else None  # noqa: E731
    return invocations(r, RunDir(Path("/runs/x")), launch_env=LAUNCH_ENV, environ=environ or {}, which=which)


def test_one_node_runs_each_binary_with_all_its_gpus():
    todo, notes = plan("hardware.gpus_per_node=8", "batch.global_batch_size=32", "commbench.max_bytes=1048576",
                       'commbench.dtype="bfloat16"', "commbench.iters=7", "commbench.warmup_iters=2")
    assert notes == []
    assert [inv.argv for inv in todo] == [
        ("all_reduce_perf", "-b", "8", "-e", "1048576", "-f", "2", "-d", "bfloat16", "-w", "2", "-n", "7", "-c", "1", "-g", "8"),
        ("alltoall_perf", "-b", "8", "-e", "1048576", "-f", "2", "-d", "bfloat16", "-w", "2", "-n", "7", "-c", "1", "-g", "8")]
    assert [inv.output for inv in todo] == [Path("/runs/x/commbench/nccl-tests/all_reduce.txt"),
                                            Path("/runs/x/commbench/nccl-tests/all_to_all.txt")]
    assert todo[0].env == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,GRAPH,ENV",
                           "NCCL_DEBUG_FILE": "/runs/x/commbench/nccl-tests/all_reduce.nccl.%h.%p.log"}


def test_missing_binaries_are_one_line_naming_how_to_get_them():
    todo, notes = plan(on_path=())
    assert todo == [] and len(notes) == 1
    assert "all_reduce_perf, alltoall_perf" in notes[0] and "make MPI=1" in notes[0] and "container" in notes[0]
    assert "continuing with the built-in sweep" in notes[0]
    todo, notes = plan(on_path=("all_reduce_perf",))
    assert [inv.op for inv in todo] == ["all_reduce"] and "alltoall_perf" in notes[0]


def test_cpu_profile_and_switch_off():
    r = resolve_path(TINY, ["run.mode=commbench"])
    todo, notes = invocations(r, RunDir(Path("/r")), launch_env={}, environ={}, which=lambda _: "/bin/x")
    assert todo == [] and "skipped" in notes[0] and "CPU profile" in notes[0]
    assert plan("commbench.nccl_tests=false") == ([], [])


def test_many_nodes_go_through_mpirun_or_srun_from_node_0():
    two = ("hardware.nodes=2", "hardware.gpus_per_node=4", "batch.global_batch_size=32")
    todo, _ = plan(*two, environ={"LAYOUTLAB_HOSTFILE": "/etc/hosts.txt"})
    assert todo[0].argv[:9] == ("mpirun", "-np", "8", "--map-by", "ppr:4:node", "--hostfile", "/etc/hosts.txt", "-x",
                                "NCCL_DEBUG")
    assert todo[0].argv[-2:] == ("-g", "1") and "all_reduce_perf" in todo[0].argv
    todo, _ = plan(*two, environ={"SLURM_JOB_ID": "7"}, on_path=("all_reduce_perf", "alltoall_perf", "srun"))
    assert todo[0].argv[0] == "srun" and "--mpi=pmix" in todo[0].argv
    todo, _ = plan(*two, 'commbench.group="inter_node"')
    assert todo[0].argv[:5] == ("mpirun", "-np", "2", "--map-by", "ppr:1:node")
    todo, notes = plan(*two, environ={"NODE_RANK": "1"})
    assert todo == [] and notes == ["commbench: nccl-tests run from node 0 only"]
    todo, notes = plan(*two, on_path=("all_reduce_perf", "alltoall_perf"))
    assert todo == [] and "need mpirun (Open MPI) or srun" in notes[0]


def test_inside_a_slurm_step_srun_overlaps_it_with_counts_of_its_own():
    """Started from the running training step, a nested srun without --overlap waits for CPUs and GPUs that step
    holds; without its own counts it takes the step's (SLURM_NTASKS=2, SLURM_CPUS_PER_TASK=72 below) and starts 2
    processes where 8 are meant, or asks 8 x 72 CPUs of a 72-CPU node."""
    two = ("hardware.nodes=2", "hardware.gpus_per_node=4", "batch.global_batch_size=32")
    step = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_CPUS_PER_TASK": "72", "SLURM_CPUS_ON_NODE": "72"}
    todo, _ = plan(*two, environ=step, on_path=("all_reduce_perf", "alltoall_perf", "srun"))
    assert todo[0].argv[:11] == ("srun", "--overlap", "--nodes", "2", "--ntasks", "8", "--ntasks-per-node", "4",
                                 "--cpus-per-task", "18", "--mpi=pmix")
    todo, _ = plan(*two, environ={"SLURM_JOB_ID": "7"}, on_path=("all_reduce_perf", "alltoall_perf", "srun"))
    assert todo[0].argv[8:10] == ("--cpus-per-task", "1")  # SLURM did not say: one each


def test_mpirun_carries_the_network_variables_to_the_other_nodes():
    two = ("hardware.nodes=2", "hardware.gpus_per_node=4", "batch.global_batch_size=32")
    env = {"NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "mlx5_0,mlx5_1", "UCX_NET_DEVICES": "mlx5_0:1",
           "NCCL_DEBUG": "WARN", "HOME": "/home/x"}
    todo, _ = plan(*two, environ=env)
    named = [todo[0].argv[i + 1] for i, a in enumerate(todo[0].argv) if a == "-x"]
    assert named == ["NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME",
                     "UCX_NET_DEVICES"]


def test_sub_groups_say_that_nccl_tests_measure_the_world():
    todo, notes = plan("hardware.gpus_per_node=4", "batch.global_batch_size=32", "parallel.tp=2", 'commbench.group="dp"')
    assert len(todo) == 2 and notes == ['commbench: nccl-tests measure all 4 ranks; the built-in sweep measures '
                                        'commbench.group="dp"']


def test_a_timed_out_launcher_gets_sigterm_for_its_whole_group(tmp_path):
    import subprocess
    import time

    from launch.run.nccl_tests_runner import _stop

    marker = tmp_path / "terminated"
    # stands in for mpirun: it must get the chance to stop what it started
    script = f'trap "touch {marker}; exit 0" TERM; sleep 100 & wait'
    proc = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    time.sleep(0.3)
    t0 = time.time()
    _stop(proc)
    assert proc.poll() is not None and time.time() - t0 < 10
    assert marker.exists()
