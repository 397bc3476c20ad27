"""Vocab-parallel log-probs, entropy, divergences and the predicted divergence change (DESIGN.md sections 2-4).

Rank r of `group` holds the logits shard z_r = z[:, r*V_l:(r+1)*V_l] of equal width V_l (Megatron pads the
vocabulary to a multiple of the TP size), pi = softmax(z / temperature), V = V_l * tp. `group=None` is one
process holding the whole vocabulary. Rows are processed in chunks; per chunk exactly two collectives run:

1. an all-gather of each rank's local log-sum-exp ([n] floats, [n, 2] with a behavior logits shard);
2. one all-reduce of a packed [n, c] tensor of per-rank partial sums (c = K + 4 for the top-K kinds).

No rank ever materialises more than a few [chunk, V_l] buffers, and nothing of size O(T * V) is communicated.
Math runs in float32 (float64 when the logits are float64), whatever the logits dtype.

Device and host syncs: every tensor is made on the logits' device, and nothing here reads a tensor's values on the
host (no `.item()`, `bool(tensor)`, `nonzero`), so a CUDA micro-batch never waits on the GPU. Values are validated
once at the boundary instead (`BehaviorTopK.validate` where the engine's output is parsed); here only shapes,
dtypes and devices are checked. NaN logits give NaN statistics on every rank (the collectives spread them).

Edges: a -inf logit (a vocabulary entry masked by the caller) is probability 0 and 0 log 0 = 0, so entropy and
divergences are those of the distribution over the finite entries; see `_topk_terms` for the engine's log-probs.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import kernels
from .behavior import BehaviorLogits, BehaviorTopK

TOPK_KINDS = ("binary_tv", "binary_kl", "topk_kl", "topk_tv")
EXACT_KINDS = ("kl", "reverse_kl", "tv")
KINDS = TOPK_KINDS + EXACT_KINDS
TAILS = ("aggregated", "uniform", "proportional")

# Rows per collective chunk: as many as a float32 [chunk, V_l] block of this size would hold (no such block is
# allocated: the chunk is computed in sub-chunks), so that collectives are few (gloo's latency is ~1 ms).
CHUNK_BYTES = {"cpu": 256 * 2**20, "cuda": 256 * 2**20}
# Rows per sub-chunk: one float32 [sub, V_l] work buffer of this size. On a CPU the sub-chunk's passes then run
# from cache (measured at V_l = 16K, one thread: 2 MiB 0.35 s, 8 MiB 0.77 s, megatron's cross entropy 0.59 s);
# on a GPU large sub-chunks keep kernels long. CPU sub-chunks run on one-thread workers (`_for_blocks`).
SUB_CHUNK_BYTES = {"cpu": 2 * 2**20, "cuda": 256 * 2**20}
# at least this many rows, else a sub-chunk is all per-op overhead. Issue 56, V_l = 152K, bf16, forward + backward
# on one thread: 1 row 0.32 s, 2-8 rows 0.27-0.28 s, 16 rows 0.33 s, 32 rows 0.39 s (megatron's CE 0.36 s); the
# same with ATEN_CPU_CAPABILITY=avx2: 2-8 rows 0.27-0.28 s, 16 rows 0.36 s, 32 rows 0.45 s
SUB_CHUNK_MIN_ROWS = 4
# the class attribute by which a Python function / dispatch mode says the row blocks may run on worker threads
# outside it (`_block_threads`); a name, not an import: compat sits below this package and sets it on its modes
FLOAT_BLOCK_TRANSPARENT = "float_block_transparent"

Behavior = BehaviorTopK | BehaviorLogits


class PolicyStatistics(NamedTuple):
    """Per-token [T] outputs of `policy_statistics`.

    logprobs           log pi(k), differentiable
    behavior_logprobs  log mu(k) (the engine's, clamped at 0; or from mu's logits shard for the exact kinds)
    entropy            H(pi) = -sum_i pi_i log pi_i, differentiable (an entropy bonus)
    divergence         D(mu, pi) of `kind`
    predicted_change   Ddot / A of `kind` (DESIGN.md section 2.3)
    """

    logprobs: torch.Tensor
    behavior_logprobs: torch.Tensor
    entropy: torch.Tensor
    divergence: torch.Tensor
    predicted_change: torch.Tensor


# ----------------------------------------------------------------------------------------------------------
# collectives and shard bookkeeping


def _group_info(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_gather(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """[n, ...] on each rank -> [world, n, ...]."""
    if world == 1:
        return x.unsqueeze(0)
    out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
    # torch 2.13 renamed all_gather_into_tensor; cluster containers still carry older torch releases
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x.contiguous(), group=group)
    return out.view((world,) + tuple(x.shape))


def _all_reduce(x: torch.Tensor, group, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(x, group=group)
    return x


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _scaled(z: torch.Tensor, temperature: float, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """z / temperature in `dtype`, written into `out[:len(z)]` when a copy is needed; z itself is never modified
    (it is returned as is when no cast or scaling is needed)."""
    if temperature == 1.0 and z.dtype == dtype:
        return z
    y = z.to(dtype, copy=True) if out is None else out[: z.shape[0]].copy_(z)
    return y.div_(temperature) if temperature != 1.0 else y


class _Scratch:
    """Work buffers reused by every chunk of one pass: fresh [chunk, V_l] allocations per chunk cost page
    faults (large blocks are mmapped) and are measurably slower than reusing one block."""

    def __init__(self, rows: int, width: int, dtype: torch.dtype, device: torch.device):
        self.rows, self.width, self.dtype, self.device = rows, width, dtype, device
        self._bufs = {}

    def get(self, name: str, n: int, extra_cols: int = 0) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None:
            buf = self._bufs[name] = torch.empty(self.rows, self.width + extra_cols, dtype=self.dtype,
                                                 device=self.device)
        return buf[:n]


def _owned(ids: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask of ids in [start, start + width), their local column, 0 where not owned)."""
    local = ids - start
    owned = (local >= 0) & (local < width)
    return owned, torch.where(owned, local, 0)


def _exp_shifted(y: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write exp(y - rowmax) into out[:, :V_l]; return (rowmax, local log-sum-exp). A row that is -inf on this whole
    shard (masked entries) is shifted by 0 instead: its exps are 0 (not NaN), its rowmax and log-sum-exp -inf."""
    m = y.amax(-1)
    shift = m.masked_fill(m == float("-inf"), 0.0)
    pv = out[:, : y.shape[1]]
    torch.sub(y, shift[:, None], out=pv).exp_()
    return m, shift + pv.sum(-1).log()


def _block_threads(logits: torch.Tensor) -> int:
    """Worker threads for the row-block loops (`_for_blocks`): the caller's intra-op thread count on a CPU; 1 on
    other devices (their ops are asynchronous: one host thread keeps the device busy) and under a Python dispatch or
    function mode that does not declare itself `FLOAT_BLOCK_TRANSPARENT` (modes are per thread: a worker runs outside
    them). The blocks compute in float32 / float64 on tensors placed on the logits' device, so a mode that only
    rewrites "cuda" placements or low-precision products (compat's `cuda_to_cpu_scope` and `lowp_gemm_scope`, under
    which the trainer runs on a CPU) changes nothing in them and may declare it."""
    if logits.device.type != "cpu":
        return 1
    modes = (*torch.overrides._get_current_function_mode_stack(),
             *torch.utils._python_dispatch._get_current_dispatch_mode_stack())
    if not all(getattr(m, FLOAT_BLOCK_TRANSPARENT, False) for m in modes):
        return 1
    return torch.get_num_threads()


def _for_blocks(start: int, stop: int, step: int, work, scratches: list[_Scratch]) -> None:
    """work(b0, b1, scratch) once for each block [b0, b1) of rows start..stop in steps of `step`.

    With one scratch (one intra-op thread), inline. With n: on n fresh threads of ONE intra-op thread each, a free
    thread taking the next block, each with its own scratch. Why: a torch CPU op on n threads ends at a barrier
    that waits for all n, and the blocks are cache-sized, so a call runs thousands of such ops; when other
    processes share the cores, a descheduled thread stalls every barrier (issue 56: 7x the quiet time at
    V = 151,936, megatron-core's few large ops 2x). One-thread workers share no barrier: a stalled one delays its
    own block while the others take the rest; they meet only at the GIL, held for the microseconds of Python
    between ops of ~0.1 ms (torch ops release it). Measured on 2 busy cores, V = 151,936, 2048 tokens, forward +
    backward: fastest round 0.66 s (2-thread ops 0.65 s, megatron-core 0.83 s), median 1.4 s (2-thread ops 4.9 s).

    torch.set_num_threads sets the calling thread's OpenMP thread count and the process default that a thread
    reads at its first parallel op. Each worker sets 1 for itself; once all have, the caller sets the default back
    to its own (unchanged) count, before any block is taken. A thread of this process whose first parallel op
    falls inside that window (microseconds) would keep one intra-op thread. Grad and inference mode are per
    thread: the workers run without autograd (no block is differentiated through) in the caller's inference mode.
    """
    starts = range(start, stop, step)
    n = min(len(scratches), len(starts))
    if n <= 1:
        for b0 in starts:
            work(b0, min(b0 + step, stop), scratches[0])
        return
    blocks = iter(starts)  # shared by the workers: next() on a range iterator is atomic under the GIL
    ready, errors = threading.Barrier(n + 1), []
    inference = torch.is_inference_mode_enabled()

    def worker(scratch):
        try:
            torch.get_num_threads()  # torch sets a thread's count from the process default once, at its first use:
            torch.set_num_threads(1)  # now, so that this 1 stays (measured: else the ops run on n threads again)
            ready.wait()
            with torch.inference_mode(inference), torch.no_grad():  # this order: inference_mode(False) enables grad
                for b0 in blocks:
                    work(b0, min(b0 + step, stop), scratch)
        except threading.BrokenBarrierError:
            pass  # the caller could not start every worker, or another worker failed before the barrier
        except BaseException as e:  # re-raised by the caller
            errors.append(e)
            ready.abort()  # a worker that fails before the barrier would leave the others and the caller waiting

    threads = torch.get_num_threads()
    workers = [threading.Thread(target=worker, args=(s,), name="vocab-parallel-block") for s in scratches[:n]]
    try:
        for w in workers:
            w.start()
        ready.wait()
    except threading.BrokenBarrierError:
        if not errors:  # a worker broke the barrier: its error is raised below, once every worker has ended
            raise
    except BaseException:
        ready.abort()
        raise
    finally:
        torch.set_num_threads(threads)
        for w in workers:
            if w.ident is not None:  # started
                w.join()
    if errors:
        raise errors[0]


def _scratches(rows: int, width: int, dtype: torch.dtype, logits: torch.Tensor) -> list[_Scratch]:
    """One `_Scratch` per worker thread of `_for_blocks` (allocated at a worker's first use)."""
    return [_Scratch(rows, width, dtype, logits.device) for _ in range(_block_threads(logits))]


def _chunk_rows(chunk_size: int | None, logits: torch.Tensor) -> int:
    if chunk_size is None:
        budget = CHUNK_BYTES["cuda" if logits.is_cuda else "cpu"]
        chunk_size = max(1, budget // (4 * (logits.shape[1] + 1)))
    return max(1, min(chunk_size, logits.shape[0]))


def _sub_rows(logits: torch.Tensor) -> int:
    budget = SUB_CHUNK_BYTES["cuda" if logits.is_cuda else "cpu"]
    # at least SUB_CHUNK_MIN_ROWS rows: with very wide shards a few-row sub-chunk is all per-op overhead
    return max(SUB_CHUNK_MIN_ROWS, budget // (4 * (logits.shape[1] + 1)))


def _vecdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vecdot(a, b, dim=-1)


def _wsum(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum_i w_i x_i over the last dim with 0 * x = 0 for any x: 0 log 0 = 0 (an entry of probability 0, e.g. a
    -inf logit, adds nothing whatever its log); w_i > 0 with x_i = +-inf (mass where the other has none) is inf."""
    return torch.where(w == 0, 0.0, w * x).sum(-1)


def _finite(y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """y with -inf replaced by the lowest finite value, in `out`: p * y is then 0 where p = exp(y - m) = 0."""
    return torch.clamp(y, min=torch.finfo(y.dtype).min, out=out)


# ----------------------------------------------------------------------------------------------------------
# the chunked passes


def _shard_row_sums(y, ids_owned, idx, p, need_probs, need_entropy, yf):
    """One read of a sub-chunk y [n, V_l] of this shard, relative to its local row max m (no global quantity is
    needed, so exp runs once per entry whatever the TP size). With e_i = exp(y_i - m) written into p [n, V_l + 1]
    (the extra column is a sink for support ids not owned here) and S the support ids owned by this shard:

      lse_loc = m + log sum_i e_i,   y_S = y at S (0 where not owned),
      R1 = sum_i e_i y_i (0 y = 0 at -inf logits),   R0 = sum_{i not in S} e_i,   R2 = sum_{i not in S} e_i^2.

    Returns (m, lse_loc, y_S [n, J], R1 or None, R0 or None, R2 or None). `yf` is a scratch [n, V_l] buffer for
    the finite copy of y (only with need_entropy). Given the global log Z, pi_i = c e_i with c = exp(m - log Z),
    so the sums of pi are c R1, c R0, c^2 R2 (`_scale_row_sums`).
    """
    width = y.shape[1]
    m, lse_loc = _exp_shifted(y, p)
    y_sup = torch.where(ids_owned, y.gather(1, idx), 0.0)
    if not need_probs:
        return m, lse_loc, y_sup, None, None, None
    e = p[:, :width]
    r1 = _vecdot(e, _finite(y, yf)) if need_entropy else None
    p[:, width] = 0.0
    p.scatter_(1, torch.where(ids_owned, idx, width), 0.0)
    return m, lse_loc, y_sup, r1, e.sum(-1), _vecdot(e, e)


def _scale_row_sums(packed, lse, m, owned, J, need_probs):
    """In place on one chunk's packed [n, J (+ 2 or 3)] sums of `_shard_row_sums`, once the global log Z = lse is
    known: y_S -> log pi_S = y_S - log Z where owned (0 elsewhere), and with c = exp(m - log Z) the row sums of e
    become those of pi: (R1, R0) -> c (R1, R0), R2 -> c^2 R2."""
    packed[:, :J] = torch.where(owned, packed[:, :J] - lse[:, None], 0.0)
    if need_probs:
        c = (m - lse).exp()
        packed[:, J:-1] *= c[:, None]
        packed[:, -1] *= c.square()
    return packed


def _support_pass(logits, support_ids, *, group, temperature, chunk_size, need_probs, need_entropy):
    """Per-row statistics of pi against a support of ids (column 0 the sampled token, if any).

    Returns (lse [T], logp at support ids [T, J], sum_i pi_i y_i [T] or None, pi mass outside the support [T]
    or None, sum of pi_i^2 outside the support [T] or None), y = z / temperature.
    The out-of-support sums are direct sums over the complement (support entries zeroed through a sink column),
    not 1 - sum_S pi_i, so they stay accurate when the support holds almost all the mass.

    Rows go in chunks of `chunk_size` (two collectives each), and each chunk in cache-sized sub-chunks, each read
    once (`_shard_row_sums`: exp(y - local max) and its row sums, the same at every TP size); then collective 1
    gives the global log Z, `_scale_row_sums` turns the local sums into sums of pi, and collective 2 adds them up
    over the shards. CUDA logits take the fused kernel instead (`_support_pass_fused`), which computes the same.
    """
    if kernels.fused_available(logits):
        return _support_pass_fused(logits, support_ids, group=group, temperature=temperature,
                                   need_probs=need_probs, need_entropy=need_entropy)
    world, rank = _group_info(group)
    T, width = logits.shape
    start = rank * width
    dtype = _compute_dtype(logits)
    rows, sub = _chunk_rows(chunk_size, logits), _sub_rows(logits)
    scratches = _scratches(min(rows, sub), width, dtype, logits)
    J = support_ids.shape[1]
    ncols = J + (3 if need_entropy else 2) * need_probs
    lse, m_loc = logits.new_empty(T, dtype=dtype), logits.new_empty(T, dtype=dtype)
    packed = logits.new_zeros(T, ncols, dtype=dtype)

    def read(s0, s1, scratch):  # one read of the sub-chunk [s0, s1)
        y = _scaled(logits[s0:s1], temperature, dtype, scratch.get("y", sub))
        owned, idx = _owned(support_ids[s0:s1], start, width)
        yf = scratch.get("y_finite", s1 - s0) if need_probs and need_entropy else None
        m, lse[s0:s1], packed[s0:s1, :J], *sums = _shard_row_sums(
            y, owned, idx, scratch.get("p", s1 - s0, extra_cols=1), need_probs, need_entropy, yf
        )
        if need_probs:
            m_loc[s0:s1] = m
            packed[s0:s1, J:] = torch.stack([t for t in sums if t is not None], -1)

    for c0 in range(0, T, rows):
        c1 = min(c0 + rows, T)
        _for_blocks(c0, c1, sub, read, scratches)
        lse[c0:c1] = torch.logsumexp(_all_gather(lse[c0:c1], group, world), dim=0)  # collective 1
        owned, _ = _owned(support_ids[c0:c1], start, width)
        _scale_row_sums(packed[c0:c1], lse[c0:c1], m_loc[c0:c1], owned, J, need_probs)
        _all_reduce(packed[c0:c1], group, world)  # collective 2 (in place on the contiguous row block)
    if not need_probs:
        return lse, packed[:, :J], None, None, None
    return lse, packed[:, :J], packed[:, J] if need_entropy else None, packed[:, -2], packed[:, -1]


def _support_pass_fused(logits, support_ids, *, group, temperature, need_probs, need_entropy):
    """`_support_pass` from the Triton kernel's per-row partial sums (kernels/triton_stats.py): one read of the
    shard for all rows, then the same two collectives on [T] and [T, J + 3] floats."""
    world, rank = _group_info(group)
    width = logits.shape[1]
    start = rank * width
    m, s0, r0, r1, r2 = kernels.row_partial_sums(logits, support_ids - start, temperature).unbind(1)
    lse = torch.logsumexp(_all_gather(m + s0.log(), group, world), dim=0)  # collective 1
    owned, idx = _owned(support_ids, start, width)
    cols = [torch.where(owned, logits.gather(1, idx).float() / temperature - lse[:, None], 0.0)]
    if need_probs:
        c = (m - lse).exp()  # this shard's e^(y - m) sums -> sums of pi
        cols += [(c * r1)[:, None]] if need_entropy else []
        cols += [(c * r0)[:, None], (c * c * r2)[:, None]]
    packed = _all_reduce(torch.cat(cols, 1), group, world)  # collective 2
    J = support_ids.shape[1]
    if not need_probs:
        return lse, packed[:, :J], None, None, None
    return lse, packed[:, :J], packed[:, J] if need_entropy else None, packed[:, -2], packed[:, -1]


def _exact_pass(logits, behavior_logits, token_ids, kind, *, group, temperature, chunk_size):
    """Partial sums for the exact (full-vocabulary) kinds against mu's logits shard, reduced over the group.

    Returns {name: [T]}: lse and lse_mu (log Z of pi and of mu, over z / T), lp_k and lm_k (log pi(k), log mu(k)),
    ent (sum_i pi_i y_i) and the kind's reduced partial sums.
    CUDA logits take the fused kernels instead (`_exact_pass_fused`).
    """
    if kernels.fused_available(logits) and behavior_logits.dtype in kernels.DTYPES and behavior_logits.stride(-1) == 1:
        return _exact_pass_fused(logits, behavior_logits, token_ids, kind, group=group, temperature=temperature)
    world, rank = _group_info(group)
    T, width = logits.shape
    start = rank * width
    dtype = _compute_dtype(logits)
    rows = _chunk_rows(chunk_size, logits)
    scratch = _Scratch(rows, width, dtype, logits.device)
    names = {"kl": ("kl", "pi_dmu"), "reverse_kl": ("rkl", "p2l", "p2"), "tv": ("abs", "sp2", "sp", "p2")}[kind]
    out = {name: [] for name in ("lse", "lse_mu", "lp_k", "lm_k", "ent") + names}
    for c0 in range(0, T, rows):
        y = _scaled(logits[c0 : c0 + rows], temperature, dtype, scratch.get("y", rows))
        x = _scaled(behavior_logits[c0 : c0 + rows], temperature, dtype, scratch.get("x", rows))
        P, M = scratch.get("P", y.shape[0]), scratch.get("M", y.shape[0])
        m_y, lse_y_loc = _exp_shifted(y, P)
        m_x, lse_x_loc = _exp_shifted(x, M)
        lse = torch.logsumexp(_all_gather(torch.stack([lse_y_loc, lse_x_loc], -1), group, world), dim=0)
        lse_y, lse_x = lse[:, 0], lse[:, 1]
        P.mul_((m_y - lse_y).exp()[:, None])
        M.mul_((m_x - lse_x).exp()[:, None])
        owned, idx = _owned(token_ids[c0 : c0 + rows, None], start, width)
        cols = [
            torch.where(owned, y.gather(1, idx) - lse_y[:, None], 0.0),
            torch.where(owned, x.gather(1, idx) - lse_x[:, None], 0.0),
            _wsum(P, y)[:, None],
        ]
        if kind in ("kl", "reverse_kl"):
            d = (x - lse_x[:, None]).sub_(y).add_(lse_y[:, None])  # log mu - log pi (NaN where both are -inf)
        if kind == "kl":  # 0 log 0 = 0 through _wsum: entries where the weight is 0 add nothing
            cols += [_wsum(M, d), _vecdot(P, M - P)]
        elif kind == "reverse_kl":
            cols += [-_wsum(P, d), -_wsum(P, P * d), _vecdot(P, P)]
        else:
            s = torch.sign(P - M)
            cols += [(P - M).abs_().sum(-1), _vecdot(s * P, P), _vecdot(s, P), _vecdot(P, P)]
        packed = _all_reduce(torch.cat([c.reshape(c.shape[0], -1) for c in cols], -1), group, world)
        out["lse"].append(lse_y)
        out["lse_mu"].append(lse_x)
        for j, name in enumerate(("lp_k", "lm_k", "ent") + names):
            out[name].append(packed[:, j])
    if T == 0:
        return {name: torch.empty(0, dtype=dtype, device=logits.device) for name in out}
    return {name: torch.cat(v) for name, v in out.items()}


def _exact_pass_fused(logits, behavior_logits, token_ids, kind, *, group, temperature):
    """`_exact_pass` from the Triton kernels: one read of both shards (kernels/triton_stats.py gives the ten
    per-row sums), two more for tv only (its sign(pi - mu) needs the global log Z), the same two collectives.

    With c_y = e^(m_y - log Z_pi), c_x = e^(m_x - log Z_mu), l = log Z_mu - log Z_pi and d = log mu - log pi:
      sum pi y = c_y R1,  kl = sum mu d = c_x (A1 - l Sx),  sum pi (mu - pi) = c_y c_x B - c_y^2 Q,
      rkl = -sum pi d = c_y (C1 + l Sy),  -sum pi^2 d = c_y^2 (C2 + l Q),  sum pi^2 = c_y^2 Q.
    """
    world, rank = _group_info(group)
    width = logits.shape[1]
    start = rank * width
    m_y, s_y, m_x, s_x, r1, a1, b, q, c1, c2 = kernels.exact_partial_sums(logits, behavior_logits,
                                                                         temperature).unbind(1)
    lse = torch.logsumexp(_all_gather(torch.stack([m_y + s_y.log(), m_x + s_x.log()], -1), group, world), dim=0)
    lse_y, lse_x = lse[:, 0], lse[:, 1]
    cy, cx, gap = (m_y - lse_y).exp(), (m_x - lse_x).exp(), lse_x - lse_y
    owned, idx = _owned(token_ids[:, None], start, width)
    cols = [torch.where(owned, logits.gather(1, idx).float() / temperature - lse_y[:, None], 0.0)[:, 0],
            torch.where(owned, behavior_logits.gather(1, idx).float() / temperature - lse_x[:, None], 0.0)[:, 0],
            cy * r1]
    if kind == "kl":
        names, cols = ("kl", "pi_dmu"), cols + [cx * (a1 - gap * s_x), cy * cx * b - cy * cy * q]
    elif kind == "reverse_kl":
        names, cols = ("rkl", "p2l", "p2"), cols + [cy * (c1 + gap * s_y), cy * cy * (c2 + gap * q), cy * cy * q]
    else:
        names, cols = ("abs", "sp2", "sp", "p2"), cols + list(kernels.tv_sums(logits, behavior_logits, lse,
                                                                               temperature).unbind(1))
    packed = _all_reduce(torch.stack(cols, -1), group, world)
    out = {"lse": lse_y, "lse_mu": lse_x}
    out.update({name: packed[:, j] for j, name in enumerate(("lp_k", "lm_k", "ent") + names)})
    return out


def _logprob_backward(logits, token_ids, lse, grad_out, *, group, temperature, chunk_size, out=None):
    """d/dz_r sum_t g_t log pi_t(k_t) = g (onehot_r(k) - pi_r) / temperature, recomputed chunk by chunk (by
    the fused kernel, one read and one write, for CUDA logits). out: where to write it on the torch path (may be the
    logits themselves: each block of rows is read before it is written)."""
    _, rank = _group_info(group)
    T, width = logits.shape
    if kernels.fused_available(logits):
        owned, idx = _owned(token_ids, rank * width, width)
        return kernels.logprob_grad(logits, torch.where(owned, idx, -1), lse, grad_out, temperature)
    dtype = _compute_dtype(logits)
    rows = min(_chunk_rows(chunk_size, logits), _sub_rows(logits))  # no collectives: cache-sized chunks
    grad = torch.empty_like(logits) if out is None else out

    def block(c0, c1, scratch):
        z, g = logits[c0:c1], grad[c0:c1]
        buf = g if g.dtype == dtype else scratch.get("g", z.shape[0])
        # pi = exp((z - T lse) / T), computed from z directly (a mixed-dtype sub, no upcast copy of z)
        torch.sub(z, lse[c0:c1, None] * temperature, out=buf)
        if temperature != 1.0:
            buf.div_(temperature)
        buf.exp_()
        owned, idx = _owned(token_ids[c0:c1], rank * width, width)
        buf.scatter_add_(1, idx[:, None], -owned.to(buf.dtype)[:, None])  # pi - onehot(k), no host sync
        torch.mul(buf, (grad_out[c0:c1].to(dtype) / -temperature)[:, None], out=g)

    _for_blocks(0, T, rows, block, _scratches(rows, width, dtype, logits))
    return grad


def _logprob_entropy_backward(logits, token_ids, lse, entropy, grad_logp, grad_entropy, *, group, temperature,
                              chunk_size, out=None):
    """d/dz_r sum_t (g_t log pi_t(k_t) + h_t H_t) = -(pi_r (g + h (log pi_r + H)) - g onehot_r(k)) / temperature,
    recomputed chunk by chunk from the shard, log Z and H (dH/dz_r = -(pi_r / T)(log pi_r + H); 0 log 0 = 0: a -inf
    logit gets no gradient). Plain torch on every device (the fused kernel covers log pi(k) alone), in place on two
    chunk-sized buffers (what `plan.pdm_bytes` counts): b = log pi, p = e^b, b = h (p b) + p (g + h H). out: where
    to write it (may be the logits themselves: each block of rows is read into b before it is written)."""
    _, rank = _group_info(group)
    T, width = logits.shape
    dtype = _compute_dtype(logits)
    rows = min(_chunk_rows(chunk_size, logits), _sub_rows(logits))  # no collectives: cache-sized chunks
    grad = torch.empty_like(logits) if out is None else out
    g_all = grad_logp.to(dtype) if grad_logp is not None else torch.zeros(T, dtype=dtype, device=logits.device)
    h_all = grad_entropy.to(dtype)
    c_all = g_all + h_all * entropy.to(dtype)  # g + h H, per row

    def block(c0, c1, scratch):
        z = logits[c0:c1]
        b, p = scratch.get("b", z.shape[0]), scratch.get("p", z.shape[0])
        torch.sub(z, lse[c0:c1, None] * temperature, out=b)  # mixed-dtype sub: no upcast copy of z
        b.div_(temperature)  # log pi, -inf where z is
        torch.exp(b, out=p)
        b.mul_(p).nan_to_num_(nan=0.0)  # p log p, 0 log 0 = 0
        b.mul_(h_all[c0:c1, None]).addcmul_(p, c_all[c0:c1, None])
        owned, idx = _owned(token_ids[c0:c1], rank * width, width)
        b.scatter_add_(1, idx[:, None], -(owned.to(dtype) * g_all[c0:c1])[:, None])  # no host sync
        torch.mul(b, -1.0 / temperature, out=grad[c0:c1])

    _for_blocks(0, T, rows, block, _scratches(rows, width, dtype, logits))
    return grad


class _VocabParallelSupportStats(torch.autograd.Function):
    """Forward: `_support_pass`. Outputs log pi(k) (support column 0) and, with need_entropy, H; both differentiable.
    Backward recomputes softmax from the saved logits shard, log Z and H (no second [T, V_l] tensor is saved): through
    log pi(k) alone by `_logprob_backward` (the fused kernel on CUDA), with an entropy gradient by
    `_logprob_entropy_backward`."""

    @staticmethod
    def forward(ctx, logits, token_ids, support_ids, group, temperature, chunk_size, need_probs, need_entropy):
        lse, logp_sup, ent, rest, q = _support_pass(
            logits, support_ids, group=group, temperature=temperature, chunk_size=chunk_size,
            need_probs=need_probs, need_entropy=need_entropy,
        )
        H = lse - ent if need_entropy else lse.new_empty(0)
        ctx.save_for_backward(logits, token_ids, lse, H)
        ctx.options = (group, temperature, chunk_size)
        ctx.set_materialize_grads(False)  # a None gradient: that output is not in the graph
        extras = [logp_sup, lse] + [t if t is not None else lse.new_empty(0) for t in (rest, q)]
        ctx.mark_non_differentiable(*extras)
        return (logp_sup[:, 0].clone(), H, *extras)

    @staticmethod
    def backward(ctx, grad_logp_k, grad_entropy, *_):
        logits, token_ids, lse, H = ctx.saved_tensors
        group, temperature, chunk_size = ctx.options
        grad = None
        if ctx.needs_input_grad[0] and grad_entropy is not None:
            grad = _logprob_entropy_backward(logits, token_ids, lse, H, grad_logp_k, grad_entropy, group=group,
                                             temperature=temperature, chunk_size=chunk_size)
        elif ctx.needs_input_grad[0] and grad_logp_k is not None:
            grad = _logprob_backward(
                logits, token_ids, lse, grad_logp_k, group=group, temperature=temperature, chunk_size=chunk_size
            )
        return grad, None, None, None, None, None, None, None


def _reverse_kl_backward(logits, ref_logits, lse, lse_ref, kl, grad_out, *, temperature, chunk_size):
    """d/dz_r sum_t g_t KL(pi_t || q_t) = g pi_r (log pi_r - log q_r - KL) / temperature, recomputed chunk by chunk
    from both shards and the two log Z (0 where pi_r = 0: a -inf logit gets no gradient). No collective; two
    chunk-sized buffers."""
    T, width = logits.shape
    dtype = _compute_dtype(logits)
    rows = min(_chunk_rows(chunk_size, logits), _sub_rows(logits))  # no collectives: cache-sized chunks
    grad = torch.empty_like(logits)
    scale = grad_out.to(dtype) / temperature

    def block(c0, c1, scratch):
        b, d = scratch.get("b", c1 - c0), scratch.get("d", c1 - c0)
        torch.sub(logits[c0:c1], lse[c0:c1, None] * temperature, out=b).div_(temperature)  # log pi
        torch.sub(ref_logits[c0:c1], lse_ref[c0:c1, None] * temperature, out=d).div_(temperature)  # log q
        torch.sub(b, d, out=d).sub_(kl[c0:c1, None])  # log pi - log q - KL
        b.exp_()  # pi
        d.mul_(b).masked_fill_(b == 0, 0.0)
        torch.mul(d, scale[c0:c1, None], out=grad[c0:c1])

    _for_blocks(0, T, rows, block, _scratches(rows, width, dtype, logits))
    return grad


class _VocabParallelReverseKL(torch.autograd.Function):
    """Forward: `_exact_pass` of kind reverse_kl (KL(pi || q), two collectives per chunk; the fused kernels on CUDA).
    Backward: `_reverse_kl_backward` from the saved shards and log Z's. Differentiable in the logits only."""

    @staticmethod
    def forward(ctx, logits, ref_logits, group, temperature, chunk_size):
        token_ids = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)  # any id: not read back
        s = _exact_pass(logits, ref_logits, token_ids, "reverse_kl", group=group, temperature=temperature,
                        chunk_size=chunk_size)
        kl = s["rkl"]
        ctx.save_for_backward(logits, ref_logits, s["lse"], s["lse_mu"], kl)
        ctx.options = (temperature, chunk_size)
        return kl.clone()

    @staticmethod
    def backward(ctx, grad_out):
        logits, ref_logits, lse, lse_ref, kl = ctx.saved_tensors
        temperature, chunk_size = ctx.options
        grad = _reverse_kl_backward(logits, ref_logits, lse, lse_ref, kl, grad_out, temperature=temperature,
                                    chunk_size=chunk_size) if ctx.needs_input_grad[0] else None
        return grad, None, None, None, None


# ----------------------------------------------------------------------------------------------------------
# closed forms on the reduced statistics


def _plogq(p: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor:
    """p * log_ratio with 0 log 0 = 0: 0 where p = 0, whatever log_ratio (-inf, NaN of -inf - -inf)."""
    return torch.where(p > 0, p * log_ratio, 0.0)


def _prob_diff(lp: torch.Tensor, lm: torch.Tensor, p: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """p - m from log p, log m: m (r - 1) where r = p / m <= 1, -p (1/r - 1) where r > 1 (expm1 of a non-positive
    log ratio): exact near r = 1, where the mask's sign is decided, and finite when either probability is 0."""
    d = torch.where(lp > lm, -p * torch.expm1(lm - lp), m * torch.expm1(lp - lm))
    return torch.where((p == 0) & (m == 0), 0.0, d)  # both 0: -inf - -inf is NaN


def _topk_terms(logp_sup, rest, q, behavior: BehaviorTopK, kind, tail, vocab_size):
    """D and Ddot / A for the binary and top-K kinds from the reduced support statistics.

    logp_sup [T, 1+K]: log pi at (k, topk_ids); rest = pi mass outside S; q = sum of pi_i^2 outside S.

    Finite for finite (or -inf) logits and a valid BehaviorTopK, by these choices:
    - the engine's log-probs are clamped at 0 (validation tolerates rounding up to 1e-3); one whose exp is 0 in the
      compute dtype (-inf, or SGLang's finfo(float32).min = -3.4e38 for an entry that underflowed) is probability
      0, and 0 log 0 = 0;
    - pi_i - mu_i comes from `_prob_diff` (never inf * 0);
    - tails: both 0 when S covers the vocabulary (|S| = V). Otherwise pi_tail is summed directly over the complement
      (accurate however small, until it underflows) and mu_tail = max(1 - sum_S mu_i, 0) carries a rounding residue
      (~1e-7 in float32); in the logarithm both are clamped at finfo(dtype).tiny, so a pi tail that underflowed to 0
      against a residue in mu's gives ~1e-7 * 87 instead of inf;
    - binary KL: 1 - pi_k is a sum of positives (rest and the other top-K entries), clamped at finfo(dtype).tiny
      in the logarithm; when every other entry underflows (pi_k = 1 in float32) D stays finite, a lower bound of its
      float64 value.
    """
    dtype = logp_sup.dtype
    tiny = torch.finfo(dtype).tiny
    lp_k, lp_top = logp_sup[:, 0], logp_sup[:, 1:]
    lm_k, lm_top = behavior.token_logprobs.to(dtype).clamp(max=0.0), behavior.topk_logprobs.to(dtype).clamp(max=0.0)
    pi_k, pi_top, mu_k, mu_top = lp_k.exp(), lp_top.exp(), lm_k.exp(), lm_top.exp()
    in_top = behavior.topk_ids == behavior.token_ids[:, None]
    w_k = (~in_top.any(-1)).to(dtype)  # the sampled token joins S only when it is not among the top-K
    not_k = (~in_top).to(dtype)
    diff_k, diff_top = _prob_diff(lp_k, lm_k, pi_k, mu_k), _prob_diff(lp_top, lm_top, pi_top, mu_top)
    pi_notk = rest + (pi_top * not_k).sum(-1)  # 1 - pi_k as a sum of positives
    p2_notk = q + (pi_top.square() * not_k).sum(-1)  # ||pi||^2 - pi_k^2
    pidot_k = pi_k * (pi_notk.square() + p2_notk)  # pi_k (1 - 2 pi_k + ||pi||^2)

    if kind == "binary_tv":
        return diff_k.abs(), torch.sign(diff_k) * pidot_k
    if kind == "binary_kl":
        mu_notk = -torch.expm1(lm_k)
        d = _plogq(mu_k, lm_k - lp_k) + _plogq(mu_notk, mu_notk.clamp_min(tiny).log() - pi_notk.clamp_min(tiny).log())
        scale = (pi_notk.square() + p2_notk) / pi_notk.clamp_min(tiny)  # (1-2pi_k+|pi|^2)/(1-pi_k)
        ddot = torch.where(pi_notk > 0, diff_k * scale, 0.0)
        return d, ddot

    covers = (behavior.k + w_k) >= vocab_size  # S is the whole vocabulary: no tail
    pi_tail = torch.where(covers, 0.0, rest)
    mu_tail = torch.where(covers, 0.0, (1.0 - mu_top.sum(-1) - w_k * mu_k).clamp_min(0.0))
    if kind == "topk_kl":
        d = _plogq(mu_top, lm_top - lp_top).sum(-1) + w_k * _plogq(mu_k, lm_k - lp_k)
        d = d + _plogq(mu_tail, mu_tail.clamp_min(tiny).log() - pi_tail.clamp_min(tiny).log())
        head = diff_k - (pi_top * diff_top).sum(-1) - w_k * pi_k * diff_k
        if tail == "proportional":  # exact derivative of the top-K KL itself: Q (mu_tail / pi_tail - 1)
            tail_term = (q / pi_tail.clamp_min(tiny)) * mu_tail - q  # Q <= pi_tail^2: no overflow, 0 without a tail
        else:
            tail_term = pi_tail * (mu_tail - pi_tail)
            if tail == "uniform":
                tail_term = tail_term / (vocab_size - behavior.k - w_k).clamp_min(1.0)
        return d, head + tail_term

    # topk_tv: the TV formula over the categories of S plus one tail bucket. Both tail models give every tail
    # token the sign of (pi_tail - mu_tail) and the tail's total pidot is known exactly, so `tail` is moot.
    d = 0.5 * ((diff_top.abs()).sum(-1) + w_k * diff_k.abs() + (pi_tail - mu_tail).abs())
    p2 = p2_notk + pi_k.square()
    pidot_top = torch.where(in_top, pidot_k[:, None], pi_top * (p2 - pi_k)[:, None] - pi_top.square())
    pidot_tail = pi_tail * (p2 - pi_k) - q
    ddot = 0.5 * (
        (torch.sign(diff_top) * pidot_top).sum(-1)
        + w_k * torch.sign(diff_k) * pidot_k
        + torch.sign(pi_tail - mu_tail) * pidot_tail
    )
    return d, ddot


def _exact_terms(s, kind):
    """D and Ddot / A for the exact kinds from the reduced partial sums of `_exact_pass`."""
    pi_k, mu_k = s["lp_k"].exp(), s["lm_k"].exp()
    if kind == "kl":
        return s["kl"], (pi_k - mu_k) + s["pi_dmu"]
    if kind == "reverse_kl":
        kr = s["rkl"]
        return kr, pi_k * (s["lp_k"] - s["lm_k"] - kr) - s["p2l"] + kr * s["p2"]
    sk = torch.sign(pi_k - mu_k)
    return 0.5 * s["abs"], 0.5 * (sk * pi_k - s["sp2"] + (s["p2"] - pi_k) * s["sp"])


# ----------------------------------------------------------------------------------------------------------
# validation


def _check_logits(logits, name="logits"):
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"{name}: expected a [T, V/tp] tensor, got {shape}")
    if not logits.is_floating_point():
        raise ValueError(f"{name}: expected floating logits (bf16/fp16/fp32/fp64), got {logits.dtype}")


def _check_options(temperature, chunk_size):
    if not (isinstance(temperature, (int, float)) and temperature > 0 and temperature < float("inf")):
        raise ValueError(f"temperature: must be a finite number > 0, got {temperature!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size: must be None or an integer >= 1, got {chunk_size!r}")


def _check_token_ids(token_ids, logits, name="token_ids"):
    """Shape, dtype and device only: the values are checked at the boundary (no host sync here)."""
    T = logits.shape[0]
    if not isinstance(token_ids, torch.Tensor) or token_ids.shape != (T,):
        shape = tuple(token_ids.shape) if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__
        raise ValueError(f"{name}: expected shape [{T}] matching the logits rows, got {shape}")
    if token_ids.is_floating_point() or token_ids.dtype == torch.bool:
        raise ValueError(f"{name}: expected integer ids, got {token_ids.dtype}")
    _check_device(name, token_ids, logits)


def _check_device(name, t, logits):
    if t.device != logits.device:
        raise ValueError(f"{name}: on {t.device}, but the logits are on {logits.device}; move it there once per step")


def _check_kind(kind, behavior, tail):
    if kind not in KINDS:
        raise ValueError(f"kind: unknown divergence {kind!r}; expected one of {', '.join(KINDS)}")
    if tail not in TAILS:
        raise ValueError(f"tail: unknown tail model {tail!r}; expected one of {', '.join(TAILS)}")
    if kind in TOPK_KINDS and not isinstance(behavior, BehaviorTopK):
        raise ValueError(f"behavior: kind {kind!r} needs a BehaviorTopK, got {type(behavior).__name__}")
    if kind in EXACT_KINDS and not isinstance(behavior, BehaviorLogits):
        raise ValueError(
            f"behavior: kind {kind!r} is a full-vocabulary divergence and needs BehaviorLogits (mu's logits shard), "
            f"got {type(behavior).__name__}; with only top-K log-probs use one of {', '.join(TOPK_KINDS)}"
        )


# ----------------------------------------------------------------------------------------------------------
# public API


def token_logprobs(logits, token_ids, *, group=None, temperature=1.0, chunk_size=None) -> torch.Tensor:
    """log pi(k) = z_k / temperature - log sum_i exp(z_i / temperature), from the local logits shard.

    logits [T, V/tp] (bf16/fp16/fp32/fp64), token_ids [T] global ids on the logits' device. Returns [T] in float32
    (float64 for float64 logits), differentiable w.r.t. logits: d/dz = (onehot(k) - pi) / temperature, recomputed
    in backward from the saved shard and log Z. An id outside [0, V) gives NaN (checked without a host sync).
    """
    _check_logits(logits)
    _check_options(temperature, chunk_size)
    _check_token_ids(token_ids, logits)
    return _token_stats(logits, token_ids, group, float(temperature), chunk_size, need_entropy=False)[0]


def _nan_out_of_range(logp, token_ids, vocab_size: int) -> torch.Tensor:
    """log pi(k) [T], NaN where k is outside [0, V) (the passes would read some other column, or none: log 1);
    elementwise, no host sync; the gradient flows where k is in range."""
    in_range = (token_ids >= 0) & (token_ids < vocab_size)
    return torch.where(in_range, logp, float("nan"))


def _token_stats(logits, token_ids, group, temperature, chunk_size, *, need_entropy):
    """(log pi(k), H or an empty tensor), differentiable: NaN for an id outside [0, V) (no host sync)."""
    world, _ = _group_info(group)
    logp, H, *_ = _VocabParallelSupportStats.apply(logits, token_ids, token_ids[:, None], group, temperature,
                                                   chunk_size, need_entropy, need_entropy)
    return _nan_out_of_range(logp, token_ids, logits.shape[1] * world), H


def support_logprobs(logits, support_ids, *, group=None, temperature=1.0, chunk_size=None) -> torch.Tensor:
    """log pi(j) at every id j of support_ids [T, J] (global ids; e.g. the behavior top-K), from the local logits
    shard: [T, J] float32 (float64 for float64 logits), no gradient. The same two collectives per chunk as
    `token_logprobs`; no rank gathers the vocabulary."""
    _check_logits(logits)
    _check_options(temperature, chunk_size)
    _check_device("support_ids", support_ids, logits)
    with torch.no_grad():
        _, logp, _, _, _ = _support_pass(logits, support_ids, group=group, temperature=float(temperature),
                                         chunk_size=chunk_size, need_probs=False, need_entropy=False)
    return logp


def entropy(logits, *, group=None, temperature=1.0, chunk_size=None) -> torch.Tensor:
    """H(pi) = -sum_i pi_i log pi_i = log Z - sum_i pi_i z_i / temperature, per row [T], with 0 log 0 = 0: -inf
    logits (masked entries) add nothing, H is that of pi over the finite entries. Differentiable w.r.t. logits:
    dH/dz_i = -(pi_i / temperature)(log pi_i + H), recomputed in backward from the shard, log Z and H (one more read
    of the shard, no collective)."""
    _check_logits(logits)
    _check_options(temperature, chunk_size)
    ids = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)  # a support column H does not use
    return _token_stats(logits, ids, group, float(temperature), chunk_size, need_entropy=True)[1]


def policy_statistics(
    logits, behavior: Behavior, kind: str, *, tail="aggregated", group=None, temperature=1.0, chunk_size=None,
    entropy_grad: bool = False,
) -> PolicyStatistics:
    """log pi(k) (differentiable), entropy, D and Ddot / A of `kind` in one pass (two collectives per chunk; for
    the exact kinds a second pass, and two more, only when logits require a gradient).

    This is what a loss calls: the divergence and the predicted change are detached (masks are built under
    no_grad), the gradient flows through log pi(k) and H (the exact kinds' H carries one only with entropy_grad,
    which makes their second pass compute it: an entropy bonus). See `divergence` and `predicted_divergence_change`
    for the formulas.

    `behavior` must be on the logits' device and already validated (`behavior.validate(V)` once, where the
    engine's output is parsed): here only its shapes, dtypes and devices are checked, without a host sync.
    """
    _check_logits(logits)
    _check_options(temperature, chunk_size)
    _check_kind(kind, behavior, tail)
    world, _ = _group_info(group)
    T, vocab_size = logits.shape[0], logits.shape[1] * world
    temperature = float(temperature)
    if behavior.num_tokens != T:
        raise ValueError(f"behavior: {behavior.num_tokens} tokens, but logits have {T} rows")
    behavior.check_shapes(vocab_size)
    _check_device("behavior", behavior.token_ids, logits)
    if isinstance(behavior, BehaviorLogits):
        if behavior.logits.shape != logits.shape:
            raise ValueError(
                f"behavior.logits: shape {tuple(behavior.logits.shape)} must match logits {tuple(logits.shape)}"
            )
        with torch.no_grad():
            s = _exact_pass(
                logits.detach(), behavior.logits.detach(), behavior.token_ids, kind,
                group=group, temperature=temperature, chunk_size=chunk_size,
            )
            d, ddot = _exact_terms(s, kind)
        logp, ent = _nan_out_of_range(s["lp_k"], behavior.token_ids, vocab_size), s["lse"] - s["ent"]
        if torch.is_grad_enabled() and logits.requires_grad:  # a second pass only when a gradient is wanted
            # with entropy_grad the pass computes H too (the entropy sums over the shard)
            logp, H = _token_stats(logits, behavior.token_ids, group, temperature, chunk_size,
                                   need_entropy=entropy_grad)
            ent = H if entropy_grad else ent
        return PolicyStatistics(logp, s["lm_k"], ent, d, ddot)

    support = torch.cat([behavior.token_ids[:, None], behavior.topk_ids], dim=-1)
    logp, ent, logp_sup, lse, rest, q = _VocabParallelSupportStats.apply(
        logits, behavior.token_ids, support, group, temperature, chunk_size, True, True
    )
    with torch.no_grad():
        d, ddot = _topk_terms(logp_sup, rest, q, behavior, kind, tail, vocab_size)
    logp = _nan_out_of_range(logp, behavior.token_ids, vocab_size)  # as token_logprobs: never log 1
    return PolicyStatistics(logp, behavior.token_logprobs.to(logp.dtype).clamp(max=0.0), ent, d, ddot)


def divergence(logits, behavior: Behavior, kind: str, *, group=None, temperature=1.0, chunk_size=None):
    """D(mu, pi) per token [T] (no gradient), mu the behavior policy, pi = softmax(logits / temperature).

    With a BehaviorTopK (S = TopK(mu) u {k}, tails t = 1 - sum_S):
      binary_tv  |pi_k - mu_k|
      binary_kl  mu_k log(mu_k/pi_k) + (1-mu_k) log((1-mu_k)/(1-pi_k))
      topk_kl    sum_S mu_i log(mu_i/pi_i) + mu_t log(mu_t/pi_t)
      topk_tv    1/2 (sum_S |pi_i - mu_i| + |pi_t - mu_t|)
    With a BehaviorLogits (full vocabulary): kl = KL(mu||pi), reverse_kl = KL(pi||mu), tv = 1/2 sum |pi - mu|.
    """
    with torch.no_grad():
        return policy_statistics(
            logits, behavior, kind, group=group, temperature=temperature, chunk_size=chunk_size
        ).divergence


def kl_to_reference(logits, ref_logits, *, group=None, temperature=1.0, chunk_size=None) -> torch.Tensor:
    """KL(pi || pi_ref) per token [T], exact over the whole vocabulary, differentiable in `logits` (not in
    ref_logits): pi = softmax(logits / T), pi_ref = softmax(ref_logits / T), both [T, V/tp] shards of one layout.

      KL_t = sum_i pi_i (log pi_i - log pi_ref_i),    dKL_t / dz_i = (pi_i / T) (log pi_i - log pi_ref_i - KL_t)

    Forward: one read of both shards and two collectives per chunk (the exact divergences' pass); backward: one
    more read of both, no collective. Saves both shards for the backward (the caller's ref_logits stays alive until
    then)."""
    _check_logits(logits)
    _check_logits(ref_logits, "ref_logits")
    _check_options(temperature, chunk_size)
    if ref_logits.shape != logits.shape:
        raise ValueError(f"ref_logits: expected the logits' shape {tuple(logits.shape)}, got {tuple(ref_logits.shape)}")
    _check_device("ref_logits", ref_logits, logits)
    return _VocabParallelReverseKL.apply(logits, ref_logits.detach(), group, temperature, chunk_size)


def predicted_divergence_change(
    logits, behavior: Behavior, kind: str, *, tail="aggregated", group=None, temperature=1.0, chunk_size=None
):
    """Ddot / A [T]: the first-order change of D along the policy-gradient step g = A (e_k - pi) on the logits,
    for a unit positive advantage (DESIGN.md 2.3). With pidot_i = pi_i (delta_ik - pi_i - pi_k + ||pi||^2):

      kl          (pi_k - mu_k) + sum_i pi_i (mu_i - pi_i)
      topk_kl     (pi_k - mu_k) + sum_S pi_i (mu_i - pi_i) + tail term, the tail term being
                    aggregated:   pi_t (mu_t - pi_t)              (the tail as one token)
                    uniform:      pi_t (mu_t - pi_t) / (V - |S|)   (a flat tail)
                    proportional: Q (mu_t / pi_t - 1), Q = sum_{i not in S} pi_i^2
                                  (mu proportional to pi on the tail; the exact derivative of topk_kl itself)
      reverse_kl  pi_k (l_k - Kr) - sum_i pi_i^2 (l_i - Kr),  l = log(pi/mu), Kr = KL(pi||mu)
      tv          1/2 [s_k pi_k - sum_i s_i pi_i^2 + (||pi||^2 - pi_k) sum_i s_i pi_i],  s = sign(pi - mu)
      topk_tv     1/2 [sum_S s_i pidot_i + s_t pidot_t],  pidot_t = -sum_S pidot_i (`tail` has no effect)
      binary_tv   sign(pi_k - mu_k) pidot_k
      binary_kl   (pi_k - mu_k) pidot_k / (pi_k (1 - pi_k))   (sign = sign(r - 1): PDM on binary is DPPO)
    """
    with torch.no_grad():
        return policy_statistics(
            logits, behavior, kind, tail=tail, group=group, temperature=temperature, chunk_size=chunk_size
        ).predicted_change
