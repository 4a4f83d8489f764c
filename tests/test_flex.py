"""The flex backend: every bias encoding's score_mod gives its bias(), and FlexAttention with it gives the
eager reference's outputs (causal and bidirectional, square and queries after a memory); the refusals.

The unfused FlexAttention (FlexBackend(compiled=False)) runs these on CPU; one test compiles."""
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from posbench.attention import BACKENDS, AttentionCall, EagerBackend, FlexBackend, get_backend, query_key_hooks
from posbench.encodings import REGISTRY
from posbench.encodings.base import Encoding, relative_distance
from posbench.attention.flex import causal_block_mask
from posbench.model import ModelConfig, Transformer
from tests.helpers import ROOT, assert_close_scaled, make_encoding, with_layouts

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

SEQUENCE = sorted(name for name, cls in REGISTRY.items() if cls.position_dims == 1)  # 2-D: no score_mod yet
BIAS = [name for name in SEQUENCE if "bias" in REGISTRY[name].hooks]
RUNNABLE = [name for name in SEQUENCE if not set(REGISTRY[name].hooks) - {"embed"} - FlexBackend.supported_hooks]
# the registry's bias encodings with their defaults, and the variants whose score_mod takes another path
CASES = [(name, {}) for name in BIAS] + [
    ("t5", {"num_buckets": 8, "max_distance": 10}),  # offsets past max_distance share the last bucket
    ("t5", {"bucketed": False, "max_distance": 6}),
    ("kerple", {"variant": "power"}),
    ("fire", {"share_layers": True}),
    ("composite", {"parts": ["alibi", "kerple", "sandwich"]}),
]
FLEX_CASES = [(name, params) for name, params in CASES if name in RUNNABLE] + [
    ("alibi", {}),  # a decay when causal, a bias when not
]


def attend(backend, q, k, v, *call_fields):
    """What the layer hands a backend: the call, after the hooks before the logits (alibi's causal decay)."""
    call = AttentionCall(*call_fields)
    q, k = query_key_hooks(q, k, call)
    return backend.attend(q, k, v, call)


def case_id(case):
    name, params = case
    return "-".join([name, *(f"{k}={v}" for k, v in params.items())])


def trained_looking(name: str, params: dict, causal: bool = True) -> Encoding:
    torch.manual_seed(0)
    enc = make_encoding(name, causal=causal, d_model=32, n_heads=4, max_positions=64, **params)
    for p in enc.parameters():  # not the zero / one initialisations
        torch.nn.init.normal_(p, std=0.5)
    return enc


def score_grid(score_mod, batch: int, heads: int, lq: int, lk: int, dtype) -> torch.Tensor:
    """score_mod of a zero score at every (b, h, q_idx, kv_idx), one score at a time: [B, H, Lq, Lk]."""
    index = torch.meshgrid(*(torch.arange(n, dtype=torch.int32) for n in (batch, heads, lq, lk)), indexing="ij")
    scores = torch.vmap(score_mod)(torch.zeros(index[0].numel(), dtype=dtype), *(i.flatten() for i in index))
    return scores.view(batch, heads, lq, lk)


def random_positions(batch: int, length: int, seed: int) -> torch.Tensor:
    """Sorted positions with gaps, as the randomized schemes give: [batch, length]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(60, generator=gen)[:length].sort().values for _ in range(batch)])


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shared", [True, False])
def test_score_mod_gives_the_bias(case, causal, shared):
    enc = trained_looking(*case, causal=causal).double()
    k_pos = random_positions(1 if shared else 2, 17, seed=1)  # [B', 17]
    q_pos = k_pos[:, -7:] if shared else random_positions(2, 7, seed=2)  # [B', 7]
    for layer in (0, 1):
        expected = enc.bias(q_pos, k_pos, layer)  # [B', H, 7, 17]
        got = score_grid(enc.score_mod(q_pos, k_pos, layer), q_pos.shape[0], 4, 7, 17, torch.float64)
        assert_close_scaled(got, expected, rtol=0, atol_scale=1e-12, name=f"layer {layer}")  # biases up to ~65


def test_t5_score_mod_reaches_past_max_distance():
    """Guard for the case above: the positions span offsets beyond the t5 table's max_distance."""
    distance = relative_distance(random_positions(2, 7, seed=2), random_positions(2, 17, seed=1))
    assert distance.max() > 10 and distance.min() < -10


@pytest.mark.parametrize("case", FLEX_CASES, ids=case_id)
@pytest.mark.parametrize("causal", [True, False])
# square with shared positions; queries after a memory with per-sequence positions
@pytest.mark.parametrize("lq,shared", [(21, True), (8, False)])
def test_attend_matches_eager(case, causal, lq, shared):
    enc = trained_looking(*case, causal=causal)
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, lq, 8, generator=gen), *torch.randn(2, 2, 4, 21, 8, generator=gen)
    k_pos = torch.arange(21)[None] + (3 if shared else torch.tensor([[0], [5]]))  # [B', 21]
    q_pos = k_pos[:, -lq:]  # [B', Lq]
    with torch.no_grad():
        expected = attend(EagerBackend(), q, k, v, enc, q_pos, k_pos, 1, causal)  # [2, 4, Lq, 8]
        got = attend(FlexBackend(compiled=False), q, k, v, enc, q_pos, k_pos, 1, causal)
    assert_close_scaled(got, expected, rtol=0, atol_scale=1e-5)  # float32 outputs up to ~4


def test_attend_over_several_blocks_matches_eager():
    """Full, partial and cut blocks of the block mask (block 128), queries after a memory."""
    enc = trained_looking("alibi", {})
    gen = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(1, 4, 200, 8, generator=gen), *torch.randn(2, 1, 4, 333, 8, generator=gen)
    pos = torch.arange(333)[None]
    with torch.no_grad():
        expected = attend(EagerBackend(), q, k, v, enc, pos[:, -200:], pos, 0, True)
        got = attend(FlexBackend(compiled=False), q, k, v, enc, pos[:, -200:], pos, 0, True)
    assert_close_scaled(got, expected, rtol=0, atol_scale=1e-5)  # float32 outputs up to ~2


@pytest.mark.parametrize("lq,lk", [(5, 5), (128, 128), (300, 300), (200, 513), (129, 257), (1, 300)])
def test_causal_block_mask_equals_create_block_mask(lq, lk):
    shift = lk - lq
    expected = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx + shift >= kv_idx, None, None, lq, lk,
                                 device="cpu")
    got = causal_block_mask(lq, lk, torch.device("cpu"))
    assert torch.equal(got.to_dense(), expected.to_dense())  # blocks seen at all

    def full_blocks(mask):
        return [set(row[:n].tolist()) for row, n in zip(mask.full_kv_indices[0, 0], mask.full_kv_num_blocks[0, 0])]

    assert full_blocks(got) == full_blocks(expected)  # blocks seen whole (no mask_mod)


def model_pair(name: str, causal: bool) -> tuple[Transformer, Transformer]:
    """The same float32 model on the eager and the (unfused) flex backend."""
    enc = trained_looking(name, {}, causal)
    cfg = ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=4, causal=causal)
    eager = Transformer(cfg, enc, get_backend("eager")).eval()
    flex = Transformer(cfg, enc, FlexBackend(compiled=False)).eval()
    flex.load_state_dict(eager.state_dict())
    return eager, flex


@pytest.mark.parametrize("name,causal", with_layouts(SEQUENCE))
def test_model_matches_eager(name, causal):
    if name not in RUNNABLE:
        with pytest.raises(ValueError, match="backend=flex cannot run the"):
            model_pair(name, causal)
        return
    eager, flex = model_pair(name, causal)
    flex.set_eval_chunk(4)  # ignored: flex attends every query at once
    ids = torch.randint(0, 11, (2, 25), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(25)[None]
    with torch.no_grad():
        torch.testing.assert_close(flex(ids, pos), eager(ids, pos), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["alibi", "t5", "sandwich", "composite"])
def test_segment_after_memory_matches_eager(name):
    eager, flex = model_pair(name, True)
    ids = torch.randint(0, 11, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, memory = eager.forward_recurrent(ids[:, :6], None, memory_length=6)
        expected, _ = eager.forward_recurrent(ids[:, 6:], memory, memory_length=6)
        got, _ = flex.forward_recurrent(ids[:, 6:], memory, memory_length=6)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_compiled_flex_matches_eager():
    """One compiled FlexAttention (seconds of compilation on CPU): t5's table lookup, queries after a memory.
    Under a forced ATEN_CPU_CAPABILITY inductor's C++ does not compile (torch's fault, not posbench's): the test
    then runs in a process of its own without it."""
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        env = {key: value for key, value in os.environ.items() if key != "ATEN_CPU_CAPABILITY"}
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                               f"{__file__}::test_compiled_flex_matches_eager"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:]
        return
    enc = trained_looking("t5", {})
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(2, 4, 24, 8, generator=gen), *torch.randn(2, 2, 4, 40, 8, generator=gen)
    pos = torch.arange(40)[None]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # inductor's C++ compiler warnings
        got = attend(get_backend("flex"), q, k, v, enc, pos[:, -24:], pos, 0, True)
    expected = attend(EagerBackend(), q, k, v, enc, pos[:, -24:], pos, 0, True)
    assert_close_scaled(got, expected, rtol=0, atol_scale=1e-5)  # float32 outputs up to ~1.3


class BiasWithoutScoreMod(Encoding):
    name = "bias_without_score_mod"
    hooks = frozenset({"bias"})

    def bias(self, q_pos, k_pos, layer):
        return relative_distance(q_pos, k_pos)[:, None].float()  # [B', 1, Lq, Lk]


def test_bias_without_score_mod_is_refused():
    enc = BiasWithoutScoreMod(make_encoding("nope").dims)
    with pytest.raises(ValueError, match=r"encoding bias_without_score_mod: its bias has no FlexAttention "
                                         r"score_mod.*backends that can: \['sdpa', 'eager'\]"):
        get_backend("flex").check(enc)
    get_backend("sdpa").check(enc)


def test_hooks_flex_cannot_run_are_refused():
    with pytest.raises(ValueError, match=r"flex cannot run the \['prob'\] hook.*backends that can: \['eager'\]"):
        get_backend("flex").check(make_encoding("urpe"))


def test_training_on_cpu_is_refused():
    _, flex = model_pair("alibi", True)
    flex.train()
    ids = torch.randint(0, 11, (2, 9))
    with pytest.raises(ValueError, match=r"backend=flex trains on CUDA only; on CPU it evaluates \(forward only\); "
                                         r"use backend=sdpa or auto for training"):
        flex(ids, torch.arange(9)[None])


def test_flex_is_registered():
    assert BACKENDS["flex"] is FlexBackend and isinstance(get_backend("flex"), FlexBackend)
    assert get_backend("flex").compiled


@pytest.mark.parametrize("name", ["alibi_2d", "t5_2d"])
def test_grid_biases_without_a_score_mod_are_refused(name):
    with pytest.raises(ValueError, match=f"backend=flex cannot run encoding {name}: its bias has no"):
        FlexBackend(compiled=False).check(make_encoding(name))


@pytest.mark.parametrize("name", sorted(n for n, cls in REGISTRY.items() if "bias" in cls.hooks
                                         and cls.position_dims == 1 and cls.hooks <= FlexBackend.supported_hooks))
def test_a_plan_on_the_meta_device_takes_every_bias_with_a_score_mod(name):
    """The run's plan builds the model on the meta device; a score_mod that reads position values (sandwich's
    table per offset) cannot run there, and the plan must not refuse it (the built model's check probes it)."""
    FlexBackend(compiled=False).check(make_encoding(name))
    with torch.device("meta"):
        planned = make_encoding(name)
    FlexBackend(compiled=False).check(planned)
