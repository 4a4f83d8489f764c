"""Naive absolute baselines (article 003): the raw index, the length-normalised index, the bits.

`index` adds p_k = k and `normalized` adds p_k = k / (n - 1) (n = length of the current
input), either broadcast to every channel or along a learned direction w (`learned_scale`).
Broadcast to every channel is the article's literal idea, but a pre-LN model erases it:
LayerNorm subtracts the channel mean, and a constant vector is all mean, so
LN(x + c*1) = LN(x) in every block and at the output. With posbench's pre-LN transformer
`learned_scale: false` therefore behaves like nope; `learned_scale: true` (k * w) is the
default so that the baseline actually carries its (unbounded / length-dependent) signal.

`binary` writes the bits of k as +-1 features in the first ceil(log2(max_positions))
channels (bit 0, the least significant, in channel 0) and zeros in the rest: no parameters,
so the encoding is exactly the article's table (the alternative, a learned projection of
the bits, would mix in a learned embedding and is not offered).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posbench.checks import Flag, Real
from posbench.encodings.base import Encoding, ModelDims, position_range


class ScalarPosition(Encoding):
    """x + s(k) * w: a scalar per position along a learned direction w, or on every channel."""

    hooks = frozenset({"embed"})

    def __init__(self, dims: ModelDims, learned_scale: bool = True, init_std: float = 0.02):
        super().__init__(dims)
        self.learned_scale = Flag()("encoding.learned_scale", learned_scale, self.name)
        self.init_std = Real(least=0)("encoding.init_std", init_std, self.name)
        if self.learned_scale:
            self.scale = nn.Parameter(torch.randn(dims.d_model) * self.init_std)  # [D]

    def params(self) -> dict:
        return {"learned_scale": self.learned_scale, "init_std": self.init_std if self.learned_scale else None}

    def scalar(self, pos: torch.Tensor, length: int) -> torch.Tensor:
        """pos: [B', L] -> the scalar s(k) per position, float64: [B', L]."""
        raise NotImplementedError

    def embed(self, x: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        value = self.scalar(pos, x.shape[1]).to(x.dtype)[..., None]  # [B', L, 1]
        if self.learned_scale:
            return x + value * self.scale.to(x.dtype)  # [B, L, D]
        return x + value  # [B, L, D]: the same value on every channel


class Index(ScalarPosition):
    """p_k = k (* w): unbounded, so positions past training are values never seen."""

    name = "index"

    def scalar(self, pos, length):
        return pos.to(torch.float64)  # [B', L]


class Normalized(ScalarPosition):
    """p_k = k / (n - 1) (* w), n the length of the current input; 0 when n = 1.

    Bounded in [0, 1] for positions 0..n-1, but the spacing 1/(n-1) between neighbours
    changes with n, and n counts the whole input: in a causal model a token's encoding
    depends on how many tokens follow it (article 003's objection, kept on purpose).
    """

    name = "normalized"

    def scalar(self, pos, length):
        if length == 1:
            return torch.zeros(pos.shape, dtype=torch.float64, device=pos.device)  # [B', 1]
        return pos.to(torch.float64) / (length - 1)  # [B', L]


def position_bits(pos: torch.Tensor, n_bits: int) -> torch.Tensor:
    """Bit b of k as +1 (set) / -1 (clear), bit 0 first: [...] integer -> [..., n_bits] float64."""
    weights = 2 ** torch.arange(n_bits, device=pos.device)  # [n_bits]
    bits = torch.div(pos.long()[..., None], weights, rounding_mode="floor") % 2  # [..., n_bits]
    return bits.to(torch.float64) * 2 - 1


class Binary(Encoding):
    name = "binary"
    hooks = frozenset({"embed"})

    def __init__(self, dims: ModelDims):
        super().__init__(dims)
        # enough bits to write every position 0..max_positions-1 (ceil(log2 P), at least 1)
        self.n_bits = max(1, (dims.max_positions - 1).bit_length())
        if self.n_bits > dims.d_model:
            raise ValueError(f"binary needs {self.n_bits} channels to write positions up to "
                             f"{dims.max_positions - 1} in bits, but model.d_model={dims.d_model}; "
                             f"set model.d_model >= {self.n_bits} or shorten the evaluation lengths")

    def params(self) -> dict:
        return {"n_bits": self.n_bits}

    def embed(self, x: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        span = position_range(pos)
        if span is not None and (span[0] < 0 or span[1] >= 2 ** self.n_bits):
            raise IndexError(f"binary encoding writes positions 0..{2 ** self.n_bits - 1} in {self.n_bits} bits "
                             f"but got positions {span[0]}..{span[1]}; the run sized it from its eval lengths")
        bits = position_bits(pos, self.n_bits).to(x.dtype)  # [B', L, n_bits]
        return x + F.pad(bits, (0, x.shape[-1] - self.n_bits))  # [B, L, D]: zeros past the bits
