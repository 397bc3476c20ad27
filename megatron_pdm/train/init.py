"""The weights a run starts from (`train.init`: random, or an HF checkpoint) and the supervised warm start
(`train.warm_start_steps`) that makes sampling find rewards on a toy task."""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_pdm.models import load_hf_checkpoint, load_hf_into_model
from megatron_pdm.models.hf import architecture_mismatches

from .batch import sequences
from .config import Config
from .data import RLData
from .step import Learner


def warm_start_rows(dp: int, per_rank: int = 1, rows: int = 64) -> int:
    """(prompt, answer) pairs per supervised warm-start step: `rows` rounded up to a multiple of DP x per_rank, so
    that every DP rank gets the same number, at least per_rank (the micro-batches virtual stages need; at DP > 64 a
    rank got none before)."""
    return -(-rows // (dp * per_rank)) * dp * per_rank


def initialize(cfg: Config, learner: Learner, data: RLData, device: torch.device) -> None:
    """train.init (random, or an HF checkpoint), then the supervised warm start if asked."""
    if cfg.train.init == "hf":
        state, hf_cfg = load_hf_checkpoint(cfg.train.init_path)
        diffs = architecture_mismatches(cfg.model, hf_cfg)
        if diffs:
            raise ValueError(f"train.init_path: the checkpoint differs from the model section: {'; '.join(diffs)}")
        load_hf_into_model(learner.chunks, state, cfg.model, learner.parallel)
        # mixed-precision optimizers copied the random weights into their fp32 main weights when built
        learner.optimizer.reload_model_params()
    if cfg.train.warm_start_steps:
        warm_start(cfg, learner, data, device)


def warm_start(cfg: Config, learner: Learner, data: RLData, device: torch.device) -> None:
    """A few supervised steps on (prompt, answer) pairs so that sampling finds rewards; a fresh optimizer is made
    for RL afterwards."""
    t, train, tok, dp = cfg.train, data.train, data.tokenizer, learner.parallel.dp
    learner.optimizer = learner.new_optimizer(t.warm_start_lr)
    g = torch.Generator().manual_seed(t.seed)
    rows = warm_start_rows(dp, cfg.min_micro_batches)
    for _ in range(t.warm_start_steps):
        idx = torch.randint(0, len(train.problems), (rows,), generator=g).tolist()
        if data.demonstrations is None:
            answers = [tok.encode(train.problems[i].answer, special=False) + [tok.eos_id] for i in idx]
        else:
            answers = [data.demonstrations[i][0] for i in idx]
        batch = sequences([train.prompt_ids[i] for i in idx], answers, pad_id=tok.pad_id,
                          multiple=cfg.parallel.sequence_multiple)
        trained = batch.num_tokens
        if data.demonstrations is not None:  # a demonstration's tool turns are context, out of the loss
            mask = torch.tensor([f for i in idx for f in data.demonstrations[i][1]], dtype=torch.float32)
            batch, trained = replace(batch, loss_mask=mask), int(mask.sum())
        per = batch.rows // dp
        rank = learner.parallel.dp_rank
        learner.sft_update(batch.select(rank * per, (rank + 1) * per).to(device), trained)
    learner.optimizer = learner.new_optimizer(cfg.optim.lr)
