"""What the report knows of one run's layout and training settings (analysis.report.data.layout_of fills it from the
run's resolved.json, its metrics' meta record, or its logs), and which file said so."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunLayout:
    """A run's layout and training settings; None where no file of the run states it. The names mean what they mean in
    the recipe and the metrics' meta record (launch.config.schema, launch.run.metrics.MetaRecord)."""

    backend: str | None = None  # deepspeed | megatron | torch
    tp: int | None = None  # tensor-parallel size
    pp: int | None = None  # pipeline-parallel size
    dp: int | None = None  # data-parallel size
    zero_stage: int | None = None  # ZeRO stage
    sp: bool | None = None  # sequence parallelism
    micro_batch_size: int | None = None  # samples per micro-batch
    global_batch_size: int | None = None  # samples per optimizer step
    seq_len: int | None = None  # tokens per sample
    dtype: str | None = None  # training precision (bf16, fp16, fp32)
    world_size: int | None = None  # ranks in the run
    hardware: str | None = None  # the hardware profile's name
    model: str | None = None  # the model's name
    steps: int | None = None  # optimizer steps the run was set to train
    lr: float | None = None  # peak learning rate
    lr_warmup_steps: int | None = None  # learning-rate warm-up steps
    lr_schedule: str | None = None  # learning-rate schedule after the warm-up
    seed: int | None = None  # the run's random seed
    data: str | None = None  # where its rows come from: synthetic, text, parquet or megatron (data.source)
    data_path: str | None = None  # the corpus as the recipe names it (data.path); None for synthetic rows
    corpus: str | None = None  # the rows' content: the first 12 hex digits of the corpora's digest, or "synthetic"
    tokenizer: str | None = None  # "byte", a tokenizer folder, "model (<weights>)", or "none" for synthetic ids
    source: str | None = None  # the file (or record) the layout came from; None: nothing states it

    def dims(self) -> dict[str, int]:
        """The parallel degrees it states (tp, pp, dp): analysis.analyzers.collectives.group_size_hint's `layout`."""
        return {k: v for k in ("tp", "pp", "dp") if (v := getattr(self, k))}
