"""The copy task's variants (Kazemnejad et al. 2023: cmc, rsc, rdc, and their 2x forms): every batch
checked against an independent solver that rebuilds the whole sequence (inputs, targets, loss mask)
from the paper's description in plain Python, in the causal and the encoder layout; the default
(cmc, repeat 1) draws exactly what copy drew before the variants; seeded determinism; refusals."""
import inspect
import json
from collections import Counter

import pytest
import torch
import yaml
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from tasks import REGISTRY
from tasks.base import TransductionTask
from tests.helpers import CONFIGS, compose_cfg

Copy = REGISTRY["copy"]
VARIANTS = [("cmc", 1), ("cmc", 2), ("rsc", 1), ("rsc", 2), ("rdc", 1)]  # the paper's five copy tasks


def solve(variant: str, repeat: int, xs: list[int], n: int, symbols: int) -> list[int]:
    """The answer to the decoded input xs at length n, checking that xs is a valid input of the variant.
    NEXT, the cmc2x separator, is the first id after the symbols."""
    if variant == "cmc":
        assert len(xs) == n and all(0 <= s < symbols for s in xs)
        return xs if repeat == 1 else xs + [symbols] + xs  # "x [NEXT] x"
    if variant == "rsc":
        assert len(xs) == n and len(set(xs)) == 1 and xs[0] < symbols
        return [xs[0]] * (repeat * n)
    a, b, rest = xs[0], xs[1], xs[2:]  # "Replace a with b in a a .. a"
    assert repeat == 1 and a != b and max(a, b) < symbols and rest == [a] * n
    return [b] * n


def expected(variant, repeat, xs, n, symbols, causal, bos=True):
    """(inputs, targets, loss mask) of one sequence, built from scratch: [BOS] x SEP y (causal: all but
    the last token in, next tokens out) or [BOS] x SEP QUERY*m (encoder: the answer in the targets only)."""
    sep = symbols + (variant == "cmc" and repeat == 2)
    head = ([sep + 1] if bos else []) + xs + [sep]
    answer = solve(variant, repeat, xs, n, symbols)
    m = len(answer)
    if causal:
        sequence = head + answer
        inputs, targets = sequence[:-1], sequence[1:]
    else:
        inputs = head + [sep + 2] * m
        targets = head + answer
    mask = [False] * (len(inputs) - m) + [True] * m
    return inputs, targets, mask


@pytest.mark.parametrize("variant,repeat", VARIANTS)
@pytest.mark.parametrize("length", [1, 2, 5, 13])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "encoder"])
@pytest.mark.parametrize("bos", [True, False], ids=["bos", "no_bos"])
def test_batches_match_an_independent_solver(variant, repeat, length, causal, bos):
    symbols = 4
    task = Copy(symbols=symbols, variant=variant, repeat=repeat, causal=causal, bos=bos)
    batch = task.sample(32, length, torch.Generator().manual_seed(0))
    n_in = length + 2 if variant == "rdc" else length
    m = repeat * length + (variant == "cmc" and repeat == 2)
    T = bos + n_in + (m if causal else m + 1)
    assert task.sequence_length(length) == T
    assert batch.inputs.shape == batch.targets.shape == batch.loss_mask.shape == (32, T)
    assert task.vocab_size == symbols + (variant == "cmc" and repeat == 2) + (2 if causal else 3)
    for inputs, targets, mask in zip(batch.inputs.tolist(), batch.targets.tolist(), batch.loss_mask.tolist()):
        xs = inputs[bos:bos + n_in]
        assert (inputs, targets, mask) == expected(variant, repeat, xs, length, symbols, causal, bos)


@pytest.mark.parametrize("variant,repeat", VARIANTS)
def test_every_symbol_is_drawn(variant, repeat):
    """rsc draws its symbol uniformly, rdc every ordered pair a != b: 4 symbols, 2048 sequences."""
    batch = Copy(symbols=4, variant=variant, repeat=repeat).sample(2048, 3, torch.Generator().manual_seed(1))
    xs = batch.inputs[:, 1:]
    if variant == "rdc":
        pairs = Counter(map(tuple, xs[:, :2].tolist()))
        assert set(pairs) == {(a, b) for a in range(4) for b in range(4) if a != b}
        assert min(pairs.values()) > 2048 / 12 * 0.7
    else:
        assert set(xs[:, 0].tolist()) == set(range(4))


def test_the_default_is_the_copy_task_as_it_was():
    """The pre-variant copy task was a TransductionTask with the identity transform: same batches,
    ids and vocabulary, so earlier results and the tests written for them still hold."""
    class Before(TransductionTask):
        name = "copy"

        def transform(self, x):
            return x

    assert Copy().params() == {"symbols": 10, "variant": "cmc", "repeat": 1, "eos": False, "bos": True,
                               "causal": True}
    for causal in (True, False):
        for bos in (True, False):
            now, before = Copy(causal=causal, bos=bos), Before(10, 16, bos, causal)
            assert (now.vocab_size, now.sep, now.bos, now.query) == (before.vocab_size, before.sep, before.bos,
                                                                    before.query)
            for seed, length in ((0, 1), (3, 12), (7, 40)):
                a, b = (t.sample(16, length, torch.Generator().manual_seed(seed)) for t in (now, before))
                assert all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("inputs", "targets", "loss_mask"))
    generator = torch.Generator().manual_seed(5)  # one shared stream: the default draws nothing extra
    Copy().sample(4, 6, generator)
    after = torch.randint(0, 1000, (4,), generator=generator)
    generator = torch.Generator().manual_seed(5)
    Before(10, 16, True, True).sample(4, 6, generator)
    assert torch.equal(after, torch.randint(0, 1000, (4,), generator=generator))


@pytest.mark.parametrize("variant,repeat", VARIANTS)
def test_seeded_determinism(variant, repeat):
    task = Copy(variant=variant, repeat=repeat)
    a, b, c = (task.sample(8, 12, torch.Generator().manual_seed(seed)) for seed in (5, 5, 6))
    assert all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("inputs", "targets", "loss_mask"))
    assert not torch.equal(a.inputs, c.inputs)


@pytest.mark.parametrize("variant,repeat", VARIANTS)
def test_params_record_the_variant(variant, repeat):
    params = Copy(variant=variant, repeat=repeat, causal=False).params()
    assert params == {"symbols": 10, "variant": variant, "repeat": repeat, "eos": False, "bos": True, "causal": False}
    json.dumps(params)


@pytest.mark.parametrize("options,message", [
    ({"variant": "x"}, r"copy: task.variant='x' is not valid; choose one of \['cmc', 'rsc', 'rdc'\]"),
    ({"variant": None}, r"copy: task.variant=None is not valid"),
    ({"repeat": 3}, r"copy: task.repeat=3: must be in \[1, 2\]"),
    ({"repeat": 0}, r"copy: task.repeat=0: must be in \[1, 2\]"),
    ({"repeat": True}, r"copy: task.repeat=True: must be an integer in \[1, 2\]"),
    ({"repeat": "2"}, r"copy: task.repeat='2': must be an integer"),
    ({"variant": "rdc", "repeat": 2}, r"copy: task.repeat=2 with task.variant='rdc' is not valid"),
    ({"symbols": 1, "variant": "rdc"}, r"copy: task.symbols=1: must be >= 2"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        Copy(**options)


def test_options_from_the_command_line():
    task = instantiate(compose_cfg("task=copy", "task.variant=rsc", "task.repeat=2", "model.causal=false").task)
    assert (task.variant, task.repeat, task.causal) == ("rsc", 2, False)
    with pytest.raises(InstantiationException, match="task.variant='abc' is not valid"):
        instantiate(compose_cfg("task=copy", "task.variant=abc").task)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_task_yaml_defaults_equal_the_constructor_defaults(name):
    """Every constructor parameter is in the task's YAML with the constructor's default (as the encodings'
    test checks theirs); interpolated values (causal: ${model.causal}, environment lookups) are skipped."""
    written = {k: v for k, v in yaml.safe_load((CONFIGS / "task" / f"{name}.yaml").read_text()).items()
               if not k.startswith("_")}
    signature = inspect.signature(REGISTRY[name].__init__).parameters
    defaults = {k: p.default for k, p in signature.items() if k != "self"}
    assert set(written) == set(defaults)
    assert {k: v for k, v in written.items() if not (isinstance(v, str) and "${" in v)} == \
        {k: defaults[k] for k, v in written.items() if not (isinstance(v, str) and "${" in v)}
