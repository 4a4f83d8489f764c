"""Scale-invariant attention (Anson, Wang, Aitchison 2025, arXiv 2505.17083, NeurIPS 2025): the content
logit s_ij = q_i . k_j / sqrt(d) of a causal pair at distance t = i - j >= 0 becomes

    L_ij = a_t s_ij + m_t,   a_t = sqrt(2 ln(t/tau + 1) + 1),   m_t = -2 ln(t/tau + 1)

(a_0 = 1, m_0 = 0; tau = 10, the best of the paper's sweep), so that, for Gaussian logits, the expected
attention given to every scale band t in [T, T Delta) stays of order one at any length. No clipping;
m_t is an additive bias that is never positive; a_t scales the content logit alone.

The paper pairs it with "pp-RoPE", rope without its lowest frequencies (after Barbero et al.'s p-RoPE).
The rotation here is rope's own (posbench.encodings.rope.RoPE: base, layout, rotary_fraction,
frequency_fraction, frequency_cut); its default keeps the highest 3/4 of the frequencies
(frequency_fraction 0.75, the larger of the two fractions Barbero et al. train; the scale-invariant
paper's own fraction is not stated in the facts this follows). rope=false drops the rotation (NoPE
logits transformed).

Hooks: qk (rope's, with rope) and logit_transform, on the eager backend. The logits the hook receives
hold the content logit plus any other composite part's bias, decay or key term; alone they are the
content logit and are scaled as they are, beside other parts the content logit is recomputed from q and
k and only it is scaled. Per query block: t comes from the block's q_pos and k_pos. Causal only.
"""
from __future__ import annotations

import torch

from posbench.checks import Flag, Real
from posbench.encodings.base import LayerShape, ModelDims, relative_distance
from posbench.encodings.rope import RoPE


def scale_invariant_terms(t: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(a_t, m_t) at distances t >= 0 (float): a_t = sqrt(2 ln(t/tau + 1) + 1), m_t = -2 ln(t/tau + 1)."""
    log = torch.log1p(t / tau)  # ln(t/tau + 1)
    return (2 * log + 1).sqrt(), -2 * log


class ScaleInvariant(RoPE):
    """tau: the distance scale of a_t and m_t (module docstring). rope: rotate q and k with rope (its
    options below, default pp-RoPE: frequency_fraction 0.75); false: no rotation."""

    name = "scale_invariant"
    hooks = frozenset({"qk", "logit_transform"})
    relative = True  # a_t, m_t and rope's rotation depend on i - j only
    causal_only = True  # t = i - j >= 0; the paper's models are causal

    def __init__(self, dims: ModelDims, tau: float = 10.0, rope: bool = True, base: float = 10000.0,
                 layout: str = "half", rotary_fraction: float = 1.0, frequency_fraction: float = 0.75,
                 frequency_cut: str = "none"):
        if not dims.causal:
            raise ValueError("scale_invariant: a_t and m_t are defined for causal distances t = i - j >= 0; set "
                             "model.causal=true (the paper's models are decoders)")
        super().__init__(dims, base=base, layout=layout, rotary_fraction=rotary_fraction,
                         frequency_fraction=frequency_fraction, frequency_cut=frequency_cut)
        self.tau = Real(above=0)("encoding.tau", tau, self.name)
        self.rope = Flag()("encoding.rope", rope, self.name)
        if not self.rope:
            self.hooks = frozenset({"logit_transform"})

    def params(self) -> dict:
        return {"tau": self.tau, "rope": self.rope, "base": self.base, "layout": self.layout,
                "rotary_fraction": self.rotary_fraction, "frequency_fraction": self.frequency_fraction,
                "frequency_cut": self.frequency_cut}

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        # t, a_t and m_t [B', 1, Lq, Lk] in float32: under one [B, H, Lq, Lk] between them
        return shape.pair_bytes(0.5)

    def logit_transform(self, logits, q, k, call):
        compute = torch.promote_types(logits.dtype, torch.float32)
        t = relative_distance(call.q_pos, call.k_pos).clamp(min=0).to(compute)  # [B', Lq, Lk]; masked keys: t = 0
        a, m = (term.to(logits.dtype)[:, None] for term in scale_invariant_terms(t, self.tau))  # [B', 1, Lq, Lk]
        if call.encoding is self:  # the logits are the content logit
            return a * logits + m
        content = (q @ k.transpose(-2, -1)) * call.encoding.logit_scale(q.shape[-1])  # [B, H, Lq, Lk]
        return logits + (a - 1) * content + m  # other parts' terms unscaled
