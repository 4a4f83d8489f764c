"""STRING (An et al., "Why Does the Effective Context Length of LLMs Fall Short?", ICLR 2025, arXiv
2410.18745): a rope model evaluated with its rarely trained long distances overwritten by well-trained
ones, with no training.

The model trains as rope. In evaluation (every length, as the paper applies it at the training length
and below) the rotary content term of query i and key j at distance t = i - j becomes

    q_i . R(t) k_j                   where t < S (the neighbours: plain rope)
    q_i . R(t - S + W) k_j           where t >= S (the query rotated at i - S + W)

one softmax over every key, and q and k both times the attention factor f = 1 + 0.1 ln 2 (the official
code multiplies cos and sin by it, so every logit by f^2 = 1.1434, also where STRING shifts nothing).
S: shifted_offset, W: local_value. Distances past L - 1 - S + W never appear.

The official flash path merges two attention calls by their log-sum-exps, a window t in [0, S] and the
shifted keys t >= S: the key at distance exactly S is counted in both (its weight from both logits, its
value twice); its decoding path counts every key once (t < S plain). boundary=once (default) follows the
decoding path, a proper softmax; boundary=twice reproduces the prefill path exactly, as one key of logit
logaddexp(plain, shifted) (two copies of one value are one key holding both weights).

S null: floor(0.33 L) at evaluation length L (the official RULER script's int(0.33 * test length)),
raised past N to L - N + W so that the shifted distances stay below N (FRONTIER2's derived use: possible
up to L = 2N - W - 1), and at most N - 1 (the plain part's distances trained). Within N this is the
official rule. W null: N / 16 (at least 1): the paper's 128 is a few local tokens out of N = 128K; at
posbench's N = 32-512 a token count that small in proportion would be zero, and N / 16 (2-32) keeps a
local neighbourhood with unique positions while staying well below S. Where S <= W (very short
evaluations with S null) the map does not shorten distances.

Hooks: qk is rope's (training is rope on any backend; the factor multiplies q and k in evaluation),
logit_transform turns the rotated q on by W - S and replaces only the rotary term of the far pairs, so a
composite part's bias, decay or key term stays. Eager backend only; causal (as the paper's models).
"""
from __future__ import annotations

import math

import torch

from posbench.checks import Choice, Flag, Integer
from posbench.encodings.base import ModelDims, relative_distance
from posbench.encodings.rope import RoPE

BOUNDARIES = ("once", "twice")
SHIFTED_RATIO = 0.33  # the official README and RULER script: S = int(0.33 * L)
STRING_FACTOR = 1 + 0.1 * math.log(2)  # the official attention_factor on cos and sin


class STRING(RoPE):
    """shifted_offset S, local_value W, attention_factor (f = 1 + 0.1 ln 2 on q and k in evaluation) and
    boundary as in the module docstring; base, layout, rotary_fraction, frequency_fraction and
    frequency_cut are rope's, as the model was trained."""

    name = "string"
    hooks = frozenset({"qk", "logit_transform"})
    relative = True  # both branches are functions of t = i - j
    causal_only = True
    loads_checkpoints_of = ("posbench.encodings.rope.RoPE",)  # a rope run evaluated with STRING

    def __init__(self, dims: ModelDims, base: float = 10000.0, layout: str = "half", rotary_fraction: float = 1.0,
                 frequency_fraction: float = 1.0, frequency_cut: str = "none", shifted_offset: int | None = None,
                 local_value: int | None = None, attention_factor: bool = True, boundary: str = "once"):
        if not dims.causal:
            raise ValueError("string: the shifted keys are the earlier ones, t = i - j >= S; set model.causal=true "
                             "(the paper's models and code are causal)")
        super().__init__(dims, base=base, layout=layout, rotary_fraction=rotary_fraction,
                         frequency_fraction=frequency_fraction, frequency_cut=frequency_cut)
        n = dims.train_positions
        default = max(1, n // 16)
        local_value = Integer(0, null=f"the training positions / 16, here {default}")(
            "encoding.local_value", local_value, self.name)
        shifted_offset = Integer(1, null="floor(0.33 L), at least L - N + W, at most N - 1")(
            "encoding.shifted_offset", shifted_offset, self.name)
        if local_value is not None and local_value >= n:
            raise ValueError(f"string: encoding.local_value={local_value} is not a trained distance (training "
                             f"positions {n}); choose 0 <= local_value <= {n - 1}, or null ({default})")
        if shifted_offset is not None and shifted_offset >= n:
            raise ValueError(f"string: encoding.shifted_offset={shifted_offset}: distances below it keep plain rope "
                             f"and must have been trained (training positions {n}); choose 1 <= shifted_offset "
                             f"<= {n - 1}, or null (0.33 of the evaluation length)")
        self.local_value = default if local_value is None else local_value
        if shifted_offset is not None and self.local_value >= shifted_offset:
            raise ValueError(f"string: encoding.local_value={self.local_value} must be below encoding.shifted_offset="
                             f"{shifted_offset}: the keys at distance t >= S move to t - S + W, closer only if W < S")
        self.shifted_offset = shifted_offset
        self.attention_factor_on = Flag()("encoding.attention_factor", attention_factor, self.name)
        Choice(BOUNDARIES)("encoding.boundary", boundary, self.name)
        self.boundary = boundary

    def params(self) -> dict:
        return {"base": self.base, "layout": self.layout, "rotary_fraction": self.rotary_fraction,
                "frequency_fraction": self.frequency_fraction, "frequency_cut": self.frequency_cut,
                "shifted_offset": self.shifted_offset, "local_value": self.local_value,
                "attention_factor": self.attention_factor_on, "boundary": self.boundary}

    def set_eval_length(self, train_positions: int, eval_positions: int) -> None:
        super().set_eval_length(train_positions, eval_positions)
        self.lengths = (train_positions, eval_positions)

    def offset(self) -> int:
        """S at the current evaluation length (module docstring)."""
        if self.shifted_offset is not None:
            return self.shifted_offset
        n, length = self.lengths
        return max(1, min(max(int(SHIFTED_RATIO * length), length - n + self.local_value), n - 1))

    def qk(self, q, k, q_pos, k_pos, layer):
        q, k = super().qk(q, k, q_pos, k_pos, layer)
        if self.training or not self.attention_factor_on:
            return q, k
        return q * STRING_FACTOR, k * STRING_FACTOR

    def logit_transform(self, logits, q, k, call):
        if self.training:
            return logits
        shifted = self.offset()
        distance = relative_distance(call.q_pos, call.k_pos)[:, None]  # t = i - j: [B', 1, Lq, Lk]
        turned = self.rotate_head(q, torch.full_like(call.q_pos, self.local_value - shifted))  # at i - S + W
        scale = call.encoding.logit_scale(q.shape[-1])
        far = logits + ((turned - q) @ k.transpose(-2, -1)) * scale  # [B, H, Lq, Lk]: the rotary term shifted
        merged = torch.where(distance >= shifted, far, logits)  # [B, H, Lq, Lk]
        if self.boundary == "twice":  # the key at t = S in both branches: one key holding both weights
            merged = torch.where(distance == shifted, torch.logaddexp(logits, far), merged)
        return merged
