"""Rank program of tests/dist/test_megatron_sharding.py (torchrun, 2 gloo ranks): measures, the test judges.

Rank 0 prints one line `RESULT <json>`: per case, differences between the sharded Megatron computation
and an unsharded oracle computed on every rank (plain torch.nn.Linear for the MLP, the 1-rank HF model for
GPTModel), and whether the HF state gathered back from all ranks is exactly the one loaded.
"""
from __future__ import annotations

import json
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

SEQ, BATCH, MICRO_BATCHES = 16, 2, 2


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    sp: bool = False


LAYOUTS = (Layout("tp2", tp=2), Layout("tp2_sp", tp=2, sp=True), Layout("pp2", pp=2), Layout("pp2_vpp2", pp=2, vpp=2))
MODELS = ("tiny-llama", "tiny-qwen2")
# One KV head at TP2: Megatron's other GQA path (fewer query groups than TP ranks: all-gather, then slice).
FEWER_KV_HEADS_THAN_TP = ("tiny-llama-kv1", LAYOUTS[:2])  # the two TP layouts


def _gathered(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _worst(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> float:
    """max |got - want| / (atol + rtol |want|): at most 1 where torch.allclose would pass."""
    return float(((got - want).abs() / (atol + rtol * want.abs())).max())


def tied_pp2_without_compat() -> dict[str, Any]:
    """Before any redirect: GPTModel with tied embeddings at PP2 fails in its constructor on a CPU build."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from launch.config.models import load_model
    from launch.ranks.trainers.megatron_model import transformer_config

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    spec = load_model(name="tiny-qwen2")
    config = transformer_config(spec, cuda=False, tp=1, pp=2, vpp=1, sp=False, activation_checkpointing="none", dtype="fp32")
    try:
        GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=spec.vocab_size,
                 max_sequence_length=SEQ, pre_process=parallel_state.is_pipeline_first_stage(),
                 post_process=parallel_state.is_pipeline_last_stage(), share_embeddings_and_output_weights=True,
                 position_embedding_type="rope")
        result: dict[str, Any] = {"error": "", "where": ""}
    except Exception as exc:  # recorded for the test to judge
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/megatron/" in f.filename]
        where = f"{frames[-1].filename.rsplit('/', 1)[1]}: {frames[-1].line}"
        result = {"error": f"{type(exc).__name__}: {exc}", "where": where}
    parallel_state.destroy_model_parallel()
    return result


def mlp_tp2() -> dict[str, float]:
    """ColumnParallelLinear (gather_output=False) -> gelu -> RowParallelLinear (input_is_parallel) at TP2
    against torch.nn.Linear with the full weights: output, input grad, every weight and bias grad, each as
    max |difference| / max(1, max |reference|), the worst rank's."""
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank, tp = parallel_state.get_tensor_model_parallel_rank(), 2
    hidden, ffn = 16, 32
    g = torch.Generator().manual_seed(11)  # same full weights, input and output grad on both ranks
    # Scaled as an initialiser would, so that activations are O(1) and 1e-6 is a tight absolute bound.
    w1, b1 = torch.randn(ffn, hidden, generator=g) / hidden**0.5, torch.randn(ffn, generator=g)
    w2, b2 = torch.randn(hidden, ffn, generator=g) / ffn**0.5, torch.randn(hidden, generator=g)
    x = torch.randn(SEQ, BATCH, hidden, generator=g)
    dy = torch.randn(SEQ, BATCH, hidden, generator=g)

    config = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True)
    col = ColumnParallelLinear(hidden, ffn, config=config, init_method=torch.nn.init.zeros_, bias=True,
                               gather_output=False)
    row = RowParallelLinear(ffn, hidden, config=config, init_method=torch.nn.init.zeros_, bias=True,
                            input_is_parallel=True, skip_bias_add=False)
    with torch.no_grad():
        col.weight.copy_(w1.chunk(tp, dim=0)[rank])
        col.bias.copy_(b1.chunk(tp, dim=0)[rank])
        row.weight.copy_(w2.chunk(tp, dim=1)[rank])
        row.bias.copy_(b2)
    x_sharded = x.clone().requires_grad_(True)
    hidden_part, _ = col(x_sharded)
    y, _ = row(F.gelu(hidden_part))
    (y * dy).sum().backward()

    ref1, ref2 = torch.nn.Linear(hidden, ffn), torch.nn.Linear(ffn, hidden)
    with torch.no_grad():
        for param, value in ((ref1.weight, w1), (ref1.bias, b1), (ref2.weight, w2), (ref2.bias, b2)):
            param.copy_(value)
    x_full = x.clone().requires_grad_(True)
    y_full = ref2(F.gelu(ref1(x_full)))
    (y_full * dy).sum().backward()

    pairs = {
        "output": (y, y_full),
        "input_grad": (x_sharded.grad, x_full.grad),
        "column_weight_grad": (col.weight.grad, ref1.weight.grad.chunk(tp, dim=0)[rank]),
        "column_bias_grad": (col.bias.grad, ref1.bias.grad.chunk(tp, dim=0)[rank]),
        "row_weight_grad": (row.weight.grad, ref2.weight.grad.chunk(tp, dim=1)[rank]),
        "row_bias_grad": (row.bias.grad, ref2.bias.grad),
    }
    # Relative to the largest reference value: a bias grad sums 32 positions, so its fp32 rounding scales with it.
    diffs = {k: float((got.detach() - want.detach()).abs().max() / max(1.0, float(want.abs().max())))
             for k, (got, want) in pairs.items()}
    parallel_state.destroy_model_parallel()
    per_rank = _gathered(diffs)
    return {k: max(r[k] for r in per_rank) for k in diffs}


def _perturbed_reference(spec) -> dict[str, torch.Tensor]:
    # As in tests/unit/test_megatron_model.py: HF's unit norms and zero biases would hide a mis-mapping.
    from launch.ranks.trainers.megatron_model import hf_reference_state

    g = torch.Generator().manual_seed(1000)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in hf_reference_state(spec, 0).items()}


def _hf_losses_and_grads(spec, state, batches) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    from launch.torchtools.hf import hf_config

    model = AutoModelForCausalLM.from_config(hf_config(spec), dtype=torch.float32, attn_implementation="eager")
    model.load_state_dict(state, strict=False)  # a tied lm_head is the embedding itself
    losses = []
    for b in batches:
        logits = model(input_ids=b["tokens"]).logits
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["labels"].reshape(-1),
                                      reduction="none").view(BATCH, SEQ))
    (sum(loss.mean() for loss in losses) / len(losses)).backward()
    return [loss.detach() for loss in losses], {n: p.grad for n, p in model.named_parameters()}


def _spec(name: str):
    from launch.config.models import ModelSpec, load_model

    if name != FEWER_KV_HEADS_THAN_TP[0]:
        return load_model(name=name)
    d = load_model(name="tiny-llama").to_dict()
    d.update(name=name, num_kv_heads=1, hf_config={**d["hf_config"], "num_key_value_heads": 1})
    return ModelSpec.from_dict(d)


def gpt_case(name: str, layout: Layout) -> dict[str, Any]:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from launch.ranks.trainers.megatron_model import (
        build_chunks,
        gather_hf_state,
        load_hf_state,
        place_of,
        transformer_config,
    )

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None)
    spec = _spec(name)
    config = transformer_config(spec, cuda=False, tp=layout.tp, pp=layout.pp, vpp=layout.vpp, sp=layout.sp,
                                activation_checkpointing="none", dtype="fp32")
    chunks = build_chunks(spec, config, seed=0, attention="eager")
    out: dict[str, Any] = {"chunks": len(chunks), "layers": [len(c.decoder.layers) for c in chunks]}

    # Megatron's own start-up sync of a tied embedding: the last stage's copy equals the first stage's.
    if spec.tie_word_embeddings and layout.pp > 1:
        mine = {"first": chunks[0].embedding.word_embeddings.weight.detach()} if chunks[0].pre_process else {}
        if chunks[-1].post_process:
            mine["last"] = chunks[-1].output_layer.weight.detach()
        both = {k: v for d in _gathered(mine) for k, v in d.items()}
        out["tied_copy_equal_at_init"] = bool(torch.equal(both["first"], both["last"]))

    state = _perturbed_reference(spec)
    load_hf_state(chunks, state, spec)
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, spec.vocab_size, (MICRO_BATCHES, BATCH, SEQ + 1), generator=g)
    batches = [{"tokens": d[:, :-1], "labels": d[:, 1:]} for d in data]
    hf_losses, hf_grads = _hf_losses_and_grads(spec, state, batches)

    # As the training loop will: Megatron DDP per chunk, its finalize_model_grads (SP norm grads summed
    # over TP, tied embedding grads over the embedding group), the schedule parallel_state selects.
    ddp_config = DistributedDataParallelConfig()
    models = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c) for c in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    positions = torch.arange(SEQ).expand(BATCH, SEQ)

    def step(data_iterator, model):
        b = next(data_iterator)
        per_token = model(b["tokens"], positions, None, labels=b["labels"])

        def loss_func(output):
            loss = output.mean()
            return loss, {"per_token": output.detach().clone()}

        return per_token, loss_func

    iterators = [iter(batches) for _ in models]
    results = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iterators if len(models) > 1 else iterators[0], model=models,
        num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=BATCH, forward_only=False)
    if results:  # only the last pipeline stage computes the loss
        diff = max(float((r["per_token"] - want).abs().max()) for r, want in zip(results, hf_losses, strict=True))
    else:
        diff = None
    out["loss_max_abs_diff_per_rank"] = _gathered(diff)

    local_states = {place_of(c): {k: v.clone() for k, v in c.state_dict().items() if isinstance(v, torch.Tensor)}
                    for c in chunks}
    local_grads = {place_of(c): {n: p.main_grad.clone() for n, p in c.named_parameters()} for c in chunks}
    all_states = {k: v for d in _gathered(local_states) for k, v in d.items()}
    all_grads = {k: v for d in _gathered(local_grads) for k, v in d.items()}
    shape = {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp}
    back = gather_hf_state(all_states, spec, **shape)
    out["round_trip_keys_equal"] = list(back) == list(state)
    out["round_trip_mismatches"] = [k for k in state if not torch.equal(back[k], state[k])]
    try:
        grads = gather_hf_state(all_grads, spec, **shape)
        worst = {k: _worst(grads[k], hf_grads[k], rtol=1e-4, atol=1e-6) for k in hf_grads}
        out["grad_worst"] = max(worst.values())
        out["grad_worst_key"] = max(worst, key=worst.get)
        out["grad_keys_equal"] = list(grads) == list(hf_grads)
    except ValueError as exc:
        out["grad_gather_error"] = str(exc)
    parallel_state.destroy_model_parallel()
    return out


def main() -> None:
    dist.init_process_group("gloo")
    results: dict[str, Any] = {"tied_pp2_without_compat": tied_pp2_without_compat()}  # first: nothing redirected yet
    from launch.ranks.trainers import cpu_compat

    results["redirects"] = cpu_compat.apply(cuda=False)
    results["mlp_tp2"] = mlp_tp2()
    for layout in LAYOUTS:
        for name in MODELS:
            results[f"{name}/{layout.name}"] = gpt_case(name, layout)
    name, layouts = FEWER_KV_HEADS_THAN_TP
    for layout in layouts:
        results[f"{name}/{layout.name}"] = gpt_case(name, layout)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
