"""STRING (encoding=string): against an eager transcription of the method (one logit matrix per branch from
q and k turned pair by pair at absolute positions, the masks t < S or t <= S and t >= S, one softmax over
both sets of keys), the official prefill boundary (boundary=twice) against the two attention calls merged
by their log-sum-exps as the official flash path does, rope times the factor below S, rope bit for bit in
training, chunked evaluation as one block, the default S and W, a rope model's weights loading, and the
refusals."""
from __future__ import annotations

import math

import pytest
import torch

from posbench.attention import get_backend
from posbench.attention.context import AttentionCall
from posbench.attention.eager import EagerBackend
from posbench.attention.layer import query_key_hooks
from posbench.encodings.base import ModelDims
from posbench.encodings.string_rope import STRING
from posbench.model import ModelConfig, Transformer
from tests.helpers import assert_chunks_equal_one_pass, assert_close_scaled, compose_cfg, make_encoding, token_ids

HEADS, HEAD_DIM, TRAIN = 2, 16, 64
FACTOR = 1 + 0.1 * math.log(2)  # the official attention_factor on cos and sin


def dims(train_positions: int = TRAIN, causal: bool = True) -> ModelDims:
    return ModelDims(d_model=HEADS * HEAD_DIM, n_heads=HEADS, n_layers=1, max_positions=8 * train_positions,
                     train_positions=train_positions, causal=causal)


def naive_rotate(x: torch.Tensor, pos: torch.Tensor, layout: str = "half", base: float = 10000.0) -> torch.Tensor:
    """Pair m (interleaved (2m, 2m+1) or half (m, m + d/2)) turned by pos * base^(-2m/d), one pair at a time.
    x: [B, H, L, d], pos: [B', L] -> [B, H, L, d]."""
    d = x.shape[-1]
    out = x.clone()
    for m in range(d // 2):
        a, b = (2 * m, 2 * m + 1) if layout == "interleaved" else (m, m + d // 2)
        angle = pos[:, None, :].double() * base ** (-2 * m / d)  # [B', 1, L]
        out[..., a] = x[..., a] * angle.cos() - x[..., b] * angle.sin()
        out[..., b] = x[..., a] * angle.sin() + x[..., b] * angle.cos()
    return out


def branch_logits(q, k, q_pos, k_pos, shift: float, factor: float, layout: str) -> torch.Tensor:
    """(f q_i at i + shift) . (f k_j at j) / sqrt(d): [B, H, Lq, Lk]."""
    q_at, k_at = naive_rotate(q, q_pos.double() + shift, layout), naive_rotate(k, k_pos.double(), layout)
    return factor ** 2 * q_at @ k_at.transpose(-1, -2) / math.sqrt(q.shape[-1])


def naive_string(q, k, v, q_pos, k_pos, shifted: int, local: int, boundary: str = "once", factor: float = FACTOR,
                 layout: str = "half") -> torch.Tensor:
    """One logit matrix per branch: plain rope where 0 <= t < S (t <= S with boundary twice), q at i - S + W
    where t >= S; both sets of keys side by side ([near | far], values [v | v]), one softmax."""
    t = (q_pos[:, :, None] - k_pos[:, None, :])[:, None]  # [B', 1, Lq, Lk]
    lq, lk = q.shape[-2], k.shape[-2]
    causal = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)  # [Lq, Lk]
    near_mask = causal & ((t < shifted) if boundary == "once" else (t <= shifted))
    near = branch_logits(q, k, q_pos, k_pos, 0.0, factor, layout).masked_fill(~near_mask, -math.inf)
    far = branch_logits(q, k, q_pos, k_pos, float(local - shifted), factor, layout).masked_fill(
        ~(causal & (t >= shifted)), -math.inf)
    return torch.cat([near, far], -1).softmax(-1) @ torch.cat([v, v], -2)


def lse_merged(q, k, v, pos, shifted: int, local: int) -> torch.Tensor:
    """The official flash path on positions 0..L-1: a causal window t in [0, S] with plain rope, the queries
    S.. (at i - S + W) against the keys 0..L-S-1 (t >= S), each normalised alone, merged by the weights
    1 / (1 + exp(lse_other - lse_own))."""
    def part(logits, mask):
        logits = logits.masked_fill(~mask, -math.inf)
        return logits.softmax(-1) @ v, logits.logsumexp(-1)[..., None]  # [B, H, L, d], [B, H, L, 1]

    t = (pos[:, :, None] - pos[:, None, :])[:, None]  # [1, 1, L, L]
    diag_out, diag_lse = part(branch_logits(q, k, pos, pos, 0.0, FACTOR, "half"), (t >= 0) & (t <= shifted))
    shift_out, shift_lse = part(branch_logits(q, k, pos, pos, float(local - shifted), FACTOR, "half"), t >= shifted)
    diag_weight, shift_weight = 1 / (1 + torch.exp(shift_lse - diag_lse)), 1 / (1 + torch.exp(diag_lse - shift_lse))
    merged = diag_out * diag_weight + shift_out * shift_weight  # [B, H, L, d]
    return torch.cat([diag_out[..., :shifted, :], merged[..., shifted:, :]], -2)


def evaluated(enc: STRING, length: int) -> STRING:
    enc.eval()
    enc.set_eval_length(enc.dims.train_positions, length)
    return enc


def qkv(lq: int, lk: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, HEADS, lq, HEAD_DIM, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, HEADS, lk, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v


def attend(enc, q, k, v, q_pos, k_pos):
    call = AttentionCall(enc, q_pos, k_pos, 0, True)
    rq, rk = query_key_hooks(q, k, call)
    return EagerBackend().attend(rq, rk, v, call)


@pytest.mark.parametrize("boundary", ["once", "twice"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("shifted,local", [(10, 4), (5, 0), (13, 12), (1, 0)])
def test_attention_matches_the_transcription(shifted, local, layout, boundary):
    """Positions from 0, shifted and per sequence (STRING reads distances only)."""
    enc = evaluated(STRING(dims(), layout=layout, shifted_offset=shifted, local_value=local, boundary=boundary)
                    .double(), 40)
    q, k, v = qkv(40, 40)
    for pos in (torch.arange(40)[None], torch.stack([torch.arange(40) + 7, torch.arange(40) * 2 + 100])):
        expected = naive_string(q, k, v, pos, pos, shifted, local, boundary, layout=layout)
        assert_close_scaled(attend(enc, q, k, v, pos, pos), expected, rtol=1e-12)


def test_queries_after_a_memory_and_defaults_match_the_transcription():
    """A block of queries against more keys; S and W null at L = 100 > N = 64: W = 4, S = max(33, 40) = 40."""
    enc = evaluated(STRING(dims()).double(), 100)
    assert (enc.offset(), enc.local_value) == (40, 4)
    q, k, v = qkv(12, 100, seed=1)
    k_pos = torch.arange(100)[None]
    expected = naive_string(q, k, v, k_pos[:, 88:], k_pos, 40, 4)
    assert_close_scaled(attend(enc, q, k, v, k_pos[:, 88:], k_pos), expected, rtol=1e-12)


def test_the_official_prefill_boundary_counts_the_key_at_s_twice():
    """boundary=twice equals the official two calls merged by log-sum-exp (the key at t = S in both); once
    differs from it exactly in the queries that have a key at distance S (i >= S), and equals it before."""
    shifted, local = 9, 3
    q, k, v = qkv(30, 30, seed=2)
    pos = torch.arange(30)[None]
    official = lse_merged(q, k, v, pos, shifted, local)
    outputs = {}
    for boundary in ("once", "twice"):
        enc = evaluated(STRING(dims(), shifted_offset=shifted, local_value=local, boundary=boundary).double(), 30)
        outputs[boundary] = attend(enc, q, k, v, pos, pos)
    assert_close_scaled(outputs["twice"], official, rtol=1e-12, name="twice")
    assert torch.equal(outputs["once"][..., :shifted, :], outputs["twice"][..., :shifted, :])
    assert ((outputs["once"] - official)[..., shifted:, :].abs().amax(-1) > 1e-6).all()


def test_far_keys_see_shifted_distances_and_near_keys_rope_times_the_factor():
    """Query 40, S = 12, W = 5: keys at distance 11 (plain), 12 (read at 5) and 30 (read at 23), each logit f^2
    times the rope logit at that distance."""
    enc = evaluated(STRING(dims(), shifted_offset=12, local_value=5).double(), 41)
    q, k, _ = qkv(1, 3, seed=3)
    q_pos, k_pos = torch.tensor([[40]]), torch.tensor([[29, 28, 10]])
    call = AttentionCall(enc, q_pos, k_pos, 0, True)
    rq, rk = query_key_hooks(q, k, call)
    logits = enc.logit_transform(rq @ rk.transpose(-1, -2) / 4, rq, rk, call)
    for column, distance in enumerate((11, 5, 23)):
        expected = FACTOR ** 2 * naive_rotate(q, torch.tensor([[distance]])) @ k[:, :, column:column + 1].transpose(
            -1, -2) / 4
        assert_close_scaled(logits[..., column:column + 1], expected, rtol=1e-13, name=f"distance {distance}")


def model_pair(**params) -> tuple[Transformer, Transformer]:
    """A rope model and a string model with the same weights (float64, eager), the string model loaded from
    the rope model's state dict as a checkpoint would be."""
    models = []
    for name in ("rope", "string"):
        torch.manual_seed(0)
        enc = make_encoding(name, d_model=32, n_heads=2, max_positions=TRAIN, **(params if name == "string" else {}))
        cfg = ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=2)
        models.append(Transformer(cfg, enc, get_backend("eager")).double())
    torch.manual_seed(9)
    rope, string = models
    for p in rope.parameters():
        p.data.normal_(0, 0.5)
    string.load_state_dict(rope.state_dict())  # strict: a rope checkpoint holds every tensor STRING needs
    return rope, string


def test_training_is_rope_bit_for_bit_and_a_rope_checkpoint_loads():
    rope, string = model_pair()
    ids = token_ids(100, seed=1)
    pos = torch.arange(100)[None]
    string.encoding.set_eval_length(TRAIN, 100)  # no effect in train mode
    assert torch.equal(string(ids, pos), rope(ids, pos))
    string.eval(), rope.eval()
    assert (string(ids, pos) - rope(ids, pos)).abs().max() > 1e-3
    string.train()
    assert torch.equal(string(ids, pos), rope(ids, pos))


def test_below_s_it_is_rope_times_the_factor():
    """Sequences no longer than S: every logit is f^2 times rope's (the factor 1: bit for bit rope)."""
    rope, string = model_pair(shifted_offset=TRAIN - 1)
    _, plain = model_pair(shifted_offset=TRAIN - 1, attention_factor=False)
    for net in (rope, string, plain):
        net.eval()
    ids, pos = token_ids(TRAIN - 1, seed=2), torch.arange(TRAIN - 1)[None] + 30
    assert torch.equal(plain(ids, pos), rope(ids, pos))
    q, k, v = qkv(TRAIN - 1, TRAIN - 1, seed=4)
    expected = naive_string(q, k, v, pos, pos, TRAIN - 1, 0)  # no key reaches t >= S: rope logits times f^2
    assert_close_scaled(attend(string.encoding, q, k, v, pos, pos), expected, rtol=1e-12)
    logits = branch_logits(q, k, pos, pos, 0.0, FACTOR, "half")
    causal = torch.ones(TRAIN - 1, TRAIN - 1, dtype=torch.bool).tril()
    rope_only = logits.masked_fill(~causal, -math.inf).softmax(-1) @ v
    assert_close_scaled(expected, rope_only, rtol=1e-12)


@pytest.mark.parametrize("params", [{}, {"shifted_offset": 20, "local_value": 3, "boundary": "twice"}])
def test_chunked_evaluation_equals_one_block(params):
    _, net = model_pair(**params)
    net.eval()
    net.encoding.set_eval_length(TRAIN, 110)
    ids = token_ids(110, seed=3)
    for pos in (torch.arange(110)[None], torch.stack([torch.arange(110), torch.arange(110) + 17])):
        assert_chunks_equal_one_pass(net, ids, pos, (1, 7, 109))


def test_shift_invariance_and_causality():
    _, net = model_pair()
    net.eval()
    net.encoding.set_eval_length(TRAIN, 90)
    ids = token_ids(90, seed=6)
    reference = net(ids, torch.arange(90)[None])
    assert_close_scaled(net(ids, torch.arange(90)[None] + 11), reference, rtol=1e-12, name="shifted by 11")
    changed = ids.clone()
    changed[:, 60:] = (changed[:, 60:] + 1) % 11
    later = net(changed, torch.arange(90)[None])
    assert torch.equal(later[:, :60], reference[:, :60])


@pytest.mark.parametrize("train,length,expected", [(64, 64, 21), (64, 32, 10), (64, 100, 40), (64, 128, 63),
                                                   (64, 300, 63), (256, 256, 84), (256, 400, 160), (32, 32, 10)])
def test_default_offset(train, length, expected):
    """S = min(max(floor(0.33 L), L - N + W), N - 1), W = N / 16: at L <= N the official floor(0.33 L)."""
    enc = STRING(dims(train))
    enc.set_eval_length(train, length)
    assert enc.offset() == expected and enc.local_value == max(1, train // 16)


def test_params_record_the_settings():
    enc = STRING(dims(), shifted_offset=30, local_value=8, attention_factor=False, boundary="twice")
    assert enc.params() == {"base": 10000.0, "layout": "half", "rotary_fraction": 1.0, "frequency_fraction": 1.0,
                            "frequency_cut": "none", "shifted_offset": 30, "local_value": 8,
                            "attention_factor": False, "boundary": "twice"}
    assert STRING(dims(train_positions=8)).local_value == 1
    assert STRING.relative and STRING.causal_only and STRING.hooks == {"qk", "logit_transform"}


@pytest.mark.parametrize("params,message", [
    ({"shifted_offset": 0}, r"string: encoding.shifted_offset=0: must be >= 1, or null"),
    ({"shifted_offset": 64}, r"string: encoding.shifted_offset=64: distances below it keep plain rope .*<= 63"),
    ({"local_value": 64}, r"string: encoding.local_value=64 is not a trained distance .*<= 63, or null \(4\)"),
    ({"local_value": -1}, r"string: encoding.local_value=-1: must be >= 0"),
    ({"shifted_offset": 8, "local_value": 8},
     r"string: encoding.local_value=8 must be below encoding.shifted_offset=8"),
    ({"attention_factor": 1.07}, r"string: encoding.attention_factor=1.07: must be true or false"),
    ({"boundary": "both"}, r"string: encoding.boundary='both' is not valid; choose one of \['once', 'twice'\]"),
])
def test_bad_settings_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        STRING(dims(), **params)


def test_a_bidirectional_model_is_refused_and_eager_runs_it():
    with pytest.raises(ValueError, match=r"string: .*set model.causal=true"):
        STRING(dims(causal=False))
    enc = STRING(dims())
    with pytest.raises(ValueError, match=r"backend=sdpa cannot run the \['logit_transform'\] hook"):
        get_backend("sdpa").check(enc)
    assert get_backend("auto", enc).name == "eager"


def test_builds_from_the_command_line():
    from posbench.build import build

    built = build(compose_cfg("encoding=string", "encoding.shifted_offset=5", "encoding.local_value=2",
                              "encoding.boundary=twice"), torch.device("cpu"))
    assert (built.encoding.offset(), built.encoding.local_value, built.encoding.boundary) == (5, 2, "twice")
    assert built.model.blocks[0].attn.backend.name == "eager"
