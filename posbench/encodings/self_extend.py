"""SelfExtend (Jin et al. 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window Without Tuning",
ICML 2024, arXiv 2401.01325): a rope model read past its training length with no training.

The model trains as rope. Evaluated on sequences longer than its training (set_eval_length with
L > N, in eval mode), the rotary content term of query i and key j becomes

    q_i . R(i - j) k_j                        where i - j < W (the neighbour window: plain rope)
    q_i . R(g_q(i) - g_k(j)) k_j              elsewhere, g_q(i) = floor(i/G) + W - W/G, g_k(j) = floor(j/G)

both logit matrices merged with a where, then the mask and one softmax (the eager path of the
official code, datamllab/LongLM self_extend_patch/Llama.py; W/G a float there and here). Distances
up to (N - W) G + W so fall below N. G: group_size, W: window. Grouping reads positions modulo G,
so the logits are not shift invariant while extending (`relative` says so then).

Bidirectional models (the paper's are causal) group the keys right of the window too, j - i >= W,
as the mirror image: q_i . R(floor(i/G) - floor(j/G) - (W - W/G)) k_j.

Optional query log-scale (scale_base b; null: off, as the official default -1): while extending, q_i
is multiplied by max(ln(i + 1) / ln b, 1) in both logit matrices (the official
`scaled_query = query_states * ((position_ids + 1).log() / np.log(scale_base)).clip(1)`, then rotated
for the neighbour and the grouped part alike; a scalar commutes with the rotation). SelfExtend.py's
apply() sets b to the pretraining length (N here), so the factor is 1 up to N; within N and in
training the model stays plain rope whatever b.

Hooks: qk is rope's own (so training is rope on any backend's terms, and a composite keeps its one
rotation); query_scale (declared only with scale_base) scales the rotated q; logit_transform moves
the rotated q and k on to their grouped positions, R(g - i) R(i) = R(g), and replaces only the rotary
term of the far pairs: a composite part's bias, decay or key term stays. logit_transform runs on the
eager backend only.
"""
from __future__ import annotations

import math

import torch

from posbench.checks import Integer
from posbench.encodings.base import ModelDims, relative_distance
from posbench.encodings.rope import RoPE


class SelfExtend(RoPE):
    """group_size G and window W as in the module docstring; window null: a quarter of the training
    positions (the paper's W = 1024 of Llama-2's 4096), at most the training positions (the neighbour
    window keeps plain rope, whose distances must have been trained). scale_base b: the query log-scale
    max(ln(i + 1) / ln b, 1) while extending (the module docstring); null: off."""

    name = "self_extend"
    hooks = frozenset({"qk", "logit_transform"})
    relative = True  # in training and within the training length: rope
    loads_checkpoints_of = ("posbench.encodings.rope.RoPE",)  # a rope run evaluated with SelfExtend

    def __init__(self, dims: ModelDims, base: float = 10000.0, layout: str = "half", rotary_fraction: float = 1.0,
                 group_size: int = 8, window: int | None = None, scale_base: int | None = None):
        super().__init__(dims, base=base, layout=layout, rotary_fraction=rotary_fraction)
        self.group_size = Integer(1)("encoding.group_size", group_size, self.name)
        default = max(1, dims.train_positions // 4)
        window = Integer(1, null=f"a quarter of the training positions, here {default}")("encoding.window", window,
                                                                                         self.name)
        if window is not None and window > dims.train_positions:
            raise ValueError(f"self_extend: encoding.window={window} is past the training positions "
                             f"{dims.train_positions}: the window keeps plain rope, whose distances must have been "
                             f"trained; choose 1 <= window <= {dims.train_positions}, or null ({default})")
        self.window = default if window is None else window
        self.shift = self.window - self.window / self.group_size  # W - W/G
        # ln b must be > 0: b = 1 divides by 0, b < 1 gives factors <= 0, clipped to 1 (off)
        self.scale_base = Integer(2, null="off, the official default")("encoding.scale_base", scale_base, self.name)
        if self.scale_base is not None:
            self.hooks = self.hooks | {"query_scale"}

    def params(self) -> dict:
        return {"base": self.base, "layout": self.layout, "rotary_fraction": self.rotary_fraction,
                "group_size": self.group_size, "window": self.window, "scale_base": self.scale_base}

    def set_eval_length(self, train_positions: int, eval_positions: int) -> None:
        super().set_eval_length(train_positions, eval_positions)  # rope's theta_m
        self.extending = eval_positions > train_positions
        self.relative = not self.extending

    def regroup(self, x: torch.Tensor, pos: torch.Tensor, shift: float) -> torch.Tensor:
        """x rotated at pos -> rotated at floor(pos/G) + shift. x: [B, H, L, d], pos: [B', L] -> [B, H, L, d]."""
        grouped = torch.div(pos, self.group_size, rounding_mode="floor").double() + shift  # [B', L]
        return self.rotate_head(x, grouped - pos.double())

    def query_scale(self, call):
        if self.scale_base is None or self.training or not self.extending:
            return None
        dtype = torch.float32 if call.x is None else call.x.dtype
        log_scale = (call.q_pos + 1).double().log() / math.log(self.scale_base)  # ln(i + 1) / ln b: [B', Lq]
        return log_scale.clamp(min=1).to(dtype)[:, None, :, None]  # [B', 1, Lq, 1]

    def logit_transform(self, logits, q, k, call):
        if self.training or not self.extending:
            return logits
        scale = call.encoding.logit_scale(q.shape[-1])
        distance = relative_distance(call.q_pos, call.k_pos)[:, None]  # i - j: [B', 1, Lq, Lk]
        rest = logits - (q @ k.transpose(-2, -1)) * scale  # [B, H, Lq, Lk]: other parts' terms, 0 alone
        q_group = self.regroup(q, call.q_pos, self.shift)  # at floor(i/G) + W - W/G: [B, H, Lq, d]
        far = rest + (q_group @ self.regroup(k, call.k_pos, 0.0).transpose(-2, -1)) * scale  # [B, H, Lq, Lk]
        merged = torch.where(distance < self.window, logits, far)  # [B, H, Lq, Lk]
        if not call.causal:  # keys right of the window: the mirror image, k at floor(j/G) + 2 (W - W/G)
            mirror = rest + (q_group @ self.regroup(k, call.k_pos, 2 * self.shift).transpose(-2, -1)) * scale
            merged = torch.where(distance <= -self.window, mirror, merged)  # [B, H, Lq, Lk]
        return merged
