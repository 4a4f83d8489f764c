"""The paths that make length cheap give the reference's numbers, for every encoding in the
registry: the fused causal+bias CPU kernel and its blockwise bias gradient, query blocks in
eager training, chunked evaluation (bias gathered from per-offset rows, or built per chunk),
chunked segment recurrence, and one bias per forward when the layers share it.

The reference is the eager backend attending every query at once (the logits materialised)."""
import pytest
import torch

from posbench.attention import PositionContext, eager, fused_cpu, get_backend, layer
from posbench.encodings import REGISTRY
from posbench.model import ModelConfig, Transformer
from tests.helpers import assert_close_scaled, make_encoding, positions_for, trained_looking_model, with_layouts

ALL = sorted(REGISTRY)
BIAS = sorted(name for name, cls in REGISTRY.items() if "bias" in cls.hooks)
SEQUENCE_BIAS = [name for name in BIAS if REGISTRY[name].position_dims == 1]
LENGTH = 24  # 2-D encodings: a 4 x 6 grid


def backends_for(name: str) -> list[str]:
    needed = set(REGISTRY[name].hooks) - {"embed"}
    return ["eager"] + (["sdpa"] if needed <= get_backend("sdpa").supported_hooks else [])


def ids_for(batch: int = 2, length: int = LENGTH) -> torch.Tensor:
    return torch.randint(0, 11, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def one_pass(monkeypatch):
    """Training attends every query at once (the reference)."""
    monkeypatch.setattr(eager, "EAGER_TRAIN_BLOCK", 10**9)


@pytest.mark.parametrize("name,causal", with_layouts(ALL))
def test_chunked_evaluation_equals_one_pass(name, causal):
    pos = positions_for(name, LENGTH)
    reference = trained_looking_model(name, "eager", causal).eval()(ids_for(), pos)
    for backend in backends_for(name):
        model = trained_looking_model(name, backend, causal).eval()
        for chunk in (1, 5, LENGTH - 1):
            model.set_eval_chunk(chunk)
            assert_close_scaled(model(ids_for(), pos), reference, rtol=1e-10, name=f"{backend}, chunk {chunk}")


@pytest.mark.parametrize("name", SEQUENCE_BIAS + ["shaw", "transformer_xl"])
def test_chunked_evaluation_with_scattered_and_per_sequence_positions(name):
    """Positions that are not contiguous (randomized) or differ per sequence build the bias per chunk."""
    scattered = torch.tensor([0, 2, 3, 7, 8, 9, 13, 20, 21, 22, 30, 31, 32, 40, 41, 45, 50])[None]  # [1, 17]
    per_sequence = torch.stack((torch.arange(17), torch.arange(17) + 5))  # [2, 17]
    for pos in (scattered, per_sequence):
        reference = trained_looking_model(name, "eager").eval()(ids_for(length=17), pos)
        for backend in backends_for(name):
            model = trained_looking_model(name, backend).eval()
            model.set_eval_chunk(4)
            assert_close_scaled(model(ids_for(length=17), pos), reference, rtol=1e-10)


@pytest.mark.parametrize("name,causal", with_layouts(ALL))
def test_chunked_evaluation_with_a_sliding_window_equals_one_pass(name, causal):
    """A window of 5 in the first layer, the second global: causal chunks read the keys from their first
    query's window on, so every hook meets rows that start inside the key axis."""
    pos = positions_for(name, LENGTH)
    for backend in backends_for(name):
        model = trained_looking_model(name, backend, causal, window=[5, None]).eval()
        reference = model(ids_for(), pos)
        model.set_eval_chunk(7)
        assert_close_scaled(model(ids_for(), pos), reference, rtol=1e-10, name=backend)


def test_auto_chunk_splits_long_evaluations(monkeypatch):
    monkeypatch.setattr(layer, "AUTO_CHUNK_ELEMENTS", 2 * 4 * LENGTH * 6)  # B x H x Lk x 6 queries (eager)
    monkeypatch.setattr(layer, "MIN_AUTO_CHUNK", 1)
    calls = []
    model = trained_looking_model("shaw", "eager").eval()
    original = model.blocks[0].attn.attend_block
    monkeypatch.setattr(model.blocks[0].attn, "attend_block",
                        lambda *args: calls.append(args[-1][1] - args[-1][0]) or original(*args))  # stop - start
    reference = model(ids_for(), torch.arange(LENGTH)[None])
    model.set_eval_chunk("auto")
    assert_close_scaled(model(ids_for(), torch.arange(LENGTH)[None]), reference, rtol=1e-10)
    assert calls == [6, 6, 6, 6]


@pytest.mark.parametrize("name", ALL)
def test_training_paths_give_the_reference_gradients(name, monkeypatch):
    """Query blocks (eager) and the fused kernel with its blockwise bias gradient (sdpa) in
    training: same logits and same gradient for every parameter as one eager pass."""
    ids, pos = ids_for(), positions_for(name, LENGTH)

    def outputs_and_grads(model):
        model.train()
        logits = model(ids, pos)
        (logits.sin().sum()).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    monkeypatch.setattr(eager, "EAGER_TRAIN_BLOCK", 10**9)
    expected, expected_grads = outputs_and_grads(trained_looking_model(name, "eager"))
    assert expected_grads
    monkeypatch.setattr(eager, "EAGER_TRAIN_BLOCK", 5)
    monkeypatch.setattr(fused_cpu, "GRAD_BLOCK", 4)
    for backend in backends_for(name):
        logits, grads = outputs_and_grads(trained_looking_model(name, backend))
        assert_close_scaled(logits, expected, rtol=1e-10, name=backend)
        assert grads.keys() == expected_grads.keys()
        for key, grad in grads.items():
            assert_close_scaled(grad, expected_grads[key], rtol=1e-8, atol_scale=1e-10, name=f"{backend} {key}")


@pytest.mark.parametrize("name", ["t5", "alibi", "fire"])
def test_bidirectional_fused_kernel_gives_the_reference_gradients(name):
    ids, pos = ids_for(), torch.arange(LENGTH)[None]
    results = []
    for backend in ("eager", "sdpa"):
        model = trained_looking_model(name, backend, causal=False).train()
        model(ids, pos).sin().sum().backward()
        results.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    for key, grad in results[1].items():
        assert_close_scaled(grad, results[0][key], rtol=1e-8, atol_scale=1e-10, name=key)  # gradients up to ~400


def test_sdpa_with_a_bias_runs_the_fused_kernel_on_cpu(monkeypatch):
    """Guard for the tests above: on CPU the sdpa backend's bias path is the fused kernel."""
    calls = []
    original = fused_cpu.FusedBiasAttention.apply
    monkeypatch.setattr(fused_cpu.FusedBiasAttention, "apply", lambda *a: calls.append(1) or original(*a))
    model = trained_looking_model("t5", "sdpa").train()
    model(ids_for(), torch.arange(LENGTH)[None]).sum().backward()
    assert len(calls) == 2  # one per layer
    assert model.encoding.table.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["t5", "kerple", "sandwich", "fire", "composite", "urpe"])  # causal alibi: a decay
def test_bias_built_once_per_forward_when_the_layers_share_it(name, monkeypatch):
    model = trained_looking_model(name, "eager").eval()
    calls = []
    original = type(model.encoding).bias
    monkeypatch.setattr(type(model.encoding), "bias", lambda self, *a: calls.append(a[-1]) or original(self, *a))
    model(ids_for(), torch.arange(LENGTH)[None])
    assert len(calls) == (1 if model.encoding.bias_layers_shared else len(model.blocks))
    assert model.encoding.bias_layers_shared == (name != "fire")


@pytest.mark.parametrize("name", [n for n in SEQUENCE_BIAS if REGISTRY[n].relative])
def test_offset_rows_give_the_bias_of_every_block(name):
    enc = make_encoding(name, d_model=32, n_heads=4, max_positions=64).double()
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.3)
    pos = torch.arange(7, 7 + LENGTH)[None]
    context = PositionContext(enc, pos)
    assert context.offset_rows(0) is not None
    full = enc.bias(pos, pos, 0)  # [1, H, L, L]
    for start, stop, end in ((0, 5, 5), (5, 11, 11), (20, 23, 23), (3, 9, LENGTH)):
        assert_close_scaled(context.block_bias(0, start, stop, end), full[:, :, start:stop, :end], rtol=1e-12)


@pytest.mark.parametrize("name", ["alibi", "t5", "shaw", "transformer_xl", "nope"])
def test_chunked_segment_recurrence_equals_reading_both_segments_at_once(name):
    ids = ids_for(length=18)
    for backend in backends_for(name):
        model = trained_looking_model(name, backend).eval()
        full = model(ids, torch.arange(18)[None])  # [B, 2L, V]
        model.set_eval_chunk(4)
        first, memory = model.forward_recurrent(ids[:, :9], None, memory_length=9)
        second, _ = model.forward_recurrent(ids[:, 9:], memory, memory_length=9)
        assert_close_scaled(torch.cat([first, second], 1), full, rtol=1e-10, name=backend)


def test_auto_backend_follows_the_device():
    """auto: sdpa on CPU (fused kernel, flex cannot train there); flex on CUDA for a bias with a
    score_mod flex can differentiate, where heads have 16 features or more; eager for content terms; sdpa
    for a bias flex cannot express or train, and for heads of fewer features (flex's CUDA kernels refuse them)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for name, on_cpu, on_cuda in (("alibi", "sdpa", "flex"), ("kerple", "sdpa", "sdpa"), ("rope", "sdpa", "sdpa"),
                                  ("t5", "sdpa", "sdpa"),  # flex cannot train it
                                  ("fox", "sdpa", "flex"),
                                  ("shaw", "eager", "eager"), ("alibi_2d", "sdpa", "sdpa")):
        enc = make_encoding(name, d_model=32)  # heads of 16 features
        assert (get_backend("auto", enc, cpu).name, get_backend("auto", enc, cuda).name) == (on_cpu, on_cuda), name
    kerple = make_encoding("kerple", d_model=32)  # flex trains it slowly (Encoding.flex_trains_slowly): sdpa to train
    assert (get_backend("auto", kerple, cuda).name, get_backend("auto", kerple, cuda, training=False).name) == ("sdpa",
                                                                                                              "flex")
    composite = make_encoding("composite", parts=["rope", "kerple"], d_model=32)
    assert get_backend("auto", composite, cuda).name == "sdpa" and "r1 and r2" in composite.flex_trains_slowly
    assert get_backend("auto", make_encoding("alibi", d_model=16), cuda).name == "sdpa"  # heads of 8
    assert get_backend("auto", make_encoding("alibi", d_model=32), cuda, dynamic_compile=True).name == "sdpa"  # in compile


def test_fire_piecewise_linear_mlp_is_the_mlp():
    """FIRE's MLP of a scalar evaluated by segments: same values and gradients as the nn layers,
    including a hidden unit with no breakpoint (weight 0) and one turned off everywhere."""
    from torch import nn

    from posbench.encodings.fire import piecewise_linear_mlp

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(1, 6), nn.ReLU(), nn.Linear(6, 3)).double()
    with torch.no_grad():
        mlp[0].weight[0, 0], mlp[0].weight[1, 0], mlp[0].bias[1] = 0.0, 0.0, -1.0
    x = (torch.rand(2, 9, 9, dtype=torch.float64) * 4 - 1).requires_grad_()
    expected, got = mlp(x[..., None]).movedim(-1, 0), piecewise_linear_mlp(mlp, x)  # heads first
    assert_close_scaled(got, expected, rtol=1e-12)
    grad = torch.randn_like(expected)
    inputs = [x, *mlp.parameters()]
    for a, b in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(expected, inputs, grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("setting", [0, -3, "big", 2.5, True])
def test_bad_eval_chunk_is_refused(setting):
    from posbench.validate import eval_chunk

    with pytest.raises(ValueError, match=r"eval.chunk=.*use auto, a number of queries >= 1, or null"):
        eval_chunk(setting)
    assert [eval_chunk(s) for s in ("auto", None, 64)] == ["auto", None, 64]


@pytest.mark.parametrize("name", ["t5", "alibi"])
def test_bf16_autocast_through_the_fused_kernel_stays_close_to_fp32(name):
    """train.precision=bf16 on CPU: the fused kernel takes bf16 q, k, v with a float32 bias mask."""
    ids, pos = ids_for(), torch.arange(LENGTH)[None]
    results = []
    for precision in (None, torch.bfloat16):
        model = trained_looking_model(name, "sdpa").float().train()
        with torch.autocast("cpu", dtype=precision or torch.float32, enabled=precision is not None):
            logits = model(ids, pos)
        logits.float().sin().sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((logits.float(), grads))
    assert torch.isfinite(results[1][1]).all()
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0.05, atol=0.05)
    cosine = torch.nn.functional.cosine_similarity(results[1][1], results[0][1], dim=0)
    assert cosine > 0.99


def test_a_relative_bias_beside_a_rotation_and_a_content_term_keeps_its_offset_rows():
    """rope + shaw + t5 is not shift-invariant (shaw reads rotated q), but its bias is t5's:
    chunked evaluation takes it from per-offset rows and still equals one pass."""
    torch.manual_seed(0)
    enc = make_encoding("composite", d_model=32, n_heads=4, max_positions=64, parts=["rope", "shaw", "t5"])
    assert not enc.relative and enc.bias_relative
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model = Transformer(ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=4), enc,
                        get_backend("eager", enc)).double().eval()
    pos = torch.arange(LENGTH)[None]
    reference = model(ids_for(), pos)
    assert PositionContext(enc, pos, pos).offset_rows(0) is not None
    model.set_eval_chunk(5)
    assert_close_scaled(model(ids_for(), pos), reference, rtol=1e-10)
