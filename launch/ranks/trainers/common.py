"""What the training loop and every backend share on a rank: rank environment, per-rank logs, the stall
watchdog, the Hugging Face model and the data, measurement and profiling.

Checkpoint bookkeeping lives in launch/run/checkpoints.py (torch-free: the CLI uses it before launch).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, TextIO

from launch import PACKAGE
from launch.config.resolve import Resolved
from launch.torchtools.hf import hf_config, offline_bitsandbytes
from launch.run.rankenv import STOP_REQUEST
from launch.run.rundir import RunDir

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world: int
    local_rank: int


def rank_env() -> RankEnv:
    return RankEnv(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
                   int(os.environ.get("LOCAL_RANK", "0")))


def no_jit_comm_op() -> None:
    """Both backends start DeepSpeed's comm: its CPU accelerator would JIT-build a shared-memory all-reduce op
    (minutes of C++ compile) the first time; gloo does the job without it, so mark the op incompatible."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def run_rank(run_dir: str, body: Callable[..., int]) -> int:
    """What every rank program does around its work: open the run, send its output to logs/, start the stall
    watchdog, and on failure name the rank and the step (on its stderr and rank 0's terminal) before torchrun
    stops the others. `body(run, resolved, env, terminal, cuda, watchdog)` does the work; `terminal` is rank 0's
    terminal stream and None elsewhere. A ResumeError is the user's: one line, exit 2."""
    from launch.torchtools.untrusted import UntrustedFileError
    from launch.run.checkpoints import ResumeError

    offline_bitsandbytes()
    run = RunDir.open(run_dir)
    resolved = Resolved.load(run.resolved)
    env = rank_env()
    terminal = redirect_logs(run, env.rank)
    for stale in (run.failure(env.rank), run.logs / f"stall_rank{env.rank}.json"):
        with contextlib.suppress(OSError):  # an earlier attempt's (torchrun restart, SLURM requeue): not this one's
            stale.unlink()
    cuda = resolved.hardware.device_type == "cuda"
    if cuda:
        os.environ.setdefault("NCCL_DEBUG_FILE", str(run.nccl_log(env.rank)))
    repeat_kv_for_fused_attention(resolved)  # training, calibrate's passes and the rehearsal run the same attention
    # On GPUs a rank waits for its peers in a CUDA synchronisation, not inside the torch.distributed call (NCCL
    # returns at once): where the main thread is cannot tell victim from cause, so no rank is blamed there.
    watchdog = Watchdog(env.rank, float(resolved.recipe.run.timeout_s), terminal if env.rank == 0 else None, run,
                        blame=not cuda)
    try:
        return body(run, resolved, env, terminal if env.rank == 0 else None, cuda, watchdog)
    except (ResumeError, UntrustedFileError) as e:  # the user's to mend: one line, exit 2
        record_failure(run, env.rank, watchdog.step, watchdog.phase, "resume", f"layoutlab: {e}")
        print(f"layoutlab: {e}", file=sys.stderr)
        if env.rank == 0:
            print(f"layoutlab: {e}", file=terminal)
        return 2
    except BaseException as e:  # noqa: BLE001 - name the rank and step, then let torchrun stop the others
        msg = fail_message(env.rank, watchdog.step, e)
        record_failure(run, env.rank, watchdog.step, watchdog.phase, "exception", msg)
        print(msg, file=sys.stderr, flush=True)
        print(msg, file=terminal, flush=True)
        raise
    finally:
        watchdog.stop()


def init_process_group(cuda: bool, timeout_s: float, *, deepspeed_comm: bool = True) -> None:
    """The default process group, then (`deepspeed_comm`) DeepSpeed's communication layer on top of it (it adopts a
    group that exists); the torch backend starts no DeepSpeed.

    Keys in the rendezvous store are prefixed with torchrun's restart count: a group that torchrun restarts
    (run.max_restarts) meets in the same store, and without the prefix a restarted rank read the dead group's gloo
    addresses and failed with "connectFullMesh ... Connection refused" before its peers had published theirs.
    """
    import datetime as dt

    import torch.distributed as dist

    timeout = dt.timedelta(seconds=timeout_s)
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        store = dist.PrefixStore(f"layoutlab/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    if deepspeed_comm:
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)


def die_with_parent() -> None:
    """End this rank when the process that started it dies, even by SIGKILL.

    torchrun starts every worker in a session of its own, so killing the job's process group (or
    torchrun alone, with SIGKILL) would otherwise leave the ranks running as orphans.
    """
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() == 1:  # the parent died before the prctl took effect
        os._exit(1)


def redirect_logs(run: RunDir, rank: int) -> TextIO:
    """Send this rank's stdout/stderr (including C++ and NCCL output) to logs/rank{R}.out|err.

    Returns a stream to the original terminal, used by rank 0 for the progress line.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(1), "w", buffering=1)
    run.logs.mkdir(parents=True, exist_ok=True)
    for fd, path in ((1, run.stdout(rank)), (2, run.stderr(rank))):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    return terminal


class Watchdog:
    """Ends this rank when no step finishes within `timeout_s`, naming the rank, the step, and where it waits.

    Collectives time out on their own (the process-group timeout), but a rank stuck outside a
    collective (a data loader, a deadlock in Python) would otherwise hang the job forever. Its peers then wait for
    it inside a collective and stall as long, so whichever watchdog fires first could be a victim: at half the
    timeout every stalled rank notes where its main thread is (logs/stall_rank{R}.json), and the one that ends
    the job names the ranks found outside any collective as the likely cause.
    """

    def __init__(self, rank: int, timeout_s: float, terminal: TextIO | None, run: RunDir | None = None,
                 blame: bool = False) -> None:
        self.rank, self.timeout_s, self.terminal, self.run, self.blame = rank, timeout_s, terminal, run, blame
        self.step = 0
        self.phase = "start-up"
        self._last = time.monotonic()
        self._noted = False
        self.started = time.monotonic()  # the rank's start, as near as its logs' opening
        self._deadline: float | None = None  # start_by's
        self._deadline_s = 0.0
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="layoutlab-watchdog")
        self._thread.start()

    def start_by(self, seconds: float) -> None:
        """Start-up's own limit (run.startup_timeout_s): the first step must begin within `seconds` of now, however
        steadily the build progresses; beat() with phase "step" lifts it."""
        self._deadline = time.monotonic() + seconds
        self._deadline_s = seconds

    def beat(self, step: int, phase: str) -> None:
        if phase == "step":
            self._deadline = None
        self.step, self.phase, self._last = step, phase, time.monotonic()
        if self._noted:  # progress again: the note of a slow moment is no longer true
            self._noted = False
            with contextlib.suppress(OSError):
                self._note_path().unlink()

    def stop(self) -> None:
        self._stop.set()

    def _note_path(self) -> Path:
        return self.run.logs / f"stall_rank{self.rank}.json"

    def where(self) -> tuple[bool, str]:
        """(whether the main thread is inside a torch.distributed call, where it is: the call, or its innermost
        frame in layoutlab's own code)."""
        frame = sys._current_frames().get(self._main)
        frames = []
        while frame is not None:
            frames.append(frame)
            frame = frame.f_back
        for f in frames:  # innermost first
            if f.f_code.co_filename.replace(os.sep, "/").endswith("torch/distributed/distributed_c10d.py"):
                return True, f"torch.distributed.{f.f_code.co_name}"
        own = str(PACKAGE)
        for f in frames:  # the innermost frame of layoutlab itself, not of the libraries it calls
            if os.path.abspath(f.f_code.co_filename).startswith(own + os.sep):
                return False, f"{os.path.relpath(f.f_code.co_filename)}:{f.f_lineno} in {f.f_code.co_name}"
        return False, f"{frames[0].f_code.co_filename}:{frames[0].f_lineno}" if frames else "unknown"

    def _culprits(self) -> list[str]:
        """Other ranks that noted a stall outside any collective."""
        out = []
        for path in sorted(self.run.logs.glob("stall_rank*.json")) if self.run is not None else []:
            try:
                note = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if note.get("rank") != self.rank and not note.get("in_collective", True):
                out.append(f"rank {note['rank']} is outside any collective at step {note['step']} ({note['where']})")
        return out

    def _run(self) -> None:
        while not self._stop.wait(min(5.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s / 2 and not self._noted and self.run is not None and self.blame:
                inside, where = self.where()
                note = {"rank": self.rank, "step": self.step, "phase": self.phase, "in_collective": inside,
                        "where": where, "idle_s": round(idle, 1)}
                with contextlib.suppress(OSError):
                    self.run.write_text_atomic(self._note_path(), json.dumps(note) + "\n")
                    self._noted = True
            deadline = self._deadline  # once: the main thread's beat may clear it meanwhile
            late = deadline is not None and time.monotonic() > deadline
            if idle > self.timeout_s or late:
                inside, where = self.where()
                msg = (f"layoutlab: rank {self.rank} stalled at step {self.step} ({self.phase}) for {idle:.0f} s "
                       f"> run.timeout_s={self.timeout_s:g}" if not late else
                       f"layoutlab: rank {self.rank} still starting ({self.phase}) after run.startup_timeout_s="
                       f"{self._deadline_s:g} s")
                if self.blame:
                    msg += ", " + (f"waiting in {where}" if inside else f"outside any collective ({where})")
                culprits = self._culprits() if inside and self.blame else []
                msg += ("; " + "; ".join(culprits) + ": the likely cause" if culprits else "") + "; ending the job"
                if self.run is not None:
                    record_failure(self.run, self.rank, self.step, self.phase, "stall", msg)
                for stream in (sys.stderr, self.terminal):
                    if stream is not None:
                        try:
                            print(msg, file=stream, flush=True)
                        except (OSError, ValueError):
                            pass
                os._exit(124)


def inject_fault(rank: int, step: int, run: RunDir) -> None:
    """Chaos testing: LAYOUTLAB_FAULT="hang:RANK:STEP", "crash:RANK:STEP" or "kill:RANK:STEP" makes that rank
    stall, raise, or die by SIGKILL (as the OOM killer ends it) at the start of that step, to show how the job
    comes down (tests use it; users may too). A fault fires once per run directory, so that a group torchrun
    restarts (run.max_restarts) runs through. "slow:RANK:MS" delays that rank by MS milliseconds at the start of
    every step: a straggler whose cost is known, for checking what the report says of it."""
    spec = os.environ.get("LAYOUTLAB_FAULT")
    if not spec:
        return
    kind, r, s = spec.split(":")
    if kind == "slow":
        if int(r) == rank:
            time.sleep(int(s) / 1e3)
        return
    if int(r) != rank or int(s) != step:
        return
    try:  # the marker is the claim: a restarted rank finds it and goes on
        os.close(os.open(run.logs / f"fault_{kind}_rank{r}_step{s}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return
    if kind == "hang":
        time.sleep(10**6)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault ({spec})")


class StopVote:
    """Whether the ranks stop with a checkpoint: any rank's launcher caught the stop signal (launch/run/launcher.py:
    STOP_SIGNAL, SLURM's warning before the time limit) and created the file STOP_REQUEST names. At a step boundary
    every rank posts whether its node's file exists in an all-reduce that,
    like the loss mean's, overlaps the next step; at the next boundary all read the same sum and stop there together:
    a rank that saved alone would wait in the save's collectives for ever."""

    def __init__(self, device) -> None:
        import torch
        import torch.distributed as dist

        self.device = device
        self.path = os.environ.get(STOP_REQUEST)
        self.posted = None  # (flag, work) of the last boundary's vote
        # Votes are a collective every rank must join: posted only if every rank's launcher gave a request file (under
        # SLURM, launch/run/launcher.py execute). Agreed once at start-up: a node started by hand inside an allocation
        # (no SLURM_JOB_ID over ssh) would otherwise leave the others waiting in a vote it never posts.
        everyone = torch.tensor([int(bool(self.path))], dtype=torch.int32, device=device)
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
        self.enabled = bool(everyone.item())

    def post(self) -> None:
        if not self.enabled:
            return
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(os.path.exists(self.path))], dtype=torch.int32,
                            device=self.device)
        self.posted = (flag, dist.all_reduce(flag, async_op=True))

    def agreed(self) -> bool:
        """The last posted vote's outcome (False when none was posted); it is spent."""
        if self.posted is None:
            return False
        flag, work = self.posted
        self.posted = None
        work.wait()
        return bool(flag.item())


def record_failure(run: RunDir, rank: int, step: int, phase: str, kind: str, message: str) -> None:
    """The rank's own account of why it ends (RunDir.failure), which run.sh summarises after the job."""
    record = {"rank": rank, "step": step, "phase": phase, "kind": kind, "message": message}
    with contextlib.suppress(OSError):
        run.write_text_atomic(run.failure(rank), json.dumps(record) + "\n")


def fail_message(rank: int, step: int, exc: BaseException) -> str:
    return f"layoutlab: rank {rank} failed at step {step}: {type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------- model and data


def build_model(resolved: Resolved):
    """A Hugging Face causal LM from the catalogue config: random init, or local weights when given."""
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_config(resolved.model)
    attn = resolved.recipe.train.attention  # Hugging Face's own names: "sdpa" | "eager"
    weights = resolved.recipe.model.weights
    if weights:
        path = Path(resolved.recipe_path).parent / weights
        model = AutoModelForCausalLM.from_pretrained(path, config=config, local_files_only=True, use_safetensors=True,
                                                     trust_remote_code=False, dtype=torch.float32,
                                                     attn_implementation=attn)
    else:
        torch.manual_seed(resolved.recipe.train.seed)  # identical weights on every rank
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    return model


def repeat_kv_for_fused_attention(resolved: Resolved) -> None:
    """Where SDPA's kernel would be the memory-efficient one, which refuses grouped-query attention in torch 2.13.0 (a
    T4: HardwareProfile.fused_attention_gqa; fp32 on any GPU: launch.plan.memory.sdpa_kernel), Hugging Face's sdpa
    attention is made to repeat the K/V heads itself before SDPA (its own path where enable_gqa does not apply) instead
    of passing enable_gqa=True, which would send SDPA to the math kernel and its s × s scores: the memory-efficient
    kernel then runs, and the plan keeps the repeated K and V (launch.plan.memory.repeats_kv). Process-wide, on the
    rank (launch.ranks.trainers.common.run_rank: training, calibrate's passes, the rehearsal), decided by the recipe."""
    from launch.plan.memory import repeats_kv
    from launch.plan.layout import Layout

    if repeats_kv(Layout.from_resolved(resolved)):
        from transformers.integrations import sdpa_attention

        sdpa_attention.use_gqa_in_sdpa = lambda attention_mask, key, value: False


def import_model_class(resolved: Resolved) -> None:
    """The model's transformers module, imported ahead of a measured build: its import (about 170 MB of a CPU rank's
    memory with torch's) is no part of the build's memory (logs/build_memory_rank{R}.json)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config(resolved.model))]


def initial_tensors(resolved: Resolved) -> Iterator[tuple[str, "torch.Tensor"]]:
    """The model's starting weights one whole fp32 tensor at a time, (name, tensor) under the model's own parameter
    names, each once (a tied output layer is its embedding), never the whole model at once: what each rank of a sharded
    start-up cuts its own shards from, concurrently, with no collective.

    From `model.weights`: each tensor read from its safetensors file as it is needed. Otherwise the seeded random init
    of build_model, bit for bit (tests/unit/test_initial_tensors.py): the model is built on meta and Hugging Face's
    construction replayed a module at a time on the host, every random draw at its place in the stream: each module's
    own reset_parameters in construction order (pre-order), and, where a PreTrainedModel's construction ends, its
    post_init's initialisation walk (post-order, _init_weights) over the modules not yet initialised. Only the walk's
    values are kept; the construction draws advance the generator as the plain build's do. A tied output layer keeps
    the embedding's values, as transformers ties it after initialising."""
    weights = resolved.recipe.model.weights
    if weights:
        yield from _stored_tensors(Path(resolved.recipe_path).parent / weights, resolved)
        return
    yield from _seeded_tensors(resolved)


def _stored_tensors(folder: Path, resolved: Resolved) -> Iterator[tuple[str, "torch.Tensor"]]:
    """In the model's own order (the files' is alphabetical: layer 10 before layer 2), each tensor read when its turn
    comes; every one is there (launch.run.launcher.weights_preflight checked the headers before launch)."""
    from safetensors import safe_open

    with contextlib.ExitStack() as files:
        opened = [files.enter_context(safe_open(str(p), framework="pt")) for p in sorted(folder.glob("*.safetensors"))]
        where = {name: f for f in opened for name in f.keys()}
        for p in resolved.model.parameters():
            yield p.name, where[p.name].get_tensor(p.name).float()


def _seeded_tensors(resolved: Resolved) -> Iterator[tuple[str, "torch.Tensor"]]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers import initialization as hf_init
    from transformers.modeling_utils import PreTrainedModel

    # Draws nothing: meta tensors take no random numbers. The attention implementation draws nothing either: eager,
    # which transformers has for every model ("te", Megatron's, is none of its names).
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(resolved.model), dtype=torch.float32,
                                                 attn_implementation="eager")
    first: dict[int, str] = {}  # a parameter's first name: the embedding's, for a tied output layer
    owners = {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}
    for module in model.modules():
        module._is_hf_initialized = False  # the meta build's walk initialised nothing

    def construct(module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        if isinstance(module, PreTrainedModel):
            for name, child in module.named_children():
                yield from construct(child, f"{prefix}{name}.")
            with torch.no_grad(), hf_init.guard_torch_init_functions():
                yield from walk(module, module._initialize_weights, prefix)
            return
        if hasattr(module, "reset_parameters") and next(module.parameters(recurse=False), None) is not None:
            module.to_empty(device="cpu", recurse=False)
            module.reset_parameters()
            module.to_empty(device="meta", recurse=False)
        for name, child in module.named_children():
            yield from construct(child, f"{prefix}{name}.")

    def walk(module, init, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        for name, child in module.named_children():
            yield from walk(child, child._initialize_weights if isinstance(child, PreTrainedModel) else init,
                            f"{prefix}{name}.")
        if module._is_hf_initialized:
            return
        module.to_empty(device="cpu", recurse=False)
        init(module, False)
        module._is_hf_initialized = True
        for name, p in module.named_parameters(recurse=False):
            if owners[prefix + name] == prefix + name:  # a tied output layer's draws are made, its values not kept
                # not a copy: to_empty below points the module at meta, leaving this storage to the consumer alone
                yield prefix + name, p.detach()
        module.to_empty(device="meta", recurse=False)

    with torch.random.fork_rng(devices=[]):
        # the CPU generator alone, which the host build draws from (torch.manual_seed would reseed the GPUs' too)
        torch.default_generator.manual_seed(resolved.recipe.train.seed)
        yield from construct(model, "")


def torch_dtype(precision: str):
    """A precision.dtype value as the torch dtype."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


# --------------------------------------------------------------------------- measurement


def memory_fields(device_is_cuda: bool) -> dict[str, int | None]:
    if device_is_cuda:
        import torch

        return {"mem_max_allocated_bytes": int(torch.cuda.max_memory_allocated()),
                "mem_max_reserved_bytes": int(torch.cuda.max_memory_reserved()), "rss_max_bytes": None}
    import resource

    return {"mem_max_allocated_bytes": None, "mem_max_reserved_bytes": None,
            "rss_max_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024}


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
# While a rank builds its part of the model, freed full-size tensors go back to the system at once; below glibc's
# threshold its heap keeps them, and a partitioned build peaked above the plain one (measured, 4 ranks). Afterwards
# the threshold is put where glibc's own dynamic rule would take it (32 MiB on 64-bit), not kept low for training.
BUILD_MMAP_THRESHOLD, TRAIN_MMAP_THRESHOLD = 64 * 2**10, 32 * 2**20


@contextlib.contextmanager
def model_build(run: RunDir, rank: int) -> Iterator[None]:
    """Around a backend's model build: freed memory returned at once, and how much the rank's peak host memory grew
    recorded (logs/build_memory_rank{R}.json): a sharded start-up grows with the rank's part, not the whole model."""
    import ctypes
    import resource

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, BUILD_MMAP_THRESHOLD)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, TRAIN_MMAP_THRESHOLD)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    run.write_text_atomic(run.build_memory(rank), json.dumps({"peak_rss_growth_bytes": grown}) + "\n")


@contextlib.contextmanager
def evaluating(modules) -> Iterator[None]:
    """Modules in eval mode (a model.config with dropout evaluates without it), back in training mode after."""
    modules = list(modules)
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m in modules:
            m.train()


@contextlib.contextmanager
def region(name: str, cuda: bool) -> Iterator[None]:
    """A named range that both torch.profiler (record_function) and Nsight Systems (NVTX) show."""
    import torch

    if cuda:
        torch.cuda.nvtx.range_push(name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        if cuda:
            torch.cuda.nvtx.range_pop()


def profiled_steps(resolved: Resolved, start_step: int) -> range:
    """The 0-based steps a profiler records: `profile_active_steps` of them after the warm-up steps and one more
    (torch.profiler's own warm-up step), counted from this run's first step (a resumed run is cold again); shortened
    when the run is too short for all of that, so that a trace is always written."""
    r = resolved.recipe
    remaining = r.train.steps - start_step
    active = max(1, min(r.run.profile_active_steps, remaining - 1))
    skip = max(0, min(r.train.warmup_steps, remaining - active - 1))
    first = start_step + skip + 1
    return range(first, first + active)


def make_profiler(resolved: Resolved, run: RunDir, rank: int, cuda: bool, start_step: int):
    """torch.profiler that records `profiled_steps`, one trace per rank."""
    r = resolved.recipe
    if r.run.profile != "torch":
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    steps = profiled_steps(resolved, start_step)
    skip, active = steps.start - 1 - start_step, len(steps)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def ready(p) -> None:
        run.traces.mkdir(parents=True, exist_ok=True)
        p.export_chrome_trace(str(run.traces / f"rank{rank}.json"))

    return profile(activities=acts, schedule=schedule(skip_first=skip, wait=0, warmup=1, active=active, repeat=1),
                   on_trace_ready=ready, record_shapes=True, with_stack=False)


class StartupProgress:
    """A sharded start-up's progress, called after each tensor: the watchdog beaten (a build that moves is no stall,
    however long it takes; run.startup_timeout_s bounds the whole) and, on rank 0's terminal, a line every few seconds
    and at the end, with the time so far."""

    EVERY_S = 10.0

    def __init__(self, watchdog: Watchdog, what: str) -> None:
        self.watchdog, self.what = watchdog, what
        self._start = self._said = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        self.watchdog.beat(0, f"model build, {done}/{total} tensors")
        now = time.monotonic()
        if self.watchdog.terminal is not None and (now - self._said >= self.EVERY_S or done == total):
            self._said = now
            with contextlib.suppress(OSError, ValueError):
                print(f"start-up: {self.what}: {done}/{total} tensors, {now - self._start:.0f} s", file=self.watchdog.terminal,
                      flush=True)


class ProgressLine:
    """A rich progress bar on rank 0's terminal; other ranks print nothing there."""

    def __init__(self, terminal: TextIO | None, total: int, start: int, label: str) -> None:
        self._p = None
        if terminal is None:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self._p = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("{task.fields[stats]}"), TimeRemainingColumn(),
                           console=Console(file=terminal, width=120), transient=False,
                           # Redrawing competes with the ranks for cores (2 ranks on 2 CPU cores): twice a second is enough.
                           refresh_per_second=2)
        self._task = self._p.add_task(label, total=total, completed=start, stats="")
        self._p.start()

    def update(self, step: int, stats: str) -> None:
        if self._p is not None:
            self._p.update(self._task, completed=step, stats=stats)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()


def seed_step(seed: int, step: int, dp_rank: int) -> None:
    """Seed the generators a step's random draws (adapter dropout) come from, by (train.seed, step, data-parallel
    rank) alone: a run resumed at step N draws the masks the uninterrupted run drew there (at the same micro-batch
    size: each micro-batch draws in turn), with no generator state in the checkpoint."""
    import hashlib

    import torch

    torch.manual_seed(int.from_bytes(hashlib.sha256(f"{seed}:{step}:{dp_rank}".encode()).digest()[:8], "little"))


def micro_batch_tensor(source, step: int, resolved: Resolved, dp_rank: int, micro: int, device):
    import torch

    from launch.data.rows import micro_batch

    r = resolved.recipe
    rows = micro_batch(source, step, global_batch=r.batch.global_batch_size, micro=r.batch.micro_batch_size,
                       dp=resolved.grid.dp, dp_rank=dp_rank, micro_step=micro)
    return torch.from_numpy(rows).to(device)


def count_layer_calls(model) -> list[int]:
    """Count forward calls of each decoder layer's MLP: with activation checkpointing every layer runs
    twice per micro-batch (forward, then recompute in backward), which proves recomputation happened.
    The count wraps the MLP's `forward` itself: transformers 5 checkpoints the layer's `forward` and
    torch 2.13 does not fire module hooks during the recompute, so hooks would miss it."""
    counts = [0] * len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        inner = layer.mlp.forward

        def counted(*args, _inner=inner, _i=i, **kwargs):
            counts[_i] += 1
            return _inner(*args, **kwargs)

        layer.mlp.forward = counted
    return counts


def write_layer_calls(run: RunDir, rank: int, counts: list[int]) -> None:
    (run.logs / f"layer_calls_rank{rank}.json").write_text(json.dumps({"forward_calls_per_layer": counts}))


def grad_norm(grads) -> float:
    """Pre-clipping L2 norm of unsharded, already data-parallel averaged gradients (None entries skipped)."""
    return sum(float(g.detach().float().pow(2).sum()) for g in grads if g is not None) ** 0.5


def local_param_numel(module) -> int:
    """Elements this rank stores: a ZeRO-3 parameter's own partition (ds_tensor), else the tensor."""
    return sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in module.parameters())


def model_state_bytes(engine) -> dict[str, int]:
    """Bytes of model state a DeepSpeed 0.19.8 engine keeps alive on this rank between optimizer steps (call it
    after at least one step: Adam's state is created lazily by the first), in the planner's categories
    (launch/plan/memory.py, "deepspeed" accounting). Each tensor counts its whole storage, once per storage
    (a view into a flat buffer counts the buffer, padding included), in this order:

      weights    the module parameters' storage: ZeRO 0 the tensors themselves, ZeRO-1/2 the flat 16-bit (here:
                 the model dtype) buffer they are views of, ZeRO-3 the flat buffer of their `ds_tensor`
                 partitions plus the full data of parameters kept gathered (`ds_persist`, numel <=
                 stage3_param_persistence_threshold), and with ZeRO++ hpZ each parameter's secondary partition
                 (`ds_secondary_tensor`). An fp32 master copy that *is* this storage (ZeRO-0 fp32, ZeRO-3 fp32)
                 counts here, once.
      grads      `.grad` of the module parameters and of the parameters the torch optimizer updates (the fp32
                 gradient partitions), ZeRO-3's persistent `grad_partitions_flat_buffer`, BF16_Optimizer's
                 `fp32_groups_gradients_flat`. DeepSpeed 0.19.8 frees the 16-bit gradients and (without
                 offload) the fp32 partitions' gradients inside every step, so ZeRO 0-2 hold none here.
      optimizer  the parameters the torch optimizer updates when they are not the module's storage (the fp32
                 master partitions: ZeRO-1/2 `single_partition_of_fp32_groups`, ZeRO-3 `fp32_partitioned_groups_flat`,
                 the mixed-precision optimizers' fp32 groups) plus every tensor in its state (AdamW: exp_avg,
                 exp_avg_sq and the 0-d `step`).

    Communication buffers (ZeRO's reduce and gather buckets) are not model state (the planner's `buffers`), nor
    are activations. Host-resident state (offload) is counted like device state.
    """
    import torch

    opt = engine.optimizer
    torch_opt = getattr(opt, "optimizer", opt)  # ZeRO and mixed-precision wrappers keep the torch optimizer here
    params = list(engine.module.parameters())
    masters = [p for g in torch_opt.param_groups for p in g["params"]]
    seen: set[int] = set()

    def count(tensors) -> int:
        return storage_bytes(tensors, seen)

    weights = count([p.data for p in params] + [getattr(p, "ds_tensor", None) for p in params]
                    + [getattr(p, "ds_secondary_tensor", None) for p in params])
    grads = count([p.grad for p in params] + [p.grad for p in masters]
                  + [getattr(opt, "grad_partitions_flat_buffer", None)] + list(getattr(opt, "fp32_groups_gradients_flat", ())))
    optimizer = count(masters + [v for st in torch_opt.state.values() for v in st.values() if torch.is_tensor(v)])
    return {"weights": weights, "grads": grads, "optimizer": optimizer}


def storage_bytes(tensors, seen: set[int]) -> int:
    """Bytes of the storages behind `tensors` (None entries skipped) not counted yet: a view counts its whole storage,
    once (`seen` holds the storages' addresses and is updated); a DTensor counts its local shard's."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if t is None:
            continue
        s = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def say_reduce_dtype(engine) -> None:
    """Rank 0 says what the DeepSpeed engine reduces data-parallel gradients in, read from the engine itself
    (precision.grad_reduce_dtype composes its communication_data_type)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(f"deepspeed: data-parallel gradients reduced in {engine.communication_data_type}", flush=True)
