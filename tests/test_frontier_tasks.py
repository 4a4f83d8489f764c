"""The frontier tasks (flip_flop, selective_copy, counting, state_tracking, mqar) in both layouts: every
batch checked against an independent solver (a plain Python loop over the decoded tokens), exact masks
and lengths, seeded determinism, the densities drawn, refusals, configs and one real run."""
import itertools
import json

import pytest
import torch
from hydra.utils import instantiate

from tasks import REGISTRY
from tests.helpers import compose_cfg, posbench, read_rows

NAMES = ["counting", "flip_flop", "mqar", "selective_copy", "state_tracking"]
LENGTHS = [1, 2, 9, 40]
W, R, I, BITS = 2, 3, 4, (0, 1)  # flip_flop's ids (docstring of tasks.frontier.FlipFlop)


def solve_flip_flop(task, seq, n):
    """Walk the pairs keeping the last written bit; each read's bit must be it."""
    assert seq[0] == task.BOS and len(seq) == 2 * n + 3
    ops, bits = seq[1::2], seq[2::2]
    assert ops[0] == W and ops[-1] == R and set(ops) <= {W, R, I} and set(bits) <= set(BITS)
    memory, answers = None, {}
    for k, (op, bit) in enumerate(zip(ops, bits)):
        if op == W:
            memory = bit
        elif op == R:
            answers[2 + 2 * k] = memory  # the read bit's index in seq
    return answers


def solve_selective_copy(task, seq, n):
    assert seq[0] == task.bos and seq[n + 1] == task.sep
    xs = seq[1:n + 1]
    kept = [t for t in xs if t != task.blank]
    assert len(kept) == min(task.content, n) and all(t < task.symbols for t in kept)
    assert len(seq) == n + 2 + len(kept)
    return {n + 2 + i: t for i, t in enumerate(kept)}


def solve_counting(task, seq, n):
    """Run the program: `v = 0` sets v to 0, `v ++` adds 1 (only to a variable set, never past the
    max), `pass` does nothing; `print v` asks v's value."""
    assert seq[0] == task.bos and seq[n + 2] == task.sep and len(seq) == n + 4
    V, first = task.variables, task.max_count + 2
    values = {}
    for k, token in enumerate(seq[1:n + 1]):
        if token == task.max_count + 1:
            continue
        kind, var = divmod(token - first, V)
        assert 0 <= token - first < 2 * V, "a statement token"
        assert k > 0 or kind == 0, "the first statement sets a variable"
        if kind == 0:
            values[var] = 0
        else:
            assert var in values and values[var] < task.max_count
            values[var] += 1
    kind, var = divmod(seq[n + 1] - first, V)
    assert kind == 2 and var in values, "print asks a variable that was set"
    return {n + 3: values[var]}


def solve_mqar(task, seq, n):
    """Read the pairs, then every QUERY k SEP block; every key is asked once."""
    assert seq[0] == task.bos and len(seq) == 1 + 2 * n + 4 * n
    pairs = dict(zip(seq[1:2 * n + 1:2], seq[2:2 * n + 1:2]))
    assert len(pairs) == n and all(k < task.keys <= v < task.keys + task.values for k, v in pairs.items())
    answers, asked = {}, []
    for at in range(1 + 2 * n, len(seq), 4):
        query, key, sep = seq[at:at + 3]
        assert (query, sep) == (task.query, task.sep)
        asked.append(key)
        answers[at + 3] = pairs[key]
    assert sorted(asked) == sorted(pairs)
    return answers


SOLVERS = {"flip_flop": solve_flip_flop, "selective_copy": solve_selective_copy, "counting": solve_counting,
           "mqar": solve_mqar}
FULL = {  # tokens of the whole sequence at task length n: the encoder reads them all, the decoder all but the last
    "flip_flop": lambda n, task: 1 + 2 * (n + 1),  # BOS, n + 1 instruction-bit pairs
    "selective_copy": lambda n, task: 1 + n + 1 + min(task.content, n),  # BOS, x, SEP, the content
    "counting": lambda n, task: 1 + (n + 1) + 1 + 1,  # BOS, n statements and print, SEP, the value
    "mqar": lambda n, task: 1 + 2 * n + 4 * n,  # BOS, n pairs, n blocks QUERY k SEP v
}


def make(name, causal=True, **params):
    small = {"selective_copy": {"content": 5}, "counting": {"max_count": 3}, "mqar": {"keys": 40, "values": 6}}
    return REGISTRY[name](causal=causal, **{**small.get(name, {}), **params})


@pytest.mark.parametrize("name,params", [(n, {}) for n in SOLVERS] + [("flip_flop", {"p_ignore": 0.1})])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "encoder"])
@pytest.mark.parametrize("length", LENGTHS)
def test_batches_match_an_independent_solver(name, params, causal, length):
    task = make(name, causal, **params)
    batch = task.sample(16, length, torch.Generator().manual_seed(length))
    T = FULL[name](length, task) - causal
    assert task.sequence_length(length) == T
    assert batch.inputs.shape == batch.targets.shape == batch.loss_mask.shape == (16, T)
    assert 0 <= int(batch.inputs.min()) and int(batch.inputs.max()) < task.vocab_size
    for inputs, targets, mask in zip(batch.inputs.tolist(), batch.targets.tolist(), batch.loss_mask.tolist()):
        seq = [inputs[0], *targets] if causal else targets  # the whole sequence, answers in place
        answers = SOLVERS[name](task, seq, length)
        slots = [s - causal for s in answers]  # where each answer is a target
        assert [i for i, m in enumerate(mask) if m] == slots
        assert [targets[s] for s in slots] == list(answers.values())
        if causal:
            assert targets[:-1] == inputs[1:]
        else:  # nothing of an answer in the inputs
            blank = task.placeholder if name == "mqar" else task.query
            assert [inputs[s] for s in slots] == [blank] * len(slots)
            assert [t for i, t in enumerate(inputs) if i not in slots] == [t for i, t in enumerate(seq)
                                                                            if i not in slots]


ELEMENTS = {"s5": list(itertools.permutations(range(5)))}
ELEMENTS["a5"] = [p for p in ELEMENTS["s5"] if sum(p[i] > p[j] for i in range(5) for j in range(i + 1, 5)) % 2 == 0]


@pytest.mark.parametrize("group", ["s5", "a5"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "encoder"])
@pytest.mark.parametrize("length", LENGTHS)
def test_state_tracking_matches_permutations_composed_in_python(group, causal, length):
    """Ids are lexicographic ranks among the group's permutations; p_t(i) = g_t(p_{t-1}(i))."""
    task = make("state_tracking", causal, group=group)
    elements = ELEMENTS[group]
    assert task.vocab_size == len(elements) + 1 == task.bos + 1 and task.identity == 0
    batch = task.sample(16, length, torch.Generator().manual_seed(length))
    assert batch.inputs.shape == batch.targets.shape == batch.loss_mask.shape == (16, length + 1)
    assert task.sequence_length(length) == length + 1
    for inputs, targets, mask in zip(batch.inputs.tolist(), batch.targets.tolist(), batch.loss_mask.tolist()):
        assert inputs[0] == task.bos and mask == [False] + [True] * length
        state = tuple(range(5))
        for t, g in enumerate(inputs[1:], start=1):
            perm = elements[g]
            state = tuple(perm[state[i]] for i in range(5))
            assert targets[t] == elements.index(state)


def test_state_tracking_composition_order(monkeypatch):
    """Two transpositions that do not commute: (0 1) then (1 2) is 0 -> 2, 1 -> 0, 2 -> 1."""
    task = make("state_tracking")
    s5 = ELEMENTS["s5"]
    swap01, swap12, cycle = (s5.index(p) for p in ((1, 0, 2, 3, 4), (0, 2, 1, 3, 4), (2, 0, 1, 3, 4)))
    assert task.table[swap12, swap01] == cycle  # table[g, h] = g o h: h acts first
    monkeypatch.setattr(torch, "randint", lambda *args, **kwargs: torch.tensor([[swap01, swap12]]))
    batch = task.sample(1, 2, torch.Generator())  # the task draws its elements with torch.randint: these two
    assert batch.targets[0, 1:].tolist() == [swap01, cycle]


@pytest.mark.parametrize("name", NAMES)
def test_seeded_determinism(name):
    task = make(name)
    a, b, c = (task.sample(8, 12, torch.Generator().manual_seed(seed)) for seed in (5, 5, 6))
    assert all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("inputs", "targets", "loss_mask"))
    assert not torch.equal(a.inputs, c.inputs)
    scored = a.targets[a.loss_mask]
    assert scored.unique().numel() >= 2  # no single guess answers everything


@pytest.mark.parametrize("p_ignore", [0.0, 0.1, 0.8, 0.98, 1.0])
def test_flip_flop_draws_the_paper_density(p_ignore):
    """Instructions after the opening write and before the closing read: i with probability p_ignore,
    w and r equally often otherwise."""
    task = make("flip_flop", p_ignore=p_ignore)
    ops = task.train_sample(512, 100, 100, torch.Generator().manual_seed(0)).inputs[:, 3:-2:2]  # [B, 99]
    share = {op: float((ops == op).float().mean()) for op in (W, R, I)}
    assert share[I] == pytest.approx(p_ignore, abs=0.01)
    assert share[W] == pytest.approx((1 - p_ignore) / 2, abs=0.01) and share[R] == pytest.approx(share[W], abs=0.015)


def test_flip_flop_evaluates_at_its_own_density():
    task = make("flip_flop", p_ignore=0.1, eval_p_ignore=0.98)
    generator = torch.Generator().manual_seed(0)
    train = task.train_sample(128, 40, 40, generator).inputs[:, 3:-2:2]
    evaluation = next(task.eval_batches(40, 128, 128, generator)).inputs[:, 3:-2:2]
    assert float((train == I).float().mean()) < 0.2 < 0.9 < float((evaluation == I).float().mean())
    assert task.params() == {"p_ignore": 0.1, "eval_p_ignore": 0.98, "causal": True}


def test_selective_copy_holds_its_content_count():
    task = make("selective_copy", content=4)
    for length in (2, 4, 30):
        x = task.sample(32, length, torch.Generator().manual_seed(0)).inputs[:, 1:length + 1]
        assert ((x != task.blank).sum(1) == min(4, length)).all()


def test_counting_reaches_its_max_and_stops_there():
    task = make("counting", variables=1, max_count=2)
    batch = task.sample(256, 200, torch.Generator().manual_seed(0))
    answers = batch.targets[batch.loss_mask]
    assert set(answers.tolist()) == {0, 1, 2}  # the solver test checks no increment passes the max


@pytest.mark.parametrize("name,params,message", [
    ("flip_flop", {"p_ignore": 1.5}, r"flip_flop: task.p_ignore=1.5: must be in \[0, 1\]"),
    ("flip_flop", {"p_ignore": "dense"}, r"flip_flop: task.p_ignore='dense': must be a finite number in \[0, 1\]"),
    ("flip_flop", {"eval_p_ignore": -0.1}, r"flip_flop: task.eval_p_ignore=-0.1: must be in \[0, 1\], or null"),
    ("flip_flop", {"default_length": 0}, r"flip_flop: task.default_length=0: must be >= 1"),
    ("flip_flop", {"causal": "yes"}, r"flip_flop: task.causal='yes': must be true or false"),
    ("selective_copy", {"content": 0}, r"selective_copy: task.content=0: must be >= 1"),
    ("selective_copy", {"symbols": 1}, r"selective_copy: task.symbols=1: must be >= 2"),
    ("counting", {"variables": 0}, r"counting: task.variables=0: must be >= 1"),
    ("counting", {"max_count": 0}, r"counting: task.max_count=0: must be >= 1"),
    ("counting", {"max_count": 2.5}, r"counting: task.max_count=2.5: must be an integer >= 1"),
    ("state_tracking", {"group": "s4"}, r"state_tracking: task.group='s4' is not valid; choose one of \['s5', 'a5'\]"),
    ("state_tracking", {"default_length": -1}, r"state_tracking: task.default_length=-1: must be >= 1"),
    ("mqar", {"queries": 0}, r"mqar: task.queries=0: must be >= 1, or null \(every pair\)"),
    ("mqar", {"keys": 8}, r"mqar: length 16 needs 16 distinct keys but task.keys=8"),
])
def test_bad_settings_are_refused(name, params, message):
    with pytest.raises(ValueError, match=message):
        REGISTRY[name](**params)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("length", [0, -2])
def test_bad_lengths_are_refused(name, length):
    task = make(name)
    for call in (lambda: task.sample(2, length, torch.Generator()), lambda: task.sequence_length(length),
                 lambda: task.train_sample(2, length, 8, torch.Generator())):
        with pytest.raises(ValueError, match=f"{name}: length must be >= 1, got {length}"):
            call()


@pytest.mark.parametrize("name", NAMES)
def test_config_composes_in_both_layouts_and_records_its_settings(name):
    for causal in (True, False):
        task = instantiate(compose_cfg(f"task={name}", f"model.causal={str(causal).lower()}").task)
        assert type(task) is REGISTRY[name] and task.causal is causal
        params = task.params()
        assert params["causal"] is causal and json.loads(json.dumps(params)) == params
        assert task.sequence_length(4 * task.default_length) > 0  # the default evaluation grid (up to 4 N) is valid
        task.sample(2, 4 * task.default_length, torch.Generator())


def test_mqar_is_associative_recall_with_every_pair_queried():
    mqar, recall = REGISTRY["mqar"](), REGISTRY["associative_recall"](queries=None)
    assert mqar.params() == recall.params() and mqar.params()["queries"] is None
    a, b = (task.sample(4, 10, torch.Generator().manual_seed(0)) for task in (mqar, recall))
    assert torch.equal(a.inputs, b.inputs) and a.depth.shape == (4, 10)


def test_end_to_end_run(tmp_path):
    posbench("debug=smoke", "task=flip_flop", "task.eval_p_ignore=0.98", "train.length=8", f"hydra.run.dir={tmp_path}")
    rows = read_rows(tmp_path)
    assert [r["eval_length"] for r in rows] == [8, 16]
    for row in rows:
        assert row["status"] == "ok" and row["task"] == "flip_flop"
        assert row["task_params"] == {"p_ignore": 0.8, "eval_p_ignore": 0.98, "causal": True}
        assert row["eval_sequence_length"] == 2 * row["eval_length"] + 2
