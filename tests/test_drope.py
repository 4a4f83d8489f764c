"""drope (Gelberg et al. 2026): rope before the drop step, the identity after it; the joint QK-norm against a
loop over its formula; the switch in a real training run; a rope checkpoint loaded into drope and evaluated."""
import math
import os
import subprocess
import sys

import pytest
import torch

import posbench.encodings.drope as drope_module
import posbench.training as training
from posbench.attention import get_backend
from posbench.build import build
from posbench.encodings import REGISTRY
from posbench.evaluation import evaluate
from posbench.model import ModelConfig, Transformer
from posbench.runner import run
from tests.helpers import ROOT, assert_close_scaled, compose_cfg, make_encoding, random_qk, read_rows

SMOKE = ("debug=smoke", "task=copy", "threads=1", "device=cpu")


def rope_half_transcribed(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE in the half layout, written as complex numbers: feature pair (x_m, x_{m+d/2}) is x_m + i x_{m+d/2},
    multiplied by exp(i k theta_m), theta_m = base^(-2m/d). x: [B, H, L, d], pos: [L]."""
    d = x.shape[-1]
    theta = torch.tensor([base ** (-2 * m / d) for m in range(d // 2)], dtype=torch.float64)  # [d/2]
    turned = torch.complex(x[..., :d // 2], x[..., d // 2:]) * torch.polar(torch.ones_like(theta),
                                                                           pos.double()[:, None] * theta)
    return torch.cat((turned.real, turned.imag), dim=-1)  # [B, H, L, d]


def joint_norm_transcribed(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of the projection's output before it is split into heads: per token, the H d features
    u = (x_h,i) with index h d + i, u / sqrt(mean(u^2) + eps) * w, one feature at a time."""
    b, heads, length, d = x.shape
    out = torch.empty_like(x)
    for n in range(b):
        for t in range(length):
            u = [x[n, h, t, i].item() for h in range(heads) for i in range(d)]
            rms = math.sqrt(sum(value * value for value in u) / len(u) + eps)
            for h in range(heads):
                for i in range(d):
                    out[n, h, t, i] = u[h * d + i] / rms * weight[h * d + i].item()
    return out


def model_with(name: str, **params) -> Transformer:
    """A float64 two-layer model (d_model 32, 4 heads) of an encoding, weights from seed 0."""
    torch.manual_seed(0)  # the encoding's initial values too, whatever ran before
    enc = make_encoding(name, d_model=32, n_heads=4, **params)
    cfg = ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=4)
    return Transformer(cfg, enc, get_backend("eager", enc)).double()


@pytest.mark.parametrize("drop_at,total,first_dropped", [(0.875, 16000, 14000), (0.875, 16, 14), (0.5, 10, 5),
                                                         (0.0, 10, 0), (1.0, 10, 10)])
def test_rotation_is_rope_before_the_drop_step_and_the_identity_from_it(drop_at, total, first_dropped):
    enc = make_encoding("drope", d_model=32, n_heads=4, drop_at=drop_at, base=500.0)
    q, k = random_qk(4, 9, 8)
    pos = torch.arange(3, 12)
    for step in sorted({0, first_dropped - 1, first_dropped, total - 1} & set(range(total))):
        enc.set_train_step(step, total)
        got_q, got_k = enc.qk(q, k, pos[None], pos[None], 0)
        if step < first_dropped:
            assert_close_scaled(got_q, rope_half_transcribed(q, pos, 500.0), ulps=16, name=f"q at step {step}")
            assert_close_scaled(got_k, rope_half_transcribed(k, pos, 500.0), ulps=16, name=f"k at step {step}")
        else:
            assert torch.equal(got_q, q) and torch.equal(got_k, k), f"step {step} rotated"
    enc.set_eval_length(18, 72)  # evaluation: dropped, whatever the step (drop_at = 1 included)
    assert all(map(torch.equal, enc.qk(q, k, pos[None], pos[None], 0), (q, k)))


def test_logits_are_ropes_before_the_drop_and_nopes_after_with_the_same_weights():
    drope, rope, nope = model_with("drope", drop_at=0.5), model_with("rope"), model_with("nope")
    rope.load_state_dict(drope.state_dict())
    nope.load_state_dict(drope.state_dict())
    ids = torch.randint(0, 11, (2, 20), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(20)[None]
    drope.encoding.set_train_step(4, 10)
    assert_close_scaled(drope(ids, pos), rope(ids, pos), rtol=0, atol_scale=1e-12, name="before the drop")
    drope.encoding.set_train_step(5, 10)
    assert torch.equal(drope(ids, pos), nope(ids, pos))
    drope.encoding.set_train_step(0, 10)
    drope.encoding.set_eval_length(20, 40)
    ids = torch.randint(0, 11, (2, 40), generator=torch.Generator().manual_seed(2))
    assert torch.equal(drope(ids, torch.arange(40)[None]), nope(ids, torch.arange(40)[None]))


def test_qk_norm_is_one_rmsnorm_over_every_head_jointly():
    enc = make_encoding("drope", d_model=32, n_heads=4, drop_at=0.0, qk_norm=True).double()
    assert enc.norm_weight.shape == (2, 2, 32) and torch.equal(enc.norm_weight, torch.ones(2, 2, 32))
    torch.nn.init.normal_(enc.norm_weight, mean=1.0, std=0.3, generator=torch.Generator().manual_seed(0))
    q, k = random_qk(4, 5, 8)
    q[:, 1] *= 10  # one loud head: a joint norm scales the others down with it, a per-head one would not
    pos = torch.arange(5)[None]
    for layer in (0, 1):
        got_q, got_k = enc.qk(q, k, pos, pos, layer)
        assert_close_scaled(got_q, joint_norm_transcribed(q, enc.norm_weight[layer, 0]), ulps=64, name="q")
        assert_close_scaled(got_k, joint_norm_transcribed(k, enc.norm_weight[layer, 1]), ulps=64, name="k")
    quiet = enc.qk(q, k, pos, pos, 0)[0][:, 0]  # head 0 beside the loud head 1
    assert quiet.pow(2).mean() < 0.05 * q[:, 0].pow(2).mean()


def test_qk_norm_weights_are_in_the_graph_before_the_drop_with_zero_gradient():
    """Before the drop the norm is not applied, but its weights get a zero gradient at every step (so
    DDP's static graph sees the same parameters used throughout); after it, a real one."""
    model = model_with("drope", drop_at=0.5, qk_norm=True)
    ids = torch.randint(0, 11, (2, 12), generator=torch.Generator().manual_seed(3))
    grads = []
    for step in (4, 5):
        model.zero_grad(set_to_none=True)
        model.encoding.set_train_step(step, 10)
        model(ids, torch.arange(12)[None]).square().mean().backward()
        grads.append(model.encoding.norm_weight.grad)
    assert grads[0] is not None and torch.equal(grads[0], torch.zeros_like(grads[0]))
    assert grads[1].abs().min() > 0


def test_the_compiled_forward_follows_the_switch():
    """The flag is read outside the graph: a compiled forward guards on it and recompiles at the drop."""
    model = model_with("drope", drop_at=0.5)
    nope, rope = model_with("nope"), model_with("rope")
    ids, pos = torch.randint(0, 11, (2, 12), generator=torch.Generator().manual_seed(4)), torch.arange(12)[None]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    model.encoding.set_train_step(0, 10)
    assert_close_scaled(compiled(ids, pos), rope(ids, pos), rtol=1e-12, name="compiled before the drop")
    model.encoding.set_train_step(5, 10)
    assert_close_scaled(compiled(ids, pos), nope(ids, pos), rtol=1e-12, name="compiled after the drop")


def test_a_short_training_run_drops_at_its_step_and_wakes_the_norm_then(monkeypatch, tmp_path):
    """8 steps at drop_at 0.5: steps 0-3 rotate (q and k of the one layer: 2 rotations each), 4-7 do not, and
    the norm weights stay exactly 1 until step 4 trains them; evaluation rotates nothing."""
    rotations, seen = [0], []
    rotate = drope_module.rotate

    def counting_rotate(*args):
        rotations[0] += 1
        return rotate(*args)

    step = training.train_step

    def recording_step(model, *args, **kwargs):
        before = rotations[0]
        weights = model.encoding.norm_weight.detach().clone()
        result = step(model, *args, **kwargs)
        seen.append((model.encoding.dropped, rotations[0] - before, torch.equal(weights, torch.ones_like(weights))))
        return result

    monkeypatch.setattr(drope_module, "rotate", counting_rotate)
    monkeypatch.setattr(training, "train_step", recording_step)
    cfg = compose_cfg(*SMOKE, "encoding=drope", "encoding.drop_at=0.5", "encoding.qk_norm=true", "train.steps=8")
    rows = run(cfg, tmp_path)
    assert [dropped for dropped, _, _ in seen] == [False] * 4 + [True] * 4
    assert [count for _, count, _ in seen] == [2] * 4 + [0] * 4
    assert [ones for _, _, ones in seen] == [True] * 5 + [False] * 3  # the weights each step starts from
    assert len(seen) == 8 and rotations[0] == 8  # the evaluation rotated nothing
    assert [row["status"] for row in rows] == ["ok", "ok"]
    assert rows[0]["encoding_params"] == {"base": 10000.0, "drop_at": 0.5, "qk_norm": True}
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["model"]
    assert "encoding.norm_weight" in saved and not torch.equal(saved["encoding.norm_weight"], torch.ones(1, 2, 16))
    again = build(cfg, torch.device("cpu"))
    again.model.load_state_dict(saved)  # its own trained norm weights, not the ones a rope checkpoint gets
    assert torch.equal(again.encoding.norm_weight, saved["encoding.norm_weight"])


@pytest.mark.slow
def test_two_processes_train_across_the_drop_as_one(tmp_path):
    """Data-parallel (DDP with a static graph: the same parameters used at every step): the norm weights,
    unused before the drop and trained after it, give the one-process run's rows."""
    overrides = [*SMOKE, "encoding=drope", "encoding.drop_at=0.5", "encoding.qk_norm=true"]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "-m", "posbench", f"hydra.run.dir={tmp_path / 'two'}", *overrides], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "WANDB_MODE": "disabled"})
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = run(compose_cfg(*overrides), tmp_path / "one"), read_rows(tmp_path / "two")
    assert [r["world_size"] for r in two] == [2, 2]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)


@pytest.fixture(scope="module")
def rope_checkpoint(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("rope")
    run(compose_cfg(*SMOKE, "encoding=rope"), run_dir)
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)


def evaluated(encoding_overrides, weights) -> list[tuple]:
    """A smoke run's model of that encoding, the weights loaded, evaluated at N and 2N."""
    cfg = compose_cfg(*SMOKE, *encoding_overrides)
    built = build(cfg, torch.device("cpu"))
    built.model.load_state_dict(weights)
    rows = [evaluate(built, length, cfg.eval, torch.device("cpu")) for length in built.lengths]
    return [(row["exact_match"], row["token_acc"], row["loss"]) for row in rows]


def test_a_rope_checkpoint_loads_into_drope_and_evaluates_as_nope(rope_checkpoint):
    """Recalibration's start: every weight of a rope run kept, the rotation dropped: nope with those weights."""
    weights = rope_checkpoint["model"]
    as_drope = evaluated(["encoding=drope", "encoding.drop_at=0"], weights)
    assert as_drope == evaluated(["encoding=nope"], weights)
    assert as_drope != evaluated(["encoding=rope"], weights)


def test_a_rope_checkpoint_loads_into_drope_with_qk_norm_at_weight_one(rope_checkpoint):
    cfg = compose_cfg(*SMOKE, "encoding=drope", "encoding.drop_at=0", "encoding.qk_norm=true")
    built = build(cfg, torch.device("cpu"))
    built.model.load_state_dict(rope_checkpoint["model"])  # no norm weights there: they start at 1
    assert torch.equal(built.encoding.norm_weight, torch.ones(1, 2, 16))
    assert torch.equal(built.model.tok.weight, rope_checkpoint["model"]["tok.weight"])
    row = evaluate(built, built.lengths[-1], cfg.eval, torch.device("cpu"))
    assert math.isfinite(row["loss"]) and 0 <= row["token_acc"] <= 1


@pytest.mark.parametrize("params,message", [
    ({"drop_at": 1.5}, r"drope: encoding.drop_at=1.5: must be in \[0, 1\]"),
    ({"drop_at": -0.1}, r"drope: encoding.drop_at=-0.1: must be in \[0, 1\]"),
    ({"drop_at": None}, r"drope: encoding.drop_at=None: must be"),
    ({"qk_norm": "yes"}, r"drope: encoding.qk_norm='yes': must be true or false"),
    ({"base": 1.0}, r"drope: encoding.base=1.0: must be > 1"),
    ({"causal": False}, r"drope: .*set model.causal=true"),
    ({"d_model": 12, "n_heads": 4}, r"drope rotates feature pairs .* even head size"),
])
def test_bad_parameters_are_refused_naming_them(params, message):
    with pytest.raises(ValueError, match=message):
        make_encoding("drope", **params)


def test_registered_with_its_traits():
    cls = REGISTRY["drope"]
    assert (cls.hooks, cls.relative, cls.causal_only) == (frozenset({"qk"}), True, True)


@pytest.mark.parametrize("encoding", [
    ("encoding=drope", "encoding.drop_at=0.5"),
    ("encoding=composite", "encoding.parts=[drope,alibi]", "+encoding.part_params={drope: {drop_at: 0.5}}"),
    ("encoding=schedule", "encoding.pattern=[dropped]", "encoding.kinds={dropped: {encoding: drope, drop_at: 0.5}}"),
])
def test_a_drope_inside_a_composite_or_schedule_drops_at_the_step_drope_alone_does(monkeypatch, tmp_path, encoding):
    """8 training steps at drop_at 0.5: the training loop's set_train_step reaches the part or entry, so steps 0-3
    rotate q and k (2 rotations) and 4-7 do not, as drope alone; evaluation rotates nothing."""
    rotations, per_step = [0], []
    rotate, step = drope_module.rotate, training.train_step

    def counting_rotate(*args):
        rotations[0] += 1
        return rotate(*args)

    def recording_step(*args, **kwargs):
        before = rotations[0]
        result = step(*args, **kwargs)
        per_step.append(rotations[0] - before)
        return result

    monkeypatch.setattr(drope_module, "rotate", counting_rotate)
    monkeypatch.setattr(training, "train_step", recording_step)
    rows = run(compose_cfg(*SMOKE, *encoding, "train.steps=8"), tmp_path)
    assert per_step == [2] * 4 + [0] * 4 and rotations[0] == 8
    assert [row["status"] for row in rows] == ["ok", "ok"]
