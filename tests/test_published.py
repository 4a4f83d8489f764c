"""The `published` block (posbench/published.py): a paper's numbers that the report shows beside the runs'.
Malformed blocks are refused with the key named; every preset's block names real config keys and encodings."""
import pytest
import yaml
from omegaconf import OmegaConf

from posbench import published
from posbench.encodings import REGISTRY
from posbench.runinfo import flatten
from posbench.validate import check_config
from tests.helpers import CONFIGS, compose_cfg

BLOCK = {"source": "a paper", "metric": "exact_match", "lengths": [21, 40],
         "results": [{"match": {"task.variant": "cmc"}, "values": {"nope": 0.305, "t5": 0.42}},
                     {"match": {"task": "sort"}, "metric": "token_acc", "lengths": [8, 8], "values": {"rope": 1},
                      "note": "one length"}]}


def with_change(path: str, value):
    """BLOCK with the dotted path (list items by index) replaced; value None deletes the key."""
    block = yaml.safe_load(yaml.safe_dump(BLOCK))
    *parents, leaf = path.split(".")
    node = block
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    if value is None:
        del node[leaf]
    else:
        node[leaf] = value
    return block


def test_a_block_reads_as_its_entries():
    first, second = published.parse(OmegaConf.create(BLOCK))
    assert (first.metric, first.lengths, first.values, first.span()) == ("exact_match", (21, 40),
                                                                          {"nope": 0.305, "t5": 0.42}, "21–40")
    assert (second.metric, second.lengths, second.note, second.span()) == ("token_acc", (8, 8), "one length", "8")
    assert first.applies("copy", {"task.variant": "cmc"}) and not first.applies("copy", {"task.variant": "rsc"})
    assert not first.applies("sort", {})  # a key the run does not have never matches
    assert second.applies("sort", {}) and not second.applies("copy", {})
    assert published.parse(None) == []


@pytest.mark.parametrize("path, value, message", [
    ("metric", "accuracy", "published.results[0].metric='accuracy' is not valid; choose one of"),
    ("lengths", [40, 21], "published.results[0].lengths=[40, 21]: the first length must not exceed the last"),
    ("lengths", [21], "published.results[0].lengths=[21]: must be [first, last]"),
    ("lengths", [0, 4], "published.results[0].lengths[0]=0: must be >= 1"),
    ("results.0.values.nope", "high", "published.results[0].values.nope='high': must be a finite number"),
    ("results.0.values", {}, "published.results[0].values={}: must be a non-empty mapping"),
    ("results.0.match", ["task.variant"], "published.results[0].match=['task.variant']: must be a mapping"),
    ("results.1.lengths", [8, "x"], "published.results[1].lengths[1]='x': must be an integer"),
    ("results.1.colour", "red", "published.results[1]: unknown keys ['colour']"),
    ("results", [], "published.results=[]: must be a non-empty list"),
    ("source", None, "published.source=None: must be a non-empty string"),
    ("year", 2023, "published: unknown keys ['year']"),
])
def test_a_malformed_block_is_refused_with_its_key(path, value, message):
    with pytest.raises(ValueError) as err:
        published.parse(with_change(path, value))
    assert message in str(err.value)


def test_a_run_with_a_malformed_block_is_refused_before_training():
    cfg = compose_cfg("task=copy", "train.steps=1")
    OmegaConf.update(cfg, "published", with_change("lengths", [40, 21]), force_add=True)
    with pytest.raises(ValueError, match=r"published.results\[0\].lengths"):
        check_config(cfg)


def swept_encodings(experiment: str, swept: dict) -> set[str]:
    """The encodings a preset sweeps: its `encoding` values, or those its swept config group's options select
    (experiment=kazemnejad_copy sweeps kazemnejad_pe=pe_none,... each selecting an encoding)."""
    if "encoding" in swept:
        return set(str(swept["encoding"]).split(","))
    names = set()
    for group in (key for key in swept if (CONFIGS / key).is_dir()):
        for option in str(swept[group]).split(","):
            target = compose_cfg(f"experiment={experiment}", f"{group}={option}").encoding._target_
            names |= {name for name, cls in REGISTRY.items() if f"{cls.__module__}.{cls.__name__}" == target}
    return names


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml")
                                              if "published:" in p.read_text()))
def test_a_presets_block_names_real_settings_and_swept_encodings(experiment):
    """A typo in a match key (task.varient) or an encoding name would silently match nothing."""
    cfg = compose_cfg(f"experiment={experiment}")
    references = published.parse(cfg.published)
    assert references
    encodings = {p.stem for p in (CONFIGS / "encoding").glob("*.yaml")}
    swept = yaml.safe_load((CONFIGS / "experiment" / f"{experiment}.yaml").read_text())["hydra"]["sweeper"]["params"]
    tasks = set(str(swept["task"]).split(",")) if "task" in swept else {cfg.task._target_.split(".")[1]}
    preset_encodings = swept_encodings(experiment, swept)
    set_alone = {}  # (key, value) -> the preset's flattened config with that setting given
    for reference in references:
        assert set(reference.values) <= encodings, reference
        assert set(reference.values) <= preset_encodings, reference
        for key, value in reference.match.items():
            if key == "task":
                assert value in tasks, reference
                continue
            if (key, str(value)) not in set_alone:
                set_alone[key, str(value)] = flatten(OmegaConf.to_container(
                    compose_cfg(f"experiment={experiment}", f"{key}={value}"), resolve=True))
            flat = set_alone[key, str(value)]
            assert key in flat and flat[key] == value, (key, reference)
