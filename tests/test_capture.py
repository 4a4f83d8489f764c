"""train.compile=capture (posbench/capture.py) on the CPU, where it runs without a graph: the static buffers,
the warm-up that is undone and the graph per shape and phase, against the uncompiled run's exact losses.
The capture itself runs on CUDA only (tests/test_cuda.py)."""
import copy

import pytest
import torch
from omegaconf import OmegaConf

from posbench import capture, distributed
from posbench.build import build
from posbench.capture import WARMUP_STEPS, CapturedSteps, HostReads
from posbench.encodings import cope as cope_module
from posbench.encodings.base import bias_by_offset, graph_safe
from posbench.training import make_optimizer, train_step
from tests.helpers import (ENCODING_CASES, compose_cfg, make_encoding, positions_for, posbench, read_rows,
                           trained_looking_model, with_layouts)


def test_a_captured_run_trains_to_the_uncompiled_runs_exact_losses_on_the_cpu(tmp_path):
    """Uniform lengths: a buffer set per length; drope (rope, then none) drops at half the steps: another set
    per phase."""
    common = ["debug=smoke", "device=cpu", "encoding=drope", "encoding.drop_at=0.5", "train.steps=30",
              "eval.ratios=[1,2]"]
    rows = {}
    for mode in ("false", "capture"):
        posbench(*common, f"train.compile={mode}", f"hydra.run.dir={tmp_path / mode}")
        rows[mode] = read_rows(tmp_path / mode)
    assert [r["loss"] for r in rows["capture"]] == [r["loss"] for r in rows["false"]]  # the same float ops
    assert [r["data_fingerprint"] for r in rows["capture"]] == [r["data_fingerprint"] for r in rows["false"]]


def built_copy_model():
    cfg = compose_cfg("debug=smoke", "device=cpu", "train.compile=capture")
    built = build(cfg, torch.device("cpu"))
    return cfg, built


def test_the_warm_up_before_a_new_shape_is_undone_and_each_shape_and_phase_has_its_buffers(monkeypatch):
    cfg, built = built_copy_model()
    model, task = built.model.train(), built.task
    optimizer = make_optimizer(model, cfg.train)
    calls = []

    def step(batch, positions):
        calls.append(tuple(batch.inputs.shape))
        return train_step(model, model, task, batch, positions, optimizer, cfg.train, torch.device("cpu"),
                          static_gradients=True)

    captured = CapturedSteps(model, optimizer, step, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    batch = task.train_sample(4, 5, built.train_length, generator)
    positions = torch.arange(batch.inputs.shape[1])[None]
    reference = copy.deepcopy(model)
    reference_optimizer = make_optimizer(reference, cfg.train)
    loss, _ = captured(batch, positions)
    want, _ = train_step(reference, reference, task, batch, positions, reference_optimizer, cfg.train,
                         torch.device("cpu"))
    assert len(calls) == WARMUP_STEPS + 1 and loss.item() == want.item()  # the warm-up left no trace
    for got, expected in zip(model.parameters(), reference.parameters()):
        assert torch.equal(got, expected)
    captured(task.train_sample(4, 5, built.train_length, generator), positions)  # the same shape: no warm-up
    assert len(calls) == WARMUP_STEPS + 2 and len(captured.graphs) == 1
    captured(batch, positions, phase=(True,))  # another phase: its own buffers, warmed up again
    longer = task.train_sample(4, 7, built.train_length, generator)
    captured(longer, torch.arange(longer.inputs.shape[1])[None])
    assert len(captured.graphs) == 3 and len(calls) == 3 * WARMUP_STEPS + 4
    monkeypatch.setattr(capture, "MOST_GRAPHS", 3)
    longest = task.train_sample(4, 9, built.train_length, generator)
    with pytest.raises(RuntimeError, match="at most .* this run drew a 4th"):
        captured(longest, torch.arange(longest.inputs.shape[1])[None])


def test_capture_refuses_more_training_shapes_than_it_keeps_graphs():
    with pytest.raises(ValueError, match="at most 64 .* here train.length=65"):
        build(compose_cfg("debug=smoke", "device=cpu", "train.compile=capture", "train.length=65"), torch.device("cpu"))
    build(compose_cfg("debug=smoke", "device=cpu", "train.compile=capture", "train.length=65", "train.lengths=fixed"),
          torch.device("cpu"))  # one shape


def test_capture_is_refused_under_torchrun(monkeypatch):
    monkeypatch.setattr(distributed, "size", lambda: 2)
    cfg = compose_cfg("debug=smoke", "device=cpu", "train.compile=capture")
    with pytest.raises(ValueError, match="train.compile=capture trains one process"):
        build(cfg, torch.device("cpu"))
    OmegaConf.update(cfg, "train.compile", False)
    build(cfg, torch.device("cpu"))  # the uncaptured run is not refused


def training_step_under_capture(model, ids, pos) -> None:
    """What CapturedSteps' warm-up runs on the CPU: a training step (forward, backward, AdamW) in graph_safe,
    watched for reads back to the host."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with HostReads(optimizer), graph_safe():
        model(ids, pos).sin().sum().backward()
        optimizer.step()


@pytest.mark.parametrize("case,causal", with_layouts(ENCODING_CASES))
def test_every_encodings_training_step_reads_nothing_back_to_the_host(case, causal):
    """A CUDA graph cannot record a read back to the host: in graph_safe every hook takes its path that reads
    none (floater, learned_2d, cope and the relative bias rows had one each), on auto's backend (eager for the
    hooks sdpa cannot run)."""
    model = trained_looking_model(case, backend="auto", causal=causal).train()
    ids = torch.randint(0, 11, (2, 24), generator=torch.Generator().manual_seed(0))
    training_step_under_capture(model, ids, positions_for(model.encoding, 24))


def test_a_host_read_in_a_captured_step_is_refused_on_the_cpu_naming_where(monkeypatch):
    """CoPE's table rows read on the host, as before graph_safe: the warm-up refuses it, as the capture on CUDA
    would fail, naming the line; the optimizer's own reads on the CPU (AdamW's step counts) are not counted."""
    monkeypatch.setattr(cope_module, "host_reads_allowed", lambda: True)
    model = trained_looking_model("cope").train()
    ids = torch.randint(0, 11, (2, 24), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=r"cannot record .* a value read on the host .* at "
                                           r"posbench/encodings/cope\.py:\d+; use train\.compile=graphs or false"):
        training_step_under_capture(model, ids, torch.arange(24)[None])


def test_the_relative_bias_rows_of_a_recorded_step_cover_the_training_offsets_with_the_same_values():
    """bias_by_offset reads the positions' range on the host; in graph_safe it takes every offset the training
    positions allow instead (ModelDims.train_positions): the same bias at each offset the positions span."""
    encoding = make_encoding("kerple", n_heads=2, max_positions=64)
    torch.nn.init.normal_(encoding.raw_r1, std=0.3)
    q_pos = torch.tensor([[5, 9, 20]])
    rows, _, first = bias_by_offset(encoding, q_pos, q_pos, 0)  # offsets -15 .. 15
    with graph_safe():
        bounded, first_tensor, bound_first = bias_by_offset(encoding, q_pos, q_pos, 0)  # offsets -63 .. 63
    assert (first, bound_first, int(first_tensor)) == (-15, -63, -63) and bounded.shape == (2, 127)
    assert torch.equal(bounded[:, first - bound_first:][:, :rows.shape[1]], rows)
