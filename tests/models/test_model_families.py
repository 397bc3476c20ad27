"""Llama, Qwen2 and DeepSeek-V3 / Kimi-K2 against transformers: logits and every gradient at TP 1 equal
`LlamaForCausalLM` / `Qwen2ForCausalLM` / `DeepseekV3ForCausalLM` on tiny random checkpoints with O(1) weights,
and the parallel layouts (TP 2 with sequence parallelism, EP 2, CP 2) equal TP 1; HF round trips through PP 2 with
uneven stages; the DeepSeek-V3 routing rule and the expert bias."""

import json
import math
import os

import pytest
import torch

from megatron_pdm.models import (
    ModelConfig,
    ParallelConfig,
    build_model,
    canonical_hf_state,
    forward_logits,
    hf_config_dict,
    initialize_parallel,
    load_hf_checkpoint,
    load_hf_into_model,
    model_config_from_hf,
)
from tests.helpers import hf_model, model_case, rank_forward_backward, rank_roundtrip

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LLAMA = ModelConfig(model_type="llama", vocab_size=320, hidden_size=32, num_layers=2, num_attention_heads=4,
                    num_query_groups=2, head_dim=8, ffn_hidden_size=48, max_position_embeddings=128,
                    tie_word_embeddings=True, rope_theta=500000.0, rope_scaling="llama3", rope_scaling_factor=8.0,
                    rope_original_max_position_embeddings=16)  # 16: the sequences' length, so all three bands act
QWEN2 = ModelConfig(model_type="qwen2", vocab_size=320, hidden_size=32, num_layers=2, num_attention_heads=4,
                    num_query_groups=2, head_dim=8, ffn_hidden_size=48, max_position_embeddings=64)
# DeepSeek-V3's architecture at toy size: q / kv LoRA, 1 dense + 2 MoE layers, 16 experts top-4 within 2 of 4
# groups (k = 2 x group_topk: megatron's group score equals DeepSeek's top-2), a shared expert, YaRN
DSV3 = ModelConfig(model_type="deepseek_v3", vocab_size=256, hidden_size=64, num_layers=3, num_attention_heads=4,
                   num_query_groups=4, head_dim=16, ffn_hidden_size=96, num_experts=16, moe_ffn_hidden_size=16,
                   moe_router_topk=4, moe_first_k_dense=1, moe_shared_expert_ffn_hidden_size=16, q_lora_rank=48,
                   kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, moe_router_num_groups=4,
                   moe_router_group_topk=2, moe_routed_scaling_factor=2.5, rope_theta=10000.0, rope_scaling="yarn",
                   rope_scaling_factor=4.0, rope_original_max_position_embeddings=16, rope_mscale=1.0,
                   rope_mscale_all_dim=1.0, max_position_embeddings=64, moe_aux_loss_coeff=0.0)
# Kimi-K2's knobs: one expert group, YaRN beta 1 / 1, scale 2.827, rope_theta 50000; no q-LoRA (q_proj)
KIMI = ModelConfig(**{**DSV3.__dict__, "moe_router_num_groups": 0, "moe_router_group_topk": 0,
                      "moe_routed_scaling_factor": 2.827, "rope_theta": 50000.0, "rope_beta_fast": 1.0,
                      "rope_beta_slow": 1.0, "q_lora_rank": 0})


def scaled_hf_model(cfg, seed=0):
    """transformers' model of `cfg` with O(1) activations (transformers' 0.02 init leaves logits near zero, where
    a wrong attention or RoPE barely shows): matrices N(0, 1 / fan_in), norms 1 + N(0, 0.1^2), biases and
    DeepSeek's expert bias N(0, 0.1^2)."""
    hf = hf_model(cfg, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise / math.sqrt(p.shape[-1]) if p.dim() >= 2 else
                    (1 + 0.1 * noise if "norm" in name else 0.1 * noise))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return hf


def min_routing_margin(hf, cfg, ids) -> float:
    """The smallest gap, over every token and MoE layer, between the last chosen and the first rejected group (by
    the sum of its top-2 biased scores) and between the last chosen and the first rejected expert within the
    chosen groups: a float error below it cannot change a choice."""
    gaps, handles = [], []

    def hook(module, args, output):
        s = output[0].float().sigmoid() + module.e_score_correction_bias
        if cfg.moe_router_num_groups:
            groups = s.view(s.shape[0], cfg.moe_router_num_groups, -1)
            ranked = groups.topk(2, dim=-1).values.sum(-1).sort(-1, descending=True)
            picked = cfg.moe_router_group_topk
            gaps.append((ranked.values[:, picked - 1] - ranked.values[:, picked]).min())
            keep = torch.zeros_like(ranked.values, dtype=torch.bool).scatter_(1, ranked.indices[:, :picked], True)
            s = groups.masked_fill(~keep[..., None], float("-inf")).view_as(s)
        top = s.topk(cfg.moe_router_topk + 1, dim=-1).values
        gaps.append((top[:, -2] - top[:, -1]).min())

    for layer in hf.model.layers[cfg.moe_first_k_dense:]:
        handles.append(layer.mlp.gate.register_forward_hook(hook))
    with torch.no_grad():
        hf(ids)
    for h in handles:
        h.remove()
    return float(min(gaps))


def hf_grads(hf, ids, weights, targets):
    """d/dtheta sum(weights x log softmax(logits)[targets]) in the checkpoint layout (per-expert keys)."""
    hf.zero_grad()
    lp = torch.log_softmax(hf(ids).logits.float(), -1).gather(-1, targets[..., None])[..., 0]
    (lp * weights).sum().backward()
    return canonical_hf_state({n: p.grad for n, p in hf.named_parameters()})


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: a gradient's error against the scale of the whole tensor (elementwise relative errors
    blow up on entries that are sums cancelling to near zero)."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# fp32 (eps 1.2e-7) sums of a few hundred terms taken in another order (other shards, another reduction tree):
# errors of ~1e-6 of the largest entry; 2e-5 leaves a margin of 10x, while a wrong gradient (a missing TP sum, a
# wrong head order) is off by O(1)
GRAD_RTOL = 2e-5
CASES = [(LLAMA, 2, 1, 1), (QWEN2, 2, 1, 1), (DSV3, 2, 1, 1), (DSV3, 1, 2, 1), (DSV3, 1, 1, 2), (KIMI, 2, 1, 1)]


@pytest.mark.parametrize("cfg,tp,ep,cp", CASES, ids=["llama-tp2", "qwen2-tp2", "dsv3-tp2", "dsv3-ep2", "dsv3-cp2",
                                                     "kimi-tp2"])
def test_family_equals_transformers_and_tp1(dist_pools, cfg, tp, ep, cp):
    """Logits (fp32, max |diff| < 1e-4 at O(1) logits) and every gradient at TP 1 equal transformers', and the
    layout's equal TP 1's. At TP 2 the MLA down-projections are replicated: megatron's stock column-parallel ones
    give exact logits and wrong gradients (Megatron-LM #1699), which only the gradient comparison catches."""
    hf = scaled_hf_model(cfg)
    state = canonical_hf_state(hf.state_dict())
    ids, weights, targets = model_case(cfg)
    if cfg.is_moe:
        assert min_routing_margin(hf, cfg, ids) > 1e-4  # float noise (~1e-6 here) cannot flip an expert choice
    ref_logits, ref_grads, _, _ = dist_pools(1).run(rank_forward_backward, shared=(cfg, 1, 1, state, ids, weights,
                                                                                    targets))[0]
    with torch.no_grad():
        expected = hf(ids).logits
    assert float(expected.abs().max()) > 1  # O(1) logits: the comparison has something to see
    errors = {"logits_vs_hf": float((ref_logits - expected).abs().max())}
    assert errors["logits_vs_hf"] < 1e-4
    hf_g = hf_grads(hf, ids, weights, targets)
    errors["grads_vs_hf"] = max(relative_error(ref_grads[k], g) for k, g in hf_g.items())
    assert errors["grads_vs_hf"] < GRAD_RTOL, [k for k, g in hf_g.items()
                                               if relative_error(ref_grads[k], g) >= GRAD_RTOL]
    errors["logits_vs_tp1"] = errors["grads_vs_tp1"] = 0.0
    results = dist_pools(2).run(rank_forward_backward, shared=(cfg, tp, ep, state, ids, weights, targets, cp))
    for logits, grads, (lo, hi), cols in results:
        errors["logits_vs_tp1"] = max(errors["logits_vs_tp1"], float((logits - ref_logits[lo:hi][:, cols]).abs().max()))
        assert grads.keys() == ref_grads.keys()
        errors["grads_vs_tp1"] = max(errors["grads_vs_tp1"], *(relative_error(grads[k], ref_grads[k]) for k in ref_grads
                                                                if ref_grads[k].is_floating_point()))
    print(f"\nparity {cfg.model_type} tp{tp} ep{ep} cp{cp}: {errors}")
    assert errors["logits_vs_tp1"] < 1e-5 and errors["grads_vs_tp1"] < GRAD_RTOL, errors


@pytest.mark.parametrize("cfg,layouts", [(LLAMA, ((2, 1, 1, 0),)), (QWEN2, ((1, 1, 2, 0),)),
                                         (DSV3, ((1, 2, 1, 0), (1, 1, 2, 1)))],
                         ids=["llama", "qwen2", "dsv3"])
def test_family_hf_round_trip(dist_pools, tmp_path, cfg, layouts):
    """Import then export is the identity (the expert bias included, in float32) at TP 2, EP 2 and PP 2 (DeepSeek-V3:
    uneven stages, its dense layer alone on the first, the two MoE layers on the second); transformers loads the
    written checkpoint and gives the original's logits."""
    import transformers

    hf = scaled_hf_model(cfg, seed=3)
    state = canonical_hf_state(hf.state_dict())
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")  # the embedding itself
    for tp, ep, pp, first in layouts:
        directory = tmp_path / f"tp{tp}ep{ep}pp{pp}"
        for exported in dist_pools(2).run(rank_roundtrip, shared=(cfg, tp, ep, state, str(directory), pp, first)):
            assert exported.keys() == state.keys()
            for k in state:
                assert torch.equal(exported[k], state[k]), k
        reloaded, cfg2 = load_hf_checkpoint(directory)
        assert cfg2 == cfg
        hf2 = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).float().eval()
        ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.testing.assert_close(hf2(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_released_config_files_load():
    """config.json as DeepSeek-V3, Kimi-K2 (model_type kimi_k2, legacy rope_scaling), Llama-3.2 and Qwen2.5 ship
    them map to the right fields; routing settings megatron would compute differently are refused with the reason."""
    v3 = {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
          "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
          "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
          "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
          "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
          "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
          "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
          "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                                "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                "type": "yarn"},
          "num_nextn_predict_layers": 1, "tie_word_embeddings": False}
    cfg = model_config_from_hf(v3)
    assert (cfg.head_dim, cfg.qk_rope_head_dim, cfg.moe_router_num_groups, cfg.moe_router_group_topk,
            cfg.moe_shared_expert_ffn_hidden_size, cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_beta_fast,
            cfg.rope_mscale_all_dim, cfg.mtp_num_layers) == (128, 64, 8, 4, 2048, "yarn", 40.0, 32.0, 1.0, 1)
    kimi = {**v3, "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
            "n_routed_experts": 384, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
            "routed_scaling_factor": 2.827, "rope_theta": 50000.0, "vocab_size": 163840,
            "rope_scaling": {**v3["rope_scaling"], "beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0}}
    k2 = model_config_from_hf(kimi)
    assert (k2.model_type, k2.moe_router_num_groups, k2.rope_beta_fast, k2.rope_beta_slow, k2.rope_scaling_factor) == (
        "deepseek_v3", 0, 1.0, 1.0, 32.0)
    assert model_config_from_hf(json.loads(json.dumps(hf_config_dict(k2)))) == k2  # what we write reads back
    with pytest.raises(ValueError, match="scores a group by its top-3 experts.*top-2"):
        model_config_from_hf({**v3, "num_experts_per_tok": 12})
    with pytest.raises(ValueError, match="scoring_func 'softmax'"):
        model_config_from_hf({**v3, "scoring_func": "softmax"})
    llama32 = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
               "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
               "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
               "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
               "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False}
    lc = model_config_from_hf(llama32)
    assert (lc.rope_scaling, lc.rope_scaling_factor, lc.rope_original_max_position_embeddings, lc.head_dim) == (
        "llama3", 32.0, 8192, 64)
    with pytest.raises(ValueError, match="rope scaling 'dynamic'"):
        model_config_from_hf({**llama32, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    qwen25 = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
              "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "tie_word_embeddings": True, "use_sliding_window": False}
    qc = model_config_from_hf(qwen25)
    assert (qc.head_dim, qc.qkv_bias, qc.qk_norm) == (64, True, False)
    with pytest.raises(ValueError, match="use_sliding_window"):
        model_config_from_hf({**qwen25, "use_sliding_window": True})
    with pytest.raises(ValueError, match="model.moe_router_group_topk: 3 of 4 groups"):
        ModelConfig(**{**DSV3.__dict__, "moe_router_group_topk": 3})
    with pytest.raises(ValueError, match="model.rope_scaling: 'yarn' with model_type 'llama'"):
        ModelConfig(model_type="llama", rope_scaling="yarn")


QWEN3 = ModelConfig(model_type="qwen3", vocab_size=320, hidden_size=32, num_layers=2, num_attention_heads=4,
                    num_query_groups=2, head_dim=8, ffn_hidden_size=48, max_position_embeddings=64)
QWEN3_MOE = ModelConfig(**{**QWEN3.__dict__, "model_type": "qwen3_moe", "num_experts": 4, "moe_ffn_hidden_size": 16,
                           "moe_router_topk": 2})
FAMILIES = {"qwen3": QWEN3, "qwen3_moe": QWEN3_MOE, "qwen2": QWEN2, "llama": LLAMA, "deepseek_v3": DSV3}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_config_json_layers_the_model_cannot_build_are_refused(model_type):
    """Every family's MLP is a SiLU GLU: another hidden_act is refused naming it (the regression: silently computed
    with SiLU), as are Qwen3's q / k / v biases (silently dropped); transformers' other name of SiLU loads."""
    d = json.loads(json.dumps(hf_config_dict(FAMILIES[model_type])))
    assert model_config_from_hf(d) == model_config_from_hf({**d, "hidden_act": "swish"}) == FAMILIES[model_type]
    without = {k: v for k, v in d.items() if k != "hidden_act"}  # absent: transformers' "silu"
    assert model_config_from_hf(without) == FAMILIES[model_type]
    for act in ("gelu", "relu", "gelu_pytorch_tanh"):
        with pytest.raises(ValueError, match=f"config.json: hidden_act '{act}' is not supported"):
            model_config_from_hf({**d, "hidden_act": act})
    if model_type in ("qwen3", "qwen3_moe"):
        with pytest.raises(ValueError, match=r"config.json: attention_bias true \(Qwen3 with q / k / v biases\)"):
            model_config_from_hf({**d, "attention_bias": True})


def test_qwen3_moe_norm_topk_prob_defaults_as_transformers():
    """config.json without norm_topk_prob: Qwen3MoeConfig's default, False (the regression: True, renormalising
    the top-k weights that HF, SGLang and vLLM serve unnormalised); export writes the key, so it round-trips."""
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    d = json.loads(json.dumps(hf_config_dict(QWEN3_MOE)))
    without = {k: v for k, v in d.items() if k != "norm_topk_prob"}
    cfg = model_config_from_hf(without)
    assert cfg.moe_norm_topk_prob is Qwen3MoeConfig().norm_topk_prob is False
    assert hf_config_dict(cfg)["norm_topk_prob"] is False and model_config_from_hf(hf_config_dict(cfg)) == cfg
    assert model_config_from_hf({**d, "norm_topk_prob": True}).moe_norm_topk_prob is True
    dsv3 = {k: v for k, v in hf_config_dict(DSV3).items() if k != "norm_topk_prob"}
    assert model_config_from_hf(dsv3).moe_norm_topk_prob is DeepseekV3Config().norm_topk_prob is True


def rank_export(group, checkpoint, out):
    from megatron_pdm.train.export import export_job

    return str(export_job(checkpoint, out))


def test_tiny_deepseek_v3_example_trains_at_tp2_ep2_and_exports(dist_pools, tmp_path):
    """examples/tiny_deepseek_v3.yaml as a user runs it, from the block-FP8 checkpoint its script writes (no model
    section: read from config.json): warm start and RL steps at TP 2 x EP 2 (4 ranks), a checkpoint, and its
    export from one process, which transformers loads (its only unexpected keys: the MTP layer, carried unchanged
    from the start checkpoint). The released expert bias is loaded, kept (update rate 0) and exported in float32."""
    import importlib.util

    import transformers

    from megatron_pdm.train.config import load_config
    from tests.helpers import rank_train

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("tiny_deepseek_v3", os.path.join(root, "examples",
                                                                                   "tiny_deepseek_v3.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    ckpt = example.write_checkpoint(tmp_path / "init")
    assert "quantization_config" in json.loads((ckpt / "config.json").read_text())  # block-FP8, as released
    init, ckpt_cfg = load_hf_checkpoint(ckpt)
    cfg = load_config(os.path.join(root, "examples", "tiny_deepseek_v3.yaml"),
                      [f"train.init_path={ckpt}", "train.steps=2", "train.warm_start_steps=2", "train.eval_every=2",
                       "train.checkpoint_every=2"])
    assert cfg.model == ckpt_cfg and (cfg.parallel.tensor, cfg.parallel.expert) == (2, 2)
    rows, state = dist_pools(4).run(rank_train, shared=(cfg, str(tmp_path / "run")))[0]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]
    assert all(math.isfinite(r["train/loss"]) for r in rows if "train/loss" in r)
    bias = [k for k in init if k.endswith("e_score_correction_bias")]
    assert len(bias) == 2 and all(float(init[k].abs().max()) > 0 for k in bias)
    for k in bias:
        assert state[k].dtype == torch.float32 and torch.equal(state[k], init[k])
    assert max(float((state[k] - init[k].float()).abs().max()) for k in state) > 1e-4  # it trained
    (step,) = sorted((tmp_path / "run" / "checkpoints").iterdir())
    out = tmp_path / "export"
    dist_pools(1).run(rank_export, shared=(str(step), str(out)))
    exported, _ = load_hf_checkpoint(out)
    mtp = [k for k in init if k.startswith("model.layers.3.")]
    assert sorted(exported) == sorted([*state, *mtp]) and mtp
    assert all(torch.equal(exported[k], state[k]) for k in state)  # the resharded checkpoint is the trained model
    assert all(torch.equal(exported[k], init[k]) for k in mtp)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True, output_loading_info=True)
    assert not info["missing_keys"] and sorted(info["unexpected_keys"]) == sorted(mtp)
    assert torch.equal(hf.model.layers[1].mlp.gate.e_score_correction_bias, init[bias[0]])


def test_deepseek_v3_engine_and_routing_replay(dist_pools):
    """The embedded engine (transformers' DeepseekV3, weights with the expert bias synced) samples with the
    log-probs megatron computes at TP 1 and 2, and its routed experts (every decoder layer, the dense first one
    expert 0) are megatron's own choices, replayed exactly (R3)."""
    from tests.helpers import check_engine_logprobs, check_routed_experts

    state = canonical_hf_state(scaled_hf_model(DSV3, seed=5).state_dict())
    check_engine_logprobs(dist_pools, DSV3, state)
    check_routed_experts(dist_pools, DSV3, state, tps=(2,))


def rank_bias_update(group, cfg, state, ids, padded_from):
    """One forward + backward with the last columns marked padding, then megatron's expert-bias update (what
    finalize_model_grads runs once per optimizer step): (bias before, tokens counted per expert, bias after) per
    MoE layer, and the experts megatron chose for the unpadded tokens (recorded)."""
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megatron_pdm.models.gpt import _router_replays, causal_mask

    ctx = initialize_parallel(ParallelConfig())
    model = build_model(cfg, ctx, moe_enable_routing_replay=True)
    load_hf_into_model(model, state, cfg, ctx)
    routers = [m for m in model.modules() if hasattr(m, "local_tokens_per_expert")]
    before = [r.expert_bias.clone() for r in routers]
    for r in _router_replays(model):
        r.set_router_replay_action(RouterReplayAction.RECORD)
    B, S = ids.shape
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[:, padded_from:] = True
    model(ids, torch.arange(S)[None].expand(B, S), causal_mask(S), padding_mask=padding).sum().backward()
    chosen = [r.get_recorded_indices().view(S, B, -1)[:padded_from] for r in _router_replays(model)]
    counts = [r.local_tokens_per_expert.clone() for r in routers]
    _update_router_expert_bias([model], model.config)
    after = [r.expert_bias.clone() for r in routers]
    ctx.close()
    return before, counts, after, chosen


def test_expert_bias_update_is_deepseeks_rule_and_skips_padding(dist_pools):
    """model.moe_router_bias_update_rate u > 0: after a step each MoE layer's bias moves by u sign(mean(c) - c),
    c the tokens routed to each expert in passes with gradients (DeepSeek-V3's aux-loss-free balancing), and padding
    tokens count for no expert (megatron-core 0.16 fails to broadcast its padding mask there: the compat patch)."""
    u = 0.01
    cfg = ModelConfig(**{**DSV3.__dict__, "moe_router_bias_update_rate": u})
    state = canonical_hf_state(scaled_hf_model(cfg, seed=2).state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    before, counts, after, chosen = dist_pools(1).run(rank_bias_update, shared=(cfg, state, ids, 12))[0]
    assert len(counts) == 2
    for b, c, a, picked in zip(before, counts, after, chosen, strict=True):
        assert torch.equal(c, torch.bincount(picked.reshape(-1), minlength=cfg.num_experts).to(c.dtype))
        assert float(c.sum()) == 2 * 12 * cfg.moe_router_topk  # 12 unpadded columns of 2 rows, top-4 each
        torch.testing.assert_close(a, b + u * torch.sign(c.mean() - c), atol=0, rtol=0)
        assert float((a - b).abs().max()) == pytest.approx(u)


def rank_public_api_logits(group, directory, ids):
    """The API a user loads a checkpoint with, at world size 1."""
    state, cfg = load_hf_checkpoint(directory)
    with initialize_parallel(ParallelConfig()) as ctx:
        model = build_model(cfg, ctx)
        load_hf_into_model(model, state, cfg, ctx)
        with torch.no_grad():
            logits = forward_logits(model, ids)
    return logits


@pytest.mark.parametrize("cfg,model_type", [(LLAMA, "llama"), (QWEN2, "qwen2"),
                                            (ModelConfig(**{**DSV3.__dict__, "vocab_size": 320}), "deepseek_v3"),
                                            (ModelConfig(**{**KIMI.__dict__, "vocab_size": 320}), "kimi_k2")],
                         ids=["llama", "qwen2", "deepseek_v3", "kimi_k2"])
def test_transformers_checkpoint_loads_and_trains(dist_pools, tmp_path, cfg, model_type):
    """A checkpoint written by transformers' save_pretrained (Kimi-K2's: model_type kimi_k2 in config.json, as
    released) gives transformers' logits through load_hf_checkpoint / build_model / load_hf_into_model /
    forward_logits (fp32, max |diff| < 1e-4 at O(1) logits), and `train` runs from it with no model section."""
    from megatron_pdm.models.tokenizer import copy_tokenizer_files
    from megatron_pdm.train.config import config_from_dict
    from megatron_pdm.train.data import ARITHMETIC_TOKENIZER
    from tests.helpers import rank_train

    hf = scaled_hf_model(cfg, seed=7)
    directory = tmp_path / "ckpt"
    hf.save_pretrained(directory)
    copy_tokenizer_files(ARITHMETIC_TOKENIZER, directory)  # the arithmetic task's 291 ids fit the 320 rows
    if model_type == "kimi_k2":
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(8))
    logits = dist_pools(1).run(rank_public_api_logits, shared=(str(directory), ids))[0]
    with torch.no_grad():
        expected = hf(ids).logits
    assert float(expected.abs().max()) > 1 and float((logits - expected).abs().max()) < 1e-4
    run = config_from_dict({
        "rollout": {"n": 2, "max_new_tokens": 3}, "data": {"max_operand": 2},
        "train": {"init": "hf", "init_path": str(directory), "steps": 1, "prompts_per_step": 4, "minibatches": 1,
                  "micro_batch_size": 8, "eval_every": 100, "checkpoint_every": 100, "warm_start_steps": 0}})
    assert run.model == load_hf_checkpoint(directory)[1] and run.model.model_type == cfg.model_type
    rows, _ = dist_pools(1).run(rank_train, shared=(run, str(tmp_path / "run")))[0]
    assert [r["step"] for r in rows if "train/loss" in r] == [1] and all(
        math.isfinite(r["train/loss"]) for r in rows if "train/loss" in r)
