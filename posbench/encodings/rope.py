"""Rotary position embedding (Su et al. 2021, RoFormer), and its evaluation-time scalings.

Feature pairs are rotated by k * theta_m, theta_m = base^(-2m/d). Two named layouts:
`interleaved` pairs (x_2m, x_2m+1) as in the paper; `half` pairs (x_m, x_m+d/2) as in
GPT-NeoX / LLaMA. They give the same logits up to a fixed permutation of features.

Partial rotation (GPT-NeoX's rotary_pct, GPT-J's rotary_dim; Kazemnejad et al. 2023 rotate a
quarter): only the first d' = round(rotary_fraction * d) features of each head rotate, with their
own frequencies theta_m = base^(-2m/d'), the layout applied within them; the other d - d' pass
through unchanged. The scalings then act on the rotated part: their d is d' (as transformers'
modeling_rope_utils uses partial_rotary_factor).

Scalings (SCALINGS, name -> pure function, in the style of transformers'
ROPE_INIT_FUNCTIONS) stretch a model trained on N positions to L > N positions at
evaluation time; each returns (inv_freq [d/2] float64, attention_factor), the factor
multiplying q and k, hence the logits by its square (a temperature on the whole logit; with
partial rotation transformers scales only the rotated part, through cos and sin). Scale s = L / N
when L > N (or a forced `scaling_factor`):
  none         theta_m unchanged
  pi           position interpolation (Chen et al. 2023): positions k / s, i.e. theta_m / s
  ntk          static NTK-aware: base' = base * s^(d/(d-2))
  dynamic_ntk  NTK base recomputed from the evaluation length, transformers' rule
               base' = base * (f * L / N - (f - 1))^(d/(d-2)), f = scaling_factor or 1
  yarn         YaRN (Peng et al. 2023): per pair, a ramp between theta_m / s and theta_m by
               the number of rotations r = N / wavelength the pair makes within N
               (beta_slow = 1, beta_fast = 32; ENCODINGS.md's alpha, beta), attention
               factor 0.1 ln s + 1
  longrope     LongRoPE (Ding et al. 2024) in Phi-3's form: theta_m / lambda_m with given per-pair
               factor vectors, `short_factors` while L <= N and `long_factors` past N (strictly);
               past N the attention factor sqrt(1 + ln s / ln N). The one scaling that acts within
               N too (its short factors, in training as well); its attention factor stays 1 there.
               `start_positions` n̂ (the paper's start tokens, default 0): positions < n̂ keep
               theta_m and factor 1 wherever the rest is scaled (below)
With f = 1 (no forced factor), ntk and dynamic_ntk give the same base at every length,
since each evaluation runs whole sequences of one length; a forced factor separates them
(ntk keeps base * f^(d/(d-2)) at every L > N, dynamic_ntk grows from base at L = N).

Kept frequencies: both rules keep the K highest frequencies of the rotated pairs (theta_m falls
with m) and set the others to 0, so those pairs never turn (position-independent features), in
training and in evaluation, whatever the scaling:
  frequency_fraction p  p-RoPE (Barbero et al. 2025, arXiv 2410.06205; Gemma's rope_proportion,
               transformers' proportional rope): K = floor(p * d/2), theta_m = base^(-2m/d) with d the
               rotated size (the whole head unless rotary_fraction < 1). Not rotary_fraction, which
               recomputes base^(-2m/d') over fewer features and so keeps the lowest frequencies too
  frequency_cut=hope  HoPE (Chen et al. 2024, arXiv 2410.21216): the pairs that cannot complete one
               turn within the training positions N, theta_m < 2 pi / N, stop turning (N: the
               model's train_positions, never the evaluation length)
With both, the fewer K wins. p = 1 and cut none leave every frequency as it was.

Resonance RoPE (Wang et al. 2024, arXiv 2403.00071; sheryc/resonance_rope): `resonance=true` rounds
every pair's wavelength 2 pi / theta to the nearest integer after the scaling (so with yarn it is
Resonance YaRN), theta' = 2 pi / round(2 pi / theta), and rotates pair m by (k mod lambda_m) theta'_m,
lambda_m the integer wavelength: angles repeat exactly every lambda_m positions, so a pair whose
wavelength fits in the training positions meets no angle past N it has not met (the official
code builds its cos and sin tables the same way, per pair from arange(lambda_m) repeated). Pairs
at frequency 0 (p-RoPE, HoPE) stay still.

LongRoPE's start positions (microsoft/LongRoPE, `longrope` branch,
rope/LlamaLongRoPEScaledStartTokenRotaryEmbedding.py): the first n̂ rows of the scaled cos and sin
(which carry the attention factor m) are overwritten by plain rope's (no factor). So a position
k < n̂ rotates by k theta_m at factor 1 (the kept pairs as everywhere), k >= n̂ by k theta_m / lambda_m
at factor m. A key j < n̂ meets a query i >= n̂ as m q_i . R(i theta / lambda - j theta) k_j: no
longer a function of i - j, so such an encoding is not `relative` while its frequencies or factor
differ from rope's: past N, and within N (training included) with short factors, as the official class
splits at every length; within N without short factors n̂ changes nothing.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from posbench.checks import Choice, Flag, Integer, Items, Real
from posbench.encodings.base import Encoding, ModelDims

LAYOUTS = ("half", "interleaved")
FREQUENCY_CUTS = ("none", "hope")
YARN_BETA_FAST = 32.0  # pairs making more rotations than this within N keep theta_m
YARN_BETA_SLOW = 1.0  # pairs making fewer rotations than this within N are fully interpolated


def rope_inv_freq(head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """theta_m = base^(-2m/d) for m = 0..d/2-1, float64: [d/2]."""
    return base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def rotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, layout: str) -> torch.Tensor:
    """x: [B, H, L, d], pos: [B', L], inv_freq: [d/2] -> [B, H, L, d]."""
    compute = torch.promote_types(x.dtype, torch.float32)
    angles = pos.to(compute)[:, None, :, None] * inv_freq.to(compute)  # [B', 1, L, d/2]
    return rotate_by_angles(x, angles, layout)


def resonant(inv_freq: torch.Tensor) -> torch.Tensor:
    """Resonance RoPE's theta' = 2 pi / round(2 pi / theta) per pair; 0 stays 0 (a pair that never turns). [d/2]."""
    wavelength = torch.round(2 * math.pi / inv_freq).clamp(min=1)  # [d/2]; inf where theta = 0
    return 2 * math.pi / wavelength


def resonant_angles(pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(k mod lambda_m) theta'_m, lambda_m = 2 pi / theta'_m an integer (inf for a still pair): every
    angle below 2 pi, so periods stay exact at any position. pos: [B', L] -> [B', 1, L, d/2]."""
    wavelength = torch.round(2 * math.pi / inv_freq.double())  # [d/2]
    steps = torch.remainder(pos.double()[:, None, :, None], wavelength)  # [B', 1, L, d/2]
    return (steps * inv_freq.double()).to(dtype)


def rotate_by_angles(x: torch.Tensor, angles: torch.Tensor, layout: str) -> torch.Tensor:
    """Rotates feature pair m by angles[..., m]. x: [B, H, L, d], angles: [B', 1 or H, L, d/2] -> [B, H, L, d]."""
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    if layout == "interleaved":
        x1, x2 = x[..., 0::2], x[..., 1::2]  # [B, H, L, d/2] each
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)  # [B, H, L, d]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # [B, H, L, d/2] each
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # [B, H, L, d]


# --- scalings: (head_dim, base, train_positions, eval_positions, scaling_factor) -> (inv_freq, attention_factor)

ScalingFn = Callable[[int, float, int, int, float | None], tuple[torch.Tensor, float]]


def length_scale(train_positions: int, eval_positions: int, scaling_factor: float | None) -> float:
    """s: the forced factor if given, else L / N when the evaluation is longer than training, else 1."""
    if scaling_factor is not None:
        return float(scaling_factor)
    return max(eval_positions / train_positions, 1.0)


def ntk_exponent(head_dim: int) -> float:
    """d / (d - 2): the power that makes the lowest frequency exactly theta_{d/2-1} / s."""
    if head_dim <= 2:
        raise ValueError(f"NTK-aware rope scaling needs a rotated head size above 2 (base' = base * s^(d/(d-2))), "
                         f"got {head_dim}; rotate more features per head or use another scaling")
    return head_dim / (head_dim - 2)


def no_scaling(head_dim: int, base: float, train_positions: int, eval_positions: int,
               scaling_factor: float | None = None) -> tuple[torch.Tensor, float]:
    return rope_inv_freq(head_dim, base), 1.0


def position_interpolation(head_dim: int, base: float, train_positions: int, eval_positions: int,
                           scaling_factor: float | None = None) -> tuple[torch.Tensor, float]:
    scale = length_scale(train_positions, eval_positions, scaling_factor)
    return rope_inv_freq(head_dim, base) / scale, 1.0


def ntk_aware(head_dim: int, base: float, train_positions: int, eval_positions: int,
              scaling_factor: float | None = None) -> tuple[torch.Tensor, float]:
    scale = length_scale(train_positions, eval_positions, scaling_factor)
    return rope_inv_freq(head_dim, base * scale ** ntk_exponent(head_dim)), 1.0


def dynamic_ntk(head_dim: int, base: float, train_positions: int, eval_positions: int,
                scaling_factor: float | None = None) -> tuple[torch.Tensor, float]:
    factor = 1.0 if scaling_factor is None else float(scaling_factor)
    length = max(eval_positions, train_positions)  # within the training length: the trained base
    growth = factor * length / train_positions - (factor - 1.0)
    return rope_inv_freq(head_dim, base * growth ** ntk_exponent(head_dim)), 1.0


def yarn_pair_index(rotations: float, head_dim: int, base: float, train_positions: int) -> float:
    """The (fractional) pair index m whose wavelength 2 pi / theta_m fits `rotations` times in N:
    N theta_m / (2 pi) = rotations  <=>  m = d ln(N / (2 pi rotations)) / (2 ln base)."""
    return head_dim * math.log(train_positions / (2 * math.pi * rotations)) / (2 * math.log(base))


def yarn(head_dim: int, base: float, train_positions: int, eval_positions: int, scaling_factor: float | None = None,
         beta_fast: float = YARN_BETA_FAST, beta_slow: float = YARN_BETA_SLOW) -> tuple[torch.Tensor, float]:
    """Pairs up to floor(m(beta_fast)) keep theta_m, pairs from ceil(m(beta_slow)) get theta_m / s,
    linear in m between (the ramp of YaRN's released code and of transformers; the paper writes
    the ramp linear in the rotation count r, which agrees outside the ramp)."""
    scale = length_scale(train_positions, eval_positions, scaling_factor)
    theta = rope_inv_freq(head_dim, base)  # [d/2]
    low = max(math.floor(yarn_pair_index(beta_fast, head_dim, base, train_positions)), 0)
    high = min(math.ceil(yarn_pair_index(beta_slow, head_dim, base, train_positions)), head_dim - 1)
    if high == low:
        high += 0.001  # one-pair ramp: avoid 0 / 0, as the reference code
    interpolated = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)  # [d/2]
    inv_freq = theta + (theta / scale - theta) * interpolated  # [d/2]; exactly theta when s = 1
    attention_factor = 0.1 * math.log(scale) + 1.0 if scale > 1 else 1.0
    return inv_freq, attention_factor


def longrope(head_dim: int, base: float, train_positions: int, eval_positions: int,
             scaling_factor: float | None = None, short_factors: list[float] | None = None,
             long_factors: list[float] | None = None) -> tuple[torch.Tensor, float]:
    """theta_m / lambda_m, lambda = short_factors while L <= N, long_factors past N (strictly, as
    transformers' Phi-3 rule); past N the attention factor m = sqrt(1 + ln s / ln N), s = L / N or the
    forced factor (Phi-3 takes it from the configured target length), multiplying cos and sin, so the
    logits by m^2. Within N: the short factors and m = 1 (the trained model). Unset factors: short
    lambda = 1 (theta_m), long lambda = s for every pair (position interpolation, where LongRoPE's
    search starts). The start positions act per position, not per pair: RoPE.place."""
    theta = rope_inv_freq(head_dim, base)  # [d/2]
    if eval_positions <= train_positions:
        return (theta if short_factors is None else theta / torch.tensor(short_factors, dtype=torch.float64)), 1.0
    if train_positions < 2:
        raise ValueError(f"longrope's attention factor sqrt(1 + ln s / ln N) needs N >= 2 training positions, "
                         f"got N = {train_positions}")
    scale = length_scale(train_positions, eval_positions, scaling_factor)
    factors = torch.full_like(theta, scale) if long_factors is None else torch.tensor(long_factors, dtype=torch.float64)
    attention_factor = math.sqrt(1 + math.log(scale) / math.log(train_positions)) if scale > 1 else 1.0
    return theta / factors, attention_factor


SCALINGS: dict[str, ScalingFn] = {
    "none": no_scaling,
    "pi": position_interpolation,
    "ntk": ntk_aware,
    "dynamic_ntk": dynamic_ntk,
    "yarn": yarn,
    "longrope": longrope,
}
WITHIN_TRAINING = frozenset({"longrope"})  # scalings with their own rule at L <= N (the others: theta_m there)
FACTOR_LISTS = {"short_factors": "every lambda_m = 1", "long_factors": "every lambda_m = s"}  # longrope's -> null


def kept_pairs(rotary_dim: int, base: float, frequency_fraction: float, frequency_cut: str,
               train_positions: int) -> int:
    """K: how many of the rotated pairs keep turning, the highest frequencies (m < K). p-RoPE keeps
    floor(p * d/2) (transformers' int(p * d // 2)); HoPE those with theta_m >= 2 pi / N; both: the fewer."""
    kept = math.floor(frequency_fraction * rotary_dim / 2)
    if frequency_cut == "hope":
        turning = rope_inv_freq(rotary_dim, base) >= 2 * math.pi / train_positions  # [d/2], True first
        kept = min(kept, int(turning.sum()))
    return kept


class RoPE(Encoding):
    """scaling: applied by set_eval_length for evaluation lengths beyond the training length only
    (longrope: its short factors within it); training and evaluation within the training length
    use the unscaled frequencies.
    scaling_factor: forces s for pi / ntk / yarn / longrope (instead of L / N) at every evaluation
    length beyond training; for dynamic_ntk it is transformers' `factor` f (default 1).
    original_positions: the context (tokens) the frequencies were first trained at, for
    fine-tuning a checkpoint at a longer N as Chen et al. do: the scaling then acts against
    it, in training (s = this run's training positions / original_positions) and evaluation
    (that s at every length up to the training one, L / original_positions past it).
    rotary_fraction: the share of each head's features that rotate (the first ones); 1 rotates all.
    frequency_fraction, frequency_cut: which rotated pairs keep their frequency (p-RoPE, HoPE; the
    module docstring); the others get frequency 0.
    short_factors, long_factors: longrope's lambda_m, one per rotated pair (null: 1, and s).
    start_positions: longrope's n̂, the first positions kept at rope's theta_m and factor 1 (0: none).
    resonance: Resonance RoPE's integer wavelengths (the module docstring)."""

    name = "rope"
    hooks = frozenset({"qk"})
    relative = True

    def __init__(self, dims: ModelDims, base: float = 10000.0, layout: str = "half", scaling: str = "none",
                 scaling_factor: float | None = None, original_positions: int | None = None,
                 rotary_fraction: float = 1.0, frequency_fraction: float = 1.0, frequency_cut: str = "none",
                 short_factors: list[float] | None = None, long_factors: list[float] | None = None,
                 start_positions: int = 0, resonance: bool = False):
        super().__init__(dims)
        self.resonance = Flag()("encoding.resonance", resonance, self.name)
        Choice(LAYOUTS)("encoding.layout", layout, self.name)
        Choice(SCALINGS)("encoding.scaling", scaling, self.name)
        Choice(FREQUENCY_CUTS)("encoding.frequency_cut", frequency_cut, self.name)
        base = Real(above=1)("encoding.base", base, self.name)  # theta_m = base^(-2m/d) must fall with m
        scaling_factor = Real(least=1, null="L / N")("encoding.scaling_factor", scaling_factor, self.name)
        original_positions = Integer(1, null="this run's training length")("encoding.original_positions",
                                                                           original_positions, self.name)
        rotary_fraction = Real(above=0, most=1)("encoding.rotary_fraction", rotary_fraction, self.name)
        frequency_fraction = Real(least=0, most=1)("encoding.frequency_fraction", frequency_fraction, self.name)
        start_positions = Integer(0)("encoding.start_positions", start_positions, self.name)
        if dims.head_dim % 2:
            raise ValueError(f"{self.name} rotates feature pairs and needs an even head size, got "
                             f"model.d_model / model.n_heads = {dims.d_model}/{dims.n_heads} = {dims.head_dim}; "
                             "change model.d_model or model.n_heads")
        if scaling_factor is not None and scaling == "none":
            raise ValueError(f"rope: encoding.scaling_factor={scaling_factor} has no effect with scaling=none; "
                             f"choose a scaling among {[s for s in SCALINGS if s != 'none']} or drop the factor")
        if original_positions is not None and scaling == "none":
            raise ValueError(f"rope: encoding.original_positions={original_positions} needs a scaling among "
                             f"{[s for s in SCALINGS if s != 'none']}")
        if start_positions and scaling != "longrope":
            raise ValueError(f"rope: encoding.start_positions={start_positions} has no effect with scaling={scaling}; "
                             "set encoding.scaling=longrope or drop the start positions (0)")
        self.rotary_dim = round(rotary_fraction * dims.head_dim)
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"{self.name}: encoding.rotary_fraction={rotary_fraction} rotates round({rotary_fraction}"
                             f" * {dims.head_dim}) = {self.rotary_dim} features of the head size {dims.head_dim} "
                             "(model.d_model / model.n_heads); features rotate in pairs, so that must be even and >= 2")
        self.factor_lists = {key: self.check_factors(key, value, scaling)
                             for key, value in (("short_factors", short_factors), ("long_factors", long_factors))}
        self.original_positions, self.scaling_factor = original_positions, scaling_factor
        self.base, self.layout, self.scaling, self.rotary_fraction = base, layout, scaling, rotary_fraction
        self.frequency_fraction, self.frequency_cut = frequency_fraction, frequency_cut
        self.start_positions = start_positions
        self.kept_pairs = kept_pairs(self.rotary_dim, base, frequency_fraction, frequency_cut, dims.train_positions)
        reference = original_positions or dims.train_positions
        self.frequencies(scaling, reference, 2 * reference)  # a bad setting fails before training
        self.register_buffer("inv_freq", rope_inv_freq(self.rotary_dim, self.base), persistent=False)
        if start_positions:  # rope's theta_m (the kept pairs' cut applied) for the positions below n̂
            self.register_buffer("start_freq", self.frequencies("none", reference, reference)[0], persistent=False)
        self.attention_factor = 1.0
        self.set_eval_length(dims.train_positions, dims.train_positions)  # training's frequencies

    def check_factors(self, key: str, factors, scaling: str) -> list[float] | None:
        """A longrope factor list: one positive lambda_m per rotated pair, and only with scaling=longrope."""
        factors = Items(Real(above=0), null=FACTOR_LISTS[key])(f"encoding.{key}", factors, self.name)
        if factors is None:
            return None
        if scaling != "longrope":
            raise ValueError(f"rope: encoding.{key}={factors} has no effect with scaling={scaling}; "
                             "set encoding.scaling=longrope or drop the factors")
        if len(factors) != self.rotary_dim // 2:
            raise ValueError(f"rope: encoding.{key}={factors} has {len(factors)} factors; longrope needs one per "
                             f"rotated pair, rotary_dim / 2 = {self.rotary_dim // 2}")
        return factors

    def params(self) -> dict:
        return {"base": self.base, "layout": self.layout, "scaling": self.scaling,
                "scaling_factor": self.scaling_factor, "original_positions": self.original_positions,
                "rotary_fraction": self.rotary_fraction, "frequency_fraction": self.frequency_fraction,
                "frequency_cut": self.frequency_cut, **self.factor_lists,
                **({"start_positions": self.start_positions} if self.scaling == "longrope" else {}),  # its only use
                "resonance": self.resonance}

    def frequencies(self, scaling: str, train_positions: int, eval_positions: int) -> tuple[torch.Tensor, float]:
        """The scaling's (inv_freq [d'/2] float64, attention factor), the pairs past kept_pairs at frequency 0."""
        options = self.factor_lists if scaling == "longrope" else {}
        inv_freq, attention_factor = SCALINGS[scaling](self.rotary_dim, self.base, train_positions, eval_positions,
                                                       self.scaling_factor, **options)
        if self.resonance:
            inv_freq = resonant(inv_freq)
        inv_freq[self.kept_pairs:] = 0.0  # p-RoPE / HoPE: these pairs never turn (nothing when all are kept)
        return inv_freq, attention_factor

    def set_eval_length(self, train_positions: int, eval_positions: int) -> None:
        reference = train_positions
        if self.original_positions:  # fine-tuned: never less scaling than the training used
            reference, eval_positions = self.original_positions, max(eval_positions, train_positions)
        scaling = self.scaling if eval_positions > reference or self.scaling in WITHIN_TRAINING else "none"
        inv_freq, self.attention_factor = self.frequencies(scaling, reference, eval_positions)
        self.inv_freq = inv_freq.to(device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        self.split_start = False  # LongRoPE's start positions differ from the rest only while the rest is scaled
        if self.start_positions:
            unscaled, _ = self.frequencies("none", reference, eval_positions)  # [d'/2]
            self.split_start = self.attention_factor != 1.0 or not torch.equal(inv_freq, unscaled)
        self.relative = not self.split_start  # split: a key below n̂ and a later query are not a function of i - j

    def train(self, mode: bool = True):
        if mode:  # training: unscaled, or scaled to its own length past original_positions
            self.set_eval_length(self.dims.train_positions, self.dims.train_positions)
        return super().train(mode)

    def rotate_head(self, x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor | None = None) -> torch.Tensor:
        """Rotates the first rotary_dim features by inv_freq (default: the current frequencies), the rest
        pass through. x: [B, H, L, d], pos: [B', L] -> [B, H, L, d]."""
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        part = x if self.rotary_dim == x.shape[-1] else x[..., :self.rotary_dim]  # [B, H, L, d']
        if self.resonance:
            rotated = rotate_by_angles(part, resonant_angles(pos, inv_freq, torch.promote_types(x.dtype, torch.float32)),
                                       self.layout)
        else:
            rotated = rotate(part, pos, inv_freq, self.layout)
        if self.rotary_dim == x.shape[-1]:
            return rotated
        return torch.cat((rotated, x[..., self.rotary_dim:]), dim=-1)  # [B, H, L, d]

    def place(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x rotated at pos and times the attention factor; LongRoPE's start positions (pos < n̂) rotated
        by rope's theta_m at factor 1 instead. x: [B, H, L, d], pos: [B', L] -> [B, H, L, d]."""
        placed = self.rotate_head(x, pos)
        if self.attention_factor != 1.0:  # YaRN, LongRoPE: q and k scaled, so the logits by its square
            placed = placed * self.attention_factor
        if self.split_start:
            start = (pos < self.start_positions)[:, None, :, None]  # [B', 1, L, 1]
            placed = torch.where(start, self.rotate_head(x, pos, self.start_freq), placed)  # [B, H, L, d]
        return placed

    def qk(self, q, k, q_pos, k_pos, layer):
        return self.place(q, q_pos), self.place(k, k_pos)
