"""PoPE: its logits against the paper's formula written out with loops (float64), against lucidrains'
pope-pytorch and x-transformers' PolarEmbedding where installed, and the properties: shift invariance,
bidirectional attention, sdpa and flex equal to eager through the model (q and k 2d wide, v d wide: the
decay column, the fused CPU kernel's refusal, chunks and windows), the delta clamp, refusals."""
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

from posbench.attention import get_backend
from posbench.attention.flex import FlexBackend
from posbench.encodings.pope import clamp_learning_at_bounds
from posbench.model import ModelConfig, Transformer
from tests.helpers import ROOT, assert_close_scaled, make_encoding, token_ids

D_MODEL, HEADS = 16, 2
HEAD = D_MODEL // HEADS


def pope(causal=True, seed=0, **params):
    """A float64 pope whose deltas are drawn over [-3 pi, pi]: some beyond the clamp on both sides."""
    enc = make_encoding("pope", causal=causal, d_model=D_MODEL, n_heads=HEADS, **params).double()
    with torch.no_grad():
        enc.delta.uniform_(-3 * math.pi, math.pi, generator=torch.Generator().manual_seed(seed))
    return enc


def qk(lq, lk, seed=1, scale=1.5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, HEADS, length, HEAD, dtype=torch.float64, generator=gen) * scale for length in (lq, lk)]


def our_logits(enc, q, k, q_pos, k_pos, layer):
    q2, k2 = enc.qk(q, k, q_pos, k_pos, layer)  # [B, H, Lq, 2d], [B, H, Lk, 2d]
    assert q2.shape[-1] == k2.shape[-1] == 2 * q.shape[-1]
    return q2 @ k2.transpose(-1, -2) * enc.logit_scale(q2.shape[-1])  # the scale the backends ask for


def naive_logits(q, k, q_pos, k_pos, delta, base=10000.0):
    """The paper's a_ts = sum_c softplus(q_tc) softplus(k_sc) cos((s - t) theta_c + delta_c) / sqrt(d),
    theta_c = base^(-(c - 1)/d), c = 1..d, delta clamped to [-2 pi, 0], one (b, h, t, s, c) at a time."""
    batch, heads, lq, d = q.shape
    out = torch.zeros(batch, heads, lq, k.shape[-2], dtype=torch.float64)
    softplus = lambda x: math.log1p(math.exp(x))  # noqa: E731
    for b in range(batch):
        t_row, s_row = q_pos[b % q_pos.shape[0]], k_pos[b % k_pos.shape[0]]
        for h in range(heads):
            for i in range(lq):
                for j in range(k.shape[-2]):
                    total = 0.0
                    for c in range(1, d + 1):
                        theta = base ** (-(c - 1) / d)
                        shift = min(max(delta[h, c - 1].item(), -2 * math.pi), 0.0)
                        total += (softplus(q[b, h, i, c - 1].item()) * softplus(k[b, h, j, c - 1].item())
                                  * math.cos((s_row[j].item() - t_row[i].item()) * theta + shift))
                    out[b, h, i, j] = total / math.sqrt(d)
    return out


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("base", [10000.0, 50.0])
def test_matches_the_formula_written_out(shared, base):
    """Arbitrary positions (keys before and after the queries, per sequence or shared) and both layers;
    the scale is 1/sqrt(d) of the head, not of the 2d the logits are summed over. Each phase t theta is
    rounded at its size (up to 3000), the loop's (s - t) theta at the difference's: a few ulps of 3000
    per feature."""
    enc = pope(base=base)
    q, k = qk(5, 7)
    gen = torch.Generator().manual_seed(2)
    k_pos = torch.randint(0, 3000, (1 if shared else 2, 7), generator=gen)  # [B', 7]
    q_pos = torch.randint(0, 3000, (1 if shared else 2, 5), generator=gen)  # [B', 5]
    for layer in (0, 1):
        expected = naive_logits(q, k, q_pos, k_pos, enc.delta[layer].detach(), base)
        assert_close_scaled(our_logits(enc, q, k, q_pos, k_pos, layer), expected, ulps=4 * 3000 * HEAD,
                            name=f"layer {layer}")


def test_matches_pope_pytorch():
    """lucidrains' unofficial port (PyPI pope-pytorch 0.2.1): PoPE(d, heads=H)(positions) and
    apply_pope_to_qk give q', k' (interleaved, ours concatenated: the same dot products); its bias is our
    delta, clamped in its forward. Queries are the last Lq of the keys (its convention). Its frequencies
    are float32 (relative rounding 6e-8, times positions up to 40: phases within 3e-6)."""
    reference = pytest.importorskip("PoPE_pytorch")
    enc = pope()
    q, k = qk(5, 9)
    k_pos = (4 + 4 * torch.arange(9))[None]  # [1, 9]: gaps, up to 36
    theirs = reference.PoPE(HEAD, heads=HEADS).double()
    for layer in (0, 1):
        with torch.no_grad():
            theirs.bias.copy_(enc.delta[layer])  # unclamped: [-3 pi, pi]
        q2, k2 = reference.apply_pope_to_qk(theirs(k_pos[0].double()), q, k)  # [B, H, L, 2d]
        expected = q2 @ k2.transpose(-1, -2) / math.sqrt(HEAD)
        assert_close_scaled(our_logits(enc, q, k, k_pos[:, -5:], k_pos, layer), expected, rtol=2e-5,
                            name=f"layer {layer}")


def test_matches_x_transformers_polar_embedding():
    """x-transformers' PolarEmbedding (its learned_bias [H, 1, d], clamped in its forward) and
    apply_polar_pos_emb, which computes in float32: q' = [mu cos, mu sin] as ours."""
    xt = pytest.importorskip("x_transformers.x_transformers")
    if not hasattr(xt, "PolarEmbedding"):
        pytest.skip("this x-transformers predates PolarEmbedding")
    enc = pope()
    q, k = qk(6, 6)
    pos = torch.arange(6)[None] * 5 + 3  # [1, 6]
    theirs = xt.PolarEmbedding(HEAD, HEADS)
    for layer in (0, 1):
        with torch.no_grad():
            theirs.learned_bias.copy_(enc.delta[layer][:, None].float())
        freqs, bias = theirs(pos[0])  # [1, L, d], [H, 1, d]
        q2, k2 = xt.apply_polar_pos_emb(q, freqs), xt.apply_polar_pos_emb(k, freqs + bias)  # [B, H, L, 2d]
        expected = q2 @ k2.transpose(-1, -2) / math.sqrt(HEAD)
        assert_close_scaled(our_logits(enc, q, k, pos, pos, layer), expected, rtol=1e-5, name=f"layer {layer}")


def test_delta_is_clamped_in_the_forward():
    """delta beyond [-2 pi, 0] acts as its bound, and gets no gradient there; inside, it acts and learns."""
    enc = pope()
    q, k = qk(4, 4)
    pos = torch.arange(4)[None]
    with torch.no_grad():
        enc.delta[0, 0, :4] = torch.tensor([0.5, 3.0, -7.0, -100.0], dtype=torch.float64)
        enc.delta[0, 0, 4:] = torch.linspace(-6.0, -0.5, HEAD - 4, dtype=torch.float64)
    clamped = pope()
    with torch.no_grad():
        clamped.delta.copy_(enc.delta.clamp(-2 * math.pi, 0))
    assert_close_scaled(our_logits(enc, q, k, pos, pos, 0), our_logits(clamped, q, k, pos, pos, 0), rtol=1e-14)
    our_logits(enc, q, k, pos, pos, 0).sum().backward()
    grad = enc.delta.grad[0, 0]
    assert torch.all(grad[:4] == 0) and torch.all(grad[4:] != 0)
    assert torch.all(enc.delta.grad[1] == 0)  # layer 1 was not used


def test_training_projects_delta_back_into_its_range():
    """Before each step the training loop calls set_train_step: a delta an update pushed past a bound returns to it,
    and from there learns again (the forward's clamp alone would leave it without gradient)."""
    enc = pope()
    q, k = qk(4, 4)
    pos = torch.arange(4)[None]
    with torch.no_grad():
        enc.delta[0, 0, :3] = torch.tensor([0.5, -7.0, -1.0], dtype=torch.float64)
    enc.set_train_step(1, 10)
    assert enc.delta[0, 0, :3].tolist() == [0.0, -2 * math.pi, -1.0]
    our_logits(enc, q, k, pos, pos, 0).sum().backward()
    assert torch.all(enc.delta.grad[0, 0] != 0)


def test_zero_initialised_deltas_learn_from_the_first_step():
    """The paper's language-model initialisation puts every delta at the range's upper bound, 0: each still gets a
    gradient there (torch 2.14's clamp gives none at a bound, which would leave every delta at 0 for good)."""
    enc = make_encoding("pope", causal=True, d_model=D_MODEL, n_heads=HEADS).double()
    assert torch.all(enc.delta == 0)
    q, k = qk(5, 5)
    pos = torch.arange(5)[None]
    our_logits(enc, q, k, pos, pos, 0).sum().backward()
    assert torch.all(enc.delta.grad[0] != 0)


@pytest.mark.parametrize("value,expected", [(-2 * math.pi, 1.0), (0.0, 1.0), (-1.0, 1.0), (0.5, 0.0), (-7.0, 0.0)])
def test_the_clamps_gradient_is_one_inside_and_at_the_bounds_and_zero_beyond(value, expected):
    x = torch.tensor(value, dtype=torch.float64, requires_grad=True)
    clamped = clamp_learning_at_bounds(x, -2 * math.pi, 0.0)
    clamped.backward()
    assert clamped.item() == min(max(value, -2 * math.pi), 0.0) and x.grad.item() == expected


def test_delta_initialisations():
    zero = make_encoding("pope")
    assert torch.all(zero.delta == 0) and zero.delta.shape == (2, 2, 8)  # [layers, H, d]
    torch.manual_seed(0)
    uniform = make_encoding("pope", delta_init="uniform")
    assert uniform.delta.min() >= -2 * math.pi and uniform.delta.max() <= 0 and uniform.delta.std() > 1
    assert uniform.params() == {"base": 10000.0, "delta_init": "uniform"}


@pytest.mark.parametrize("params,message", [
    ({"delta_init": "normal"}, r"pope: encoding.delta_init='normal' is not valid; choose one of \['zero', 'uniform'\]"),
    ({"base": 1.0}, r"encoding.base=1.0: must be > 1"),
])
def test_bad_parameters_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        make_encoding("pope", **params)


def model(causal=True, backend="eager", dtype=torch.float64, parts=None, window=None):
    """A 2-layer model (d_model 16, 2 heads) of pope, or of a composite holding it, every parameter drawn
    (deltas over [-2 pi - 1, 1]: some clamped)."""
    torch.manual_seed(0)
    enc = make_encoding("composite", causal=causal, d_model=D_MODEL, n_heads=HEADS, parts=parts) if parts else \
        make_encoding("pope", causal=causal, d_model=D_MODEL, n_heads=HEADS)
    for name, p in enc.named_parameters():
        with torch.no_grad():
            p.uniform_(-2 * math.pi - 1, 1) if name.endswith("delta") else p.normal_(std=0.5)
    cfg = ModelConfig(vocab_size=11, d_model=D_MODEL, n_layers=2, n_heads=HEADS, causal=causal, window=window)
    backend = FlexBackend(compiled=False) if backend == "flex" else get_backend(backend)
    return Transformer(cfg, enc, backend).to(dtype).eval()


@pytest.mark.parametrize("causal", [True, False])
def test_shift_of_every_position_changes_nothing(causal):
    """Relative, bidirectional too; the phases are reduced modulo 2 pi in float64, so a float32 model at
    positions past a million gives what it gives at 0 up to float32 rounding."""
    ids = token_ids(16)
    for dtype, shifts, rtol in ((torch.float64, (1, 37, 1000, 10**6), 1e-12), (torch.float32, (10**6, 10**7), 1e-5)):
        net = model(causal, dtype=dtype)
        base = net(ids, torch.arange(16)[None])
        for shift in shifts:
            assert_close_scaled(net(ids, torch.arange(16)[None] + shift), base, rtol=rtol, name=f"shift {shift}")


def test_bidirectional_queries_read_later_keys():
    ids = token_ids(12)
    net = model(causal=False)
    pos = torch.arange(12)[None]
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 11
    assert (net(changed, pos)[:, 0] - net(ids, pos)[:, 0]).abs().max() > 1e-6
    assert not make_encoding("pope").causal_only


CASES = [None, ["pope", "alibi"], ["pope", "t5"]]  # alone; beside a decay (sdpa's extra column); a bias (a mask)


@pytest.mark.parametrize("parts", CASES, ids=lambda p: "+".join(p) if p else "pope")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 5])
def test_sdpa_matches_eager(parts, causal, window):
    """q and k 2d wide, v d wide: sdpa's output keeps v's width (past alibi's column), the fused CPU kernel
    (one head size) leaves the call to the masked kernel; one pass and chunks of 6 queries (decay_room)."""
    ids = token_ids(20)
    pos = torch.arange(20)[None] + 3
    eager, sdpa = model(causal, "eager", parts=parts, window=window), model(causal, "sdpa", parts=parts, window=window)
    sdpa.load_state_dict(eager.state_dict())
    expected = eager(ids, pos)
    for chunk in (None, 6):
        sdpa.set_eval_chunk(chunk)
        assert_close_scaled(sdpa(ids, pos), expected, rtol=1e-12, name=f"chunk {chunk}")


@pytest.mark.parametrize("parts", CASES, ids=lambda p: "+".join(p) if p else "pope")
def test_sdpa_gradients_match_eager(parts):
    ids = token_ids(20)
    grads = {}
    for backend in ("eager", "sdpa"):
        net = model(True, backend, parts=parts).train()
        net(ids, torch.arange(20)[None]).sin().sum().backward()
        grads[backend] = {name: p.grad for name, p in net.named_parameters()}
    assert grads["sdpa"]["encoding.delta" if not parts else "encoding.parts.0.delta"].abs().max() > 0
    for name, grad in grads["eager"].items():
        assert_close_scaled(grads["sdpa"][name], grad, rtol=1e-10, name=name)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("causal", [True, False])
def test_flex_matches_eager(causal):
    """FlexAttention takes v narrower than q and k (torch 2.13, CPU, unfused)."""
    ids = token_ids(20)
    pos = torch.arange(20)[None]
    eager, flex = model(causal, "eager", parts=["pope", "t5"]), model(causal, "flex", parts=["pope", "t5"])
    flex.load_state_dict(eager.state_dict())
    with torch.no_grad():
        assert_close_scaled(flex(ids, pos), eager(ids, pos), rtol=1e-12)


def test_compiled_flex_matches_eager():
    """And compiled (seconds on CPU). Under a forced ATEN_CPU_CAPABILITY inductor's C++ FlexAttention does not
    compile (torch's limit): the test then runs in a process of its own without it, as tests/test_flex.py's."""
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        env = {key: value for key, value in os.environ.items() if key != "ATEN_CPU_CAPABILITY"}
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                               f"{__file__}::test_compiled_flex_matches_eager"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:]
        return
    ids, pos = token_ids(20), torch.arange(20)[None]
    net = model(True, "eager", dtype=torch.float32)
    expected = net(ids, pos)
    for block in net.blocks:
        block.attn.backend = FlexBackend(compiled=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # inductor's C++ compiler warnings
        assert_close_scaled(net(ids, pos), expected, rtol=1e-5)
