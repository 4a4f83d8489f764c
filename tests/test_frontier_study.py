"""experiment=frontier expands to the study the README reports: its methods, tasks and seeds, each job
composing to the intended encoding and task and passing the settings check."""
from pathlib import Path

import pytest
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser

from posbench.validate import check_config
from tests.helpers import assert_runs_compose_to_their_hashes, multirun_config, options, sweep_values

METHODS = {  # option: (encoding target, the encoding settings the option sets)
    "nope": ("nope.NoPE", {}), "rope": ("rope.RoPE", {"frequency_fraction": 1.0}),
    "alibi": ("alibi.ALiBi", {}), "fire": ("fire.FIRE", {}), "t5": ("t5.T5", {}),
    "fox": ("fox.FoX", {"rope": False}), "stick_breaking": ("stick_breaking.StickBreaking", {"remainder": "value"}),
    "cope": ("cope.CoPE", {"npos": None}), "dape": ("dape.DAPE", {"version": 1, "base": "kerple"}),
    "ssmax": ("composite.Composite", {"parts": ["rope", "ssmax"]}), "path": ("path.PaTH", {}),
    "p_rope": ("rope.RoPE", {"frequency_fraction": 0.75}),
    "rnope": ("schedule.Schedule", {"pattern": ["rope", "rope", "nope"]}),
    # the 2025-26 methods (issue 38)
    "grape_m": ("grape.GRAPE", {"form": "multiplicative"}), "grape_a": ("grape.GRAPE", {"form": "additive"}),
    "grape_ap": ("grape.GRAPE", {"form": "path"}), "pope": ("pope.PoPE", {}), "fope": ("fope.FoPE", {}),
    "scale_invariant": ("scale_invariant.ScaleInvariant", {}), "gated": ("gated.Gated", {"rope": True}),
    "selective": ("selective.Selective", {}), "cable": ("cable.CABLE", {}), "drope": ("drope.DroPE", {}),
    "string": ("string_rope.STRING", {}), "tape": ("tape.TAPE", {}),
}
TASKS = {  # option: (task target, N, task settings, the longest evaluated length)
    "copy": ("copy.Copy", 16, {"variant": "cmc", "eos": True}, 64),
    "flip_flop_sparse": ("frontier.FlipFlop", 32, {"p_ignore": 0.8, "eval_p_ignore": 0.98}, 128),
    "counting": ("frontier.Counting", 64, {}, 256),
    "wikitext": ("wikitext.WikiText", 64, {"tokenizer": "byte"}, 512),
}
STUDY = Path(__file__).resolve().parent.parent / "results" / "reference" / "frontier"
UNSWEPT_TASKS = {"flip_flop_dense", "selective_copy", "state_tracking", "mqar",  # options of the group, cut for
                 "passkey"}  # the budget; passkey run for TAPE and STRING by its own command (docs/studies.md)


def test_the_sweep_takes_every_method_four_tasks_and_three_seeds_seeds_outermost():
    params = multirun_config("experiment=frontier").hydra.sweeper.params
    assert sweep_values(params, "frontier_method") == sorted(METHODS) == options("frontier_method")
    assert sweep_values(params, "frontier_task") == sorted(TASKS)
    assert set(options("frontier_task")) == set(TASKS) | UNSWEPT_TASKS
    overrides = OverridesParser.create().parse_overrides([f"{key}={value}" for key, value in params.items()
                                                          if key != "frontier_method"])
    (jobs,) = BasicSweeper.split_arguments(overrides, None)
    assert len(jobs) == 3 * len(TASKS)
    assert [job[0] for job in jobs[::len(TASKS)]] == ["seed=0", "seed=1", "seed=2"]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_job_of_a_task_composes_to_its_method_and_passes_the_checks(task, monkeypatch, tmp_path):
    monkeypatch.setenv("POSBENCH_WIKITEXT_DIR", str(tmp_path))  # composing only: no data is read
    target, length, task_settings, longest = TASKS[task]
    for method, (encoding_target, encoding_settings) in METHODS.items():
        cfg = multirun_config("experiment=frontier", f"frontier_task={task}", f"frontier_method={method}")
        assert cfg.task._target_ == f"tasks.{target}" and cfg.encoding._target_ == f"posbench.encodings.{encoding_target}"
        assert {key: cfg.task[key] for key in task_settings} == task_settings
        assert {key: cfg.encoding[key] for key in encoding_settings} == encoding_settings
        assert (cfg.model.d_model, cfg.model.n_layers, cfg.threads, cfg.train.length) == (64, 3, 1, length)
        assert max(cfg.eval.ratios) * length == longest
        assert (cfg.train.steps, cfg.train.lr) == ((2000, 1e-3) if task == "wikitext" else (4000, 3e-3))
        check_config(cfg)


def test_every_committed_run_composes_today_to_the_hash_of_its_rows(monkeypatch, tmp_path):
    """A setting or parameter added since a run was made leaves its group hash as it was
    (settings.ADDED_PARAMETERS): otherwise a later seed would be grouped apart from it, and
    rerunning the sweep over the committed directories would refuse them as other runs."""
    monkeypatch.setenv("POSBENCH_WIKITEXT_DIR", str(tmp_path))  # composing only: no data is read
    runs = sorted(STUDY.glob("*_experiment=frontier,*"))
    assert len(runs) >= 52  # seed 0 of copy, sparse flip-flop, WikiText and counting at least
    assert_runs_compose_to_their_hashes(runs)
