"""FoPE, Fourier Position Embedding (Hua et al. ICML 2025, arXiv 2412.17739; the configs of
TsinghuaC3I/Fourier-Position-Embedding: separate cos and sin bases, separate heads, zero
frequencies ignored). RoPE's frequencies w_k = base^(-2k/d) below floor_ratio · 2 pi / N (N the
training positions, `dims.train_positions`, never the evaluation length) are dropped: D' remain.
Each layer and head holds two coefficient matrices C^cos, C^sin [D', M], M = min(D', d/4), and
the first M pairs of the half layout (m, m + d/2) turn by Fourier series instead of one frequency:

    c_t[m] = sum_D C^cos[D, m] cos(w_D t),   s_t[m] = sum_D C^sin[D, m] sin(w_D t)
    x'_m = x_m c - x_{m+d/2} s,   x'_{m+d/2} = x_{m+d/2} c + x_m s          (on q and k)

The other pairs get c = s = 1 (position-free, but they double the pair's q.k). Init: xavier-normal
on each layer's [H, D', M] tensor with `gain` (std = gain sqrt(2 / ((D' + H) M))) plus a step eye,
[i ceil(D'/M), i] += 1; drawn from torch's global generator (posbench seeds it before building).
Frozen buffers unless `learnable`. Not relative: the separate cos and sin mixtures make q'.k'
depend on t and s, not t - s alone.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from posbench.checks import Flag, Real
from posbench.encodings.base import Encoding, ModelDims
from posbench.encodings.rope import rope_inv_freq


def kept_frequencies(head_dim: int, base: float, train_positions: int, floor_ratio: float) -> torch.Tensor:
    """The w_k = base^(-2k/d) at or above floor_ratio · 2 pi / N, highest first: [D'] float64."""
    with torch.device("cpu"):  # the count is read on the host: the encoding may be built on the meta device
        kept = int((rope_inv_freq(head_dim, base) >= floor_ratio * 2 * math.pi / train_positions).sum())
    return rope_inv_freq(head_dim, base)[:kept]  # decreasing: the kept ones lead


def step_eye(n_in: int, n_out: int) -> torch.Tensor:
    """[i ceil(n_in / n_out), i] = 1 where the row exists: [n_in, n_out]."""
    eye, step = torch.zeros(n_in, n_out), math.ceil(n_in / n_out)
    for i in range(n_out):
        if i * step < n_in:
            eye[i * step, i] = 1.0
    return eye


class FoPE(Encoding):
    name = "fope"
    hooks = frozenset({"qk"})
    relative = False

    def __init__(self, dims: ModelDims, base: float = 10000.0, gain: float = 0.3, learnable: bool = False,
                 floor_ratio: float = 1.0):
        super().__init__(dims)
        self.base = Real(above=1)("encoding.base", base, self.name)
        self.gain = Real(least=0)("encoding.gain", gain, self.name)
        self.learnable = Flag()("encoding.learnable", learnable, self.name)
        self.floor_ratio = Real(least=0)("encoding.floor_ratio", floor_ratio, self.name)
        d = dims.head_dim
        if d % 2 or d < 4:
            raise ValueError(f"fope rotates feature pairs, d/4 of them by Fourier series, and needs an even head size "
                             f">= 4, got model.d_model / model.n_heads = {dims.d_model}/{dims.n_heads} = {d}; "
                             "change model.d_model or model.n_heads")
        freq = kept_frequencies(d, self.base, dims.train_positions, self.floor_ratio)  # [D']
        if not len(freq):
            raise ValueError(f"fope: no frequency base^(-2k/d) reaches encoding.floor_ratio={self.floor_ratio} x "
                             f"2 pi / {dims.train_positions} (the training positions); lower encoding.floor_ratio")
        self.n_freq, self.n_pairs = len(freq), min(len(freq), d // 4)  # D', M
        self.register_buffer("freq", freq, persistent=False)  # float64, as rope's
        eye = step_eye(self.n_freq, self.n_pairs)  # [D', M]
        coef = {}
        for key in ("sin_coef", "cos_coef"):
            layers = torch.empty(dims.n_layers, dims.n_heads, self.n_freq, self.n_pairs)  # [layers, H, D', M]
            for table in layers:
                nn.init.xavier_normal_(table, gain=self.gain)  # fan_in D' M, fan_out H M
            coef[key] = layers + eye
        for key, table in coef.items():
            if self.learnable:
                setattr(self, key, nn.Parameter(table))
            else:
                self.register_buffer(key, table)  # persistent: a checkpoint keeps the draw

    def params(self) -> dict:
        return {"base": self.base, "gain": self.gain, "learnable": self.learnable, "floor_ratio": self.floor_ratio}

    def place(self, x: torch.Tensor, pos: torch.Tensor, layer: int) -> torch.Tensor:
        """x: [B, H, L, d] at pos [B', L] -> [B, H, L, d]."""
        compute = torch.promote_types(x.dtype, torch.float32)
        angles = pos.to(compute)[:, None, :, None] * self.freq.to(compute)  # [B', 1, L, D']
        pad = (0, x.shape[-1] // 2 - self.n_pairs)
        c = F.pad(angles.cos() @ self.cos_coef[layer].to(compute), pad, value=1.0)  # [B', H, L, d/2]
        s = F.pad(angles.sin() @ self.sin_coef[layer].to(compute), pad, value=1.0)  # [B', H, L, d/2]
        c, s = c.to(x.dtype), s.to(x.dtype)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]  # [B, H, L, d/2] each
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)  # [B, H, L, d]

    def qk(self, q, k, q_pos, k_pos, layer):
        return self.place(q, q_pos, layer), self.place(k, k_pos, layer)
