"""What the attention hooks and backends see: the positions of one forward pass (`PositionContext`,
which builds a bias shared by the layers once) and one attention call (`AttentionCall`: the
encoding, the positions of its queries and keys, the layer, the mask, the layer's input and the
decay levels), with the block of queries a chunked call covers."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from posbench.encodings.base import Encoding


def causal_mask(lq: int, lk: int, device) -> torch.Tensor:
    """True where key j may be seen by query i (j <= i, queries aligned to the last keys): [Lq, Lk]."""
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(diagonal=lk - lq)


@dataclass
class AttentionCall:
    """One call of attention: queries at q_pos [B', Lq], keys at k_pos [B', Lk], the queries at key
    indices q_start.. (by default the last Lq: a memory, then the queries). Content hooks read it;
    backends run it."""

    encoding: Encoding
    q_pos: torch.Tensor  # [B', Lq] ([B', Lq, 2] on grids for 2-D encodings)
    k_pos: torch.Tensor  # [B', Lk]
    layer: int
    causal: bool
    window: int | None = None  # sliding window: query i sees keys with |i - j| < window (None: all)
    q_start: int = -1  # the key index of the first query (-1: Lk - Lq, the queries last)
    bias: torch.Tensor | None = None  # [B', H, Lq, Lk] when the caller built it; else the backend builds it
    mask_in_bias: bool = False  # the bias holds -inf where a causal query may not look
    x: torch.Tensor | None = None  # the layer's input up to the last key [B, first_key + Lk, D] (q, k, v's source)
    first_key: int = 0  # the index of the call's first key in the layer's keys (a window's chunk starts past 0)
    q_levels: torch.Tensor | None = None  # decay levels c at the queries [B|1, H, Lq]: bias c_i - c_j
    k_levels: torch.Tensor | None = None  # decay levels c at the keys [B|1, H, Lk]
    decay_room: int = 0  # columns q, k, v carry past the head for the decay, the backend's (Backend.decay_room)
    block_starts: tuple[int, ...] = (0,)  # the layer's query blocks begin at these query indices
    query_offset: int = 0  # this call's first query among the layer's queries (a block's start)
    layer_state: object = None  # what the encoding's layer_pass returned for this layer and forward
    state: object = None  # the position state this layer received (state_init, then each layer's updates)

    def __post_init__(self):
        if self.q_start < 0:
            self.q_start = self.k_pos.shape[1] - self.q_pos.shape[1]

    def visible(self) -> torch.Tensor | None:
        """True where query i may see key j: [Lq, Lk]; None when every key is visible."""
        if not self.causal and self.window is None:
            return None
        lq, lk = self.q_pos.shape[1], self.k_pos.shape[1]
        offset = (torch.arange(self.q_start, self.q_start + lq, device=self.q_pos.device)[:, None]
                  - torch.arange(lk, device=self.q_pos.device))  # i - j in key indices: [Lq, Lk]
        seen = offset >= 0 if self.causal else torch.ones_like(offset, dtype=torch.bool)
        return seen if self.window is None else seen & (offset.abs() < self.window)

    def keys_seen(self) -> torch.Tensor:
        """How many keys each query attends: [Lq] (causal: its index among the layer's keys + 1), within the window."""
        lq, lk = self.q_pos.shape[1], self.k_pos.shape[1]
        first = self.first_key + self.q_start  # the first query's index among the layer's keys
        i = torch.arange(first, first + lq, device=self.q_pos.device)  # [Lq]
        if self.causal:
            return i + 1 if self.window is None else (i + 1).clamp(max=self.window)
        if self.window is None:
            return torch.full((lq,), lk, device=self.q_pos.device)  # [Lq]
        last = self.first_key + lk  # keys first_key.. of the layer's, every one within reach of a query here
        return (i + self.window).clamp(max=last) - (i - self.window + 1).clamp(min=0)  # |i - j| < window

    def block(self, start: int, stop: int, first: int, end: int, bias: torch.Tensor | None,
              mask_in_bias: bool) -> AttentionCall:
        """Queries start:stop against keys first:end, with the block's bias."""
        def keys(t):
            return None if t is None else t[..., first:end]

        return dataclasses.replace(
            self, q_pos=self.q_pos[:, start:stop], k_pos=self.k_pos[:, first:end], bias=bias,
            mask_in_bias=mask_in_bias, q_start=self.q_start + start - first, first_key=self.first_key + first,
            query_offset=self.query_offset + start,
            x=None if self.x is None else self.x[:, :self.first_key + end],  # from the start: a convolution's context
            q_levels=None if self.q_levels is None else self.q_levels[..., start:stop], k_levels=keys(self.k_levels))


class PositionContext:
    """The positions of one forward pass and what its layers share: queries at q_pos [B', Lq],
    keys at k_pos [B', Lk] (a memory, then the queries), and each bias built once."""

    def __init__(self, encoding: Encoding, q_pos: torch.Tensor, k_pos: torch.Tensor | None = None):
        self.encoding, self.q_pos = encoding, q_pos
        self.k_pos = q_pos if k_pos is None else k_pos
        self.has_bias = "bias" in encoding.hooks
        self.state = None  # the position state between layers (state_init's, then each layer's update)
        self.full: dict[int, torch.Tensor] = {}
        self.rows: dict[int, torch.Tensor | None] = {}

    def layer_key(self, layer: int) -> int:
        return 0 if self.encoding.bias_layers_shared else layer

    def bias(self, layer: int) -> torch.Tensor | None:
        """The layer's whole bias [B', H, Lq, Lk], built once when every layer shares it."""
        if not self.has_bias:
            return None
        key = self.layer_key(layer)
        if key not in self.full:
            self.full[key] = self.encoding.bias(self.q_pos, self.k_pos, layer)
        return self.full[key]

    def block_bias(self, layer: int, start: int, stop: int, end: int, causal: bool = False) -> torch.Tensor | None:
        """The bias of queries start:stop against keys :end, [B', H, stop - start, end], without
        building the whole (with -inf where a causal query may not look, queries aligned to the
        last keys): taken from per-offset rows when the encoding's bias is relative and the positions
        contiguous, else built for the block. In evaluation: one tensor per block, no copies."""
        if not self.has_bias:
            return None
        above = ~causal_mask(stop - start, end, self.q_pos.device) if causal else None  # [b, end]
        rows = self.offset_rows(layer)
        if rows is None:
            bias = self.encoding.bias(self.q_pos[:, start:stop], self.k_pos[:, :end], layer)  # [B', H, b, end]
            return bias if above is None else bias.masked_fill(above, float("-inf"))
        # reversed rows r[u] = f(Lk - 1 - u): query i (key index) and key j read u = Lk - 1 - i + j, so
        # the block's queries taken last to first form a strided view; flipping it back copies it once
        last_query = stop + self.k_pos.shape[1] - self.q_pos.shape[1]  # one past the block, in key indices
        view = rows.as_strided((1, rows.shape[1], stop - start, end), (rows.stride(0), rows.stride(1), 1, 1),
                               rows.storage_offset() + self.k_pos.shape[1] - last_query)  # [1, H, b, end]
        bias = view.flip(-2)  # [1, H, b, end], its own memory
        return bias if above is None else bias.masked_fill_(above, float("-inf"))

    def offset_rows(self, layer: int) -> torch.Tensor | None:
        """f(i - j) for i - j from Lk - 1 down to -(Lk - 1) as [1, H, 2 Lk - 1] (reversed), for a
        relative bias over contiguous positions shared by the batch, the queries the last keys;
        None otherwise."""
        key = self.layer_key(layer)
        if key not in self.rows:
            self.rows[key] = None
            k_pos = self.k_pos
            queries_last = torch.equal(self.q_pos, k_pos[:, k_pos.shape[1] - self.q_pos.shape[1]:])
            if self.encoding.bias_relative and k_pos.dim() == 2 and k_pos.shape[0] == 1 and queries_last \
                    and bool((k_pos[0, 1:] - k_pos[0, :-1] == 1).all()):
                last, first = k_pos[:, -1:], k_pos[:, :1]
                after = self.encoding.bias(first, k_pos, layer)[:, :, 0].flip(-1)  # i - j = -(Lk-1)..0
                before = self.encoding.bias(last, k_pos, layer)[:, :, 0].flip(-1)  # i - j = 0..Lk-1
                self.rows[key] = torch.cat([after, before[..., 1:]], dim=-1).flip(-1).contiguous()  # [1, H, 2 Lk - 1]
        return self.rows[key]
