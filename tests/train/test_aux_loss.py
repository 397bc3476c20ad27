"""The MoE load-balancing loss weighs what megatron's own weighting gives, on whatever megatron-core is installed: the
router's token count (different in 0.16 and 0.17+) is measured (`train/aux_loss.py`), not assumed."""

from fractions import Fraction
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_pdm.train.config import config_from_dict
from megatron_pdm.train.data import ARITHMETIC_TOKENIZER
from tests.helpers import TRAIN_MOE

# DeepSeek-V3's router (sigmoid scores, expert bias, groups) with its sequence-wise balance loss; a dense first layer
DSV3_SEQ_AUX = dict(model_type="deepseek_v3", vocab_size=320, hidden_size=32, num_layers=3, num_attention_heads=4,
                    num_query_groups=4, head_dim=8, ffn_hidden_size=64, num_experts=8, moe_ffn_hidden_size=16,
                    moe_router_topk=4, moe_first_k_dense=1, moe_shared_expert_ffn_hidden_size=16,
                    moe_router_num_groups=4, moe_router_group_topk=2, moe_routed_scaling_factor=2.5,
                    moe_aux_loss_coeff=0.1, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8,
                    rope_theta=10000.0, max_position_embeddings=32)


def test_the_probe_tells_every_known_form_apart():
    """On every rank of a TP x CP group of up to 256 (rank 0 and the others differ), the probe's token counts give
    each candidate form its own count, 1 / (5 size) apart or more (the probe's tolerance, 1e-5, is far below): no
    two forms can be confused."""
    from megatron_pdm.train.aux_loss import CANDIDATES, probe_tokens

    for size in range(1, 257):
        for rank in range(min(size, 2)):
            rows, local, group = probe_tokens(size, rank)
            counts = sorted({Fraction(group if c.group_tokens else local) * (size if c.times_group else 1)
                             / (rows if c.per_row else 1)
                             for c in CANDIDATES if size > 1 or not (c.group_tokens or c.times_group)})
            assert len(counts) == (8 if size > 1 else 2)
            assert min(b / a for a, b in pairwise(counts)) >= 1 + Fraction(1, 5 * size), (size, rank)


def rank_load_balancing_grads(group, cfg, run_dir, ids, lengths):
    """The router gradients of one trainer update whose policy loss is zero (only the load-balancing loss trains),
    on right-padded rows with their padding masks, and those of megatron's own weighting of the same micro-batches:
    the coefficient x the mean over micro-batches of each one's loss (calculate_per_token_loss off, scale 1 / M),
    summed over TP (each TP rank's routers see its part of the sequence), as the trainer's finalize_model_grads
    sums them."""
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_pdm.compat import cuda_to_cpu_scope
    from megatron_pdm.models import build_model, causal_mask
    from megatron_pdm.objectives import Metrics
    from megatron_pdm.train.trainer import Trainer

    trainer = Trainer(cfg, Path(run_dir))
    reference = build_model(cfg.model, trainer.parallel)
    reference.load_state_dict(trainer.chunks[0].state_dict())
    padding = torch.arange(ids.shape[1])[None] >= torch.tensor(lengths)[:, None]
    cuts = [slice(i, i + 3) for i in range(0, len(ids), 3)]  # rows 3, 3, 1
    mbs = [SimpleNamespace(input_ids=ids[c], lengths=lengths[c], padding_mask=padding[c]) for c in cuts]
    trainer.learner.update(mbs, lambda mb, logits: ((logits * 0).sum(), Metrics()))
    MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), 1 / len(mbs)))
    for mb in mbs:
        B, S = mb.input_ids.shape
        with cuda_to_cpu_scope():
            out = reference(mb.input_ids, torch.arange(S)[None].expand(B, S), causal_mask(S, mb.input_ids.device),
                            padding_mask=mb.padding_mask)
        (out * 0).sum().backward()
    ours = {n: p.main_grad.clone() for n, p in trainer.chunks[0].named_parameters() if "router" in n}
    theirs = {n: p.grad.clone() for n, p in reference.named_parameters() if "router" in n}
    for g in theirs.values():
        dist.all_reduce(g, group=trainer.parallel.tp_group)
    trainer.parallel.close()
    return ours, theirs


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("model", [dict(TRAIN_MOE, moe_aux_loss_coeff=0.1), DSV3_SEQ_AUX],
                         ids=["aux_loss", "seq_aux_loss"])
def test_load_balancing_loss_is_megatrons_at_tp1_and_tp2(dist_pools, tmp_path, model, tp):
    """Qwen3-MoE's batch-wise loss and DeepSeek-V3's sequence-wise one, each at TP 1 and TP 2, weigh what megatron's
    own weighting gives (which is the same at every TP): megatron-core 0.17+ multiplies the count by the TP x CP
    size, 0.16 divides the sequence-wise one by the micro-batch's rows; micro-batches of 3, 3 and 1 rows, padded."""
    cfg = config_from_dict({"model": {**model, "tokenizer": str(ARITHMETIC_TOKENIZER)}, "parallel": {"tensor": tp},
                            "train": {"prompts_per_step": 4, "minibatches": 1}})
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 288, (7, 10), generator=gen)
    lengths = [10, 7, 4, 9, 10, 2, 6]
    results = dist_pools(tp).run(rank_load_balancing_grads, shared=(cfg, str(tmp_path), ids, lengths))
    moe_layers = sum(cfg.model.is_moe_layer(i) for i in range(cfg.model.num_layers))
    for ours, theirs in results:
        assert ours.keys() == theirs.keys() and len(ours) == moe_layers
        for k in ours:
            assert float(theirs[k].abs().max()) > 1e-4  # the loss trains the router
            # float32 sums in two orders (one model's micro-batch losses summed vs scaled apart)
            torch.testing.assert_close(ours[k], theirs[k], atol=1e-7, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
