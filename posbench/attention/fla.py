"""The fla backend: Triton kernels, on CUDA only, for attention that posbench's other paths run with [B, H, L, L]
tensors or a dense mask: flash-linear-attention's (fla-core: `pip install posbench[fla]`) and posbench's own for
CoPE and DAPE (posbench.attention.cope_kernel and dape_kernel, which need Triton alone). Each call is one kernel
whatever its length.

- A decay (`parallel_forgetting_attn`): FoX's forget gates and causal ALiBi's slopes. The logits get G_i - G_j,
  G the cumulative sum of the per-token decays g, which are the differences of the encoding's levels c
  (c_i - c_j = G_i - G_j).
- An encoding whose logit hook is the attention of one of fla's kernels (`Encoding.fla_kernel`):
  stick-breaking (`parallel_stickbreaking_attn`; the unclaimed share r_i the kernel returns goes to the
  encoding's remainder term) and PaTH (`parallel_path_attn`, from the encoding's w and beta; beside FoX's decay
  too, PaTH-FoX as a composite); CoPE (posbench's kernel, its gates from the logits: CoPE beside nothing that
  adds to them) and DAPE v1 (posbench's kernel, the network over every head of a tile; the base's bias formed
  once per call, [B', H, L, L]).
- A bias of i - j alone (kerple, t5, sandwich; beside a rotation too): posbench's kernel looks each pair's bias up
  in the encoding's bias per offset, [H, 2L - 1] (posbench.attention.relative_bias_kernel); a learned bias gets
  its gradient through those rows.
- FIRE's bias (alone, beside a rotation, or a schedule's layer): posbench's kernel computes FIRE's MLP of each pair's
  normalised distance in the tile (posbench.attention.fire_kernel).

It takes causal calls with no sliding window, whose queries are its keys: a call with a memory before its queries
(segment recurrence) runs on sdpa (a decay or a bias) or eager. Other hooks that need logits (a bias of more than
i - j, a logit transform, ...) stay with sdpa, flex or eager. posbench's own backends are the reference it is
tested against on a GPU (tests/test_cuda.py).
"""
from __future__ import annotations

import importlib.util

import torch

from posbench.attention.backend import Backend, backends_that_run, suggested
from posbench.attention.eager import EagerBackend
from posbench.attention.fla_hooks import fire_part, fla_missing_hooks
from posbench.attention.sdpa import SdpaBackend
from posbench.encodings.base import bias_by_offset
from posbench.encodings.dape import BIASED
from posbench.hooks import FLA, backend_hooks

EXTRA = "pip install 'posbench[fla]'"


OWN_KERNELS = ("cope", "dape")  # Encoding.fla_kernel values whose kernel is posbench's (Triton alone, no fla-core)


def fla_refusal(cuda: bool, encoding=None) -> str | None:
    """Why the fla backend cannot run `encoding` here (any of its kernels where None), or None where it can."""
    if not cuda:
        return "backend=fla runs on CUDA only (Triton kernels); use backend=sdpa or auto"
    if encoding is not None and (encoding.fla_kernel in OWN_KERNELS or "bias" in encoding.hooks):
        if importlib.util.find_spec("triton") is None:
            return (f"backend=fla runs {encoding.name}'s kernel with Triton, which this torch lacks; "
                    "use backend=eager")
        return None
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


def stick_breaking_attention(q, k, v, scale: float, attend_current: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fla-core's kernel: q, k [B, L, H, K], v [B, L, H, V] -> (sum_j A_ij v_j [B, L, H, V], r [B, L, H])."""
    from fla.ops.stickbreaking_attn import parallel_stickbreaking_attn

    return parallel_stickbreaking_attn(q, k, v, scale=scale, attend_current=attend_current)


def path_attention(q, k, v, w, beta, g, scale: float) -> torch.Tensor:
    """fla-core's kernel: q, k, w [B, L, H, K], v [B, L, H, V], beta [B, L, H], g [B, L, H] or None ->
    [B, L, H, V]; the logits are scale (q_i^T H_i ... H_(j+1) k_j + G_i - G_j), G the cumulative sum of g."""
    from fla.ops.path_attn import parallel_path_attn

    return parallel_path_attn(q, k, v, w, beta, g, scale=scale)[0]


def cope_attention(q, k, v, e, scale: float, causal: bool) -> torch.Tensor:
    """posbench's CoPE kernel (posbench.attention.cope_kernel), imported at its first call: Triton's import stays
    out of every run's start-up."""
    from posbench.attention.cope_kernel import cope_attention as kernel

    return kernel(q, k, v, e, scale, causal)


def dape_attention(q, k, v, bias, w1, b1, w2, b2, slope: float, scale: float) -> torch.Tensor:
    """posbench's DAPE v1 kernel (posbench.attention.dape_kernel), imported at its first call."""
    from posbench.attention.dape_kernel import dape_attention as kernel

    return kernel(q, k, v, bias, w1, b1, w2, b2, slope, scale)


def relative_bias_attention(q, k, v, rows, q_pos, k_pos, first: int, scale: float) -> torch.Tensor:
    """posbench's kernel for a bias of i - j alone (posbench.attention.relative_bias_kernel), causal, imported at its
    first call."""
    from posbench.attention.relative_bias_kernel import relative_bias_attention as kernel

    return kernel(q, k, v, rows, q_pos, k_pos, first, scale, True)


def fire_attention(q, k, v, distances, normalisers, w1, b1, w2, b2, q_pos, k_pos, scale: float) -> torch.Tensor:
    """posbench's kernel for FIRE's bias (posbench.attention.fire_kernel), causal, imported at its first call."""
    from posbench.attention.fire_kernel import fire_attention as kernel

    return kernel(q, k, v, distances, normalisers, w1, b1, w2, b2, q_pos, k_pos, scale, True)


PATH_HEAD_SIZES = (16, 32, 64, 128)  # fla-core's PaTH kernel


def kernel_owner(encoding):
    """The encoding, or the part of a composite, whose attention the kernel runs (Encoding.fla_kernel)."""
    return next((part for part in getattr(encoding, "parts", ()) if part.fla_kernel), encoding)


def fallback(encoding) -> Backend:
    """The backend that takes a call fla's kernels cannot (keys before the queries): sdpa for a decay or a bias, else
    eager."""
    return SdpaBackend() if set(encoding.hooks) - {"embed"} <= SdpaBackend.supported_hooks else EagerBackend()


class FlaBackend(Backend):
    name = FLA
    supported_hooks = backend_hooks(name)
    takes_bias = False  # one call over every query: the kernel bounds its own memory
    kernel_attention = True
    runs_windows = False

    def runs_kernel_of(self, encoding) -> bool:
        return bool(encoding.fla_kernel) or fire_part(encoding) is not None

    def check(self, encoding) -> None:
        missing = fla_missing_hooks(encoding)
        if missing:
            valid = [name for name in backends_that_run(encoding) if name != self.name]
            raise ValueError(f"backend=fla cannot run the {sorted(missing)} hook(s) that encoding {encoding.name} "
                             f"needs; use backend={suggested(valid)} (backends that can: {valid})")
        if not encoding.dims.causal:
            raise ValueError("backend=fla runs causal attention only; a bidirectional model: use backend=sdpa")
        head_dim = encoding.dims.head_dim
        owner = kernel_owner(encoding)
        if encoding.fla_kernel == "cope" and owner.logit_scale(head_dim) != encoding.logit_scale(head_dim):
            raise ValueError(f"backend=fla: CoPE's kernel reads its gates from the logits, which encoding "
                             f"{encoding.name} scales by its own factor; use backend=eager")

    def attend(self, q, k, v, call):
        refusal = fla_refusal(q.is_cuda, call.encoding)
        if refusal:
            raise ValueError(refusal)
        if q.shape[-2] != k.shape[-2]:  # queries after a memory (segment recurrence): the kernels take none
            return fallback(call.encoding).attend(q, k, v, call)
        encoding, batch = call.encoding, q.shape[0]
        scale = encoding.logit_scale(q.shape[-1])
        owner = kernel_owner(encoding)
        if encoding.fla_kernel == "cope":
            return cope_attention(q, k, v, owner.scaled_table(call.layer, k.shape[-2]), scale, True)  # [B, H, L, d]
        if (fire := fire_part(encoding.at(call.layer))) is not None:
            inputs = fire.kernel_inputs(call.q_pos, call.k_pos, call.layer)
            return fire_attention(q, k, v, *inputs, call.q_pos, call.k_pos, scale)  # [B, H, L, d]
        if "bias" in encoding.hooks:
            rows, _, first = bias_by_offset(encoding, call.q_pos, call.k_pos, call.layer)  # [H, n]
            if rows is None:  # a schedule's layer without a bias: plain attention
                return SdpaBackend().attend(q, k, v, call)
            return relative_bias_attention(q, k, v, rows, call.q_pos, call.k_pos, first, scale)  # [B, H, L, d]
        if encoding.fla_kernel == "dape":
            first, act, last = owner.net
            bias = owner.base_bias(call) if owner.base_name in BIASED else None  # [B', H, L, L]
            return dape_attention(q, k, v, bias, first.weight, first.bias, last.weight, last.bias, act.negative_slope,
                                  scale)  # [B, H, L, d]
        q_, k_, v_ = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, L, H, d] each
        if encoding.fla_kernel == "stick_breaking":
            out, rest = stick_breaking_attention(q_, k_, v_, scale, owner.attend_current)  # [B, L, H, d], [B, L, H]
            out = out.transpose(1, 2).to(v.dtype)  # [B, H, L, d]
            term = owner.remainder_term(rest.transpose(1, 2)[..., None].to(v.dtype), v, call)  # [B, H, L, d]
            return out if term is None else out + term
        if encoding.fla_kernel == "path":
            if q.shape[-1] not in PATH_HEAD_SIZES:
                raise ValueError(f"backend=fla runs PaTH with heads of {list(PATH_HEAD_SIZES)} features (fla-core's "
                                 f"kernel), not {q.shape[-1]}; use backend=eager")
            w, beta = owner.householder(call.x, call.layer)  # [B, H, L, d], [B, H, L]
            precision = torch.promote_types(w.dtype, torch.float32)  # the kernel takes them in float32 at least
            w, beta = w.transpose(1, 2).to(precision), beta.transpose(1, 2).to(precision)  # [B, L, H, d], [B, L, H]
            # PaTH-FoX: the kernel scales the gate term as the products, posbench adds c_i - c_j as they are
            g = None if call.k_levels is None else token_log_decay(call.k_levels, batch).to(precision) / scale
            out = path_attention(q_, k_, v_, w, beta, g, scale)  # [B, L, H, d]
            return out.transpose(1, 2).to(v.dtype)  # [B, H, L, d]
        if call.k_levels is None:  # no decay: plain causal attention
            g = q.new_zeros(batch, q.shape[-2], q.shape[1], dtype=torch.float32)  # [B, L, H]
        else:
            g = token_log_decay(call.k_levels, batch)  # [B, L, H]
        return forgetting_attention(q_, k_, v_, g, scale).transpose(1, 2).to(v.dtype)  # [B, H, L, d]
