"""Helpers shared by the test modules (fixtures live in conftest.py): configs composed as Hydra
composes them, `python -m posbench` in a subprocess and the rows it writes, encodings and small
models built as the runner builds them."""
import importlib.metadata
import importlib.util
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict
from packaging.version import Version

from posbench.attention import get_backend
from posbench.encodings import REGISTRY, Encoding, ModelDims
from posbench.model import ModelConfig, Transformer
from posbench.runinfo import config_hash, group_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"


# --- configs ------------------------------------------------------------------------------------
# python -c KILLER PHASE AT SIGNAL RANK overrides...: posbench, sending itself SIGNAL at the AT-th training
# step (PHASE train) or evaluated length (PHASE eval) of the process of torchrun rank RANK (any: every
# process), so the point of the kill is exact
KILLER = """
import os, signal, sys
import posbench.runner as runner
import posbench.training as training
phase, at, name, rank = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
# patched where the run looks it up: training.train calls train_step, runner.run_built calls evaluate
module, attribute = (training, "train_step") if phase == "train" else (runner, "evaluate")
target = getattr(module, attribute)
calls = 0
def killing(*args, **kwargs):
    global calls
    calls += 1
    if calls == at and rank in ("any", os.environ.get("RANK", "0")):
        os.kill(os.getpid(), getattr(signal, name))
    return target(*args, **kwargs)
setattr(module, attribute, killing)
sys.argv = ["posbench", *sys.argv[5:]]
import runpy
runpy.run_module("posbench", run_name="__main__", alter_sys=True)
"""

def options(group: str) -> list[str]:
    """The options of a config group: the names of its YAML files."""
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def compose_cfg(*overrides: str):
    """The config of a single run with these overrides, ${hydra:...} resolved, the hydra section removed."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # resolves ${hydra:...} as in a real run
    with open_dict(cfg):
        del cfg.hydra
    return cfg


def multirun_config(*overrides: str):
    """The config `python -m posbench -m <overrides>` composes, hydra section included."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return GlobalHydra.instance().config_loader().load_configuration(
            "config", list(overrides), run_mode=RunMode.MULTIRUN)


def assert_runs_compose_to_their_hashes(runs: list[Path]) -> list[dict]:
    """Each committed sweep run's overrides compose today to the group hash its rows carry; returns each run's
    first row. The seed is not part of a group (runinfo.NOT_RESULT_KEYS) and no config reads it, so the runs
    of one group that differ only in their seed are composed once."""
    hashes, rows = {}, []
    for run in runs:
        overrides = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())
        group = tuple(sorted(o for o in overrides if not o.startswith("seed=")))
        if group not in hashes:
            cfg = multirun_config(*overrides)
            with open_dict(cfg):
                del cfg["hydra"]
            assert "${seed" not in OmegaConf.to_yaml(cfg), "a config reads the seed: compose every run"
            hashes[group] = config_hash(group_config(OmegaConf.to_container(cfg, resolve=True)))
        row = json.loads((run / "results.jsonl").read_text().splitlines()[0])
        assert hashes[group] == row["config_hash"], run.name
        rows.append(row)
    return rows


def sweep_values(params, key: str) -> list[str]:
    """The values a sweeper param expands to, globs included (they need Hydra's config loader)."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
        (override,) = parser.parse_overrides([f"{key}={params[key]}"])
        return sorted(override.sweep_string_iterator())


def write_wikitext_release(folder: Path, splits=("train", "valid", "test"), lines: int = 20) -> Path:
    """A small local WikiText release (tokenized format) in `folder`: the hub is out of reach in tests."""
    folder.mkdir(parents=True, exist_ok=True)
    for split in splits:
        (folder / f"wiki.{split}.tokens").write_text(" = Title = \n the cat sat on the mat . \n" * lines)
    return folder


# --- runs in a subprocess -----------------------------------------------------------------------

def posbench(*args: str, env: dict | None = None, module: str = "posbench", entry: list[str] | None = None,
             check: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` from the repository root, wandb disabled unless `env` sets WANDB_MODE.
    entry: the interpreter's arguments in place of `-m <module>` (a `-c` script). check: the run must exit 0
    (the tails of its output in the message)."""
    command = [sys.executable, *(entry if entry is not None else ["-m", module]), *args]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "WANDB_MODE": "disabled", **(env or {})})
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def read_rows(run_dir: Path) -> list[dict]:
    """The rows of a run directory's results.jsonl."""
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]


# --- encodings and models -----------------------------------------------------------------------

def make_encoding(name: str, causal: bool = True, n_heads: int = 2, d_model: int = 16, max_positions: int = 64,
                  **params):
    """An encoding built as the runner builds it; a 2-D one (position_dims = 2, or a composite of 2-D parts)
    as for a grid task of sides up to isqrt(max_positions), whose raster ids then fill max_positions."""
    names = [name, *params.get("parts", ())]
    side = math.isqrt(max_positions) if any(getattr(REGISTRY.get(n), "position_dims", 1) == 2 for n in names) else 0
    dims = ModelDims(d_model=d_model, n_heads=n_heads, n_layers=2, max_positions=max_positions,
                     train_positions=max_positions, causal=causal, vocab_size=11, max_side=side, train_side=side)
    return REGISTRY[name](dims, **params)


def grid_positions(height: int, width: int, row: int = 0, col: int = 0) -> torch.Tensor:
    """(row, column) of an H x W grid in raster order, starting at (row, col): [1, H*W, 2]."""
    rows, cols = torch.meshgrid(torch.arange(height) + row, torch.arange(width) + col, indexing="ij")
    return torch.stack((rows, cols), dim=-1).flatten(0, 1)[None]  # [1, H*W, 2]


# composites whose traits their class does not tell: rotations beside content terms (not
# relative), beside biases and each other part kind, absolute parts, parts in either order
COMPOSITE_PARTS = (("rope", "t5"), ("rope", "tener"), ("tener", "rope"), ("rope", "shaw"), ("rope", "deberta"),
                   ("xpos", "transformer_xl"), ("xpos", "alibi"), ("rope", "urpe"), ("alibi", "shaw"),
                   ("shaw", "tener"), ("nope", "kerple"), ("fire", "rope"), ("learned", "alibi"),
                   ("complex_order", "t5"), ("rope_2d", "t5_2d"), ("rope", "cope"), ("rope", "ssmax"),
                   ("alibi", "fox"))
# the built instances the trait tests run over: every registered encoding with its defaults, and those composites
ENCODING_CASES = (*sorted(REGISTRY), *(f"composite:{'+'.join(parts)}" for parts in COMPOSITE_PARTS))


def with_layouts(cases) -> list[tuple[str, bool]]:
    """(case, causal) for both layouts, but only the causal one for an encoding that refuses the other
    (causal_only: its refusal is tested with it)."""
    return [(case, causal) for case in cases for causal in (True, False)
            if causal or not REGISTRY[case.partition(":")[0]].causal_only]


def make_case(case: str, **kwargs):
    """The encoding of an ENCODING_CASES entry: a registered name, or composite:part+part; either may end in
    ?key=value&key=value, the encoding's parameters (values read as YAML), e.g. dape?base=alibi&mlp_width=8."""
    case, _, query = case.partition("?")
    params = {key: yaml.safe_load(value) for key, value in (pair.split("=", 1) for pair in query.split("&") if query)}
    name, _, parts = case.partition(":")
    return make_encoding(name, **kwargs, **params, **({"parts": parts.split("+")} if parts else {}))


def positions_for(encoding: str | Encoding, length: int, shift: int = 0) -> torch.Tensor:
    """Positions of `length` tokens as an encoding (a registered name or a built instance) reads them:
    ids [1, L] shifted by `shift`, or for a 2-D encoding the H x W grid with H*W = L, H the largest
    divisor <= sqrt(L), shifted by (shift, 2 * shift + 1) when shift != 0 (rows and columns by
    different amounts)."""
    if (REGISTRY[encoding] if isinstance(encoding, str) else encoding).position_dims == 1:
        return torch.arange(length)[None] + shift
    height = max(h for h in range(1, math.isqrt(length) + 1) if length % h == 0)
    return grid_positions(height, length // height, shift, 2 * shift + 1 if shift else 0)


def trained_looking_model(case: str, backend: str = "eager", causal: bool = True, window=None,
                          heads: int = 4) -> Transformer:
    """A float64 model (2 layers, d_model 32, `heads` heads; model.window `window`) of an ENCODING_CASES entry
    whose encoding parameters are drawn (seed 0, std 0.3): trained-looking values, not the zero / one
    initialisations."""
    torch.manual_seed(0)
    enc = make_case(case, causal=causal, d_model=32, n_heads=heads, max_positions=64)
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.3)
    cfg = ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=heads, causal=causal, window=window)
    return Transformer(cfg, enc, get_backend(backend, enc)).double()


def rope_dims(heads: int, head_dim: int, train_positions: int = 64) -> ModelDims:
    """One layer of `heads` heads of head_dim features, positions up to 8x train_positions (rope tests)."""
    return ModelDims(d_model=heads * head_dim, n_heads=heads, n_layers=1, max_positions=8 * train_positions,
                     train_positions=train_positions)


def random_qk(heads: int, length: int, head_dim: int, dtype=torch.float64, seed: int = 0):
    """Queries and keys [2, heads, length, head_dim] drawn from N(0, 1) with their own generator."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, heads, length, head_dim)
    return torch.randn(shape, generator=gen, dtype=dtype), torch.randn(shape, generator=gen, dtype=dtype)


def assert_close_scaled(got: torch.Tensor, expected: torch.Tensor, rtol: float | None = None,
                        atol_scale: float | None = None, name: str = "", ulps: float | None = None) -> None:
    """assert_close with an absolute tolerance of atol_scale (default rtol) times the largest |expected|
    (at least 1): float error grows with the values, so a fixed bound on large values fails on other CPUs
    (another BLAS path). Give rtol, or ulps: rtol = atol_scale = ulps * eps of the dtype got was computed
    in (a lower-precision got is compared in expected's dtype), for a bound derived from the computation:
    a few ulps per rounding step, times the length of a reduction where there is one (a dot product over
    d features: ~d). A failure names the tensor, its worst element and both values."""
    assert (rtol is None) != (ulps is None), "give rtol or ulps"
    if ulps is not None:
        rtol = ulps * torch.finfo(got.dtype).eps
        got = got.to(expected.dtype)
    scale = float(expected.detach().abs().max().clamp(min=1))
    atol = (rtol if atol_scale is None else atol_scale) * scale

    def message(generated: str) -> str:
        g, e = got.detach(), expected.detach()
        if g.shape != e.shape or g.dtype != e.dtype:  # assert_close says which
            return f"{name}: {generated}"
        excess = ((g - e).abs() - (atol + rtol * e.abs())).masked_fill(g == e, -math.inf)  # past its tolerance
        worst = tuple(int(i) for i in torch.unravel_index(excess.nan_to_num(math.inf).argmax(), e.shape))
        return (f"{name}: {generated}\nworst against its tolerance at {worst}: got {g[worst].item()!r}, "
                f"expected {e[worst].item()!r}")

    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=message)


def assert_chunks_equal_one_pass(net: Transformer, tokens, pos, chunks, atol_scale: float = 1e-12) -> None:
    """Evaluation in chunks of queries gives the logits of one pass, for every chunk size."""
    reference = net(tokens, pos)
    for chunk in chunks:
        net.set_eval_chunk(chunk)
        assert_close_scaled(net(tokens, pos), reference, rtol=0, atol_scale=atol_scale, name=f"chunk {chunk}")
    net.set_eval_chunk(None)


def assert_recurrence_equals_one_pass(net: Transformer, tokens, atol_scale: float = 1e-12) -> None:
    """Two segments, the second reading the first as memory (chunked), give the logits of one pass over both."""
    half = tokens.shape[1] // 2
    full = net(tokens, torch.arange(tokens.shape[1])[None])
    net.set_eval_chunk(4)
    first, memory = net.forward_recurrent(tokens[:, :half], None, memory_length=half)
    second, _ = net.forward_recurrent(tokens[:, half:], memory, memory_length=half)
    assert_close_scaled(torch.cat([first, second], 1), full, rtol=0, atol_scale=atol_scale, name="logits")


def assert_query_blocks_give_one_pass_gradients(make_net, tokens, monkeypatch, rtol=1e-9, atol_scale=1e-12) -> None:
    """Training in eager query blocks of 6 gives every parameter the gradient of one pass (gradients reach
    hundreds: the absolute tolerance scales with each one's largest entry)."""
    from posbench.attention import eager

    def grads(block):
        monkeypatch.setattr(eager, "EAGER_TRAIN_BLOCK", block)
        net = make_net().train()
        net(tokens, torch.arange(tokens.shape[1])[None]).sin().sum().backward()
        return {name: p.grad for name, p in net.named_parameters()}

    one, blocked = grads(10**9), grads(6)
    for name, grad in one.items():
        assert_close_scaled(blocked[name], grad, rtol=rtol, atol_scale=atol_scale, name=name)


def drawn_model(name: str, causal: bool = True, dtype=torch.float64, seed: int = 0, **params) -> Transformer:
    """A 2-layer model (d_model 32, 4 heads, backend auto) of encoding `name` whose parameters are drawn
    N(0, 0.5) (seed `seed`): gates and tables far from their initial values."""
    torch.manual_seed(seed)
    enc = make_encoding(name, causal=causal, d_model=32, n_heads=4, **params)
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.5)
    cfg = ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=4, causal=causal)
    return Transformer(cfg, enc, get_backend("auto", enc)).to(dtype)


def token_ids(length: int = 20, batch: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 11, (batch, length), generator=torch.Generator().manual_seed(seed))


def wandb_records(path: Path):
    """The records of a .wandb file. wandb (0.31) writes no files/wandb-summary.json in offline
    mode; the .wandb file is its log: a 7-byte header, then LevelDB-log chunks (crc32, length,
    type) in 32 KiB blocks, each record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


NO_TRITON = importlib.util.find_spec("triton") is None  # posbench's kernels (and fla-core's) need it: Linux wheels


def interpreter_refusal() -> str | None:
    """Why Triton's interpreter cannot run the kernels here, or None. Before Triton 3.7 it reads a loop bound held
    in a tensor with int() of a one-element array, an error since numpy 2.4; torch 2.11's CUDA wheels pin Triton
    3.6."""
    if NO_TRITON:
        return "triton is not installed (CUDA builds of torch ship it)"
    triton, numpy = importlib.metadata.version("triton"), importlib.metadata.version("numpy")
    if Version(triton).release < (3, 7) and Version(numpy).release >= (2, 4):
        return (f"Triton {triton}'s interpreter fails under numpy {numpy} (int() of a one-element array); "
                "pip install 'numpy<2.4', or Triton 3.7 or later")
    return None


INTERPRETER_REFUSAL = interpreter_refusal()
needs_interpreter = pytest.mark.skipif(INTERPRETER_REFUSAL is not None, reason=INTERPRETER_REFUSAL or "")

# A model on backend=fla against the float64 eager model (tests/test_cuda.py's check), on the CPU: argv names the
# cases, each checked with heads of 32 and 8 features; it prints "<case> <heads> matches" where the named kernel ran
INTERPRETED_MODEL = """
import sys
import torch
import tests.test_cuda as on_device
from posbench.attention import fla
on_device.CUDA = torch.device("cpu")  # the interpreter runs the kernels on CPU tensors
fla.fla_refusal = lambda cuda, encoding=None: None
kernel_name, cases = sys.argv[1], sys.argv[2:]
calls = []
kernel = getattr(fla, kernel_name)
setattr(fla, kernel_name, lambda *args: calls.append(1) or kernel(*args))
for case in cases:
    for heads in (1, 4):
        calls.clear()
        on_device.compare_with_the_cpu_reference(case, True, heads, backend="fla")
        print(case, heads, "matches" if calls else "never ran the kernel", flush=True)
"""


def run_interpreted(script: str, *args: str) -> subprocess.CompletedProcess:
    """`script` with `args` in a fresh Python under Triton's interpreter (TRITON_INTERPRET=1, which Triton reads when
    a kernel is defined), from the project's root."""
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})


def interpreted_case(case: str, kernel_module) -> list[str]:
    """A formula case's fields (inside a script run_interpreted runs). A case that starts with "launch:" runs the
    kernel with the tiles it launches with on a GPU (kernel_module.launch_tiles), not the interpreter's smaller ones
    (kernel_module.tiles there)."""
    if not hasattr(kernel_module, "interpreter_tiles"):
        kernel_module.interpreter_tiles = kernel_module.tiles
    launch = case.startswith("launch:")
    kernel_module.tiles = kernel_module.launch_tiles if launch else kernel_module.interpreter_tiles
    return case.removeprefix("launch:").split(",")


def assert_interpreted_errors_within(script: str, cases: list[str], tolerance: dict[str, float]) -> dict:
    """Run `script` under Triton's interpreter for `cases` (comma-separated, the last field the inputs' dtype); it
    prints {case: {name: error}} as JSON, each error relative to its largest entry. Every case answers and every
    error is within tolerance[its dtype]; the errors by case are returned."""
    done = run_interpreted(script, *cases)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().split("\n")[-1])
    assert sorted(found) == sorted(cases)
    for case, errors in found.items():
        for name, error in errors.items():
            assert error < tolerance[case.split(",")[-1]], f"case {case}: {name} off by {error:.1e} of its largest"
    return found


def assert_kernel_models_match(kernel_name: str, cases: list[str]) -> None:
    """Each case's model on backend=fla, its kernel `kernel_name` (an attribute of posbench.attention.fla) run by
    Triton's interpreter, gives the float64 eager model's logits and gradients."""
    done = run_interpreted(INTERPRETED_MODEL, kernel_name, *cases)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.split("\n")[:-1] == [f"{case} {heads} matches" for case in cases for heads in (1, 4)]
