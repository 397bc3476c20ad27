"""Calling the PDM loss from another trainer's loss function (verl, slime, NeMo-RL, your own).

Those trainers hold, per micro-batch, padded [B, L] responses and the model's vocab-parallel logits shard
[B, L, V/tp] (Megatron's output layer with `parallel_output=True`), plus what the rollout engine returned:
the sampled-token log-prob and the top-K ids / log-probs per response position. `pdm_loss` below maps those
to `megatron_pdm.objectives.policy_loss`: flatten the response tokens, build a `BehaviorTopK`, and pass the
trainer's own tensor-parallel group. The returned loss already has the global-batch denominator.

  verl (Megatron actor):   call it where the actor computes `log_prob` from `logits` in its forward step,
                           with `mpu.get_tensor_model_parallel_group()`; the rollout's top-K comes from the
                           vLLM/SGLang server's `logprobs=K` output, stored in the batch next to
                           `rollout_log_probs`.
  slime:                   call it from the custom policy-loss hook with the logits shard slime passes and
                           `mpu.get_tensor_model_parallel_group()`; SGLang's `output_top_logprobs` gives the
                           top-K.

Run this file to see it work on CPU with two tensor-parallel processes over gloo:

    python examples/drop_in_policy_loss.py
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_pdm.objectives import ObjectiveConfig, loss_normalizer, policy_loss
from megatron_pdm.vocab_parallel import BehaviorTopK


def pdm_loss(logits_shard, response_mask, advantages, token_ids, token_logprobs, topk_ids, topk_logprobs, *,
             temperature: float, tp_group, dp_group=None, config: ObjectiveConfig | None = None):
    """logits_shard [B, L, V/tp]; response_mask, advantages, token_ids, token_logprobs [B, L];
    topk_ids, topk_logprobs [B, L, K]; temperature: the rollout's sampling temperature (its log-probs are
    log_softmax(logits / temperature), and so must the trainer's be). Returns (loss, metrics dict)."""
    config = config or ObjectiveConfig()
    on = response_mask.reshape(-1) > 0
    K = topk_ids.shape[-1]
    device = logits_shard.device  # every tensor made here goes beside the logits
    seq = torch.arange(response_mask.shape[0], device=device).repeat_interleave(response_mask.shape[1])[on]
    behavior = BehaviorTopK(token_ids.reshape(-1)[on], token_logprobs.reshape(-1)[on],
                            topk_ids.reshape(-1, K)[on], topk_logprobs.reshape(-1, K)[on])
    # validate the engine's output once per rollout (it reads values: a host sync); the loss does not re-check
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    behavior.validate(logits_shard.shape[-1] * tp)
    ones = torch.ones(seq.shape[0], device=device)
    normalizer = loss_normalizer(ones, seq, config.aggregation, group=dp_group)
    out = policy_loss(logits_shard.reshape(-1, logits_shard.shape[-1])[on], behavior, advantages.reshape(-1)[on],
                      ones, config, temperature=temperature, normalizer=normalizer, sequence_ids=seq, tp_group=tp_group)
    return out.loss, out.metrics.reduce(dp_group)


def _demo(rank, world, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    B, L, V, K = 4, 6, 64, 5
    g = torch.Generator().manual_seed(0)
    full = torch.randn(B, L, V, generator=g)  # stands in for the model's full logits (only used to fake a rollout)
    log_mu = torch.log_softmax(full + 0.3 * torch.randn(B, L, V, generator=g), -1)
    # every TP rank must see the same rollout: sample with the shared generator
    token_ids = torch.multinomial(log_mu.exp().reshape(-1, V), 1, generator=g).reshape(B, L)
    topk_logprobs, topk_ids = log_mu.topk(K, dim=-1)
    token_logprobs = log_mu.gather(-1, token_ids[..., None]).squeeze(-1)
    response_mask = torch.ones(B, L)
    response_mask[0, :2] = 0  # a shorter response
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(B, L)
    shard = full[..., rank * V // world:(rank + 1) * V // world].clone().requires_grad_(True)
    loss, metrics = pdm_loss(shard, response_mask, advantages, token_ids, token_logprobs, topk_ids, topk_logprobs,
                             temperature=1.0, tp_group=dist.group.WORLD)
    loss.backward()
    if rank == 0:
        print(f"loss {loss.item():.6f}  grad norm of shard 0 {shard.grad.norm():.6f}")
        print({k: round(v, 4) for k, v in metrics.items()})
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.spawn(_demo, args=(2, free_port), nprocs=2)
