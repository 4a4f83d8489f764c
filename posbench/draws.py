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


def split_rows(batch, pieces) -> list:
    """The batch split along its batch dimension: `pieces` maps a tensor to its parts (tensor.split(n),
    tensor.tensor_split(k)); the tensors with a row per sequence are split, every other field is kept."""
    rows = batch.inputs.shape[0]
    split = {f.name: pieces(getattr(batch, f.name)) for f in dataclasses.fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor) and getattr(batch, f.name).dim()
             and getattr(batch, f.name).shape[0] == rows}
    return [dataclasses.replace(batch, **{name: parts[i] for name, parts in split.items()})
            for i in range(len(split["inputs"]))]


def row_blocks(batch, rows: int) -> list:
    """The batch in blocks of at most `rows` sequences: a batch drawn whole and evaluated in smaller
    forwards, so the sequences drawn do not depend on them."""
    return [batch] if batch.inputs.shape[0] <= rows else split_rows(batch, lambda tensor: tensor.split(rows))


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
            h.update(value.numpy())  # the tensor's own buffer: no copy
        self.digest = h.hexdigest()


def combined(train_digest: str | None, eval_digest: str | None) -> str | None:
    """A row's data_fingerprint: what the run trained on and what this length evaluated on.
    None when either is unknown (a run resumed from a checkpoint written before fingerprints)."""
    if train_digest is None or eval_digest is None:
        return None
    return hashlib.blake2b(f"{train_digest}/{eval_digest}".encode(), digest_size=DIGEST_BYTES // 2).hexdigest()
