"""train.init_from: evaluate (train.steps=0) or fine-tune a saved checkpoint."""
import pytest
import torch

from posbench.build import build
from posbench.evaluation import evaluate
from posbench.runner import run
from tests.helpers import compose_cfg

SMOKE = ("debug=smoke", "encoding=rope", "task=copy", "threads=1")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained")
    rows = run(compose_cfg(*SMOKE), run_dir)
    return run_dir, rows


def metrics(rows):
    return [(r["eval_length"], r["exact_match"], r["token_acc"], r["loss"]) for r in rows]


def test_evaluation_only_reproduces_the_trained_run(trained, tmp_path):
    run_dir, rows = trained
    again = run(compose_cfg(*SMOKE, f"train.init_from={run_dir}", "train.steps=0"), tmp_path)
    assert metrics(again) == metrics(rows)  # same weights, same evaluation data
    assert {(r["train_steps"], r["init_steps"], r["init_from"]) for r in again} == {
        (0, 20, str(run_dir / "checkpoint.pt"))}
    assert {(r["train_steps"], r["init_steps"], r["init_from"]) for r in rows} == {(20, 0, None)}
    assert not (tmp_path / "checkpoint.pt").exists()  # nothing new to save


def test_scaling_changes_only_lengths_past_n(trained, tmp_path):
    run_dir, rows = trained
    scaled = run(compose_cfg(*SMOKE, f"train.init_from={run_dir}", "train.steps=0", "encoding.scaling=pi"),
                 tmp_path)
    assert metrics(scaled)[0] == metrics(rows)[0]  # at N: no scaling
    assert scaled[1]["loss"] != rows[1]["loss"]  # at 2N: positions interpolated by 1/2
    assert scaled[0]["encoding_params"]["scaling"] == "pi"


def test_fine_tuning_counts_the_checkpoint_steps(trained, tmp_path):
    run_dir, _ = trained
    rows = run(compose_cfg(*SMOKE, f"train.init_from={run_dir / 'checkpoint.pt'}", "train.steps=5"), tmp_path)
    assert {(r["train_steps"], r["init_steps"]) for r in rows} == {(5, 20)}
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["steps"] == 25


def test_missing_checkpoint_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"train.init_from={tmp_path}: no checkpoint there"):
        build(compose_cfg(*SMOKE, f"train.init_from={tmp_path}"), torch.device("cpu"))


def test_other_encoding_is_refused(trained):
    run_dir, _ = trained
    cfg = compose_cfg(*SMOKE[:1], "encoding=alibi", "task=copy", f"train.init_from={run_dir}")
    with pytest.raises(ValueError, match=r"encoding posbench.encodings.rope.RoPE, not posbench.encodings.alibi.*"
                                         r"\(or one that loads its checkpoints: \['drope', 'self_extend', 'string'\]\)"):
        build(cfg, torch.device("cpu"))


def test_other_model_is_refused(trained):
    run_dir, _ = trained
    cfg = compose_cfg(*SMOKE, "model.d_model=32", f"train.init_from={run_dir}")
    with pytest.raises(ValueError, match=r"another model: model.d_model=32 \(checkpoint: 16\)"):
        build(cfg, torch.device("cpu"))


def test_other_vocabulary_is_refused(trained):
    run_dir, _ = trained
    cfg = compose_cfg(*SMOKE, "task.symbols=5", f"train.init_from={run_dir}")
    with pytest.raises(ValueError, match="(?s)does not fit this model.*size mismatch for tok.weight"):
        build(cfg, torch.device("cpu"))


def test_evaluation_only_must_keep_n(trained):
    run_dir, _ = trained
    cfg = compose_cfg(*SMOKE, f"train.init_from={run_dir}", "train.steps=0", "train.length=8")
    with pytest.raises(ValueError, match="train.length=8 but .* was trained at N=16"):
        build(cfg, torch.device("cpu"))


def test_a_checkpoint_from_before_the_architecture_settings_is_read_at_their_earlier_values(trained, tmp_path):
    run_dir, _ = trained
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    for key in ("activation", "norm", "bias"):  # as a checkpoint written before model.activation/norm/bias
        del checkpoint["config"]["model"][key]
    torch.save(checkpoint, tmp_path / "checkpoint.pt")
    build(compose_cfg(*SMOKE, f"train.init_from={tmp_path}"), torch.device("cpu"))  # gelu, layernorm, biases
    with pytest.raises(ValueError, match=r"another model: model.activation=relu \(checkpoint: gelu\)"):
        build(compose_cfg(*SMOKE, "model.activation=relu", f"train.init_from={tmp_path}"), torch.device("cpu"))


def evaluated_on(weights: dict, *overrides: str) -> list[tuple]:
    """The smoke model of these overrides with the weights loaded by hand, evaluated at N and 2N."""
    cfg = compose_cfg(*overrides)
    built = build(cfg, torch.device("cpu"))
    built.model.load_state_dict(weights)
    return [(length, *(evaluate(built, length, cfg.eval, torch.device("cpu"))[key]
                       for key in ("exact_match", "token_acc", "loss"))) for length in built.lengths]


@pytest.mark.parametrize("encoding", [("encoding=string",), ("encoding=drope", "encoding.drop_at=0")])
def test_a_rope_run_evaluates_as_string_and_as_drope(trained, tmp_path, encoding):
    """STRING and DroPE read a rope model's weights: an evaluation-only run from the rope checkpoint gives what
    the encoding computes on those weights loaded by hand, not what rope computes."""
    run_dir, rope_rows = trained
    overrides = (SMOKE[0], *encoding, *SMOKE[2:])
    rows = run(compose_cfg(*overrides, f"train.init_from={run_dir}", "train.steps=0"), tmp_path)
    weights = torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]
    assert metrics(rows) == evaluated_on(weights, *overrides)
    assert metrics(rows)[1] != metrics(rope_rows)[1]  # at 2N: shifted distances, or no rotation at all
    assert {(r["encoding"], r["init_steps"]) for r in rows} == {(encoding[0].split("=")[1], 20)}


@pytest.mark.parametrize("encoding,message", [
    (("encoding=string", "encoding.base=500"), r"encoding.base=500 \(checkpoint: 10000.0\)"),
    (("encoding=self_extend", "encoding.layout=interleaved"), r"encoding.layout=interleaved \(checkpoint: half\)"),
    (("encoding=drope", "encoding.drop_at=0", "encoding.base=500"), r"encoding.base=500 \(checkpoint: 10000.0\)"),
])
def test_a_rope_run_with_other_rotation_settings_is_refused_naming_them(trained, encoding, message):
    run_dir, _ = trained
    cfg = compose_cfg(SMOKE[0], *encoding, *SMOKE[2:], f"train.init_from={run_dir}", "train.steps=0")
    with pytest.raises(ValueError, match=r"holds a posbench.encodings.rope.RoPE model; the settings posbench.encodings"
                                         r".* shares with it must be the checkpoint's .*: " + message):
        build(cfg, torch.device("cpu"))
