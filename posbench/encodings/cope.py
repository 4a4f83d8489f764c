"""CoPE, contextual position encoding (Golovneva et al. 2024, "Contextual Position Encoding: Learning to
Count What's Important", arXiv 2405.18719): positions counted by gates on the content, not by tokens.

    g_ij = sigmoid(q_i . k_j / sqrt(d))                      gates, 0 where key j is masked
    p_ij = sum_{t=j..i} g_it                                 (causal; all visible t >= j otherwise)
    z_i[n] = q_i . e[n],   n = 0..npos-1                     e: [npos, d] per layer, shared by its heads
    r_ij = (p - floor p) z_i[ceil p] + (1 - p + floor p) z_i[floor p],   p = min(p_ij, npos - 1)
    logit_ij = (q_i . k_j + r_ij) / sqrt(d)

As the official code (facebookresearch/RAM, projects/cope): the gates read q . k alone (computed here
from q and k, so a bias or decay another composite part adds to the logits does not enter them, as
the official "cope+rel" keeps its relative bias out of the gates), r is added before dividing by
sqrt(d) (its default; `--cope-nodiv` would add r after), e starts at zero, and the masked gates are
zeroed before the reverse cumulative sum. The gates and their sums run in float32 at least: a bf16
sum of hundreds of gates would lose whole positions.

npos (null: training positions + 1, the official block_size + 1): positions p lie in [0, keys seen],
so npos - 1 = the training length gives every position a training sequence can reach its own row,
and evaluation past it collapses every larger p onto the last row (the clamp), which decides how
CoPE extrapolates: the resolved value is recorded in params(). Position ids are never read: CoPE alone
is shift invariant (beside a rotation it is not: q_i . e[n] reads the rotated q_i), and a query's
positions use only its own row of the mask, so chunks and query blocks give the one-pass values.
"""
from __future__ import annotations

import torch
from torch import nn

from posbench.checks import Integer
from posbench.encodings.base import Encoding, ModelDims


class CoPE(Encoding):
    name = "cope"
    hooks = frozenset({"logit_transform"})
    relative = True  # reads no positions at all
    reads_query_key = True  # beside a rotation it reads rotated q and k: no longer relative

    def __init__(self, dims: ModelDims, npos: int | None = None):
        super().__init__(dims)
        npos = Integer(2, null="training positions + 1")("encoding.npos", npos, self.name)
        self.npos = dims.train_positions + 1 if npos is None else npos
        self.table = nn.Parameter(torch.zeros(dims.n_layers, self.npos, dims.head_dim))  # e: [layers, npos, d]

    def params(self) -> dict:
        return {"npos": self.npos}

    def positions(self, q: torch.Tensor, k: torch.Tensor, call) -> torch.Tensor:
        """p_ij, clamped to npos - 1: [B, H, Lq, Lk] in float32 at least."""
        compute = torch.promote_types(q.dtype, torch.float32)
        gates = torch.sigmoid((q @ k.transpose(-2, -1)).to(compute) * self.logit_scale(q.shape[-1]))  # [B, H, Lq, Lk]
        visible = call.visible()  # [Lq, Lk] or None
        if visible is not None:
            gates = gates.masked_fill(~visible, 0.0)
        return gates.flip(-1).cumsum(-1).flip(-1).clamp(max=self.npos - 1)  # sum over t >= j: [B, H, Lq, Lk]

    def logit_transform(self, logits, q, k, call):
        p = self.positions(q, k, call)  # [B, H, Lq, Lk]
        z = q.to(p.dtype) @ self.table[call.layer].to(p.dtype).T  # q_i . e[n]: [B, H, Lq, npos]
        floor = p.detach().floor()  # the rows carry no gradient; the weight p - floor does
        below, above = z.gather(-1, floor.long()), z.gather(-1, p.detach().ceil().long())  # [B, H, Lq, Lk] each
        weight = p - floor
        r = above * weight + below * (1 - weight)  # [B, H, Lq, Lk]
        return logits + (r * self.logit_scale(q.shape[-1])).to(logits.dtype)  # (q.k + r) / sqrt(d)
