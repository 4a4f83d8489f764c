"""T5 relative bias (Raffel et al. 2020): a learned scalar per head per bucket of j - i,
shared by all layers as in T5.

`bucketed: false` is the unbucketed variant of the background articles (000: one entry per
|i - j|; 004: one entry per signed offset): one learned entry per offset i - j, no log
buckets. Offsets are clipped into the table, never looked up past it: to
[-max_distance, max_distance] with bidirectional buckets (2 * max_distance + 1 entries), to
[0, max_distance] without (max_distance + 1 entries; keys after the query share entry 0, as
they share bucket 0 in the bucketed rule). num_buckets is unused then.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from posbench.checks import Flag, Integer
from posbench.encodings.base import Encoding, LayerShape, ModelDims, score_positions


def t5_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int = 32,
              max_distance: int = 128) -> torch.Tensor:
    """Bucket ids for relative_position = j - i (key minus query), any shape -> same shape, long.

    Bidirectional: half the buckets per sign (keys after the query in the upper half).
    Causal: only i - j >= 0 matters; future offsets share bucket 0. Within a sign,
    distances below half the buckets get one bucket each, larger ones log-spaced up to
    max_distance, and everything beyond falls into the last bucket.
    """
    distance = -relative_position.long()  # i - j
    offset = torch.zeros_like(distance)
    if bidirectional:
        num_buckets //= 2
        offset = (distance < 0).long() * num_buckets
        distance = distance.abs()
    else:
        distance = distance.clamp(min=0)
    exact = num_buckets // 2
    # float32 as in T5's released code, so that ids on exact-integer boundaries match it
    log_ratio = torch.log(distance.clamp(min=exact).float() / exact) / math.log(max_distance / exact)
    log_bucket = exact + (log_ratio * (num_buckets - exact)).long()
    log_bucket = log_bucket.clamp(max=num_buckets - 1)
    return offset + torch.where(distance < exact, distance, log_bucket)


def check_buckets(owner: str, num_buckets: int, max_distance: int, bidirectional: bool) -> None:
    """The bucket geometry t5_bucket needs: at least one exact bucket per sign, and log buckets that run
    forward from the exact ones to max_distance (max_distance <= exact would divide by log(<= 1))."""
    per_sign = num_buckets // 2 if bidirectional else num_buckets
    if per_sign < 2:
        raise ValueError(f"{owner}: encoding.num_buckets={num_buckets}: must be >= "
                         + ("4 (bidirectional: half the buckets per sign, at least 2 each)" if bidirectional else "2"))
    exact = per_sign // 2
    if max_distance <= exact:
        raise ValueError(f"{owner}: encoding.max_distance={max_distance}: must be > {exact} with "
                         f"encoding.num_buckets={num_buckets}{' (bidirectional: half per sign)' if bidirectional else ''}"
                         f": distances below {exact} have a bucket each and the log-spaced buckets run from there "
                         "to max_distance")


class T5(Encoding):
    name = "t5"
    hooks = frozenset({"bias"})
    flex_trains = False  # its table looked up by bucket inside the score_mod (inductor: ShapeAsConstantBuffer)
    relative = True
    bias_layers_shared = True

    def __init__(self, dims: ModelDims, num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool | None = None, bucketed: bool = True):
        super().__init__(dims)
        self.num_buckets = Integer(1)("encoding.num_buckets", num_buckets, self.name)
        self.max_distance = Integer(1)("encoding.max_distance", max_distance, self.name)
        bidirectional = Flag(null="follows model.causal")("encoding.bidirectional", bidirectional, self.name)
        self.bidirectional = (not dims.causal) if bidirectional is None else bidirectional
        self.bucketed = Flag()("encoding.bucketed", bucketed, self.name)
        if self.bucketed:
            check_buckets(self.name, self.num_buckets, self.max_distance, self.bidirectional)
            entries = self.num_buckets
        else:
            entries = 2 * self.max_distance + 1 if self.bidirectional else self.max_distance + 1
        self.table = nn.Embedding(entries, dims.n_heads)  # [entries, H]
        nn.init.zeros_(self.table.weight)

    def params(self) -> dict:
        return {"num_buckets": self.num_buckets if self.bucketed else None, "max_distance": self.max_distance,
                "bidirectional": self.bidirectional, "bucketed": self.bucketed}

    def offset_index(self, distance: torch.Tensor) -> torch.Tensor:
        """Unbucketed table row for distance = i - j, clipped into the table: any shape -> same shape, long."""
        if self.bidirectional:
            return distance.clamp(-self.max_distance, self.max_distance) + self.max_distance
        return distance.clamp(0, self.max_distance)

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        # training: the bias's autograd record, the relative offsets and buckets (int64), and its gradient, beside the bias the guard counts
        if not shape.training or (self.bias_layers_shared and layer):
            return 0.0
        return shape.bias_bytes(2.75)

    def bias(self, q_pos, k_pos, layer):
        relative = k_pos[:, None, :] - q_pos[:, :, None]  # [B', Lq, Lk]
        if self.bucketed:
            rows = t5_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        else:
            rows = self.offset_index(-relative.long())
        return self.table(rows).permute(0, 3, 1, 2)  # [B', H, Lq, Lk]

    def score_mod(self, q_pos, k_pos, layer):
        # every offset past max_distance shares the edge entry (bucketed: the last bucket; unbucketed: the
        # clipped row), so one table row per offset in [-max_distance, max_distance] is exact
        reach = self.max_distance
        distance = torch.arange(-reach, reach + 1, device=q_pos.device)  # i - j: [2 reach + 1]
        if self.bucketed:
            rows = t5_bucket(-distance, self.bidirectional, self.num_buckets, self.max_distance)
        else:
            rows = self.offset_index(distance)
        values = self.table(rows).t()  # [H, 2 reach + 1]
        positions = score_positions(q_pos, k_pos)

        def t5(score, b, h, q_idx, kv_idx):
            i, j = positions(b, q_idx, kv_idx)
            return score + values[h, (i - j).clamp(-reach, reach) + reach]

        return t5
