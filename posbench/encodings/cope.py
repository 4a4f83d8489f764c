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
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from posbench.checks import Integer
from posbench.encodings.base import FLOAT_BYTES, Encoding, LayerShape, ModelDims, host_reads_allowed


class _Positional(torch.autograd.Function):
    """logits + r / sqrt(d) with a backward written out: autograd of the formula keeps a dozen [B, H, Lq, Lk]
    tensors and makes twice the passes over them. e comes scaled, e / sqrt(d), so z = q . e[n] / sqrt(d).

    forward: g = sigmoid(q . k / sqrt(d)), 0 where hidden; p = min(sum_{t >= j} g_t, rows - 1),
    f = floor p, w = p - f; r / sqrt(d) = z[f] + w (z[f + 1] - z[f]), the floor/ceil form's value.
    backward: z[f] gets (1 - w) dr, z[f + 1] gets w dr; dp = dr (z[f + 1] - z[f]), 0 where w = 0 (as in the
    floor/ceil form, whose two rows meet there, clamped p included); dg_t = sum_{j <= t} dp_j, a plain
    cumulative sum; ds = dg g (1 - g), 0 where hidden as g = 0 there; q, k and e get the products' gradients.
    With `gates_from_logits` the logits are q . k / sqrt(d) themselves (CoPE alone: nothing else added to
    them): the gates read them instead of a product of their own, and ds joins the logits' gradient, so the
    attention's own backward product carries it to q and k.
    """

    @staticmethod
    def forward(ctx, logits, q, k, e, hidden, scale, gates_from_logits):
        # logits: [B, H, Lq, Lk]; q: [B, H, Lq, d]; k: [B, H, Lk, d]; e: [rows + 1, d] / sqrt(d) in the compute
        # dtype, its last row never weighs; hidden: True where hidden, over the last keys [Lq, c], or None
        q, k = q.contiguous(), k.contiguous()  # once for the products here and in backward
        if gates_from_logits:
            gates = torch.sigmoid(logits.to(e.dtype))  # [B, H, Lq, Lk]
        else:
            gates = (q @ k.transpose(-2, -1)).to(e.dtype).mul_(scale).sigmoid_()  # [B, H, Lq, Lk]
        if hidden is not None:
            gates[..., -hidden.shape[-1]:].masked_fill_(hidden, 0.0)
        scratch = gates.flip(-1).cumsum_(-1)  # the sums over t >= j, keys reversed
        p = scratch.flip(-1)  # [B, H, Lq, Lk]
        rows = e.shape[0] - 1
        if rows <= p.shape[-1]:  # else p <= the keys < rows
            p.clamp_(max=rows - 1)
        # the rows read: p is largest at the first key; every row where no host read is allowed
        used = int(p[..., 0].max()) + 2 if host_reads_allowed() else e.shape[0]
        z = (q.to(e.dtype) @ e[:used].T).to(e.dtype)  # [B, H, Lq, used], float32 under bf16 autocast too
        # flat indices of z[f]: index_select and index_add_ take int32, half the bytes of gather's int64
        kind = torch.int32 if z.numel() < 2 ** 31 else torch.int64
        starts = torch.arange(0, z.numel(), used, dtype=kind, device=z.device).view(*z.shape[:-1], 1)
        index = p.to(kind).add_(starts).view(-1)  # floor, p >= 0
        weight = p.frac_()  # p - floor p
        below = torch.index_select(z.view(-1), 0, index, out=scratch.view(-1)).view_as(weight)  # z[f]: [B, H, Lq, Lk]
        steps = F.pad(z.diff(dim=-1), (0, 1))  # z[n + 1] - z[n], never read at the last n: [B, H, Lq, used]
        slope = steps.view(-1).index_select(0, index).view_as(weight)  # z[f + 1] - z[f]
        ctx.save_for_backward(gates, index, weight, slope, q, k, e)
        ctx.used, ctx.scale, ctx.gates_from_logits = used, scale, gates_from_logits
        r = below.addcmul_(weight, slope)  # r / sqrt(d)
        if r.dtype != logits.dtype or torch.compiler.is_compiling():  # torch 2.11's dynamo gives wrong gradients
            return logits + r.to(logits.dtype)  # for an output changed in place: a new tensor in a graph
        return r.add_(logits)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        gates, index, weight, slope, q, k, e = ctx.saved_tensors
        dr = grad.to(gates.dtype)  # d(r / sqrt(d)): [B, H, Lq, Lk]
        # z[f] gets (1 - w) dr and z[f + 1] w dr: the sums of dr and of w dr at each f, shifted and combined
        summed, weighed = (gates.new_zeros(gates.numel() // gates.shape[-1] * ctx.used) for _ in range(2))
        summed.index_add_(0, index, dr.reshape(-1))
        part = dr * weight
        weighed.index_add_(0, index, part.view(-1))
        dz = summed.sub_(weighed).view(*gates.shape[:-1], ctx.used)  # [B, H, Lq, used]
        dz[..., 1:] += weighed.view_as(dz)[..., :-1]
        torch.ceil(weight, out=part).mul_(slope).mul_(dr).cumsum_(-1)  # dp, 0 where w = 0; summed: dg
        ds = torch.ops.aten.sigmoid_backward.grad_input(part, gates, grad_input=part)  # [B, H, Lq, Lk]
        dq = (dz @ e[:ctx.used]).to(q.dtype)  # [B, H, Lq, d]
        de = torch.zeros_like(e)
        de[:ctx.used] = dz.flatten(0, -2).T @ q.flatten(0, -2).to(e.dtype)
        if ctx.gates_from_logits:
            return ds.to(grad.dtype).add_(grad), dq, None, de, None, None, None
        ds = ds.to(q.dtype)
        dq.add_((ds @ k).mul_(ctx.scale))
        dk = (ds.transpose(-2, -1) @ q).mul_(ctx.scale)  # [B, H, Lk, d]
        return grad, dq, dk, de, None, None, None


class CoPE(Encoding):
    name = "cope"
    hooks = frozenset({"logit_transform"})
    fla_kernel = "cope"  # backend=fla: posbench's Triton kernel (posbench.attention.cope_kernel), no [B, H, L, L]
    relative = True  # reads no positions at all
    reads_query_key = True  # beside a rotation it reads rotated q and k: no longer relative

    def __init__(self, dims: ModelDims, npos: int | None = None):
        super().__init__(dims)
        npos = Integer(2, null="training positions + 1")("encoding.npos", npos, self.name)
        self.npos = dims.train_positions + 1 if npos is None else npos
        self.table = nn.Parameter(torch.zeros(dims.n_layers, self.npos, dims.head_dim))  # e: [layers, npos, d]

    def params(self) -> dict:
        return {"npos": self.npos}

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        # [B, H, Lq, Lk]: the gates, their reversed cumulative sum (the positions), the interpolation's floor,
        # weight and lookups; training keeps the gates and positions for the backward
        return shape.pair_bytes(4.5 if shape.training else 3.5)

    def scaled_table(self, layer: int, keys: int, dtype=torch.float32) -> torch.Tensor:
        """e / sqrt(d) for a call over `keys` keys, with a zero row past the last (z[f + 1] where p clamps, weighed
        0): [rows + 1, d], rows = min(npos, keys + 1), as p <= the keys and the rows past them are never read."""
        rows = min(self.npos, keys + 1)
        e = self.table[layer, :rows].to(dtype) * self.logit_scale(self.table.shape[-1])  # [rows, d]
        return nn.functional.pad(e, (0, 0, 0, 1))  # [rows + 1, d]

    def kernel_memory(self, layer: int, shape: LayerShape) -> float:
        # z = q . e^T [B, H, Lq, rows + 1] kept for the backward, which adds its gradient; none of the pairs
        rows = min(self.npos, shape.keys + 1) + 1
        return (2.0 if shape.training else 1.0) * FLOAT_BYTES * shape.batch * shape.heads * shape.tokens * rows

    def logit_transform(self, logits, q, k, call):
        compute = torch.promote_types(q.dtype, torch.float32)  # the gates, their sums and r
        scale = self.logit_scale(q.shape[-1])
        e = self.scaled_table(call.layer, k.shape[-2], compute)  # [rows + 1, d]
        visible = call.visible()  # [Lq, Lk] or None
        hidden = None
        if visible is not None and not host_reads_allowed():  # inside a compiled or recorded step
            hidden = ~visible  # [Lq, Lk]
        elif visible is not None and not visible.all():
            first = int((~visible).any(0).nonzero()[0])  # the first key hidden from some query
            hidden = ~visible[:, first:]  # [Lq, Lk - first]
        # CoPE alone gets logits = q . k / sqrt(d); beside other parts they may hold a bias or decay too
        return _Positional.apply(logits, q, k, e, hidden, scale, call.encoding is self)
