"""Grid tasks: every batch against an independent solver (numpy convolution for life, BFS for
grid_nearest, plain Python for the others), shapes and masks, seeded determinism, the training
draw of rectangles, per-axis position schemes, configs that choose the encoder layout, one real run."""
from collections import deque

import numpy as np
import pytest
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from posbench.positions import GridPositions, PositionScheme, position_scheme
from posbench.build import build
from tasks import REGISTRY
from tasks.grid import GridTask
from tests.helpers import compose_cfg, posbench, read_rows

GRID_TASKS = ["grid_flip", "grid_nearest", "grid_row_count", "life"]


def solve_life(grid: np.ndarray, task) -> np.ndarray:
    """B3/S23 with a dead boundary: the 8-neighbour count as a numpy convolution of the zero-padded grid."""
    kernel = np.array([[1, 1, 1], [1, 0, 1], [1, 1, 1]])
    windows = np.lib.stride_tricks.sliding_window_view(np.pad(grid, 1), (3, 3))  # [H, W, 3, 3]
    neighbours = (windows * kernel).sum(axis=(-2, -1))
    return ((neighbours == 3) | ((grid == 1) & (neighbours == 2))).astype(np.int64)


def solve_flip(grid: np.ndarray, task) -> np.ndarray:
    return np.array([list(reversed(row)) for row in grid.tolist()])


def solve_row_count(grid: np.ndarray, task) -> np.ndarray:
    return np.array([[min(sum(row), task.counts - 1)] * len(row) for row in grid.tolist()])


def solve_nearest(grid: np.ndarray, task) -> np.ndarray:
    """Multi-source breadth-first search from every mark over the 4-neighbour grid, clipped."""
    height, width = grid.shape
    far = task.distances - 1
    distance = [[None] * width for _ in range(height)]
    queue = deque()
    for r in range(height):
        for c in range(width):
            if grid[r, c] == 1:
                distance[r][c] = 0
                queue.append((r, c))
    while queue:
        r, c = queue.popleft()
        for nr, nc in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
            if 0 <= nr < height and 0 <= nc < width and distance[nr][nc] is None:
                distance[nr][nc] = distance[r][c] + 1
                queue.append((nr, nc))
    return np.array([[far if d is None else min(d, far) for d in row] for row in distance])


SOLVERS = {"life": solve_life, "grid_flip": solve_flip, "grid_row_count": solve_row_count,
           "grid_nearest": solve_nearest}


def test_the_grid_tasks_are_registered():
    assert sorted(name for name, cls in REGISTRY.items() if cls.position_dims == 2) == GRID_TASKS == sorted(SOLVERS)
    assert all(issubclass(REGISTRY[name], GridTask) for name in GRID_TASKS)


@pytest.mark.parametrize("name", GRID_TASKS)
@pytest.mark.parametrize("height, width", [(1, 1), (1, 9), (6, 1), (4, 7), (12, 12)])
def test_batches_match_an_independent_solver(name, height, width):
    task = REGISTRY[name]()
    batch = task.sample_grid(32, height, width, torch.Generator().manual_seed(0))
    cells = height * width
    assert batch.inputs.shape == batch.targets.shape == batch.loss_mask.shape == (32, cells)
    assert batch.grid == (height, width) and batch.loss_mask.all()  # one scored answer per cell
    assert 0 <= batch.inputs.min() and batch.inputs.max() < task.alphabet <= task.vocab_size
    assert 0 <= batch.targets.min() and batch.targets.max() < task.labels <= task.vocab_size
    for inputs, targets in zip(batch.inputs.numpy(), batch.targets.numpy()):
        grid = inputs.reshape(height, width)  # raster order: row by row
        np.testing.assert_array_equal(targets.reshape(height, width), SOLVERS[name](grid, task))


def test_life_known_patterns():
    """A blinker turns; a block stays; cells at the border see dead cells outside."""
    task = REGISTRY["life"]()
    blinker = torch.zeros(1, 5, 5, dtype=torch.long)
    blinker[0, 2, 1:4] = 1
    turned = torch.zeros(1, 5, 5, dtype=torch.long)
    turned[0, 1:4, 2] = 1
    assert torch.equal(task.answer(blinker), turned) and torch.equal(task.answer(turned), blinker)
    block = torch.zeros(1, 4, 4, dtype=torch.long)
    block[0, :2, :2] = 1  # in the corner: still a block with a dead boundary
    assert torch.equal(task.answer(block), block)
    assert task.answer(torch.ones(1, 3, 3, dtype=torch.long)).tolist() == [[[1, 0, 1], [0, 0, 0], [1, 0, 1]]]


def test_nearest_and_row_count_clip_to_their_labels():
    nearest = REGISTRY["grid_nearest"](distances=3)
    marks = torch.zeros(1, 1, 6, dtype=torch.long)
    marks[0, 0, 0] = 1
    assert nearest.answer(marks).tolist() == [[[0, 1, 2, 2, 2, 2]]]
    assert nearest.answer(torch.zeros(1, 2, 2, dtype=torch.long)).tolist() == [[[2, 2], [2, 2]]]  # no mark at all
    count = REGISTRY["grid_row_count"](counts=4)
    rows = torch.tensor([[[1, 1, 1, 1, 1], [0, 1, 0, 0, 1]]])
    assert count.answer(rows).tolist() == [[[3] * 5, [2] * 5]]


@pytest.mark.parametrize("name", GRID_TASKS)
def test_answers_vary_and_are_seeded(name):
    task = REGISTRY[name]()
    a, b, c = (task.sample(16, 6, torch.Generator().manual_seed(seed)) for seed in (5, 5, 6))
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, c.inputs)
    assert a.targets.unique().numel() >= 2


@pytest.mark.parametrize("name", GRID_TASKS)
def test_length_is_the_side(name):
    task = REGISTRY[name]()
    assert task.sequence_length(5) == 25 and task.sample(2, 5, torch.Generator()).grid == (5, 5)
    for call in (lambda: task.sequence_length(0), lambda: task.sample(2, 0, torch.Generator())):
        with pytest.raises(ValueError, match=f"{name}: length must be >= 1, got 0"):
            call()


def test_training_draws_rectangles_with_independent_uniform_sides():
    """H is the runner's drawn length; W is uniform in [1, N] (rectangles), or H (squares)."""
    task, gen = REGISTRY["life"](), torch.Generator().manual_seed(0)
    widths = [task.train_sample(2, 3, 8, gen).grid for _ in range(400)]
    assert {h for h, _ in widths} == {3} and {w for _, w in widths} == set(range(1, 9))
    counts = np.bincount([w for _, w in widths], minlength=9)[1:]
    assert counts.min() > 400 / 8 / 2  # roughly uniform
    squares = REGISTRY["life"](shapes="squares")
    assert squares.train_sample(2, 3, 8, gen).grid == (3, 3)


@pytest.mark.parametrize("make, message", [
    (lambda: REGISTRY["life"](causal=True), r"life: causal=True is not possible.*model.causal=false"),
    (lambda: REGISTRY["life"](shapes="circles"), r"life: task.shapes='circles' is not valid; choose one of"),
    (lambda: REGISTRY["life"](density=0), r"life: task.density=0: must be in \(0, 1\]"),
    (lambda: REGISTRY["grid_flip"](symbols=1), r"grid_flip: task.symbols=1: must be >= 2"),
    (lambda: REGISTRY["grid_row_count"](counts=1), r"grid_row_count: task.counts=1: must be >= 2"),
    (lambda: REGISTRY["grid_nearest"](distances=0), r"grid_nearest: task.distances=0: must be >= 2"),
])
def test_bad_options_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# ---- positions per axis ------------------------------------------------------------------------------

def grid_batch(height, width):
    return REGISTRY["life"]().sample_grid(1, height, width, torch.Generator())


def test_sequential_grid_positions_are_row_and_column_in_raster_order():
    pos = GridPositions("sequential", 10).for_batch(grid_batch(2, 3), torch.Generator())
    assert pos.tolist() == [[[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]]


@pytest.mark.parametrize("scheme", ["randomized", "offset"])
def test_randomized_and_offset_act_on_each_axis(scheme):
    positions, seen = GridPositions(scheme, 12), set()
    for seed in range(30):
        pos = positions.for_batch(grid_batch(3, 5), torch.Generator().manual_seed(seed))[0].view(3, 5, 2)
        rows, cols = pos[:, 0, 0], pos[0, :, 1]
        assert torch.equal(pos[..., 0], rows[:, None].expand(3, 5)) and torch.equal(pos[..., 1], cols.expand(3, 5))
        for axis in (rows, cols):  # sorted, distinct, inside [0, max_position) per axis
            assert torch.all(axis[1:] > axis[:-1]) and 0 <= axis.min() and axis.max() < 12
            if scheme == "offset":
                assert torch.equal(axis - axis[0], torch.arange(len(axis)))
        seen.add((rows[0].item(), cols[0].item()))
    assert len({r for r, _ in seen}) > 1 and len({c for _, c in seen}) > 1 and len(seen) > 5  # axes drawn apart


def test_grid_scheme_is_checked_per_side():
    life = REGISTRY["life"]()
    positions = position_scheme(life, "randomized", None, [8, 4, 32])
    assert isinstance(positions, GridPositions) and positions.max_position == 32  # the longest side, not 32^2
    assert positions.model_extents(life, 8) == {"max_positions": 1024, "train_positions": 1024, "max_side": 32,
                                                "train_side": 32}
    assert position_scheme(life, "sequential", None, [8, 32]).model_extents(life, 8) == {
        "max_positions": 1024, "train_positions": 64, "max_side": 32, "train_side": 8}
    with pytest.raises(ValueError, match=r"max_position=20\) but the largest evaluated grid has 32 cells on a side"):
        position_scheme(life, "randomized", 20, [8, 32])
    copy = REGISTRY["copy"]()
    assert type(position_scheme(copy, "sequential", None, [16, 32])) is PositionScheme


# ---- configs and runs -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", GRID_TASKS)
def test_a_grid_task_chooses_the_encoder_layout(name):
    cfg = compose_cfg(f"task={name}")
    assert cfg.model.causal is False and cfg.task.causal is False
    built = build(compose_cfg(f"task={name}", "encoding=rope_2d"), torch.device("cpu"))
    assert built.model.cfg.causal is False and built.task.params()["causal"] is False
    dims = built.encoding.dims
    assert (dims.train_side, dims.max_side) == (8, 32) and (dims.train_positions, dims.max_positions) == (64, 1024)
    with pytest.raises(InstantiationException, match=f"{name}: causal=True is not possible"):
        instantiate(compose_cfg(f"task={name}", "model.causal=true").task)


def test_a_grid_task_refuses_2d_encodings_elsewhere_and_runs_1d_ones():
    with pytest.raises(ValueError, match="encoding t5_2d reads \\(row, column\\) positions and needs a grid task"):
        build(compose_cfg("task=copy", "encoding=t5_2d"), torch.device("cpu"))
    built = build(compose_cfg("task=life", "encoding=learned"), torch.device("cpu"))
    assert built.encoding.table.shape[0] == 32 * 32  # raster ids of the largest evaluated grid


def test_randomized_grid_positions_train_every_cell_of_the_table():
    built = build(compose_cfg("task=life", "encoding=learned_2d", "train.positions=randomized",
                              "train.max_position=40"), torch.device("cpu"))
    assert built.encoding.table.shape[:2] == (40, 40) and built.positions.max_position == 40


def test_a_grid_run_end_to_end(tmp_path):
    posbench("debug=smoke", "task=life", "encoding=rope_2d", f"hydra.run.dir={tmp_path}")
    rows = read_rows(tmp_path)
    assert [(r["eval_length"], r["eval_sequence_length"]) for r in rows] == [(8, 64), (16, 256)]  # side, cells
    for row in rows:
        assert row["task"] == "life" and row["encoding"] == "rope_2d" and row["status"] == "ok"
        assert row["model"]["causal"] is False and row["train_length"] == 8 and row["train_sequence_length"] == 64
        assert row["task_params"] == {"density": 0.5, "shapes": "rectangles", "causal": False}
        assert 0 <= row["exact_match"] <= row["token_acc"] <= 1
