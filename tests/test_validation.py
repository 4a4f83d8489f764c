"""Every bad setting is refused before the first training step, by a ValueError that names the key,
the value and what is valid; every good one runs (posbench.validate, the encodings' and tasks' own checks)."""
import re
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch
from hydra.errors import InstantiationException
from hypothesis import given, settings
from hypothesis import strategies as st

from posbench import runner
from posbench.build import build
from posbench.runner import run
from tasks.text_data import DataUnavailableError
from tests.helpers import compose_cfg, write_wikitext_release

TINY = ("debug=smoke", "encoding=rope", "task=copy", "threads=1", "device=cpu", "train.save_checkpoint=false")


def refused(run_or_build, *args) -> ValueError:
    """The ValueError the call raises: itself, or the one hydra wraps when a task constructor
    (built by hydra's instantiate) refuses its parameters."""
    try:
        run_or_build(*args)
    except InstantiationException as err:
        assert isinstance(err.__cause__, ValueError), err
        return err.__cause__
    except ValueError as err:
        return err
    raise AssertionError("nothing was refused")


@pytest.fixture
def no_training(monkeypatch):
    """Any call of the training loop fails the test: refusals must come before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("training started: the bad setting was not refused before it")

    monkeypatch.setattr(runner, "train", refuse)


BAD = [  # overrides -> the start of the message (the key and the value as given)
    (["train.grad_clip=-1"], "train.grad_clip=-1: must be > 0"),
    (["train.grad_clip=0"], "train.grad_clip=0: must be > 0"),
    (["train.min_lr_ratio=-5"], "train.min_lr_ratio=-5: must be in [0, 1]"),
    (["train.min_lr_ratio=1.5"], "train.min_lr_ratio=1.5: must be in [0, 1]"),
    (["train.steps=-5"], "train.steps=-5: must be >= 0"),
    (["train.steps=abc"], "train.steps='abc': must be an integer >= 0"),
    (["train.steps=2.5"], "train.steps=2.5: must be an integer >= 0"),
    (["train.steps=1000000000000000000000"], "train.steps=1000000000000000000000: must be <= 9223372036854775807"),
    (["train.log_every=0"], "train.log_every=0: must be >= 1"),
    (["train.batch_size=0"], "train.batch_size=0: must be >= 1"),
    (["train.batch_size=true"], "train.batch_size=True: must be an integer >= 1"),
    (["train.lr=0"], "train.lr=0: must be > 0"),
    (["train.lr=fast"], "train.lr='fast': must be a finite number > 0"),
    (["train.lr=nan"], "train.lr=nan: must be a finite number > 0"),
    (["train.warmup_steps=-1"], "train.warmup_steps=-1: must be >= 0"),
    (["train.weight_decay=-0.1"], "train.weight_decay=-0.1: must be >= 0"),
    (["train.length=0"], "train.length=0: must be >= 1"),
    (["train.length=n"], "train.length='n': must be an integer >= 1"),
    (["train.compile=sometimes"], "train.compile='sometimes' is not valid; choose one of false, true, static, graphs, capture"),
    (["train.compile=1"], "train.compile=1 is not valid; choose one of false, true, static, graphs, capture"),
    (["train.compile=yes"], "train.compile='yes' is not valid; choose one of false, true, static, graphs, capture"),
    (["train.compile=dynamic"], "train.compile='dynamic' is not valid; choose one of false, true, static, graphs,"),
    (["train.save_checkpoint=1"], "train.save_checkpoint=1: must be true or false"),
    (["train.lengths=sometimes"], "train.lengths='sometimes' is not valid; choose one of ['uniform', 'fixed']"),
    (["train.precision=fp16"], "train.precision='fp16' is not valid; choose one of ['fp32', 'bf16']"),
    (["train.positions=shuffled"], "train.positions='shuffled' is not valid; choose one of ['sequential',"),
    (["train.max_position=0"], "train.max_position=0: must be >= 1, or null"),
    (["train.checkpoint_every=-1"], "train.checkpoint_every=-1: must be >= 0, or null (never)"),
    (["train.resume=maybe"], "train.resume='maybe': must be auto, true or false"),
    (["seed=-1"], "seed=-1: must be >= 0"),
    (["eval.samples=0"], "eval.samples=0: must be >= 1"),
    (["eval.batch_size=x"], "eval.batch_size='x': must be an integer >= 1"),
    (["eval.seed=abc"], "eval.seed='abc': must be an integer >= 0"),
    (["eval.ratios=[0]"], "eval.ratios=[0]: eval.ratios[0]=0: must be > 0"),
    (["eval.ratios=[1,-2]"], "eval.ratios=[1, -2]: eval.ratios[1]=-2: must be > 0"),
    (["eval.ratios=[]"], "eval.ratios=[]: must be a non-empty list of numbers"),
    (["eval.ratios=[0.01,1]"], "eval.ratios=[0.01, 1]: [0.01] x train.length=16 rounds to length 0"),
    (["eval.lengths=[]"], "eval.lengths=[]: must be a non-empty list of integers, or null (use eval.ratios)"),
    (["eval.lengths=[0,4]"], "eval.lengths=[0, 4]: eval.lengths[0]=0: must be >= 1"),
    (["eval.chunk=0"], "eval.chunk=0 is not valid"),
    (["model.n_heads=0"], "model.n_heads=0: must be >= 1"),
    (["model.d_model=30", "model.n_heads=4"], "model.d_model=30 is not divisible by model.n_heads=4"),
    (["model.d_model=wide"], "model.d_model='wide': must be an integer >= 1"),
    (["model.n_layers=0"], "model.n_layers=0: must be >= 1"),
    (["model.mlp_ratio=1.5"], "model.mlp_ratio=1.5: must be an integer >= 1"),
    (["model.dropout=1"], "model.dropout=1: must be in [0, 1)"),
    (["model.causal=maybe"], "model.causal='maybe': must be true or false"),
    (["model.activation=tanh"], "model.activation='tanh' is not valid; choose one of ['gelu', 'relu']"),
    (["model.norm=batchnorm"], "model.norm='batchnorm' is not valid; choose one of ['layernorm', 'rmsnorm']"),
    (["model.bias=no"], "model.bias='no': must be true or false"),
    (["train.schedule=step"], "train.schedule='step' is not valid; choose one of ['cosine', 'linear']"),
    (["encoding=t5", "encoding.max_distance=16"], "t5: encoding.max_distance=16: must be > 16"),
    (["encoding=t5", "encoding.max_distance=8", "encoding.bidirectional=true"], "encoding.max_distance=8: must be > 8"),
    (["encoding=t5", "encoding.num_buckets=1"], "t5: encoding.num_buckets=1: must be >= 2"),
    (["encoding=t5", "encoding.bucketed=no"], "t5: encoding.bucketed='no': must be true or false"),
    (["encoding=rope", "encoding.base=0"], "rope: encoding.base=0: must be > 1"),
    (["encoding=rope", "encoding.scaling=pi", "encoding.scaling_factor=0.5"], "encoding.scaling_factor=0.5: must be >= 1"),
    (["encoding=xpos", "encoding.scale_base=-1"], "xpos: encoding.scale_base=-1: must be > 0"),
    (["encoding=kerple", "encoding.variant=cubic"], "kerple: encoding.variant='cubic' is not valid; choose one of"),
    (["encoding=fire", "encoding.init_c=0"], "fire: encoding.init_c=0: must be > 0"),
    (["encoding=sandwich", "encoding.dim=3"], "sandwich: encoding.dim=3"),
    (["encoding=shaw", "encoding.max_relative_position=0"], "shaw: encoding.max_relative_position=0: must be >= 1"),
    (["encoding=floater", "encoding.substeps=many"], "floater: encoding.substeps='many': must be an integer >= 1"),
    (["encoding=sinusoidal", "encoding.base=-1"], "sinusoidal: encoding.base=-1: must be > 0"),
    (["encoding=learned", "encoding.init_std=-1"], "learned: encoding.init_std=-1: must be >= 0"),
    (["task.symbols=1"], "copy: task.symbols=1: must be >= 2"),
    (["task.symbols=abc"], "copy: task.symbols='abc': must be an integer >= 2"),
    (["task.bos=maybe"], "copy: task.bos='maybe': must be true or false"),
    (["task.eos=maybe"], "copy: task.eos='maybe': must be true or false"),
    (["task=sort", "task.eos=1"], "sort: task.eos=1: must be true or false"),
    (["task=lego", "task.variables=0"], "lego: task.variables=0: must be >= 1"),
    (["task=summation", "task.modulus=x"], "summation: task.modulus='x': must be an integer >= 2"),
    (["task=passkey", "task.digits=0"], "passkey: task.digits=0: must be >= 1"),
    (["task=lego", "task.variables=8", "task.default_length=4", "eval.ratios=[1,4]"],
     "length 16 needs 16 distinct variables but task.variables=8"),
    # a key the built class does not take: left by another choice, or a typo added with +
    (["experiment=kazemnejad_copy", "kazemnejad_pe=pe_rotary", "encoding=t5", "debug=smoke"],
     "encoding.rotary_fraction is not a parameter of posbench.encodings.t5.T5; its parameters: "
     "['bidirectional', 'bucketed', 'max_distance', 'num_buckets']"),
    (["+task.symbol=4"], "task.symbol is not a parameter of tasks.copy.Copy; its parameters: ['bos', 'causal', "),
    (["+model.layers=4"], "model.layers is not a model setting; the settings: ['activation', 'bias', 'causal', "),
    # every section's keys are declared (posbench.settings): a typo added with + is named with the nearest key
    (["+train.stepz=5"], "train.stepz is not a train setting; the settings: ['batch_size', "),
    (["+eval.sample=4"], "eval.sample is not an eval setting; the settings: ['batch_size', 'chunk', 'lengths', "
                         "'memory_limit', 'ratios', 'samples', 'seed']; did you mean eval.samples?"),
    (["+sed=4"], "sed is not a setting; the settings: ['backend', 'device', "),
    (["logger=wandb", "logger.tags=notalist"], "logger.tags='notalist': must be a list of strings, e.g. [a,b]"),
    (["logger=wandb", "logger.mode=loud"], "logger.mode='loud' is not valid; choose one of ['online', 'offline', "),
    (["backend.name=fast"], "backend.name='fast' is not valid; choose one of ['auto', 'eager', 'fla', 'flex', 'sdpa']"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_setting_is_refused_before_training(overrides, message, no_training, tmp_path):
    assert message in str(refused(run, compose_cfg(*TINY, *overrides), tmp_path / "run"))
    assert not (tmp_path / "run" / "results.jsonl").exists()


# threads and device, checked before run() applies them (and by build() for the benchmark scripts)
@pytest.mark.parametrize("override,message", [
    ("threads=0", "threads=0: must be in [1, "),
    ("threads=abc", "threads='abc': must be an integer in [1, "),
    ("device=gpu", "device='gpu' is not valid; choose one of ['auto', 'cpu', 'cuda', 'cuda:<index>']"),
    ("device=cuda:x", "device='cuda:x' is not valid"),
])
def test_bad_threads_and_device_are_refused_by_build(override, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build(compose_cfg(*TINY, override), torch.device("cpu"))


def test_wikitext_without_its_evaluation_split_fails_before_training(no_training, tmp_path):
    data = write_wikitext_release(tmp_path / "data", splits=("train",))
    cfg = compose_cfg(*TINY, "task=wikitext", f"task.data_dir={data}", "task.cache_dir=null")
    with pytest.raises(DataUnavailableError, match=r"task.data_dir=.* has no wiki.valid.tokens"):
        run(cfg, tmp_path / "run")


@pytest.mark.parametrize("override,message", [
    ("task.eval_tokens=40", "the evaluation range has 40 tokens, fewer than the window length 128; raise task.eval_tokens"),
    ("task.train_tokens=40", "the training split has 40 tokens, fewer than a window of 65; lower train.length"),
])
def test_wikitext_shorter_than_a_window_fails_before_training(override, message, no_training, tmp_path):
    data = write_wikitext_release(tmp_path / "data")
    cfg = compose_cfg(*TINY, "task=wikitext", f"task.data_dir={data}", "task.cache_dir=null", override)
    with pytest.raises(ValueError, match=re.escape(message)):
        run(cfg, tmp_path / "run")


def test_building_draws_no_numbers_from_the_run(tmp_path):
    """check_built's draws use their own generators: the run's results do not depend on it."""
    cfg = compose_cfg(*TINY, "train.steps=3", "eval.samples=4")
    with mock.patch("posbench.build.check_built"):  # where build() looks it up
        skipped = run(cfg, tmp_path / "skipped")
    checked = run(cfg, tmp_path / "checked")
    assert [r["loss"] for r in checked] == [r["loss"] for r in skipped]


# --- property: random overrides, good ones run, bad ones are named ---------------------------------

SETTINGS = {  # key -> (good values, bad values) on the tiny job below
    "seed": ([0, 5], [-1, "s", 10**30]),
    "threads": ([1], [0, -1, "abc"]),
    "device": (["cpu"], ["gpu", "cuda:x"]),
    "train.length": ([1, 3], [0, -4, "n", 2.5]),
    "train.lengths": (["uniform", "fixed"], ["sometimes"]),
    "train.steps": ([0, 1, 3], [-1, "abc", True, 2.5, 10**30]),
    "train.batch_size": ([1, 4], [0, -3, "x", False]),
    "train.lr": ([1e-3, 0.1], [0, -1e-3, "fast", float("inf")]),
    "train.warmup_steps": ([0, 1, 50], [-1, "w"]),
    "train.min_lr_ratio": ([0, 0.5, 1], [-5, 1.5, 1e9, "low"]),
    "train.weight_decay": ([0, 0.01], [-0.1, "none"]),
    "train.grad_clip": ([0.5, 100], [0, -1, "clip"]),
    "train.log_every": ([1, 2, 1000], [0, -2, "often"]),
    "train.compile": ([False], ["maybe", 0]),
    "train.positions": (["sequential", "randomized"], ["shuffled"]),
    "train.max_position": ([None, 64], [0, -1, "far"]),
    "eval.ratios": ([[1], [1, 2], [1.5]], [[0], [], [1, -2], "abc"]),
    "eval.samples": ([1, 4], [0, -1, "all"]),
    "eval.batch_size": ([1, 3], [0, "x"]),
    "eval.seed": ([0, 7], [-1, "s", 10**30]),
    "eval.chunk": (["auto", 1, None], [0, -1, "x"]),
    "model.d_model": ([8, 16], [0, -8, "wide"]),
    "model.n_heads": ([1, 2], [0, -2, "h"]),
    "model.n_layers": ([1, 2], [0, "deep"]),
    "model.mlp_ratio": ([1, 2], [0, 1.5]),
    "model.dropout": ([0.0, 0.1], [1, -0.1, "d"]),
    "model.causal": ([True, False], ["maybe", 1]),
    "model.activation": (["gelu", "relu"], ["tanh"]),
    "model.norm": (["layernorm", "rmsnorm"], ["batchnorm"]),
    "model.bias": ([True, False], ["maybe", 0]),
    "train.schedule": (["cosine", "linear"], ["step"]),
    "encoding.num_buckets": ([8, 32], [1, 0, "b"]),
    "encoding.max_distance": ([20, 128], [0, -3, 2]),  # 2: not past the exact buckets of 8 or 32
    "task.symbols": ([2, 10], [1, "s", True]),
}
PROPERTY_JOB = ("encoding=t5", "task=copy", "model=tiny", "threads=1", "device=cpu", "train.steps=3",
                "train.batch_size=4", "train.warmup_steps=1", "train.log_every=1", "train.length=4",
                "train.save_checkpoint=false", "eval.samples=4", "eval.batch_size=4", "eval.ratios=[1,2]")


def hydra_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


@st.composite
def draws(draw):
    """{key: (value, is_bad)} for 1 to 4 keys; each value good or bad by a coin."""
    keys = draw(st.permutations(sorted(SETTINGS)))[:draw(st.integers(1, 4))]
    chosen = {}
    for key in keys:
        bad = draw(st.booleans())
        chosen[key] = (draw(st.sampled_from(SETTINGS[key][bad])), bad)
    return chosen


@settings(max_examples=40, deadline=None, derandomize=True)  # ~20 s on one core
@given(draws())
def test_random_overrides_run_or_are_named(chosen):
    overrides = [f"{key}={hydra_value(value)}" for key, (value, _) in chosen.items()]
    bad_keys = [key for key, (_, bad) in chosen.items() if bad]
    cfg = compose_cfg(*PROPERTY_JOB, *overrides)
    with tempfile.TemporaryDirectory() as folder:
        if not bad_keys:
            rows = run(cfg, Path(folder) / "run")
            assert rows and {row["status"] for row in rows} <= {"ok", "diverged"}
            assert (Path(folder) / "run" / "results.jsonl").read_text().count("\n") == len(rows)
            return
        started = AssertionError(f"training started despite {bad_keys}")
        with mock.patch.object(runner, "train", side_effect=started):
            message = str(refused(run, cfg, Path(folder) / "run"))
    assert any(f"{key}=" in message for key in bad_keys), (overrides, message)
