"""scripts/benchmark_encodings.py: a real run on two encodings, and the ratio arithmetic; the block views
part of scripts/benchmark_scale.py, run for real."""
import csv
import importlib.util
import subprocess
import sys

import pytest

from tests.helpers import ROOT

SCRIPT = ROOT / "scripts" / "benchmark_encodings.py"


def load_script():
    spec = importlib.util.spec_from_file_location("benchmark_encodings", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table_rows(stdout: str) -> list[list[str]]:
    """The markdown table's body rows, split into cells (header and separator dropped)."""
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


@pytest.mark.slow
def test_two_encodings_two_lengths(tmp_path):
    out = tmp_path / "bench.csv"
    result = subprocess.run([sys.executable, str(SCRIPT), "--encodings", "nope,alibi", "--lengths", "4,8",
                             "--steps", "2", "--warmup", "1", "--device", "cpu",
                             "--out", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[4/4] alibi length 8" in result.stderr  # progress goes to stderr

    rows = table_rows(result.stdout)
    assert [(r[0], r[2]) for r in rows] == [("nope", "4"), ("nope", "8"), ("alibi", "4"), ("alibi", "8")]
    for encoding, backend, length, tokens, speed, _, step_ms, peak, _, step_mem, _ in rows:
        assert backend == "sdpa"  # backend=auto resolved as in a real run
        assert int(tokens) == 2 * int(length) + 1  # BOS + n symbols + SEP + n - 1 outputs
        assert float(speed.replace(",", "")) > 0 and float(step_ms) > 0
        assert float(peak) > 0 and float(step_mem) > 0
    for row in rows[:2]:  # nope against itself
        assert (row[5], row[8], row[10]) == ("1.00", "1.00", "1.00")

    with out.open() as handle:
        written = list(csv.DictReader(handle))
    assert [(r["encoding"], int(r["length"])) for r in written] == [(r[0], int(r[2])) for r in rows]
    for row in written:
        assert row["status"] == "ok" and row["mem_kind"] in {"rss_hwm", "ru_maxrss", "cuda_max_allocated"}
        assert float(row["tokens_per_s"]) > 0 and float(row["peak_mem_mb"]) > 0
        if row["encoding"] == "nope":
            assert float(row["tokens_per_s_vs_nope"]) == 1.0
            assert float(row["peak_mem_vs_nope"]) == 1.0 and float(row["step_mem_vs_nope"]) == 1.0
        else:
            assert float(row["tokens_per_s_vs_nope"]) > 0 and float(row["peak_mem_vs_nope"]) > 0


@pytest.mark.slow
def test_frontier_methods_compose_as_the_study_does(tmp_path):
    out = tmp_path / "bench.csv"
    command = [sys.executable, str(SCRIPT), "--methods", "p_rope", "--lengths", "4", "--steps", "1", "--warmup", "0",
               "--device", "cpu", "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [(r[0], r[1]) for r in table_rows(result.stdout)] == [("nope", "sdpa"), ("p_rope", "sdpa")]
    refused = subprocess.run([*command[:3], "p_rpe"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "--methods: unknown ['p_rpe']; choose from ['alibi'," in refused.stderr


def test_ratios_divide_by_nope_at_the_same_length():
    bench = load_script()
    rows = [
        {"encoding": "nope", "length": 4, "status": "ok", "tokens_per_s": 100.0, "peak_mem_mb": 10.0,
         "step_mem_mb": 0.0},
        {"encoding": "rope", "length": 4, "status": "ok", "tokens_per_s": 50.0, "peak_mem_mb": 15.0,
         "step_mem_mb": 3.0},
        {"encoding": "rope", "length": 8, "status": "ok", "tokens_per_s": 50.0, "peak_mem_mb": 15.0,
         "step_mem_mb": 3.0},
        {"encoding": "t5", "length": 4, "status": "failed: boom"},
    ]
    bench.add_ratios(rows)
    assert (rows[0]["tokens_per_s_vs_nope"], rows[0]["peak_mem_vs_nope"]) == (1.0, 1.0)
    assert rows[0]["step_mem_vs_nope"] is None  # nope's zero: no ratio rather than a division by zero
    assert (rows[1]["tokens_per_s_vs_nope"], rows[1]["peak_mem_vs_nope"]) == (0.5, 1.5)
    assert rows[2]["tokens_per_s_vs_nope"] is None  # no nope row at length 8
    assert rows[3]["tokens_per_s_vs_nope"] is None


def test_unknown_encoding_is_refused():
    result = subprocess.run([sys.executable, str(SCRIPT), "--encodings", "nope,bogus"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "bogus" in result.stderr and "--encodings: unknown ['bogus']; choose from [" in result.stderr


@pytest.mark.parametrize("flag", [["--lengths", "4,x"], ["--lengths", "0,4"], ["--steps", "0"]])
def test_bad_options_are_refused(flag):
    result = subprocess.run([sys.executable, str(SCRIPT), "--encodings", "nope", *flag], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and flag[0] in result.stderr


@pytest.mark.slow
def test_block_views_are_timed_against_plain_slices(tmp_path):
    """131 tokens: two eager query blocks (128 and 3), so both ways of taking their views run."""
    out = tmp_path / "blocks.csv"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark_scale.py"), "blocks", "--lengths", "131",
                             "--encodings", "cope", "--rounds", "1", "--out", str(out)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    (row,) = csv.DictReader(out.open())
    assert (row["name"], row["backend"], row["tokens"]) == ("cope", "eager", "131")
    slices, views = float(row["slices_seconds_median"]), float(row["views_seconds_median"])
    assert slices > 0 and views > 0 and float(row["ratio_median"]) == pytest.approx(views / slices)
    assert table_rows(result.stdout)[0][:3] == ["cope", "eager", "131"]


@pytest.mark.slow
def test_profile_step_and_compile_probe_run_on_the_cpu(tmp_path):
    """scripts/profile_step.py names the step it profiled and tables its ops; scripts/compile_probe.py times each
    step of both modes and writes them (on the CPU graphs is the compiled graph alone)."""
    profiled = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_step.py"), "--encoding", "fire",
                               "--tokens", "32", "--tokens-per-step", "256", "--steps", "1", "--device", "cpu"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert profiled.returncode == 0, profiled.stderr[-2000:]
    assert "fire on sdpa, train.compile=false, 33 tokens x 7 sequences, 1 steps on cpu" in profiled.stdout
    assert "aten::searchsorted" in profiled.stdout or "aten::mm" in profiled.stdout  # ops of the step, tabled
    probe = tmp_path / "probe.csv"
    probed = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_probe.py"), "--modes", "false,true",
                             "--steps", "6", "--out", str(probe), "debug=smoke", "device=cpu"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert probed.returncode == 0, probed.stderr[-2000:]
    with probe.open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["mode"], r["step"]) for r in rows] == [(m, str(s)) for m in ("false", "true") for s in range(6)]
    assert rows[0]["first_of_length"] == "True" and all(float(r["seconds"]) > 0 for r in rows)
    assert [line.split()[0] for line in probed.stdout.splitlines()[1:]] == ["false", "true"]


def test_attention_costs_split_a_call_into_its_parts(tmp_path):
    """scripts/attention_costs.py times each part of a bias or decay method's attention call against nope's
    kernel on the same q, k, v, and writes the rows as it goes."""
    from scripts import attention_costs

    out = tmp_path / "costs.csv"
    rows = attention_costs.main(["--encodings", "alibi,fire,cope", "--tokens", "33", "--tokens-per-step", "128",
                                 "--device", "cpu", "--out", str(out)])
    parts = {name: [r["part"] for r in rows if r["encoding"] == name] for name in ("alibi", "fire", "cope")}
    assert parts["cope"] == ["nope", "eager, no hooks", "eager call"]  # a logit hook: eager's floor beside its call
    assert parts["alibi"] == ["nope", "sdpa, constant bias", "sdpa, bias gradient", "sdpa, decay in 17 columns",
                              "sdpa, decay in 24 columns", "sdpa call", "eager call"]  # heads of 16: d + 1, padded
    assert parts["fire"] == ["nope", "sdpa, constant bias", "sdpa, bias gradient", "bias alone",
                             "bias alone, dense MLP", "bias alone, segment sums by bincount", "sdpa call",
                             "eager call"]  # flex trains on CUDA only
    assert all(r["status"] == "ok" and r["ms"] > 0 and r["batch_size"] == 3 for r in rows)
    assert [r["times_nope"] for r in rows if r["part"] == "nope"] == [1.0, 1.0, 1.0]
    with out.open() as handle:
        assert [row["part"] for row in csv.DictReader(handle)] == [r["part"] for r in rows]


def test_fires_segment_sums_by_bincount_give_gathers_gradients():
    """attention_costs' histogram backward of fire's segment lookup is the same function with the same gradients."""
    from unittest import mock

    import torch

    from posbench.encodings import fire
    from scripts import attention_costs
    from tests.helpers import assert_close_scaled, make_encoding

    encoding = make_encoding("fire", d_model=16, max_positions=40).double()
    positions = torch.arange(40)[None]
    grad = torch.randn(1, 2, 40, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def bias_and_grads():
        encoding.zero_grad()
        bias = encoding.bias(positions, positions, 0)  # [1, H, L, L]
        bias.backward(grad)
        return bias.detach(), {n: p.grad.clone() for n, p in encoding.named_parameters() if p.grad is not None}

    gathered = bias_and_grads()
    with mock.patch.object(fire, "segment_rows", attention_costs.SegmentRows.apply):
        histogram = bias_and_grads()
    assert_close_scaled(histogram[0], gathered[0], rtol=0, atol_scale=1e-15, name="bias")
    assert gathered[1].keys() == histogram[1].keys() and len(gathered[1]) == 6  # MLP weights and biases, c, L
    for name, want in gathered[1].items():
        assert_close_scaled(histogram[1][name], want, rtol=1e-12, atol_scale=1e-12, name=name)
