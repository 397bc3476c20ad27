"""Tensors travel between ranks as their bytes where a link lacks their dtype: gloo has no float8, and neither
gloo's broadcast nor NCCL takes int16."""

from __future__ import annotations

import torch


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as flat uint8: a view, so receiving into it fills `t` (a non-contiguous `t`
    gives a copy, which only a sender may use)."""
    return t.reshape(-1).view(torch.uint8)
