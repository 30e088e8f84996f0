"""The in-situ half of `python -m launch calibrate`: `python -m launch.ranks.calibrate_pass RUN_DIR`, started on every rank
of one node by the recipe's own launcher.

Each rank builds the backend's real trainer (launch/ranks/trainers/protocol.py) at the run's tensor-parallel degree, once
per activation-checkpointing mode (and with sequence parallelism on and off), side by side (on a GPU as many as
its free memory holds at once), and times the forward
(`Trainer.loss`) and backward of one micro-batch for every variant and micro-batch size in turn (medians over
iterations), and of the forward the part before the first decoder layer and inside the layers (what the planner
splits into pipeline stages), all ranks at once: the TP collectives inside the model run as in training, on the threads and cores a training
rank has; gradients are not reduced and no optimizer steps there. Then, where the spec asks (tp = 1), it times
whole `train_step`s of the real trainer at each ZeRO stage, at one and two micro-batches per step and with full
checkpointing: `calibrate` takes what the rest of its figures do not explain as the engine's own cost in situ.
Rank 0 writes `passes.json`: passes averaged over ranks, steps the slowest rank's.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

from launch.config.calibration import PASS_RESULT_FILE, PASS_SPEC_FILE


def main(run_dir: str) -> int:
    from launch.ranks.trainers import common

    return common.run_rank(run_dir, _body)


def _body(run, resolved, env, terminal, cuda, watchdog) -> int:
    import torch
    import torch.distributed as dist

    from launch.config.backends import traits
    from launch.config.resolve import Resolved
    from launch.ranks.trainers.protocol import BuildContext

    spec = json.loads((run.root / PASS_SPEC_FILE).read_text())
    backend = traits(resolved.recipe.backend).rank_module()
    if cuda:
        torch.cuda.set_device(env.local_rank)
    backend.init_distributed(resolved, cuda)
    device = torch.device("cuda", env.local_rank) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # The variants' trainers side by side, timed in turn within each iteration (as `_steps` does): on a shared
    # machine the TP collectives' latency drifts over seconds, and variants timed one after another each caught a
    # different phase of it (here, on gloo: 46 vs 106 ms for the same pass in two calibrations, the checkpointing
    # modes out of order). Side by side costs each variant's model, gradients and whatever its engine allocates
    # at build (bf16 master weights) at once; on a GPU as many are built together as its free memory allows (room
    # for twice the last one's allocation: the next one and the passes' activations), the rest after them.
    rows: dict[tuple[str, bool, int], list[float]] = {}
    pending = list(spec["variants"])
    while pending:
        built = []
        while pending:
            item = pending.pop(0)
            ac, sp = item["activation_checkpointing"], item["sp"]
            variant = Resolved.load(Path(item["resolved"]))
            watchdog.beat(0, f"building the {variant.recipe.backend} model, activation_checkpointing={ac}, sp={sp}")
            before = torch.cuda.memory_allocated() if cuda else 0
            built.append((ac, sp, backend.build(BuildContext(run, variant, env, cuda, device, watchdog, None, False))))
            if cuda and pending:
                free, _ = torch.cuda.mem_get_info()
                # every rank builds the same group: one that runs short stops it for all
                full = torch.tensor([float(free < 2 * (torch.cuda.memory_allocated() - before))], device=device)
                dist.all_reduce(full, op=dist.ReduceOp.MAX)
                if full.item():
                    break
        rows.update(_passes(built, variant, spec, device, watchdog, sync))
        del built
        gc.collect()  # one group's models before the next, and before the engines of the steps below
        if cuda:
            torch.cuda.empty_cache()
    stages = sorted({item["zero_stage"] for item in spec["steps"]})
    by_stage = {z: [item for item in spec["steps"] if item["zero_stage"] == z] for z in stages}
    measured = {}
    for z in stages:
        measured[z] = _steps(backend, by_stage[z], run, env, cuda, device, watchdog, spec, sync)
        gc.collect()  # one stage's trainers at a time
    steps = [measured[item["zero_stage"]][by_stage[item["zero_stage"]].index(item)] for item in spec["steps"]]
    # Every rank's figures to rank 0, which writes the mean over ranks.
    mine = [[rows[k] for k in sorted(rows)], steps]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if env.rank == 0:
        out = [{"activation_checkpointing": ac, "sp": sp, "micro_batch_size": b,
                **{part: statistics.fmean(g[0][i][j] for g in gathered) for j, part in enumerate(SUMMARY)}}
               for i, (ac, sp, b) in enumerate(sorted(rows))]
        # A step ends when its slowest rank's does: the longest of the ranks' medians.
        timed = [{**{k: v for k, v in item.items() if k != "resolved"}, "step_s": max(g[1][i] for g in gathered)}
                 for i, item in enumerate(spec["steps"])]
        run.write_text_atomic(run.root / PASS_RESULT_FILE, json.dumps({"ranks": len(gathered), "passes": out, "steps": timed},
                                                            indent=1) + "\n")
    dist.barrier()
    return 0


def _passes(built: list, variant, spec: dict, device, watchdog, sync) -> dict[tuple[str, bool, int], list[float]]:
    """_summary of forward and backward per (activation_checkpointing, sp, micro-batch size) of the trainers built
    side by side: every variant and size in turn within an iteration, so that a drift of the machine's load reaches
    all alike. `variant`: any of them (vocabulary and sequence length are the same in all)."""
    import torch
    import torch.distributed as dist

    cuda = device.type == "cuda"
    batches = {}
    for b in spec["micro_batch_sizes"]:
        g = torch.Generator().manual_seed(b)
        batches[b] = torch.randint(0, variant.model.vocab_size, (b, variant.recipe.batch.seq_len), generator=g).to(device)
    times: dict[tuple[str, bool, int], list[tuple[float, ...]]] = {(ac, sp, b): [] for ac, sp, _ in built
                                                                    for b in batches}
    # Where the forward goes, for the planner's pipeline stages: before the first decoder layer (the embedding),
    # inside the layers, after the last (final norm, output layer, loss). Marks are reset before each forward, so
    # a recompute in the backward does not move them.
    # On a GPU the marks are CUDA events, read after the forward's own synchronisation: a synchronisation inside
    # the forward would stop the host queueing kernels ahead and slow the very pass being timed.
    marks: dict[str, object] = {}

    def mark():
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def first_in(_module, _args) -> None:
        marks.setdefault("first", mark())

    def last_out(_module, _args, _out) -> None:
        marks["last"] = mark()

    hooks = [h for _, _, trainer in built for h in (trainer.decoder_layers[0].register_forward_pre_hook(first_in),
                                                    trainer.decoder_layers[-1].register_forward_hook(last_out))]
    dist.barrier()
    for it in range(spec["warmup_iters"] + spec["iters"]):
        watchdog.beat(it, "timing forward and backward passes")
        for ac, sp, trainer in built:
            for b, x in batches.items():
                sync()
                marks.clear()
                start = mark()
                t0 = time.perf_counter()
                loss = trainer.loss(x)
                sync()
                t1 = time.perf_counter()
                if cuda:  # milliseconds between recorded events
                    first, last = start.elapsed_time(marks["first"]) / 1e3, start.elapsed_time(marks["last"]) / 1e3
                else:
                    first, last = marks["first"] - start, marks["last"] - start
                loss.backward()  # gradients accumulate in place, as over a step's micro-batches
                sync()
                if it >= spec["warmup_iters"]:
                    times[(ac, sp, b)].append((t1 - t0, time.perf_counter() - t1, first, last - first))
    for h in hooks:
        h.remove()
    return {key: _summary(fb) for key, fb in times.items()}


def _steps(backend, items: list[dict], run, env, cuda: bool, device, watchdog, spec: dict, sync) -> list[float]:
    """Median seconds of the real trainer's `train_step` (the engine's reduction and step included), on the data
    the training loop reads, for each variant of one ZeRO stage (micro-batches per step, checkpointing). The
    variants' trainers live side by side and take their steps in turn, so that the differences between them, from
    which the engine's costs are taken, see the same moments of machine load."""
    import torch.distributed as dist

    from launch.config.resolve import Resolved
    from launch.ranks.data import sources
    from launch.ranks.trainers import common
    from launch.ranks.trainers.protocol import BuildContext

    built = []
    for item in items:
        variant = Resolved.load(Path(item["resolved"]))
        watchdog.beat(0, f"building the engine at zero_stage={item['zero_stage']}")
        trainer = backend.build(BuildContext(run, variant, env, cuda, device, watchdog, None, False))
        built.append((trainer, variant, sources(variant, Path(spec["data"])).train, trainer.dp_rank))
    times: list[list[float]] = [[] for _ in built]
    dist.barrier()
    for it in range(spec["warmup_iters"] + spec["step_iters"]):
        watchdog.beat(it, f"timing train_step at zero_stage={items[0]['zero_stage']}")
        for k, (trainer, variant, source, dp_rank) in enumerate(built):
            sync()
            t0 = time.perf_counter()
            trainer.train_step(lambda micro, _it=it, _v=variant, _s=source, _r=dp_rank:
                               common.micro_batch_tensor(_s, _it, _v, _r, micro, device))
            sync()
            if it >= spec["warmup_iters"]:
                times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


SUMMARY = ("forward_s", "backward_s", "sd_s", "embedding_forward_s", "layers_forward_s")


def _summary(fb: list[tuple[float, ...]]) -> list[float]:
    """SUMMARY of a pass from (forward, backward, before the first layer, inside the layers) per iteration: medians,
    as the step time it is compared with is a median, so that a moment of interference on a shared machine does
    not move it; the spread of forward + backward from the interquartile range (the normal's sd = IQR / 1.349),
    for the same reason."""
    both = sorted(f[0] + f[1] for f in fb)
    q = statistics.quantiles(both, n=4) if len(both) > 1 else [both[0]] * 3
    forward = statistics.median(f[0] for f in fb)
    # The forward's three parts, each a median, scaled to add up to the forward's median (medians of parts need not).
    parts = [statistics.median(f[2] for f in fb), statistics.median(f[3] for f in fb),
             statistics.median(max(0.0, f[0] - f[2] - f[3]) for f in fb)]
    scale = forward / sum(parts) if sum(parts) > 0 else 0.0
    return [forward, statistics.median(f[1] for f in fb), (q[2] - q[0]) / 1.349, parts[0] * scale, parts[1] * scale]


if __name__ == "__main__":
    from launch.ranks.trainers.common import die_with_parent

    die_with_parent()
    rc = main(sys.argv[1])
    # As the training loop does: DeepSpeed/gloo background threads can abort a finished process in teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
