"""Where a run's data are drawn: on the CPU, from generators seeded by the run, whatever device trains.

A seed's sequences are then the same on a CPU and a GPU (a CUDA generator draws other numbers), and
the batch moves to the device afterwards (pinned memory, non-blocking). `DataFingerprint` hashes what
was drawn, so two runs can be checked to have trained and evaluated on the same sequences.
"""
from __future__ import annotations

import dataclasses
import hashlib

import torch

DIGEST_BYTES = 16


def generator(seed: int) -> torch.Generator:
    """A CPU generator: every task and position scheme draws from one of these."""
    return torch.Generator().manual_seed(int(seed))


def to_device(batch, device: torch.device):
    """The batch (any dataclass of tensors and plain fields) with its tensors on `device`."""
    if device.type == "cpu":
        return batch
    moved = {field.name: move(getattr(batch, field.name), device) for field in dataclasses.fields(batch)
             if isinstance(getattr(batch, field.name), torch.Tensor)}
    return dataclasses.replace(batch, **moved)


def row_blocks(batch, rows: int) -> list:
    """The batch in blocks of at most `rows` sequences (its tensors split along the batch dimension): a
    batch drawn whole and evaluated in smaller forwards, so the sequences drawn do not depend on them."""
    total = batch.inputs.shape[0]
    if total <= rows:
        return [batch]
    blocks = []
    for start in range(0, total, rows):
        split = {field.name: getattr(batch, field.name)[start:start + rows] for field in dataclasses.fields(batch)
                 if isinstance(getattr(batch, field.name), torch.Tensor) and getattr(batch, field.name).dim()
                 and getattr(batch, field.name).shape[0] == total}
        blocks.append(dataclasses.replace(batch, **split))
    return blocks


def move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One drawn tensor to `device`; through pinned memory to CUDA, so the copy overlaps the step."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class DataFingerprint:
    """A running hash of drawn batches: each batch's tensors (dtype, shape and bytes) and its positions
    are chained onto the digest so far, so the digest names the whole sequence of batches in order.
    `digest` is a hex string that a checkpoint can carry and a resumed run continue from."""

    def __init__(self, digest: str = ""):
        self.digest = digest

    def add(self, batch, positions: torch.Tensor | None) -> None:
        h = hashlib.blake2b(bytes.fromhex(self.digest), digest_size=DIGEST_BYTES)
        for value in [getattr(batch, f.name) for f in dataclasses.fields(batch)] + [positions]:
            if not isinstance(value, torch.Tensor):  # a grid's shape, a segment's memory length
                h.update(repr(value).encode())
                continue
            value = value.detach().cpu().contiguous()
            h.update(f"{value.dtype}{tuple(value.shape)}".encode())
            h.update(value.numpy().tobytes())
        self.digest = h.hexdigest()


def combined(train_digest: str | None, eval_digest: str | None) -> str | None:
    """A row's data_fingerprint: what the run trained on and what this length evaluated on.
    None when either is unknown (a run resumed from a checkpoint written before fingerprints)."""
    if train_digest is None or eval_digest is None:
        return None
    return hashlib.blake2b(f"{train_digest}/{eval_digest}".encode(), digest_size=DIGEST_BYTES // 2).hexdigest()
