"""The fla backend: flash-linear-attention's Triton kernel for causal softmax attention with a per-token log
decay (`fla.ops.forgetting_attn.parallel_forgetting_attn`, from fla-core: `pip install posbench[fla]`), on
CUDA only. It runs the `decay` hook, FoX's forget gates and causal ALiBi's slopes, inside the kernel: the
logits get G_i - G_j, G the cumulative sum of the per-token decays g, which are the differences of the
encoding's levels c (c_i - c_j = G_i - G_j). No [B, H, L, L] tensor is formed, and the whole call is one
kernel whatever its length.

It takes a call whose queries are its keys (no memory before them, no query blocks) and no sliding window;
hooks that need logits (a bias, a logit transform, ...) stay with sdpa, flex or eager. posbench's sdpa and
eager paths are the reference it is tested against on a GPU (tests/test_cuda.py).
"""
from __future__ import annotations

import importlib.util

import torch

from posbench.attention.backend import Backend
from posbench.hooks import FLA, backend_hooks

EXTRA = "pip install 'posbench[fla]'"


def fla_refusal(cuda: bool) -> str | None:
    """Why the fla backend cannot run here, or None where it can."""
    if not cuda:
        return "backend=fla runs on CUDA only (Triton kernels); use backend=sdpa or auto"
    if importlib.util.find_spec("fla") is None:
        return f"backend=fla needs fla-core ({EXTRA}); or use backend=sdpa or auto"
    return None


def token_log_decay(levels: torch.Tensor, batch: int) -> torch.Tensor:
    """Per-token log decays g [B, L, H] (float32) whose cumulative sum differs from the levels c [B|1, H, L]
    by one constant per sequence and head: g_0 = 0, g_t = c_t - c_(t-1), taken in the levels' precision."""
    steps = torch.diff(levels, dim=-1, prepend=levels[..., :1])  # [B|1, H, L]
    return steps.expand(batch, -1, -1).transpose(1, 2).float()  # [B, L, H]


def forgetting_attention(q, k, v, g, scale: float) -> torch.Tensor:
    """fla-core's kernel: q, k [B, L, H, K], v [B, L, H, V], g [B, L, H] -> [B, L, H, V]."""
    from fla.ops.forgetting_attn import parallel_forgetting_attn

    return parallel_forgetting_attn(q, k, v, g, scale=scale)


class FlaBackend(Backend):
    name = FLA
    supported_hooks = backend_hooks(name)
    takes_bias = False  # one call over every query: the kernel bounds its own memory
    runs_windows = False

    def check(self, encoding) -> None:
        super().check(encoding)
        if not encoding.dims.causal:
            raise ValueError("backend=fla runs causal attention only; a bidirectional model: use backend=sdpa")

    def attend(self, q, k, v, call):
        refusal = fla_refusal(q.is_cuda)
        if refusal:
            raise ValueError(refusal)
        if not call.causal or q.shape[-2] != k.shape[-2]:
            raise ValueError("backend=fla runs causal attention whose queries are its keys (no memory before them, "
                             "no bidirectional layer); use backend=sdpa")
        batch = q.shape[0]
        if call.k_levels is None:  # no decay: plain causal attention
            g = q.new_zeros(batch, q.shape[-2], q.shape[1], dtype=torch.float32)  # [B, L, H]
        else:
            g = token_log_decay(call.k_levels, batch)  # [B, L, H]
        scale = call.encoding.logit_scale(q.shape[-1])
        out = forgetting_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g, scale)  # [B, L, H, d]
        return out.transpose(1, 2).to(v.dtype)  # [B, H, L, d]
