"""Each validation rule fails with one line naming the file, the dotted field, the value and the fix."""
import json

import pytest

from launch.config.resolve import Resolved, resolve_path
from launch.config.schema import load_recipe
from launch.errors import ConfigError
from tests.conftest import RECIPES

FLAGSHIP = RECIPES / "7b_tp2_zero3"


def err(path, overrides=(), world_size=None) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        resolve_path(path, overrides, world_size)
    return e.value


def test_flagship_resolves_to_expected_layout():
    r = resolve_path(FLAGSHIP)
    assert (r.grid.tp, r.grid.pp, r.grid.dp) == (2, 1, 2)
    assert r.recipe.parallel.zero_stage == 3 and r.recipe.backend == "megatron"
    assert r.grad_accum == 16 // (1 * 2)
    assert r.grid.tp_group(0) == (0, 1) and r.grid.dp_group(0) == (0, 2)


def test_resolved_json_round_trip():
    r = resolve_path(RECIPES / "7b_zero3_ac", ["train.lr=1e-4"])
    back = Resolved.from_json(r.to_json())
    assert back == r
    assert json.loads(r.to_json())["recipe"]["train"]["lr"] == 1e-4


def test_overrides_are_typed_and_recorded():
    r = resolve_path(FLAGSHIP, ["parallel.tp=4", "train.activation_checkpointing=full"])
    assert r.recipe.parallel.tp == 4 and r.grid.dp == 1
    assert r.recipe.train.activation_checkpointing == "full"
    loaded = load_recipe(FLAGSHIP, ["parallel.tp=4"])
    assert loaded.where("parallel.tp") == "override parallel.tp=4"


@pytest.mark.parametrize("override, field, words", [
    ("parallel.tp=two", "parallel.tp", "is not an integer"),
    ("parallel.sp=1", "parallel.sp", "is not true or false"),
    ("precision.dtype=fp8", "precision.dtype", '"bf16" | "fp16" | "fp32"'),
    ("parallel.offload_optimizer=disk", "parallel.offload_optimizer", '"none" | "cpu" | "nvme"'),
    ("parallel.tpp=2", "parallel.tpp", "did you mean parallel.tp?"),
    ("bogus.key=1", "bogus.key", "is not a known key"),  # the key as written, not {"key": 1}
])
def test_type_and_unknown_key_errors(override, field, words):
    e = err(FLAGSHIP, [override])
    assert e.field == field and words in str(e)
    assert str(e).startswith("override ")


def test_heads_divisible_by_tp():
    e = err(FLAGSHIP, ["parallel.tp=3", "hardware.gpus_per_node=3"])
    assert e.field == "parallel.tp" and e.value == 3 and "32 attention heads" in str(e) and "choose tp among" in str(e)


def test_kv_heads_divisible_by_tp(write_recipe):
    # Llama-3.1-8B has 32 query heads but 8 KV heads: tp=16 divides the former, not the latter.
    d = write_recipe("x", '[model]\nname = "llama-3.1-8b"\n[parallel]\ntp = 16\n[hardware]\ngpus_per_node = 16\n'
                          'profile = "h100-sxm"\n[batch]\nmicro_batch_size = 1\nglobal_batch_size = 1\nseq_len = 128\n')
    e = err(d)
    assert "8 KV heads" in str(e) and e.field == "parallel.tp"
    assert str(d / "recipe.toml") in str(e)


def test_layers_divisible_by_pp_times_vpp():
    e = err(FLAGSHIP, ["parallel.tp=1", "parallel.pp=4", "parallel.vpp=3"])
    assert e.field == "parallel.pp" and "× parallel.vpp=3 = 12 does not divide the 32 layers" in str(e)


def test_global_batch_divisible():
    e = err(FLAGSHIP, ["batch.global_batch_size=3"])
    assert e.field == "batch.global_batch_size" and "micro_batch_size 1 × dp 2 = 2" in str(e)
    assert "multiple of 2" in e.fix


def test_sp_needs_tp():
    e = err(FLAGSHIP, ["parallel.tp=1", "parallel.sp=true"])
    assert str(e) == ('override parallel.sp=true: parallel.sp=true needs parallel.tp > 1 (got 1); '
                      'set parallel.tp=2 or parallel.sp=false')


@pytest.mark.parametrize("override, field", [("parallel.pp=2", "parallel.pp"), ("parallel.sp=true", "parallel.sp")])
def test_pp_and_sp_need_megatron(override, field):
    e = err(RECIPES / "7b_zero3_ac", [override, "parallel.tp=2"])
    assert e.field == field and 'needs backend = "megatron"' in str(e)


def test_offload_rules():
    e = err(RECIPES / "7b_zero3_ac", ["parallel.zero_stage=2", "parallel.offload_params=cpu"])
    assert e.field == "parallel.offload_params" and "needs parallel.zero_stage=3" in str(e)
    e = err(RECIPES / "base", ["parallel.offload_optimizer=cpu"])
    assert "needs parallel.zero_stage >= 1" in str(e)
    e = err(RECIPES / "base", ["parallel.zero_stage=3", "parallel.offload_params=nvme"])
    assert "needs a GPU machine" in str(e)
    e = err(RECIPES / "7b_zero3_ac", ["parallel.offload_params=nvme", "parallel.nvme_path=nvme"])
    assert e.field == "parallel.nvme_path" and "absolute path" in str(e)


def test_tp_across_nodes_is_a_warning():
    r = resolve_path(FLAGSHIP, ["hardware.nodes=2", "hardware.gpus_per_node=1"])
    assert any("TP all-reduces cross nodes" in w for w in r.warnings)


def test_world_size_mismatch():
    e = err(FLAGSHIP, world_size=8)
    assert e.field == "hardware.gpus_per_node" and "does not match the world size 8" in str(e)
    e = err(FLAGSHIP, ["parallel.dp=4"])
    assert e.field == "parallel.dp" and "= 2" in str(e)


def test_bf16_on_t4_is_refused():
    e = err(RECIPES / "0.5b_t4_zero2_ac", ["precision.dtype=bf16"])
    assert "Tesla T4" in str(e) and 'precision.dtype="fp16"' in e.fix


def test_model_name_and_config_exclusive(write_recipe):
    d = write_recipe("x", '[model]\nconfig = "cfg.json"\nname = "tiny-llama"\n')
    e = err(d)
    assert "exactly one must be set" in str(e)


def test_child_config_replaces_inherited_name_and_paths_become_absolute(write_recipe, repo, tmp_path, monkeypatch):
    d = write_recipe("x", '[model]\nconfig = "cfg.json"\n')  # the base names tiny-llama
    (d / "cfg.json").write_text((repo / "launch/config/catalogue/models/tiny-qwen2.json").read_text())
    r = resolve_path(d)
    assert r.model.architecture == "Qwen2ForCausalLM" and r.recipe.model.config == str(d / "cfg.json")
    # an override's relative path is relative to the working directory, not to the recipe
    monkeypatch.chdir(repo)
    r = resolve_path(d, ["data.source=text", "data.path=tests/fixtures/text/corpus.jsonl"])
    assert r.recipe.data.path == str(repo / "tests/fixtures/text/corpus.jsonl")
    r = resolve_path(d, ["deepspeed.config=ds_configs/zero2.json", "parallel.zero_stage=2"])
    assert r.ds_base == "ds_configs/zero2.json"
    e = err(d, ["model.weights=nowhere"])
    assert e.field == "model.weights" and "is not a folder" in str(e)


def test_model_from_config_path(write_recipe, repo):
    body = ('backend = "deepspeed"\n[model]\nconfig = "cfg.json"\n'
            '[batch]\nmicro_batch_size = 1\nglobal_batch_size = 2\nseq_len = 32\n[train]\nsteps = 5\nwarmup_steps = 1\n')
    d = write_recipe("x", body, extends=None)
    (d / "cfg.json").write_text((repo / "launch/config/catalogue/models/tiny-qwen2.json").read_text())
    r = resolve_path(d)
    assert r.model.architecture == "Qwen2ForCausalLM" and r.model.tie_word_embeddings
    (d / "cfg.json").write_text("{")
    e = err(d)
    assert "cfg.json" in str(e)


def test_extends_cycle_and_missing(write_recipe, tmp_path):
    a = write_recipe("a", "", extends=str(tmp_path / "recipes" / "b"))
    write_recipe("b", "", extends=str(tmp_path / "recipes" / "a"))
    with pytest.raises(ConfigError, match="forms a cycle"):
        resolve_path(a)
    c = write_recipe("c", "", extends="../nowhere")
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_path(c)


def test_invalid_toml_names_file(write_recipe):
    d = write_recipe("x", "[parallel\n")
    e = err(d)
    assert str(d / "recipe.toml") in str(e) and "not valid TOML" in str(e)


def test_ds_config_composed_from_recipe():
    r = resolve_path(RECIPES / "7b_zero3_ac")
    c = r.ds_config
    assert c["train_batch_size"] == 16 == c["train_micro_batch_size_per_gpu"] * c["gradient_accumulation_steps"] * 4
    assert c["zero_optimization"]["stage"] == 3 and c["bf16"]["enabled"] is True
    assert r.ds_base == "ds_configs/zero3.json"
    off = resolve_path(RECIPES / "7b_zero3_ac", ["parallel.offload_optimizer=cpu", "parallel.offload_params=cpu"])
    assert off.ds_base == "ds_configs/zero3_offload_all_cpu.json"
    assert off.ds_config["zero_optimization"]["offload_param"]["device"] == "cpu"
    tp = resolve_path(RECIPES / "7b_zero3_ac", ["parallel.tp=2"])
    assert tp.ds_config["tensor_parallel"]["autotp_size"] == 2 and "train_batch_size" not in tp.ds_config


def test_ds_base_contradicting_recipe_is_refused(write_recipe):
    d = write_recipe("x", '[parallel]\nzero_stage = 2\n[deepspeed]\nconfig = "my.json"\n')
    (d / "my.json").write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_batch_size": 8}))
    e = err(d)
    assert e.file.endswith("my.json") and e.field == "zero_optimization.stage" and e.value == 3
    assert "parallel.zero_stage gives 2" in str(e)
    (d / "my.json").write_text(json.dumps({"train_batch_size": 99}))
    e = err(d)
    assert e.field == "train_batch_size" and "batch.global_batch_size gives 8" in str(e)
    (d / "my.json").write_text("{oops")
    e = err(d)
    assert "not valid JSON" in str(e)


def test_selective_recompute_needs_megatron():
    e = err(RECIPES / "tiny_zero2", ["train.activation_checkpointing=selective"])
    assert e.field == "train.activation_checkpointing" and 'set train.activation_checkpointing="full"' in str(e)
    flagship = resolve_path(FLAGSHIP, ["train.activation_checkpointing=selective"])  # megatron: fine
    assert flagship.recipe.train.activation_checkpointing == "selective"


# Every combination the resolver's rules allow (parameter offload and NVMe need ZeRO-3; the refusals are
# tested in test_offload_rules).
VALID_OFFLOAD = [(z, o, p) for z in (1, 2, 3) for o in ("none", "cpu", "nvme") for p in ("none", "cpu", "nvme")
                 if z == 3 or (p == "none" and o != "nvme")]


@pytest.mark.parametrize("zero, opt, par", VALID_OFFLOAD)
def test_every_valid_offload_combination_composes(zero, opt, par):
    r = resolve_path(RECIPES / "7b_zero3_ac", [f"parallel.zero_stage={zero}", f"parallel.offload_optimizer={opt}",
                                               f"parallel.offload_params={par}", "parallel.nvme_path=/scratch/nvme"])
    zo = r.ds_config["zero_optimization"]
    assert zo["stage"] == zero
    for kind, dev in (("offload_optimizer", opt), ("offload_param", par)):
        if dev == "none":
            assert zo.get(kind, {}).get("device", "none") == "none"
        else:
            assert zo[kind]["device"] == dev
            if dev == "nvme":
                assert zo[kind]["nvme_path"] == "/scratch/nvme" and "aio" in r.ds_config
    assert r.ds_config["optimizer"]["params"]["torch_adam"] is (opt == "none")


@pytest.mark.parametrize("override, field", [
    ("plan.headroom=1.5", "plan.headroom"), ("plan.headroom=-0.1", "plan.headroom"), ("train.lr=-1", "train.lr"),
    ("train.min_lr=1", "train.min_lr"), ("train.grad_clip=-1", "train.grad_clip"),
    ("train.adam_beta2=1.5", "train.adam_beta2"), ("train.weight_decay=-0.1", "train.weight_decay"),
])
def test_numeric_ranges(override, field):
    e = err(FLAGSHIP, [override])
    assert e.field == field and "is out of range" in str(e) and str(e).startswith("override ")


def test_sequence_parallel_needs_seq_len_divisible_by_tp():
    e = err(RECIPES / "7b_tp4_sp", ["batch.seq_len=4098"])
    assert e.field == "batch.seq_len" and "multiple of 4" in e.fix


def test_offload_needs_the_right_prebuilt_ops():
    from launch.run.extensions import needed_ops

    assert needed_ops(resolve_path(RECIPES / "tiny_zero2")) == []
    assert needed_ops(resolve_path(RECIPES / "tiny_zero2", ["parallel.offload_optimizer=cpu"])) == ["cpu_adam"]
    nvme = resolve_path(RECIPES / "7b_zero3_ac", ["parallel.offload_optimizer=nvme", "parallel.offload_params=nvme"])
    assert needed_ops(nvme) == ["cpu_adam", "async_io"]


# ---------------------------------------------------------------------- Megatron layouts (one line, the fix)

MC = RECIPES / "tiny_tp2_sp"


@pytest.mark.parametrize("overrides, field, text", [
    (["parallel.pp=2", "parallel.sp=false", "parallel.tp=1", "parallel.zero_stage=2"], "parallel.zero_stage",
     "cannot combine with parallel.pp=2 on backend \"megatron\" (supported: zero_stage 0, 1); set parallel.zero_stage=1"),
    (["parallel.zero_stage=3"], "parallel.zero_stage",
     "cannot combine with parallel.sp=true on backend \"megatron\" (supported: zero_stage 0, 1); set parallel.zero_stage=1"),
    (["parallel.pp=2", "parallel.sp=false", "parallel.tp=1", "model.name=\"tiny-qwen2\""], "parallel.pp",
     "needs untied embeddings"),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.sp=false", "parallel.tp=1", "batch.micro_batch_size=4",
      "batch.global_batch_size=4"], "batch.global_batch_size",
     "gives 1 micro-batches per step (global / (micro_batch_size 4 × dp 1)); the interleaved schedule "
     "(parallel.vpp=2) needs a multiple of parallel.pp=2; set batch.global_batch_size to a multiple of 8"),
    (["parallel.offload_optimizer=\"cpu\"", "parallel.zero_stage=1"], "parallel.offload_optimizer",
     "is not supported by backend \"megatron\" yet"),
    (["parallel.tp=2", "batch.seq_len=33"], "batch.seq_len", "is not divisible by parallel.tp=2"),
    (["parallel.tp=4", "hardware.gpus_per_node=4"], "parallel.tp", "does not divide the 2 KV heads of tiny-llama"),
])
def test_megatron_layout_errors(overrides, field, text):
    e = err(MC, overrides)
    assert e.field == field, (e.field, str(e))
    assert text in str(e), str(e)
    assert "\n" not in str(e)


def test_vpp_without_pp_and_layers_not_divisible():
    e = err(MC, ["parallel.vpp=3"])  # 4 layers are not divisible by pp 1 × vpp 3
    assert e.field == "parallel.pp" and "× parallel.vpp=3 = 3 does not divide the 4 layers" in str(e)
    e = err(MC, ["parallel.vpp=2", "parallel.pp=1"])
    assert e.field == "parallel.vpp" and "needs parallel.pp > 1" in str(e)


TORCH = RECIPES / "tiny_fsdp2"


@pytest.mark.parametrize("overrides, field, said, fix", [
    (["parallel.zero_stage=1"], "parallel.zero_stage", "has no torch equivalent", "set parallel.zero_stage=2"),
    (["parallel.zero_stage=0", "parallel.tp=2"], "parallel.zero_stage",
     'cannot combine with parallel.tp=2 on backend "torch" (supported: zero_stage 2, 3)',
     "set parallel.zero_stage=3, or parallel.tp=1"),
    (["parallel.pp=2", "parallel.zero_stage=0"], "parallel.zero_stage",
     'cannot combine with parallel.pp=2 on backend "torch" (supported: zero_stage 2, 3)',
     "set parallel.zero_stage=3, or parallel.pp=1"),
    (["model.name=tiny-qwen2", "parallel.pp=2"], "parallel.pp", "ties its output layer", "set parallel.pp=1"),
    (["parallel.pp=2", "batch.micro_batch_size=8"], "batch.global_batch_size",
     "gives 1 micro-batch(es) per step, fewer than parallel.pp=2", "set batch.global_batch_size to at least 2"),
    (["parallel.pp=2", "precision.dtype=fp16"], "precision.dtype", "has no loss-scaling path",
     'set precision.dtype="bf16"'),
    (["parallel.offload_optimizer=cpu"], "parallel.offload_optimizer", "FSDP2 offloads parameters, gradients and",
     'set both to "cpu"'),
    (["hardware.profile=h100-sxm", "parallel.offload_optimizer=nvme", "parallel.offload_params=nvme"],
     "parallel.offload_params", "is not offered by FSDP2", 'parallel.offload_params="cpu"'),
    (['deepspeed.config="zero3.json"'], "deepspeed.config", 'is not used by backend "torch"', "remove deepspeed.config"),
    (["parallel.tp=3", "hardware.gpus_per_node=3"], "parallel.tp", "does not divide the 4 attention heads", "choose tp"),
])
def test_torch_backend_refuses_what_it_cannot_build(overrides, field, said, fix):
    e = err(TORCH, overrides)
    assert e.field == field and said in e.problem and fix in e.fix, str(e)
    assert "\n" not in str(e)


def test_hybrid_sharding_on_the_torch_backend_takes_tp():
    """parallel.zero_hpz_partition_size is FSDP2's hybrid sharding on the torch backend: its groups live on the mesh,
    so TP may come with it (DeepSpeed's hpZ groups consecutive ranks and refuses TP)."""
    r = resolve_path(TORCH, ["hardware.gpus_per_node=8", "parallel.tp=2", "parallel.zero_hpz_partition_size=2"])
    assert (r.grid.tp, r.grid.dp, r.recipe.parallel.zero_hpz_partition_size) == (2, 4, 2)
    e = err(RECIPES / "tiny_zero2", ["hardware.gpus_per_node=8", "parallel.tp=2", "parallel.zero_stage=3",
                                     "parallel.zero_hpz_partition_size=2"])
    assert e.field == "parallel.zero_hpz_partition_size" and 'backend = "torch"' in e.fix


def test_compile_is_refused_with_its_reason_where_the_library_cannot():
    assert resolve_path(RECIPES / "tiny_zero2", ["train.compile=true"]).recipe.train.compile  # DeepSpeed ZeRO-2
    e = err(RECIPES / "tiny_tp2_sp", ["train.compile=true"])
    assert e.field == "train.compile" and "does not torch.compile GPTModel" in str(e) and "train.compile=false" in e.fix
    e = err(RECIPES / "tiny_zero2", ["train.compile=true", "parallel.zero_stage=3"])
    assert e.field == "train.compile" and "recompiles per submodule under ZeRO-3" in str(e)


def test_torch_backend_composes_no_deepspeed_config():
    r = resolve_path(TORCH, ["precision.dtype=fp16"])  # fp16 on CPU ranks: torch's scaler runs there
    assert r.ds_config == {} and r.ds_base == "" and r.recipe.parallel.zero_stage == 3


def test_megatron_zero1_is_its_own_distributed_optimizer_not_a_deepspeed_engine(write_recipe):
    """At ZeRO-1 the megatron backend trains through Megatron-Core's DDP and distributed optimizer: no DeepSpeed config
    is composed, the fit check is the "megatron" accounting, and a DeepSpeed config the recipe names would be silently
    unused, so it is refused. Its other stages still compose one."""
    from launch.config.backends import traits

    base = ["parallel.tp=1", "parallel.sp=false", "hardware.gpus_per_node=2", "batch.micro_batch_size=2"]
    zero1 = resolve_path(RECIPES / "tiny_tp2_sp", [*base, "parallel.zero_stage=1"])
    assert zero1.ds_config == {} and zero1.ds_base == ""
    for z in (0, 2, 3):
        assert resolve_path(RECIPES / "tiny_tp2_sp", [*base, f"parallel.zero_stage={z}"]).ds_config["zero_optimization"][
            "stage"] == z
    assert [traits("megatron").accounting_at(z) for z in range(4)] == ["deepspeed", "megatron", "deepspeed", "deepspeed"]
    assert [traits("deepspeed").accounting_at(z) for z in range(4)] == ["deepspeed"] * 4
    d = write_recipe("x", 'backend = "megatron"\n[parallel]\nzero_stage = 1\n[deepspeed]\nconfig = "ds.json"\n')
    (d / "ds.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        resolve_path(d)
    assert e.value.field == "deepspeed.config" and "distributed optimizer" in str(e.value)


# ---------------------------------------------------------------------- fp16 loss scaling

FP16_T4 = '[precision]\ndtype = "fp16"\n[hardware]\nprofile = "t4"\n'  # DeepSpeed (the base's backend) on a T4


def test_initial_loss_scale_power_reaches_deepspeed_and_the_torch_scaler(write_recipe):
    d = write_recipe("x", FP16_T4)
    fp16 = resolve_path(d).ds_config["fp16"]
    # the default is the libraries' own (torch.amp.GradScaler init_scale=2.0**16, DeepSpeed initial_scale_power=16);
    # the shipped fragment ds_configs/fp16.json still gives the rest of the scaler's tuning
    assert (fp16["enabled"], fp16["initial_scale_power"], fp16["hysteresis"], fp16["loss_scale"]) == (True, 16, 2, 0)
    assert resolve_path(d, ["precision.initial_loss_scale_power=12"]).ds_config["fp16"]["initial_scale_power"] == 12
    torch_fp16 = resolve_path(TORCH, ["precision.dtype=fp16", "precision.initial_loss_scale_power=40"])
    assert torch_fp16.recipe.precision.initial_loss_scale_power == 40 and torch_fp16.ds_config == {}
    assert resolve_path(RECIPES / "tiny_zero2").ds_config["fp16"] == {"enabled": False}  # fp32: no scaler tuning


@pytest.mark.parametrize("recipe, overrides, said, fix", [
    (TORCH, ["precision.initial_loss_scale_power=20"], 'is set but precision.dtype="fp32" scales no loss',
     'set precision.dtype="fp16", or leave precision.initial_loss_scale_power unset'),
    (MC, ["precision.dtype=bf16", "precision.initial_loss_scale_power=20"],
     'is set but precision.dtype="bf16" scales no loss',
     'set precision.dtype="fp16"'),
    (TORCH, ["precision.dtype=fp16", "precision.initial_loss_scale_power=65"], "must be between 0 and 64",
     "set precision.initial_loss_scale_power within that range"),
    (TORCH, ["precision.dtype=fp16", "precision.initial_loss_scale_power=-1"], "must be between 0 and 64",
     "set precision.initial_loss_scale_power within that range"),
])
def test_initial_loss_scale_power_errors(recipe, overrides, said, fix):
    e = err(recipe, overrides)
    assert e.field == "precision.initial_loss_scale_power" and said in e.problem and fix in e.fix, str(e)
    assert str(e).startswith("override precision.initial_loss_scale_power=") and "\n" not in str(e)


def test_a_deepspeed_base_contradicting_the_initial_loss_scale_is_refused(write_recipe):
    d = write_recipe("x", FP16_T4 + '[deepspeed]\nconfig = "my.json"\n')
    (d / "my.json").write_text(json.dumps({"fp16": {"initial_scale_power": 12}}))
    e = err(d)
    assert e.file.endswith("my.json") and e.field == "fp16.initial_scale_power" and e.value == 12
    assert "precision.initial_loss_scale_power gives 16" in str(e)
    assert resolve_path(d, ["precision.initial_loss_scale_power=12"]).ds_config["fp16"]["initial_scale_power"] == 12
