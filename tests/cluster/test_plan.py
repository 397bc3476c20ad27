"""`megatron-pdm plan`: exact parameter counts (against built models and published totals), per-GPU memory against
hand-computed cases, layout validity, the CLI, and every cluster preset."""

import contextlib
import io
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_pdm.cli import main
from megatron_pdm.cluster.plan import (
    GB,
    Layout,
    count_parameters,
    format_plan,
    kv_bytes_per_token,
    plan,
    training_memory,
)
from megatron_pdm.models import ModelConfig
from megatron_pdm.train.config import config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((ROOT / "examples" / "presets").glob("*.yaml"))
TINY = dict(vocab_size=128, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2, head_dim=16,
            ffn_hidden_size=128)
TINY_DSV3 = ModelConfig(model_type="deepseek_v3", vocab_size=64, hidden_size=64, num_layers=3, num_attention_heads=4,
                        num_query_groups=4, head_dim=16, ffn_hidden_size=96, num_experts=4, moe_ffn_hidden_size=32,
                        moe_router_topk=2, moe_first_k_dense=1, moe_shared_expert_ffn_hidden_size=32, q_lora_rank=24,
                        kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16)


def _megatron_counts(group, cfgs):
    from megatron_pdm.models import ParallelConfig, build_model, initialize_parallel

    with initialize_parallel(ParallelConfig()) as ctx:
        return [sum(p.numel() for p in build_model(c, ctx).parameters()) for c in cfgs]


def test_counts_equal_megatron_core_built_models(dist_pools):
    cfgs = [ModelConfig(**TINY), ModelConfig(**TINY, tie_word_embeddings=True),
            ModelConfig(**{**TINY, "model_type": "qwen3_moe"}, num_experts=4, moe_ffn_hidden_size=32),
            ModelConfig(**{**TINY, "model_type": "qwen3_moe", "num_layers": 3}, num_experts=8, moe_router_topk=3),
            ModelConfig(**{**TINY, "model_type": "llama"}), ModelConfig(**{**TINY, "model_type": "qwen2"}),
            TINY_DSV3, ModelConfig(**{**TINY_DSV3.__dict__, "q_lora_rank": 0})]
    (built,) = dist_pools(1).run(_megatron_counts, shared=(cfgs,))
    assert built == [count_parameters(c).total for c in cfgs]


def test_multi_latent_attention_count_equals_transformers_deepseek_v3():
    """transformers' DeepseekV3 has the parameters the planner counts (and megatron-core builds: above)."""
    import transformers

    c = TINY_DSV3
    hf = transformers.DeepseekV3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
        moe_intermediate_size=c.moe_ffn_hidden_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_attention_heads, n_shared_experts=1,
        n_routed_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk, first_k_dense_replace=1,
        q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, n_group=1, topk_group=1,
        tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(c).total
    # active: one token passes 2 of the 4 routed experts in each of the 2 MoE layers
    routed = 3 * 64 * 32
    assert count_parameters(c).total - count_parameters(c).active == 2 * (4 - 2) * routed


@pytest.mark.parametrize("preset, total, active, rel_total, rel_active", [
    ("qwen3_4b", 4.0e9, 4.0e9, 0.01, 0.01),
    ("qwen3_8b", 8.2e9, 8.2e9, 0.01, 0.01),
    ("qwen3_30b_a3b", 30.5e9, 3.3e9, 0.005, 0.02),
    ("qwen3_235b_a22b", 235e9, 22e9, 0.005, 0.01),
    ("deepseek_v3", 671e9, 37e9, 0.001, 0.02),
    ("kimi_k2_1t", 1.0e12, 32e9, 0.03, 0.03),  # Kimi K2's card: 1T total, 32B activated
])
def test_counts_match_published_totals(preset, total, active, rel_total, rel_active):
    c = count_parameters(load_config(ROOT / "examples" / "presets" / f"{preset}.yaml").model)
    assert c.total == pytest.approx(total, rel=rel_total)
    assert c.active == pytest.approx(active, rel=rel_active)


def _cfg(**sections):
    base = {"model": TINY, "data": {"max_prompt_length": 8}, "rollout": {"max_new_tokens": 8},
            "train": {"micro_batch_size": 2, "fused_output_layer": False}, "precision": {"train": "bf16"},
            "cluster": {"gpus_per_node": 2}}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return config_from_dict(base)


def test_training_memory_hand_computed():
    """TINY at TP 2 / DP 2, bf16, micro-batch 2 x (8 + 8) tokens, K = 20, no distributed optimizer or recompute.
    Per layer: attention 64 + 64*128 + 2*16 + 64*64 = 12,384; MLP 64 + 64*256 + 128*64 = 24,640; of these the
    two norms and the QK-norms (160) are replicated over TP. Embedding and output 8,192 each, final norm 64."""
    mem, stage = training_memory(_cfg(), Layout(tp=2, pp=1, ep=1, cp=1, dp=2, etp=2))
    local = ((12384 + 24640 - 160) * 2 + 2 * 8192) / 2 + 2 * 160 + 64  # 45,440 parameters on each rank
    assert stage == 0
    assert mem.weights == local * 2 and mem.grads == local * 4 and mem.optimizer == local * 12
    # elements saved per token and layer: attention 2h + 2(n+g)d + 2nd + n = 452, MLP 2h + 3f = 512; 16 tokens/rank
    assert mem.activations == 2 * (452 + 512) * 16 * 2
    assert mem.logits == 2 * 32 * 64 * 2  # bf16 [32, V/2] and its gradient
    assert mem.pdm == 32 * (20 * 12 + 12 + 24 * 4 + 8 * 4) + 2 * 32 * 64 * 4
    assert mem.total == 916_352



def test_fused_output_layer_memory_hand_computed():
    """train.fused_output_layer on the same case: no [32, V/2] logits; a chunk of min(32, 128 MiB / (4 x 64)) = 32
    rows of bf16 logits and their bf16 gradient (4 bytes per logit), the float32 gradients the fused pass holds for
    the backward, [32, H] and [V/2, H], and a chunk's bf16 weight-gradient GEMM result [V/2, H]. At this toy size
    they outweigh the logits; at a preset's they do not (`test_fused_output_layer_shrinks_the_presets_last_stage`)."""
    plain, _ = training_memory(_cfg(), Layout(tp=2, pp=1, ep=1, cp=1, dp=2, etp=2))
    mem, _ = training_memory(_cfg(train={"fused_output_layer": True}), Layout(tp=2, pp=1, ep=1, cp=1, dp=2, etp=2))
    assert mem.logits == 32 * 64 * 4 + (32 + 64) * 64 * 4 + 64 * 64 * 2 and mem.logits_forward == 32 * 64 * 2
    assert mem.pdm == plain.pdm and mem.activations == plain.activations


@pytest.mark.parametrize("preset, factor", [("qwen3_30b_a3b", 3.0), ("qwen3_235b_a22b", 1.9)])
def test_fused_output_layer_shrinks_the_presets_last_stage(preset, factor):
    """At a preset's micro-batch the logits shard and its gradient dominate the last stage's transient memory; the
    fused output layer replaces them by a chunk and two float32 gradient buffers (30B: 3.1x less with the PDM
    buffers; 235B, hidden 4096: 2.0x, its float32 [V/tp, H] weight gradient being the larger part)."""
    from megatron_pdm.cluster.plan import plan, stage_memory

    path = ROOT / "examples" / "presets" / f"{preset}.yaml"
    on, off = (load_config(path, [f"train.fused_output_layer={v}"]) for v in ("true", "false"))
    layout = plan(off).layout
    last_on, last_off = (stage_memory(c, layout, layout.pp - 1) for c in (on, off))
    assert factor * (last_on.logits + last_on.pdm) < last_off.logits + last_off.pdm, (last_on, last_off)


def test_reference_memory_hand_computed():
    """The KL penalty's reference on the GPU (a second copy of the weights), offloaded (none on the GPU but during its
    pass, beside the pass's logits shard; pinned host memory per rank of the node), and with the exact KL its last
    hidden states over a rank's minibatch (prompts_per_step 32 x n 8 / (2 minibatches x DP 2) = 64 rows of 16
    positions, H 64, bf16) and its logits shard per micro-batch (bf16 [32, V/2])."""
    from megatron_pdm.cluster.plan import host_memory

    layout = Layout(tp=2, pp=1, ep=1, cp=1, dp=2, etp=2)
    plain, _ = training_memory(_cfg(), layout)
    kl, _ = training_memory(_cfg(objective={"kl_coef": 0.1}), layout)
    assert kl.reference == plain.weights and kl.total == plain.total + plain.weights
    off, _ = training_memory(_cfg(objective={"kl_coef": 0.1, "ref_offload": True}), layout)
    assert off.reference == 0 and off.reference_pass == plain.weights
    assert off.total == plain.total  # weights + one logits shard < the training pass's activations here
    hosts = [host_memory(_cfg(objective={"kl_coef": 0.1, "ref_offload": o}), layout, 2, colocated=False) for o in
             (False, True)]
    assert hosts[1].reference == 2 * plain.weights and hosts[1].total == hosts[0].total + 2 * plain.weights
    exact, _ = training_memory(_cfg(objective={"kl_coef": 0.1, "kl_type": "exact"}), layout)
    assert exact.reference == plain.weights + 64 * 16 * 64 * 2 and exact.logits == plain.logits + 32 * 64 * 2
    # offloaded, the exact KL's output weight shard stays on the GPU ([V/2, H] bf16)
    both, _ = training_memory(_cfg(objective={"kl_coef": 0.1, "kl_type": "exact", "ref_offload": True}), layout)
    assert both.reference == 64 * 16 * 64 * 2 + 64 * 64 * 2
    # colocated engines share the GPU with the states and the larger of the sync's buffers and, at a checkpoint,
    # the offloaded reference's copy
    assert off.beside_engines == off.states + max(off.weight_sync, off.reference_pass) >= plain.beside_engines


def test_weight_sync_buffers_hand_computed(monkeypatch):
    """TINY at TP 1 / PP 1 / DP 2, the float32 export in buckets of rollout.sync_bucket_bytes = 100,000. Export items
    (elements) per layer: input norm 64, QKV (4 + 2 x 2) x 16 x 64 = 8,192, QK-norms 16 + 16, o_proj 4,096, post-norm
    64, gate/up 2 x 128 x 64 = 16,384, down 8,192 (37,024); embedding 8,192, final norm 64, output 8,192: the stage's
    S = 90,496 x 4 = 361,984 bytes, its largest tensor T = 16,384 x 4 = 65,536. The bucket b = min(max(100,000, T),
    S) = 100,000; rank 0 holds b + T = 165,536 bytes (the sender converts for the engine: no copy on rank 0; a bf16
    engine: 100,000 + 32,768; "tensor" sync keeps the whole update, S + T = 427,520). The sync runs after the step, when
    the activations (123,392), logits (16,384) and PDM buffers (44,928) are freed: the total is the states
    (90,496 x (2 + 4 + 12)) plus the larger of the two. Colocated engines take their memory back for the sync, so
    they have the states and the sync's buffers beside them."""
    import megatron_pdm.cluster.plan as planner

    real, beside = planner.rollout_memory, []

    def spy(*args, **kwargs):
        beside.append(kwargs["beside"])
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "rollout_memory", spy)
    p = plan(_cfg(rollout={"sync_bucket_bytes": 100_000}), nodes=1, gpu="h100", top=0)
    m = p.memory
    assert m.weight_sync == 165_536 and m.states == 90_496 * 18
    assert (m.activations, m.logits, m.pdm) == (123_392, 16_384, 44_928)
    assert m.total == 90_496 * 18 + 123_392 + 16_384 + 44_928  # the passes' buffers now exceed the sync's
    assert beside == [m.states + m.weight_sync]
    bf16 = plan(_cfg(rollout={"sync_bucket_bytes": 100_000}, precision={"rollout": "bf16"}), nodes=1, gpu="h100",
                top=0)
    tensor = plan(_cfg(rollout={"sync_bucket_bytes": 100_000, "sglang": {"weight_sync": "tensor"}, "engine": "sglang"}),
                  nodes=1, gpu="h100", top=0)
    assert (bf16.memory.weight_sync, tensor.memory.weight_sync) == (132_768, 427_520)
    assert "weight_sync 0.00" in planner.format_plan(p) and "weight_sync" in p.to_json()["per_gpu_memory_breakdown_gb"]
    # the default 1 GiB bucket holds the whole stage: b = S, rank 0 holds S + T
    assert plan(_cfg(), nodes=1, gpu="h100", top=0).memory.weight_sync == 361_984 + 65_536
    # below the activations the sync adds nothing to the total
    small = planner.Memory(weights=1, activations=10, logits=2, pdm=3, weight_sync=14)
    assert small.total == 1 + 15 and replace(small, weight_sync=16).total == 1 + 16
    # the layout facts live at the models layer; plan re-exports them
    from megatron_pdm.models import Layout as ModelsLayout
    from megatron_pdm.models import layout_of

    assert Layout is ModelsLayout and planner.layout_of is layout_of


def test_memory_under_distributed_optimizer_recompute_and_pipeline():
    base, _ = training_memory(_cfg(), Layout(2, 1, 1, 1, 2, 2))
    sharded, _ = training_memory(_cfg(optim={"distributed_optimizer": True}), Layout(2, 1, 1, 1, 2, 2))
    assert sharded.optimizer == base.optimizer / 2 and sharded.weights == base.weights
    full, _ = training_memory(_cfg(train={"recompute": "full"}), Layout(2, 1, 1, 1, 2, 2))
    assert full.activations == 2 * 64 * 16 * 2 + (452 + 512) * 16 * 2  # layer inputs, plus one layer recomputed
    # PP 2: stage 0 keeps 2 micro-batches of its one layer in flight, the last stage holds the output layer
    pp, stage = training_memory(_cfg(), Layout(1, 2, 1, 1, 2, 1))
    first_stage_params = 12384 + 24640 + 8192
    last_stage_params = 12384 + 24640 + 8192 + 64
    assert stage == 1 and pp.weights == last_stage_params * 2
    assert last_stage_params > first_stage_params
    # MoE: the routed experts split over EP x ETP, everything else over TP
    moe = _cfg(model={"model_type": "qwen3_moe", "num_experts": 4, "moe_ffn_hidden_size": 32})
    m1, _ = training_memory(moe, Layout(1, 1, 1, 1, 4, 1))
    m4, _ = training_memory(moe, Layout(1, 1, 4, 1, 4, 1))
    expert = 3 * 64 * 32
    assert m1.weights - m4.weights == 2 * (4 - 1) * expert * 2


def test_kv_cache_bytes():
    qwen = load_config(ROOT / "examples" / "presets" / "qwen3_30b_a3b.yaml").model
    assert kv_bytes_per_token(qwen, "auto", 1) == 48 * 2 * 4 * 128 * 2
    assert kv_bytes_per_token(qwen, "fp8_e4m3", 4) == 48 * 2 * 1 * 128  # 4 KV heads over TP 4
    assert kv_bytes_per_token(qwen, "auto", 8) == 48 * 2 * 1 * 128 * 2  # replicated past the head count
    dsv3 = load_config(ROOT / "examples" / "presets" / "deepseek_v3.yaml").model
    assert kv_bytes_per_token(dsv3, "auto", 16) == 61 * (512 + 64) * 2


def test_layout_errors_and_does_not_fit():
    with pytest.raises(ValueError, match="tensor x pipeline x context = 3 must divide the 2 training GPUs"):
        plan(_cfg(parallel={"tensor": 3}), nodes=1, gpu="h100")
    with pytest.raises(ValueError, match="3 experts are not divisible by EP 2"):
        plan(_cfg(model={"model_type": "qwen3_moe", "num_experts": 3}, parallel={"expert": 2}), nodes=1, gpu="h100")
    with pytest.raises(ValueError, match="gpu: 'a100'"):
        plan(_cfg(), gpu="a100")
    big = load_config(ROOT / "examples" / "presets" / "qwen3_30b_a3b.yaml", ["parallel.expert=1"])
    p = plan(big, nodes=1)
    assert not p.fits and p.memory.total > p.capacity_gb * GB
    assert p.ranked and all(lay.ep * lay.etp > 1 for lay, _ in p.ranked)  # what fits shards experts
    from megatron_pdm.cluster.plan import format_plan

    assert "does not fit: needs" in format_plan(p) and ", has 71.64" in format_plan(p)


@pytest.mark.e2e
def test_cli_json_and_exit_codes():
    preset = str(ROOT / "examples" / "presets" / "qwen3_30b_a3b.yaml")
    out = subprocess.run([sys.executable, "-m", "megatron_pdm.cli", "plan", preset, "--json"], capture_output=True,
                         text=True, check=True)
    d = json.loads(out.stdout)
    assert d["params_total"] == count_parameters(load_config(preset).model).total
    assert d["params_active"] < d["params_total"] and d["fits"] is True
    assert d["per_gpu_memory_gb"] == d["per_gpu_memory_breakdown_gb"]["total"] < d["usable_gb"]
    assert d["ranked_layouts"] and d["rollout"]["kv_tokens_per_engine"] > 0
    assert d["per_gpu_memory_breakdown_gb"]["weight_sync"] > 0
    no = _plan_cli(preset, "--nodes", "1", "parallel.expert=1")
    assert no.returncode == 1 and "does not fit: needs" in no.stdout


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_presets_fit_with_headroom(preset):
    """Every preset is a valid config whose own layout fits its nodes with room (<= 85% of the usable memory) and
    whose rollout engines hold at least one full-length sequence."""
    from megatron_pdm.cluster.plan import TIGHT_FRACTION

    cfg = load_config(preset)
    p = plan(cfg)
    assert p.fits, preset
    assert p.memory.total <= TIGHT_FRACTION * p.capacity_gb * GB
    assert cfg.objective.top_k == 20 and cfg.objective.mask == "pdm"
    assert p.rollout.sequences_per_engine >= 1


def test_routed_expert_replay_and_moe_dispatch_memory_hand_computed():
    """R3 holds the step's int16 expert choices of the stage's MoE layers on each GPU: prompts_per_step 16 x n 4 =
    64 rows over DP 2 = 32 rows x (8 + 8) positions x 2 layers x top-2 x 2 bytes, and on rank 0's node the samples'
    int32 choices of every layer, 64 x 16 x 2 x 2 x 4 bytes (twice under lag 1: a step's batch waits). The allgather
    dispatcher adds one layer's gathered tokens: 2 x 16 positions / TP 2 x EP 2 x ETP 1 x (64 bf16 + 4 experts x 5)."""
    from megatron_pdm.cluster.plan import host_memory

    moe = {**TINY, "model_type": "qwen3_moe", "num_experts": 4, "moe_ffn_hidden_size": 32, "moe_router_topk": 2}
    lay = Layout(tp=2, pp=1, ep=2, cp=1, dp=2, etp=1)
    plain, _ = training_memory(_cfg(model=moe), lay)
    r3 = _cfg(model=moe, rollout={"routed_experts": True, "n": 4}, train={"prompts_per_step": 16})
    mem, _ = training_memory(r3, lay)
    assert plain.routed_experts == 0 and mem.routed_experts == 32 * 16 * 2 * 2 * 2
    assert mem.total == plain.total + mem.routed_experts
    assert host_memory(r3, lay, 2, colocated=False).routed_experts == 64 * 16 * 2 * 2 * 4
    lagged = _cfg(model=moe, rollout={"routed_experts": True, "n": 4, "schedule": "lagged", "lag": 1},
                  train={"prompts_per_step": 16})
    assert host_memory(lagged, lay, 2, colocated=False).routed_experts == 2 * 64 * 16 * 2 * 2 * 4
    gathered, _ = training_memory(_cfg(model={**moe, "moe_token_dispatcher_type": "allgather"}), lay)
    assert gathered.activations == plain.activations + 16 * 2 * 1 * (64 * 2 + 4 * 5)
    p = plan(_cfg(model={**moe, "moe_grouped_gemm": True}, rollout={"routed_experts": True},
                  train={"recompute": "full"}), top=0)
    assert p.to_json()["moe"] == {"token_dispatcher": "alltoall", "deepep": False, "grouped_gemm": True,
                                  "routed_expert_replay": True, "recompute": "full"}
    text = format_plan(p)
    assert "MoE layers: alltoall dispatcher, grouped GEMM, routed-expert replay (R3) under full recompute" in text
    assert "routed_experts 0.00" in text and plan(_cfg(), top=0).to_json()["moe"] is None


@pytest.mark.parametrize("preset", [p for p in PRESETS if load_config(p).model.is_moe], ids=lambda p: p.stem)
def test_moe_presets_replay_routes_under_recompute(preset):
    """Every MoE preset replays the engine's routing (R3) under full recompute, runs its MoE layers as the peers'
    recipes do, and its plan counts the replayed routes and fits (test_presets_fit_with_headroom: with room)."""
    cfg = load_config(preset)
    assert cfg.rollout.routed_experts and cfg.train.recompute == "full" and cfg.model.moe_grouped_gemm
    deepseek = cfg.model.model_type == "deepseek_v3"
    assert cfg.model.moe_token_dispatcher_type == ("flex" if deepseek else "alltoall")
    assert cfg.model.moe_enable_deepep == deepseek
    p = plan(cfg, top=0)
    assert p.fits and p.memory.routed_experts > 0 and p.host.routed_experts > 0


def test_fp8_presets_are_the_papers_settings():
    rollout = load_config(ROOT / "examples" / "presets" / "qwen3_30b_a3b_fp8_rollout.yaml").precision
    e2e = load_config(ROOT / "examples" / "presets" / "qwen3_30b_a3b_fp8_e2e.yaml").precision
    assert (rollout.train, rollout.rollout) == ("bf16", "fp8")
    assert (e2e.train, e2e.rollout) == ("fp8", "fp8")


BUILT_BY_ITS_SCRIPT = {  # the test that runs each script loads its config too (test_data, test_model_families)
    "qwen3_vocab_tiny.yaml": (ROOT / "runs" / "qwen3_vocab_tiny" / "checkpoint" / "config.json", "its script"),
    "tiny_deepseek_v3.yaml": (ROOT / "runs" / "tiny_deepseek_v3_init" / "checkpoint" / "config.json", "its script"),
    # a 93 MB download; the GGUF conversion itself is tested on a tiny GGUF (test_gguf)
    "smollm2_addition.yaml": (ROOT / "checkpoints" / "smollm2-135m-instruct" / "config.json", "`make smollm2`"),
}


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")) + PRESETS,
                         ids=lambda p: p.relative_to(ROOT / "examples").as_posix())
def test_every_example_config_loads_plans_and_passes_the_trainer_checks(path, monkeypatch):
    """Every example and preset loads; the world it runs on (the cluster's training ranks, or the local
    processes `train` spawns) takes its layout and splits its minibatches over DP as the trainer demands; a
    cluster config plans the same world and fits."""
    from megatron_pdm.vocab_parallel import TOPK_KINDS

    built, by = BUILT_BY_ITS_SCRIPT.get(path.name, (None, None))
    if built is not None and not built.is_file():
        pytest.skip(f"needs {built.relative_to(ROOT)}, which {by} builds")
    monkeypatch.chdir(ROOT)  # the examples' relative paths
    cfg = load_config(path)
    world, source = cfg.training_world_size()
    dp = cfg.check_world_size(world, source)
    rows = cfg.train.prompts_per_step * cfg.rollout.n // cfg.train.minibatches
    assert rows % dp == 0 and cfg.parallel.context == 1 and cfg.objective.divergence in TOPK_KINDS
    if cfg.on_cluster:
        p = plan(cfg)
        assert p.fits and p.training_gpus == world and p.layout.dp == dp
        cfg.precision.check_hardware(cuda=cfg.cluster.gpu != "cpu", transformer_engine=True)
    else:  # a local run: CPU-ready, and started with the processes it asks for
        assert world == cfg.parallel.tensor * cfg.parallel.pipeline * cfg.parallel.context * cfg.parallel.expert
        cfg.precision.check_hardware(cuda=False, transformer_engine=False)
        assert cfg.rollout.engine == "embedded" or cfg.rollout.sglang.urls or cfg.rollout.sglang.num_engines


def test_plan_refuses_nodes_that_do_not_split_the_minibatch():
    preset = ROOT / "examples" / "presets" / "qwen3_235b_a22b.yaml"
    # 4 rollout nodes beside 4 training nodes: TP 4 x PP 8 is DP 1; on 28 nodes, 192 training GPUs are DP 6, which
    # does not divide 512 sequences
    with pytest.raises(ValueError, match=r"= 512 sequences per minibatch must be divisible by the data-parallel size "
                                         r"6 = 192 ranks .*cluster.nodes 28 - cluster.rollout_nodes 4"):
        plan(load_config(preset, ["cluster.rollout_nodes=4", "cluster.nodes=8"]), nodes=28)
    # the ranked layouts leave out every DP that would not split the minibatch
    small = load_config(ROOT / "examples" / "presets" / "qwen3_4b.yaml",
                        ["parallel.tensor=8", "train.prompts_per_step=3", "rollout.n=2", "train.minibatches=1"])
    p = plan(small, nodes=3)  # 24 GPUs, 6 sequences per minibatch: TP 8 x DP 3 is fine, DP 4, 8, 12, 24 are not
    assert p.layout.dp == 3 and p.ranked and {lay.dp for lay, _ in p.ranked} <= {1, 2, 3, 6}
    out = _plan_cli(preset, "cluster.nodes=12")
    assert out.returncode == 2 and "must be divisible by the data-parallel size 3" in out.stderr
    assert "Traceback" not in out.stderr


# --------------------------------------------------------------------------------------------------------------
# uneven pipeline stages, host memory and CPU offload, MoE-guided ranking, errors as messages


@pytest.mark.parametrize("layers, pp, split", [
    (61, 16, (3, 2)),  # DeepSeek-V3 / Kimi-K2 at PP 16: Megatron-Bridge's 3 + 14 x 4 + 2
    (61, 8, (7, 6)),  # NeMo-RL's DeepSeek-V3 recipe
    (94, 8, (11, 11)),  # NeMo-RL's Qwen3-235B recipe
    (61, 2, (31, 30)),
    (48, 8, (0, 0)),  # divides: even stages
    (5, 2, (3, 2)),
])
def test_auto_stage_layers_matches_published_splits(layers, pp, split):
    from megatron_pdm.cluster.plan import auto_stage_layers
    from megatron_pdm.models import ParallelConfig, pipeline_layer_counts

    assert auto_stage_layers(layers, pp) == split
    counts = pipeline_layer_counts(layers, ParallelConfig(pipeline=pp, first_stage_layers=split[0],
                                                          last_stage_layers=split[1]))
    assert sum(counts) == layers and counts[0] <= max(counts) and counts[-1] <= counts[0]


def test_auto_stage_layers_refuses_what_cannot_split():
    from megatron_pdm.cluster.plan import auto_stage_layers

    with pytest.raises(ValueError, match=r"model.num_layers = 61 over parallel.pipeline = 32: no split"):
        auto_stage_layers(61, 32)


def test_uneven_stages_memory_hand_computed():
    """TINY with 5 layers over PP 2 as 3 + 2: stage 0 holds three layers and the embedding and keeps 2 micro-batches
    in flight; stage 1 holds two layers, the output layer and the final norm, and the logits."""
    from megatron_pdm.cluster.plan import stage_memory

    cfg = _cfg(model={"num_layers": 5})
    lay = Layout(1, 2, 1, 1, 1, 1, first_stage_layers=3, last_stage_layers=2)
    layer, emb = 12384 + 24640, 8192
    first, last = stage_memory(cfg, lay, 0), stage_memory(cfg, lay, 1)
    assert first.weights == (3 * layer + emb) * 2 and last.weights == (2 * layer + emb + 64) * 2
    assert first.activations == 2 * 3 * (452 + 512) * 32 * 2 and last.activations == 2 * (452 + 512) * 32 * 2
    assert first.logits == 0 and last.logits == 2 * 32 * 128 * 2
    mem, stage = training_memory(cfg, lay)
    assert mem.total == max(first.total, last.total) and stage == (0 if first.total > last.total else 1)
    assert lay.label() == "TP1 PP2(3/2) CP1 DP1" and lay.stage_layers(5) == [3, 2]
    with pytest.raises(ValueError, match=r"model.num_layers = 5 over parallel.pipeline = 2 with first_stage_layers = "
                                         r"4, last_stage_layers = 2: the layers cannot be split"):
        Layout(1, 2, 1, 1, 1, 1, 4, 2).stage_layers(5)


def test_virtual_stages_memory_hand_computed():
    """TINY with 6 layers over PP 3 x 2 virtual stages: every stage holds 2 layers (two chunks of one), its weights
    as without virtual stages; megatron's interleaved warm-up keeps 2 (PP - stage - 1) + (V - 1) PP + 1 chunk
    plus one passes in flight, of one layer each: 8, 6, 4 layers' activations against 1F1B's 3 x 2, 2 x 2, 1 x 2
    (on the first stage 1 + (PP - 1) / (PP V) = 4 / 3 times as many)."""
    from megatron_pdm.cluster.plan import stage_memory

    cfg = _cfg(model={"num_layers": 6})
    flat, interleaved = Layout(1, 3, 1, 1, 1, 1), Layout(1, 3, 1, 1, 1, 1, virtual=2)
    per_layer = (452 + 512) * 32 * 2
    for stage, chunk_passes in enumerate([8, 6, 4]):
        a, b = stage_memory(cfg, flat, stage), stage_memory(cfg, interleaved, stage)
        assert a.weights == b.weights and a.activations == (3 - stage) * 2 * per_layer
        assert b.activations == chunk_passes * per_layer
    assert interleaved.label() == "TP1 PP3 VP2 CP1 DP1"
    with pytest.raises(ValueError, match=r"parallel.virtual = 2: every pipeline stage's layers must split into that "
                                         r"many equal chunks; model.num_layers = 9 over parallel.pipeline = 3 gives "
                                         r"stages of \[3, 3, 3\] layers"):
        interleaved.stage_layers(9)


def test_token_budget_sizes_the_micro_batch_hand_computed():
    """Issue 30: train.max_tokens_per_microbatch, not micro_batch_size, sizes the micro-batch. TINY at TP 2 / DP 2
    as in test_training_memory_hand_computed (micro_batch_size 2 x (8 + 8) = 32 positions: total 916,352) with a
    64-token budget: the trainer packs four full-length sequences into a micro-batch (4 x 16 <= 64), 64 positions,
    32 per rank under sequence parallelism: activations 2 layers x 964 elements x 32 x 2 bytes = 123,392, logits
    2 x 64 x 64 x 2 = 16,384, PDM 64 x 380 + 2 x 64 x 64 x 4 = 57,088, the same states 45,440 x 18 = 817,920:
    1,014,784 bytes. A budget below the longest sequence: that sequence goes alone, 16 positions."""
    from megatron_pdm.cluster.plan import format_plan
    from megatron_pdm.train.batch import plan_minibatches

    lay = Layout(tp=2, pp=1, ep=1, cp=1, dp=2, etp=2)
    cfg = _cfg(train={"max_tokens_per_microbatch": 64})
    # the trainer's cut of the step's 128 full-length sequences over DP 2: micro-batches of 4 x 16 positions
    cut = plan_minibatches([16] * 128, minibatches=1, ranks=2, micro_batch_size=2, max_tokens=64)
    assert {size for _, sizes in cut[0] for size in sizes} == {4}
    mem, _ = training_memory(cfg, lay)
    assert mem.activations == 2 * (452 + 512) * 32 * 2 == 123_392
    assert mem.logits == 2 * 64 * 64 * 2 == 16_384
    assert mem.pdm == 64 * (20 * 12 + 12 + 24 * 4 + 8 * 4) + 2 * 64 * 64 * 4 == 57_088
    assert mem.states == 45_440 * 18 and mem.total == 1_014_784
    assert training_memory(_cfg(), lay)[0].total == 916_352  # micro_batch_size's 32 positions: what plan reported
    short, _ = training_memory(_cfg(train={"max_tokens_per_microbatch": 10}), lay)
    assert plan_minibatches([16] * 128, minibatches=1, ranks=2, micro_batch_size=2, max_tokens=10)[0][0][1] == [1] * 64
    assert (short.activations, short.logits) == (2 * (452 + 512) * 8 * 2, 2 * 16 * 64 * 2)
    # the printed plan says what sized the micro-batch
    p = plan(cfg, nodes=1, gpu="h100", top=0)
    assert p.memory.activations == 2 * (452 + 512) * 64 * 2  # the config's own TP 1 x DP 2: 64 positions a rank
    assert ("micro-batch: sized by the token budget train.max_tokens_per_microbatch = 64: up to 64 positions; "
            "train.micro_batch_size is unused") in format_plan(p)
    d = p.to_json()
    assert (d["micro_batch_positions"], d["micro_batch_sized_by"]) == (64, "max_tokens_per_microbatch")
    assert "up to 16 positions (a 16-token sequence, longer than the budget, goes alone)" in format_plan(
        plan(_cfg(train={"max_tokens_per_microbatch": 10}), nodes=1, gpu="h100", top=0))
    assert "micro-batch: train.micro_batch_size 2 x 16-token sequences = 32 positions" in format_plan(
        plan(_cfg(), nodes=1, gpu="h100", top=0))


def test_token_budget_micro_batches_in_flight_hand_computed():
    """With a token budget the micro-batch count depends on the lengths: the plan counts the most micro-batches in
    flight over every cut the trainer can make. TINY with 8 layers over PP 4 x 2 virtual stages (2 layers a stage),
    prompts_per_step 8 x rollout.n 2 in 4 minibatches, an 8-token budget under every 16-token sequence (each goes
    alone: 16 positions). Without dynamic sampling a minibatch has 4 rows: 4 micro-batches, in flight (whole
    stages) min(2 (PP - stage - 1) + (V - 1) 4 + 1, 8) / 2 = 4, 4, 3.5, 2.5. With train.filter_groups (no refill) a
    step of 3 groups (6 rows) is one minibatch (6 // (DP 1 x PP 4) = 1) of 6 micro-batches, whose interleave group
    is 6: min(2 (PP - stage - 1) + 6 + 1, 12) / 2 = 6, 5.5, 4.5, 3.5, times 2 layers x 964 x 16 x 2 bytes."""
    from megatron_pdm.cluster.plan import stage_memory
    from megatron_pdm.train.batch import plan_minibatches
    from megatron_pdm.train.step import at_least, interleave_group

    lay = Layout(1, 4, 1, 1, 1, 1, virtual=2)
    sections = dict(model={"num_layers": 8}, rollout={"n": 2},
                    train={"prompts_per_step": 8, "minibatches": 4, "micro_batch_size": 1,
                           "max_tokens_per_microbatch": 8})
    stage_bytes = 2 * (452 + 512) * 16 * 2
    full = _cfg(**sections)
    assert [stage_memory(full, lay, s).activations for s in range(4)] == [x * stage_bytes for x in (4, 4, 3.5, 2.5)]
    drops = _cfg(**{**sections, "train": {**sections["train"], "filter_groups": "zero_variance"}})
    assert [stage_memory(drops, lay, s).activations for s in range(4)] == [x * stage_bytes for x in (6, 5.5, 4.5, 3.5)]
    # the trainer's cut of such a step: one minibatch of six one-row micro-batches, kept at six by `at_least`
    ((rows, sizes),), = plan_minibatches([16] * 6, minibatches=4, ranks=1, micro_batch_size=1, max_tokens=8, per_rank=4)
    assert at_least(sizes, 4, fewest=len(rows)) == [1] * 6 and interleave_group(6, 4) == 6


def test_cpu_offload_moves_the_optimizer_to_host_memory():
    """optim.cpu_offload f: (1 - f) of the rank's Adam shard stays on the GPU; the host holds f x shard x (12 + 4)
    bytes per rank (fp32 main parameters, two moments and an fp32 gradient copy), for every rank of a node."""
    from megatron_pdm.cluster.plan import HOST_RUNTIME_GB_PER_PROCESS, host_memory, stage_memory

    lay = Layout(2, 1, 1, 1, 2, 2)
    on = _cfg(optim={"distributed_optimizer": True})
    half = _cfg(optim={"distributed_optimizer": True, "cpu_offload": 0.5})
    local = ((12384 + 24640 - 160) * 2 + 2 * 8192) / 2 + 2 * 160 + 64
    assert stage_memory(on, lay, 0).optimizer == 12 * local / 2
    assert stage_memory(half, lay, 0).optimizer == 12 * local / 2 * 0.5
    h = host_memory(half, lay, gpus_per_node=2, colocated=False)
    assert h.optimizer == 2 * 0.5 * local / 2 * 16
    assert h.checkpoint == 2 * (local * 2 + 0.5 * local / 2 * 12)
    assert h.runtime == 2 * HOST_RUNTIME_GB_PER_PROCESS * GB
    assert host_memory(on, lay, gpus_per_node=2, colocated=False).optimizer == 0
    assert _cfg(optim={"distributed_optimizer": True, "cpu_offload": True}).optim.cpu_offload == 1.0
    with pytest.raises(ValueError, match="optim.cpu_offload: 0.5 offloads the distributed optimizer's shards"):
        _cfg(optim={"cpu_offload": 0.5})
    with pytest.raises(ValueError, match=r"optim.cpu_offload: 1.5 must be a fraction in \[0, 1\]"):
        _cfg(optim={"distributed_optimizer": True, "cpu_offload": 1.5})


def test_host_memory_per_node_and_host_mem_flag():
    preset = ROOT / "examples" / "presets" / "deepseek_v3.yaml"
    cfg = load_config(preset)
    p = plan(cfg, top=0)
    assert p.host_node_gb == 2048 and p.host_fits and p.host.optimizer > 500 * GB  # CPU Adam: ~0.7 TB per node
    small = plan(cfg, host_mem_gb=512, top=0)
    assert not small.fits and small.gpu_fits and not small.host_fits
    from megatron_pdm.cluster.plan import format_plan

    assert "host memory per training node (GB): optimizer" in format_plan(small) and ": does not fit in 409.6" \
        in format_plan(small)
    out = _plan_cli(preset, "--host-mem", "512", "--json", "--top", "0")
    d = json.loads(out.stdout)
    assert out.returncode == 1 and d["host_fits"] is False and d["host_usable_gb"] == 409.6


def test_expert_all_to_all_inside_a_node_ranks_first():
    lay = Layout(8, 16, 8, 1, 1, 1)
    assert not lay.expert_a2a_crosses_nodes(8)
    assert Layout(8, 8, 16, 1, 2, 1).expert_a2a_crosses_nodes(8)
    assert not Layout(2, 1, 4, 1, 4, 2).expert_a2a_crosses_nodes(8) and Layout(2, 1, 8, 1, 8, 2) \
        .expert_a2a_crosses_nodes(8)
    assert not Layout(8, 1, 1, 1, 8, 8).expert_a2a_crosses_nodes(8)  # no expert parallelism
    # DeepSeek-V3 on 16 nodes: every layout that fits keeps the all-to-all in a node, and the stages split across
    # nodes instead; with in-node EP ruled out by memory (EP 1) the cross-node ones are reported as such
    p = plan(load_config(ROOT / "examples" / "presets" / "deepseek_v3.yaml"), top=50)
    crossing = [lay.expert_a2a_crosses_nodes(8) for lay, _ in p.ranked]
    assert p.ranked and crossing == sorted(crossing) and not crossing[0]
    assert all(lay.pp > 1 for lay, _ in p.ranked)
    d = p.to_json()
    assert d["expert_a2a_crosses_nodes"] is False and d["stage_layers"] == [3] + [4] * 14 + [2]
    assert all("expert_a2a_crosses_nodes" in x for x in d["ranked_layouts"])


def test_mem_fraction_static_is_never_negative():
    """A colocated layout whose training states leave the engines nothing: fraction 0 and 'does not fit', and
    submit refuses to render it."""
    from megatron_pdm.cluster.plan import format_plan
    from megatron_pdm.cluster.submit import Submission, render

    cfg = load_config(ROOT / "examples" / "presets" / "qwen3_30b_a3b.yaml",
                      ["parallel.expert=1", "optim.cpu_offload=0"])
    p = plan(cfg, top=0)
    assert p.rollout.mem_fraction_static == 0.0 and not p.rollout.fits and not p.fits
    assert "leaving them no room" in p.rollout.problem and "does not fit: the trainer keeps" in format_plan(p)
    with pytest.raises(ValueError, match="rollout: does not fit: the trainer keeps .* leaving them no room"):
        render(cfg, Submission(run_dir=Path("/scratch/runs/x")))


def test_dp_attention_multiplies_the_engines_kv_capacity():
    from megatron_pdm.cluster.plan import kv_bytes_per_token

    preset = ROOT / "examples" / "presets" / "deepseek_v3.yaml"
    cfg = load_config(preset)
    dpa = plan(cfg, top=0).rollout
    tp = plan(load_config(preset, ["rollout.sglang.server_args=[]"]), top=0).rollout
    assert dpa.attention_dp == 8 and tp.attention_dp == 1 and dpa.mem_fraction_static == tp.mem_fraction_static
    assert dpa.kv_bytes_per_token == tp.kv_bytes_per_token == kv_bytes_per_token(cfg.model, "fp8_e4m3", 2)
    assert dpa.kv_tokens_per_engine == 8 * tp.kv_tokens_per_engine
    with pytest.raises(ValueError, match=r"rollout.sglang.server_args: --enable-dp-attention needs --dp-size, a "
                                         r"divisor of cluster.rollout_tp 16; got '3'"):
        plan(load_config(preset, ["rollout.sglang.server_args=[--enable-dp-attention, --dp-size, '3']"]), top=0)


def test_engine_tp_must_shard_the_attention_heads():
    """Issue 30: SGLang shards the query heads over its (attention) TP and splits the KV heads over it, or
    replicates them when the TP is a multiple of them: an engine TP that does neither is refused with the field and
    the values; with DP attention the attention TP is rollout_tp / dp-size."""
    from megatron_pdm.rollout.sglang.launcher import check_engine_heads

    def sglang(heads, groups, tp, server_args=()):
        return _cfg(model={"num_attention_heads": heads, "num_query_groups": groups},
                    rollout={"engine": "sglang", "sglang": {"server_args": list(server_args)}},
                    cluster={"gpus_per_node": 8, "rollout_tp": tp})

    with pytest.raises(ValueError, match=r"^cluster.rollout_tp: 8 does not divide model.num_attention_heads = 12: "
                                         r"SGLang shards the query heads over its TP \(engine TPs that work: 1, 2, 4, "
                                         r"12\)$"):
        plan(sglang(12, 4, 8), top=0)
    with pytest.raises(ValueError, match=r"^cluster.rollout_tp: 4 and model.num_query_groups = 6 KV heads do not "
                                         r"divide each other: SGLang splits the KV heads over its TP, or replicates "
                                         r"them over a TP that is a multiple of them \(engine TPs that work: 1, 2, 3, "
                                         r"6, 12\)$"):
        plan(sglang(12, 6, 4), top=0)
    dpa = ["--enable-dp-attention", "--dp-size", "2"]
    with pytest.raises(ValueError, match=r"^cluster.rollout_tp: 8 / DP-attention --dp-size 2 = attention TP 4 and "
                                         r"model.num_query_groups = 6 KV heads"):
        plan(sglang(12, 6, 8, dpa), top=0)
    plan(sglang(12, 6, 4, dpa), top=0)  # attention TP 2
    plan(sglang(12, 6, 2), top=0)  # splits the 6 KV heads
    plan(sglang(8, 2, 8), top=0)  # replicates the 2 KV heads 4 times
    plan(_cfg(model={"num_attention_heads": 12, "num_query_groups": 4}, cluster={"gpus_per_node": 8,
                                                                                 "rollout_tp": 8}), top=0)  # embedded
    model = ModelConfig(**{**TINY, "num_attention_heads": 12, "num_query_groups": 6})
    with pytest.raises(ValueError, match=r"^rollout.sglang.engine_tp: 5 does not divide model.num_attention_heads = "
                                         r"12"):
        check_engine_heads(model, 5, field="rollout.sglang.engine_tp")
    check_engine_heads(TINY_DSV3, 4, field="rollout.sglang.engine_tp")  # MLA: 4 heads over 4 GPUs, latent replicated
    out = _plan_cli(ROOT / "examples" / "presets" / "qwen3_30b_a3b.yaml", "model.num_attention_heads=20")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "plan: cluster.rollout_tp: 8 does not divide model.num_attention_heads = 20" in out.stderr, out.stderr


def _plan_cli(*args):
    """`megatron-pdm plan ARGS` in this process (`plan` starts none; a new interpreter costs 1.5 s a call): its exit
    code and output as subprocess.run gives them. test_cli_json_and_exit_codes runs the real command."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["plan", *map(str, args)])
        except SystemExit as e:  # argparse's refusals
            code = e.code
    return subprocess.CompletedProcess(["megatron-pdm", "plan", *map(str, args)], code, out.getvalue(),
                                       err.getvalue())


def test_kimi_k2_at_pp16_answers_with_its_uneven_split():
    """The issue's command: the preset's own PP 16 plans; a PP the layers do not divide, given without stage counts,
    gets an uneven split chosen and said."""
    preset = ROOT / "examples" / "presets" / "kimi_k2_1t.yaml"
    out = _plan_cli(preset, "parallel.pipeline=16")
    assert out.returncode == 0, out.stderr
    assert "pipeline stages: 3 + 14 x 4 + 2 layers" in out.stdout and "inside each node" in out.stdout
    eight = _plan_cli(preset, "parallel.pipeline=8", "parallel.first_stage_layers=0", "parallel.last_stage_layers=0")
    assert "using uneven stages parallel.first_stage_layers=7 parallel.last_stage_layers=6 (7 + 6 x 8 + 6 layers)" \
        in eight.stderr
    assert eight.returncode == 1 and "does not fit: engine weights" in eight.stdout  # no room left for the engines


@pytest.mark.parametrize("args, message", [
    (["missing.yaml"], "plan: config: missing.yaml does not exist"),
    (["{preset}", "parallel.pipeline=32", "parallel.first_stage_layers=0", "parallel.last_stage_layers=0"],
     "plan: model.num_layers = 61 over parallel.pipeline = 32: no split"),
    (["{preset}", "parallel.first_stage_layers=10"], "the layers cannot be split"),
    (["{preset}", "parallel.pipeline=61"], "plan: parallel: tensor x pipeline x context = 488 must divide the 256"),
    (["{preset}", "--host-mem", "-1"], "plan: host-mem: -1.0 must be > 0"),
    (["{preset}", "--nodes", "0"], "plan: nodes: expected an integer >= 1, got 0"),
    (["{preset}", "--top", "-1"], "plan: top: expected an integer >= 0, got -1"),
    (["{preset}", "parallel.expert=7"], "plan: parallel: TP8 PP16(3/2) CP1 DP2 EP7 ETP1 is not valid"),
    (["{bad}"], "plan: "),
])
def test_every_plan_error_is_a_message(args, message, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    preset = ROOT / "examples" / "presets" / "kimi_k2_1t.yaml"
    out = _plan_cli(*[a.format(preset=preset, bad=bad) for a in args])
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
