"""Selective attention against the paper's listing (Leviathan et al. 2025, Fig. 2) transcribed over the
whole [L, L] logits, through the layer's query blocks in training (outputs and gradients) and its chunks in
evaluation; the composite with rope; context pruning against the eviction rule run query by query over
Python sets; causality and the refusals."""
import math

import pytest
import torch

from posbench.attention import Attention, PositionContext, get_backend
from posbench.attention.eager import EAGER_TRAIN_BLOCK
from posbench.encodings.rope import rope_inv_freq, rotate
from posbench.model import ModelConfig, Transformer
from tests.helpers import assert_close_scaled, make_encoding

D_MODEL, HEADS, HEAD = 16, 2, 8


def causal_logits(q, k):
    length = q.shape[-2]
    logits = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, H, L, L]
    return logits.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))


def listing(q, k):
    """The paper's listing: causal logits, head 0's ReLU without key 0 and the diagonal, rolled one query down,
    summed over queries, subtracted from every head. q, k: [B, H, L, d] -> masked logits [B, H, L, L], F [B, L, L]."""
    logits = causal_logits(q, k)
    s = logits[:, 0].relu().clone()  # [B, L, L]; -inf -> 0
    s[..., 0] = 0  # never mask the first token
    s = s * (1 - torch.eye(q.shape[-2], dtype=s.dtype))  # nor a token itself
    s = torch.roll(s, 1, -2)
    s[..., 0, :] = 0  # F_ij sums S_kj over k < i
    f = s.cumsum(-2)
    return logits - f[:, None], f


def listing_logits(q, k):
    return listing(q, k)[0]


def attention_by_hand(x, attn, rope=False, logits_of=listing_logits):
    b, length, _ = x.shape
    q, k, v = (t.view(b, length, HEADS, HEAD).transpose(1, 2) for t in (x @ attn.qkv.weight.T).split(D_MODEL, -1))
    if rope:
        pos, inv_freq = torch.arange(length)[None], rope_inv_freq(HEAD)
        q, k = rotate(q, pos, inv_freq, "half"), rotate(k, pos, inv_freq, "half")
    out = logits_of(q, k).softmax(-1) @ v  # [B, H, L, d]
    return out.transpose(1, 2).reshape(b, length, D_MODEL) @ attn.out.weight.T


def layer(enc, seed=1):
    torch.manual_seed(seed)
    attn = Attention(D_MODEL, HEADS, 0, enc, get_backend("auto", enc), True).double()
    nn_init = torch.nn.init.normal_
    nn_init(attn.qkv.weight, std=0.4)  # logits of a few units: S is positive somewhere, F matters
    nn_init(attn.out.weight, std=0.3)
    return attn


def test_the_layer_equals_the_listing_over_training_blocks_with_gradients():
    enc = make_encoding("selective", d_model=D_MODEL, n_heads=HEADS).double()
    attn = layer(enc).train()
    assert attn.backend.name == "eager"
    length = 2 * EAGER_TRAIN_BLOCK + 40  # three query blocks
    assert attn.query_block(enc, 2, length, length) == EAGER_TRAIN_BLOCK
    x = torch.randn(2, length, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    x_got, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = attn(x_got, PositionContext(enc, torch.arange(length)[None]))
    expected = attention_by_hand(x_ref, attn)
    assert_close_scaled(got, expected, rtol=1e-12, name="outputs")
    weights = torch.randn_like(got)
    (got * weights).sum().backward()
    grad_weight = attn.qkv.weight.grad.clone()
    attn.qkv.weight.grad = None
    (expected * weights).sum().backward()
    assert_close_scaled(x_got.grad, x_ref.grad, rtol=1e-11, name="d input")
    assert_close_scaled(grad_weight, attn.qkv.weight.grad, rtol=1e-11, name="d qkv")
    no_selection = attention_by_hand(x, attn, logits_of=causal_logits)
    assert (got - no_selection).abs().max() > 1e-3  # the selection changes the output


def test_rope_option_equals_the_composite_and_the_listing_on_rotated_q_k():
    own = make_encoding("selective", d_model=D_MODEL, n_heads=HEADS, rope=True).double()
    composite = make_encoding("composite", d_model=D_MODEL, n_heads=HEADS, parts=["rope", "selective"]).double()
    x = torch.randn(1, 30, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(30)[None]
    attn = layer(own).eval()
    with torch.no_grad():
        got = attn(x, PositionContext(own, pos))
        assert_close_scaled(got, attention_by_hand(x, attn, rope=True), rtol=1e-12, name="selective rope=true")
        attn.encoding = [composite]
        assert_close_scaled(attn(x, PositionContext(composite, pos)), got, rtol=1e-12, name="rope + selective")


def model_of(enc, seed=4):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=11, d_model=D_MODEL, n_layers=2, n_heads=HEADS)
    model = Transformer(cfg, enc, get_backend("auto", enc)).double().eval()
    for block in model.blocks:
        torch.nn.init.normal_(block.attn.qkv.weight, std=0.4)
    return model


def test_chunked_evaluation_equals_one_pass_and_is_causal():
    enc = make_encoding("selective", d_model=D_MODEL, n_heads=HEADS).double()
    model = model_of(enc)
    ids = torch.randint(0, 11, (2, 40), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(40)[None]
    with torch.no_grad():
        reference = model(ids, pos)
        model.set_eval_chunk(7)  # blocks at 0, 7, ..., 35: uneven last block
        assert_close_scaled(model(ids, pos), reference, rtol=1e-12, name="chunked logits")
        changed = ids.clone()
        changed[:, 25:] = (changed[:, 25:] + 1) % 11
        assert_close_scaled(model(changed, pos)[:, :25], reference[:, :25], rtol=1e-12, name="past logits")
        assert (model(changed, pos)[:, 25:] - reference[:, 25:]).abs().max() > 1e-3


def pruned_logits_by_hand(budget):
    """The listing's logits, then each query in order: its own key joins the kept set; while more than `budget`
    keys are kept, the one with the largest F (not key 0, not the query's own; ties: the smallest index) leaves
    for good. One Python set per sequence."""
    def logits_of(q, k):
        logits, f = listing(q, k)  # [B, H, L, L], [B, L, L]
        hidden = torch.zeros(logits.shape[0], *logits.shape[2:], dtype=torch.bool)
        for seq in range(logits.shape[0]):
            kept = set()
            for i in range(logits.shape[-1]):
                kept.add(i)
                while len(kept) > budget:
                    victim = max(sorted(kept - {0, i}), key=lambda j: (f[seq, i, j].item(), -j))
                    kept.remove(victim)
                hidden[seq, i] = torch.tensor([j not in kept for j in range(logits.shape[-1])])
        return logits.masked_fill(hidden[:, None], float("-inf"))
    return logits_of


@pytest.mark.parametrize("chunk", [None, 6])
def test_context_pruning_follows_the_eviction_rule(chunk):
    enc = make_encoding("selective", d_model=D_MODEL, n_heads=HEADS, prune_budget=5).double()
    attn = layer(enc, seed=6).eval()
    enc.eval()  # the model holds the encoding; a bare layer does not
    attn.eval_chunk = chunk
    x = torch.randn(2, 24, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = attn(x, PositionContext(enc, torch.arange(24)[None]))
        expected = attention_by_hand(x, attn, logits_of=pruned_logits_by_hand(5))
        assert_close_scaled(got, expected, rtol=1e-12, name="pruned outputs")
        assert (got - attention_by_hand(x, attn)).abs().max() > 1e-3  # pruning hid something
        enc.train()  # training never prunes
        assert_close_scaled(attn(x, PositionContext(enc, torch.arange(24)[None])), attention_by_hand(x, attn),
                            rtol=1e-12, name="training outputs")


@pytest.mark.parametrize("budget", [1, 2.5, True, "4"])
def test_a_bad_budget_is_refused(budget):
    with pytest.raises(ValueError, match=r"encoding.prune_budget=.*at least 2"):
        make_encoding("selective", prune_budget=budget)


def test_a_memory_of_keys_is_refused():
    enc = make_encoding("selective", d_model=D_MODEL, n_heads=HEADS).double()
    attn = layer(enc)
    x = torch.randn(1, 5, D_MODEL, dtype=torch.float64)
    memory = torch.randn(1, 8, D_MODEL, dtype=torch.float64)
    key_pos = torch.arange(8)[None]
    with pytest.raises(ValueError, match="8 keys for 5 queries"):
        attn(x, PositionContext(enc, key_pos[:, 3:], key_pos), memory)


def test_segment_recurrence_is_refused_before_running():
    model = model_of(make_encoding("selective", d_model=D_MODEL, n_heads=HEADS).double())
    with pytest.raises(ValueError, match=r"'selective' reads every token of the layer's forward \(hooks \['layer_pass'\]\)"):
        model.forward_recurrent(torch.zeros(1, 4, dtype=torch.long), None, 4)
