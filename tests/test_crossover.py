"""backend=auto by measurement (posbench/attention/crossover.py): a crossover table names the fastest backend
per encoding, training mode and length; auto takes it for training at N and for each evaluation length, and
keeps its rule where the table has no row. On the CPU the table comes through POSBENCH_CROSSOVER."""
import csv

import pytest
import torch

from posbench.attention import crossover
from posbench.attention.select import FLEX_FROM_TOKENS, measured_backend, runnable
from posbench.build import build, plan_run
from tests.helpers import compose_cfg, make_encoding, posbench, read_rows

FIELDS = ["encoding", "backend", "mode", "tokens", "tokens_per_s", "vs_nope", "auto", "batch_size", "status"]


def write_table(path, rows) -> str:
    """rows: (encoding, backend, mode, tokens, tokens/s against nope's[, auto, status])."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        writer.writeheader()
        for encoding, backend, mode, tokens, speed, *rest in rows:
            auto, status = rest if rest else (False, "ok")
            writer.writerow({"encoding": encoding, "backend": backend, "mode": mode, "tokens": tokens,
                             "tokens_per_s": 1000 * speed, "vs_nope": speed, "auto": auto, "batch_size": 1, "status": status})
    crossover.read_table.cache_clear()
    return str(path)


# alibi: eager fastest at 33 tokens (the smoke run's N = 16), sdpa from 257 on; a failed and an auto row ignored
ALIBI = [("alibi", "eager", "eager", 33, 300.0), ("alibi", "sdpa", "eager", 33, 200.0),
         ("alibi", "eager", "eager", 257, 100.0), ("alibi", "sdpa", "eager", 257, 400.0),
         ("alibi", "flex", "eager", 257, 900.0, False, "failed: refused"), ("alibi", "eager", "eager", 257, 999.0, True, "ok"),
         ("alibi", "sdpa", "compiled", 33, 500.0), ("alibi", "eager", "compiled", 33, 100.0)]


def test_the_fastest_at_the_nearest_measured_length_among_the_backends_that_run_here(tmp_path):
    path = write_table(tmp_path / "t.csv", ALIBI)
    assert crossover.fastest((path,), "alibi", False, 40, ["sdpa", "eager"]) == "eager"
    assert crossover.fastest((path,), "alibi", False, 65, ["sdpa", "eager"]) == "eager"  # nearer 33 than 257 (log)
    assert crossover.fastest((path,), "alibi", False, 100, ["sdpa", "eager"]) == "sdpa"
    assert crossover.fastest((path,), "alibi", False, 10000, ["sdpa", "eager"]) == "sdpa"
    assert crossover.fastest((path,), "alibi", False, 33, ["sdpa"]) == "sdpa"  # eager cannot run here: not taken
    assert crossover.fastest((path,), "alibi", True, 33, ["sdpa", "eager"]) == "sdpa"  # train.compile=true's rows
    assert crossover.fastest((path,), "alibi", "static", 33, ["sdpa", "eager"]) is None  # no row: auto's rule
    assert crossover.fastest((path,), "t5", False, 33, ["sdpa", "eager"]) is None


def test_the_rules_backend_stays_unless_another_is_measured_clearly_faster(tmp_path):
    lead = crossover.MARGIN * 200.0
    path = write_table(tmp_path / "t.csv", [("t5", "eager", "eager", 33, lead), ("t5", "sdpa", "eager", 33, 200.0),
                                            ("t5", "eager", "eager", 257, lead + 1), ("t5", "sdpa", "eager", 257, 200.0)])
    assert crossover.fastest((path,), "t5", False, 33, ["sdpa", "eager"], rule="sdpa") == "sdpa"  # within the margin
    assert crossover.fastest((path,), "t5", False, 257, ["sdpa", "eager"], rule="sdpa") == "eager"  # past it
    assert crossover.fastest((path,), "t5", False, 33, ["sdpa", "eager"]) == "eager"  # no rule: the fastest
    assert crossover.fastest((path,), "t5", False, 33, ["sdpa", "eager"], rule="flex") == "eager"  # rule unmeasured


def test_flex_runs_evaluation_only_on_the_cpu_and_never_inside_dynamic_shapes():
    alibi = make_encoding("alibi", d_model=32)
    assert runnable(alibi, "cpu", training=True, dynamic_compile=False, windowed=False) == ["eager", "sdpa"]
    assert runnable(alibi, "cpu", training=False, dynamic_compile=False, windowed=False) == ["eager", "sdpa", "flex"]
    assert "flex" not in runnable(alibi, "cuda", training=True, dynamic_compile=True, windowed=False)
    assert "flex" in runnable(alibi, "cuda", training=True, dynamic_compile=False, windowed=False)
    assert runnable(make_encoding("cope"), "cpu", training=True, dynamic_compile=False, windowed=False) == ["eager"]
    assert "flex" not in runnable(alibi, "cuda", training=False, dynamic_compile=False, windowed=True)


def test_auto_takes_the_table_for_training_and_each_evaluation_length(tmp_path, monkeypatch):
    monkeypatch.setenv(crossover.TABLE_ENV, write_table(tmp_path / "t.csv", ALIBI))
    built = build(compose_cfg("debug=smoke", "encoding=alibi", "eval.ratios=[1,8]"), torch.device("cpu"))
    assert built.backend == "eager"  # 33 tokens at N
    assert built.eval_backends == {16: "eager", 128: "sdpa"}  # 33 and 257 tokens
    named = build(compose_cfg("debug=smoke", "encoding=alibi", "backend=sdpa"), torch.device("cpu"))
    assert named.backend == "sdpa" and named.eval_backends == {}  # a backend named outright is kept
    other = build(compose_cfg("debug=smoke", "encoding=t5"), torch.device("cpu"))
    assert other.backend == "sdpa" and set(other.eval_backends.values()) == {"sdpa"}  # no row: the rule


def test_a_run_records_the_backend_of_each_length_and_measures_what_the_rule_measures(tmp_path):
    table = write_table(tmp_path / "t.csv", ALIBI)
    common = ["debug=smoke", "device=cpu", "encoding=alibi", "eval.ratios=[1,8]", "eval.samples=16"]
    printed = posbench(*common, f"hydra.run.dir={tmp_path / 'table'}", env={crossover.TABLE_ENV: table}).stdout
    posbench(*common, "backend=eager", f"hydra.run.dir={tmp_path / 'eager'}")
    by_table, by_eager = read_rows(tmp_path / "table"), read_rows(tmp_path / "eager")
    assert [(r["backend"], r["eval_backend"]) for r in by_table] == [("eager", "eager"), ("eager", "sdpa")]
    assert [(r["backend"], r["eval_backend"]) for r in by_eager] == [("eager", "eager"), ("eager", "eager")]
    assert {r["backend_table"] for r in by_table} == {table} and {r["backend_table"] for r in by_eager} == {None}
    assert f"backend=auto: eager for training, by the crossover measurements of {table}" in printed
    # the same training; sdpa and eager evaluate the same model to float differences
    assert [r["loss"] for r in by_table] == pytest.approx([r["loss"] for r in by_eager], rel=1e-5)
    assert [r["data_fingerprint"] for r in by_table] == [r["data_fingerprint"] for r in by_eager]


def write_device(folder, rows, capability: str | None) -> None:
    folder.mkdir(parents=True)
    write_table(folder / crossover.TABLE_FILE, rows)
    if capability is not None:
        (folder / crossover.DEVICE_FILE).write_text(f"name,capability\n{folder.name},{capability}\n")


def test_a_device_reads_its_own_table_then_those_of_its_compute_capability_and_no_other(tmp_path):
    write_device(tmp_path / "gpu-b", ALIBI, "9.0")
    write_device(tmp_path / "gpu-a", ALIBI, "8.0")
    write_device(tmp_path / "gpu-c", ALIBI, "9.0")
    write_device(tmp_path / "gpu-d", ALIBI, None)  # no device.csv: its own device's table only
    own = crossover.table_for("GPU D", "9.0", tmp_path)
    assert (own.source, own.same_device) == ("gpu-d+gpu-b+gpu-c", True)
    shared = crossover.table_for("GPU E", "9.0", tmp_path)
    assert (shared.source, shared.same_device) == ("gpu-b+gpu-c", False)  # every one of its capability, by name
    assert shared.paths == (tmp_path / "gpu-b" / crossover.TABLE_FILE, tmp_path / "gpu-c" / crossover.TABLE_FILE)
    assert crossover.table_for("GPU C", "9.0", tmp_path).source == "gpu-c+gpu-b"  # its own first
    assert crossover.table_for("GPU E", "8.0", tmp_path).source == "gpu-a"
    assert crossover.table_for("GPU E", "8.6", tmp_path) is None  # another capability: auto's rule


def test_a_devices_own_rows_stand_and_another_tables_fill_what_it_did_not_measure(tmp_path):
    """A first call on a device measured sdpa alone: flex's rows come from a device of its capability, compared
    by their ratios to nope (each call's own nope), not by tokens/s."""
    own = write_table(tmp_path / "own.csv", [
        ("alibi", "sdpa", "eager", 33, 0.9), ("alibi", "sdpa", "eager", 8193, 0.3),
        ("alibi", "flex", "eager", 8193, 0.2, False, "failed: out of time")])
    other = write_table(tmp_path / "other.csv", [
        ("alibi", "sdpa", "eager", 33, 0.1), ("alibi", "flex", "eager", 33, 0.6),
        ("alibi", "sdpa", "eager", 8193, 0.9), ("alibi", "flex", "eager", 8193, 0.6)])
    both = (own, other)
    assert crossover.fastest(both, "alibi", False, 33, ["sdpa", "flex"]) == "sdpa"  # its own 0.9 over 0.6
    assert crossover.fastest(both, "alibi", False, 8192, ["sdpa", "flex"]) == "flex"  # its sdpa 0.3, the other's flex
    assert crossover.fastest((other, own), "alibi", False, 8192, ["sdpa", "flex"]) == "sdpa"  # the first file stands
    with open(own, "a") as handle:  # a row without nope's ratio (nope failed in its call) is no candidate
        handle.write("alibi,eager,eager,33,9999999,,False,1,ok\n")
    crossover.read_table.cache_clear()
    assert crossover.fastest(both, "alibi", False, 33, ["sdpa", "flex", "eager"]) == "sdpa"


def test_an_h200_follows_the_committed_h100_table(monkeypatch):
    """The H100's table (sm_90) is the H200's, which has none: at a few tokens alibi trains on sdpa, where the
    rule's flex made 4-11 steps a second on an H200, and from about 1,025 tokens it evaluates on flex."""
    monkeypatch.delenv(crossover.TABLE_ENV, raising=False)
    monkeypatch.setattr(crossover, "cuda_identity", lambda device: ("NVIDIA H200", "9.0"))
    built = build(compose_cfg("debug=smoke", "encoding=alibi", "eval.ratios=[1,64]"), torch.device("cpu"))
    assert built.backend_table == "nvidia-h100-80gb-hbm3"
    assert built.backend == "sdpa"  # 33 tokens: sdpa 6.6M tokens/s, flex 4.4M (and eager refused there)
    assert built.eval_backends == {16: "sdpa", 1024: "flex"}  # 2,049 tokens, nearest 1,025: flex 2.11M, sdpa 1.82M
    monkeypatch.setattr(crossover, "cuda_identity", lambda device: ("NVIDIA A100-SXM4-80GB", "8.0"))
    assert crossover.device_table("cpu") is None  # no table of sm_80: the rule
    monkeypatch.setattr(crossover, "cuda_identity", lambda device: ("NVIDIA H100 80GB HBM3", "9.0"))
    assert crossover.device_table("cpu").same_device


def test_posbench_crossover_none_keeps_the_rule(monkeypatch):
    monkeypatch.setenv(crossover.TABLE_ENV, crossover.NO_TABLE)
    monkeypatch.setattr(crossover, "cuda_identity", lambda device: ("NVIDIA H100 80GB HBM3", "9.0"))
    built = build(compose_cfg("debug=smoke", "encoding=alibi", "eval.ratios=[1,64]"), torch.device("cpu"))
    assert (built.backend, built.eval_backends, built.backend_table) == ("sdpa", {}, None)


def test_every_committed_table_names_its_devices_compute_capability():
    folders = [p.parent for p in crossover.TABLES.glob(f"*/{crossover.TABLE_FILE}")]
    assert folders
    for folder in folders:
        assert crossover.measured_capability(folder) is not None, f"{folder} lacks {crossover.DEVICE_FILE}"


def test_without_a_table_auto_on_cuda_takes_flex_from_flex_from_tokens_and_sdpa_below(monkeypatch):
    """The rule by length (planned for CUDA on the meta device: nothing runs there): alibi trains on sdpa at
    129 tokens and evaluates on flex from 2,049; kerple trains on sdpa at any length; t5 has no flex at all."""
    monkeypatch.setenv(crossover.TABLE_ENV, crossover.NO_TABLE)
    cuda = torch.device("cuda")
    alibi = make_encoding("alibi", d_model=32)
    assert measured_backend("auto", alibi, cuda, FLEX_FROM_TOKENS - 1).name == "sdpa"
    assert measured_backend("auto", alibi, cuda, FLEX_FROM_TOKENS).name == "flex"
    assert measured_backend("flex", alibi, cuda, 33).name == "flex"  # named outright: kept
    assert measured_backend("auto", alibi, "cpu", 8192).name == "sdpa"  # the CPU: sdpa at every length
    short = plan_run(compose_cfg("encoding=alibi", "train.length=64", "eval.ratios=[1,4,16]"), cuda)
    assert (short.backend, short.eval_backends) == ("sdpa", {64: "sdpa", 256: "sdpa", 1024: "flex"})
    long = plan_run(compose_cfg("encoding=alibi", "train.length=1024", "eval.ratios=[1]"), cuda)
    assert (long.backend, long.eval_backends) == ("flex", {1024: "flex"})
    kerple = plan_run(compose_cfg("encoding=kerple", "train.length=1024", "eval.ratios=[1,4]"), cuda)
    assert (kerple.backend, kerple.eval_backends) == ("sdpa", {1024: "flex", 4096: "flex"})
    t5 = plan_run(compose_cfg("encoding=t5", "train.length=1024", "eval.ratios=[1,4]"), cuda)
    assert (t5.backend, set(t5.eval_backends.values())) == ("sdpa", {"sdpa"})
