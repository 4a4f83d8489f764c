"""TAPE against a transcription of the official layer (VITA-Group/TAPE, models/llama/adape.py: position states
C, S with duplicated halves, q * C + rotate_half(q) * S, the states attended with the same weights, the
post-attention einsum, the PELayer einsums), through a whole model with every state parameter drawn non-zero;
RoPE at start; a shift of every position; chunked evaluation, training blocks and sdpa equal to one eager pass;
causality; the refusals."""
import math

import pytest
import torch
import torch.nn.functional as F

from posbench.attention import get_backend
from posbench.encodings.rope import rope_inv_freq
from posbench.model import ModelConfig, Transformer
from tests.helpers import assert_close_scaled, make_encoding

D_MODEL, HEADS, HEAD, VOCAB = 16, 2, 8, 11


def drawn_tape(backend="auto", seed=0, **params):
    """A float64 model whose state parameters are all non-zero, so every update acts."""
    torch.manual_seed(seed)  # the encoding's initial values too, whatever ran before
    enc = make_encoding("tape", d_model=D_MODEL, n_heads=HEADS, **params).double()
    model = Transformer(ModelConfig(vocab_size=VOCAB, d_model=D_MODEL, n_layers=2, n_heads=HEADS), enc,
                        get_backend(backend, enc)).double()
    with torch.no_grad():
        for p in (enc.mix_attended, enc.w_up, enc.w_down):
            p.normal_(std=0.5)
        for linear in enc.w_x:
            linear.weight.normal_(std=0.5)
        for block in model.blocks:
            block.attn.qkv.weight.normal_(std=0.4)
    return model.eval()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def tape_by_hand(model, ids, pos):
    """The official decoder layer's order over posbench's pre-LN block: attention on C, S-rotated q and k, the
    states attended and mixed by post_attention_linear's einsum, then the PELayer update from the MLP output."""
    enc = model.encoding
    b, length = ids.shape
    freqs = pos[0].double()[:, None] * rope_inv_freq(HEAD)  # [L, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [L, d]
    c_state = emb.cos()[None, None].repeat(b, HEADS, 1, 1)  # [B, H, L, d]
    s_state = emb.sin()[None, None].repeat(b, HEADS, 1, 1)
    mask = torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)
    x = model.tok(ids)
    for layer, block in enumerate(model.blocks):
        h = block.norm1(x)
        q, k, v = (t.view(b, length, HEADS, HEAD).transpose(1, 2) for t in (h @ block.attn.qkv.weight.T).split(D_MODEL, -1))
        q = q * c_state + rotate_half(q) * s_state
        k = k * c_state + rotate_half(k) * s_state
        weights = (q @ k.transpose(2, 3) / math.sqrt(HEAD) + mask).softmax(-1)  # [B, H, L, L]
        out = (weights @ v).transpose(1, 2).reshape(b, length, D_MODEL)
        attended = (weights @ c_state, weights @ s_state)
        x = x + out @ block.attn.out.weight.T
        mixed = [torch.einsum("bqnd,qe->bqnd", state, enc.mix_attended[layer]) for state in attended]
        c_state, s_state = c_state + mixed[0], s_state + mixed[1]
        u = block.mlp(block.norm2(x))
        updated = []
        for state in (c_state, s_state):
            up = torch.einsum("bqnd,eq->bend", state, enc.w_up[layer])  # [B, P, L, d]
            gated = F.silu(enc.w_x[layer](u).transpose(1, 2)[..., None]) * up
            updated.append(state + torch.einsum("bend,qe->bqnd", gated, enc.w_down[layer]))
        c_state, s_state = updated
        x = x + u
    return model.head(model.norm(x))


def test_a_model_equals_the_official_layers_transcribed():
    model = drawn_tape()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12)[None]
    with torch.no_grad():
        got = model(ids, pos)
        assert_close_scaled(got, tape_by_hand(model, ids, pos), rtol=1e-12, name="logits")
        plain = make_encoding("rope", d_model=D_MODEL, n_heads=HEADS).double()
        model.encoding = plain
        for block in model.blocks:
            block.attn.encoding = [plain]
        assert (model(ids, pos) - got).abs().max() > 1e-3  # the moved states change the logits


def test_at_start_tape_is_rope():
    enc = make_encoding("tape", d_model=D_MODEL, n_heads=HEADS).double()
    rope = make_encoding("rope", d_model=D_MODEL, n_heads=HEADS).double()
    cfg = ModelConfig(vocab_size=VOCAB, d_model=D_MODEL, n_layers=2, n_heads=HEADS)
    torch.manual_seed(2)
    model = Transformer(cfg, enc, get_backend("eager", enc)).double().eval()
    torch.manual_seed(2)
    reference = Transformer(cfg, rope, get_backend("eager", rope)).double().eval()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(10)[None]
    with torch.no_grad():
        assert_close_scaled(model(ids, pos), reference(ids, pos), rtol=1e-12, name="tape at start vs rope")


@pytest.mark.parametrize("shift", [1, 37, 1000])
def test_a_shift_of_every_position_changes_nothing(shift):
    model = drawn_tape()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(12)[None]
    with torch.no_grad():
        assert_close_scaled(model(ids, pos + shift), model(ids, pos), rtol=1e-9, name=f"shift {shift}")


def test_chunks_blocks_and_sdpa_equal_one_eager_pass_and_stay_causal():
    model = drawn_tape(backend="eager")
    ids = torch.randint(0, VOCAB, (2, 150), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(150)[None]
    with torch.no_grad():
        reference = model(ids, pos)
        model.set_eval_chunk(40)
        assert_close_scaled(model(ids, pos), reference, rtol=1e-12, name="chunked")
        model.set_eval_chunk(None)
        model.train()  # eager trains in query blocks of 128: two here
        assert_close_scaled(model(ids, pos), reference, rtol=1e-12, name="training blocks")
        model.eval()
        model.use_backend(get_backend("sdpa", model.encoding))
        assert_close_scaled(model(ids, pos), reference, rtol=1e-12, name="sdpa")
        changed = ids.clone()
        changed[:, 90:] = (changed[:, 90:] + 1) % VOCAB
        assert_close_scaled(model(changed, pos)[:, :90], reference[:, :90], rtol=1e-12, name="past logits")
        assert (model(changed, pos)[:, 90:] - reference[:, 90:]).abs().max() > 1e-3


def test_every_state_parameter_learns():
    model = drawn_tape()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(6))
    model(ids, torch.arange(12)[None]).square().sum().backward()
    enc = model.encoding
    for name, p in [("mix_attended", enc.mix_attended), ("w_up", enc.w_up), ("w_down", enc.w_down),
                    ("w_x", enc.w_x[0].weight)]:
        assert p.grad is not None and p.grad.abs().max() > 0, name


def test_refusals():
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=r"encoding.position_size=.*positive integer"):
            make_encoding("tape", position_size=bad)
    with pytest.raises(ValueError, match="act on the model input"):
        make_encoding("schedule", pattern=["tape", "nope"])
    model = drawn_tape()
    with pytest.raises(ValueError, match=r"segment recurrence keeps earlier keys .* 'tape' reads every token"):
        model.forward_recurrent(torch.zeros(1, 4, dtype=torch.long), None, 4)
