"""Grid tasks: an H x W grid of cells read in raster order, one answer per cell, for a bidirectional
encoder (model.causal=false; configs/task_train/<task>.yaml sets it). The model reads the cells'
tokens at positions (row, column) [1, H*W, 2] and is scored at every cell; no BOS, SEP or QUERY.

Length = the side: `sample(B, n)` gives n x n grids (evaluation uses squares of side ratio x N,
n^2 tokens). Training (`train_sample`) takes the drawn length as the height H and draws the width
W uniformly from [1, N] (`shapes: rectangles`, so H, W are independent and uniform in [1, N] with
train.lengths=uniform), or W = H (`shapes: squares`). Cells are drawn on the generator's device in
batched tensor ops; answers are computed the same way (tests check them against plain solvers).

life            one step of Conway's Game of Life, cells outside the grid dead. Tokens 0 dead, 1 alive.
grid_flip       the grid mirrored left-right. Tokens: `symbols` symbols in and out.
grid_row_count  each cell: the number of marked cells in its row, clipped to counts - 1.
grid_nearest    each cell: its Manhattan distance to the nearest marked cell (0 on a mark), clipped
                to distances - 1 (also the answer when the grid has no mark).
Inputs of the last three: 0 empty, 1 marked (grid_flip: symbols); answers share the ids 0..labels-1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from posbench.checks import Choice, Flag, Integer, Real
from tasks.base import Batch, Task, uniform_ids

SHAPES = ("rectangles", "squares")


class GridTask(Task):
    """Subclasses give `cells` (the input grid) and `answer` (the grid of labels)."""

    position_dims = 2
    options: tuple[str, ...] = ()  # the subclass's constructor options, recorded by params()

    def __init__(self, alphabet: int, labels: int, default_length: int = 8, causal: bool = False,
                 shapes: str = "rectangles"):
        if Flag()("task.causal", causal, self.name):
            raise ValueError(f"{self.name}: causal=True is not possible: every cell's answer depends on cells on "
                             "all sides, so a grid task needs the bidirectional encoder (model.causal=false, the "
                             f"default of configs/task_train/{self.name}.yaml)")
        Choice(SHAPES)("task.shapes", shapes, self.name)
        self.alphabet, self.labels = int(alphabet), int(labels)
        self.vocab_size = max(self.alphabet, self.labels)
        self.default_length = Integer(1)("task.default_length", default_length, self.name)
        self.causal, self.shapes = False, shapes

    def params(self) -> dict:
        return {**{key: getattr(self, key) for key in self.options}, "shapes": self.shapes, "causal": self.causal}

    def check_length(self, length: int) -> None:
        if length < 1:
            raise ValueError(f"{self.name}: length must be >= 1, got {length}")

    def sequence_length(self, length: int) -> int:
        self.check_length(length)
        return length * length

    def cells(self, batch_size: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        """-> the input grid [B, H, W], ids in 0..alphabet-1, on the generator's device."""
        raise NotImplementedError

    def answer(self, cells: torch.Tensor) -> torch.Tensor:
        """cells: [B, H, W] -> labels [B, H, W] in 0..labels-1."""
        raise NotImplementedError

    def sample_grid(self, batch_size: int, height: int, width: int, generator: torch.Generator) -> Batch:
        self.check_length(height)
        self.check_length(width)
        cells = self.cells(batch_size, height, width, generator)  # [B, H, W]
        inputs, targets = cells.flatten(1), self.answer(cells).flatten(1)  # [B, H*W] each
        return Batch(inputs=inputs, targets=targets, loss_mask=torch.ones_like(inputs, dtype=torch.bool),
                     grid=(height, width))

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        return self.sample_grid(batch_size, length, length, generator)

    def train_sample(self, batch_size: int, length: int, train_length: int, generator: torch.Generator) -> Batch:
        width = length
        if self.shapes == "rectangles":
            width = int(torch.randint(1, train_length + 1, (1,), generator=generator, device=generator.device))
        return self.sample_grid(batch_size, length, width, generator)


def marks(generator: torch.Generator, density: float, *shape: int) -> torch.Tensor:
    """Cells marked (1) independently with probability `density`, else 0: long, on the generator's device."""
    return (torch.rand(shape, generator=generator, device=generator.device) < density).long()


def check_density(task: str, density: float) -> float:
    return Real(above=0, most=1)("task.density", density, task)


class Life(GridTask):
    """One step of Conway's Game of Life (B3/S23): a live cell with 2 or 3 live neighbours lives, a dead
    cell with exactly 3 becomes alive, every other cell is dead next; cells outside the grid are dead.
    Cells alive with probability `density`."""

    name = "life"
    data_bytes_per_token = 112.0  # measured 84 (posbench.guard)
    options = ("density",)

    def __init__(self, density: float = 0.5, default_length: int = 8, causal: bool = False,
                 shapes: str = "rectangles"):
        super().__init__(2, 2, default_length, causal, shapes)
        self.density = check_density(self.name, density)

    def cells(self, batch_size, height, width, generator):
        return marks(generator, self.density, batch_size, height, width)  # [B, H, W]

    def answer(self, cells):
        kernel = torch.ones(1, 1, 3, 3, dtype=torch.float32, device=cells.device)
        kernel[0, 0, 1, 1] = 0  # the 8 neighbours, not the cell itself
        neighbours = F.conv2d(cells[:, None].float(), kernel, padding=1)[:, 0].round().long()  # [B, H, W]
        return ((neighbours == 3) | ((cells == 1) & (neighbours == 2))).long()  # [B, H, W]


class GridFlip(GridTask):
    """The grid mirrored left-right: cell (r, c) answers the input at (r, W - 1 - c). Uniform symbols."""

    name = "grid_flip"
    options = ("symbols",)

    def __init__(self, symbols: int = 10, default_length: int = 8, causal: bool = False,
                 shapes: str = "rectangles"):
        self.symbols = Integer(2)("task.symbols", symbols, self.name)
        super().__init__(self.symbols, self.symbols, default_length, causal, shapes)

    def cells(self, batch_size, height, width, generator):
        return uniform_ids(generator, self.symbols, batch_size, height, width)  # [B, H, W]

    def answer(self, cells):
        return cells.flip(-1)  # [B, H, W]


class GridRowCount(GridTask):
    """Each cell answers the number of marked cells in its row, clipped to counts - 1 (the label
    counts - 1 means "that many or more"). Cells marked with probability `density`."""

    name = "grid_row_count"
    options = ("counts", "density")

    def __init__(self, counts: int = 10, density: float = 0.25, default_length: int = 8, causal: bool = False,
                 shapes: str = "rectangles"):
        self.counts = Integer(2)("task.counts", counts, self.name)
        super().__init__(2, self.counts, default_length, causal, shapes)
        self.density = check_density(self.name, density)

    def cells(self, batch_size, height, width, generator):
        return marks(generator, self.density, batch_size, height, width)  # [B, H, W]

    def answer(self, cells):
        per_row = cells.sum(-1, keepdim=True).clamp(max=self.counts - 1)  # [B, H, 1]
        return per_row.expand_as(cells)  # [B, H, W]


class GridNearest(GridTask):
    """Each cell answers its Manhattan distance to the nearest marked cell, clipped to distances - 1
    (also the answer in a grid with no mark). Cells marked with probability `density`."""

    name = "grid_nearest"
    data_bytes_per_token = 160.0  # measured 127 (posbench.guard)
    options = ("distances", "density")

    def __init__(self, distances: int = 10, density: float = 0.1, default_length: int = 8, causal: bool = False,
                 shapes: str = "rectangles"):
        self.distances = Integer(2)("task.distances", distances, self.name)
        super().__init__(2, self.distances, default_length, causal, shapes)
        self.density = check_density(self.name, density)

    def cells(self, batch_size, height, width, generator):
        return marks(generator, self.density, batch_size, height, width)  # [B, H, W]

    def answer(self, cells):
        far = self.distances - 1
        distance = torch.where(cells == 1, 0, far)  # [B, H, W]
        for _ in range(far):  # step t makes every distance <= t exact; past `far` all are clipped anyway
            padded = F.pad(distance, (1, 1, 1, 1), value=far)  # [B, H + 2, W + 2]
            steps = torch.stack((padded[:, :-2, 1:-1], padded[:, 2:, 1:-1], padded[:, 1:-1, :-2],
                                 padded[:, 1:-1, 2:])).amin(0)  # [B, H, W]: the nearest of the 4 neighbours
            distance = torch.minimum(distance, steps + 1).clamp(max=far)
        return distance  # [B, H, W]
