"""One declared schema of the settings (posbench.settings): the YAMLs, validation, ModelConfig, the config
hash's added settings and --help agree with it; tasks declare their metrics in one table (posbench.metrics)."""
import dataclasses
import typing

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from posbench import metrics, settings
from posbench.model import ACTIVATIONS, ModelConfig
from posbench.runinfo import ADDED_SETTINGS
from posbench.settings import BY_KEY, SECTIONS, SETTINGS
from posbench.validate import check_config
from tasks import REGISTRY as TASKS
from tests.helpers import CONFIGS, compose_cfg, options, posbench, write_wikitext_release

GROUPS = ("encoding", "task", *SECTIONS)


def declared_keys(cfg) -> set[str]:
    """The setting keys of a composed config: every key outside encoding and task, dotted."""
    keys = {key for key in cfg if key not in GROUPS}
    keys |= {f"{section}.{leaf}" for section in SECTIONS for leaf in cfg[section]}
    return keys


def test_every_setting_of_the_yamls_is_declared_and_every_declared_one_is_in_them():
    assert declared_keys(compose_cfg()) == {s.key for s in SETTINGS if not s.option}
    assert declared_keys(compose_cfg("logger=wandb")) == {s.key for s in SETTINGS if s.option != "none"}


def test_the_declared_defaults_are_the_yamls():
    files = {None: "config.yaml", "train": "train/default.yaml", "eval": "eval/default.yaml",
             "model": "model/small.yaml", "backend": "backend/auto.yaml", "logger": "logger/wandb.yaml"}
    written = {}
    for section, name in files.items():
        loaded = OmegaConf.to_container(OmegaConf.load(CONFIGS / name))  # as Hydra reads it: 1e-3 a float
        written |= {(f"{section}.{k}" if section else k): v for k, v in loaded.items() if k != "defaults"}
    written["logger.name"] = OmegaConf.load(CONFIGS / "logger/none.yaml").name
    assert written == {s.key: s.default for s in SETTINGS}


@pytest.mark.parametrize("group", ["experiment", "model", "logger", "backend", "debug", "kazemnejad_pe",
                                   "study_task", "task_train"])
def test_every_option_sets_only_declared_settings(group):
    for option in options(group):
        overrides = {"task_train": [f"task={option}"], "kazemnejad_pe": ["experiment=kazemnejad_copy", f"{group}={option}"],
                     "study_task": ["experiment=scale_study", f"{group}={option}"]}.get(group, [f"{group}={option}"])
        if group == "task_train" and option == "wikitext":
            continue  # its data: test_configs builds it
        check_config(compose_cfg(*overrides))


BAD_VALUES = {"Integer": "x", "Real": "x", "Flag": "maybe", "Choice": "bogus", "Text": [1], "Items": "notalist",
              "Device": "gpu", "Resume": "maybe", "Chunk": 0, "Window": 0, "Published": 5, "Compile": "sometimes"}


@pytest.mark.parametrize("key", [s.key for s in SETTINGS])
def test_every_declared_setting_is_validated(key):
    cfg = compose_cfg("logger=wandb")
    with open_dict(cfg):
        OmegaConf.update(cfg, key, BAD_VALUES[type(BY_KEY[key].rule).__name__], force_add=True)
    with pytest.raises(ValueError, match=f"^{key}="):
        check_config(cfg)


def test_model_config_fields_are_the_model_settings():
    fields = dataclasses.fields(ModelConfig)
    types = typing.get_type_hints(ModelConfig)
    model = settings.section("model")
    assert [f.name for f in fields] == ["vocab_size", *[s.name for s in model]]
    assert types["vocab_size"] is int and fields[0].default is dataclasses.MISSING
    assert {f.name: f.default for f in fields[1:]} == {s.name: s.default for s in model}
    assert {f.name: types[f.name] for f in fields[1:]} == {s.name: s.type for s in model}
    assert tuple(ACTIVATIONS) == settings.ACTIVATION_NAMES


def test_the_choices_equal_the_registries():
    from posbench.attention import BACKENDS
    from posbench.hooks import BACKEND_NAMES
    from posbench.positions import SCHEMES

    assert sorted(BACKENDS) == sorted(BACKEND_NAMES)  # a backend class for each declared name
    assert settings.POSITION_SCHEMES == SCHEMES


def test_added_settings_derive_from_the_schema():
    assert ADDED_SETTINGS == settings.added_settings()
    assert {k: v for k, v in ADDED_SETTINGS.items() if k in BY_KEY} == {s.key: s.before for s in SETTINGS if s.added}
    # the table as it stood before the schema: changing it changes the hash of committed runs
    assert ADDED_SETTINGS == {"model.activation": "gelu", "model.norm": "layernorm", "model.bias": True,
                              "model.norm_position": "pre", "model.embed_scale": False, "model.window": None,
                              "train.schedule": "cosine", "encoding.rotary_fraction": 1.0,
                              "encoding.frequency_fraction": 1.0, "encoding.frequency_cut": "none",
                              "encoding.short_factors": None, "encoding.long_factors": None,
                              "encoding.start_positions": 0, "encoding.scale_base": None, "task.eos": False,
                              "encoding.k_shift": False, "encoding.v_shift": False, "encoding.resonance": False}
    for s in SETTINGS:  # the default job is the one before the setting existed
        if s.added:
            assert s.default == s.before, s.key


@pytest.mark.parametrize("overrides,message", [
    (["+train.stepz=5"], "train.stepz is not a train setting; the settings: ["),
    (["+eval.sample=4"], "eval.sample is not an eval setting; the settings: ["),
    (["+sed=3"], "sed is not a setting; the settings: ["),
    (["+logger.project=x"], "logger.project is a setting of logger=wandb, not of logger=none"),
])
def test_unknown_keys_added_with_plus_are_refused_naming_the_nearest(overrides, message):
    with pytest.raises(ValueError, match="^" + message.replace("[", r"\[")) as refused:
        check_config(compose_cfg(*overrides))
    nearest = {"+train.stepz=5": "did you mean train.steps?", "+eval.sample=4": "did you mean eval.samples?",
               "+sed=3": "did you mean seed?"}.get(overrides[0], "")
    assert str(refused.value).endswith(nearest)


@pytest.mark.parametrize("value,message", [
    ("notalist", "logger.tags='notalist': must be a list of strings, e.g. [a,b]"),
    ("[a,[b]]", "logger.tags=['a', ['b']]: logger.tags[1]=['b']: must be a string"),
])
def test_lists_are_checked_as_lists(value, message):
    with pytest.raises(ValueError, match="^" + message.replace("[", r"\[").replace("]", r"\]")):
        check_config(compose_cfg("logger=wandb", f"logger.tags={value}"))
    check_config(compose_cfg("logger=wandb", "logger.tags=[a,b]"))
    check_config(compose_cfg("logger=wandb", "logger.tags=[]"))


def test_help_has_usage_common_overrides_experiments_report_and_every_setting():
    text = posbench("--help").stdout
    assert text.startswith("posbench: ") and "Usage:\n  python -m posbench [" in text
    assert "python -m posbench.report DIR" in text and "Common overrides:" in text
    for name in options("experiment"):
        assert f"experiment={name} " in text, name
    for s in SETTINGS:
        assert f"  {s.key}=" in text, s.key
    assert "  train.steps=10000 " in text and "Hydra" not in text.split("\n")[0]


def test_settings_help_shows_defaults_and_rules():
    text = settings.settings_help()
    entry = text[text.index("  eval.ratios="):text.index("  eval.lengths=")]
    assert entry.split()[0] == "eval.ratios=[0.5,1,1.5,2,3,4]" and "list of numbers > 0" in " ".join(entry.split())


# --- metrics -----------------------------------------------------------------------------------------

def test_headline_metrics_keep_their_names_and_order():
    from posbench.headline import HEADLINE_METRICS, HIGHER_IS_BETTER, LOWER_IS_BETTER
    from posbench.loggers import EVAL_KEYS
    from posbench.results import METRIC_LABELS, METRICS

    assert HIGHER_IS_BETTER == ("exact_match", "token_acc", "sliding_token_acc", "recurrent_token_acc")
    assert LOWER_IS_BETTER == ("loss", "perplexity", "bits_per_byte", "sliding_loss", "sliding_perplexity",
                               "sliding_bits_per_byte", "recurrent_loss", "recurrent_perplexity",
                               "recurrent_bits_per_byte")
    assert HEADLINE_METRICS == tuple(metrics.METRICS) == (*HIGHER_IS_BETTER, *LOWER_IS_BETTER) or \
        set(HEADLINE_METRICS) == set(metrics.METRICS)
    assert set(EVAL_KEYS) >= set(metrics.METRICS) and METRICS == ("exact_match", "token_acc", "loss")
    assert set(METRIC_LABELS) == set(metrics.METRICS)
    assert set(metrics.PRIMARY_METRICS) <= set(metrics.METRICS) and set(metrics.TABLE_METRICS) <= set(metrics.METRICS)


def test_every_task_declares_metrics_of_the_table():
    for name, cls in TASKS.items():
        assert cls.metrics and set(cls.metrics) <= set(metrics.METRICS), name


def measured(task, length: int) -> set[str]:
    """The metrics a task's evaluation reports (not None) at one length, from random logits."""
    generator = torch.Generator().manual_seed(0)
    totals = {}
    for batch in task.eval_batches(length, 4, 4, generator):
        logits = torch.randn(*batch.inputs.shape, task.vocab_size, generator=generator)
        for key, value in task.batch_sums(logits, batch).items():
            totals[key] = totals.get(key, 0.0) + float(value)
    return {key for key, value in task.finalize(totals).items() if key in metrics.METRICS and value is not None}


@pytest.mark.parametrize("name", ["copy", "passkey", "life"])
def test_a_task_measures_what_it_declares(name):
    task = TASKS[name]()
    assert measured(task, task.default_length) == set(task.metrics)


def test_wikitext_measures_what_it_declares(tmp_path):
    data = write_wikitext_release(tmp_path / "data")
    task = TASKS["wikitext"](data_dir=str(data), cache_dir=None, memory=8, eval_tokens=200, stride=32)
    assert measured(task, 64) == set(task.metrics)
