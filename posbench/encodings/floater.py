"""FLOATER (Liu et al. ICML 2020, "Learning to Encode Position for Transformer with Continuous
Dynamical Model"): positions from an ODE.

    p(t) = p(0) + integral_0^t h(tau, p(tau); theta) dtau,   position k at t_k = k * delta

h is a small MLP (input [p, tau], one tanh hidden layer, output D). The ODE is solved with
a fixed-step classic RK4 (`substeps` steps per interval delta), once per call up to the
largest position asked for, on the grid 0, delta, ..., max * delta; the rows are then
gathered for every sequence. Longer sequences simply integrate further. Gradients flow
through the solver (plain autograd, no adjoint). The paper injects positions in every
layer; here, as an `embed` encoding, they are added once to the input.

Under torch.no_grad (evaluation) the last trajectory is cached and reused until a parameter
changes (an optimiser step or a state-dict load bumps the parameters' version counters).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from posbench.checks import Flag, Integer, Real
from posbench.encodings.base import Encoding, LayerShape, ModelDims, position_range


def rk4_trajectory(func: Callable[[float, torch.Tensor], torch.Tensor], y0: torch.Tensor, step: float,
                   n_steps: int, record_every: int = 1) -> torch.Tensor:
    """Classic 4th-order Runge-Kutta for dy/dt = func(t, y) from y(0) = y0 with a fixed step.

    Returns y at t = 0, record_every * step, ..., n_steps * step (n_steps a multiple of
    record_every): [n_steps // record_every + 1, *y0.shape].
    """
    states, y = [y0], y0
    for i in range(n_steps):
        t = i * step
        k1 = func(t, y)
        k2 = func(t + step / 2, y + step / 2 * k1)
        k3 = func(t + step / 2, y + step / 2 * k2)
        k4 = func(t + step, y + step * k3)
        y = y + step / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        if (i + 1) % record_every == 0:
            states.append(y)
    return torch.stack(states)  # [n_steps // record_every + 1, *y0.shape]

RK4_STEP_BYTES = 56_000  # training: what autograd keeps per integration step (extra_memory)


class Dynamics(nn.Module):
    """h(tau, p) = W2 tanh(W1 [p, tau] + b1) + b2: [D], time -> [D]."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.hidden = nn.Linear(d_model + 1, hidden)
        self.out = nn.Linear(hidden, d_model)

    def forward(self, t: float, p: torch.Tensor) -> torch.Tensor:
        tau = torch.full((*p.shape[:-1], 1), t, dtype=p.dtype, device=p.device)  # [..., 1]
        return self.out(torch.tanh(self.hidden(torch.cat((p, tau), dim=-1))))  # [..., D]


class Floater(Encoding):
    name = "floater"
    hooks = frozenset({"embed"})

    def __init__(self, dims: ModelDims, delta: float = 0.1, substeps: int = 1, hidden: int = 32,
                 learn_initial: bool = True, init_std: float = 0.02):
        super().__init__(dims)
        self.delta = Real(above=0)("encoding.delta", delta, self.name)  # time between positions
        self.substeps = Integer(1)("encoding.substeps", substeps, self.name)
        self.learn_initial = Flag()("encoding.learn_initial", learn_initial, self.name)
        self.init_std = Real(least=0)("encoding.init_std", init_std, self.name)
        self.dynamics = Dynamics(dims.d_model, Integer(1)("encoding.hidden", hidden, self.name))  # hidden layer: nn.Linear's own init
        nn.init.normal_(self.dynamics.out.weight, std=self.init_std)  # slow drift at the start
        nn.init.zeros_(self.dynamics.out.bias)
        if self.learn_initial:
            self.initial = nn.Parameter(torch.randn(dims.d_model) * self.init_std)  # [D]: p(0)
        else:
            self.register_buffer("initial", torch.zeros(dims.d_model), persistent=False)  # [D]: p(0) = 0
        self._cache: tuple[tuple, torch.Tensor] | None = None

    def params(self) -> dict:
        return {"delta": self.delta, "substeps": self.substeps, "hidden": self.dynamics.hidden.out_features,
                "learn_initial": self.learn_initial, "init_std": self.init_std}

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        # training, once per forward: autograd's record of every RK4 step up to the last position (4 calls of
        # the dynamics' MLP, each a few small tensors and their nodes: measured ~56 kB a step at d_model 64)
        return shape.tokens * self.substeps * RK4_STEP_BYTES if shape.training and not layer else 0.0

    def trajectory(self, top: int) -> torch.Tensor:
        """p(k * delta) for k = 0..top: [top + 1, D]. Inside a compiled model it runs as it is, outside the graph:
        unrolled, its steps would take minutes to compile (disabled there only: the decorator imports dynamo)."""
        integrate = torch.compiler.disable(rk4_trajectory) if torch.compiler.is_compiling() else rk4_trajectory
        return integrate(self.dynamics, self.initial, self.delta / self.substeps, top * self.substeps, self.substeps)

    def table(self, top: int) -> torch.Tensor:
        """The trajectory up to at least position top: [>= top + 1, D]; cached when no gradient is needed."""
        if torch.is_grad_enabled():
            return self.trajectory(top)
        key = (self.initial.dtype, self.initial.device, *(p._version for p in self.parameters()))
        if self._cache is None or self._cache[0] != key or self._cache[1].shape[0] <= top:
            self._cache = (key, self.trajectory(top))
        return self._cache[1]

    def embed(self, x: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        pos = pos.long()
        span = position_range(pos)  # None in a compiled or recorded step: up to the training positions' bound
        if span is not None and span[0] < 0:
            raise IndexError(f"floater integrates forward from position 0 but got position {span[0]}")
        top = span[1] if span is not None else self.dims.train_positions - 1
        return x + self.table(top)[pos].to(x.dtype)  # [B, L, D]
