"""On-policy distillation: the vocab-parallel divergences to a teacher (exact and top-K) against float64 autograd on
gathered logits at TP 1/2/4, and the trainer's teachers (in-trainer, engine), routing, resume and validation."""

import math
from pathlib import Path

import pytest
import torch

from megatron_pdm.vocab_parallel import BehaviorTopK, distill_divergence, distill_divergence_topk
from tests.reference import make_case

ROOT = Path(__file__).resolve().parents[2]
# float64: rounding of sums over V = 37 * world terms; float32: the logits' own precision (~1e-7) times V
TOL = {torch.float64: 1e-11, torch.float32: 2e-5}
EXACT = (("reverse", 0.5), ("forward", 0.5), ("jsd", 0.3), ("jsd", 0.0), ("jsd", 1.0))


def _rank(group):
    import torch.distributed as dist

    return (None, 0, 1) if group is None else (group, dist.get_rank(group), dist.get_world_size(group))


def _teacher_topk(teacher_logits, token_ids, K, temperature):
    """The teacher's top-K view (descending, as an engine reports it) from full float64 logits."""
    lt = torch.log_softmax(teacher_logits.double() / temperature, -1)
    top_lp, top_ids = lt.topk(K, dim=-1)
    return BehaviorTopK(token_ids, lt.gather(1, token_ids[:, None])[:, 0], top_ids, top_lp)


def rank_divergences(group, case, ks, chunk_size):
    """Each exact kind's value and the gradient of sum_t v_t D_t on this rank's shard; the same for the top-K
    versions at each K of ks."""
    group, rank, world = _rank(group)
    z, beh, exact = case.shard(rank, world)
    v = torch.linspace(0.5, -1.5, z.shape[0], dtype=torch.float64)
    out = {}
    for kind, beta in EXACT:
        leaf = z.detach().clone().requires_grad_(True)
        d = distill_divergence(leaf, exact.logits, kind, beta=beta, group=group, temperature=case.temperature,
                               chunk_size=chunk_size)
        (v.to(d.dtype) * d).sum().backward()
        out[kind, beta] = (d.detach(), leaf.grad)
    for K in ks:
        top = _teacher_topk(case.behavior_logits, beh.token_ids, K, case.temperature)
        for kind, beta in EXACT[:3]:
            leaf = z.detach().clone().requires_grad_(True)
            d = distill_divergence_topk(leaf, top, kind, beta=beta, group=group, temperature=case.temperature,
                                        chunk_size=chunk_size)
            (v.to(d.dtype) * d).sum().backward()
            out[kind, beta, K] = (d.detach(), leaf.grad)
    return out


def ref_divergence(z, b, kind, beta, temperature):
    """float64 full-vocabulary reference (TRL's generalized_jsd_loss for jsd, written from its definition)."""
    lp, lt = torch.log_softmax(z / temperature, -1), torch.log_softmax(b / temperature, -1)
    if kind == "forward" or (kind == "jsd" and beta == 0):
        return (lt.exp() * (lt - lp)).sum(-1)
    if kind == "reverse" or (kind == "jsd" and beta == 1):
        return (lp.exp() * (lp - lt)).sum(-1)
    lm = torch.logsumexp(torch.stack([lp + math.log(1 - beta), lt + math.log(beta)]), 0)
    return beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (lp.exp() * (lp - lm)).sum(-1)


def ref_divergence_topk(z, top: BehaviorTopK, kind, beta, temperature):
    """float64 top-K reference: the |S| + 1 categories built from the full distribution (S = TopK(t) u {k})."""
    T, V = z.shape
    lp = torch.log_softmax(z / temperature, -1)
    rows = []
    for t in range(T):
        S = top.topk_ids[t].tolist()
        lt_S = top.topk_logprobs[t].double().tolist()
        k = int(top.token_ids[t])
        if k not in S:
            S, lt_S = S + [k], lt_S + [float(top.token_logprobs[t])]
        p = lp[t].exp()
        p_S = p[S]
        t_S = torch.tensor(lt_S, dtype=torch.float64).exp()
        if len(S) < V:
            tail = torch.ones(V, dtype=torch.bool)
            tail[S] = False
            p_S = torch.cat([p_S, p[tail].sum()[None]])
            t_S = torch.cat([t_S, (1 - t_S.sum()).clamp_min(0)[None]])
        rows.append(ref_categories(p_S, t_S, kind, beta))
    return torch.stack(rows)


def ref_categories(p, t, kind, beta):
    if kind == "forward":
        return (t * (t.log() - p.log())).sum()
    if kind == "reverse":
        return (p * (p.log() - t.log())).sum()
    m = beta * t + (1 - beta) * p
    return beta * (t * (t.log() - m.log())).sum() + (1 - beta) * (p * (p.log() - m.log())).sum()


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_exact_and_topk_divergences_match_float64_autograd_across_tp(dist_pools, world, dtype):
    """reverse / forward KL and the generalized JSD (beta 0.3, and the beta 0 / 1 limits TRL defines as forward /
    reverse), and their top-K versions at K = 4 and K = V: value and gradient per shard against float64 autograd on
    the gathered logits."""
    width, T = 37, 11
    V = width * world
    case = make_case(T, V, 4, temperature=0.7, dtype=dtype, seed=52)
    ks = (4, V)
    results = [rank_divergences(None, case, ks, 5)] if world == 1 else \
        dist_pools(world).run(rank_divergences, shared=(case, ks, 5))
    tol = TOL[dtype]
    v = torch.linspace(0.5, -1.5, T, dtype=torch.float64)
    b = case.behavior_logits.double()
    for kind, beta in EXACT:
        z = case.logits.double().clone().requires_grad_(True)
        d = ref_divergence(z, b, kind, beta, case.temperature)
        (v * d).sum().backward()
        assert (d > 0).all()
        for r in results:
            torch.testing.assert_close(r[kind, beta][0].double(), d.detach(), atol=5 * tol, rtol=tol)
        grad = torch.cat([r[kind, beta][1] for r in results], 1)
        assert grad.dtype == dtype
        torch.testing.assert_close(grad.double(), z.grad, atol=tol, rtol=tol, msg=f"{kind} {beta}")
    for K in ks:
        top = _teacher_topk(b, case.topk.token_ids, K, case.temperature)
        for kind, beta in EXACT[:3]:
            z = case.logits.double().clone().requires_grad_(True)
            d = ref_divergence_topk(z, top, kind, beta, case.temperature)
            (v * d).sum().backward()
            for r in results:
                torch.testing.assert_close(r[kind, beta, K][0].double(), d.detach(), atol=5 * tol, rtol=tol)
            grad = torch.cat([r[kind, beta, K][1] for r in results], 1)
            torch.testing.assert_close(grad.double(), z.grad, atol=tol, rtol=tol, msg=f"top-{K} {kind}")
    for kind, beta in EXACT[:3]:  # at K = V the top-K divergence is the exact one
        torch.testing.assert_close(results[0][kind, beta, V][0].double(), results[0][kind, beta][0].double(),
                                   atol=5 * tol, rtol=tol)


def test_topk_divergence_approaches_the_exact_one_as_k_grows():
    """|D_topK - D| shrinks as K grows (the tail bucket holds less mass) and is 0 at K = V; float64."""
    T, V = 16, 64
    case = make_case(T, V, 4, dtype=torch.float64, seed=7)
    z, b = case.logits, case.behavior_logits
    for kind, beta in EXACT[:3]:
        exact = distill_divergence(z, b, kind, beta=beta)
        gaps = []
        for K in (1, 4, 16, 48, V):
            top = _teacher_topk(b, case.topk.token_ids, K, 1.0)
            gaps.append((distill_divergence_topk(z, top, kind, beta=beta) - exact).abs().mean().item())
        assert all(a > c for a, c in zip(gaps[:-2], gaps[1:-1], strict=True)), (kind, gaps)
        assert gaps[-1] < 1e-12, (kind, gaps)


def test_jsd_limits_are_forward_and_reverse_kl_up_to_scaling():
    """JSD_beta / beta -> KL(t || pi) as beta -> 0 and JSD_beta / (1 - beta) -> KL(pi || t) as beta -> 1, first order
    in beta (relative gap ~ beta: 1e-4 gives ~1e-4; the bound 1e-3 leaves a factor 10 for the case's spread)."""
    case = make_case(8, 50, 4, dtype=torch.float64, seed=3)
    z, b = case.logits, case.behavior_logits
    eps = 1e-4
    fwd, rev = distill_divergence(z, b, "forward"), distill_divergence(z, b, "reverse")
    torch.testing.assert_close(distill_divergence(z, b, "jsd", beta=eps) / eps, fwd, rtol=1e-3, atol=0)
    torch.testing.assert_close(distill_divergence(z, b, "jsd", beta=1 - eps) / eps, rev, rtol=1e-3, atol=0)
    torch.testing.assert_close(distill_divergence(z, b, "jsd", beta=0.0), fwd, rtol=0, atol=0)
    torch.testing.assert_close(distill_divergence(z, b, "jsd", beta=1.0), rev, rtol=0, atol=0)


def test_math_bad_inputs_raise_one_line_errors():
    case = make_case(4, 20, 3, seed=1)
    with pytest.raises(ValueError, match=r"^kind: expected one of reverse, forward, jsd, got 'tv'$"):
        distill_divergence(case.logits, case.behavior_logits, "tv")
    with pytest.raises(ValueError, match=r"^beta: must be a number in \[0, 1\], got 1.5$"):
        distill_divergence(case.logits, case.behavior_logits, "jsd", beta=1.5)
    with pytest.raises(ValueError, match=r"^teacher_logits: expected the logits' shape"):
        distill_divergence(case.logits, case.behavior_logits[:, :-1], "forward")


def rank_megatron_scores(group, cfg, tp, hf_state, sequences, starts, K):
    """The in-trainer teacher's view: megatron's logits shard at TP `tp` for each sequence; its top-K and the scored
    tokens' log-probs, from the shards gathered here (for the comparison only: the trainer never gathers them)."""
    from megatron_pdm.models import ParallelConfig, build_model, forward_logits, initialize_parallel, load_hf_into_model

    ctx = initialize_parallel(ParallelConfig(tensor=tp))
    model = build_model(cfg, ctx)
    load_hf_into_model(model, hf_state, cfg, ctx)
    out = []
    with torch.no_grad():
        for seq, start in zip(sequences, starts, strict=True):
            ids = torch.tensor(seq)
            pad = (-len(seq)) % tp  # sequence parallelism splits the sequence: pad to a multiple of TP
            z = forward_logits(model, torch.cat([ids, ids.new_zeros(pad)])[None])[0][start - 1 : len(seq) - 1]
            if tp > 1:
                parts = [torch.empty_like(z) for _ in range(tp)]
                torch.distributed.all_gather(parts, z.contiguous(), group=ctx.tp_group)
                z = torch.cat(parts, 1)
            logp = torch.log_softmax(z.double(), -1)
            top_lp, top_ids = logp.topk(K, -1)
            out.append((logp.gather(1, ids[start:, None])[:, 0], top_ids, top_lp))
    ctx.close()
    return out


def test_embedded_engine_scores_are_the_in_trainer_teachers_top_k(dist_pools):
    """`EmbeddedEngine.score` (the engine teacher's reference implementation) gives the same scored log-probs and
    top-K (ids and log-probs) as the megatron model on the same weights at TP 1 and 2 (tolerance 1e-4: two float32
    implementations of one network, as test_engine_contract compares the engine's sampled log-probs)."""
    from megatron_pdm.models import canonical_hf_state
    from megatron_pdm.rollout import EmbeddedEngine, TeacherScores
    from tests.helpers import DENSE, hf_model

    state = canonical_hf_state(hf_model(DENSE, seed=5).state_dict())
    engine = EmbeddedEngine(DENSE)
    with pytest.raises(RuntimeError, match="no weights"):
        engine.score([[1, 2]], [1], 3)
    engine.update_weights(state, version=0)
    sequences, starts, K = [[5, 6, 7, 40, 41], [8, 9, 100, 3], [10, 11, 12, 13, 200, 201, 7]], [3, 2, 4], 6
    scores = engine.score(sequences, starts, K)
    for s, seq, start in zip(scores, sequences, starts, strict=True):
        assert isinstance(s, TeacherScores)
        assert s.token_logprobs.shape == (len(seq) - start,) and s.topk_ids.shape == (len(seq) - start, K)
        assert s.token_logprobs.dtype == torch.float32 and s.topk_ids.dtype == torch.int64
        assert torch.all(s.topk_logprobs[:, :-1] >= s.topk_logprobs[:, 1:])  # descending
    for tp in (1, 2):
        ref = dist_pools(tp).run(rank_megatron_scores, shared=(DENSE, tp, state, sequences, starts, K))[0]
        for s, (lp, ids, top) in zip(scores, ref, strict=True):
            torch.testing.assert_close(s.token_logprobs.double(), lp, atol=1e-4, rtol=1e-4)
            assert torch.equal(s.topk_ids, ids)
            torch.testing.assert_close(s.topk_logprobs.double(), top, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"^score: starts\[0\] 0 is not in \[1, 2\]"):
        engine.score([[1, 2]], [0], 3)
    with pytest.raises(ValueError, match=r"^score: top_k 0 is not in \[1, 320\]$"):
        engine.score([[1, 2]], [1], 0)


def test_distill_objective_terms():
    """The loss term is coef x the aggregated divergence (token_mean: the mean over loss tokens; a 0 normaliser gives
    0), with the divergence's gradient; as_reward adds reward_coef (log t(y) - log mu(y)) per token."""
    from megatron_pdm.objectives import DistillObjective, distill_advantages, distill_loss, distill_token_divergence

    case = make_case(6, 30, 4, dtype=torch.float64, seed=9)
    cfg = DistillObjective(kind="forward", coef=0.5)
    z = case.logits.clone().requires_grad_(True)
    mask = torch.tensor([1, 1, 0, 1, 0, 1], dtype=torch.float64)
    d = distill_token_divergence(cfg, z, teacher_logits=case.behavior_logits)
    loss, metrics = distill_loss(cfg, d, mask, aggregation="token_mean", normalizer=mask.sum())
    ref = 0.5 * (ref_divergence(case.logits, case.behavior_logits, "forward", 0.5, 1.0) * mask).sum() / 4
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)  # float64 sums of 6 terms
    loss.backward()
    assert z.grad[2].abs().max() == 0 and z.grad[0].abs().max() > 0  # masked rows get no gradient
    assert metrics.reduce()["distill/kl"] == pytest.approx(float((d.detach() * mask).sum() / 4), rel=1e-12)
    zero, _ = distill_loss(cfg, d, torch.zeros(6, dtype=torch.float64), aggregation="token_mean", normalizer=0.0)
    assert zero.item() == 0.0
    top = _teacher_topk(case.behavior_logits, case.topk.token_ids, 30, 1.0)  # K = V: the exact divergence
    torch.testing.assert_close(distill_token_divergence(cfg, case.logits, teacher_topk=top), d.detach(), rtol=1e-10,
                               atol=1e-12)
    adv = torch.tensor([1.0, -1.0, 0.0])
    t_lp, mu_lp = torch.tensor([-1.0, -2.0, float("-inf")]), torch.tensor([-0.5, -2.5, -1.0])
    assert torch.equal(distill_advantages(cfg, adv, t_lp, mu_lp), adv)  # as_reward off
    got = distill_advantages(DistillObjective(as_reward=True, reward_coef=2.0), adv, t_lp, mu_lp)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, 2.0 * (-1e4 + 1.0)]))


@pytest.mark.parametrize("field, value, message", [
    ("kind", "tv", r"^distill.kind: 'tv' is not one of reverse, forward, jsd$"),
    ("beta", 2.0, r"^distill.beta: 2.0 must be"),
    ("coef", -1.0, r"^distill.coef: -1.0 must be"),
    ("top_k", -1, r"^distill.top_k: expected an integer >= 0, got -1$"),
    ("as_reward", "yes", r"^distill.as_reward: expected true or false, got 'yes'$"),
])
def test_distill_objective_validation(field, value, message):
    from megatron_pdm.objectives import DistillObjective

    with pytest.raises(ValueError, match=message):
        DistillObjective.from_dict({field: value})
    with pytest.raises(ValueError, match=r"^distill.coef: 0 and distill.as_reward false"):
        DistillObjective(coef=0.0)


TEACHER = dict(model_type="qwen3", vocab_size=320, hidden_size=48, num_layers=1, num_attention_heads=4,
               num_query_groups=2, head_dim=12, ffn_hidden_size=96, max_position_embeddings=32)


def _teacher_checkpoint(tmp_path):
    from megatron_pdm.models import ModelConfig, canonical_hf_state, save_hf_checkpoint
    from tests.helpers import hf_model

    path = tmp_path / "teacher"
    cfg = ModelConfig(**TEACHER)
    save_hf_checkpoint(path, canonical_hf_state(hf_model(cfg, seed=23).state_dict()), cfg)
    return path


def test_in_trainer_teacher_end_to_end(dist_pools, tmp_path):
    """A tiny run at TP 2 distilling from an in-trainer teacher: with the student's own starting weights as the
    teacher, the first update's KL is 0 to float32 rounding (pi = t before it); with a teacher of another size
    (1 layer, width 48) the KL is positive and the runs with the fused output layer on and off log the same rows
    (tolerance 1e-4: float32 summation orders of two GEMM paths, carried over two updates); a run resumed after
    step 1, its teacher reloaded from the checkpoint directory and offloaded, equals the straight one."""
    from tests.helpers import TRAIN_DENSE, compare_rows, init_checkpoint, rank_train, train_cfg

    init = init_checkpoint(tmp_path, TRAIN_DENSE, dist_pools)
    same = train_cfg(TRAIN_DENSE, {"tensor": 2}, init, steps=1, minibatches=1)
    from megatron_pdm.train.config import config_from_dict

    def with_distill(cfg, teacher, **train):
        d = cfg.to_dict()
        d["distill"] = {"teacher": str(teacher), "kind": "reverse", "coef": 0.5}
        d["train"] = {**d["train"], **train}
        return config_from_dict(d)

    rows, _ = dist_pools(2).run(rank_train, shared=(with_distill(same, init), str(tmp_path / "same")))[0]
    assert abs(rows[1]["distill/kl"]) < 1e-5 and rows[1]["distill/teacher_s"] > 0
    teacher = _teacher_checkpoint(tmp_path)
    base = train_cfg(TRAIN_DENSE, {"tensor": 2}, init, steps=2)
    fused, _ = dist_pools(2).run(rank_train, shared=(with_distill(base, teacher), str(tmp_path / "fused")))[0]
    plain, _ = dist_pools(2).run(rank_train, shared=(with_distill(base, teacher, fused_output_layer=False),
                                                     str(tmp_path / "plain")))[0]
    for a, b in zip(fused[1:], plain[1:], strict=True):
        assert a["distill/kl"] > 0.1
        for key in ("distill/kl", "distill/teacher_logprob", "train/loss", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    # resume: the teacher is rebuilt from its checkpoint directory (never saved), here offloaded to host memory
    run = str(tmp_path / "resumed")
    dist_pools(2).run(rank_train, shared=(with_distill(base, teacher, steps=1), run))
    d = with_distill(base, teacher).to_dict()
    d["distill"]["teacher_offload"] = True
    resumed, _ = dist_pools(2).run(rank_train, shared=(config_from_dict(d), run, True))[0]
    compare_rows(resumed, fused)
    assert resumed[-1]["distill/kl"] == pytest.approx(fused[-1]["distill/kl"], rel=1e-4)


def test_distill_config_validation(tmp_path):
    """Every distill key is checked at load with a one-line error naming it; keys without a teacher are refused."""
    from megatron_pdm.train.config import config_from_dict

    teacher = _teacher_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"^distill.kind: 'kl' is not one of reverse, forward, jsd$"):
        config_from_dict({"distill": {"teacher": str(teacher), "kind": "kl"}})
    with pytest.raises(ValueError, match=r"^distill.coef: 0.5 does nothing with distill.teacher None"):
        config_from_dict({"distill": {"coef": 0.5}})
    with pytest.raises(ValueError, match=r"^distill.teacher: .* has vocab_size 320, the student 512"):
        config_from_dict({"model": {"vocab_size": 512}, "distill": {"teacher": str(teacher)}})
    with pytest.raises(ValueError, match=r"^distill.teacher: an in-trainer teacher runs at pipeline size 1"):
        config_from_dict({"model": {"num_layers": 2}, "parallel": {"pipeline": 2},
                          "distill": {"teacher": str(teacher)}})
    with pytest.raises(ValueError, match=r"^distill.teacher_offload: expected true or false, got 1$"):
        config_from_dict({"distill": {"teacher": str(teacher), "teacher_offload": 1}})


def test_plan_counts_the_in_trainer_teacher(tmp_path):
    """`plan`'s last stage holds the teacher's weights / TP (in the training dtype, fp32 here) and its hidden states
    over a rank's minibatch (rows x sequence x H_t x activation bytes); offloaded, the weights only during its pass."""
    from megatron_pdm.cluster.plan import ACT_BYTES, WEIGHT_BYTES, count_parameters, plan, sequence_length, stage_memory
    from megatron_pdm.models import ModelConfig
    from megatron_pdm.train.config import load_config

    teacher = _teacher_checkpoint(tmp_path)
    off = load_config(ROOT / "examples" / "tiny_cpu.yaml")
    on, offloaded = (load_config(ROOT / "examples" / "tiny_cpu.yaml", [f"distill.teacher={teacher}", *extra])
                     for extra in ([], ["distill.teacher_offload=true"]))
    layout = plan(off).layout
    a, b, c = (stage_memory(cfg, layout, layout.pp - 1) for cfg in (off, on, offloaded))
    p = off.precision.train
    weights = count_parameters(ModelConfig(**TEACHER)).total / layout.tp * WEIGHT_BYTES[p]
    rows = -(-off.train.prompts_per_step * off.rollout.n // (off.train.minibatches * layout.dp))
    hidden = rows * sequence_length(off) / layout.cp * TEACHER["hidden_size"] * ACT_BYTES[p]
    assert b.reference - a.reference == pytest.approx(weights + hidden)
    assert c.reference - a.reference == pytest.approx(hidden) and c.reference_pass == pytest.approx(weights)
