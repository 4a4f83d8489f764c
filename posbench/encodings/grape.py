"""GRAPE, Group Representational Position Encoding (Zhang et al. ICLR 2026, arXiv 2512.07805; the
official model-architectures/GRAPE `model/llama-mha-grape-*.py`), in three forms (`form`):

multiplicative  GRAPE-M-nonctx: RoPE (half layout, `base`) whose per-plane frequencies w are learned, one
                spectrum per layer shared by the heads, stored in float32 as log_freq = 16 log w (the
                official learning-rate damper), init w_m = base^(-2m/d). Relative.
multiplicative_ctx  GRAPE-M-ctx: the same rotation at a contextual phase, plane m of token t turned by
                Phi_t theta_m, Phi_t = sum_{tau < t} w_tau, w_tau = sigmoid((u.x_tau + b) / 16) from the layer's
                input x, one scalar per token shared by the heads; u, b and theta per layer, u = 0,
                b = softplus^-1(1e-3) (w = 0.394 at start: the official code's sigmoid, not its comments'
                softplus), theta_m = base^(-2m/d) learned without the damper. The qkv hook (it reads x).
                Relative: it reads no position id.
additive        GRAPE-A, query- and key-gated: b_h(i, j) = -(i - j) softplus(o_h) m_h [softplus(v_h.q_i / sqrt d)
                + softplus(u_h.k_j / sqrt d)] on the scaled logits, m_h ALiBi's slopes, u_h and v_h
                L2-normalised at every forward (init N(0, 1/d)), o_h init softplus^-1(1), all per layer.
                Relative (reads i - j and content). Causal only.
path            GRAPE-AP: p_t = W_p x_t per head (width d_p = `p_dim`, x the layer's input), p~_l = R_l rmsnorm(p_l)
                with R_l turning every plane by l radians (RoPE at base 1, l the key's position id),
                psi(t, l) = m_h logsigmoid(p_t.p~_l / d_p), b(t, j) = sum_{l = j+1..t} psi(t, l), so b(t, t) = 0;
                on the eager backend, O(H L^2 d_p) per layer. Not relative (R_l reads the absolute position).
                Causal only.

qk_norm: the paper's QK-RMSNorm, a learned weight per layer, q or k and feature (shared by the heads, as
the official RMSNorm(head_dim)), eps 1e-5. null takes the form's setting: on for additive and path, as in
every run of the paper (their gates read q and k, whose scale it bounds); off for multiplicative, which
then keeps RoPE's exact relative law, as posbench's rope. On there, it follows the rotation (the paper's
order; for multiplicative_ctx too) and multiplicative is no longer relative: the weights differ within a
rotation pair (multiplicative_ctx stays relative: it reads no position id).
The rotations turn the other way from the official code's (x_1 cos + x_2 sin): the same models up to
negating the second half of each head's q, k (or p) features, a symmetric change of the initial draw.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from posbench.checks import Choice, Flag, Integer, Real
from posbench.encodings.alibi import alibi_slopes
from posbench.encodings.base import Encoding, LayerShape, ModelDims, relative_distance
from posbench.encodings.rope import rope_inv_freq, rotate, rotate_by_angles

FORMS = ("multiplicative", "multiplicative_ctx", "additive", "path")
ROTATING = ("multiplicative", "multiplicative_ctx")
CTX_GATE_SCALE = 16.0  # w = sigmoid((u.x + b) / 16)
CTX_GATE_BIAS = math.log(math.expm1(1e-3))  # b = softplus^-1(1e-3)
LOG_FREQ_SCALE = 16.0  # log_freq = 16 log w
NORM_EPS = 1e-5  # the official QK-RMSNorm's
GATE_EPS = 1e-6  # the official L2 normalisation of u and v


class GRAPE(Encoding):
    name = "grape"
    hooks = frozenset({"qk"})  # multiplicative; additive: key_term, path: logit_transform (+ qk with qk_norm)
    relative = True  # multiplicative without qk_norm, additive; path reads absolute key positions

    def __init__(self, dims: ModelDims, form: str = "multiplicative", base: float = 10000.0,
                 qk_norm: bool | None = None, p_dim: int = 8):
        super().__init__(dims)
        self.form = Choice(FORMS)("encoding.form", form, self.name)
        self.base = Real(above=1)("encoding.base", base, self.name)
        qk_norm = Flag(null="the form's: true for additive and path, false for multiplicative")(
            "encoding.qk_norm", qk_norm, self.name)
        self.qk_norm = self.form not in ROTATING if qk_norm is None else qk_norm
        self.p_dim = Integer(2)("encoding.p_dim", p_dim, self.name)
        d, heads = dims.head_dim, dims.n_heads
        if self.form in ROTATING and d % 2:
            raise ValueError(f"grape: encoding.form={self.form} rotates feature pairs and needs an even head size, "
                             f"got model.d_model / model.n_heads = {dims.d_model}/{heads} = {d}")
        if self.form == "path" and self.p_dim % 2:
            raise ValueError(f"grape: encoding.p_dim={self.p_dim}: must be even (p turns in planes)")
        if self.form not in ROTATING and not dims.causal:
            raise ValueError(f"grape: encoding.form={self.form} penalises -(i - j), a causal bias (the paper's code is "
                             "causal only); set model.causal=true or use form=multiplicative")
        self.causal_only = self.form not in ROTATING
        # a shift of every position: the contextual phases read none; a norm inside a rotation pair breaks rope's law
        self.relative = self.form in ("additive", "multiplicative_ctx") or not self.qk_norm and self.form != "path"
        main = {"multiplicative": "qk", "multiplicative_ctx": "qkv", "additive": "key_term",
                "path": "logit_transform"}[self.form]
        self.hooks = frozenset({main} | ({"qk"} if self.qk_norm else set()))
        layers = dims.n_layers
        if self.qk_norm:  # [layers, 2 (q, k), d]
            self.norm_weight = nn.Parameter(torch.ones(layers, 2, d))
        self.register_buffer("slopes", alibi_slopes(heads), persistent=False)  # [H] float64
        if self.form == "multiplicative":  # [layers, d/2]
            self.log_freq = nn.Parameter((LOG_FREQ_SCALE * rope_inv_freq(d, self.base).log()).float().repeat(layers, 1))
        elif self.form == "multiplicative_ctx":
            self.ctx_u = nn.Parameter(torch.zeros(layers, dims.d_model))  # [layers, D]
            self.ctx_b = nn.Parameter(torch.full((layers,), CTX_GATE_BIAS))  # [layers]
            self.ctx_theta = nn.Parameter(rope_inv_freq(d, self.base).float().repeat(layers, 1))  # [layers, d/2]
        elif self.form == "additive":
            self.rate_logit = nn.Parameter(torch.full((layers, heads), math.log(math.expm1(1.0))))  # o: softplus(o) = 1
            self.u = nn.Parameter(torch.randn(layers, heads, d) / math.sqrt(d))  # key gate directions
            self.v = nn.Parameter(torch.randn(layers, heads, d) / math.sqrt(d))  # query gate directions
        else:
            self.w_p = nn.ModuleList(nn.Linear(dims.d_model, heads * self.p_dim, bias=False) for _ in range(layers))
            for linear in self.w_p:  # the official hidden init, 0.5 / sqrt(d_model)
                nn.init.normal_(linear.weight, std=0.5 / math.sqrt(dims.d_model))
            self.register_buffer("plane_freq", rope_inv_freq(self.p_dim, 1.0), persistent=False)  # ones: [d_p/2]

    def params(self) -> dict:
        extra = {"multiplicative": {"base": self.base}, "multiplicative_ctx": {"base": self.base}, "additive": {},
                 "path": {"p_dim": self.p_dim}}[self.form]
        return {"form": self.form, "qk_norm": self.qk_norm, **extra}

    def norm(self, x: torch.Tensor, layer: int, which: int) -> torch.Tensor:
        """QK-RMSNorm in float32 at least: x [B, H, L, d] -> the same."""
        compute = torch.promote_types(x.dtype, torch.float32)
        y = x.to(compute)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + NORM_EPS) * self.norm_weight[layer, which].to(compute)
        return y.to(x.dtype)  # [B, H, L, d]

    def qk(self, q, k, q_pos, k_pos, layer):
        if self.form == "multiplicative":
            freq = torch.exp(self.log_freq[layer] / LOG_FREQ_SCALE)  # [d/2]
            q, k = rotate(q, q_pos, freq, "half"), rotate(k, k_pos, freq, "half")
        if self.qk_norm:
            q, k = self.norm(q, layer, 0), self.norm(k, layer, 1)
        return q, k

    def qkv(self, q, k, v, call):
        if self.form != "multiplicative_ctx":
            return q, k, v
        layer = call.layer
        compute = torch.promote_types(q.dtype, torch.float32)
        x = call.x.to(compute)  # the layer's input at its tokens: [B, L, D]
        w = torch.sigmoid((x @ self.ctx_u[layer].to(compute) + self.ctx_b[layer].to(compute)) / CTX_GATE_SCALE)  # [B, L]
        phase = w.cumsum(-1) - w  # Phi_t = sum over tau < t: [B, L]
        angles = phase[:, None, :, None] * self.ctx_theta[layer].to(compute)  # [B, 1, L, d/2]
        return rotate_by_angles(q, angles, "half"), rotate_by_angles(k, angles, "half"), v

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        # additive: the distances and the gate sum [B, H, Lq, Lk] and the term; path: psi, its shift and the
        # reversed cumulative sum [B, H, Lq, Lk]; training keeps them for the backward
        copies = {"multiplicative": (0.0, 0.0), "multiplicative_ctx": (0.0, 0.0), "additive": (3.0, 1.0),
                  "path": (3.75, 1.5)}[self.form]
        return shape.pair_bytes(copies[0] if shape.training else copies[1])

    def key_term(self, q, k, q_pos, k_pos, layer):
        if self.form != "additive":
            return None
        compute = torch.promote_types(q.dtype, torch.float32)
        u = F.normalize(self.u[layer].to(compute), dim=-1, eps=GATE_EPS)  # [H, d]
        v = F.normalize(self.v[layer].to(compute), dim=-1, eps=GATE_EPS)  # [H, d]
        root = math.sqrt(q.shape[-1])
        gate_q = F.softplus(torch.einsum("bhld,hd->bhl", q.to(compute), v).to(compute) / root)  # [B, H, Lq]
        gate_k = F.softplus(torch.einsum("bhld,hd->bhl", k.to(compute), u).to(compute) / root)  # [B, H, Lk]
        rate = F.softplus(self.rate_logit[layer].to(compute)) * self.slopes.to(compute)  # [H]
        distance = relative_distance(q_pos, k_pos).to(compute)[:, None]  # i - j: [B', 1, Lq, Lk]
        return -distance * rate[:, None, None] * (gate_q[..., :, None] + gate_k[..., None, :])  # [B, H, Lq, Lk]

    def logit_transform(self, logits, q, k, call):
        if self.form != "path":
            return logits
        x = call.x[:, call.first_key:]  # the call's keys' input: [B, Lk, D]
        b, lk, _ = x.shape
        lq = logits.shape[-2]
        p = self.w_p[call.layer](x).view(b, lk, self.dims.n_heads, self.p_dim).transpose(1, 2)  # [B, H, Lk, d_p]
        p = p.to(torch.promote_types(p.dtype, torch.float32))
        turned = rotate(F.rms_norm(p, (self.p_dim,)), call.k_pos, self.plane_freq, "half")  # p~_l: [B, H, Lk, d_p]
        queries = p[..., call.q_start:call.q_start + lq, :]  # p_t: [B, H, Lq, d_p]
        psi = F.logsigmoid((queries @ turned.transpose(-1, -2)).to(p.dtype) / self.p_dim)  # [B, H, Lq, Lk]
        psi = (psi * self.slopes.to(psi.dtype)[:, None, None]).masked_fill(~call.visible(), 0.0)  # l <= t only
        later = F.pad(psi[..., 1:], (0, 1))  # psi(t, j + 1) at j: [B, H, Lq, Lk]
        return logits + later.flip(-1).cumsum(-1).flip(-1).to(logits.dtype)  # + sum_{l > j} psi(t, l)
