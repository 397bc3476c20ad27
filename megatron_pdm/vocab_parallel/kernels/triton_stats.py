"""Triton kernels: per-row partial sums of the local logits shard in one read, and the log pi(k) backward.

One program per row walks the row's V_l columns in blocks with an online maximum m. With y = z / temperature
and S the row's support ids (the sampled token and the behavior top-K) that this shard owns, it returns

    m,  S0 = sum_i e^(y_i - m),  R0 = sum_{i not in S} e^(y_i - m),
        R1 = sum_i e^(y_i - m) y_i,  R2 = sum_{i not in S} e^(2 (y_i - m))

each rescaled by e^(m_old - m) (e^(2 (m_old - m)) for R2) whenever m grows. Once the global log Z is known
(log Z = logsumexp over ranks of m + log S0), c = e^(m - log Z) turns them into this shard's share of
sum_i pi_i y_i = c R1, of the out-of-support mass c R0 and of sum_{i not in S} pi_i^2 = c^2 R2: what the torch
path gets from two reads. The support is excluded inside the sum (never subtracted after), so the out-of-support
sums stay accurate when the support holds almost all the mass. The exclusion test ([BLOCK, JP] compares) runs
only in the few blocks that hold a support id.

-inf logits (entries masked by the caller) are probability 0 with 0 log 0 = 0: a product e * y is taken as 0
where e = 0, and the running maximum is taken as 0 while every entry so far is -inf (its exps are then 0, not
the NaN of -inf - -inf); a row that is -inf on the whole shard returns m = -inf and zero sums.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_partial_sums_kernel(z_ptr, stride_z, sup_ptr, stride_sup, out_ptr, V, inv_temp,
                             J: tl.constexpr, JP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    jj = tl.arange(0, JP)
    sup = tl.load(sup_ptr + row * stride_sup + jj, mask=jj < J, other=-1)  # local ids; not owned: outside [0, V)
    m = tl.full((), float("-inf"), tl.float32)
    s0 = tl.zeros((), tl.float32)
    r0 = tl.zeros((), tl.float32)
    r1 = tl.zeros((), tl.float32)
    r2 = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < V
        y = tl.load(z_row + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(y, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # only -inf so far: exps 0, not NaN
        a = tl.exp(m - m_ref)
        e = tl.exp(y - m_ref)  # 0 on the padding columns and at -inf logits
        hits = tl.sum(((sup >= start) & (sup < start + BLOCK)).to(tl.int32), 0)
        if hits > 0:
            excluded = tl.sum((cols[:, None] == sup[None, :]).to(tl.int32), 1) > 0
            e_rest = tl.where(excluded, 0.0, e)
        else:
            e_rest = e
        s0 = s0 * a + tl.sum(e, 0)
        r0 = r0 * a + tl.sum(e_rest, 0)
        r1 = r1 * a + tl.sum(e * tl.where(e > 0, y, 0.0), 0)  # 0 log 0 = 0
        r2 = r2 * a * a + tl.sum(e_rest * e_rest, 0)
        m = m_new
    out = out_ptr + row * 5
    tl.store(out, m)
    tl.store(out + 1, s0)
    tl.store(out + 2, r0)
    tl.store(out + 3, r1)
    tl.store(out + 4, r2)


@triton.jit
def _logprob_grad_kernel(z_ptr, stride_z, grad_ptr, stride_g, lse_ptr, gout_ptr, tok_ptr, V, inv_temp,
                         BLOCK: tl.constexpr):
    """grad_i = (pi_i - 1[i = k]) * (-g / temperature), pi_i = e^(y_i - log Z): one read, one write per entry."""
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    scale = -tl.load(gout_ptr + row) * inv_temp
    k = tl.load(tok_ptr + row)  # local column of the sampled token; outside [0, V) when another rank owns it
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < V
        y = tl.load(z_ptr + row * stride_z + cols, mask=valid, other=0.0).to(tl.float32) * inv_temp
        g = (tl.exp(y - lse) - tl.where(cols == k, 1.0, 0.0)) * scale
        tl.store(grad_ptr + row * stride_g + cols, g.to(grad_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _exact_partial_sums_kernel(z_ptr, stride_z, b_ptr, stride_b, out_ptr, V, inv_temp, BLOCK: tl.constexpr):
    """Per row of the two shards (y = z / T for pi, x = b / T for mu), with online maxima m_y, m_x:
    [m_y, Sy, m_x, Sx, R1, A1, B, Q, C1, C2] =
    [m_y, sum e_y, m_x, sum e_x, sum e_y y, sum e_x (x - y), sum e_y e_x, sum e_y^2, sum e_y (y - x),
     sum e_y^2 (y - x)],  e_y = e^(y - m_y), e_x = e^(x - m_x): every sum the KL kinds need, from one read."""
    row = tl.program_id(0).to(tl.int64)
    my = tl.full((), float("-inf"), tl.float32)
    mx = tl.full((), float("-inf"), tl.float32)
    sy = tl.zeros((), tl.float32)
    sx = tl.zeros((), tl.float32)
    r1 = tl.zeros((), tl.float32)
    a1 = tl.zeros((), tl.float32)
    bb = tl.zeros((), tl.float32)
    q = tl.zeros((), tl.float32)
    c1 = tl.zeros((), tl.float32)
    c2 = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < V
        y = tl.load(z_ptr + row * stride_z + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        x = tl.load(b_ptr + row * stride_b + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        my_new = tl.maximum(my, tl.max(y, 0))
        mx_new = tl.maximum(mx, tl.max(x, 0))
        my_ref = tl.where(my_new == float("-inf"), 0.0, my_new)  # only -inf so far: exps 0, not NaN
        mx_ref = tl.where(mx_new == float("-inf"), 0.0, mx_new)
        ay = tl.exp(my - my_ref)
        ax = tl.exp(mx - mx_ref)
        ey = tl.exp(y - my_ref)  # 0 on the padding columns and at -inf logits
        ex = tl.exp(x - mx_ref)
        # 0 log 0 = 0: where the weighing probability (e_y or e_x) is 0 (a -inf logit, the padding) its factor is 0,
        # never the NaN of -inf - -inf; y - x (log pi - log mu up to a per-row constant) is +-inf where only the
        # other one is 0
        y_ey = tl.where(ey > 0, y, 0.0)
        diff_ey = y_ey - tl.where(ey > 0, x, 0.0)
        diff_ex = tl.where(ex > 0, y, 0.0) - tl.where(ex > 0, x, 0.0)
        sy = sy * ay + tl.sum(ey, 0)
        sx = sx * ax + tl.sum(ex, 0)
        r1 = r1 * ay + tl.sum(ey * y_ey, 0)
        a1 = a1 * ax - tl.sum(ex * diff_ex, 0)
        bb = bb * ay * ax + tl.sum(ey * ex, 0)
        q = q * ay * ay + tl.sum(ey * ey, 0)
        c1 = c1 * ay + tl.sum(ey * diff_ey, 0)
        c2 = c2 * ay * ay + tl.sum(ey * (ey * diff_ey), 0)
        my = my_new
        mx = mx_new
    out = out_ptr + row * 10
    tl.store(out, my)
    tl.store(out + 1, sy)
    tl.store(out + 2, mx)
    tl.store(out + 3, sx)
    tl.store(out + 4, r1)
    tl.store(out + 5, a1)
    tl.store(out + 6, bb)
    tl.store(out + 7, q)
    tl.store(out + 8, c1)
    tl.store(out + 9, c2)


@triton.jit
def _tv_sums_kernel(z_ptr, stride_z, b_ptr, stride_b, lse_ptr, out_ptr, V, inv_temp, BLOCK: tl.constexpr):
    """With the global log Z of pi and mu known (s = sign(pi - mu) needs them): this shard's
    [sum |pi - mu|, sum s pi^2, sum s pi, sum pi^2]; a second read of both shards."""
    row = tl.program_id(0).to(tl.int64)
    ly = tl.load(lse_ptr + row * 2)
    lx = tl.load(lse_ptr + row * 2 + 1)
    t_abs = tl.zeros((), tl.float32)
    t_sp2 = tl.zeros((), tl.float32)
    t_sp = tl.zeros((), tl.float32)
    t_p2 = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < V
        y = tl.load(z_ptr + row * stride_z + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        x = tl.load(b_ptr + row * stride_b + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        p = tl.exp(y - ly)
        mu = tl.exp(x - lx)
        s = tl.where(p > mu, 1.0, tl.where(p < mu, -1.0, 0.0))
        t_abs += tl.sum(tl.abs(p - mu), 0)
        t_sp2 += tl.sum(s * p * p, 0)
        t_sp += tl.sum(s * p, 0)
        t_p2 += tl.sum(p * p, 0)
    out = out_ptr + row * 4
    tl.store(out, t_abs)
    tl.store(out + 1, t_sp2)
    tl.store(out + 2, t_sp)
    tl.store(out + 3, t_p2)
