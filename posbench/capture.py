"""train.compile=capture: the whole training step (forward, loss, backward, gradient clipping, AdamW) recorded
once per shape as a CUDA graph and replayed, without torch.compile. A small model's step is hundreds of
kernel launches and a few milliseconds of Python; a replay is one launch. Nothing is compiled, so a run
starts training at once (the graph-captured compile mode, train.compile=graphs, spent 91 s compiling the
default job on an H100 in its first steps).

Each shape (the batch's tensors and the positions) and each training phase of the encoding
(Encoding.train_phase: drope's drop) gets its own graph. A graph reads its inputs from static buffers the
batch is copied into, and writes the loss and metric sums to static outputs, overwritten by the next replay.
Before a shape's capture, WARMUP_STEPS steps run on a side stream (CUDA's requirement) and the parameters,
gradients and optimizer state are then put back as they were, so the run trains on exactly the steps it
draws. The learning rate is a tensor the graphs read (AdamW's `capturable`), set before each replay.

On the CPU there is no graph: the same static buffers, warm-up and restore, then the step run as it is, so
CI tests everything but the capture itself. A step that reads a value back to the host (an encoding's
.item(), a data-dependent shape) cannot be captured: every step of this mode runs under graph_safe, where the
hooks take their paths that read nothing back (posbench.encodings.base.host_reads_allowed), and on the CPU the
warm-up steps watch for such a read before the optimizer's step (HostReads: a value read, nonzero, masked_select)
and refuse naming where it was made, as the capture on CUDA would fail. A `.tolist()` of a CPU tensor reads its
memory without an operator and escapes that watch; on CUDA the capture's error is raised with the mode named.
Gradients are tensors every graph writes, zeroed at each step: a parameter that gets no gradient in a step
is stepped as one whose gradient is zero (AdamW's moments decay and its count advances), where the uncompiled
step leaves it out, so the two differ where a parameter goes unused (after an encoding's phase switch, say).
Each graph keeps its own shape's activations: a run of uniform lengths holds up to N sets of them (at most
MOST_GRAPHS), where the memory guard counts one (posbench.guard): for small models, which this mode is for.
"""
from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from posbench import distributed
from posbench.encodings.base import graph_safe

WARMUP_STEPS = 3  # steps run before each capture (on CUDA, on a side stream), then undone
MOST_GRAPHS = 64  # graphs one run may record (each holds its own activation memory)
TOO_MANY = (f"train.compile=capture records a graph per training shape, at most {MOST_GRAPHS}"
            " (train.lengths=uniform draws train.length shapes); use train.lengths=fixed or train.compile=graphs")


def capture_refusal(train_length: int, lengths: str) -> str | None:
    """Why train.compile=capture cannot train here, or None."""
    if distributed.size() > 1:
        return ("train.compile=capture trains one process (its graph would hold DDP's gradient all-reduce); "
                "use train.compile=false or graphs under torchrun")
    if lengths == "uniform" and train_length > MOST_GRAPHS:
        return f"{TOO_MANY}; here train.length={train_length}"
    return None


HOST_READS = {torch.ops.aten._local_scalar_dense.default: "a value read on the host (.item(), int(), a tensor's truth)",
              torch.ops.aten.nonzero.default: "nonzero (an output sized by the data)",
              torch.ops.aten.masked_select.default: "masked_select (an output sized by the data)"}
PROJECT = Path(__file__).resolve().parent.parent


class HostReads(TorchDispatchMode):
    """Refuses an operator that reads a tensor's values back to the host, naming it and posbench's line that
    called it; paused while the optimizer steps (AdamW reads its step counts on the CPU, and on CUDA runs
    `capturable`, reading none)."""

    supports_higher_order_operators = True  # flex_attention passes through, its inner operators watched

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.paused = False
        self.hooks = [optimizer.register_step_pre_hook(lambda *_: setattr(self, "paused", True)),
                      optimizer.register_step_post_hook(lambda *_: setattr(self, "paused", False))]

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        what = HOST_READS.get(func)
        if what is not None and not self.paused:
            ours = [frame for frame in traceback.extract_stack()
                    if frame.filename.startswith(str(PROJECT)) and not frame.filename.endswith("capture.py")]
            where = f"{Path(ours[-1].filename).relative_to(PROJECT)}:{ours[-1].lineno}" if ours else "torch"
            raise RuntimeError(f"train.compile=capture cannot record this training step as a CUDA graph: {what} at "
                               f"{where}; use train.compile=graphs or false")
        return func(*args, **(kwargs or {}))


def _state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's tensors of state (moments and step counts), in a fixed order."""
    return [value for group in optimizer.param_groups for p in group["params"]
            for value in optimizer.state.get(p, {}).values() if isinstance(value, torch.Tensor)]


class CapturedSteps:
    """One training step per call, on a graph per (shape, training phase); see the module docstring."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step_fn, device: torch.device):
        self.optimizer, self.step_fn, self.device = optimizer, step_fn, device
        self.cuda = device.type == "cuda"
        self.params = [p for p in model.parameters() if p.requires_grad]
        if self.cuda:  # the graphs read the learning rate from this tensor (training.set_learning_rate fills it)
            lr = torch.tensor(float(optimizer.param_groups[0]["lr"]), device=device)
            for group in optimizer.param_groups:
                group["lr"] = lr
        self.graphs: dict[tuple, tuple] = {}  # key -> (graph or None, static batch, static positions, outputs)

    def __call__(self, batch, positions: torch.Tensor, phase=()) -> tuple[torch.Tensor, dict]:
        tensors = [f.name for f in dataclasses.fields(batch) if isinstance(getattr(batch, f.name), torch.Tensor)]
        key = (tuple((name, tuple(getattr(batch, name).shape), getattr(batch, name).dtype) for name in tensors),
               tuple(repr(getattr(batch, f.name)) for f in dataclasses.fields(batch) if f.name not in tensors),
               tuple(positions.shape), phase)
        if key not in self.graphs:
            if len(self.graphs) == MOST_GRAPHS:
                raise RuntimeError(f"{TOO_MANY}; this run drew a {MOST_GRAPHS + 1}th")
            self.graphs[key] = self._capture(batch, positions, tensors)
        graph, static_batch, static_positions, outputs = self.graphs[key]
        for name in tensors:
            getattr(static_batch, name).copy_(getattr(batch, name), non_blocking=True)
        static_positions.copy_(positions, non_blocking=True)
        if graph is None:  # the CPU: the step itself, on the static buffers
            with graph_safe():
                return self.step_fn(static_batch, static_positions)
        graph.replay()
        return outputs

    def _capture(self, batch, positions, tensors: list[str]):
        static_batch = dataclasses.replace(batch, **{name: getattr(batch, name).clone() for name in tensors})
        static_positions = positions.clone()
        saved = self._save()
        stream = torch.cuda.Stream(self.device) if self.cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else HostReads(self.optimizer), graph_safe():
            for _ in range(WARMUP_STEPS):
                self.step_fn(static_batch, static_positions)
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        self._restore(saved)
        if not self.cuda:
            return None, static_batch, static_positions, None
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph), graph_safe():
                outputs = self.step_fn(static_batch, static_positions)
        except RuntimeError as err:
            raise RuntimeError(f"train.compile=capture could not record the training step as a CUDA graph ({err}); "
                               "a step that reads a value back to the host cannot be captured: use "
                               "train.compile=graphs or false") from err
        return graph, static_batch, static_positions, outputs

    def _save(self) -> list[torch.Tensor]:
        """Copies of what a warm-up step changes: the parameters, their gradients and the optimizer state. The
        gradients and the state are created first where they are missing, as zeros (a fresh AdamW's state:
        moments and step counts 0), so that every graph reads and writes the same tensors."""
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if not _state(self.optimizer):
                weights = [p.detach().clone() for p in self.params]
                self.optimizer.step()  # creates the state (and applies weight decay: undone below)
                for tensor in _state(self.optimizer):
                    tensor.zero_()
                for p, weight in zip(self.params, weights):
                    p.copy_(weight)
        return [t.detach().clone() for t in self._tensors()]

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.params, *(p.grad for p in self.params), *_state(self.optimizer)]

    def _restore(self, saved: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for tensor, copy in zip(self._tensors(), saved, strict=True):
                tensor.copy_(copy)
