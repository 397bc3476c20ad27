"""Tensors between ranks: as their bytes where a link lacks their dtype (gloo has no float8, and neither gloo's
broadcast nor NCCL takes int16), and the one "tensor mail" protocol that moves a dict of named tensors: a pickled
header (each tensor's name, dtype and shape, and the caller's picklable `extra`), then one message per tensor, sent
point to point (`send_tensors` / `recv_tensors`) or broadcast over a group (`broadcast_tensors`). The batch
fan-out (train/rollouts.py) and the weight sync's pipeline stages (train/weight_sync.py) use it."""

from __future__ import annotations

import torch
import torch.distributed as dist


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as flat uint8: a view, so receiving into it fills `t` (a non-contiguous `t`
    gives a copy, which only a sender may use)."""
    return t.reshape(-1).view(torch.uint8)


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _header(tensors: dict[str, torch.Tensor], extra) -> tuple:
    return extra, [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]


def _empty(spec: list, device: torch.device) -> dict[str, torch.Tensor]:
    """Tensors to receive into, as the header describes them."""
    return {name: torch.empty(shape, dtype=dtype, device=device) for name, dtype, shape in spec}


def send_tensors(tensors: dict[str, torch.Tensor] | None, dst: int, *, staging: torch.device, extra=None,
                 device: torch.device | None = None) -> int:
    """Send `tensors` (contiguous) and `extra` to global rank dst: the header pickled on `staging` (the current GPU
    under NCCL), then each tensor's bytes, copied to `device` first when given (one at a time: a host-built batch
    never sits on the GPU whole). None sends the end marker, for which `recv_tensors` returns None. Returns the
    tensor bytes sent."""
    dist.send_object_list([None if tensors is None else _header(tensors, extra)], dst=dst, device=staging)
    for t in (tensors or {}).values():
        dist.send(as_bytes(t if device is None else t.to(device)), dst=dst)
    return nbytes(tensors or {})


def recv_tensors(src: int, *, device: torch.device, staging: torch.device | None = None
                 ) -> tuple[dict[str, torch.Tensor], object] | None:
    """What `send_tensors` from global rank src sent: (tensors on `device`, extra), or None for the end marker."""
    box = [None]
    dist.recv_object_list(box, src=src, device=staging or device)
    if box[0] is None:
        return None
    extra, spec = box[0]
    tensors = _empty(spec, device)
    for t in tensors.values():
        dist.recv(as_bytes(t), src=src)
    return tensors, extra


def broadcast_tensors(tensors: dict[str, torch.Tensor] | None, src: int, group, *, device: torch.device,
                      extra=None) -> tuple[dict[str, torch.Tensor], object]:
    """`tensors` and `extra` of global rank src (the others pass None) on every rank of `group`, on `device`: one
    header broadcast, then one broadcast per tensor. Returns (tensors, extra) on every rank."""
    box = [None if tensors is None else _header(tensors, extra)]
    dist.broadcast_object_list(box, src=src, group=group, device=device)
    extra, spec = box[0]
    if tensors is None:
        tensors = _empty(spec, device)
    for t in tensors.values():
        dist.broadcast(as_bytes(t), src=src, group=group)
    return tensors, extra
