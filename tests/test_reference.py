"""Reference-equivalence tests: posbench encodings against independent third-party code.

Each test calls the library's own function or module (never a copy of it), so a shared
misreading of a paper cannot make both sides agree. Libraries are optional: a test whose
library is missing is skipped with the reason. Numbers are float64 wherever the library
can compute in float64; where it cannot, the tolerance says why.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from posbench.attention import AttentionCall
from posbench.encodings.alibi import ALiBi, alibi_slopes
from posbench.encodings.base import ModelDims
from posbench.encodings.rope import RoPE, rope_inv_freq, rotate
from posbench.encodings.t5 import t5_bucket
from tests.helpers import assert_close_scaled

HEADS, HEAD_DIM, SEQ = 4, 16, 24
DIMS = ModelDims(d_model=HEADS * HEAD_DIM, n_heads=HEADS, n_layers=1, max_positions=2048, train_positions=2048)
RELATIVE = torch.arange(-1000, 1001)  # j - i, key minus query
# (num_buckets, max_distance); the last three put exact-integer log ratios on bucket edges
T5_SETTINGS = [(32, 128), (16, 64), (64, 256), (8, 20), (18, 128), (9, 128), (10, 160)]
ALIBI_HEADS = [*range(1, 17), 24, 48]


def qk_pair(batch: int = 2, dtype=torch.float64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, HEADS, SEQ, HEAD_DIM)
    return torch.randn(shape, generator=gen, dtype=dtype), torch.randn(shape, generator=gen, dtype=dtype)


def assert_same_buckets(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    differ = (ours != theirs).nonzero().flatten().tolist()
    listed = [(RELATIVE[i].item(), ours[i].item(), theirs[i].item()) for i in differ]
    assert not differ, f"{what}: (j - i, posbench, reference) differ at {listed}"


# --- HF transformers -------------------------------------------------------------------------

def llama_rotary(base: float):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                         rope_theta=base)
    return LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_rope_inv_freq_matches_transformers_llama(base):
    """rope_inv_freq equals the frequency table LlamaRotaryEmbedding builds for itself
    (transformers computes it in float32, hence rtol at float32 resolution)."""
    theirs = llama_rotary(base).inv_freq.double()
    torch.testing.assert_close(rope_inv_freq(HEAD_DIM, base), theirs, rtol=2e-7, atol=0)


@pytest.mark.parametrize("pos", [
    (torch.arange(SEQ) + 37)[None],  # [1, L], shared by the batch
    torch.stack([torch.arange(SEQ) + 5, torch.arange(SEQ) + 1000]),  # [B, L], one offset per row
], ids=["shared-offset", "per-row-offsets"])
def test_rope_half_matches_transformers_llama(pos):
    """The half layout equals LLaMA's apply_rotary_pos_emb (rotate_half pairing) with cos/sin
    from LlamaRotaryEmbedding. transformers forms the angles pos * theta in float32, so the
    outputs agree to float32 angle resolution, about 6e-5 rad at position 1000."""
    rotary = llama_rotary(10000.0)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = qk_pair()
    cos, sin = rotary(q, pos)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    q_ours, k_ours = RoPE(DIMS, base=10000.0, layout="half").qk(q, k, pos, pos, layer=0)
    torch.testing.assert_close(q_ours, q_ref, rtol=0, atol=2e-4)
    torch.testing.assert_close(k_ours, k_ref, rtol=0, atol=2e-4)


@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("num_buckets,max_distance", T5_SETTINGS)
def test_t5_bucket_matches_transformers(num_buckets, max_distance, bidirectional):
    """t5_bucket equals T5Attention._relative_position_bucket (relative_position = j - i) for
    every j - i in [-1000, 1000]; both do the log in float32, as T5's released code, so ids agree on the edges too."""
    pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    theirs = T5Attention._relative_position_bucket(RELATIVE, bidirectional=bidirectional,
                                                   num_buckets=num_buckets, max_distance=max_distance)
    ours = t5_bucket(RELATIVE, bidirectional, num_buckets, max_distance)
    assert_same_buckets(ours, theirs, f"transformers T5 ({num_buckets}, {max_distance}, {bidirectional=})")


# --- rotary-embedding-torch ------------------------------------------------------------------

@pytest.mark.parametrize("offset", [0, 7, 300])
def test_rope_interleaved_matches_rotary_embedding_torch(offset):
    """The interleaved layout equals rotary_embedding_torch.RotaryEmbedding (paper pairing
    x_2m, x_2m+1; sequence on dim -2; positions arange(L) + offset), run in float64.
    Its frequency table is built in float32, so the table is checked at float32 resolution and
    the rotation itself exactly, by handing posbench's rotate the library's own table."""
    rotary_embedding_torch = pytest.importorskip("rotary_embedding_torch")

    rotary = rotary_embedding_torch.RotaryEmbedding(dim=HEAD_DIM).double()
    torch.testing.assert_close(rope_inv_freq(HEAD_DIM), rotary.freqs.detach(), rtol=2e-7, atol=0)
    q, _ = qk_pair()
    pos = (torch.arange(SEQ) + offset)[None]
    theirs = rotary.rotate_queries_or_keys(q, offset=offset)
    torch.testing.assert_close(rotate(q, pos, rotary.freqs.detach(), "interleaved"), theirs, rtol=1e-12, atol=1e-12)


# --- x-transformers --------------------------------------------------------------------------

@pytest.mark.parametrize("n_heads", ALIBI_HEADS)
def test_alibi_slopes_match_x_transformers(n_heads):
    """alibi_slopes equals AlibiPositionalBias._get_slopes (Python floats, so float64), including
    the interleaved fill-in for head counts that are not powers of two."""
    pytest.importorskip("x_transformers")
    from x_transformers.x_transformers import AlibiPositionalBias

    theirs = torch.tensor(AlibiPositionalBias._get_slopes(n_heads), dtype=torch.float64)
    torch.testing.assert_close(alibi_slopes(n_heads), theirs, rtol=1e-14, atol=0)


@pytest.mark.parametrize("n_heads", [4, 6, 12])
def test_alibi_bias_matches_x_transformers(n_heads):
    """ALiBi.bias equals AlibiPositionalBias: forward(i, j) (queries are the last i of j keys,
    [H, i, j]) and forward_custom_pos with arbitrary per-row positions ([B, H, i, j]); both
    add -m_h * |i - j| to every head. Both keep the slopes in float32."""
    pytest.importorskip("x_transformers")
    from x_transformers.x_transformers import AlibiPositionalBias

    theirs = AlibiPositionalBias(heads=n_heads)
    dims = ModelDims(d_model=8 * n_heads, n_heads=n_heads, n_layers=1, max_positions=64, train_positions=64)
    ours = ALiBi(dataclasses.replace(dims, causal=False))  # the bias; a causal model takes it as a decay
    lq, lk = 5, 9
    q_pos, k_pos = torch.arange(lk - lq, lk)[None], torch.arange(lk)[None]
    torch.testing.assert_close(ours.bias(q_pos, k_pos, layer=0)[0], theirs(lq, lk), rtol=1e-6, atol=0)
    causal = ALiBi(dims)
    levels = causal.decay(AttentionCall(causal, q_pos, k_pos, 0, True))[0]  # c at the keys: [H, Lk]
    decay = levels[:, lk - lq:, None] - levels[:, None, :]  # c_i - c_j: [H, Lq, Lk]
    seen = k_pos[0] <= q_pos[0, :, None]  # [Lq, Lk]
    torch.testing.assert_close(decay[:, seen].float(), theirs(lq, lk)[:, seen], rtol=1e-6, atol=0)

    gen = torch.Generator().manual_seed(1)
    q_pos, k_pos = torch.randint(0, 60, (2, lq), generator=gen), torch.randint(0, 60, (2, lk), generator=gen)
    torch.testing.assert_close(ours.bias(q_pos, k_pos, layer=0), theirs.forward_custom_pos(q_pos, k_pos),
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("num_buckets,max_distance", T5_SETTINGS)
def test_t5_bucket_matches_x_transformers(num_buckets, max_distance, bidirectional):
    """t5_bucket equals RelativePositionBias._relative_position_bucket, which also takes
    j - i (its forward passes k_pos - q_pos) but flags causal = not bidirectional."""
    pytest.importorskip("x_transformers")
    from x_transformers.x_transformers import RelativePositionBias

    theirs = RelativePositionBias._relative_position_bucket(RELATIVE, causal=not bidirectional,
                                                            num_buckets=num_buckets, max_distance=max_distance)
    ours = t5_bucket(RELATIVE, bidirectional, num_buckets, max_distance)
    assert_same_buckets(ours, theirs, f"x-transformers T5 ({num_buckets}, {max_distance}, {bidirectional=})")


# --- layouts (no library) --------------------------------------------------------------------

def test_rope_layouts_agree_up_to_feature_permutation():
    """Half layout on q, k with features reordered (x_0, x_2, ..., x_1, x_3, ...) gives the
    interleaved result reordered the same way, hence identical logits q.k^T."""
    q, k = qk_pair()
    gen = torch.Generator().manual_seed(2)
    q_pos, k_pos = torch.randint(0, 500, (2, SEQ), generator=gen), torch.randint(0, 500, (2, SEQ), generator=gen)
    perm = torch.cat([torch.arange(0, HEAD_DIM, 2), torch.arange(1, HEAD_DIM, 2)])

    q_int, k_int = RoPE(DIMS, layout="interleaved").qk(q, k, q_pos, k_pos, layer=0)
    q_half, k_half = RoPE(DIMS, layout="half").qk(q[..., perm], k[..., perm], q_pos, k_pos, layer=0)
    torch.testing.assert_close(q_half, q_int[..., perm], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k_half, k_int[..., perm], rtol=1e-12, atol=1e-12)
    assert_close_scaled(q_half @ k_half.transpose(-1, -2), q_int @ k_int.transpose(-1, -2), rtol=1e-12,
                        name="logits")  # up to ~20
