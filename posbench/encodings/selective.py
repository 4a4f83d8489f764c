"""Selective attention (Leviathan, Kalman, Matias, ICLR 2025, arXiv 2410.02703): a token may mask an
earlier token from every later one. Head 0's scaled causal logits C give the selection
S = ReLU(C), the first key and the diagonal never selected (S_k0 = S_kk = 0); every head's logits
then lose the selection accumulated over the earlier queries,

    F_ij = sum_{k < i} S_kj,        logits_h[i, j] <- logits_h[i, j] - F_ij   (head 0 included)

Parameter-free; no position id is read (`rope=true` rotates q and k as well, GPT-NeoX layout).
Faithful over query blocks: the layer pass (once per layer, over every query) sums S's rows before
each block's first query, and a block adds its own rows' exclusive cumulative sum. S is read from
q.k after the rotation, times the logit scale: head 0's logits, unless a composite part adds a bias.
Sums run in float32 at least.

Context pruning (evaluation only, `prune_budget` b): queries are read in order; once query i joins,
while more than b keys are kept, the kept key with the largest F_ij is evicted (key 0 and key i never
are; ties: the oldest), and stays hidden from query i on. Every query then sees at most b keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posbench.checks import Flag, Real
from posbench.encodings.base import Encoding, LayerShape, ModelDims
from posbench.encodings.rope import rope_inv_freq, rotate


@dataclass
class SelectionState:
    """One layer's selection sums: prefixes[:, n] = sum of S's rows before block n's first query."""

    starts: tuple[int, ...]  # the blocks' first queries
    prefixes: torch.Tensor  # [B, blocks, Lk]
    evicted_at: torch.Tensor | None  # [B, Lk]: the query from which each key is pruned (Lk: never); None: no pruning


class Selective(Encoding):
    name = "selective"
    hooks = frozenset({"layer_pass", "logit_transform"})  # + qk with rope
    relative = True  # reads no position id; S comes from q.k, which a rotation keeps relative
    causal_only = True  # F sums over earlier queries

    def __init__(self, dims: ModelDims, rope: bool = False, rope_base: float = 10000.0, prune_budget: int | None = None):
        super().__init__(dims)
        if not dims.causal:
            raise ValueError("selective: F sums the selection of the earlier queries, a causal quantity; set "
                             "model.causal=true (the paper's models are causal)")
        self.rope = Flag()("encoding.rope", rope, self.name)
        self.rope_base = Real(above=1)("encoding.rope_base", rope_base, self.name)
        if prune_budget is not None and (isinstance(prune_budget, bool) or not isinstance(prune_budget, int)
                                         or prune_budget < 2):
            raise ValueError(f"selective: encoding.prune_budget={prune_budget!r} is not valid; give an integer of at "
                             "least 2 (key 0 and the query's own key are always kept) or null (no pruning)")
        self.prune_budget = prune_budget
        if self.rope and dims.head_dim % 2:
            raise ValueError(f"selective: encoding.rope=true rotates feature pairs and needs an even head size, got "
                             f"model.d_model / model.n_heads = {dims.head_dim}")
        self.hooks = frozenset(type(self).hooks | ({"qk"} if self.rope else set()))
        self.register_buffer("inv_freq", rope_inv_freq(dims.head_dim, self.rope_base), persistent=False)

    def params(self) -> dict:
        return {"rope": self.rope, "rope_base": self.rope_base, "prune_budget": self.prune_budget}

    def qk(self, q, k, q_pos, k_pos, layer):
        if not self.rope:
            return q, k
        return rotate(q, q_pos, self.inv_freq, "half"), rotate(k, k_pos, self.inv_freq, "half")

    def pruning(self) -> bool:
        return self.prune_budget is not None and not self.training

    def layer_pass(self, q, k, call) -> SelectionState:
        queries, keys = q.shape[-2], k.shape[-2]
        if queries != keys:
            raise ValueError(f"selective attention sums the selection of every earlier query, but this layer has "
                             f"{keys} keys for {queries} queries (a memory of earlier keys: segment recurrence); "
                             "run it without eval.recurrence")
        scale = call.encoding.logit_scale(q.shape[-1])
        q0, k0 = q[:, 0], k[:, 0]  # head 0: [B, L, d]
        total = q0.new_zeros(q0.shape[0], keys, dtype=torch.promote_types(q0.dtype, torch.float32))  # [B, Lk]
        evicted_at = torch.full_like(total, keys, dtype=torch.long) if self.pruning() else None  # [B, Lk]
        kept = torch.zeros_like(total, dtype=torch.bool) if self.pruning() else None  # [B, Lk]
        prefixes = []
        bounds = (*call.block_starts, queries)
        for start, stop in zip(bounds[:-1], bounds[1:]):
            prefixes.append(total)
            s = selection(q0[:, start:stop], k0, torch.arange(start, stop, device=q.device), scale, call.window)
            if evicted_at is not None:
                self.prune(total[:, None] + s.cumsum(1) - s, start, kept, evicted_at)  # F rows: [B, b, Lk]
            total = total + s.sum(1)  # [B, Lk]
        return SelectionState(call.block_starts, torch.stack(prefixes, 1), evicted_at)  # prefixes [B, blocks, Lk]

    @torch.no_grad()
    def prune(self, f_rows: torch.Tensor, start: int, kept: torch.Tensor, evicted_at: torch.Tensor) -> None:
        """Queries start.. in order (F rows [B, b, Lk]): key i joins, then the kept keys over the budget with the
        largest F_ij go, from query i on. kept and evicted_at [B, Lk] are updated in place."""
        batch = torch.arange(kept.shape[0], device=kept.device)
        for row in range(f_rows.shape[1]):
            i = start + row
            kept[:, i] = True
            while True:
                over = kept.sum(-1) > self.prune_budget  # [B]
                if not bool(over.any()):
                    break
                candidates = kept.clone()
                candidates[:, 0] = candidates[:, i] = False
                score = f_rows[:, row].masked_fill(~candidates, float("-inf"))  # [B, Lk]
                victim = score.argmax(-1)  # the first of the largest: the oldest
                kept[batch[over], victim[over]] = False
                evicted_at[batch[over], victim[over]] = i

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        # training: each block's selection S and F [B, b, Lk] of head 0 with its offsets and masks, and the
        # logits less F, kept for the backward; the prefix sums [B, blocks, Lk] are small beside them
        return shape.pair_bytes(2.0) if shape.training else 0.0

    def logit_transform(self, logits, q, k, call):
        state: SelectionState = call.layer_state
        block = state.starts.index(call.query_offset)
        first, keys = call.first_key, k.shape[-2]
        query_index = torch.arange(call.query_offset, call.query_offset + q.shape[-2], device=q.device)  # [b]
        key_index = torch.arange(first, first + keys, device=q.device)
        s = selection(q[:, 0], k[:, 0], query_index, call.encoding.logit_scale(q.shape[-1]), call.window,
                      key_index)  # [B, b, Lk']
        f = state.prefixes[:, block, None, first:first + keys] + s.cumsum(1) - s  # F: [B, b, Lk']
        logits = logits - f[:, None].to(logits.dtype)  # [B, H, b, Lk']
        if state.evicted_at is not None:
            hidden = state.evicted_at[:, None, first:first + keys] <= query_index[:, None]  # [B, b, Lk']
            logits = logits.masked_fill(hidden[:, None], float("-inf"))
        return logits


def selection(q0: torch.Tensor, k0: torch.Tensor, query_index: torch.Tensor, scale: float, window: int | None,
              key_index: torch.Tensor | None = None) -> torch.Tensor:
    """S of some queries: ReLU of head 0's scaled logits where the query sees the key, 0 at key 0, on the
    diagonal and where hidden. q0 [B, b, d] at query_index [b], k0 [B, Lk, d] at key_index [Lk] (default
    0..Lk-1; indices among the layer's keys) -> [B, b, Lk] in float32 at least."""
    key_index = torch.arange(k0.shape[1], device=k0.device) if key_index is None else key_index
    compute = torch.promote_types(q0.dtype, torch.float32)
    c = torch.einsum("bqd,bkd->bqk", q0.to(compute), k0.to(compute)) * scale  # [B, b, Lk]
    offset = query_index[:, None] - key_index  # i - j: [b, Lk]
    selectable = (offset > 0) & (key_index > 0)  # earlier keys but the first; never the diagonal
    if window is not None:
        selectable &= offset < window
    return F.relu(c) * selectable  # [B, b, Lk]
