"""The output layer fused with the vocab-parallel statistics: the logits shard [T, V/tp] is never materialized
(DESIGN.md section 3.1).

hidden [T, H] is what the output layer reads (under sequence parallelism gathered over TP, by the caller, with
megatron's region op: `models.fuse_output_layer`), weight [V_l, H] this rank's shard of the output layer (the
embedding's when tied). Rows go `chunk_rows` at a time; for each chunk c:

    z_c = hidden_c weight^T                               [R, V_l] in hidden's dtype (the output layer's GEMM)
    log Z, log pi(k), H, D, Ddot of `policy_statistics`    two collectives (two more for a reference's KL)
    l_c = token_loss(rows, stats_c, kl_c)                 the caller's loss on these rows
    g = dl_c / dlog pi(k),  h = dl_c / dH,  u = dl_c / dKL      autograd on [R]-sized tensors
    dz_c = (g (onehot(k) - pi) - h pi (log pi + H) + u pi (log pi - log pi_ref - KL)) / temperature
    grad_hidden_c = dz_c weight,   grad_weight += dz_c^T hidden_c   (float32 sums)

The gradient is taken in the forward, from each chunk's logits while they exist: three GEMMs per chunk as in the
unfused path (forward, input gradient, weight gradient), none recomputed. What this needs of the loss: given the
statistics, it is a sum over tokens of terms of that token (every loss of `objectives.loss` is: its sequence-level
parts, corrections and aggregation weights, do not depend on pi). What lives across chunks: grad_hidden [T, H] and
grad_weight [V_l, H] in float32 (the weight's size, whatever T), which the backward scales by the loss's incoming
gradient (the loss scale) and adds to the weight's `main_grad` (megatron's DDP buffer) when it has one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .behavior import BehaviorLogits, BehaviorTopK
from .core import (
    PolicyStatistics,
    _check_device,
    _check_kind,
    _check_options,
    _check_token_ids,
    _compute_dtype,
    _exact_pass,
    _exact_terms,
    _group_info,
    _logprob_backward,
    _logprob_entropy_backward,
    _reverse_kl_backward,
    _support_pass,
    _topk_terms,
)

# Rows per chunk: as many as a float32 [rows, V_l] block of this size holds. A chunk holds a few such blocks (the
# logits, their gradient, the statistics' work buffers), so the peak is O(this), whatever T. The floor is the weight
# gradient: each chunk reads and writes the whole float32 [V_l, H] buffer (2 x 297 MiB at V_l = 18,992, H = 4,096),
# which small chunks pay once per few rows. Measured on 2 CPU cores at that shape, T = 4,096 (the unfused path 6.6 s):
# 441 rows (32 MiB) 7.6 s, 1,024 rows 6.8 s, 2,048 rows 6.7 s. On CUDA (not measured yet) the same read and write
# of the buffer costs about a third of a chunk's GEMMs at this size (H100: ~0.3 ms of HBM traffic against ~0.7 ms of
# bf16 GEMMs at V_l = 37,984, H = 2,048): a larger budget trades memory for that.
FUSED_CHUNK_BYTES = {"cpu": 128 * 2**20, "cuda": 128 * 2**20}

TokenLoss = Callable[[slice, PolicyStatistics, "torch.Tensor | None"], "tuple[torch.Tensor, object]"]


class FusedOutput(NamedTuple):
    """What `fused_output_loss` returns.

    loss          the sum of the chunks' losses, a scalar differentiable in hidden and weight
    stats         [T] statistics, detached (without a behavior: logprobs, and entropy when asked, only)
    kl_reference  [T] KL(pi || pi_ref), detached, with a reference; else None
    extras        what token_loss returned beside each chunk's loss, in chunk order
    """

    loss: torch.Tensor
    stats: PolicyStatistics
    kl_reference: torch.Tensor | None
    extras: list


def default_chunk_rows(vocab_shard: int, device_type: str) -> int:
    """Rows per chunk by default: as many as FUSED_CHUNK_BYTES of float32 logits hold on that device (at least 16)."""
    return max(16, FUSED_CHUNK_BYTES["cuda" if device_type == "cuda" else "cpu"] // (4 * vocab_shard))


def fused_chunk_rows(chunk_rows: int | None, weight: torch.Tensor, num_rows: int) -> int:
    """Rows per chunk: `chunk_rows`, or `default_chunk_rows` for the weight's shard and device; at most num_rows."""
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(weight.shape[0], weight.device.type)
    return max(1, min(chunk_rows, num_rows))


def _check_hidden(hidden, weight, name="hidden", weight_name="weight"):
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or not hidden.is_floating_point():
        shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise ValueError(f"{name}: expected floating hidden states [T, H], got {shape}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"{weight_name}: expected the output layer's shard [V/tp, {hidden.shape[1]}], got {shape}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"{weight_name}: dtype {weight.dtype}, but {name} is {hidden.dtype} (the output layer's "
                         "GEMM takes one dtype)")
    if weight.device != hidden.device:
        raise ValueError(f"{weight_name}: on {weight.device}, but {name} is on {hidden.device}")


def _check_chunk_rows(chunk_rows):
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"chunk_rows: must be None or an integer >= 1, got {chunk_rows!r}")


def _input_grad(dz: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dz weight, the GEMM in the weight's dtype (dz, in the logits' dtype or float32 for fp16, cast to it). fp16
    rows are scaled to a maximum of 1 first: these gradients carry no loss scale yet, and their small entries would
    flush to zero in fp16."""
    if weight.dtype == torch.float16:
        scale = dz.abs().amax(1, keepdim=True).float().clamp_min(torch.finfo(torch.float32).tiny)
        return ((dz / scale).to(weight.dtype) @ weight).float().mul_(scale)
    return dz.to(weight.dtype) @ weight


def _bf16_weight_grad_gemm(x: torch.Tensor) -> bool:
    """Whether a chunk's weight gradient runs as a bf16 GEMM: on CUDA, for bf16 hidden states."""
    return x.is_cuda and x.dtype == torch.bfloat16


def _accumulate_weight_grad(grad_weight: torch.Tensor, dz: torch.Tensor, x: torch.Tensor) -> None:
    """grad_weight += dz^T x, summed across chunks in grad_weight's float32 (float64). bf16 on CUDA: the GEMM in bf16
    (float32 sums inside it), its [V_l, H] result (a transient of the weight's size) rounded to bf16 once per chunk,
    as megatron's output layer computes its weight gradient without gradient-accumulation fusion; elsewhere (CPU,
    fp16, fp32) a float32 GEMM on float32 copies of the chunk's rows."""
    if _bf16_weight_grad_gemm(x):
        grad_weight.add_(dz.to(x.dtype).t() @ x)
    else:
        grad_weight.addmm_(dz.t().to(grad_weight.dtype), x.to(grad_weight.dtype))


def _chunk_statistics(z, rows, behavior, kind, tail, token_ids, group, temperature, vocab_size, need_entropy):
    """(log pi(k), H or None, log mu(k), D, Ddot, lse) of one chunk of logits rows (no gradient)."""
    if isinstance(behavior, BehaviorLogits):
        s = _exact_pass(z, behavior.logits[rows], token_ids, kind, group=group, temperature=temperature,
                        chunk_size=None)
        d, ddot = _exact_terms(s, kind)
        return s["lp_k"], s["lse"] - s["ent"], s["lm_k"], d, ddot, s["lse"]
    if behavior is None:
        lse, logp_sup, ent, _, _ = _support_pass(z, token_ids[:, None], group=group, temperature=temperature,
                                                 chunk_size=None, need_probs=need_entropy,
                                                 need_entropy=need_entropy)
        return logp_sup[:, 0], (lse - ent) if need_entropy else None, None, None, None, lse
    part = BehaviorTopK(*(t[rows] for t in behavior._tensors()))
    support = torch.cat([token_ids[:, None], part.topk_ids], dim=-1)
    lse, logp_sup, ent, rest, q = _support_pass(z, support, group=group, temperature=temperature, chunk_size=None,
                                                need_probs=True, need_entropy=True)
    d, ddot = _topk_terms(logp_sup, rest, q, part, kind, tail, vocab_size)
    mu = part.token_logprobs.to(logp_sup.dtype).clamp(max=0.0)
    return logp_sup[:, 0], lse - ent, mu, d, ddot, lse


def fused_output_loss(
    hidden: torch.Tensor, weight: torch.Tensor, token_loss: TokenLoss, *, token_ids: torch.Tensor | None = None,
    behavior: BehaviorTopK | BehaviorLogits | None = None, kind: str | None = None, tail: str = "aggregated",
    reference: tuple[torch.Tensor, torch.Tensor] | None = None, group=None, temperature: float = 1.0,
    chunk_rows: int | None = None, entropy: bool = False,
) -> FusedOutput:
    """A loss over the logits z = hidden weight^T from hidden states, chunk by chunk, without the logits.

    token_loss(rows, stats, kl) -> (loss of those rows, anything) is called once per chunk: stats a
    `PolicyStatistics` of the chunk (log pi(k) and H are leaves to differentiate; D, Ddot and log mu(k) with a
    behavior), kl the chunk's KL(pi || pi_ref) with a reference (a leaf too). The returned loss is the sum of the
    chunks', with the gradient in hidden and weight of the loss these statistics define (module docstring).

    token_ids [T] (the behavior's when it is given), behavior/kind/tail as `policy_statistics` (a BehaviorTopK or,
    for the exact kinds, BehaviorLogits with mu's logits shard [T, V_l]); reference (ref_hidden [T, H], ref_weight
    [V_l, H]): pi_ref's logits are ref_hidden ref_weight^T, computed per chunk too; entropy: compute H without a
    behavior (with one it is always there). Without a gradient to take (no_grad, or inputs that do not require
    one) only the statistics are computed.
    """
    _check_hidden(hidden, weight)
    _check_options(temperature, None)
    _check_chunk_rows(chunk_rows)
    temperature = float(temperature)
    world, _ = _group_info(group)
    T, vocab_size = hidden.shape[0], weight.shape[0] * world
    if behavior is not None:
        _check_kind(kind, behavior, tail)
        if behavior.num_tokens != T:
            raise ValueError(f"behavior: {behavior.num_tokens} tokens, but hidden has {T} rows")
        behavior.check_shapes(vocab_size)
        if isinstance(behavior, BehaviorLogits) and behavior.logits.shape != (T, weight.shape[0]):
            raise ValueError(f"behavior.logits: shape {tuple(behavior.logits.shape)}, expected [{T}, "
                             f"{weight.shape[0]}] (this rank's vocabulary shard)")
        _check_device("behavior", behavior.token_ids, hidden)
        token_ids = behavior.token_ids
    elif token_ids is None:
        raise ValueError("token_ids: required without a behavior")
    _check_token_ids(token_ids, hidden)
    if reference is not None:
        _check_hidden(reference[0], reference[1], "ref_hidden", "ref_weight")
        if reference[0].shape[0] != T or reference[1].shape != weight.shape:
            raise ValueError(f"reference: ref_hidden {tuple(reference[0].shape)} and ref_weight "
                             f"{tuple(reference[1].shape)} must match hidden {tuple(hidden.shape)} and weight "
                             f"{tuple(weight.shape)}")
        _check_device("ref_hidden", reference[0], hidden)

    dtype = _compute_dtype(hidden)
    train = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    x, w = hidden.detach(), weight.detach()
    grad_hidden = torch.zeros(T, x.shape[1], dtype=dtype, device=x.device) if train else None
    grad_weight = torch.zeros(w.shape, dtype=dtype, device=x.device) if train and weight.requires_grad else None
    in_range = (token_ids >= 0) & (token_ids < vocab_size)
    cols = {name: [] for name in ("logp", "H", "mu", "d", "ddot", "kl")}
    extras, losses = [], []
    rows_per_chunk = fused_chunk_rows(chunk_rows, w, T)
    for c0 in range(0, T, rows_per_chunk) if T else [0]:  # no rows: one empty chunk, so that token_loss says what
        rows = slice(c0, min(c0 + rows_per_chunk, T))      # its (empty) results look like
        tok = token_ids[rows]
        with torch.no_grad():
            z = x[rows] @ w.t()  # [R, V_l]: the only logits that exist, one chunk at a time
            # fp16 gradients without the loss scale would underflow: the chunk's math runs on a float32 copy
            z = z.float() if z.dtype == torch.float16 else z
            logp, H, mu, d, ddot, lse = _chunk_statistics(z, rows, behavior, kind, tail, tok, group, temperature,
                                                          vocab_size, entropy)
            logp = torch.where(in_range[rows], logp, float("nan"))
            kl = zr = None
            if reference is not None:
                zr = reference[0][rows].detach() @ reference[1].detach().t()
                zr = zr.float() if zr.dtype == torch.float16 else zr
                s = _exact_pass(z, zr, tok, "reverse_kl", group=group, temperature=temperature, chunk_size=None)
                kl, lse_ref = s["rkl"], s["lse_mu"]
        leaves = [t.detach().requires_grad_(train) if t is not None else None for t in (logp, H, kl)]
        with torch.enable_grad() if train else torch.no_grad():
            loss, extra = token_loss(rows, PolicyStatistics(leaves[0], mu, leaves[1], d, ddot), leaves[2])
        losses.append(loss.detach())
        extras.append(extra)
        for name, t in zip(cols, (logp, H, mu, d, ddot, kl), strict=True):
            cols[name].append(t)
        if not train or not loss.requires_grad:
            continue
        wanted = [t for t in leaves if t is not None]
        grads = dict(zip([id(t) for t in wanted], torch.autograd.grad(loss, wanted, allow_unused=True),
                         strict=True))
        g, h, u = (grads.get(id(t)) if t is not None else None for t in leaves)
        with torch.no_grad():
            # dz in z's dtype, as the unfused path has the logits' gradient (float32 for fp16: z is upcast); on the
            # torch path it overwrites z (each block of rows is read before it is written: one [R, V_l] buffer
            # less), so the KL term, which reads z too, is taken first
            dz_kl = _reverse_kl_backward(z, zr, lse, lse_ref, kl, u, temperature=temperature, chunk_size=None) \
                if u is not None else None
            if h is not None:
                dz = _logprob_entropy_backward(z, tok, lse, H, g, h, group=group, temperature=temperature,
                                               chunk_size=None, out=z)
            elif g is not None:
                dz = _logprob_backward(z, tok, lse, g, group=group, temperature=temperature, chunk_size=None, out=z)
            else:
                dz = z.zero_()
            if dz_kl is not None:
                dz += dz_kl
            grad_hidden[rows] = _input_grad(dz, w)
            if grad_weight is not None:
                _accumulate_weight_grad(grad_weight, dz, x[rows])
            del z, dz, zr
    cat = {name: torch.cat(v) if v[0] is not None else None for name, v in cols.items()}
    stats = PolicyStatistics(cat["logp"], cat["mu"], cat["H"], cat["d"], cat["ddot"])
    total = torch.stack(losses).sum()
    if train:
        total = _PrecomputedGradients.apply(hidden, weight, total, grad_hidden, grad_weight)
    return FusedOutput(total, stats, cat["kl"] if reference is not None else None, extras)


class _PrecomputedGradients(torch.autograd.Function):
    """Attaches gradients computed in the forward to a scalar loss: backward returns grad_out x each (grad_out is
    the loss scale under fp16, else 1). The weight's goes into its `main_grad` when it has one (megatron's DDP
    float32 buffer), as megatron's gradient-accumulation fusion does, with its protocol for DDP's hook (which must
    run, to count the weight ready under overlap_grad_reduce): a weight also used elsewhere in this graph (a tied
    embedding on the same stage: `zero_out_wgrad`) gets a zero gradient, so that the hook adds just what the other
    use put in .grad; any other gets an unfilled one and `grad_added_to_main_grad`, so that the hook adds nothing.
    Without megatron's DDP (no `grad_added_to_main_grad`), None beside main_grad, else the gradient itself."""

    @staticmethod
    def forward(ctx, hidden, weight, loss, grad_hidden, grad_weight):
        ctx.grads = (grad_hidden, grad_weight, weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, grad_weight, weight = ctx.grads
        ctx.grads = None  # a second backward is an error, as for any freed graph
        g = grad_out.to(grad_hidden.dtype)
        dx = grad_hidden.mul_(g).to(ctx.dtypes[0])
        dw = None
        if grad_weight is not None:
            grad_weight.mul_(g)
            main_grad = getattr(weight, "main_grad", None)
            if main_grad is None:
                dw = grad_weight.to(ctx.dtypes[1])
            else:
                main_grad.add_(grad_weight)
                if hasattr(weight, "grad_added_to_main_grad"):  # megatron's DDP
                    if getattr(weight, "zero_out_wgrad", False):
                        dw = torch.zeros_like(weight)
                    else:
                        dw = torch.empty_like(weight)  # never read: the hook skips it
                        weight.grad_added_to_main_grad = True
        return dx, dw, None, None, None


def output_logprobs(hidden, weight, token_ids, *, support_ids=None, group=None, temperature=1.0,
                    chunk_rows=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log pi(k) [T], log pi at support_ids [T, J] or None) from hidden states, chunk by chunk, no gradient: the
    fused `token_logprobs` / `support_logprobs` for forward-only passes (log pi_old, log pi_ref)."""
    _check_hidden(hidden, weight)
    _check_options(temperature, None)
    _check_chunk_rows(chunk_rows)
    _check_token_ids(token_ids, hidden)
    world, _ = _group_info(group)
    vocab_size = weight.shape[0] * world
    ids = token_ids[:, None] if support_ids is None else torch.cat([token_ids[:, None], support_ids], dim=-1)
    _check_device("support_ids", ids, hidden)
    out = []
    rows_per_chunk = fused_chunk_rows(chunk_rows, weight, hidden.shape[0])
    with torch.no_grad():
        for c0 in range(0, hidden.shape[0], rows_per_chunk):
            z = hidden[c0:c0 + rows_per_chunk] @ weight.t()
            out.append(_support_pass(z, ids[c0:c0 + rows_per_chunk], group=group, temperature=float(temperature),
                                     chunk_size=None, need_probs=False, need_entropy=False)[1])
    lp = torch.cat(out) if out else torch.empty(0, ids.shape[1], dtype=_compute_dtype(hidden), device=hidden.device)
    in_range = (token_ids >= 0) & (token_ids < vocab_size)
    return torch.where(in_range, lp[:, 0], float("nan")), (lp[:, 1:] if support_ids is not None else None)


def precomputed_gradients(hidden: torch.Tensor, weight: torch.Tensor, loss: torch.Tensor, grad_hidden: torch.Tensor,
                          grad_weight: torch.Tensor) -> torch.Tensor:
    """`loss` (a detached scalar) whose backward gives hidden grad_out x grad_hidden and the weight
    grad_out x grad_weight, the weight's into its main_grad under megatron's DDP (`_PrecomputedGradients`): a second
    loss term computed chunk by chunk beside `fused_output_loss` (on-policy distillation's) adds its gradients the
    same way, so neither is dropped."""
    return _PrecomputedGradients.apply(hidden, weight, loss, grad_hidden, grad_weight)
