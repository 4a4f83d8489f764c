"""The resource guard (posbench.guard): lengths that cannot fit are refused before training, naming
eval.lengths, the estimate and the limit; a smaller evaluation batch is used where it fits; the estimate
stays above the peak resident set measured here, within a small factor; allocation errors are told in
the run's terms."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import open_dict

from posbench import build as build_module
from posbench import guard
from posbench.build import build
from posbench.runner import run
from tests.helpers import compose_cfg

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent
LIMIT_MIB = 16384  # a 24 GiB machine's: set explicitly so that every machine gives the same answers


@pytest.fixture
def built_unchecked(monkeypatch):
    """build(cfg) without its own guard and check_built's draw of evaluation data at the longest length
    (a grid of side 100000 would allocate 40 GB there), so that the tests call the guard themselves."""
    monkeypatch.setattr(build_module, "check_built", lambda built, cfg: None)
    monkeypatch.setattr(build_module, "check_run", lambda cfg, built, device: None)

    def make(*overrides, limit=LIMIT_MIB):
        cfg = compose_cfg("device=cpu", *overrides, f"eval.memory_limit={'null' if limit is None else limit}")
        return cfg, build(cfg, CPU)
    return make


def test_the_run_is_refused_before_training_and_writes_no_rows(tmp_path):
    cfg = compose_cfg("device=cpu", "train.steps=50", "eval.lengths=[10000000]", f"eval.memory_limit={LIMIT_MIB}")
    with pytest.raises(ValueError, match=r"eval.lengths=\[10000000\]: 1 length cannot be evaluated"):
        run(cfg, tmp_path)
    assert not (tmp_path / "results.jsonl").exists() and not (tmp_path / "checkpoint.pt").exists()


def refusal(cfg, built) -> str:
    with pytest.raises(ValueError) as caught:
        guard.check_run(cfg, built, CPU)
    return str(caught.value)


def test_ten_million_tokens_is_refused_before_training(built_unchecked):
    cfg, built = built_unchecked("eval.lengths=[10000000]")
    message = refusal(cfg, built)
    assert "eval.lengths=[10000000]" in message and "length 10000000 (20,000,001 tokens)" in message
    assert "GiB (activations" in message  # the estimate, by part
    assert f"the memory limit 16.0 GiB (eval.memory_limit={LIMIT_MIB} MiB)" in message
    assert "even one sequence at a time" in message


def test_t5_at_a_million_gets_a_smaller_batch_or_a_refusal(built_unchecked):
    cfg, built = built_unchecked("encoding=t5", "eval.lengths=[1000000]")
    result = guard.check_run(cfg, built, CPU)
    assert 1 <= result.batch_sizes[1000000] < 256
    assert result.estimates[1000000].total <= LIMIT_MIB * 2**20
    assert "eval.batch_size=256 would need about 1.5 TiB" in result.messages[0]
    assert f"sequences at a time instead" in result.messages[0]
    assert result.eval_config(cfg.eval, 1000000).batch_size == result.batch_sizes[1000000]
    assert cfg.eval.batch_size == 256  # the run's own config is unchanged
    cfg.eval.memory_limit = 2048  # not even one sequence (about 6 GiB) fits
    message = refusal(cfg, built)
    assert "eval.lengths=[1000000]" in message and "2.0 GiB (eval.memory_limit=2048 MiB)" in message


def test_a_huge_grid_is_refused_with_its_side_and_cells(built_unchecked):
    cfg, built = built_unchecked("task=life", "eval.lengths=[100000]")
    message = refusal(cfg, built)
    assert "eval.lengths=[100000]" in message
    assert "grids of side 100000: 10,000,000,000 cells" in message and "TiB" in message


def test_the_default_job_and_small_lengths_pass_unchanged(built_unchecked):
    cfg, built = built_unchecked(limit=None)  # the machine's own limit
    result = guard.check_run(cfg, built, CPU)
    assert set(result.batch_sizes.values()) == {256} and not result.messages
    assert result.eval_config(cfg.eval, built.lengths[-1]) is cfg.eval
    cfg, built = built_unchecked("encoding=cope", "eval.lengths=[32,64]")
    assert not guard.check_run(cfg, built, CPU).messages


def test_refusal_names_every_length_and_suggests_auto_chunking(built_unchecked):
    cfg, built = built_unchecked("encoding=t5", "eval.chunk=null", "eval.lengths=[64,30000]", limit=1024)
    message = refusal(cfg, built)
    assert "length 30000 (60,001 tokens)" in message and "length 64 " not in message
    assert "eval.chunk=auto would fit it" in message


def test_the_limit_without_a_setting_is_what_the_machine_has_less_a_margin():
    cfg = compose_cfg("device=cpu")
    limit = guard.memory_limit(cfg, CPU)
    if limit.bytes is None:
        pytest.skip("no /proc/meminfo or psutil here")
    total = int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemTotal:"))) * 1024
    assert 0 < limit.bytes < total and "margin" in limit.source
    with open_dict(cfg):
        cfg.eval.memory_limit = "lots"
    with pytest.raises(ValueError, match="eval.memory_limit='lots' is not valid"):
        guard.memory_limit(cfg, CPU)


def test_an_absurd_length_is_refused_on_any_machine(built_unchecked):
    cfg, built = built_unchecked("eval.lengths=[1000000000]", limit=None)
    assert "eval.lengths=[1000000000]" in refusal(cfg, built)


# --- the estimate against the peak resident set measured here ----------------------------------------

MEASURED = [  # (overrides, length, batch): T = 2 length + 1 tokens on copy, side^2 on life; one batch each
    (("encoding=nope",), 256, 32),  # the feed-forward's [B, T, 4D] pair is the peak
    (("encoding=t5",), 256, 16),  # the whole bias [1, H, T, T] per layer (no chunking)
    (("encoding=t5",), 1024, 2),  # the chunked bias: 2047 queries a chunk
    (("encoding=cope",), 64, 32),  # eager logits [B, H, T, T] and CoPE's copies of them
    (("encoding=t5", "task=life"), 32, 4),  # a grid: 1024 cells, a 2-D bias built per block
]


MEASURE = """
import json, sys
import torch
from posbench import evaluation, guard
from posbench.build import build
from posbench.memory import PeakMemory
from tests.helpers import compose_cfg

torch.set_num_threads(1)
starts = []


class Recorded(PeakMemory):
    def start(self):
        super().start()
        starts.append(self)


evaluation.PeakMemory = Recorded
overrides, length, batch = json.loads(sys.argv[1])
cfg = compose_cfg("device=cpu", "train.steps=0", *overrides, f"eval.lengths=[{length}]", f"eval.samples={batch}",
                  f"eval.batch_size={batch}")
built = build(cfg, torch.device("cpu"))
row = evaluation.evaluate(built, length, cfg.eval, torch.device("cpu"))
print(json.dumps({"resettable": starts[-1].resettable, "measured": (row["peak_mem_mb"] - starts[-1].base) * 2**20,
                  "estimated": guard.estimate(cfg, built, length, batch).total}))
"""


@pytest.mark.parametrize("overrides,length,batch", MEASURED)
def test_the_estimate_bounds_the_measured_peak_within_a_factor(overrides, length, batch):
    """Measured in a fresh process, as a run's evaluation would be: a test worker's heap, shaped by the
    tests before, would measure them as much as this length."""
    done = subprocess.run([sys.executable, "-c", MEASURE, json.dumps([list(overrides), length, batch])],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.splitlines()[-1])
    if not result["resettable"]:
        pytest.skip("no per-stretch peak here (VmHWM reset refused)")
    measured, estimated = result["measured"], result["estimated"]
    assert 0.9 * measured <= estimated <= 2.5 * measured, (measured / 2**20, estimated / 2**20)


# --- allocation errors ---------------------------------------------------------------------------------

CPU_OOM = ("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: you tried to "
           "allocate 6144003072 bytes. Error code 12 (Cannot allocate memory)")


@pytest.mark.parametrize("error", [RuntimeError(CPU_OOM), torch.OutOfMemoryError("CUDA out of memory. Tried to "
                                                                                   "allocate 6.00 GiB"), MemoryError()])
def test_allocation_errors_are_told_with_the_length_and_the_settings(error):
    with pytest.raises(guard.OutOfMemory) as caught:
        with guard.translate_oom(length=1000000, batch=256):
            raise error
    message = str(caught.value)
    assert message.startswith("out of memory in evaluation at length 1000000 (256 sequences per batch)")
    assert "eval.lengths" in message and "eval.batch_size" in message and "eval.memory_limit" in message
    assert caught.value.original is error and caught.value.__cause__ is None


def test_a_real_cpu_allocation_failure_is_translated():
    with pytest.raises(guard.OutOfMemory, match="out of memory in evaluation at length 7"):
        with guard.translate_oom(length=7):
            torch.empty(2**50, dtype=torch.uint8)  # a petabyte


def test_other_errors_pass_unchanged():
    with pytest.raises(ValueError, match="not memory"):
        with guard.translate_oom(length=7):
            raise ValueError("not memory")
    with pytest.raises(RuntimeError, match="shape mismatch"):
        with guard.translate_oom(length=7):
            raise RuntimeError("shape mismatch")
