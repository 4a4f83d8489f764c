"""The paper presets (configs/experiment/kazemnejad_copy, ruoss_chomsky, alibi_wikitext103): each composes
with its paper's values, and a smoke run of two of its sweep points goes through posbench.runner.run.

A preset picks its paper's model preset (configs/model/); `debug=smoke`, applied after it, shrinks the
model's sizes and keeps its layout, as a user trying a preset on a CPU does."""
import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from posbench.build import build
from posbench.runner import run
from tests.helpers import CONFIGS, compose_cfg

ROOT = Path(__file__).resolve().parent.parent
WIKITEXT_2 = Path(os.environ.get("POSBENCH_WIKITEXT_DIR") or ROOT.parent / "shared" / "data" / "wikitext-2")


def sweep(experiment: str) -> dict[str, list[str]]:
    """The preset's hydra.sweeper.params, each as its list of values."""
    params = yaml.safe_load((CONFIGS / "experiment" / f"{experiment}.yaml").read_text())["hydra"]["sweeper"]["params"]
    return {key: str(values).split(",") for key, values in params.items()}


def smoke(tmp_path: Path, experiment: str, points: list[dict[str, str]], *overrides: str) -> list[list[dict]]:
    """Runs each sweep point of the preset with debug=smoke and the overrides; -> the rows of each."""
    results = []
    for i, point in enumerate(points):
        cfg = compose_cfg(f"experiment={experiment}", "debug=smoke", *overrides,
                          *(f"{key}={value}" for key, value in point.items()))
        rows = run(cfg, tmp_path / str(i))
        assert rows and all(row["status"] == "ok" for row in rows), rows
        assert all(json.loads(line) for line in (tmp_path / str(i) / "results.jsonl").read_text().splitlines())
        results.append(rows)
    return results


def test_kazemnejad_copy_holds_the_papers_protocol():
    cfg = compose_cfg("experiment=kazemnejad_copy")
    assert cfg.task._target_ == "tasks.copy.Copy" and (cfg.task.variant, cfg.task.repeat, cfg.task.symbols) == \
        ("cmc", 1, 100)
    assert cfg.task.eos is True  # their generation must stop after the answer, so the EOS is scored
    assert dict(cfg.model) == {"d_model": 768, "n_layers": 12, "n_heads": 12, "mlp_ratio": 4, "causal": True,
                               "dropout": 0.1, "activation": "relu", "norm": "rmsnorm", "bias": False,
                               "norm_position": "pre", "embed_scale": False, "window": None}
    train = cfg.train
    assert (train.length, train.lengths, train.steps, train.batch_size) == (20, "uniform", 40000, 64)
    assert (train.lr, train.warmup_steps, train.weight_decay) == (3e-5, 2400, 0.05)
    assert train.schedule == "linear" and train.lr * train.min_lr_ratio == pytest.approx(1e-7)  # HF's lr_end
    assert list(cfg.eval.lengths) == list(range(1, 41))
    assert sweep("kazemnejad_copy") == {"kazemnejad_pe": ["pe_none", "pe_t5", "pe_alibi", "pe_rotary", "pe_abs_sin"],
                                        "seed": ["0", "1", "2"]}
    model = build(cfg, torch.device("cpu")).model
    layers = sum(p.numel() for name, p in model.named_parameters() if name.startswith("blocks."))
    # T5-base's 12 decoder layers without cross-attention: q, k, v, o, the feed-forward's two matrices and two
    # RMSNorm weights, no biases: ~85M (+ their 24.7M vocabulary)
    assert layers == 12 * (4 * 768 * 768 + 2 * 768 * 3072 + 2 * 768) == 84_953_088


KAZEMNEJAD_PE = {"pe_none": "nope", "pe_t5": "t5", "pe_alibi": "alibi", "pe_rotary": "rope", "pe_abs_sin": "sinusoidal"}


def test_kazemnejad_copy_encodings_are_theirs_and_only_pe_rotary_rotates_a_quarter():
    """Each swept name selects its posbench encoding at its defaults, except pe_rotary: their rotary,
    rotary_dim = int(0.25 * d_head) in src/models/custom_t5_decoder_only.py, pairs interleaved."""
    for name, encoding in KAZEMNEJAD_PE.items():
        cfg = compose_cfg("experiment=kazemnejad_copy", f"kazemnejad_pe={name}")
        default = compose_cfg("experiment=kazemnejad_copy", f"encoding={encoding}").encoding
        if name != "pe_rotary":
            assert cfg.encoding == default, name
            continue
        assert cfg.encoding == {**default, "rotary_fraction": 0.25, "layout": "interleaved"}
        assert build(cfg, torch.device("cpu")).encoding.rotary_dim == 16  # of d_head 64
    assert compose_cfg("experiment=kazemnejad_copy").encoding.rotary_fraction == 1.0  # no name: posbench's rope


def test_kazemnejad_copy_publishes_the_rope_number_for_their_partial_rotary_only():
    from omegaconf import OmegaConf

    from posbench import published
    from posbench.runinfo import flatten

    def numbers(*overrides):
        cfg = compose_cfg("experiment=kazemnejad_copy", *overrides)
        flat = flatten(OmegaConf.to_container(cfg, resolve=True))
        return [r.values["rope"] for r in published.parse(cfg.published)
                if "rope" in r.values and r.applies("copy", flat)]

    assert numbers("kazemnejad_pe=pe_rotary") == [0.011]
    assert numbers("kazemnejad_pe=pe_rotary", "task.repeat=2") == [0.043]
    assert numbers("encoding=rope") == [] and numbers("kazemnejad_pe=pe_rotary", "encoding.rotary_fraction=0.5") == []
    assert numbers("kazemnejad_pe=pe_rotary", "task.eos=false") == []  # their numbers score the stop as well


def test_ruoss_chomsky_holds_the_papers_protocol():
    cfg = compose_cfg("experiment=ruoss_chomsky")
    assert dict(cfg.model) == {"d_model": 64, "n_layers": 5, "n_heads": 8, "mlp_ratio": 4, "causal": False,
                               "dropout": 0.1, "activation": "relu", "norm": "layernorm", "bias": True,
                               "norm_position": "post", "embed_scale": True, "window": None}
    train = cfg.train
    assert (train.length, train.lengths, train.batch_size, train.max_position) == (40, "uniform", 128, 2048)
    assert (train.lr, train.weight_decay, train.grad_clip, train.min_lr_ratio) == (1e-3, 0.0, 1.0, 1.0)
    assert list(cfg.eval.lengths) == list(range(1, 501)) and cfg.eval.samples == 512
    points = sweep("ruoss_chomsky")
    assert points["train.positions"] == ["sequential", "randomized"] and points["seed"] == ["0", "1", "2"]
    assert set(points["encoding"]) == {"nope", "sinusoidal", "learned", "transformer_xl", "rope", "alibi"}
    for task in points["task"]:  # every swept task exists, in the encoder layout, at the paper's longest length
        task_cfg = compose_cfg("experiment=ruoss_chomsky", f"task={task}")
        built = build(task_cfg, torch.device("cpu"))
        assert built.task.causal is False and built.task.sequence_length(500) <= 2048  # randomized: L = 2048


def test_alibi_wikitext103_holds_the_papers_protocol():
    cfg = compose_cfg("experiment=alibi_wikitext103")
    task = cfg.task
    assert (task._target_, task.dataset, task.tokenizer, task.default_length) == \
        ("tasks.wikitext.WikiText", "wikitext-103-v1", "word", 512)
    assert task.eval_tokens is None and task.stride is None  # the whole validation split; sliding by L // 4
    assert task.data_dir == os.environ.get("POSBENCH_WIKITEXT_DIR")  # the hub unless a local copy is named
    assert dict(cfg.model) == {"d_model": 1024, "n_layers": 16, "n_heads": 8, "mlp_ratio": 4, "causal": True,
                               "dropout": 0.3, "activation": "relu", "norm": "layernorm", "bias": True,
                               "norm_position": "pre", "embed_scale": False, "window": None}
    train = cfg.train
    assert (train.length, train.lengths, train.steps, train.batch_size) == (512, "fixed", 286000, 18)
    assert (train.warmup_steps, train.grad_clip) == (16000, 0.1)
    assert list(cfg.eval.lengths) == [512, 1012, 2512]
    assert sweep("alibi_wikitext103") == {"encoding": ["alibi", "sinusoidal", "rope", "t5"]}


def test_debug_smoke_shrinks_a_preset_and_keeps_its_layout():
    for experiment, causal in (("kazemnejad_copy", True), ("ruoss_chomsky", False), ("alibi_wikitext103", True)):
        cfg = compose_cfg(f"experiment={experiment}", "debug=smoke")
        assert (cfg.model.d_model, cfg.model.n_layers, cfg.train.steps, cfg.train.batch_size) == (16, 1, 20, 16)
        assert cfg.model.causal is causal
        paper = compose_cfg(f"experiment={experiment}").model
        assert all(cfg.model[key] == paper[key] for key in ("activation", "norm", "bias"))  # the paper's layer


def test_kazemnejad_copy_smoke_and_its_published_numbers_in_the_report(tmp_path):
    import pandas as pd

    from posbench.report import write_report

    rows = smoke(tmp_path, "kazemnejad_copy", [{"kazemnejad_pe": "pe_none", "seed": "0"},
                                               {"kazemnejad_pe": "pe_rotary", "seed": "2"}], "eval.lengths=[20,30,40]")
    assert rows[1][0]["encoding_params"]["rotary_fraction"] == 0.25  # debug=smoke: 2 of d_head 8 rotate
    for encoding, runs in zip(("nope", "rope"), rows):
        assert [r["eval_length"] for r in runs] == [20, 30, 40] and {r["encoding"] for r in runs} == {encoding}
        assert runs[0]["task_params"] == {"symbols": 100, "variant": "cmc", "repeat": 1, "eos": True, "bos": True,
                                          "causal": True}
    out = write_report([str(tmp_path / "0"), str(tmp_path / "1")], tmp_path / "report")
    table = pd.read_csv(out / "published.csv").set_index("encoding")
    assert table.loc["nope", "published"] == 0.305 and table.loc["rope", "published"] == 0.011  # cmc, not rsc's
    assert table.loc["rope", "setting"] == "task.eos=True, task.variant=cmc, task.repeat=1, encoding.rotary_fraction=0.25"
    for encoding, runs in zip(("nope", "rope"), rows):  # the mean over the evaluated lengths in 21..40: 30 and 40
        mean = (runs[1]["exact_match"] + runs[2]["exact_match"]) / 2
        assert table.loc[encoding, "posbench_mean"] == pytest.approx(mean)
        assert table.loc[encoding, "difference"] == pytest.approx(mean - table.loc[encoding, "published"])
        assert (table.loc[encoding, "lengths_measured"], table.loc[encoding, "lengths_in_range"]) == (2, 20)
    report = (out / "report.md").read_text()
    assert "## Published numbers: Kazemnejad et al. (NeurIPS 2023)" in report and "21–40 (2 of 20 measured)" in report


def test_ruoss_chomsky_smoke(tmp_path):
    rows = smoke(tmp_path, "ruoss_chomsky", [
        {"task": "even_pairs", "encoding": "rope", "train.positions": "randomized", "seed": "0"},
        {"task": "bucket_sort", "encoding": "alibi", "train.positions": "sequential", "seed": "1"},
    ], "eval.lengths=[40,80]", "eval.samples=16")
    assert [r["positions"] for r in (rows[0][0], rows[1][0])] == ["randomized", "sequential"]
    assert rows[0][0]["max_position"] == 2048 and rows[0][0]["task_params"]["causal"] is False
    assert [r["eval_length"] for r in rows[1]] == [40, 80]


@pytest.mark.skipif(not any((WIKITEXT_2 / name).exists() for name in ("wiki.train.tokens", "wiki.train.tokens.xz")),
                    reason=f"no local WikiText-2 release in {WIKITEXT_2} (set POSBENCH_WIKITEXT_DIR); the smoke run "
                           "must not download")
@pytest.mark.slow
def test_alibi_wikitext103_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rows = smoke(tmp_path, "alibi_wikitext103", [{"encoding": "alibi"}, {"encoding": "sinusoidal"}],
                 f"task.data_dir={WIKITEXT_2}", "task.dataset=wikitext-2-v1", f"task.cache_dir={tmp_path / 'cache'}",
                 "task.eval_tokens=256", "train.length=32", "train.batch_size=4", "train.precision=fp32",
                 "eval.lengths=[32,64]")
    for runs in rows:
        assert [r["eval_length"] for r in runs] == [32, 64]
        assert runs[0]["task_params"]["tokenizer"] == "word" and runs[0]["task_params"]["data_dir"] == str(WIKITEXT_2)
        assert all(r["perplexity"] > 1 and r["sliding_perplexity"] > 1 for r in runs)
