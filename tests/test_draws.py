"""Where data are drawn (posbench/draws.py): on the CPU from the run's seeded generators, whatever the device,
and fingerprinted so that two runs can be checked to have trained and evaluated on the same sequences."""
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from posbench import draws
from posbench.runinfo import config_hash, group_config
from tasks.base import Batch
from tests.helpers import compose_cfg, posbench, read_rows


def batch(seed: int, length: int = 6) -> Batch:
    gen = draws.generator(seed)
    inputs = torch.randint(0, 10, (2, length), generator=gen)  # [B, T]
    return Batch(inputs=inputs, targets=inputs.roll(-1, 1), loss_mask=torch.ones_like(inputs, dtype=torch.bool))


def digest_of(batches, positions) -> str:
    fingerprint = draws.DataFingerprint()
    for b, pos in zip(batches, positions):
        fingerprint.add(b, pos)
    return fingerprint.digest


def test_the_fingerprint_names_the_batches_in_order_and_continues_from_a_saved_digest():
    b = [batch(seed) for seed in range(3)]
    pos = [torch.arange(7)[None]] * 3  # [1, T]
    whole = digest_of(b, pos)
    assert whole == digest_of([batch(seed) for seed in range(3)], pos)  # the same draws, the same digest
    assert whole != digest_of(b[::-1], pos)  # order counts
    assert whole != digest_of(b, [pos[0], pos[1], pos[2] + 1])  # positions count
    assert whole != digest_of(b[:2], pos)
    resumed = draws.DataFingerprint(digest_of(b[:2], pos))  # a checkpoint carries the digest as text
    resumed.add(b[2], pos[2])
    assert resumed.digest == whole


def test_the_fingerprint_reads_a_batchs_plain_fields_and_the_tensors_dtype_and_shape():
    b = batch(0, length=8)
    as_grid = Batch(inputs=b.inputs, targets=b.targets, loss_mask=b.loss_mask, grid=(2, 4))
    other_grid = Batch(inputs=b.inputs, targets=b.targets, loss_mask=b.loss_mask, grid=(4, 2))
    assert len({digest_of([x], [None]) for x in (b, as_grid, other_grid)}) == 3
    reshaped = Batch(inputs=b.inputs.reshape(4, 4), targets=b.targets.reshape(4, 4),
                     loss_mask=b.loss_mask.reshape(4, 4))
    assert digest_of([b], [None]) != digest_of([reshaped], [None])


def test_moving_to_the_cpu_keeps_the_batch_and_the_combined_fingerprint_needs_both_halves():
    b = batch(0)
    assert draws.to_device(b, torch.device("cpu")) is b
    assert draws.combined(None, "ab") is None and draws.combined("ab", None) is None
    assert draws.combined("", "ab") != draws.combined("", "ac")


def test_a_runs_rows_carry_fingerprints_that_tell_seeds_and_lengths_apart(tmp_path):
    fingerprints = {}
    for seed in (0, 1):
        posbench("debug=smoke", "device=cpu", f"seed={seed}", f"hydra.run.dir={tmp_path / str(seed)}")
        fingerprints[seed] = [row["data_fingerprint"] for row in read_rows(tmp_path / str(seed))]
    assert all(isinstance(f, str) and len(f) == 16 for f in fingerprints[0] + fingerprints[1])
    assert len(set(fingerprints[0])) == len(fingerprints[0])  # each length its own evaluation sequences
    assert not set(fingerprints[0]) & set(fingerprints[1])


def test_no_generator_is_made_outside_draws():
    """Every generator a run draws from comes from draws.generator (a CPU one): a torch.Generator made
    anywhere else in the package (on the device, say) would give a GPU run other sequences."""
    package = Path(draws.__file__).parent
    makers = [f"{path.relative_to(package.parent)}:{number}" for path in sorted(package.rglob("*.py"))
              if path.name != "draws.py"
              for number, line in enumerate(path.read_text().splitlines(), 1) if "torch.Generator(" in line]
    assert not makers, f"generators made outside posbench/draws.py: {makers}"


# stack manipulation at 2,000 tokens, evaluated 16 sequences at a time; the guard's tests add eval.memory_limit
LONG_EVALUATION = ["debug=smoke", "device=cpu", "task=stack_manipulation", "eval.lengths=[2000]", "train.steps=5",
                   "eval.samples=32", "eval.batch_size=16"]


@pytest.fixture(scope="module")
def unguarded(tmp_path_factory) -> dict:
    """The first row of LONG_EVALUATION's run with no memory limit."""
    run_dir = tmp_path_factory.mktemp("whole")
    posbench(*LONG_EVALUATION, f"hydra.run.dir={run_dir}")
    return read_rows(run_dir)[0]


def test_a_guarded_evaluation_batch_draws_the_configured_runs_sequences(tmp_path, unguarded):
    """The guard's smaller evaluation batch (eval.memory_limit) evaluates the sequences the configured batch
    draws: stack manipulation draws each batch whole, so before, its sequences (and scores) changed."""
    guarded = posbench(*LONG_EVALUATION, "eval.memory_limit=40", f"hydra.run.dir={tmp_path / 'guarded'}")
    split = re.search(r"evaluating it (\d+) sequences at a time instead", guarded.stderr)
    assert split and 1 <= int(split[1]) < 16 and "the same sequences" in guarded.stderr, guarded.stderr[-2000:]
    whole, parts = unguarded, read_rows(tmp_path / "guarded")[0]
    assert parts["data_fingerprint"] == whole["data_fingerprint"]
    assert parts["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    assert parts["token_acc"] == pytest.approx(whole["token_acc"], rel=1e-6)


def test_row_blocks_split_every_batch_field_and_keep_the_rest():
    b = batch(0, length=5)
    blocks = draws.row_blocks(b, 1)
    assert len(blocks) == 2 and all(block.inputs.shape == (1, 5) for block in blocks)
    assert torch.equal(torch.cat([block.targets for block in blocks]), b.targets)
    assert draws.row_blocks(b, 2) == [b]


def test_data_too_large_to_draw_whole_are_drawn_fewer_at_a_time_and_the_group_splits(tmp_path, unguarded):
    """Where even eval.batch_size sequences' data would not fit, they are drawn as few at a time as are
    evaluated: other sequences, so config_hash records it (eval.drawn_batch_size) and the group splits."""
    guarded = posbench(*LONG_EVALUATION, "eval.memory_limit=25", f"hydra.run.dir={tmp_path / 'guarded'}")
    assert "other sequences than eval.batch_size=16 draws" in guarded.stderr
    whole, parts = unguarded, read_rows(tmp_path / "guarded")[0]
    drawn = parts["config"]["eval"]["drawn_batch_size"]  # length -> sequences drawn at a time (JSON: text keys)
    assert list(drawn) == ["2000"] and 1 <= drawn["2000"] < 16
    assert parts["config_hash"] != whole["config_hash"] and parts["data_fingerprint"] != whole["data_fingerprint"]


def test_the_device_setting_does_not_split_a_group():
    """device=cpu, cuda or auto run the same experiment (the data are drawn on the CPU): one config_hash, the
    one every committed run (device=auto) has."""
    hashes = {config_hash(group_config(OmegaConf.to_container(compose_cfg(f"device={device}"), resolve=True)))
              for device in ("auto", "cpu", "cuda", "cuda:1")}
    assert len(hashes) == 1
