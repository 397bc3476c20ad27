"""The output layer fused with the loss (`policy_loss_from_hidden`, `vocab_parallel.fused_output_loss`): the same
loss, per-token terms, masks, statistics, metrics and gradients (hidden states and weight shard) as `policy_loss`
on the materialized logits hidden @ weight^T, in float64 at TP 1, 2 and 4, for every divergence kind, mask, loss,
aggregation, KL penalty, entropy bonus, sequence-level correction and the proximal anchor; chunks of a few rows,
so every case crosses chunk boundaries."""

import dataclasses

import pytest
import torch

from megatron_pdm.objectives import ObjectiveConfig, loss_normalizer, policy_loss, policy_loss_from_hidden
from megatron_pdm.vocab_parallel import BehaviorLogits, BehaviorTopK, output_logprobs, support_logprobs, token_logprobs
from tests.helpers import CONFIGS, SEQUENCE_CONFIGS, TRAIN_DENSE, compare_rows, init_checkpoint, rank_train, train_cfg
from tests.reference import make_case

T, V, H, K = 37, 48, 16, 5  # V divisible by 4 (TP 4); T prime, so the chunks of 7 rows end unevenly
CHUNK_ROWS = 7

FUSED_CONFIGS = (
    [(c, "topk") for c in CONFIGS]
    + [(ObjectiveConfig(divergence=kind, mask=mask, entropy_coef=coef, delta=0.05), "exact")
       for kind, mask, coef in (("kl", "pdm", 0.0), ("reverse_kl", "dppo", 0.02), ("tv", "pdm", 0.01))]
    + [(ObjectiveConfig(**kw), "topk") for kw in SEQUENCE_CONFIGS]
    + [(ObjectiveConfig(divergence="kl", correction="tis", correction_level="sequence", correction_cap=2.0,
                        kl_coef=0.1, kl_type="exact", delta=0.05), "exact"),
       (ObjectiveConfig(anchor="proximal", correction="tis"), "anchor")]
)


def _case(seed=11):
    """hidden [T, H], the output weight [V, H], the reference's, and a behavior drawn from mu = softmax(z + noise)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * (2.0 / H**0.5)  # logits of std ~2
    ref_hidden = hidden + 0.3 * torch.randn(T, H, generator=g, dtype=torch.float64)
    ref_weight = weight + 0.1 * torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5
    case = make_case(T, V, K, dtype=torch.float64, noise=1.0, seed=seed, logits=hidden @ weight.t())
    A = torch.randn(T, generator=g, dtype=torch.float64)
    loss_mask = (torch.rand(T, generator=g) > 0.2).double()
    seq_ids = torch.arange(T) // 6
    old = case.topk.token_logprobs + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)
    ref_lp = torch.log_softmax(ref_hidden @ ref_weight.t(), -1).gather(1, case.topk.token_ids[:, None])[:, 0]
    return dict(hidden=hidden, weight=weight, ref_hidden=ref_hidden, ref_weight=ref_weight, case=case, A=A,
                loss_mask=loss_mask, seq_ids=seq_ids, old=old, ref_lp=ref_lp)


def _both(group, d, config, mode, rank, world, temperature):
    """(unfused, fused) results on this rank: loss, per-token loss, keep mask, statistics, metrics, grads."""
    width = V // world
    sl = slice(rank * width, (rank + 1) * width)
    case = d["case"]
    behavior = BehaviorLogits(case.topk.token_ids, case.behavior_logits[:, sl]) if mode == "exact" else case.topk
    anchor = None
    if mode == "anchor":  # pi_old's log-probs at mu's top-K ids: a reference of its own, so that D is not 0
        z_old = d["ref_hidden"] @ d["ref_weight"][sl].t()
        anchor = BehaviorTopK(case.topk.token_ids, token_logprobs(z_old, case.topk.token_ids, group=group,
                                                                  temperature=temperature),
                              case.topk.topk_ids, support_logprobs(z_old, case.topk.topk_ids, group=group,
                                                                   temperature=temperature))
    old = anchor.token_logprobs if anchor is not None else d["old"]
    normalizer = loss_normalizer(d["loss_mask"], d["seq_ids"], config.aggregation)
    kw = dict(temperature=temperature, normalizer=normalizer, sequence_ids=d["seq_ids"], tp_group=group, anchor=anchor,
              old_logprobs=old if (config.correction != "none" or config.rejects) else None,
              ref_logprobs=d["ref_lp"] if config.kl_coef and config.kl_type != "exact" else None)
    exact_kl = config.kl_coef and config.kl_type == "exact"
    out = []
    for fused in (False, True):
        x = d["hidden"].clone().requires_grad_(True)
        w = d["weight"][sl].clone().requires_grad_(True)
        if fused:
            r = policy_loss_from_hidden(x, w, behavior, d["A"], d["loss_mask"], config, chunk_rows=CHUNK_ROWS,
                                        ref_hidden=d["ref_hidden"] if exact_kl else None,
                                        ref_output_weight=d["ref_weight"][sl] if exact_kl else None, **kw)
        else:
            ref_logits = d["ref_hidden"] @ d["ref_weight"][sl].t() if exact_kl else None
            r = policy_loss(x @ w.t(), behavior, d["A"], d["loss_mask"], config, ref_logits=ref_logits, **kw)
        r.loss.backward()
        stats = {f: getattr(r.stats, f).detach() for f in r.stats._fields}
        out.append(dict(loss=r.loss.detach(), per_token=r.per_token_loss, keep=r.mask.keep, stats=stats,
                        metrics=r.metrics.reduce(), grad_hidden=x.grad, grad_weight=w.grad))
    return out


def _temperature(i):
    return 0.7 if i % 2 else 1.0  # every other configuration at a sampling temperature other than 1


def rank_fused_vs_unfused(group, d, configs):
    """Per configuration (unfused, fused), and the forward-only log-probs from hidden states against those of the
    logits shard (output_logprobs: log pi_old at the step start, log pi_ref)."""
    import torch.distributed as dist

    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    width = V // world
    w = d["weight"][rank * width:(rank + 1) * width]
    ids, top = d["case"].topk.token_ids, d["case"].topk.topk_ids
    z = d["hidden"] @ w.t()
    forward = (output_logprobs(d["hidden"], w, ids, support_ids=top, group=group, temperature=0.7,
                               chunk_rows=CHUNK_ROWS),
               (token_logprobs(z, ids, group=group, temperature=0.7),
                support_logprobs(z, top, group=group, temperature=0.7)))
    return [_both(group, d, config, mode, rank, world, _temperature(i)) for i, (config, mode) in enumerate(configs)], \
        forward


def _close(a, b, what):
    # float64 throughout: the two paths differ only in summation order (chunked GEMMs, per-chunk sums)
    torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fused_equals_unfused_across_tp(dist_pools, world):
    d = _case()
    results = rank_fused_vs_unfused(None, d, FUSED_CONFIGS) if world == 1 else \
        dist_pools(world).run(rank_fused_vs_unfused, shared=(d, FUSED_CONFIGS))
    ranks = [results] if world == 1 else results
    for rank, (_, ((lp, sup), (lp_ref, sup_ref))) in enumerate(ranks):
        _close(lp, lp_ref, f"rank {rank} output_logprobs log pi(k)")
        _close(sup, sup_ref, f"rank {rank} output_logprobs support")
    ranks = [per_config for per_config, _ in ranks]
    for rank, per_config in enumerate(ranks):
        for (config, mode), (plain, fused) in zip(FUSED_CONFIGS, per_config, strict=True):
            name = f"rank {rank} {mode} {dataclasses.asdict(config)}"
            for key in ("loss", "per_token", "grad_hidden", "grad_weight"):
                _close(fused[key], plain[key], f"{name} {key}")
            assert torch.equal(fused["keep"], plain["keep"]), name
            for f, v in plain["stats"].items():
                _close(fused["stats"][f], v, f"{name} stats.{f}")
            assert fused["metrics"].keys() == plain["metrics"].keys(), name
            for k, v in plain["metrics"].items():
                assert fused["metrics"][k] == pytest.approx(v, rel=1e-10, abs=1e-12), f"{name} {k}"
    masked = [not bool(p["keep"].all()) for p, _ in ranks[0]]
    assert sum(masked) >= len(FUSED_CONFIGS) // 2, "the cases should mask tokens for most configurations"


def test_forward_only_logprobs_and_no_grad():
    d = _case(seed=3)
    z = d["hidden"] @ d["weight"].t()
    ids, top = d["case"].topk.token_ids, d["case"].topk.topk_ids
    lp, sup = output_logprobs(d["hidden"], d["weight"], ids, support_ids=top, chunk_rows=CHUNK_ROWS)
    _close(lp, token_logprobs(z, ids), "log pi(k)")
    _close(sup, support_logprobs(z, top), "support log pi")
    with torch.no_grad():  # a forward-only pass (the step-start or reference pass) takes no gradient
        out = policy_loss_from_hidden(d["hidden"].requires_grad_(True), d["weight"], d["case"].topk, d["A"],
                                      d["loss_mask"], ObjectiveConfig(), temperature=1.0, normalizer=10.0,
                                      chunk_rows=CHUNK_ROWS)
    assert out.loss.grad_fn is None


@pytest.mark.parametrize("dtype,bf16_gemm", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False)],
                         ids=["bf16", "bf16-cuda-weight-grad-gemm", "fp16"])
def test_sixteen_bit_hidden_states_match_the_unfused_path(monkeypatch, dtype, bf16_gemm):
    """bf16 / fp16 hidden states and weight: the chunk's GEMM in that dtype as the output layer's, the statistics
    and gradients in float32; fp16 gradients carry no loss scale in the forward, so they are scaled per row before
    their GEMM (without it the small ones flush to zero). The weight gradient's GEMM in bf16, as CUDA runs it, is
    forced here on the CPU. Tolerances: a bf16 logit carries ~3 significant digits."""
    from megatron_pdm.vocab_parallel import fused as fused_module

    monkeypatch.setattr(fused_module, "_bf16_weight_grad_gemm", lambda x: bf16_gemm)
    d = _case(seed=5)
    config = ObjectiveConfig(entropy_coef=0.01)
    grads = []
    for fused in (False, True):
        x = d["hidden"].to(dtype).requires_grad_(True)
        w = d["weight"].to(dtype).requires_grad_(True)
        kw = dict(temperature=1.0, normalizer=30.0)
        out = policy_loss_from_hidden(x, w, d["case"].topk, d["A"].float(), d["loss_mask"], config,
                                      chunk_rows=CHUNK_ROWS, **kw) if fused else \
            policy_loss(x @ w.t(), d["case"].topk, d["A"].float(), d["loss_mask"], config, **kw)
        (out.loss * 1024.0).backward()  # a loss scale, as fp16 training applies in backward
        grads.append((out.loss.detach(), x.grad.float(), w.grad.float()))
    (loss0, gx0, gw0), (loss1, gx1, gw1) = grads
    torch.testing.assert_close(loss1, loss0, rtol=2e-2, atol=1e-3)
    for got, want in ((gx1, gx0), (gw1, gw0)):
        assert torch.isfinite(got).all()
        rel = (got - want).norm() / want.norm()
        assert rel < 3e-2, f"relative gradient error {float(rel):.3g}"


def rank_ddp_weight_gradient(group, d, tied, fused):
    """The output weight's main_grad after one backward under megatron's DDP with overlap_grad_reduce (its hook must
    run for every parameter, or the bucket never counts the weight ready), one rank; tied: the weight is also an
    embedding looked up on this stage (megatron flags it zero_out_wgrad)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from megatron_pdm.compat import cuda_to_cpu_scope
    from megatron_pdm.models import ParallelConfig, initialize_parallel

    ctx = initialize_parallel(ParallelConfig())
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(d["weight"].clone())
    if tied:
        module.weight.zero_out_wgrad = True  # what megatron's LanguageModule sets on a same-stage tied embedding
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, pipeline_dtype=torch.float64)
    with cuda_to_cpu_scope():
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=False,
                                                                            overlap_grad_reduce=True), module=module)
        ddp.zero_grad_buffer()
    w = module.weight
    x = d["hidden"] + (torch.nn.functional.embedding(torch.arange(T) % V, w)[:, :H] if tied else 0.0)
    kw = dict(temperature=1.0, normalizer=20.0)
    out = policy_loss_from_hidden(x, w, d["case"].topk, d["A"], d["loss_mask"], ObjectiveConfig(),
                                  chunk_rows=CHUNK_ROWS, **kw) if fused else \
        policy_loss(x @ w.t(), d["case"].topk, d["A"], d["loss_mask"], ObjectiveConfig(), **kw)
    out.loss.backward()
    with cuda_to_cpu_scope():
        ddp.finish_grad_sync()  # asserts that every parameter's hook ran (overlap_grad_reduce)
    grad = w.main_grad.clone()
    ctx.close()
    return grad


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-lookup"])
def test_weight_gradient_under_megatron_ddp_with_overlap(dist_pools, tied):
    """The fused weight gradient goes into megatron DDP's float32 main_grad with megatron's own protocol: a dummy
    gradient so that DDP's hook runs (overlap_grad_reduce counts the weight ready), zero for a weight a lookup on the
    same stage also uses, whose gradient then arrives through the hook too: the main_grad the unfused path gives."""
    d = _case(seed=7)
    fused, plain = (dist_pools(1).run(rank_ddp_weight_gradient, shared=(d, tied, f))[0] for f in (True, False))
    _close(fused, plain, "main_grad")
    assert plain.abs().max() > 0


def test_bad_inputs_name_the_field():
    d = _case()
    x, w = d["hidden"], d["weight"]
    cfg, topk, A, m = ObjectiveConfig(), d["case"].topk, d["A"], d["loss_mask"]
    with pytest.raises(ValueError, match="output layer's shard"):
        policy_loss_from_hidden(x, w[:, :-1], topk, A, m, cfg, temperature=1.0, normalizer=1.0)
    with pytest.raises(ValueError, match="dtype"):
        policy_loss_from_hidden(x, w.float(), topk, A, m, cfg, temperature=1.0, normalizer=1.0)
    with pytest.raises(ValueError, match="chunk_rows"):
        policy_loss_from_hidden(x, w, topk, A, m, cfg, temperature=1.0, normalizer=1.0, chunk_rows=0)
    with pytest.raises(ValueError, match="ref_hidden"):
        policy_loss_from_hidden(x, w, topk, A, m, ObjectiveConfig(kl_coef=0.1, kl_type="exact"), temperature=1.0,
                                normalizer=1.0)


def test_no_rows_give_a_zero_loss_and_empty_terms():
    """A micro-batch with no loss token on this rank (a context-parallel shard can have none): one empty chunk."""
    d = _case(seed=2)
    empty = BehaviorTopK(*(t[:0] for t in d["case"].topk._tensors()))
    x = d["hidden"][:0].clone().requires_grad_(True)
    out = policy_loss_from_hidden(x, d["weight"], empty, d["A"][:0], d["loss_mask"][:0], ObjectiveConfig(),
                                  temperature=1.0, normalizer=1.0)
    out.loss.backward()
    assert float(out.loss) == 0.0 and out.per_token_loss.shape == (0,) and out.mask.keep.shape == (0,)
    assert x.grad.shape == (0, H)


@pytest.mark.parametrize("model,parallel,objective", [
    # sequence parallelism (the hidden states gathered over TP), the exact KL to a fused reference, the entropy bonus
    (TRAIN_DENSE, {"tensor": 2}, {"kl_coef": 0.05, "kl_type": "exact", "entropy_coef": 0.01}),
    # tied embeddings over two stages (the last stage's copy of the embedding is the output weight), the step-start
    # pass of pi_old (a correction and the proximal anchor's top-K log-probs) and a k3 KL from a reference pass
    ({**TRAIN_DENSE, "tie_word_embeddings": True}, {"pipeline": 2},
     {"correction": "tis", "anchor": "proximal", "kl_coef": 0.05, "kl_type": "k3"}),
], ids=["tp2-sp-exact-kl-entropy", "pp2-tied-proximal-k3"])
def test_trainer_steps_fused_equal_unfused(dist_pools, tmp_path, model, parallel, objective):
    """Two RL steps (two updates each) with train.fused_output_layer on and off, fp32: the same rows and weights to
    fp32 summation order (the fused GEMMs run a chunk of rows at a time)."""
    init = init_checkpoint(tmp_path, model, dist_pools)
    runs = {}
    for fused in (True, False):
        cfg = train_cfg(model, parallel, init, objective, steps=2, fused_output_layer=fused)
        runs[fused] = dist_pools(2).run(rank_train, shared=(cfg, str(tmp_path / f"fused{fused}")))[0]
    (rows_on, state_on), (rows_off, state_off) = runs[True], runs[False]
    compare_rows(rows_on, rows_off)
    for r_on, r_off in zip(rows_on, rows_off, strict=True):
        for k in ("train/loss", "policy/entropy", "divergence/mean", "policy/kl_ref", "train/grad_norm"):
            # divergence/mean between weights that agree is itself fp32 rounding noise of log-probs up to log V in
            # size (~1e-7 either sign: seen -7.9e-8 against 5.8e-8 on an AMD EPYC), so its bound is absolute: a few
            # ulps of |log pi| <= log 320 ~ 5.8 (eps32 x 5.8 = 7e-7)
            atol = 1e-6 if k == "divergence/mean" else 1e-7
            if k in r_off:
                assert r_on[k] == pytest.approx(r_off[k], rel=1e-5, abs=atol), (r_on["step"], k)
    for k in state_off:
        torch.testing.assert_close(state_on[k], state_off[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
