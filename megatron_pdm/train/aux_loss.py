"""The token count by which the installed megatron-core's MoE router multiplies the load-balancing loss, measured.

With calculate_per_token_loss, megatron's TopKRouter multiplies a micro-batch's load-balancing loss by a token count
before attaching it to the routing probabilities (router.py, attach_and_log_load_balancing_loss), for a division by
the global token count in finalize_model_grads that our globally normalised losses never make: the step divides it
out again (`Learner._aux_scale`). That count is not the same across releases:
- with a padding mask, the valid tokens of the whole TP x CP group, not this rank's (0.16 to 0.19:
  get_tokens_per_expert_and_token_count all-reduces its per-expert counts in place before summing the "local" ones);
- times the TP x CP group's size (0.17 and later);
- for DeepSeek's sequence-wise loss (seq_aux_loss), divided by the micro-batch's rows (0.16; 0.17 and later
  multiply them back).
So it is measured, not read off a version: `probe_aux_loss_count` runs a small router of the installed megatron-core
on the run's TP x CP group twice, with and without calculate_per_token_loss, and the ratio of its weight gradients is
the count. Every form the releases above use is a candidate (`CANDIDATES`); the probe's token counts are chosen so
that no two candidates give the same count, and a count that matches none is an error naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product

import torch

# the probe's router: a few experts and features (any sizes measure the same count), two experts per token
_EXPERTS, _HIDDEN, _COLUMNS = 4, 4, 2


@dataclass(frozen=True)
class AuxLossCount:
    """How the router's count is formed from a micro-batch's tokens: without a padding mask, the tokens this rank
    routes; with one, its valid tokens, or the TP x CP group's (`group_tokens`). Then times the group's size
    (`times_group`) and divided by the micro-batch's rows (`per_row`)."""

    group_tokens: bool = False
    times_group: bool = False
    per_row: bool = False

    def factor(self, tokens, group_size: int, rows: int):
        """The count for `tokens` (an int or a device tensor: the ones `group_tokens` names), the TP x CP size and
        the micro-batch's rows."""
        return tokens * (group_size if self.times_group else 1) / (rows if self.per_row else 1)


CANDIDATES = tuple(AuxLossCount(*flags) for flags in product((False, True), repeat=3))


def probe_tokens(group_size: int, group_rank: int) -> tuple[int, int, int]:
    """(rows, this rank's valid tokens, the group's valid tokens) of the probe: rank 0 of the group 1 valid token,
    the others 2, in 2 x size + 1 rows. Then no two candidates agree on any rank: with G = 2 size - 1 valid tokens
    in the group, G / local is never the size, the rows or a product or ratio of the two (at size 1 the group and
    the size factor are moot, and the rows still tell `per_row`)."""
    local = 1 if group_rank == 0 else 2
    return 2 * group_size + 1, local, 2 * group_size - 1


def matching(measured: float, local, group, group_size: int, rows: int) -> list[AuxLossCount]:
    """The candidates whose count is `measured` (relative 1e-5: the measurement is a ratio of float32 gradients, good
    to about 1e-6, and the probe's candidates differ by a factor of at least 1 + 1 / (5 size))."""
    return [c for c in CANDIDATES
            if math.isclose(c.factor(group if c.group_tokens else local, group_size, rows), measured, rel_tol=1e-5)]


def _measured_count(load_balancing: str, groups, device, rows: int, padding) -> float:
    """The count megatron's router multiplies its load-balancing loss by here: the ratio of the router's weight
    gradient with calculate_per_token_loss to that without, on fixed inputs (no random number is drawn); padding:
    the router's [columns, rows] mask (True: padding), or None."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.moe.router import TopKRouter

    # positive features and expert e's weights e / 4: every token routes to the last two experts, an imbalance whose
    # loss has a gradient (a balanced routing is the loss's minimum), with unsaturated probabilities
    x = torch.linspace(0.1, 1.0, _COLUMNS * rows * _HIDDEN, device=device).reshape(_COLUMNS, rows, _HIDDEN)
    weight = torch.arange(_EXPERTS, dtype=torch.float32)[:, None].expand(_EXPERTS, _HIDDEN) / 4
    saved = MoEAuxLossAutoScaler.main_loss_backward_scale  # set_loss_scale copies into it: a new one meanwhile
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.ones(1, device=device)
    grads = []
    try:
        for per_token in (False, True):
            config = TransformerConfig(num_layers=1, hidden_size=_HIDDEN, num_attention_heads=1,
                                       num_moe_experts=_EXPERTS, moe_router_topk=2,
                                       moe_router_load_balancing_type=load_balancing, moe_aux_loss_coeff=1.0,
                                       calculate_per_token_loss=per_token, add_bias_linear=False,
                                       perform_initialization=False, use_cpu_initialization=True)
            router = TopKRouter(config, pg_collection=groups).to(device)
            with torch.no_grad():
                router.weight.copy_(weight)
            with torch.enable_grad():
                probs, _ = router(x, padding_mask=padding)
                (probs * 0).sum().backward()  # only the attached load-balancing loss has a gradient
            grads.append(router.weight.grad.double().flatten())
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved
    plain, per_token = grads
    return float(per_token @ plain / (plain @ plain))


def probe_aux_loss_count(load_balancing: str, groups, device) -> AuxLossCount:
    """The form of the count (`AuxLossCount`) that the installed megatron-core's router multiplies a
    `load_balancing` loss ("aux_loss", "seq_aux_loss") by, measured on `groups` (megatron's ProcessGroupCollection:
    collective over its TP x CP group, whose ranks all call it) with and without a padding mask. Cost: four
    forward and backward passes of a 4 x 4 router over a few tokens, each all-reducing 4 counts."""
    size, rank = groups.tp_cp.size(), groups.tp_cp.rank()
    rows, local, group = probe_tokens(size, rank)
    padding = torch.ones(_COLUMNS * rows, dtype=torch.bool, device=device)
    padding[:local] = False
    measured = {"padded": _measured_count(load_balancing, groups, device, rows, padding.reshape(_COLUMNS, rows)),
                "unpadded": _measured_count(load_balancing, groups, device, rows, None)}
    every = _COLUMNS * rows  # without a mask the router counts this rank's tokens, all of them
    found = set(matching(measured["padded"], local, group, size, rows))
    found &= set(matching(measured["unpadded"], every, every, size, rows))
    if size == 1:  # the group is this rank: its tokens and the size factor are moot
        found = {c for c in found if not (c.group_tokens or c.times_group)}
    if len(found) != 1:
        raise RuntimeError(
            f"megatron-core's MoE router multiplies the {load_balancing} load-balancing loss by a token count of no "
            f"known form: measured {measured['padded']:.6g} with a padding mask ({local} valid tokens on this rank, "
            f"{group} in the TP x CP group of {size}, {rows} rows) and {measured['unpadded']:.6g} without "
            f"({every} tokens); the known forms: megatron_pdm/train/aux_loss.py")
    return found.pop()
