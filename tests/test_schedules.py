"""Layer schedules: sliding-window attention (model.window) against the banded softmax written out,
on every backend and in chunked evaluation that reads only the window's keys; per-layer encodings
(encoding=schedule) against the standalone encodings layer by layer; the presets of Llama 4, Cohere
and Gemma 3 as their papers and code define them; bad settings refused by name."""
import math

import pytest
import torch

from posbench.attention import Attention, AttentionCall, PositionContext, get_backend, sdpa
from posbench.build import build
from posbench.encodings.base import Encoding
from posbench.encodings.schedule import Schedule
from posbench.hooks import HOOKS
from posbench.model import ModelConfig, Transformer
from tests.helpers import assert_close_scaled, compose_cfg, make_encoding

D_MODEL, HEADS, HEAD = 16, 2, 8


def banded_attention(x, attn, window, causal=True, bias=None):
    """softmax over keys with 0 <= i - j < window (|i - j| < window when not causal), written out (float64)."""
    b, length, _ = x.shape
    q, k, v = (t.view(b, length, HEADS, HEAD).transpose(1, 2) for t in (x @ attn.qkv.weight.T).split(D_MODEL, -1))
    logits = q @ k.transpose(-1, -2) / math.sqrt(HEAD)  # [B, H, L, L]
    if bias is not None:
        logits = logits + bias
    out = torch.zeros_like(q)
    for i in range(length):
        keys = [j for j in range(length) if abs(i - j) < window and (j <= i or not causal)]
        out[:, :, i] = torch.einsum("bhk,bhkd->bhd", logits[:, :, i, keys].softmax(-1), v[:, :, keys])
    return out.transpose(1, 2).reshape(b, length, D_MODEL) @ attn.out.weight.T


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_a_sliding_window_is_the_banded_softmax(backend, causal):
    torch.manual_seed(0)
    enc = make_encoding("nope", d_model=D_MODEL, n_heads=HEADS, causal=causal)
    attn = Attention(D_MODEL, HEADS, 0, enc, get_backend(backend, enc), causal, window=4).double().eval()
    x = torch.randn(2, 13, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        got = attn(x, PositionContext(enc, torch.arange(13)[None]))
    assert_close_scaled(got, banded_attention(x, attn, 4, causal), rtol=0, atol_scale=1e-12, name="windowed output")


def test_a_window_beside_a_learned_bias_keeps_the_bias_and_its_gradient():
    torch.manual_seed(1)
    enc = make_encoding("t5", d_model=D_MODEL, n_heads=HEADS).double()
    torch.nn.init.normal_(enc.table.weight)
    x = torch.randn(2, 11, D_MODEL, dtype=torch.float64)
    pos = torch.arange(11)[None]
    grads = []
    for backend in ("eager", "sdpa"):
        attn = Attention(D_MODEL, HEADS, 0, enc, get_backend(backend, enc), True, window=3).double()
        torch.manual_seed(2)
        for p in attn.parameters():
            torch.nn.init.normal_(p, std=0.3)
        enc.zero_grad()
        out = attn(x, PositionContext(enc, pos))
        assert_close_scaled(out, banded_attention(x, attn, 3, bias=enc.bias(pos, pos, 0)), rtol=0, atol_scale=1e-12,
                            name=backend)
        out.sin().sum().backward()
        grads.append(enc.table.weight.grad.clone())
    assert grads[0].abs().sum() > 0
    assert_close_scaled(grads[1], grads[0], rtol=1e-9, atol_scale=1e-12, name="table gradient")


def test_a_window_trained_in_query_blocks_gives_the_banded_softmaxs_gradients(monkeypatch):
    """Eager training attends in query blocks, each to the keys from its first query's window on
    (layer.BlockViews): every block's gradients of q, k and v land on their rows."""
    from posbench.attention import eager
    monkeypatch.setattr(eager, "EAGER_TRAIN_BLOCK", 3)  # 13 queries: blocks of 3 and one of 1
    torch.manual_seed(3)
    enc = make_encoding("nope", d_model=D_MODEL, n_heads=HEADS)
    attn = Attention(D_MODEL, HEADS, 0, enc, get_backend("eager", enc), True, window=4).double().train()
    grads = []
    for forward in (lambda x: attn(x, PositionContext(enc, torch.arange(13)[None])),
                    lambda x: banded_attention(x, attn, 4)):
        x = torch.randn(2, 13, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(4),
                        requires_grad=True)
        attn.zero_grad()
        forward(x).sin().sum().backward()
        grads.append((x.grad, attn.qkv.weight.grad.clone(), attn.out.weight.grad.clone()))
    for name, got, want in zip(("x", "qkv", "out"), *grads):
        assert_close_scaled(got, want, rtol=1e-10, atol_scale=1e-12, name=name)  # gradients up to ~15


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_chunked_evaluation_of_a_window_reads_only_the_windows_keys(backend, monkeypatch):
    cfg = ModelConfig(vocab_size=11, d_model=D_MODEL, n_layers=2, n_heads=HEADS, window=[5, None])
    torch.manual_seed(3)
    enc = make_encoding("alibi", d_model=D_MODEL, n_heads=HEADS)
    model = Transformer(cfg, enc, get_backend(backend, enc)).double().eval()
    ids = torch.randint(0, 11, (2, 40), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(40)[None]
    reference = model(ids, pos)
    keys_read = []
    original = type(model.blocks[0].attn.backend).attend
    monkeypatch.setattr(type(model.blocks[0].attn.backend), "attend",
                        lambda self, q, k, v, call: keys_read.append((call.window, k.shape[-2]))
                        or original(self, q, k, v, call))
    model.set_eval_chunk(8)
    assert_close_scaled(model(ids, pos), reference, rtol=0, atol_scale=1e-10, name="chunked logits")
    windowed = [keys for window, keys in keys_read if window == 5]
    assert len(windowed) == 5 and max(windowed) == 8 + 5 - 1  # a chunk of 8 queries and the 4 keys before it
    assert model.blocks[1].attn.window is None


def test_keys_seen_stop_at_the_window():
    enc = make_encoding("ssmax", d_model=D_MODEL, n_heads=HEADS)
    pos = torch.arange(10)[None]
    assert AttentionCall(enc, pos, pos, 0, True, window=4).keys_seen().tolist() == [1, 2, 3, 4, 4, 4, 4, 4, 4, 4]
    assert AttentionCall(enc, pos, pos, 0, True).keys_seen().tolist() == list(range(1, 11))


def test_window_settings_are_checked_and_repeat_over_the_layers():
    assert [ModelConfig(vocab_size=5, n_layers=6, window=[3, 3, None]).layer_window(i) for i in range(6)] == \
        [3, 3, None, 3, 3, None]
    for bad in (0, -2, "wide", [], [3, 0], True):
        with pytest.raises(ValueError, match=r"model\.window="):
            ModelConfig(vocab_size=5, window=bad)
    with pytest.raises(ValueError, match="backend=flex does not run a sliding window"):
        enc = make_encoding("nope", d_model=D_MODEL, n_heads=HEADS)
        Transformer(ModelConfig(vocab_size=5, d_model=D_MODEL, n_heads=HEADS, window=4), enc, get_backend("flex"))


def test_schedule_layers_equal_their_standalone_encodings():
    """Layer l of a schedule attends as the standalone encoding of its entry would, with the same weights."""
    torch.manual_seed(5)
    sched = make_encoding("schedule", d_model=D_MODEL, n_heads=HEADS, pattern=["rope", "alibi"]).double()
    assert sched.layers == ["rope", "alibi"] and sched.hooks == {"qk", "decay"}
    x = torch.randn(2, 9, D_MODEL, dtype=torch.float64)
    pos = torch.arange(9)[None]
    for layer, name in enumerate(["rope", "alibi"]):
        alone = make_encoding(name, d_model=D_MODEL, n_heads=HEADS).double()
        for backend in ("eager", "sdpa"):
            attn = Attention(D_MODEL, HEADS, layer, sched, get_backend(backend, sched), True).double()
            single = Attention(D_MODEL, HEADS, layer, alone, get_backend(backend, alone), True).double()
            single.load_state_dict(attn.state_dict())
            with torch.no_grad():
                assert_close_scaled(attn(x, PositionContext(sched, pos)), single(x, PositionContext(alone, pos)),
                                    rtol=0, atol_scale=1e-12, name=f"{name} {backend}")


def test_schedule_routes_every_hook_to_its_layers_encoding():
    """A layer's kv and output hooks (FoX Pro's shifts, norm and gate) reach it through the schedule, and
    every hook of the table has its route (a hook the schedule left to the base class would do nothing)."""
    assert [hook for hook, spec in HOOKS.items()
            if not spec.model_level and getattr(Schedule, hook) is getattr(Encoding, hook)] == []
    kinds = {"pro": {"encoding": "fox", "k_shift": True, "v_shift": True, "output_norm": True, "output_gate": True}}
    torch.manual_seed(6)
    sched = make_encoding("schedule", d_model=D_MODEL, n_heads=HEADS, pattern=["nope", "pro"], kinds=kinds).double()
    assert sched.hooks == {"decay", "kv", "output"}
    for p in sched.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 9, D_MODEL, dtype=torch.float64)
    pos = torch.arange(9)[None]
    alone = sched.at(1)
    attn = Attention(D_MODEL, HEADS, 1, sched, get_backend("eager", sched), True).double()
    single = Attention(D_MODEL, HEADS, 1, alone, get_backend("eager", alone), True).double()
    single.load_state_dict(attn.state_dict())
    with torch.no_grad():
        assert_close_scaled(attn(x, PositionContext(sched, pos)), single(x, PositionContext(alone, pos)),
                            rtol=0, atol_scale=1e-12, name="layer 1")


def test_schedule_kinds_give_layers_their_own_parameters():
    sched = make_encoding("schedule", d_model=D_MODEL, n_heads=HEADS, pattern=["local", "global"],
                          kinds={"local": {"encoding": "rope", "base": 10000}, "global": {"encoding": "rope",
                                                                                       "base": 1e6}})
    assert [sched.at(layer).base for layer in range(2)] == [10000, 1e6]
    assert sched.params()["layers"] == ["local", "global"]
    for bad, message in (({"pattern": "rope"}, "must be a non-empty list"),
                         ({"pattern": ["rope", "ropes"]}, "'ropes' is neither a registered encoding"),
                         ({"pattern": ["learned"]}, r"act on the model input \(hooks \['embed', 'state_init'\]\)"),
                         ({"pattern": ["x"], "kinds": {"x": {"encoding": "nothing"}}}, "kind 'x' needs `encoding:`"),
                         ({"pattern": ["rope"], "kinds": {"rope": {"encoding": "alibi"}}}, "shadows the registered"),
                         ({"pattern": ["r"], "kinds": {"r": {"encoding": "rope", "bass": 1}}}, "has no parameter")):
        with pytest.raises(ValueError, match=message):
            make_encoding("schedule", d_model=D_MODEL, n_heads=HEADS, **bad)


def test_irope_preset_is_llama4s_layout_and_temperature():
    built = build(compose_cfg("experiment=irope"), torch.device("cpu"))
    enc = built.encoding
    assert enc.layers == ["rope", "rope", "rope", "global"] and len(built.model.blocks) == 4
    assert enc.at(3).name == "temperature" and all(block.attn.window is None for block in built.model.blocks)
    pos = torch.arange(200)[None]
    x = torch.zeros(1, 200, built.model.cfg.d_model)
    factor = enc.query_scale(AttentionCall(enc, pos, pos, 3, True, x=x))[0, 0, :, 0]
    # Llama 4 (HF Llama4TextAttention): log(floor((cache_position + 1) / floor_scale) + 1) * attn_scale + 1
    llama = [math.log(math.floor((i + 1) / 32) + 1) * 0.1 + 1 for i in range(200)]
    torch.testing.assert_close(factor.double(), torch.tensor(llama, dtype=torch.float64), rtol=1e-6, atol=0)
    assert enc.query_scale(AttentionCall(enc, pos, pos, 0, True, x=x)) is None  # a RoPE layer: unscaled


@pytest.mark.parametrize("preset,layers,windows,bases", [
    ("rnope_swa", ["rope", "rope", "rope", "nope"], [16, 16, 16, None], None),
    ("gemma3", ["local"] * 5 + ["global"], [16] * 5 + [None], [10000.0] * 5 + [1e6]),
])
def test_sliding_window_presets_build_their_layouts(preset, layers, windows, bases):
    built = build(compose_cfg(f"experiment={preset}"), torch.device("cpu"))
    assert built.encoding.layers == layers
    assert [block.attn.window for block in built.model.blocks] == windows
    if bases:
        assert [built.encoding.at(layer).base for layer in range(len(layers))] == bases
    assert built.backend == "sdpa"


def test_sdpa_window_mask_is_four_dimensional(monkeypatch):
    """The band goes to SDPA as a [1, 1, Lq, Lk] mask (a 3-D one would leave the fused kernels)."""
    enc = make_encoding("nope", d_model=D_MODEL, n_heads=HEADS)
    seen = []
    original = sdpa.SdpaBackend.attend_columns

    def spy(q, k, v, bias, causal, scale):
        seen.append((bias.dim(), causal))
        return original(q, k, v, bias, causal, scale)

    monkeypatch.setattr(sdpa.SdpaBackend, "attend_columns", staticmethod(spy))
    attn = Attention(D_MODEL, HEADS, 0, enc, get_backend("sdpa"), True, window=3)
    attn(torch.randn(1, 6, D_MODEL), PositionContext(enc, torch.arange(6)[None]))
    assert seen == [(4, False)]


@pytest.mark.parametrize("causal", [True, False])
def test_keys_seen_counts_the_visible_keys_of_every_block(causal):
    """keys_seen() equals the count of the call's visible keys, for whole calls and for the blocks a
    chunked evaluation makes (keys from the window's start on)."""
    enc = make_encoding("nope", d_model=D_MODEL, n_heads=HEADS, causal=causal)
    pos = torch.arange(20)[None]
    for window in (None, 4):
        call = AttentionCall(enc, pos, pos, 0, causal, window)
        torch.testing.assert_close(call.keys_seen(), call.visible().sum(-1) if call.visible() is not None
                                   else torch.full((20,), 20))
        for start, stop in ((0, 7), (7, 14), (14, 20)):
            end = stop if causal else 20
            first = max(0, start - window + 1) if causal and window else 0
            block = call.block(start, stop, first, end, None, False)
            assert block.keys_seen().tolist() == call.keys_seen()[start:stop].tolist()


def test_a_hook_without_forwarding_fails_the_schedule_naming_it(monkeypatch):
    """A hook the table gains after Schedule's forwarders were made would reach no layer: refused by name."""
    from posbench.hooks import Hook
    monkeypatch.setitem(HOOKS, "fake", Hook("fake", "a test hook", frozenset({"eager"}), False, "sum"))
    with pytest.raises(TypeError, match=r"no forwarding of hook\(s\) \['fake'\]"):
        make_encoding("schedule", d_model=D_MODEL, n_heads=HEADS)
