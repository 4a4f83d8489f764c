"""FoPE against its formula written as loops over feature pairs (float64), the kept frequencies and the
coefficient shapes counted by hand for the paper's settings (d 64 at N 512 and 1024), the step eye and
the xavier-normal spread of the draw, the cutoff fixed by the training length whatever the evaluation
length, sdpa against eager, learnable and frozen coefficients, and the refusal of bad parameters."""
import math

import pytest
import torch

from posbench.attention import get_backend
from posbench.encodings import ModelDims
from posbench.encodings.fope import FoPE
from posbench.model import ModelConfig, Transformer
from tests.helpers import assert_close_scaled


def fope(head_dim: int, train_positions: int, n_heads: int = 2, **params) -> FoPE:
    dims = ModelDims(d_model=head_dim * n_heads, n_heads=n_heads, n_layers=2, max_positions=4 * train_positions,
                     train_positions=train_positions)
    return FoPE(dims, **params)


def kept_by_hand(head_dim: int, train_positions: int, base: float = 1e4) -> list[float]:
    """w_k = base^(-2k/d), k < d/2, at or above 2 pi / N."""
    return [base ** (-2 * k / head_dim) for k in range(head_dim // 2)
            if base ** (-2 * k / head_dim) >= 2 * math.pi / train_positions]


def rotated_by_hand(x, pos, freq, cos_coef, sin_coef):
    """x [B, H, L, d] at pos [B', L]; pair m < M turns by c = sum_D C^cos[h, D, m] cos(w_D t),
    s = sum_D C^sin[h, D, m] sin(w_D t); the other pairs take c = s = 1."""
    out = torch.empty_like(x)
    b_count, heads, length, d = x.shape
    half, pairs = d // 2, cos_coef.shape[-1]
    for b in range(b_count):
        for h in range(heads):
            for i in range(length):
                t = float(pos[b if pos.shape[0] > 1 else 0, i])
                for m in range(half):
                    c = s = 1.0
                    if m < pairs:
                        c = sum(float(cos_coef[h, n, m]) * math.cos(w * t) for n, w in enumerate(freq))
                        s = sum(float(sin_coef[h, n, m]) * math.sin(w * t) for n, w in enumerate(freq))
                    a, z = x[b, h, i, m], x[b, h, i, m + half]
                    out[b, h, i, m] = a * c - z * s
                    out[b, h, i, m + half] = z * c + a * s
    return out


@pytest.mark.parametrize("head_dim,train_positions,n_freq,n_pairs", [(64, 512, 16, 16), (64, 1024, 18, 16),
                                                                    (128, 512, 31, 31), (128, 1024, 36, 32)])
def test_kept_frequencies_and_coefficient_shapes(head_dim, train_positions, n_freq, n_pairs):
    enc = fope(head_dim, train_positions, n_heads=3)
    assert len(kept_by_hand(head_dim, train_positions)) == n_freq
    assert (enc.n_freq, enc.n_pairs) == (n_freq, n_pairs)
    assert_close_scaled(enc.freq, torch.tensor(kept_by_hand(head_dim, train_positions), dtype=torch.float64),
                        rtol=1e-14, name="kept frequencies")
    assert enc.cos_coef.shape == enc.sin_coef.shape == (2, 3, n_freq, n_pairs)


def test_step_eye_at_d64_n1024():
    """D' = 18 > M = 16: step ceil(18/16) = 2, so only the columns i with 2i < 18 (nine) hold a one."""
    enc = fope(64, 1024, gain=0.0)
    eye = torch.zeros(18, 16)
    for i in range(9):
        eye[2 * i, i] = 1.0
    for table in (enc.cos_coef, enc.sin_coef):
        assert torch.equal(table, eye.expand(2, 2, 18, 16))
    square = fope(64, 512, gain=0.0)  # D' = M = 16: the identity
    assert torch.equal(square.cos_coef[1, 0], torch.eye(16))


def test_the_draw_is_xavier_normal_around_the_eye():
    """std = gain sqrt(2 / ((D' + H) M)): fan_in D' M, fan_out H M of each layer's [H, D', M]."""
    torch.manual_seed(0)
    heads, gain = 8, 0.3
    enc = fope(64, 1024, n_heads=heads, gain=gain)
    eye = fope(64, 1024, n_heads=heads, gain=0.0).cos_coef
    draws = torch.cat([(enc.cos_coef - eye).flatten(), (enc.sin_coef - eye).flatten()])  # 4 x 2304 values
    expected = gain * math.sqrt(2 / ((18 + heads) * 16))
    assert abs(draws.std().item() / expected - 1) < 0.05
    assert abs(draws.mean().item()) < 0.05 * expected
    assert not torch.equal(enc.cos_coef[0], enc.cos_coef[1])  # each layer draws its own
    assert not torch.equal(enc.cos_coef, enc.sin_coef)


@pytest.mark.parametrize("head_dim,train_positions", [(16, 64), (16, 1024)])  # D' = 3 < M = 4; D' = 5 > M = 4
def test_rotation_matches_the_formula(head_dim, train_positions):
    enc = fope(head_dim, train_positions).double()
    gen = torch.Generator().manual_seed(1)
    for table in (enc.cos_coef, enc.sin_coef):
        table.copy_(torch.randn(table.shape, generator=gen, dtype=torch.float64))
    q, k = torch.randn(2, 2, 2, 5, head_dim, generator=gen, dtype=torch.float64)
    q_pos = torch.tensor([[3, 4, 5, 6, 7], [100, 101, 102, 103, 104]])  # per sequence, past N for one
    k_pos = torch.tensor([[0, 1, 2, 3, 4]])  # shared by the batch
    freq = kept_by_hand(head_dim, train_positions)
    for layer in (0, 1):
        got_q, got_k = enc.qk(q, k, q_pos, k_pos, layer)
        expected_q = rotated_by_hand(q, q_pos, freq, enc.cos_coef[layer], enc.sin_coef[layer])
        expected_k = rotated_by_hand(k, k_pos, freq, enc.cos_coef[layer], enc.sin_coef[layer])
        assert_close_scaled(got_q, expected_q, rtol=1e-12, name=f"q, layer {layer}")
        assert_close_scaled(got_k, expected_k, rtol=1e-12, name=f"k, layer {layer}")


def test_the_cutoff_comes_from_the_training_length():
    enc = fope(16, 64)
    q, k = torch.randn(2, 1, 2, 300, 16)
    pos = torch.arange(300)[None]
    before, freq = enc.qk(q, k, pos, pos, 0), enc.freq.clone()
    enc.set_eval_length(64, 256)
    after = enc.qk(q, k, pos, pos, 0)
    assert torch.equal(enc.freq, freq) and len(freq) == 3
    assert all(map(torch.equal, before, after))
    assert fope(16, 256).n_freq == 4  # trained at 256, one more frequency completes a turn


def model(enc: FoPE, backend: str) -> Transformer:
    torch.manual_seed(2)
    cfg = ModelConfig(vocab_size=11, d_model=enc.dims.d_model, n_layers=2, n_heads=enc.dims.n_heads)
    return Transformer(cfg, enc, get_backend(backend, enc)).double().eval()


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_matches_eager(causal):
    torch.manual_seed(3)
    dims = ModelDims(d_model=64, n_heads=2, n_layers=2, max_positions=128, train_positions=64, causal=causal)
    enc = FoPE(dims)
    cfg = ModelConfig(vocab_size=11, d_model=64, n_layers=2, n_heads=2, causal=causal)
    torch.manual_seed(4)
    eager = Transformer(cfg, enc, get_backend("eager")).double().eval()
    sdpa = Transformer(cfg, FoPE(dims), get_backend("sdpa")).double().eval()
    sdpa.load_state_dict(eager.state_dict())  # the coefficients too: persistent buffers
    ids = torch.randint(0, 11, (2, 100), generator=torch.Generator().manual_seed(5))  # past N = 64
    pos = torch.arange(100)[None]
    assert_close_scaled(sdpa(ids, pos), eager(ids, pos), rtol=1e-10, name="sdpa logits")


def test_learnable_coefficients_train_and_frozen_ones_do_not():
    ids, pos = torch.randint(0, 11, (2, 9)), torch.arange(9)[None]
    frozen = model(fope(16, 64), "eager").train()
    assert not any(name.startswith("encoding") for name, _ in frozen.named_parameters())
    assert {"encoding.cos_coef", "encoding.sin_coef"} <= set(frozen.state_dict())
    learned = model(fope(16, 64, learnable=True), "eager").train()
    learned(ids, pos).sin().sum().backward()
    enc = learned.encoding
    assert {name for name, _ in enc.named_parameters()} == {"cos_coef", "sin_coef"}
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in enc.parameters())


@pytest.mark.parametrize("params,message", [
    ({"gain": -1}, r"fope: encoding.gain=-1: must be >= 0"),
    ({"base": 1}, r"fope: encoding.base=1: must be > 1"),
    ({"learnable": "yes"}, r"fope: encoding.learnable='yes': must be true or false"),
    ({"floor_ratio": 1e4}, r"fope: no frequency .* encoding.floor_ratio=10000.0"),
])
def test_bad_parameters_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        fope(16, 64, **params)


def test_an_odd_or_tiny_head_is_refused():
    with pytest.raises(ValueError, match="even head size >= 4"):
        fope(2, 64)
