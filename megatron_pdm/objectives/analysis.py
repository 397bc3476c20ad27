"""The token-level alignment study (PDM paper section 4.2): does keeping a token's update really reduce D?

On tokens outside the trust region (D_before > delta) whose two direction rules disagree, each rule keeps the
tokens it predicts will not increase D: the ratio rule keeps sign(A (r - 1)) <= 0, the PDM rule keeps
sign(A Ddot) <= 0. After a real optimizer step, a kept token is an *unsafe keep* if its realized D increased
and a *corrective keep* if it decreased.
"""

from __future__ import annotations

import torch


def alignment_rates(divergence_before, divergence_after, log_ratio, predicted_change, advantages, *, delta: float,
                    where: torch.Tensor | None = None) -> dict[str, float]:
    """Counts and rates for the ratio rule and the PDM rule side by side (all inputs per token [T]).

    Returns outside (D_before > delta), disagree (outside and sign(A (r-1)) != sign(A Ddot)), and for rule in
    (ratio, pdm): <rule>_kept, <rule>_unsafe_keep_rate = #(kept, dD > 0) / #kept,
    <rule>_corrective_keep_rate = #(kept, dD < 0) / #kept, with dD = D_after - D_before; NaN when nothing is kept.
    """
    sa = torch.sign(advantages)
    ratio_up = sa * torch.sign(log_ratio) > 0
    pdm_up = sa * torch.sign(predicted_change) > 0
    on = torch.ones_like(ratio_up) if where is None else where.bool()
    outside = on & (divergence_before > delta) & (advantages != 0)
    disagree = outside & (ratio_up != pdm_up)
    change = divergence_after - divergence_before
    out = {"outside": int(outside.sum()), "disagree": int(disagree.sum())}
    for rule, up in (("ratio", ratio_up), ("pdm", pdm_up)):
        kept = disagree & ~up
        n = int(kept.sum())
        out[f"{rule}_kept"] = n
        out[f"{rule}_unsafe_keep_rate"] = float((kept & (change > 0)).sum()) / n if n else float("nan")
        out[f"{rule}_corrective_keep_rate"] = float((kept & (change < 0)).sum()) / n if n else float("nan")
    return out
