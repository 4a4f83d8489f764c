"""PaTH attention against its formula with every transform product written as an explicit matrix
product (float64), the triangular-solve products against fla's recurrence over a cache of keys at
hundreds of tokens (float64, and float32 within rounding), w and beta against their definitions written
out, PaTH-FoX as a composite, chunked evaluation equal to one pass, causality, and the refusal of a
bidirectional model."""
import math

import pytest
import torch
import torch.nn.functional as F

from posbench.attention import Attention, PositionContext, get_backend
from posbench.model import ModelConfig, Transformer
from posbench.encodings.path import path_products
from tests.helpers import assert_close_scaled, make_encoding

D_MODEL, HEADS, HEAD, LENGTH = 16, 2, 8, 7


def drawn_path(**kwargs):
    torch.manual_seed(0)
    enc = make_encoding("path", d_model=D_MODEL, n_heads=HEADS, **kwargs).double()
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return enc


def w_and_beta_by_hand(enc, x, layer):
    """w_t = L2norm(SiLU(sum_s c_s u_{t-2+s})) with u = W_2 W_1 x (zero before the start), beta_t = 2 sigmoid(.)."""
    u = x @ enc.w_down[layer].weight.T @ enc.w_up[layer].weight.T  # [B, L, H d]
    taps = enc.w_conv[layer].weight[:, 0, :]  # [H d, 3]: tap s multiplies u_{t - 2 + s}
    conv = torch.zeros_like(u)
    for t in range(x.shape[1]):
        for s in range(3):
            if t - 2 + s >= 0:
                conv[:, t] += taps[:, s] * u[:, t - 2 + s]
    w = F.silu(conv).view(*x.shape[:2], HEADS, HEAD)  # [B, L, H, d]
    w = w / w.norm(dim=-1, keepdim=True)
    beta = 2 * torch.sigmoid(x @ enc.beta[layer].weight.T + enc.beta[layer].bias)  # [B, L, H]
    return w.transpose(1, 2), beta.transpose(1, 2)


def path_attention_by_hand(x, attn, enc, extra=None):
    """o_i = sum_{j<=i} softmax_j(q_i^T H_i ... H_{j+1} k_j / sqrt(d) [+ extra_ij]) v_j, each product a matrix."""
    b, length, _ = x.shape
    q, k, v = (t.view(b, length, HEADS, HEAD).transpose(1, 2) for t in (x @ attn.qkv.weight.T).split(D_MODEL, -1))
    w, beta = w_and_beta_by_hand(enc, x, attn.layer)
    out = torch.zeros_like(q)
    eye = torch.eye(HEAD, dtype=x.dtype)
    for s in range(b):
        for h in range(HEADS):
            for i in range(length):
                logits = []
                for j in range(i + 1):
                    product = eye.clone()
                    for t in range(j + 1, i + 1):  # H_i ... H_{j+1}: H_{j+1} acts first
                        product = (eye - beta[s, h, t] * torch.outer(w[s, h, t], w[s, h, t])) @ product
                    logit = q[s, h, i] @ product @ k[s, h, j] / math.sqrt(HEAD)
                    logits.append(logit + (0 if extra is None else extra[s, h, i, j]))
                out[s, h, i] = torch.stack(logits).softmax(0) @ v[s, h, :i + 1]
    return out.transpose(1, 2).reshape(b, length, D_MODEL) @ attn.out.weight.T


def test_householder_vectors_follow_their_definition():
    enc = drawn_path()
    x = torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64)
    w, beta = enc.householder(x, 1)
    expected_w, expected_beta = w_and_beta_by_hand(enc, x, 1)
    assert_close_scaled(w, expected_w, rtol=1e-12, name="w")
    assert_close_scaled(beta, expected_beta, rtol=1e-12, name="beta")
    assert ((beta > 0) & (beta < 2)).all()


def test_path_attention_is_the_product_of_transforms():
    enc = drawn_path()
    torch.manual_seed(1)
    attn = Attention(D_MODEL, HEADS, 1, enc, get_backend("auto", enc), True).double()
    assert attn.backend.name == "eager"
    x = torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        got = attn(x, PositionContext(enc, torch.arange(LENGTH)[None]))
    assert_close_scaled(got, path_attention_by_hand(x, attn, enc), rtol=1e-12)


def carried_keys(q, k, w, beta):
    """fla's reference recurrence: at step t every cached key j < t becomes H_t k_j, then k_t joins and
    query t reads the cache -> [B, H, L, L], zero above the diagonal."""
    length = k.shape[-2]
    out = torch.zeros(*q.shape[:-1], length, dtype=q.dtype)
    cache = k.clone()
    for t in range(length):
        if t:
            h_t = beta[..., t, None, None] * w[..., t, :, None] * w[..., t, None, :]  # beta w w^T: [B, H, d, d]
            cache[..., :t, :] = cache[..., :t, :] - cache[..., :t, :] @ h_t  # (I - beta w w^T) k_j, symmetric
        out[..., t, :t + 1] = (cache[..., :t + 1, :] @ q[..., t, :, None])[..., 0]
    return out


@pytest.mark.parametrize("length,q_start", [(300, 0), (120, 70)])
def test_the_triangular_solve_gives_the_recurrence_at_length(length, q_start):
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 2, 3, length, 16, generator=gen, dtype=torch.float64)
    w = F.normalize(torch.randn(2, 3, length, 16, generator=gen, dtype=torch.float64), dim=-1)
    beta = 2 * torch.rand(2, 3, length, generator=gen, dtype=torch.float64)
    expected = carried_keys(q, k, w, beta)[..., q_start:, :]
    assert_close_scaled(path_products(q[..., q_start:, :], k, w, beta, q_start), expected, rtol=1e-11)
    single = path_products(q[..., q_start:, :].float(), k.float(), w.float(), beta.float(), q_start)
    torch.testing.assert_close(single.double(), expected, rtol=0, atol=1e-4)  # logits up to ~18


def test_path_fox_composite_adds_the_forget_gates():
    enc = make_encoding("composite", d_model=D_MODEL, n_heads=HEADS, parts=["path", "fox"]).double()
    torch.manual_seed(2)
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.5)
    path, fox = enc.parts
    attn = Attention(D_MODEL, HEADS, 0, enc, get_backend("auto", enc), True).double()
    x = torch.randn(1, LENGTH, D_MODEL, dtype=torch.float64)
    log_f = F.logsigmoid(x @ fox.gates[0].weight.T + fox.gates[0].bias)[0].T  # [H, L]
    levels = log_f.cumsum(-1)
    gates = (levels[:, :, None] - levels[:, None, :])[None]  # c_i - c_j: [1, H, L, L]
    with torch.no_grad():
        got = attn(x, PositionContext(enc, torch.arange(LENGTH)[None]))
    assert_close_scaled(got, path_attention_by_hand(x, attn, path, gates), rtol=1e-12)


def test_chunked_evaluation_and_causality():
    enc = drawn_path()
    cfg = ModelConfig(vocab_size=11, d_model=D_MODEL, n_layers=2, n_heads=HEADS)
    torch.manual_seed(3)
    model = Transformer(cfg, enc, get_backend("auto", enc)).double().eval()
    ids = torch.randint(0, 11, (2, 20), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(20)[None]
    reference = model(ids, pos)
    model.set_eval_chunk(6)
    assert_close_scaled(model(ids, pos), reference, rtol=0, atol_scale=1e-10, name="chunked logits")
    changed = ids.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % 11
    assert_close_scaled(model(changed, pos)[:, :12], reference[:, :12], rtol=0, atol_scale=1e-12, name="past logits")
    assert (model(changed, pos)[:, 12:] - reference[:, 12:]).abs().max() > 1e-3


def test_gradients_reach_every_parameter():
    enc = drawn_path()
    cfg = ModelConfig(vocab_size=11, d_model=D_MODEL, n_layers=2, n_heads=HEADS)
    model = Transformer(cfg, enc, get_backend("auto", enc)).double().train()
    model(torch.randint(0, 11, (2, 9)), torch.arange(9)[None]).sin().sum().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() and p.grad.abs().sum() > 0 for p in enc.parameters())


def test_a_bidirectional_model_is_refused():
    with pytest.raises(ValueError, match="path: .*causal product; set model.causal=true"):
        make_encoding("path", causal=False)
