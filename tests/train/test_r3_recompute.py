"""Routed-expert replay (R3) under activation recompute: the recomputed forward of the backward pass routes by the
rollout's choices too (megatron's RouterReplay, REPLAY_BACKWARD), so a step with recompute equals one without.

The replayed routes are random, not the model's own choices: a recompute that routed on its own would send tokens
to other experts in the backward pass than in the forward pass, and the gradients would differ."""

import math
from dataclasses import replace

import pytest
import torch

from megatron_pdm.train.config import config_from_dict
from megatron_pdm.train.data import ARITHMETIC_TOKENIZER
from tests.helpers import TRAIN_MOE

ROWS_PER_RANK = 3  # one-row micro-batches: 3 per DP rank, so under PP 2 a stage holds two in flight (1F1B)
PROMPT, RESPONSE = 3, 3


def _cfg(model: dict, parallel: dict, recompute: str):
    return config_from_dict({
        "model": {**model, "tokenizer": str(ARITHMETIC_TOKENIZER)}, "parallel": parallel,
        "rollout": {"routed_experts": True},
        "train": {"recompute": recompute, "prompts_per_step": 2, "micro_batch_size": 1, "fused_output_layer": False},
        "optim": {"lr": 1e-2},
    })


def _step_batch(cfg, dp: int):
    """Random sequences, advantages and expert choices (distinct experts per token) for every DP rank, seeded: the
    same on every rank and in every run."""
    from megatron_pdm.train.batch import sequences

    m, g = cfg.model, torch.Generator().manual_seed(7)
    rows = ROWS_PER_RANK * dp
    prompts = torch.randint(4, m.vocab_size, (rows, PROMPT), generator=g).tolist()
    responses = torch.randint(4, m.vocab_size, (rows, RESPONSE), generator=g).tolist()
    b = sequences(prompts, responses, pad_id=0, multiple=cfg.parallel.sequence_multiple)
    routes = torch.rand(rows, b.width, m.num_layers, m.num_experts, generator=g).argsort(-1)[..., :m.moe_router_topk]
    return replace(b, advantages=torch.randn(b.num_tokens, generator=g), routed_experts=routes.to(torch.int16))


def _recorded(chunks, calls: list) -> None:
    """Record each router's (layer, replay action, expert ids) at every top-k it takes."""
    from megatron_pdm.models.gpt import _router_replays

    layer = 0
    for chunk in chunks:
        for replay in _router_replays(chunk):
            take = replay.get_replay_topk

            def record(scores, topk, *args, take=take, replay=replay, layer=layer, **kw):
                action = replay.router_replay_action
                probs, ids = take(scores, topk, *args, **kw)
                calls.append((layer, None if action is None else action.value, ids.cpu().clone()))
                return probs, ids

            replay.get_replay_topk = record
            layer += 1


def rank_r3_step(group, model, parallel, recompute):
    """One optimizer update of the policy-gradient loss -sum A log pi over this rank's share of `_step_batch`,
    under R3: (loss, grad norm, every parameter's reduced gradient, the routers' calls, the expected expert ids
    of this rank's MoE layers per micro-batch, whether a forward-only pass left any replay queued)."""
    from megatron_pdm.models import initialize_parallel
    from megatron_pdm.models.gpt import _router_replays
    from megatron_pdm.objectives import Metrics
    from megatron_pdm.train.step import Learner
    from megatron_pdm.vocab_parallel import token_logprobs

    cfg = _cfg(model, parallel, recompute)
    m = cfg.model
    ctx = initialize_parallel(cfg.parallel, seed=3)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        learner = Learner(cfg, device, ctx)
        calls = []
        _recorded(learner.chunks, calls)
        batch = _step_batch(cfg, ctx.dp).select(ctx.dp_rank * ROWS_PER_RANK, (ctx.dp_rank + 1) * ROWS_PER_RANK)
        mbs = learner.micro_batches(batch.with_routed_layers(ctx.moe_layers(m)).to(device), [1] * ROWS_PER_RANK)

        def loss_fn(mb, logits):
            lp = token_logprobs(mb.response_logits(logits), mb.targets, group=ctx.tp_group)
            return -(lp * mb.advantages).sum(), Metrics()

        loss, grad_norm, _ = learner.update(mbs, loss_fn)
        grads = {f"{c}.{n}": p.main_grad.cpu().clone() for c, chunk in enumerate(learner.ddp)
                 for n, p in chunk.module.named_parameters()}
        # what each MoE layer of this rank must route, read from the batch's every-layer choices by global layer:
        # micro-batch k's row (row k), this TP rank's slice of the tokens, in (s, b) order
        lo, hi = ctx.tp_rank * batch.width // ctx.tp, (ctx.tp_rank + 1) * batch.width // ctx.tp
        expected = [[batch.routed_experts[k : k + 1, lo:hi, i].transpose(0, 1).reshape(-1, m.moe_router_topk).long()
                     for k in range(len(mbs))] for i in ctx.moe_layers(m)]
        forward_calls = len(calls)
        learner.step_start_logprobs(mbs)  # forward only: nothing is recomputed, nothing may stay queued
        queued = any(r.replay_backward_list or r.router_replay_action is not None
                     for chunk in learner.chunks for r in _router_replays(chunk))
        return loss, grad_norm, grads, calls[:forward_calls], expected, queued
    finally:
        ctx.close()


def _routing(calls, expected, recompute: str) -> None:
    """Each MoE layer routed every micro-batch by its replayed ids, bitwise: in the forward pass and, recomputed,
    in the backward pass (in the micro-batches' order: the recompute pops them first in, first out)."""
    for layer, ids in enumerate(expected):
        mine = [(action, got) for lay, action, got in calls if lay == layer]
        actions = ["replay_forward"] * len(ids) + (["replay_backward"] * len(ids) if recompute != "none" else [])
        assert sorted(map(str, (a for a, _ in mine))) == sorted(actions), (layer, [a for a, _ in mine])
        for action in set(actions):
            got = [x for a, x in mine if a == action]
            assert all(torch.equal(a, b) for a, b in zip(got, ids, strict=True)), (layer, action)


@pytest.mark.parametrize("model,parallel", [
    (TRAIN_MOE, {"expert": 2}), (TRAIN_MOE, {"tensor": 2, "expert": 2}), (TRAIN_MOE, {"pipeline": 2}),
    # interleaved: each model chunk queues its own layers' choices
    ({**TRAIN_MOE, "num_layers": 6}, {"pipeline": 3, "virtual": 2})],
    ids=["ep2", "tp2-ep2", "pp2", "pp3-vp2"])
def test_r3_with_full_recompute_equals_r3_without(dist_pools, model, parallel):
    world = math.prod(parallel.get(k, 1) for k in ("tensor", "pipeline", "expert"))
    plain = dist_pools(world).run(rank_r3_step, shared=(model, parallel, "none"))
    full = dist_pools(world).run(rank_r3_step, shared=(model, parallel, "full"))
    for (loss, norm, grads, calls, expected, queued), (loss_r, norm_r, grads_r, calls_r, expected_r, queued_r) \
            in zip(plain, full, strict=True):
        _routing(calls, expected, "none")
        _routing(calls_r, expected_r, "full")
        assert not queued and not queued_r
        # the recomputed forward runs the same operations on the same inputs (measured here: bitwise equal); the
        # bound leaves room for autograd adding a gradient's contributions in another order under recompute (a
        # checkpointed layer's input gradient arrives as one sum): fp32 rounding, 1e-6 relative with an absolute
        # floor for entries that cancel to ~0. A recompute that routes on its own is off by ~1e-3 (measured)
        assert loss_r == pytest.approx(loss, rel=1e-6, abs=1e-7) and math.isfinite(loss) and loss != 0
        assert norm_r == pytest.approx(norm, rel=1e-6)
        assert grads_r.keys() == grads.keys()
        for k in grads:
            torch.testing.assert_close(grads_r[k], grads[k], rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")


def rank_selective_moe_recompute(group, model):
    """Forward and backward of a tiny MoE model under random replayed routes, without recompute and with megatron's
    selective recompute of the MoE layer (its router included): (loss, gradients) of each, and whether any replay
    stayed queued after the backward pass."""
    from megatron_pdm.models import ModelConfig, ParallelConfig, build_model, initialize_parallel, routing_replay
    from megatron_pdm.models.gpt import _router_replays, forward_logits

    cfg = ModelConfig(**model)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=g)
    routes = torch.rand(2, 8, cfg.num_layers, cfg.num_experts, generator=g).argsort(-1)[..., :cfg.moe_router_topk]
    out = []
    for recompute in ({}, dict(recompute_granularity="selective", recompute_modules=["moe"])):
        with initialize_parallel(ParallelConfig(), seed=3) as ctx:
            net = build_model(cfg, ctx, moe_enable_routing_replay=True, **recompute)
            with routing_replay(net, routes):
                loss = forward_logits(net, ids).logsumexp(-1).sum()
            loss.backward()
            queued = any(r.replay_backward_list for r in _router_replays(net))
            out.append((loss.item(), {n: p.grad.clone() for n, p in net.named_parameters()}, queued))
    return out


def test_r3_with_selective_moe_recompute(dist_pools):
    """megatron's selective recompute of the MoE layer reruns its router in the backward pass: it replays too."""
    (loss, grads, _), (loss_r, grads_r, queued) = dist_pools(1).run(rank_selective_moe_recompute,
                                                                     shared=(TRAIN_MOE,))[0]
    assert not queued  # the recompute popped what the forward queued
    assert loss_r == pytest.approx(loss, rel=1e-6)  # as above: the same operations, fp32 summation order at most
    for k in grads:
        torch.testing.assert_close(grads_r[k], grads[k], rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
