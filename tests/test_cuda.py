"""The GPU paths, where a CUDA device is present (skipped with that reason elsewhere): every encoding, on the
backend the runner picks for it on CUDA (compiled flex for biases and decays with a score_mod), gives the
logits and gradients of the float64 eager model on the CPU; a run on cuda records device memory, and bf16
autocast trains to finite losses."""
import copy
import importlib.util
import math

import pytest
import torch

from posbench.attention import get_backend
from posbench.model import ModelConfig, Transformer
from tests.helpers import ENCODING_CASES, posbench, positions_for, read_rows, trained_looking_model, with_layouts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CUDA = torch.device("cuda")
FLA_MISSING = importlib.util.find_spec("fla") is None  # backend=fla's kernels: pip install 'posbench[fla]'


def on_cuda(reference: Transformer, causal: bool, heads: int, backend: str = "auto") -> Transformer:
    """The reference model's weights in float32 on CUDA, on the backend `auto` picks there (or the one named)."""
    encoding = copy.deepcopy(reference.encoding).float().to(CUDA)
    cfg = ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=heads, causal=causal)
    model = Transformer(cfg, encoding, get_backend(backend, encoding, CUDA)).to(CUDA)
    model.load_state_dict(reference.state_dict())
    return model


def loss_and_grads(model: Transformer, ids: torch.Tensor, pos: torch.Tensor, targets: torch.Tensor):
    logits = model(ids, pos)  # [B, L, V]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return logits.detach().double().cpu(), {name: p.grad.double().cpu() for name, p in model.named_parameters()
                                            if p.grad is not None}


def compare_with_the_cpu_reference(case, causal: bool, heads: int, backend: str = "auto") -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 products, so the comparison is the backend's
    torch.backends.cudnn.allow_tf32 = False
    reference = trained_looking_model(case, "eager", causal, heads=heads)
    model = on_cuda(reference, causal, heads, backend)
    gen = torch.Generator().manual_seed(4)
    ids, targets = torch.randint(0, 11, (2, 2, 24), generator=gen)  # 24 tokens: a 4 x 6 grid for 2-D encodings
    pos = positions_for(reference.encoding, 24)
    want_logits, want_grads = loss_and_grads(reference, ids, pos, targets)
    got_logits, got_grads = loss_and_grads(model, ids.to(CUDA), pos.to(CUDA), targets.to(CUDA))
    backend = type(model.blocks[0].attn.backend).__name__
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4, msg=lambda m: f"{backend}: {m}")
    assert got_grads.keys() == want_grads.keys()
    for name, want in want_grads.items():  # each gradient within 0.5% of its own size (float32)
        error = (got_grads[name] - want).norm() / want.norm().clamp_min(1e-6)
        assert error < 5e-3, f"{backend}: {name} gradient off by {error:.2e} of its norm"


@pytest.mark.parametrize("heads", [2, 4])  # heads of 16 features (flex where it can) and of 8 (never flex)
@pytest.mark.parametrize("case,causal", with_layouts(ENCODING_CASES))
def test_the_cuda_backend_gives_the_cpu_reference(case, causal, heads):
    compare_with_the_cpu_reference(case, causal, heads)


@pytest.mark.skipif(FLA_MISSING, reason="fla-core is not installed: pip install 'posbench[fla]'")
@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("name", ["alibi", "fox", "nope", "stick_breaking", "path", "composite:path+fox"])
def test_fla_gives_the_cpu_reference(name, heads, monkeypatch):
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")  # float32 products in the Triton kernels too (TF32 otherwise)
    compare_with_the_cpu_reference(name, True, heads, backend="fla")


@pytest.mark.parametrize("heads", [1, 2, 4])  # heads of 32, 16 and 8 features
@pytest.mark.parametrize("name", ["cope", "composite:cope+rope", "dape", "dape?base=alibi", "dape?base=rope", "kerple",
                                  "t5", "sandwich", "composite:kerple+rope", "schedule?pattern=[t5,rope]", "fire",
                                  "composite:fire+rope"])
def test_posbenchs_kernels_give_the_cpu_reference(name, heads):
    """backend=fla runs CoPE, DAPE v1, a bias of i - j alone and FIRE on posbench's own Triton kernels
    (posbench.attention.cope_kernel, dape_kernel, relative_bias_kernel, fire_kernel): Triton alone."""
    compare_with_the_cpu_reference(name, True, heads, backend="fla")


@pytest.mark.parametrize("heads", [1, 2, 4])  # heads of 32, 16 and 8 features: the decay's column padded to 40, 24, 16
@pytest.mark.parametrize("name", ["alibi", "fox"])
def test_sdpa_with_the_decay_padded_to_a_multiple_of_8_gives_the_cpu_reference(name, heads):
    compare_with_the_cpu_reference(name, True, heads, backend="sdpa")


@pytest.mark.parametrize("encoding,precision,heads,backend", [
    ("alibi", "fp32", 1, "flex"), ("alibi", "fp32", 2, "sdpa"), ("kerple", "bf16", 1, "flex"), ("fox", "fp32", 1, "flex"),
    ("t5", "bf16", 1, "sdpa"), ("rope", "bf16", 2, "sdpa"), ("cope", "bf16", 2, "eager")])  # heads of 16 or 8 features
def test_a_run_on_cuda_records_device_memory(encoding, precision, heads, backend, tmp_path):
    # the backend named outright: auto follows the device's crossover table, which may pick another one
    posbench(f"encoding={encoding}", "task=copy", "debug=smoke", "device=cuda", f"train.precision={precision}",
             f"model.n_heads={heads}", f"backend={backend}", f"hydra.run.dir={tmp_path}")
    rows = read_rows(tmp_path)
    assert [row["eval_length"] for row in rows] == [16, 32]
    for row in rows:
        assert (row["status"], row["device"], row["backend"], row["mem_kind"]) == ("ok", "cuda", backend,
                                                                                   "cuda_max_allocated")
        assert math.isfinite(row["loss"]) and row["peak_mem_mb"] > 0


@pytest.mark.parametrize("case", ["t5", "fire", "composite:rope+t5", "composite:fire+rope"])
def test_training_an_encoding_flex_cannot_differentiate_is_refused(case):
    reference = trained_looking_model(case, "eager", heads=2)
    encoding = copy.deepcopy(reference.encoding).float().to(CUDA)
    cfg = ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=2, causal=True)
    model = Transformer(cfg, encoding, get_backend("flex")).to(CUDA)
    ids = torch.randint(0, 11, (2, 24), device=CUDA)
    with pytest.raises(ValueError, match=f"backend=flex cannot train encoding {encoding.name} on CUDA"):
        model(ids, torch.arange(24, device=CUDA)[None])


def test_a_seeds_gpu_run_trains_and_evaluates_on_the_cpu_runs_sequences(tmp_path):
    """Data are drawn on the CPU for every device: the rows' fingerprints agree, and so do the scores up to
    float differences (a short run, before trajectories can part)."""
    rows = {}
    for device in ("cpu", "cuda"):
        posbench("debug=smoke", f"device={device}", "train.steps=10", f"hydra.run.dir={tmp_path / device}")
        rows[device] = read_rows(tmp_path / device)
    assert [r["data_fingerprint"] for r in rows["cuda"]] == [r["data_fingerprint"] for r in rows["cpu"]]
    assert [r["loss"] for r in rows["cuda"]] == pytest.approx([r["loss"] for r in rows["cpu"]], rel=1e-3)


@pytest.mark.parametrize("encoding,mode", [("alibi", "static"), ("alibi", "graphs"), ("rope", "graphs"),
                                           ("cope", "graphs")])
def test_a_compiled_mode_trains_on_cuda_to_the_uncompiled_losses(encoding, mode, tmp_path):
    """train.compile=static lets flex train in a graph (fixed shapes); graphs replays CUDA graphs, of a graph
    per shape with flex (alibi) and of one dynamic graph otherwise (cope on eager, rope on sdpa)."""
    common = ["debug=smoke", "device=cuda", f"encoding={encoding}", "model.d_model=32", "train.lengths=fixed",
              "train.steps=8", "eval.ratios=[1]", *(["backend=flex"] if encoding == "alibi" else [])]
    losses = {}
    for compile_mode in ("false", mode):
        posbench(*common, f"train.compile={compile_mode}", f"hydra.run.dir={tmp_path / compile_mode}", timeout=600)
        rows = read_rows(tmp_path / compile_mode)
        assert rows[0]["status"] == "ok"
        losses[compile_mode] = rows[0]["loss"]
        if encoding == "alibi":
            assert rows[0]["backend"] == "flex"
    assert losses[mode] == pytest.approx(losses["false"], rel=1e-3)


@pytest.mark.parametrize("encoding,backend,precision", [
    ("rope", "auto", "fp32"), ("alibi", "auto", "fp32"), ("cope", "auto", "fp32"), ("drope", "auto", "fp32"),
    ("cope", "fla", "fp32"), ("kerple", "fla", "fp32"), ("rope", "auto", "bf16")])
def test_the_captured_step_trains_on_cuda_to_the_uncompiled_losses(encoding, backend, precision, tmp_path):
    """train.compile=capture: a CUDA graph per training length (uniform lengths: several shapes) and, for drope,
    per phase (the drop at half the steps), replayed; the same losses as the uncompiled run on the GPU. On fla,
    posbench's CoPE and relative bias kernels (the bias rows over the training offsets: no read on the host).
    Under bf16 autocast the weights' casts are recorded with the step (precision a user trains small models in on
    a GPU); the capturable AdamW's bias corrections, tensors on the device, move bf16's roundings: losses to 2%."""
    common = ["debug=smoke", "device=cuda", f"encoding={encoding}", f"backend={backend}", "model.d_model=32",
              "train.steps=30", "eval.ratios=[1,2]", f"train.precision={precision}",
              *(["encoding.drop_at=0.5"] if encoding == "drope" else [])]
    rows = {}
    for compile_mode in ("false", "capture"):
        posbench(*common, f"train.compile={compile_mode}", f"hydra.run.dir={tmp_path / compile_mode}", timeout=300)
        rows[compile_mode] = read_rows(tmp_path / compile_mode)
        assert [r["status"] for r in rows[compile_mode]] == ["ok", "ok"]
    rel = 1e-4 if precision == "fp32" else 2e-2
    assert [r["loss"] for r in rows["capture"]] == pytest.approx([r["loss"] for r in rows["false"]], rel=rel)


def test_auto_on_this_device_reads_its_tables_by_name_and_compute_capability(tmp_path):
    """The device's name and capability as torch reads them pick the committed tables (its own, then those of its
    capability: an H200 the H100's), and a run names them in its rows and its first lines."""
    from posbench.attention import crossover

    major, minor = torch.cuda.get_device_capability(CUDA)
    table = crossover.table_for(torch.cuda.get_device_name(CUDA), f"{major}.{minor}")
    if (major, minor) == (9, 0):  # Hopper: the H100's table is committed
        assert table is not None and "nvidia-h100-80gb-hbm3" in table.source.split("+")
    printed = posbench("encoding=alibi", "debug=smoke", "device=cuda", "train.steps=2", f"hydra.run.dir={tmp_path}",
                       env={crossover.TABLE_ENV: ""}).stdout  # the committed tables, whatever the caller set
    rows = read_rows(tmp_path)
    assert {row["backend_table"] for row in rows} == {table.source if table else None}
    assert (f"by the crossover measurements of {table.source}" in printed) == (table is not None)
    if table is None or table.source == "nvidia-h100-80gb-hbm3":  # the rule or the H100's: sdpa at 33 and 65 tokens
        assert {(row["backend"], row["eval_backend"]) for row in rows} == {("sdpa", "sdpa")}
