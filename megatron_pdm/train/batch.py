"""Rollout samples to training batches: right-padded sequences and, per response token, its row, the position whose
logits predict it, the behavior policy's top-K view and the advantage, all on one device.

Built on the host from the engine's samples (validated there, once), then copied to the device once per step.
Slicing rows is host arithmetic on `offsets`, and gathering the response logits is an index on device tensors:
no micro-batch step reads a tensor value back to the host."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from megatron_pdm.models.attention import zigzag_chunks, zigzag_positions
from megatron_pdm.rollout import RolloutSample
from megatron_pdm.vocab_parallel import BehaviorTopK


@dataclass
class Batch:
    """Sequences [B, S] and their N response tokens in row-major order (row 0's tokens, then row 1's, ...).

    targets[n] = input_ids[sequence_ids[n], positions[n] + 1]; offsets: host-side token offsets of the rows
    (B + 1 entries), so rows [lo, hi) hold tokens [offsets[lo], offsets[hi]); lengths: each row's prompt +
    response length (host), so that a slice of rows is padded only to its own longest, rounded up to `multiple`."""

    input_ids: torch.Tensor  # [B, S] long
    sequence_ids: torch.Tensor  # [N] long, row of each response token
    positions: torch.Tensor  # [N] long, the position whose logits predict it
    targets: torch.Tensor  # [N] long, the token
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    multiple: int = 1
    behavior: BehaviorTopK | None = None  # the engine's view of mu at every response token (RL)
    advantages: torch.Tensor | None = None  # [N]
    loss_mask: torch.Tensor | None = None  # [N] 1 for tokens in the loss (0: a truncated response with overlong mask)
    old_logprobs: torch.Tensor | None = None  # [N] log pi_old(k) at the step's start, for objective.correction
    # [B, S, layers, top_k] int16, the rollout's expert choices, replayed (R3): every decoder layer's as built, a
    # trainer rank's own MoE layers' once received (`with_routed_layers`)
    routed_experts: torch.Tensor | None = None
    sequence_lengths: torch.Tensor | None = None  # [N] loss tokens in each token's whole sequence (context shards)
    padding_mask: torch.Tensor | None = None  # [B, S] bool, True past each row's length (MoE: `with_padding_mask`)
    token_age: torch.Tensor | None = None  # [N] long, versions between each token's weights and the trainer's (lag)
    # [N, K] log pi_old at the behavior's top-K ids (objective.anchor proximal), set on micro-batches once cut
    anchor_logprobs: torch.Tensor | None = None
    # [N] log pi_ref(k) under the frozen reference policy (objective.kl_coef), set on micro-batches once cut
    ref_logprobs: torch.Tensor | None = None
    # [N, H] the reference's last hidden states at the response positions (objective.kl_type exact), likewise
    ref_hidden: torch.Tensor | None = None
    # [N, H_t] the in-trainer teacher's last hidden states at the response positions (distill.teacher), likewise
    teacher_hidden: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1] - self.offsets[0]

    def response_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V/tp] the logits rows that predict the response tokens, from [B, S, V/tp] (a gather: no sync)."""
        return logits[self.sequence_ids, self.positions]

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    @property
    def real_tokens(self) -> int:
        """Prompt and response tokens (host): rows x width minus this is the padding a forward computes."""
        return sum(self.lengths)

    def select(self, lo: int, hi: int) -> Batch:
        """Rows [lo, hi) with their tokens (row ids renumbered from 0), padded to their own longest row; slices
        only, no copy and no sync."""
        hi = min(hi, self.rows)
        a, b = self.offsets[lo] - self.offsets[0], self.offsets[hi] - self.offsets[0]
        width = max(self.lengths[lo:hi])
        width += (-width) % self.multiple
        tok = lambda t: None if t is None else t[a:b]  # noqa: E731
        beh = self.behavior
        return Batch(self.input_ids[lo:hi, :width], self.sequence_ids[a:b] - lo, self.positions[a:b],
                     self.targets[a:b], self.offsets[lo : hi + 1], self.lengths[lo:hi], self.multiple,
                     None if beh is None else BehaviorTopK(beh.token_ids[a:b], beh.token_logprobs[a:b],
                                                           beh.topk_ids[a:b], beh.topk_logprobs[a:b]),
                     tok(self.advantages), tok(self.loss_mask), tok(self.old_logprobs),
                     None if self.routed_experts is None else self.routed_experts[lo:hi, :width],
                     tok(self.sequence_lengths),
                     None if self.padding_mask is None else self.padding_mask[lo:hi, :width], tok(self.token_age))

    def with_routed_layers(self, layers: list[int]) -> Batch:
        """This batch with the routed experts of `layers` only, in that order (a rank's own MoE layers,
        `ParallelContext.moe_layers`): a pipeline stage replays its own layers, and holds the step's choices on the
        device while it trains, so it keeps no other stage's (a copy; the whole tensor is freed with the batch)."""
        if self.routed_experts is None:
            return self
        return replace(self, routed_experts=self.routed_experts[:, :, layers])

    def micro_batches(self, size: int) -> list[Batch]:
        """Consecutive micro-batches of `size` rows."""
        return [self.select(s, s + size) for s in range(0, self.rows, size)]

    def split(self, sizes: list[int]) -> list[Batch]:
        """Consecutive micro-batches of sizes[i] rows (a packing plan's bins, rows laid out bin by bin)."""
        starts = [0, *itertools.accumulate(sizes)]
        return [self.select(lo, hi) for lo, hi in itertools.pairwise(starts)]

    def to(self, device: torch.device) -> Batch:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, input_ids=move(self.input_ids), sequence_ids=move(self.sequence_ids),
                       positions=move(self.positions), targets=move(self.targets),
                       behavior=None if self.behavior is None else self.behavior.to(device),
                       advantages=move(self.advantages), loss_mask=move(self.loss_mask),
                       old_logprobs=move(self.old_logprobs), routed_experts=move(self.routed_experts),
                       sequence_lengths=move(self.sequence_lengths), padding_mask=move(self.padding_mask),
                       token_age=move(self.token_age))

    def with_padding_mask(self) -> Batch:
        """This micro-batch with `padding_mask` (True at the right padding of each row), which megatron's MoE routers
        leave out of the load-balancing loss: otherwise that loss would count padding, whose amount depends on the
        layout (`ParallelConfig.sequence_multiple`) and on how rows are packed into micro-batches. Host
        arithmetic on `lengths`, then one copy to the device, made when the micro-batch is cut (before
        `context_shard`, which slices it)."""
        mask = torch.arange(self.width)[None] >= torch.tensor(self.lengths, dtype=torch.long)[:, None]
        return replace(self, padding_mask=mask.to(self.input_ids.device))

    def context_shard(self, rank: int, size: int) -> Batch:
        """Context-parallel rank `rank`'s part of this micro-batch (width a multiple of 2 x size): the columns of
        sequence chunks (rank, 2 size-1-rank) of 2 x size equal chunks (megatron's load-balanced layout, which
        RoPE and the attention follow) and the response tokens predicted from them, with positions renumbered to
        the local columns. `sequence_lengths` keeps each token's whole-sequence loss-token count, which the
        seq_mean_token_mean weights need once a sequence's tokens are split, and `lengths` stay the whole rows'
        lengths (a shard is not sliced further: `select` on it would misread them). Which tokens stay is host
        arithmetic on offsets and lengths; the device tensors are then indexed once (three small host-to-device
        copies: token index, local positions, columns; pageable copies wait for the device, so micro-batches are
        cut before the step's compute is queued)."""
        B, S, dev = self.rows, self.width, self.input_ids.device
        if S % (2 * size):
            raise ValueError(f"context_shard: width {S} is not a multiple of 2 x CP = {2 * size} (pad sequences to "
                             "parallel.sequence_multiple)")
        chunk = S // (2 * size)
        first, second = zigzag_chunks(rank, size)
        lengths = torch.tensor(self.lengths, dtype=torch.long)
        offsets = torch.tensor(self.offsets, dtype=torch.long) - self.offsets[0]
        response = offsets.diff()
        row = torch.arange(B).repeat_interleave(response)
        pos = (lengths - response - 1)[row] + torch.arange(int(offsets[-1])) - offsets[:-1][row]  # global, host
        at = pos // chunk
        keep = ((at == first) | (at == second)).nonzero().squeeze(1)
        local_pos = torch.where(at == first, pos - first * chunk, pos - second * chunk + chunk)[keep]
        cols = zigzag_positions(S, rank, size)
        index = keep.to(dev)
        take = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        counts = self.sequence_lengths
        if counts is None and self.loss_mask is not None:  # loss tokens per sequence, per token (device ops)
            counts = torch.zeros(B, dtype=torch.float64, device=dev).index_add_(
                0, self.sequence_ids, self.loss_mask.double())[self.sequence_ids]
        beh = self.behavior
        cols_dev = cols.to(dev)
        return Batch(self.input_ids.index_select(1, cols_dev), take(self.sequence_ids), local_pos.to(dev),
                     take(self.targets), tuple((0, *torch.bincount(row[keep], minlength=B).cumsum(0).tolist())),
                     self.lengths, self.multiple,
                     None if beh is None else BehaviorTopK(*(take(getattr(beh, k)) for k in _BEHAVIOR)),
                     take(self.advantages), take(self.loss_mask), take(self.old_logprobs),
                     None if self.routed_experts is None else self.routed_experts.index_select(1, cols_dev),
                     take(counts),
                     None if self.padding_mask is None else self.padding_mask.index_select(1, cols_dev),
                     take(self.token_age))


_BEHAVIOR = ("token_ids", "token_logprobs", "topk_ids", "topk_logprobs")
_TENSORS = ("input_ids", "sequence_ids", "positions", "targets", "advantages", "loss_mask", "routed_experts",
            "token_age")


def batch_tensors(b: Batch) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, host fields) of an RL batch, for sending: the tensors by name (behavior.* flattened, None left
    out) and the host-side offsets, lengths and multiple."""
    tensors = {k: getattr(b, k) for k in _TENSORS if getattr(b, k) is not None}
    if b.behavior is not None:
        tensors.update({f"behavior.{k}": getattr(b.behavior, k) for k in _BEHAVIOR})
    return tensors, {"offsets": b.offsets, "lengths": b.lengths, "multiple": b.multiple}


def batch_from_tensors(tensors: dict[str, torch.Tensor], host: dict) -> Batch:
    """The inverse of `batch_tensors`."""
    behavior = BehaviorTopK(*(tensors[f"behavior.{k}"] for k in _BEHAVIOR)) if "behavior.token_ids" in tensors \
        else None
    return Batch(**{k: tensors.get(k) for k in _TENSORS}, **host, behavior=behavior)


def sequences(prompts: list[list[int]], responses: list[list[int]], *, pad_id: int, multiple: int = 1) -> Batch:
    """prompt + response per row, right-padded with pad_id to a multiple of `multiple` (sequence parallelism splits
    the sequence over TP); the response tokens are the targets. On the host."""
    lengths = [len(r) for r in responses]
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    width += (-width) % multiple
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    positions = []
    for row, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[row, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        positions.append(torch.arange(len(p) - 1, len(p) - 1 + len(r)))
    rows = torch.arange(len(prompts)).repeat_interleave(torch.tensor(lengths, dtype=torch.long))
    targets = torch.tensor(list(itertools.chain.from_iterable(responses)), dtype=torch.long)
    return Batch(ids, rows, torch.cat(positions), targets, (0, *itertools.accumulate(lengths)),
                 tuple(len(p) + len(r) for p, r in zip(prompts, responses, strict=True)), multiple)


def rollout_batch(samples: list[RolloutSample], advantages: torch.Tensor, *, pad_id: int, multiple: int,
                  vocab_size: int, routed_experts: tuple[int, int] | None = None,
                  in_loss: list[bool] | None = None, version: int | None = None,
                  max_age: int | None = None) -> Batch:
    """The batch of a rollout: samples' sequences, the engine's behavior (validated here, once per rollout: it reads
    values), each token's sequence advantage ([len(samples)] in, per token out) and the loss mask (in_loss[i]:
    whether sample i's tokens count in the loss and its normaliser; default all; a token the policy did not choose,
    `RolloutSample.trainable` False, never does). version: the trainer's weight version, which gives each token its
    age (`token_age`, version minus the token's version); tokens older than max_age leave the loss.
    routed_experts (layers, top_k): the samples' expert choices as [B, S, layers, top_k] int16 (any expert count below
    32,768: a quarter of int64's bytes, which a trainer rank holds for the whole step); positions the engine
    never routed (the last token, padding) take experts 0..top_k-1, which nothing the loss reads depends on.
    On the host; `.to(device)` once."""
    b = sequences([s.prompt_ids for s in samples], [s.response_ids.tolist() for s in samples], pad_id=pad_id,
                  multiple=multiple)
    cat = lambda name: torch.cat([getattr(s, name) for s in samples])  # noqa: E731
    behavior = BehaviorTopK(b.targets, cat("token_logprobs"), cat("topk_ids"), cat("topk_logprobs"))
    behavior.validate(vocab_size)
    routed = None
    if routed_experts is not None:
        layers, top_k = routed_experts
        routed = torch.arange(top_k, dtype=torch.int16).expand(b.rows, b.input_ids.shape[1], layers, top_k).clone()
        for r, s in enumerate(samples):
            if s.routed_experts is None:
                raise ValueError(f"rollout.routed_experts: the engine returned no routed experts for sample {r}")
            routed[r, : len(s.routed_experts)] = s.routed_experts
    kept = torch.tensor([True] * len(samples) if in_loss is None else in_loss, dtype=torch.float32)
    loss_mask = kept[b.sequence_ids] * torch.cat([s.flags() for s in samples]).float()
    age = None
    if version is not None:
        age = version - torch.cat([s.versions() for s in samples])
        if max_age is not None:
            loss_mask = loss_mask * (age <= max_age)
    return replace(b, behavior=behavior, advantages=advantages[b.sequence_ids], loss_mask=loss_mask,
                   routed_experts=routed, token_age=age)


# ---------------------------------------------------------------------------------------------- token budgets


def pack_by_tokens(lengths: list[int], budget: int, max_padding: float = 0.05) -> list[list[int]]:
    """Micro-batches of indices for the padded layout (each micro-batch right-padded to its longest sequence):
    sequences sorted longest first and packed greedily in that order while rows x longest <= `budget` and the
    padding stays at most `max_padding` of the positions (a sequence longer than the budget goes alone). The
    budget bounds the positions a forward computes, so activation memory; sorting keeps lengths inside a
    micro-batch close, and the padding cap closes a micro-batch where the lengths spread out."""
    bins: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if bins:
            rows, longest = len(bins[-1]) + 1, lengths[bins[-1][0]]
            if rows * longest <= budget and real + lengths[i] >= (1 - max_padding) * rows * longest:
                bins[-1].append(i)
                real += lengths[i]
                continue
        bins.append([i])
        real = lengths[i]
    return bins


def _cheapest_merge(bins: list[list[int]], lengths: list[int]) -> tuple[list[int], list[int]]:
    """The two bins whose merge computes the fewest positions, (rows_a + rows_b) x the longer longest (each bin's
    rows sorted longest first). For each bin b in order of its longest, the best partner among those not longer is
    the one with the fewest rows: one sort and one pass, O(B log B), not a pass over the B^2 pairs."""
    order = sorted(bins, key=lambda b: (lengths[b[0]], len(b), b))
    best, fewest = None, order[0]
    for b in order[1:]:
        cost = (len(b) + len(fewest)) * lengths[b[0]]
        if best is None or cost < best[0]:
            best = (cost, fewest, b)
        if len(b) < len(fewest):
            fewest = b
    return best[1], best[2]


def plan_micro_batches(lengths: list[int], budget: int, ranks: int, *, per_rank: int = 1) -> list[list[list[int]]]:
    """The rows of one minibatch over `ranks` data-parallel ranks in token-budget micro-batches: per rank, its
    micro-batches as lists of row indices. Sequences are packed under `budget` (pack_by_tokens); then the bin count
    goes to a multiple of `ranks` (every rank must run the same number of micro-batches: expert all-to-alls and
    pipeline schedules pair them across ranks): up to the next multiple by halving the largest bins while there are
    rows enough for it, else down to the previous one by merging the pair of bins that computes the fewest
    positions once merged (fewer than `ranks` merges; with a sequence longer than the budget, which goes alone, the
    only micro-batches over the budget, and then by as little as the lengths allow). Each step moves the count by
    one towards a fixed target, so the loop ends; then
    each bin goes, largest first, to the rank with the fewest tokens among those still short of their share. Ranks
    get balanced token counts, not equal sequence counts. per_rank: the fewest micro-batches a rank may get (PP with
    virtual pipeline stages, whose interleaved schedule needs PP); needs len(lengths) >= ranks x per_rank (the
    config checks that with token budgets, the trainer skips a step whose dynamic sampling left fewer)."""
    if len(lengths) < ranks * per_rank:
        raise ValueError(f"plan_micro_batches: {len(lengths)} rows cannot give each of {ranks} ranks {per_rank} "
                         "micro-batch(es)")
    bins = pack_by_tokens(lengths, budget)
    tokens = lambda b: sum(lengths[i] for i in b)  # noqa: E731
    up = -(-max(len(bins), ranks * per_rank) // ranks) * ranks
    target = up if up <= len(lengths) else len(bins) // ranks * ranks  # a bin holds at least one row
    while len(bins) < target:  # halve the largest splittable bin (its rows stay sorted by length)
        b = max((b for b in bins if len(b) > 1), key=lambda b: len(b) * lengths[b[0]])
        at = bins.index(b)
        bins[at : at + 1] = [b[: len(b) // 2], b[len(b) // 2 :]]
    while len(bins) > target:  # merge the pair that computes the fewest positions merged (rows x longest)
        a, b = _cheapest_merge(bins, lengths)
        bins.remove(a)
        bins[bins.index(b)] = sorted(b + a, key=lambda i: (-lengths[i], i))
    per_rank = len(bins) // ranks
    plan: list[list[list[int]]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for b in sorted(bins, key=lambda b: -tokens(b)):
        r = min((r for r in range(ranks) if len(plan[r]) < per_rank), key=lambda r: load[r])
        plan[r].append(b)
        load[r] += tokens(b)
    return plan


# ---------------------------------------------------------------------------------------------- dynamic sampling


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward: 0 for a response of L <= L_max - L_cache tokens,
    factor x ((L_max - L_cache) - L) / L_cache inside the buffer (down to -factor at L = L_max), L_max =
    max_new_tokens, L_cache = buffer (> 0)."""
    start = max_new_tokens - buffer
    return (-(lengths.double() - start).clamp(min=0) / buffer * factor).to(torch.float32)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[G] bool: groups whose rewards are not all equal (a zero-variance group has zero advantage everywhere: no
    gradient, only cost). rewards [G x group_size], group by group."""
    g = rewards.view(-1, group_size)
    return (g != g[:, :1]).any(dim=1)


def plan_minibatches(lengths: list[int], *, minibatches: int, ranks: int, micro_batch_size: int,
                     max_tokens: int | None = None, per_rank: int = 1) -> list[list[tuple[list[int], list[int]]]]:
    """Per minibatch, per data-parallel rank: (its row indices, laid out micro-batch by micro-batch; the
    micro-batch sizes). Fixed (max_tokens None): each minibatch is `rows / minibatches` consecutive rows, each
    rank's share `1 / ranks` of them, cut every micro_batch_size rows (the config makes these divide). Token
    budgets: the rows are cut into at most `minibatches` consecutive minibatches of at least `ranks` x `per_rank`
    rows, each planned by plan_micro_batches (any row count packs: dynamic sampling may drop groups; none below
    ranks x per_rank rows)."""
    n = len(lengths)
    if max_tokens is None:
        rows = n // minibatches
        per = rows // ranks
        sizes = [min(micro_batch_size, per - s) for s in range(0, per, micro_batch_size)]
        return [[(list(range(m * rows + r * per, m * rows + (r + 1) * per)), sizes) for r in range(ranks)]
                for m in range(minibatches)]
    count = min(minibatches, n // (ranks * per_rank))
    if not count:  # too few rows to plan (the trainer skips such a step)
        return []
    bounds = [n * m // count for m in range(count + 1)]
    out = []
    for lo, hi in itertools.pairwise(bounds):
        plan = plan_micro_batches(lengths[lo:hi], max_tokens, ranks, per_rank=per_rank)
        out.append([([lo + i for b in bins for i in b], [len(b) for b in bins]) for bins in plan])
    return out
