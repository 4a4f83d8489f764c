"""The flex backend: FlexAttention with the encoding's bias as a `score_mod` (Encoding.score_mod), a decay
c_i - c_j read from its levels per score, and the causal mask as a block mask, so that no [Lq, Lk]
tensor is built and blocks above the diagonal are skipped. Runs `qk`, `query_scale`, `decay` and
`bias`; an encoding whose bias has no score_mod is refused.

FlexAttention is fast only through torch.compile: the compiled function is built once per process
(`compiled_flex_attention`); on CPU the first call of each new shape compiles for 5-15 s (the runner
times evaluation past its first batch). `FlexBackend(compiled=False)` runs the unfused path, which
materialises the scores: for tests. On CPU FlexAttention is forward only: training there is refused,
evaluation runs.
"""
from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from posbench.attention.backend import Backend, backends_that_run, suggested
from posbench.encodings.base import Encoding
from posbench.hooks import FLEX, backend_hooks

BLOCK = 128  # queries and keys per block of the block mask (FlexAttention's default)
CPU_TRAINING = ("backend=flex trains on CUDA only; on CPU it evaluates (forward only); "
                "use backend=sdpa or auto for training (flex evaluates a trained model: train.steps=0 with "
                "train.init_from)")
# the causal mask_mod closes over lk - lq, a derived symbolic size under dynamic=True (pytorch issue 182606)
IN_DYNAMIC_COMPILE = ("backend=flex cannot train inside a graph with dynamic shapes (train.compile=true): inductor "
                      "failed to lower the compiled model's FlexAttention (torch 2.11, alibi and fox on an H200: "
                      "ShapeAsConstantBuffer); use train.compile=static or graphs (a graph per shape), backend=auto "
                      "(sdpa there) or train.compile=false")
CUDA_MIN_HEAD_DIM = 16  # FlexAttention's compiled CUDA kernels refuse smaller heads (torch 2.11: "NYI")


def flex_refusal(encoding: Encoding, head_dim: int, cuda: bool, training: bool, dynamic_compile: bool = False,
                 compiled: bool = True) -> str | None:
    """Why flex cannot run `encoding` here, or None where it can; flex's limits, checked here only (by the
    backend, the choice of a backend and the build): it trains on CUDA only, never in a graph with dynamic
    shapes (`dynamic_compile`), and only encodings whose score_mod torch differentiates (Encoding.flex_trains);
    its compiled CUDA kernels need heads of at least CUDA_MIN_HEAD_DIM features."""
    if training and dynamic_compile:
        return IN_DYNAMIC_COMPILE
    if training and not cuda:
        return CPU_TRAINING
    if cuda and compiled and head_dim < CUDA_MIN_HEAD_DIM:
        return (f"backend=flex needs heads of at least {CUDA_MIN_HEAD_DIM} features on CUDA, got {head_dim} "
                "(model.d_model / model.n_heads); use backend=sdpa or auto")
    if cuda and training and not encoding.flex_trains:
        return (f"backend=flex cannot train encoding {encoding.name} on CUDA: torch's FlexAttention cannot "
                "differentiate its score_mod (Encoding.flex_trains); use backend=sdpa or auto")
    return None


@functools.cache
def compiled_flex_attention(dynamic: bool):
    """flex_attention through torch.compile, built once per process. Dynamic shapes on CUDA, where training
    lengths vary; static on CPU, where inductor's C++ FlexAttention template does not compile with dynamic
    shapes (torch 2.13): there each new shape compiles anew, for seconds."""
    return torch.compile(flex_attention, dynamic=dynamic)


def causal_block_mask(lq: int, lk: int, device) -> BlockMask:
    """Query i sees key j <= i + lk - lq (queries aligned to the last keys), built block by block without
    an [Lq, Lk] mask. Per row of query blocks, the key blocks every query of which sees whole come
    first (full: no mask_mod), then those on the diagonal (partial); blocks cut by the sequence end are
    never full, as in create_block_mask."""
    shift = lk - lq
    n_q, n_k = -(-lq // BLOCK), -(-lk // BLOCK)
    q_first = torch.arange(n_q, device=device) * BLOCK  # [Nq]
    q_last = (q_first + BLOCK - 1).clamp(max=lq - 1)  # [Nq]
    n_full = (torch.clamp(q_first + shift + 1, max=lk) // BLOCK) * (q_first + BLOCK <= lq)  # [Nq]
    n_seen = torch.clamp((q_last + shift) // BLOCK + 1, max=n_k)  # [Nq]: key blocks any of its queries sees
    order = torch.arange(n_k, device=device)  # [Nk]
    full = order.expand(n_q, n_k)  # [Nq, Nk]: full blocks 0..n_full-1
    partial = (order + n_full[:, None]).clamp(max=n_k - 1)  # [Nq, Nk]: partial blocks n_full..n_seen-1

    def causal(b, h, q_idx, kv_idx):
        return q_idx + shift >= kv_idx

    def blocks(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.int32)[None, None]  # [1, 1, ...]: shared by every sequence and head

    return BlockMask.from_kv_blocks(blocks(n_seen - n_full), blocks(partial), blocks(n_full), blocks(full),
                                    BLOCK_SIZE=BLOCK, mask_mod=causal, seq_lengths=(lq, lk))


def tensor_device(encoding: Encoding) -> torch.device:
    """Where the encoding's parameters and buffers are (CPU when it has none)."""
    tensor = next(iter([*encoding.parameters(), *encoding.buffers()]), None)
    return torch.device("cpu") if tensor is None else tensor.device


class FlexBackend(Backend):
    name = FLEX
    supported_hooks = backend_hooks(name)
    takes_bias = False  # the bias enters as a score_mod, never as a tensor
    runs_windows = False  # its block mask is causal only

    def __init__(self, compiled: bool = True):
        self.compiled = compiled

    def check(self, encoding: Encoding) -> None:
        super().check(encoding)
        if "bias" not in encoding.hooks:
            return
        device = tensor_device(encoding)
        pos = torch.zeros(1, 1, dtype=torch.long, device=device)  # [1, 1]: one query, one key
        try:
            missing = any(encoding.score_mod(pos, pos, layer) is None for layer in range(encoding.dims.n_layers))
        except (NotImplementedError, RuntimeError):
            if device.type != "meta":
                raise
            missing = False  # a plan's score_mod that reads positions' values: the built model's check probes it
        if missing:
            valid = [b for b in backends_that_run(encoding) if b != self.name]
            raise ValueError(f"backend=flex cannot run encoding {encoding.name}: its bias has no FlexAttention "
                             f"score_mod (Encoding.score_mod); use backend={suggested(valid)} (backends that can: "
                             f"{valid})")

    def attend(self, q, k, v, call):
        """As Backend.attend; a bias built by the caller is not used: the score_mod computes it per score."""
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        encoding = call.encoding
        refusal = flex_refusal(encoding, min(q.shape[-1], v.shape[-1]), q.is_cuda, training, compiled=self.compiled)
        if refusal:
            raise ValueError(refusal)
        score_mod = encoding.score_mod(call.q_pos, call.k_pos, call.layer) if "bias" in encoding.hooks else None
        if call.k_levels is not None:
            score_mod = decay_score_mod(call, score_mod, torch.promote_types(q.dtype, torch.float32), q.shape[0])
        causal = call.causal and not call.mask_in_bias
        block_mask = causal_block_mask(q.shape[-2], k.shape[-2], q.device) if causal else None
        attend = compiled_flex_attention(q.is_cuda) if self.compiled else flex_attention
        return attend(q, k, v, score_mod=score_mod, block_mask=block_mask,
                      scale=encoding.logit_scale(q.shape[-1]))  # [B, H, Lq, d]


def decay_score_mod(call, inner, dtype: torch.dtype, batch: int):
    """score (+ inner's bias) + c_i - c_j, with the levels relative to the first query's. Each captured
    tensor is indexed once per score: FlexAttention's backward differentiates no second index."""
    ref = call.q_levels[..., :1]  # [B|1, H, 1]
    at_q, at_k = (call.q_levels - ref).to(dtype), (call.k_levels - ref).to(dtype)  # [B|1, H, Lq], [B|1, H, Lk]
    at_q, at_k = at_q.expand(batch, -1, -1), at_k.expand(batch, -1, -1)  # [B, H, Lq], [B, H, Lk]

    def decay(score, b, h, q_idx, kv_idx):
        if inner is not None:
            score = inner(score, b, h, q_idx, kv_idx)
        return score + (at_q[b, h, q_idx] - at_k[b, h, kv_idx]).to(score.dtype)

    return decay
