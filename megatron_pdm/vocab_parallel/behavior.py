"""The behavior policy mu as the rollout engine (or a second model) reports it.

`BehaviorTopK` is what SGLang / vLLM / the embedded engine return per generated token: log mu(k) of the
sampled token and the top-K ids and log-probs of the distribution it was sampled from.
`BehaviorLogits` is mu's own logits shard, sharded over the vocabulary exactly like the training logits.

Validate once, at the boundary: `validate(vocab_size)` checks the values (ids in range, log-probs, distinct top-K
ids, mass) and costs host syncs, so call it where the engine's output is parsed (once per rollout), not per
micro-batch. The math (`policy_statistics`) only runs `check_shapes`, which reads no tensor values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{field}: {msg}")


def _first_bad_row(bad: torch.Tensor) -> int:
    return int(bad.reshape(bad.shape[0], -1).any(-1).nonzero()[0, 0])


@dataclass(frozen=True)
class BehaviorTopK:
    """Rollout engine view of mu at T positions.

    token_ids      [T]    long   sampled token k
    token_logprobs [T]    float  log mu(k)
    topk_ids       [T, K] long   TopK(mu, K), distinct per row (any order)
    topk_logprobs  [T, K] float  log mu at topk_ids
    """

    token_ids: torch.Tensor
    token_logprobs: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def k(self) -> int:
        return self.topk_ids.shape[1]

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> BehaviorTopK:
        """The same view with every tensor on `device` (`Tensor.to`: no copy for those already there). Move the
        step's behavior to the logits' device once, before the micro-batch loop: a host-to-device copy of pageable
        memory waits for the stream."""
        return BehaviorTopK(*(t.to(device, non_blocking=non_blocking) for t in self._tensors()))

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return self.token_ids, self.token_logprobs, self.topk_ids, self.topk_logprobs

    def check_shapes(self, vocab_size: int) -> BehaviorTopK:
        """Raise ValueError naming the field unless shapes, dtypes and devices fit a top-K view over `vocab_size`
        ids with 1 <= K <= vocab_size. Reads no tensor values (no host sync): the math calls it on every call."""
        ti, tl, ki, kl = self._tensors()
        _check(ti.dim() == 1, "token_ids", f"expected shape [T], got {tuple(ti.shape)}")
        T = ti.shape[0]
        _check(tl.shape == (T,), "token_logprobs", f"expected shape [{T}], got {tuple(tl.shape)}")
        _check(ki.dim() == 2 and ki.shape[0] == T, "topk_ids", f"expected shape [{T}, K], got {tuple(ki.shape)}")
        K = ki.shape[1]
        _check(kl.shape == (T, K), "topk_logprobs", f"expected shape [{T}, {K}], got {tuple(kl.shape)}")
        for name, t in (("token_ids", ti), ("topk_ids", ki)):
            _check(not t.is_floating_point() and t.dtype != torch.bool, name, f"expected integer ids, got {t.dtype}")
        for name, t in (("token_logprobs", tl), ("topk_logprobs", kl)):
            _check(t.is_floating_point(), name, f"expected floating log-probs, got {t.dtype}")
        _check(1 <= K <= vocab_size, "topk_ids", f"K={K} must be in [1, vocab_size={vocab_size}]")
        for name, t in (("token_logprobs", tl), ("topk_ids", ki), ("topk_logprobs", kl)):
            _check(t.device == ti.device, name, f"on {t.device}, but token_ids on {ti.device}")
        return self

    def validate(self, vocab_size: int, *, mass_tolerance: float = 1e-3) -> BehaviorTopK:
        """Raise ValueError naming the field unless this is a well-formed top-K view over `vocab_size` ids.

        Checks `check_shapes`, then the values: ids in [0, vocab_size), distinct top-K ids per row, log-probs
        that are not NaN or +inf and are <= mass_tolerance, and sum_{i in TopK u {k}} mu_i <= 1 + mass_tolerance.
        A log-prob of -inf, or one at or below finfo(float32).min (SGLang's clamp of an underflowed entry), is a
        valid probability 0; positive log-probs up to the tolerance are rounding and count as 0 (probability 1).
        Reads the values (host syncs): call it once where the engine's output is parsed, not per micro-batch.
        """
        self.check_shapes(vocab_size)
        ti, tl, ki, kl = self._tensors()
        T, K = ki.shape
        if T == 0:
            return self
        for name, t in (("token_ids", ti), ("topk_ids", ki)):
            bad = (t < 0) | (t >= vocab_size)
            if bad.any():
                row = _first_bad_row(bad)
                raise ValueError(f"{name}: id {t[row].tolist()} at row {row} outside [0, {vocab_size})")
        for name, t in (("token_logprobs", tl), ("topk_logprobs", kl)):
            bad = torch.isnan(t) | (t > mass_tolerance)
            if bad.any():
                row = _first_bad_row(bad)
                raise ValueError(f"{name}: value {t[row].tolist()} at row {row} is not a log-prob <= 0")
        if K > 1:
            s = ki.sort(-1).values
            dup = (s[:, 1:] == s[:, :-1]).any(-1)
            if dup.any():
                row = int(dup.nonzero()[0, 0])
                raise ValueError(f"topk_ids: duplicate ids {ki[row].tolist()} at row {row}")
        in_topk = (ki == ti[:, None]).any(-1)
        mass = kl.double().exp().sum(-1) + torch.where(in_topk, 0.0, tl.double().exp())
        bad = mass > 1.0 + mass_tolerance
        if bad.any():
            row = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"topk_logprobs: probabilities of top-K and sampled token sum to {float(mass[row]):.6f} > 1 "
                f"(tolerance {mass_tolerance}) at row {row}"
            )
        return self


@dataclass(frozen=True)
class BehaviorLogits:
    """mu's own logits shard: token_ids [T] long, logits [T, V/tp] (mu = softmax(logits / temperature)).

    Sharded over the vocabulary exactly like the training logits (same group, same shard layout).
    """

    token_ids: torch.Tensor
    logits: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> BehaviorLogits:
        """The same view with both tensors on `device` (`Tensor.to`: no copy for those already there)."""
        return BehaviorLogits(self.token_ids.to(device, non_blocking=non_blocking),
                              self.logits.to(device, non_blocking=non_blocking))

    def check_shapes(self, vocab_size: int) -> BehaviorLogits:
        """Shapes, dtypes and devices only (no host sync); `vocab_size` is unused (the shard's width is checked
        against the training logits by the math)."""
        ti, lg = self.token_ids, self.logits
        _check(ti.dim() == 1, "token_ids", f"expected shape [T], got {tuple(ti.shape)}")
        _check(lg.dim() == 2 and lg.shape[0] == ti.shape[0], "logits",
               f"expected shape [{ti.shape[0]}, V/tp], got {tuple(lg.shape)}")
        _check(lg.is_floating_point(), "logits", f"expected floating logits, got {lg.dtype}")
        _check(not ti.is_floating_point() and ti.dtype != torch.bool, "token_ids",
               f"expected integer ids, got {ti.dtype}")
        _check(lg.device == ti.device, "logits", f"on {lg.device}, but token_ids on {ti.device}")
        return self

    def validate(self, vocab_size: int) -> BehaviorLogits:
        """`check_shapes`, then ids in [0, vocab_size) (a host sync: call it once, not per micro-batch)."""
        self.check_shapes(vocab_size)
        ti = self.token_ids
        bad = (ti < 0) | (ti >= vocab_size)
        if bad.any():
            row = int(bad.nonzero()[0, 0])
            raise ValueError(f"token_ids: id {int(ti[row])} at row {row} outside [0, {vocab_size})")
        return self
