"""2-D rotary embeddings for grids (Heo et al. ECCV 2024, "Rotary Position Embedding for Vision
Transformer"; naver-ai/rope-vit). Pairs as in posbench.encodings.rope (`interleaved`, rope-vit's
complex pairs, or `half`); d is the head size, d/2 pairs in all.

rope_2d (RoPE-Axial; EVA-02's 2-D rope): pair t < d/4 rotates by theta_t * column, pair
  t + d/4 by theta_t * row, theta_t = base^(-t/(d/4)) = 1 / base^(4t/d), base 100 as in the
  paper for small grids. The paper writes the axes alternating (R(n, 2t) by x, R(n, 2t+1) by y);
  its code concatenates them as here: the same logits up to a fixed permutation of pairs.
rope_mixed (RoPE-Mixed): pair t of head h in layer l rotates by fx[l,h,t] * column + fy[l,h,t] * row,
  with fx, fy learned. Init per layer and head: a random angle a; pairs t < d/4 take
  (fx, fy) = mag_t * (cos a, sin a), pairs t + d/4 the same at a + pi/2, mag_t = 1 / base^(4t/d),
  base 10. Both are relative in the 2-D offset: <R(p) q, R(p') k> depends on p - p' only.

Scalings (posbench.encodings.rope.SCALINGS) act per axis at evaluation past the trained side:
s = eval side / train side on each axis (the runner counts a grid's tokens, side^2, so sides are
their square roots; evaluation grids are squares, so both axes share s). rope_2d's d/4
frequencies per axis are the 1-D rope's for a head of d/2, so each scaling applies to them as
written. rope_mixed's frequencies are learned: each pair's frequencies (fx, fy) are multiplied
by the factor the scaling gives its init magnitude mag_t (exactly 1/s for pi; for ntk and yarn
the factor of the 1-D rule at that pair index). YaRN's attention factor multiplies q and k.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from posbench.checks import Choice, Real
from posbench.encodings.base import Encoding, ModelDims, require_grid
from posbench.encodings.rope import LAYOUTS, SCALINGS, rope_inv_freq, rotate_by_angles


def axis_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """theta_t = 1 / base^(4t/d), t < d/4: the 1-D rope frequencies of a head of d/2. -> [d/4] float64."""
    return rope_inv_freq(head_dim // 2, base)


def axial_angles(pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """pos: [B', L, 2] (row, column), inv_freq: [d/4] -> [B', 1, L, d/2]: column pairs, then row pairs."""
    rows, cols = pos.to(inv_freq.dtype).unbind(-1)  # [B', L] each
    angles = torch.cat((cols[..., None] * inv_freq, rows[..., None] * inv_freq), dim=-1)  # [B', L, d/2]
    return angles[:, None]  # [B', 1, L, d/2]


def mixed_angles(pos: torch.Tensor, fx: torch.Tensor, fy: torch.Tensor) -> torch.Tensor:
    """pos: [B', L, 2] (row, column), fx, fy: [H, d/2] -> [B', H, L, d/2], fx * column + fy * row."""
    rows, cols = pos.to(fx.dtype).unbind(-1)  # [B', L] each
    return cols[:, None, :, None] * fx[None, :, None] + rows[:, None, :, None] * fy[None, :, None]


def mixed_init(head_dim: int, n_heads: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rope-vit's RoPE-Mixed init for one layer, from the global RNG: (fx, fy), each [H, d/2]."""
    mag = axis_inv_freq(head_dim, base).float()  # [d/4]
    angle = torch.rand(n_heads, 1) * 2 * math.pi  # [H, 1]
    second = angle + math.pi / 2
    fx = torch.cat((mag * angle.cos(), mag * second.cos()), dim=-1)  # [H, d/2]
    fy = torch.cat((mag * angle.sin(), mag * second.sin()), dim=-1)  # [H, d/2]
    return fx, fy


def check_rope_2d(name: str, dims: ModelDims, base: float, layout: str, scaling: str, scaling_factor) -> None:
    require_grid(name, dims)
    Choice(LAYOUTS)("encoding.layout", layout, name)
    Choice(SCALINGS)("encoding.scaling", scaling, name)
    Real(above=1)("encoding.base", base, name)  # magnitudes 1 / base^(4t/d) must fall with t
    Real(least=1, null="eval side / train side")("encoding.scaling_factor", scaling_factor, name)
    if dims.head_dim % 4:
        raise ValueError(f"{name} gives a quarter of each head's features (half its pairs) to each axis and needs "
                         f"a head size divisible by 4, got model.d_model / model.n_heads = {dims.d_model}/"
                         f"{dims.n_heads} = {dims.head_dim}; change model.d_model or model.n_heads")
    if scaling_factor is not None and scaling == "none":
        raise ValueError(f"{name}: encoding.scaling_factor={scaling_factor} needs a scaling among "
                         f"{[s for s in SCALINGS if s != 'none']}")
    SCALINGS[scaling](dims.head_dim // 2, base, 2, 4, scaling_factor)  # a bad setting fails before training


def eval_sides(train_positions: int, eval_positions: int) -> tuple[int, int]:
    """The grid sides behind the runner's token counts (side^2 for the square grids it evaluates)."""
    return math.isqrt(train_positions), math.isqrt(eval_positions)


class GridRoPE(Encoding):
    """What the two 2-D rotations share: settings, the training-time reset of any scaling, and the
    rotation of q and k by per-position angles (times YaRN's attention factor)."""

    hooks = frozenset({"qk"})
    relative = True
    position_dims = 2

    def __init__(self, dims: ModelDims, base: float, layout: str, scaling: str, scaling_factor: float | None):
        super().__init__(dims)
        check_rope_2d(self.name, dims, base, layout, scaling, scaling_factor)
        self.base, self.layout, self.scaling = float(base), layout, scaling
        self.scaling_factor = None if scaling_factor is None else float(scaling_factor)
        self.attention_factor = 1.0

    def params(self) -> dict:
        return {"base": self.base, "layout": self.layout, "scaling": self.scaling,
                "scaling_factor": self.scaling_factor}

    def train(self, mode: bool = True):
        if mode:  # training: the unscaled frequencies
            self.set_eval_length(1, 1)
        return super().train(mode)

    def rotate(self, q, k, q_angles, k_angles):
        q = rotate_by_angles(q, q_angles, self.layout)  # [B, H, Lq, d]
        k = rotate_by_angles(k, k_angles, self.layout)  # [B, H, Lk, d]
        if self.attention_factor != 1.0:  # YaRN: cos and sin scaled, so the logits by its square
            q, k = q * self.attention_factor, k * self.attention_factor
        return q, k


class RoPE2D(GridRoPE):
    name = "rope_2d"

    def __init__(self, dims: ModelDims, base: float = 100.0, layout: str = "interleaved", scaling: str = "none",
                 scaling_factor: float | None = None):
        super().__init__(dims, base, layout, scaling, scaling_factor)
        self.register_buffer("inv_freq", axis_inv_freq(dims.head_dim, self.base), persistent=False)  # [d/4]

    def set_eval_length(self, train_positions: int, eval_positions: int) -> None:
        train_side, eval_side = eval_sides(train_positions, eval_positions)
        scaling = self.scaling if eval_side > train_side else "none"
        inv_freq, self.attention_factor = SCALINGS[scaling](self.dims.head_dim // 2, self.base, train_side,
                                                            eval_side, self.scaling_factor)
        self.inv_freq = inv_freq.to(device=self.inv_freq.device, dtype=self.inv_freq.dtype)

    def qk(self, q, k, q_pos, k_pos, layer):
        inv_freq = self.inv_freq.to(torch.promote_types(q.dtype, torch.float32))
        return self.rotate(q, k, axial_angles(q_pos, inv_freq), axial_angles(k_pos, inv_freq))


class RoPEMixed(GridRoPE):
    name = "rope_mixed"

    def __init__(self, dims: ModelDims, base: float = 10.0, layout: str = "interleaved", scaling: str = "none",
                 scaling_factor: float | None = None):
        super().__init__(dims, base, layout, scaling, scaling_factor)
        fx, fy = zip(*(mixed_init(dims.head_dim, dims.n_heads, self.base) for _ in range(dims.n_layers)))
        self.freqs = nn.Parameter(torch.stack((torch.stack(fx), torch.stack(fy))))  # [2, layers, H, d/2]
        self.register_buffer("freq_scale", torch.ones(dims.head_dim // 2), persistent=False)  # [d/2]

    def set_eval_length(self, train_positions: int, eval_positions: int) -> None:
        train_side, eval_side = eval_sides(train_positions, eval_positions)
        scaling = self.scaling if eval_side > train_side else "none"
        half = self.dims.head_dim // 2
        inv_freq, self.attention_factor = SCALINGS[scaling](half, self.base, train_side, eval_side,
                                                            self.scaling_factor)
        factor = (inv_freq / rope_inv_freq(half, self.base)).repeat(2)  # [d/2]: pairs t and t + d/4 share mag_t
        self.freq_scale = factor.to(device=self.freq_scale.device, dtype=self.freq_scale.dtype)

    def qk(self, q, k, q_pos, k_pos, layer):
        compute = torch.promote_types(q.dtype, torch.float32)
        fx, fy = (f.to(compute) * self.freq_scale.to(compute) for f in self.freqs[:, layer])  # [H, d/2] each
        return self.rotate(q, k, mixed_angles(q_pos, fx, fy), mixed_angles(k_pos, fx, fy))
