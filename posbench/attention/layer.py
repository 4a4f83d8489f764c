"""One attention layer: it projects q, k and v, applies the encoding's hooks in the table's order
(posbench.hooks) and hands each call to its backend.

Length costs no `L x L` memory beyond one block of queries where it matters:
- a bias that is the same in every layer (`Encoding.bias_layers_shared`) is built once per
  forward (`PositionContext`);
- a causal layer whose backend holds logits (eager) attends in query blocks in training, each
  to its key prefix;
- in evaluation (`Attention.eval_chunk` queries, set by the runner) every layer with a hook that
  needs logits attends one chunk of queries at a time; the bias of a relative encoding over
  contiguous positions is one strided copy of a row of per-offset values, and on the fused CPU
  kernel a chunk's prefix and its causal square are two calls merged by their log-sum-exps;
- a decay alone needs no logits: evaluation takes DECAY_CHUNK queries at a time so that the
  levels, relative to each chunk's first query, stay small in float32 at any length;
- a sliding window (model.window) is a mask: evaluation chunks as for logits, and a causal chunk
  attends only the keys from its first query's window on, so memory grows with the window, not L.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posbench.attention.backend import Backend
from posbench.attention.context import AttentionCall, PositionContext
from posbench.encodings.base import Encoding
from posbench.hooks import needs_logits

AUTO_CHUNK_ELEMENTS = 2**24  # eval.chunk=auto: a chunk's biggest [B|1, H, chunk, Lk] tensor holds at most this
MIN_AUTO_CHUNK = 16
DECAY_CHUNK = 1024  # queries per chunk in evaluation for a decay without logits


def query_key_hooks(q: torch.Tensor, k: torch.Tensor, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    """The hooks before the logits, for every query at once: qk, query_scale, layer_pass (its state goes
    into the call) and decay (its levels too); a layer of a schedule may answer None (no scale, no decay).
    q: [B, H, Lq, d], k: [B, H, Lk, d] -> the same shapes."""
    encoding, hooks = call.encoding, call.encoding.hooks
    if "qk" in hooks:
        q, k = encoding.qk(q, k, call.q_pos, call.k_pos, call.layer)
    scale = encoding.query_scale(call) if "query_scale" in hooks else None  # [B|1, H|1, Lq, 1]
    if scale is not None:
        q = q * scale  # [B, H, Lq, d]
    if "layer_pass" in hooks:
        call.layer_state = encoding.layer_pass(q, k, call)
    levels = encoding.decay(call) if "decay" in hooks else None  # [B|1, H, Lk]
    if levels is not None:
        call.q_levels, call.k_levels = levels[..., levels.shape[-1] - q.shape[-2]:], levels
    return q, k


class Attention(nn.Module):
    """Multi-head self-attention that receives its positional encoding and backend."""

    def __init__(self, d_model: int, n_heads: int, layer: int, encoding: Encoding, backend: Backend,
                 causal: bool, window: int | None = None):
        super().__init__()
        self.n_heads, self.layer, self.causal, self.window = n_heads, layer, causal, window
        self.backend = backend
        self.encoding = [encoding]  # a list: shared with the model, registered there once
        self.eval_chunk: int | str | None = None  # queries per chunk in evaluation: a number, "auto" or None (all)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor, positions: PositionContext, memory: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, L, D] at positions.q_pos [B', L]. Keys and values come from x, or from `memory`
        [B, Lk, D] at positions.k_pos [B', Lk] when given (a memory followed by x, queries
        aligned to its end)."""
        b, length, d_model = x.shape
        encoding = self.encoding[0]
        if memory is None:
            q, k, v = self.qkv(x).view(b, length, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)  # 3 x [B, H, L, d]
        else:
            w_q, w_kv = self.qkv.weight.split([d_model, 2 * d_model])
            q = F.linear(x, w_q).view(b, length, self.n_heads, -1).transpose(1, 2)  # [B, H, L, d]
            k, v = F.linear(memory, w_kv).view(b, memory.shape[1], 2, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        call = AttentionCall(encoding, positions.q_pos, positions.k_pos, self.layer, self.causal, self.window,
                             x=x if memory is None else memory)
        if "kv" in encoding.hooks:
            k, v = encoding.kv(k, v, call)  # [B, H, Lk, d] each
        if "qkv" in encoding.hooks:
            if memory is not None:
                raise ValueError(f"encoding {encoding.name} turns q and k by a state of the layer's own tokens (qkv "
                                 "hook); keys from a memory (segment recurrence) have none")
            call.state = positions.state
            q, k, v = encoding.qkv(q, k, v, call)  # v: [B, H, L, d + state columns]
        block = self.query_block(encoding, b, length, k.shape[-2])
        if block is not None:
            call.block_starts = tuple(range(0, length, block))
        q, k = query_key_hooks(q, k, call)
        if block is None:
            call.bias = positions.bias(self.layer) if self.backend.takes_bias else None
            y = self.backend.attend(q, k, v, call)  # [B, H, L, d]
        else:
            room = self.backend.decay_room(q, k, v) if call.k_levels is not None and not torch.is_grad_enabled() \
                else None
            if room is not None:  # each block writes its part of it in place: no gradient may pass
                call.decay_room = room[0].shape[-1] - q.shape[-1]
                q, k, v = room
            spans = [self.block_span(call, start, min(length, start + block), q.shape[-2], k.shape[-2])
                     for start in range(0, length, block)]
            views = BlockViews.apply(q, k, v, spans) if torch.is_grad_enabled() else \
                [view for span in spans for view in block_views(q, k, v, span)]
            y = torch.cat([self.attend_block(*views[3 * i:3 * i + 3], call, positions, span)
                           for i, span in enumerate(spans)], dim=2)  # [B, H, L, d]
        if "state_update" in encoding.hooks:
            y, positions.state = encoding.state_update(y, call)  # [B, H, L, d]
        if "output" in encoding.hooks:
            y = encoding.output(y, x, self.layer)  # [B, H, L, d]
        return self.out(y.transpose(1, 2).reshape(b, length, d_model))  # [B, L, D]

    def query_block(self, encoding: Encoding, batch: int, length: int, keys: int) -> int | None:
        """Queries per block, or None for one call over all of them."""
        logits = needs_logits(encoding.hooks) or self.window is not None  # a window is a mask
        if not self.backend.takes_bias or not (logits or "decay" in encoding.hooks):
            return None  # fused kernels (a backend that builds its own bias: block masks) bound their own memory
        if not self.training:
            chunk = self.eval_chunk
            if not logits:
                chunk = DECAY_CHUNK
            elif chunk == "auto":  # the logits (eager) or the bias (sdpa) of one chunk within the budget
                rows = (batch if self.backend.per_sequence_logits else 1) * self.n_heads * keys
                chunk = max(MIN_AUTO_CHUNK, AUTO_CHUNK_ELEMENTS // rows)
            return chunk if chunk and length > chunk else None
        block = self.backend.train_block
        if logits and block and self.causal and length > block:
            return block
        return None

    def block_span(self, call: AttentionCall, start: int, stop: int, queries: int, keys: int) -> tuple:
        """(start, stop, first, end): queries start:stop and the keys first:end they may see, their
        prefix when causal, from the window's start when there is one."""
        end = stop + keys - queries if self.causal else keys
        first = max(0, call.q_start + start - self.window + 1) if self.causal and self.window else 0
        return start, stop, first, end

    def attend_block(self, q, k, v, call: AttentionCall, positions: PositionContext, span: tuple) -> torch.Tensor:
        """One block of queries q [B, H, stop - start, d] against its keys and values [B, H, end - first, d]."""
        start, stop, first, end = span
        bake = False
        if self.training:
            full = positions.bias(self.layer)
            bias = None if full is None else full[:, :, start:stop, first:end]
        else:
            bake = self.causal and self.backend.bakes_mask(q)
            bias = positions.block_bias(self.layer, start, stop, end, bake)
            bias = None if bias is None else bias[..., first:]
        block = call.block(start, stop, first, end, bias, mask_in_bias=bake and bias is not None)
        return self.backend.attend(q, k, v, block)  # [B, H, stop - start, d]


def block_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: tuple) -> tuple[torch.Tensor, ...]:
    """A block's queries q[:, :, start:stop] and its keys and values [:, :, first:end]."""
    start, stop, first, end = span
    return q[:, :, start:stop], k[:, :, first:end], v[:, :, first:end]


class BlockViews(torch.autograd.Function):
    """Every block's views of q, k and v at once. Backward adds each block's gradients into one buffer
    per tensor; autograd's own backward of each slice would write it into a zeroed tensor of the whole
    size and add those, three full passes per block and tensor."""

    @staticmethod
    def forward(ctx, q, k, v, spans):
        ctx.spans, ctx.inputs = spans, [(t.shape, t.dtype, t.device) for t in (q, k, v)]
        return tuple(view for span in spans for view in block_views(q, k, v, span))

    @staticmethod
    def backward(ctx, *grads):
        full = [torch.zeros(shape, dtype=dtype, device=device) if needed else None
                for (shape, dtype, device), needed in zip(ctx.inputs, ctx.needs_input_grad)]  # dq, dk, dv
        for i, (start, stop, first, end) in enumerate(ctx.spans):
            rows = ((start, stop), (first, end), (first, end))  # of q, k and v
            for whole, (low, high), grad in zip(full, rows, grads[3 * i:3 * i + 3]):
                if whole is not None and grad is not None:
                    whole[:, :, low:high] += grad
        return (*full, None)
