"""The compute half of `python -m launch calibrate`: `python -m launch.calibrate_rank CALIB_DIR INDEX`.

`calibrate` starts one of these per rank of the layout at the same time (so they share the machine as training
ranks do), each a world of 1 with the threads a training rank gets. Each times, at the recipe's model shapes and
dtype: the forward and backward of one micro-batch through a TP rank's shard of the model for every tensor-parallel
degree, micro-batch size and activation-checkpointing mode asked for (`calibrate_spec.json`); torch Adam over
flat fp32 partitions of several sizes; and a real DeepSpeed engine at each ZeRO stage, whose forward, backward and
step beyond the plain model's are what the engine itself costs. It writes `compute_INDEX.json`. No communication
is timed here: the collectives come from the commbench sweep.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

SPEC = "calibrate_spec.json"


def compute_file(calib_dir: Path, index: int) -> Path:
    return calib_dir / f"compute_{index}.json"


def _shard_config(resolved, tp: int):
    """The HF config of one AutoTP rank's shard: attention heads, key/value heads and MLP width divided by tp
    (head size kept); the embedding and output layer stay whole (AutoTP gathers the logits)."""
    from launch.models import hf_config

    cfg = hf_config(resolved.model)
    m = resolved.model
    if tp > 1:
        cfg.head_dim = m.head_dim
        cfg.num_attention_heads = m.num_heads // tp
        cfg.num_key_value_heads = m.num_kv_heads // tp
        cfg.intermediate_size = m.intermediate_size // tp
    cfg.use_cache = False
    return cfg


def _model(resolved, tp: int, cuda: bool):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(resolved.recipe.train.seed)
    model = AutoModelForCausalLM.from_config(_shard_config(resolved, tp), dtype=torch.float32,
                                             attn_implementation="sdpa" if cuda else "eager")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[resolved.recipe.precision.dtype]
    model.to(device="cuda" if cuda else "cpu", dtype=dtype)
    model.train()  # transformers builds models in eval mode, where it silently skips gradient checkpointing
    return model


def _batch(resolved, b: int, cuda: bool):
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, resolved.model.vocab_size, (b, resolved.recipe.batch.seq_len), generator=g)
    return x.cuda() if cuda else x


def _forward_backward(module, backward, x, sync) -> tuple[float, float]:
    """(forward s, backward s) of one micro-batch through `module` (a model or a DeepSpeed engine)."""
    sync()
    t0 = time.perf_counter()
    loss = module(input_ids=x, labels=x).loss
    sync()
    t1 = time.perf_counter()
    backward(loss)
    sync()
    return t1 - t0, time.perf_counter() - t1


def _timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def _backward(loss) -> None:
    loss.backward()


def _passes(resolved, spec: dict, cuda: bool, sync) -> list[dict]:
    out = []
    for tp in spec["tps"]:
        model = _model(resolved, tp, cuda)
        for ac in spec["activation_checkpointing"]:
            if ac == "full":
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_disable()
            for b in spec["micro_batch_sizes"]:
                x = _batch(resolved, b, cuda)
                fwd, bwd = [], []
                for it in range(spec["warmup_iters"] + spec["iters"]):
                    tf, tb = _forward_backward(model, _backward, x, sync)
                    model.zero_grad(set_to_none=True)
                    if it >= spec["warmup_iters"]:
                        fwd.append(tf)
                        bwd.append(tb)
                # Means: a step is the sum of its parts, and the mean of a sum is the sum of the means.
                both = [f + b_ for f, b_ in zip(fwd, bwd, strict=True)]
                out.append({"tp": tp, "micro_batch_size": b, "activation_checkpointing": ac,
                            "forward_s": statistics.fmean(fwd), "backward_s": statistics.fmean(bwd),
                            "sd_s": statistics.stdev(both) if len(both) > 1 else 0.0})
        del model
        gc.collect()
    return out


def _data(resolved, spec: dict) -> dict[str, float]:
    """Seconds to make one micro-batch of each size the way the training loop does (the recipe's data source)."""
    import torch

    from launch.data import micro_batch
    from launch.trainers.common import data_source

    source = data_source(resolved)
    out = {}
    for b in spec["micro_batch_sizes"]:
        times = []
        for it in range(spec["warmup_iters"] + spec["iters"]):
            t0 = time.perf_counter()
            torch.from_numpy(micro_batch(source, it, global_batch=b, micro=b, dp=1, dp_rank=0, micro_step=0))
            times.append(time.perf_counter() - t0)
        out[str(b)] = statistics.fmean(times[spec["warmup_iters"]:])
    return out


def _adam(spec: dict, cuda: bool, sync) -> list[list[float]]:
    """(numel, seconds) of torch AdamW steps over one flat fp32 partition (ZeRO-1/2/3 step flat partitions)."""
    import torch

    points = []
    for numel in spec["adam_numels"]:
        p = torch.zeros(numel, device="cuda" if cuda else "cpu", requires_grad=True)
        p.grad = torch.full_like(p, 1e-3)
        opt = torch.optim.AdamW([p], lr=1e-3)
        times = [_timed(opt.step, sync) for _ in range(spec["warmup_iters"] + spec["iters"])][spec["warmup_iters"]:]
        points.append([numel, statistics.fmean(times)])
        del p, opt
    return points


def _engines(resolved, spec: dict, adam_s, cuda: bool, sync) -> list[dict]:
    """The engine's own cost per ZeRO stage: its forward, backward and step minus those of a plain model timed in
    alternation with it (the same moments of machine load for both), minus torch Adam over its parameters."""
    import deepspeed

    from launch.trainers.common import no_jit_comm_op

    no_jit_comm_op()
    b = spec["engine_micro_batch_size"]
    x = _batch(resolved, b, cuda)
    plain = _model(resolved, 1, cuda)
    params = sum(p.numel() for p in plain.parameters())
    out = []
    for item in spec["engines"]:
        model = _model(resolved, 1, cuda)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=item["ds_config"])
        forward, backward, step = [], [], []  # engine minus plain model, per iteration
        for it in range(spec["warmup_iters"] + spec["iters"]):
            pf, pb = _forward_backward(plain, _backward, x, sync)
            plain.zero_grad(set_to_none=True)
            ef, eb = _forward_backward(engine, engine.backward, x, sync)
            es = _timed(engine.step, sync)
            if it >= spec["warmup_iters"]:
                forward.append(ef - pf)
                backward.append(eb - pb)
                step.append(es)
        out.append({"zero_stage": item["zero_stage"], "forward_s": statistics.fmean(forward),
                    "backward_s": statistics.fmean(backward), "step_s": statistics.fmean(step) - adam_s(params)})
        engine.destroy()
        del engine, model
        gc.collect()
    return out


def main(argv: list[str]) -> int:
    from launch.calibration import fit_alpha_beta
    from launch.resolve import Resolved
    from launch.trainers.common import die_with_parent

    die_with_parent()
    calib_dir, index = Path(argv[0]), int(argv[1])
    spec = json.loads((calib_dir / SPEC).read_text())
    resolved = Resolved.load(spec["resolved"])
    cuda = resolved.hardware.name != "cpu"
    import torch

    if cuda:
        torch.cuda.set_device(0)  # calibrate sets CUDA_VISIBLE_DEVICES to this process's device
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    passes = _passes(resolved, spec, cuda, sync)
    adam_points = _adam(spec, cuda, sync)
    alpha, beta = fit_alpha_beta(adam_points)  # the same straight-line fit: seconds = alpha + numel / beta
    engines = []
    if spec["engines"]:
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
        engines = _engines(resolved, spec, lambda n: alpha + (n / beta if beta != float("inf") else 0.0),
                           cuda, sync)
    doc = {"index": index, "pid": os.getpid(), "threads": torch.get_num_threads(), "passes": passes,
           "data_s": _data(resolved, spec),
           "adam_points": adam_points, "adam_alpha_s": alpha, "adam_s_per_param": 0.0 if beta == float("inf") else 1 / beta,
           "engine": engines}
    compute_file(calib_dir, index).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
