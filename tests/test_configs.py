"""Every config composes with Hydra's compose API and builds; registries match config files."""
import copy
import functools

import pytest
import torch
import yaml

from posbench.build import build, eval_lengths
from posbench.encodings import REGISTRY as ENCODINGS
from tasks import REGISTRY as TASKS
from tests.helpers import CONFIGS, compose_cfg, options, write_wikitext_release


def test_encoding_configs_equal_the_registry():
    assert options("encoding") == sorted(ENCODINGS)


def test_task_configs_equal_the_registry():
    assert options("task") == sorted(TASKS)


@pytest.fixture(scope="module")
def wikitext_release(tmp_path_factory):
    """A small local WikiText release: build draws the run's data, and the hub is out of reach in tests."""
    return write_wikitext_release(tmp_path_factory.mktemp("wikitext"))


@functools.cache
def composed_task(task: str, *overrides: str):
    return compose_cfg(f"task={task}", *overrides)


@functools.cache
def composed_encoding(encoding: str):
    return compose_cfg(f"encoding={encoding}").encoding


def with_encoding(cfg, encoding: str):
    """`cfg` with the encoding group's node for `encoding`: what composing both gives, the two groups being
    independent (test_the_encoding_and_task_groups_compose_independently); a compose takes 70 ms, a pair's
    build 25."""
    cfg = copy.deepcopy(cfg)
    cfg.encoding = composed_encoding(encoding)
    return cfg


def test_the_encoding_and_task_groups_compose_independently(wikitext_release):
    """No file of either group has a defaults list or another package, so a pair composes to the task's config
    with the encoding's node: checked on pairs of each kind (a bias, a grid encoding, a causal-only one, an LM)."""
    for group in ("encoding", "task"):
        for path in sorted((CONFIGS / group).glob("*.yaml")):
            text = path.read_text()
            assert "@package" not in text and "defaults" not in yaml.safe_load(text), path
    data = [f"task.data_dir={wikitext_release}", "task.cache_dir=null"]
    for encoding, task, overrides in [("alibi", "wikitext", data), ("rope_2d", "life", []), ("fox", "sort", []),
                                      ("t5", "copy", []), ("cope", "passkey", [])]:
        composed = compose_cfg(f"encoding={encoding}", f"task={task}", *overrides)
        assert with_encoding(composed_task(task, *overrides), encoding) == composed, (encoding, task)


@pytest.mark.parametrize("encoding", options("encoding"))
@pytest.mark.parametrize("task", options("task"))
def test_every_encoding_and_task_builds(encoding, task, wikitext_release):
    data = [f"task.data_dir={wikitext_release}", "task.cache_dir=null"] if task == "wikitext" else []
    cfg = with_encoding(composed_task(task, *data), encoding)
    if ENCODINGS[encoding].position_dims == 2 and TASKS[task].position_dims == 1:  # (row, column) on a sequence
        with pytest.raises(ValueError, match=f"encoding {encoding} reads .* needs a grid task"):
            build(cfg, torch.device("cpu"))
        return
    if ENCODINGS[encoding].causal_only and not cfg.model.causal:  # a causal-only encoding in an encoder
        with pytest.raises(ValueError, match=f"{encoding}: .*set model.causal=true"):
            build(cfg, torch.device("cpu"))
        return
    built = build(cfg, torch.device("cpu"))
    assert built.encoding.name == encoding and built.task.name == task
    n = built.task.default_length
    assert built.train_length == n
    assert built.lengths == sorted({max(1, round(r * n)) for r in cfg.eval.ratios})


@pytest.mark.parametrize("group", ["model", "train", "eval", "logger", "backend"])
def test_every_option_of_every_group_composes(group):
    for option in options(group):
        cfg = compose_cfg(f"{group}={option}")
        assert cfg[group] is not None


def test_unknown_choice_lists_the_valid_ones():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match=r"(?s)encoding/bogus.*alibi.*rope"):
        compose_cfg("encoding=bogus")


def test_unknown_key_is_refused():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="bogus"):
        compose_cfg("train.bogus=1")


@pytest.mark.parametrize("overrides,message", [
    (["encoding=rope", "model.d_model=36", "model.n_heads=4"], "even head size"),
    (["encoding=sinusoidal", "model.d_model=33", "model.n_heads=1"], "even model size"),
    (["encoding=learned", "encoding.policy=error"], "policy=error"),
    (["model.d_model=30", "model.n_heads=4"], "not divisible"),
    (["train.lengths=sometimes"], "choose one of"),
    (["backend=sdpa", "encoding=rope", "eval.lengths=[0,4]"], "must be >= 1"),
    (["train.precision=fp16"], r"train.precision='fp16' is not valid; choose one of \['fp32', 'bf16'\]"),
    (["eval.chunk=0"], "eval.chunk=0 is not valid"),
    (["backend=flex", "encoding=alibi", "device=cpu"], "backend=flex trains on CUDA only"),
    (["backend=flex", "encoding=alibi", "train.compile=true"], "backend=flex cannot train inside a graph with dynamic"),
    (["backend=flex", "encoding=alibi", "train.compile=graphs"], "backend=flex trains on CUDA only"),  # fixed shapes
])
def test_invalid_combinations_fail_before_training(overrides, message):
    with pytest.raises(ValueError, match=message):
        build(compose_cfg(*overrides), torch.device("cpu"))


def test_eval_lengths_grid():
    cfg = compose_cfg("train.length=10", "eval.ratios=[0.5,1,2,8]")
    assert eval_lengths(cfg.eval, 10) == [5, 10, 20, 80]
    cfg = compose_cfg("eval.lengths=[40,3,3]")
    assert eval_lengths(cfg.eval, 16) == [3, 40]


def test_task_training_defaults_name_registered_tasks():
    assert set(options("task_train")) <= set(TASKS)


def test_task_training_defaults_apply_under_command_line_and_experiments():
    lm = compose_cfg("task=wikitext")
    assert (lm.train.lengths, lm.train.steps, lm.train.batch_size) == ("fixed", 2000, 32)
    copy = compose_cfg("task=copy").train
    assert (copy.steps, copy.lr, copy.min_lr_ratio) == (3500, 3e-3, 0.01)
    assert compose_cfg("task=sort").train.steps == 10000
    for experiment in ("scale_study", "synthetic_suite"):  # they pin the general defaults their rows trained with
        pinned = compose_cfg(f"experiment={experiment}", "task=copy").train
        assert (pinned.steps, pinned.lr, pinned.min_lr_ratio) == (10000, 1e-3, 0.1)
    assert compose_cfg("task=wikitext", "train.steps=7", "train.lengths=uniform").train.steps == 7
    assert compose_cfg("task=wikitext", "train.lengths=uniform").train.lengths == "uniform"
    assert compose_cfg("task=wikitext", "debug=smoke").train.steps == 20


def test_task_layout_must_match_the_model():
    cfg = compose_cfg("task=even_pairs", "model.causal=false", "task.causal=true")
    with pytest.raises(ValueError, match="task.causal=True but model.causal=False"):
        build(cfg, torch.device("cpu"))
    assert build(compose_cfg("task=even_pairs", "model.causal=false"), torch.device("cpu")).task.causal is False


@pytest.mark.parametrize("encoding", options("encoding"))
def test_encoding_yaml_defaults_equal_the_constructor_defaults(encoding):
    """Every constructor parameter is in the encoding's YAML, with the constructor's default: the YAML
    documents the encoding's settings, and `python -m posbench encoding=X` runs X's paper defaults."""
    import inspect

    import yaml

    written = {k: v for k, v in yaml.safe_load((CONFIGS / "encoding" / f"{encoding}.yaml").read_text()).items()
               if not k.startswith("_")}
    signature = inspect.signature(ENCODINGS[encoding].__init__).parameters
    defaults = {k: list(p.default) if isinstance(p.default, tuple) else p.default
                for k, p in signature.items() if k not in ("self", "dims")}
    assert written == defaults
