"""Position schemes: which position ids a sequence of length L (or a grid of H x W cells) is given.

- sequential: 0..L-1.
- randomized (Ruoss et al. ACL 2023): a sorted sample of L distinct positions from
  [0, max_position), drawn for every batch in training and evaluation alike, so the
  model meets the large positions of long sequences while training on short ones.
- offset: 0..L-1 shifted by one random offset in [0, max_position - L], the cheap
  control for randomized.
One draw is shared by the batch ([1, L]), which keeps bias masks at [1, H, L, L].

Grids (tasks with position_dims = 2) get (row, column) pairs [1, H*W, 2] in raster order,
the scheme applied to each axis on its own: rows and columns are independent 1-D draws
with max_position per axis. A 1-D encoding on a grid reads the raster index of `raster`.
"""
from __future__ import annotations

import torch

from posbench.checks import Choice

SCHEMES = ("sequential", "randomized", "offset")


class PositionScheme:
    longest_is = "the longest evaluated sequence has {} tokens"  # what `check` compares max_position with

    def __init__(self, scheme: str, max_position: int):
        Choice(SCHEMES)("train.positions", scheme)
        if max_position is None or max_position < 1:
            raise ValueError(f"train.positions={scheme} needs train.max_position >= 1, got {max_position}")
        self.scheme, self.max_position = scheme, max_position

    def check(self, longest: int) -> None:
        """Refuse before training when a sequence of `longest` tokens (a grid side) cannot get distinct positions."""
        if longest > self.max_position:
            raise ValueError(f"train.positions={self.scheme} uses positions in [0, train.max_position="
                             f"{self.max_position}) but {self.longest_is.format(longest)}; "
                             f"set train.max_position >= {longest} (positions are never clamped)")

    def __call__(self, length: int, generator: torch.Generator) -> torch.Tensor:
        """-> position ids [1, L] (long) on the generator's device."""
        device = generator.device
        if self.scheme == "sequential":
            return torch.arange(length, device=device)[None]  # [1, L]
        if self.scheme == "randomized":
            chosen = torch.randperm(self.max_position, generator=generator, device=device)[:length]  # [L]
            return chosen.sort().values[None]  # [1, L]
        shift = torch.randint(0, self.max_position - length + 1, (1,), generator=generator, device=device)
        return (torch.arange(length, device=device) + shift)[None]  # [1, L]

    def for_batch(self, batch, generator: torch.Generator) -> torch.Tensor:
        """The positions the model reads for a task's batch: [1, T]."""
        return self(batch.inputs.shape[1], generator)

    def model_extents(self, task, train_length: int) -> dict:
        """ModelDims' position counts: the largest position id + 1 ever fed, and seen in training."""
        trained = self.max_position if self.scheme != "sequential" else task.sequence_length(train_length)
        return {"max_positions": self.max_position, "train_positions": trained}


class GridPositions(PositionScheme):
    """The scheme per axis on a grid; max_position bounds each axis (a grid's side), not the cells."""

    longest_is = "the largest evaluated grid has {} cells on a side"

    def for_batch(self, batch, generator: torch.Generator) -> torch.Tensor:
        """(row, column) of every cell in raster order: [1, H*W, 2]."""
        height, width = batch.grid
        rows, cols = self(height, generator), self(width, generator)  # [1, H], [1, W]
        grid = torch.broadcast_tensors(rows[:, :, None], cols[:, None, :])  # 2 x [1, H, W]
        return torch.stack(grid, dim=-1).flatten(1, 2)  # [1, H*W, 2]

    def model_extents(self, task, train_length: int) -> dict:
        """Sides for the 2-D encodings; raster extents (side^2, see `raster`) for the 1-D ones."""
        trained = self.max_position if self.scheme != "sequential" else train_length
        return {"max_positions": self.max_position ** 2, "train_positions": trained ** 2,
                "max_side": self.max_position, "train_side": trained}


def position_scheme(task, scheme: str, max_position: int | None, lengths: list[int]) -> PositionScheme:
    """The scheme for `task` (per axis when it hands the model a grid), checked before training against
    every length in `lengths` (N and the evaluation lengths); max_position None: the longest one."""
    if task.position_dims == 2:
        cls, longest = GridPositions, max(lengths)  # a grid task's length is its side
    else:
        cls, longest = PositionScheme, max(task.sequence_length(n) for n in lengths)
    positions = cls(scheme, max_position or longest)
    positions.check(longest)
    return positions


def raster(pos: torch.Tensor) -> torch.Tensor:
    """The 1-D adapter: (row, column) [B', L, 2] -> raster index r * W + c [B', L].

    W is the span of the columns present (the grid's width for sequential positions; randomized
    columns keep their gaps), so ids stay distinct, in raster order, and below max_side^2. The
    span is read from the whole grid: apply this once per forward, before any slicing of queries."""
    rows, cols = pos.long().unbind(-1)  # [B', L] each
    width = cols.amax(dim=1, keepdim=True) - cols.amin(dim=1, keepdim=True) + 1  # [B', 1]
    return rows * width + cols  # [B', L]
