"""task.eos (copy, reverse, sort): the answer ends with a scored EOS token, so the model must say where it
stops, as Kazemnejad et al. 2023's greedy generation must. The layout token by token in both layouts, the
ids and vocabulary, teacher-forced exact match equal to greedy generation's on a trained model, the
refusal of a bad value, the config, and the default left as it was (batches, ids, config_hash)."""
import copy
import hashlib
import json

import pytest
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from posbench.build import build
from posbench.runinfo import config_hash, group_config
from posbench.training import make_optimizer, train_step
from tasks import REGISTRY
from tasks.base import Batch, batch_metrics
from tests.helpers import compose_cfg, posbench, read_rows

NAMES = ("copy", "reverse", "sort")
SOLVERS = {"copy": lambda xs: list(xs), "reverse": lambda xs: xs[::-1], "sort": sorted}


def fixed_input(task, x: list[int]):
    """Makes `task` draw the one input x (a batch of one), its answer from the task's own transform."""
    xs = torch.tensor([x])  # [1, n]
    task.generate = lambda batch_size, length, generator: (xs, task.transform(xs))


@pytest.mark.parametrize("causal,inputs,targets", [
    # sort of 2 0 1, symbols 3: EOS 3, SEP 4, BOS 5 (QUERY 6)
    (True, [5, 2, 0, 1, 4, 0, 1, 2], [2, 0, 1, 4, 0, 1, 2, 3]),  # [BOS] x SEP y EOS, all but the last token in
    (False, [5, 2, 0, 1, 4, 6, 6, 6, 6], [5, 2, 0, 1, 4, 0, 1, 2, 3]),  # [BOS] x SEP QUERY*(m + 1)
], ids=["causal", "encoder"])
def test_the_layout_token_by_token(causal, inputs, targets):
    task = REGISTRY["sort"](symbols=3, causal=causal, eos=True)
    assert (task.eos_id, task.sep, task.bos, task.query) == (3, 4, 5, None if causal else 6)
    fixed_input(task, [2, 0, 1])
    batch = task.sample(1, 3, torch.Generator())
    assert batch.inputs.tolist() == [inputs] and batch.targets.tolist() == [targets]
    assert batch.loss_mask.tolist() == [[False] * (len(inputs) - 4) + [True] * 4]  # y_1..y_3 and EOS
    assert task.sequence_length(3) == len(inputs)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("length", [1, 2, 9])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "encoder"])
@pytest.mark.parametrize("bos", [True, False], ids=["bos", "no_bos"])
def test_drawn_batches_end_with_a_scored_eos(name, length, causal, bos):
    task = REGISTRY[name](symbols=5, causal=causal, bos=bos, eos=True)
    eos, sep = 5, 6
    batch = task.sample(16, length, torch.Generator().manual_seed(0))
    T = bos + length + length + 1  # x, SEP, y EOS less the last token; the encoder: x, SEP, QUERY*(n + 1)
    assert batch.inputs.shape == batch.loss_mask.shape == (16, T + (not causal)) == (16, task.sequence_length(length))
    for inputs, targets, mask in zip(batch.inputs.tolist(), batch.targets.tolist(), batch.loss_mask.tolist()):
        xs = inputs[bos:bos + length]
        head = [sep + 1] * bos + xs + [sep]
        answer = SOLVERS[name](xs) + [eos]
        assert inputs == ((head + answer)[:-1] if causal else head + [sep + 2] * (length + 1))
        assert targets == ((head + answer)[1:] if causal else head + answer)
        assert mask == [False] * (len(inputs) - length - 1) + [True] * (length + 1)  # EOS scored
        assert eos not in xs and targets.count(eos) == 1 and targets[-1] == eos


@pytest.mark.parametrize("variant,repeat", [("cmc", 1), ("cmc", 2), ("rsc", 1), ("rsc", 2), ("rdc", 1)])
def test_copy_variants_end_with_eos(variant, repeat):
    """EOS comes after copy's own tokens (NEXT too, for cmc2x): the answer is the variant's, then EOS."""
    plain, task = (REGISTRY["copy"](symbols=4, variant=variant, repeat=repeat, eos=eos) for eos in (False, True))
    a, b = (t.sample(8, 3, torch.Generator().manual_seed(2)) for t in (plain, task))
    own = 4 + (task.next is not None)  # the symbols, NEXT
    assert task.eos_id == own and (task.sep, task.bos) == (own + 1, own + 2) == (plain.sep + 1, plain.bos + 1)
    m = plain.output_length(3)
    assert torch.equal(b.targets[:, -m - 1:-1], a.targets[:, -m:])  # the same answer, drawn alike
    assert (b.targets[:, -1] == own).all() and b.loss_mask[:, -m - 1:].all() and b.loss_mask.sum() == 8 * (m + 1)


@pytest.mark.parametrize("name", NAMES)
def test_vocabulary_and_params(name):
    for causal, size in ((True, 13), (False, 14)):  # 10 symbols, EOS, SEP, BOS (QUERY)
        task, plain = REGISTRY[name](causal=causal, eos=True), REGISTRY[name](causal=causal)
        assert task.vocab_size == size == plain.vocab_size + 1
        assert (plain.eos_id, plain.sep, plain.bos, plain.query) == (None, 10, 11, None if causal else 12)
    if name == "copy":
        assert REGISTRY["copy"](variant="cmc", repeat=2, eos=True).vocab_size == 14  # NEXT 10, EOS 11
    assert REGISTRY[name](eos=True).params()["eos"] is True and REGISTRY[name]().params()["eos"] is False
    json.dumps(REGISTRY[name](eos=True).params())


# Batches of the default (eos=false) as the code before task.eos drew them (commit 831fdcb): sha256 of
# ids, sequence length and the inputs, targets and loss mask of 8 sequences at length 5, causal and encoder.
BEFORE_EOS = [
    ("copy", {}, "39ad0b45b27ec7c9", "a1f33cac6eb099d8"),
    ("copy", {"variant": "cmc", "repeat": 2}, "4e4e10a8e353b62d", "7d2086ffe3012aee"),
    ("copy", {"variant": "rsc"}, "341bd3d7dcd7612d", "7ad34d7fb8547bc8"),
    ("copy", {"variant": "rsc", "repeat": 2}, "a4acfdeaae8d1737", "49dab4b30e9603e3"),
    ("copy", {"variant": "rdc"}, "a627e9dd8b00c3c5", "e3ca81dbd24818dd"),
    ("copy", {"bos": False}, "5ea79caa9175b612", "74e9faeae786a620"),
    ("reverse", {}, "7aacf8bf002ebc3e", "b1784463d51d21f9"),
    ("reverse", {"bos": False}, "a9c6ac84b550a3e9", "6437b07b520971dc"),
    ("sort", {}, "263861090132e79c", "f2dfff237c39ca4a"),
    ("sort", {"bos": False}, "7515b2c343253a0c", "84a365d26aac6b5c"),
]


def fingerprint(task, length: int = 5) -> str:
    digest = hashlib.sha256(repr((task.vocab_size, task.sep, task.bos, task.query,
                                  task.sequence_length(length))).encode())
    batch = task.sample(8, length, torch.Generator().manual_seed(0))
    for tensor in (batch.inputs, batch.targets, batch.loss_mask):
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()[:16]


@pytest.mark.parametrize("name,options,causal_digest,encoder_digest", BEFORE_EOS)
def test_the_default_draws_the_batches_it_drew_before(name, options, causal_digest, encoder_digest):
    for eos in ({}, {"eos": False}):
        assert [fingerprint(REGISTRY[name](causal=causal, **options, **eos)) for causal in (True, False)] == \
            [causal_digest, encoder_digest]


@pytest.fixture
def one_thread():
    """One torch thread while the test trains (as the runner's threads=1: faster on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def greedy(model, positions, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """prompt [B, P] -> [B, steps]: each step appends the argmax of the last position's logits."""
    sequence = prompt
    for _ in range(steps):
        logits = model(sequence, positions(sequence.shape[1], torch.Generator()))  # [B, L, V]
        sequence = torch.cat([sequence, logits[:, -1].argmax(-1, keepdim=True)], dim=1)  # [B, L + 1]
    return sequence[:, prompt.shape[1]:]


@pytest.mark.parametrize("overrides", [("task=copy", "task.variant=rsc", "encoding=rope"),
                                       ("task=sort", "encoding=sinusoidal")], ids=["copy_rsc_rope", "sort_sinusoidal"])
def test_teacher_forced_exact_match_is_greedy_generation(overrides, one_thread):
    """A small posbench model trained 300 steps at lengths 1..4, some answers right and some wrong: for every
    sequence, the task's own exact match (every scored argmax right, tasks.base.batch_metrics) equals greedy
    decoding from `[BOS] x SEP` that stops at EOS (or after m + 1 tokens) and produced exactly y EOS."""
    cfg = compose_cfg("device=cpu", "debug=smoke", *overrides, "task.eos=true", "task.symbols=4", "train.length=4",
                      "train.lr=3e-3")
    built = build(cfg, torch.device("cpu"))
    model, task = built.model, built.task
    optimizer = make_optimizer(model, cfg.train)
    data = torch.Generator().manual_seed(0)
    for _ in range(300):
        batch = task.sample(32, int(torch.randint(1, 5, (1,), generator=data)), data)
        train_step(model, model, task, batch, built.positions.for_batch(batch, data), optimizer, cfg.train,
                   torch.device("cpu"))
    model.eval().double()  # float64: a near-tie cannot fall one way in the full pass and the other in a prefix
    outcomes = []
    for length in range(1, 7):
        batch = task.sample(48, length, torch.Generator().manual_seed(length))
        answer = length + 1  # y_1..y_n, EOS
        with torch.no_grad():
            logits = model(batch.inputs, built.positions.for_batch(batch, data))  # [B, T, V]
            generated = greedy(model, built.positions, batch.inputs[:, :-answer + 1], answer)  # [B, n + 1]
        for i in range(batch.inputs.shape[0]):
            one = Batch(batch.inputs[i:i + 1], batch.targets[i:i + 1], batch.loss_mask[i:i + 1])
            teacher_forced = batch_metrics(logits[i:i + 1], one)["exact"].item() == 1
            tokens = generated[i].tolist()
            stopped = tokens[:tokens.index(task.eos_id) + 1] if task.eos_id in tokens else tokens
            expected = batch.targets[i, -answer:].tolist()  # y EOS
            outcomes.append((teacher_forced, stopped == expected, stopped[:length] == expected[:length]))
    disagree = sum(teacher_forced != generation for teacher_forced, generation, _ in outcomes)
    assert disagree == 0, f"{disagree} of {len(outcomes)} sequences: teacher forcing and generation disagree"
    right = sum(generation for _, generation, _ in outcomes)
    assert 0 < right < len(outcomes)  # both outcomes occur, so the comparison could fail
    # some generate y right and then fail to stop there: what eos=false would score as right
    assert any(not generation and answer_right for _, generation, answer_right in outcomes)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("value", ["maybe", 1, None])
def test_a_bad_eos_is_refused(name, value):
    with pytest.raises(ValueError, match=rf"{name}: task.eos={value!r}: must be true or false"):
        REGISTRY[name](eos=value)


def test_a_bad_eos_is_refused_before_training():
    with pytest.raises(ValueError, match=r"copy: task.eos='maybe': must be true or false"):
        build(compose_cfg("device=cpu", "task=copy", "task.eos=maybe"), torch.device("cpu"))


@pytest.mark.parametrize("name", NAMES)
def test_the_config_composes_with_eos(name):
    assert compose_cfg(f"task={name}").task.eos is False
    for causal in ("true", "false"):
        task = instantiate(compose_cfg(f"task={name}", "task.eos=true", f"model.causal={causal}").task)
        assert task.eos is True and task.eos_id == 10 and task.vocab_size == (13 if causal == "true" else 14)
    with pytest.raises(InstantiationException, match="task.eos='maybe'"):
        instantiate(compose_cfg(f"task={name}", "task.eos=maybe").task)


@pytest.mark.parametrize("name", NAMES)
def test_config_hash_unchanged_by_the_default_and_changed_by_eos(name):
    general_training = ("train.steps=10000", "train.lr=1e-3", "train.min_lr_ratio=0.1")  # before task_train/copy.yaml
    resolved = OmegaConf.to_container(compose_cfg(f"task={name}", *general_training), resolve=True)
    before = copy.deepcopy(resolved)  # as written before task.eos existed
    del before["task"]["eos"]
    assert config_hash(group_config(resolved)) == config_hash(group_config(before))
    if name == "copy":  # the default run, as test_architecture pins it
        assert config_hash(group_config(resolved)) == "5e807f9dc682"
    resolved["task"]["eos"] = True
    assert config_hash(group_config(resolved)) != config_hash(group_config(before))


def test_a_run_with_eos_records_it(tmp_path):
    posbench("debug=smoke", "encoding=nope", "task=copy", "task.variant=rsc", "task.eos=true", "train.steps=2",
             f"hydra.run.dir={tmp_path}")
    rows = read_rows(tmp_path)
    assert rows and all(row["task_params"]["eos"] is True and row["config"]["task"]["eos"] is True for row in rows)
