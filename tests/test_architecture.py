"""The settable architecture and schedule: model.activation, model.norm, model.bias and
train.schedule. Each is checked against its formula; their defaults leave the model, its
initial outputs and the runs' config_hash as they were before the settings existed."""
import copy
import math

import pytest
import torch
from omegaconf import OmegaConf

from posbench.attention import PositionContext, get_backend
from posbench.build import build
from posbench.model import ModelConfig, Transformer
from posbench.runinfo import ADDED_SETTINGS, config_hash, group_config
from posbench.training import learning_rate
from tests.helpers import compose_cfg, make_encoding


def model(encoding: str = "rope", **settings) -> Transformer:
    torch.manual_seed(0)
    enc = make_encoding(encoding, d_model=16, n_heads=2)
    cfg = ModelConfig(vocab_size=11, d_model=16, n_layers=2, n_heads=2, **settings)
    return Transformer(cfg, enc, get_backend("eager", enc))


def test_rmsnorm_is_t5s_formula():
    norms = [m for m in model(norm="rmsnorm").modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(norms) == 5  # two per block and the final one
    norm = norms[0]
    assert [name for name, _ in norm.named_parameters()] == ["weight"]  # no bias
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 7, 16) * 5 + 2  # a mean far from 0: the norm must not subtract it
    x64, w64 = x.double(), norm.weight.detach().double()
    expected = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-6) * w64
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.double()(x64), expected, rtol=1e-12, atol=1e-12)


def test_a_relu_block_is_the_hand_computed_one():
    block = model(activation="relu").double().blocks[0]
    for p in block.parameters():  # biases drawn too, so that their place in the formula is tested
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    positions = PositionContext(block.attn.encoding[0], torch.arange(6)[None])
    w1, b1, w2, b2 = block.mlp[0].weight, block.mlp[0].bias, block.mlp[2].weight, block.mlp[2].bias
    with torch.no_grad():
        h = x + block.attn(block.norm1(x), positions)
        pre = block.norm2(h) @ w1.T + b1
        expected = h + (pre.clamp(min=0) @ w2.T + b2)
        torch.testing.assert_close(block(x, positions), expected)
        assert (pre < 0).any()  # where GELU would differ from ReLU
        assert not torch.allclose(torch.nn.functional.gelu(pre) @ w2.T, pre.clamp(min=0) @ w2.T)


def test_bias_false_removes_every_bias_outside_the_encoding():
    with_bias, without = model("transformer_xl"), model("transformer_xl", bias=False)
    assert not [name for name, _ in without.named_parameters() if name.endswith("bias")
                and not name.startswith("encoding.")]
    # the encoding's own parameters (transformer_xl's content_bias, position_bias) are untouched
    assert {n: p.shape for n, p in with_bias.encoding.named_parameters()} == \
        {n: p.shape for n, p in without.encoding.named_parameters()}
    biases = sum(p.numel() for name, p in with_bias.named_parameters()
                 if name.endswith("bias") and not name.startswith("encoding."))
    d, hidden, layers = 16, 4 * 16, 2
    assert biases == layers * (hidden + d + 2 * d) + d  # the feed-forward's two, the block's two norms, the final norm
    assert sum(p.numel() for p in with_bias.parameters()) - sum(p.numel() for p in without.parameters()) == biases
    assert all(isinstance(m, torch.nn.LayerNorm) and m.bias is None
               for m in without.modules() if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm)))


def test_the_linear_schedule_decays_to_min_lr_at_train_steps():
    cfg = OmegaConf.create({"lr": 2.0, "warmup_steps": 10, "steps": 110, "min_lr_ratio": 0.1, "schedule": "linear"})
    end = 2.0 * 0.1

    def hf_polynomial(step):  # HF Trainer's polynomial decay with power 1 to lr_end
        return end + (2.0 - end) * (1 - (step - 10) / (110 - 10))

    assert learning_rate(0, cfg) == pytest.approx(0.2) and learning_rate(9, cfg) == pytest.approx(2.0)
    for step, value in ((10, 2.0), (35, 1.55), (60, 1.1), (109, 0.218)):  # warm-up end, a quarter, midway, last
        assert learning_rate(step, cfg) == pytest.approx(value) == pytest.approx(hf_polynomial(step))
    assert learning_rate(110, cfg) == pytest.approx(end) == learning_rate(500, cfg)
    cosine = OmegaConf.merge(cfg, {"schedule": "cosine"})  # today's: half a cosine
    assert learning_rate(35, cosine) == pytest.approx(end + (2.0 - end) * 0.5 * (1 + math.cos(math.pi / 4)))
    assert learning_rate(60, cosine) == pytest.approx(1.1) and learning_rate(110, cosine) == pytest.approx(end)


def test_the_default_model_is_the_one_before_these_settings():
    # measured on the code before model.activation/norm/bias existed (posbench commit 378a2e7)
    built = build(compose_cfg("device=cpu"), torch.device("cpu"))  # model=small, task=copy, encoding=rope
    assert sum(p.numel() for p in built.model.parameters()) == 150_848
    torch.manual_seed(0)
    ids = torch.randint(0, built.task.vocab_size, (2, 12))
    with torch.no_grad():
        logits = built.model(ids, torch.arange(12)[None])
    torch.testing.assert_close(logits[0, 0, :4], torch.tensor([0.18201417, 0.08672141, -0.09770574, 0.00073304]),
                               rtol=1e-4, atol=1e-6)
    assert logits.double().sum().item() == pytest.approx(3.4559660692, abs=1e-4)


GENERAL_TRAINING = ("train.steps=10000", "train.lr=1e-3", "train.min_lr_ratio=0.1")  # before task_train/copy.yaml


def test_added_settings_at_their_earlier_values_keep_the_config_hash():
    resolved = OmegaConf.to_container(compose_cfg(*GENERAL_TRAINING), resolve=True)
    absent = object()  # another encoding's parameter (fox's k_shift, self_extend's scale_base)
    present = {key: OmegaConf.select(OmegaConf.create(resolved), key, default=absent) for key in ADDED_SETTINGS}
    present = {key: value for key, value in present.items() if value is not absent}
    assert set(ADDED_SETTINGS) - set(present) == {"encoding.k_shift", "encoding.v_shift", "encoding.scale_base"}
    assert present == {key: ADDED_SETTINGS[key] for key in present}
    before = copy.deepcopy(resolved)  # the config as written before the settings existed
    for key in ADDED_SETTINGS:
        section, leaf = key.split(".")
        before[section].pop(leaf, None)
    assert config_hash(group_config(resolved)) == config_hash(group_config(before))
    # the default run's hash as the code before these settings computed it (commit 378a2e7)
    assert config_hash(group_config(resolved)) == "5e807f9dc682"
    # copy's own training defaults (3,500 steps, lr 3e-3 to 1%; 2,500 steps until 2026-11-27: 517a32f251c8)
    # made the default job another group
    assert config_hash(group_config(OmegaConf.to_container(compose_cfg(), resolve=True))) == "8e6cc40fa50b"
    for key, other in (("model.activation", "relu"), ("model.norm", "rmsnorm"), ("model.bias", False),
                       ("model.norm_position", "post"), ("model.embed_scale", True), ("train.schedule", "linear"),
                       ("encoding.rotary_fraction", 0.25), ("task.eos", True)):
        changed = copy.deepcopy(resolved)
        section, leaf = key.split(".")
        changed[section][leaf] = other
        assert config_hash(group_config(changed)) != config_hash(group_config(resolved)), key
        assert group_config(changed)[section][leaf] == other


def test_a_post_ln_block_is_the_hand_computed_one_and_the_model_has_no_final_norm():
    net = model(norm_position="post").double()
    block = net.blocks[0]
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    positions = PositionContext(block.attn.encoding[0], torch.arange(6)[None])

    def layer_norm(t, norm):  # (t - mean) / sqrt(var + eps) * weight + bias
        mean, var = t.mean(-1, keepdim=True), t.var(-1, unbiased=False, keepdim=True)
        return (t - mean) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias

    with torch.no_grad():
        h = layer_norm(x + block.attn(x, positions), block.norm1)  # attention reads x itself
        expected = layer_norm(h + block.mlp(h), block.norm2)
        torch.testing.assert_close(block(x, positions), expected)
        pre = model().double().blocks[0]
        pre.load_state_dict(block.state_dict())
        assert not torch.allclose(pre(x, positions), expected)  # the position of the norms matters
    assert isinstance(net.norm, torch.nn.Identity)
    assert not [name for name, _ in net.named_parameters() if name.startswith("norm.")]


def test_embed_scale_multiplies_the_token_embeddings_by_sqrt_d():
    plain, scaled = model("sinusoidal"), model("sinusoidal", embed_scale=True)
    scaled.load_state_dict(plain.state_dict())
    ids, pos = torch.randint(0, 11, (2, 5)), torch.arange(5)[None]
    hook_inputs = []  # what the encoding's embed hook (sinusoidal adds its table) receives
    original = scaled.encoding.embed

    def spy(x, *rest):
        hook_inputs.append(x)
        return original(x, *rest)

    scaled.encoding.embed = spy
    scaled(ids, pos)
    torch.testing.assert_close(hook_inputs[0], plain.tok(ids) * 4.0)  # sqrt(16)
    assert not torch.allclose(scaled(ids, pos), plain(ids, pos))
