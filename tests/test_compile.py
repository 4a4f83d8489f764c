"""train.compile's modes on the CPU (CUDA graphs only replay on CUDA: tests/test_cuda.py): each trains the
run the uncompiled model trains, to float differences; flex is refused only inside dynamic shapes. The compiled
runs leave ATEN_CPU_CAPABILITY out of their environment: inductor picks its own instruction set (under a forced
one it fails, and posbench refuses to compile there)."""

import pytest
import torch

from posbench.attention import get_backend
from posbench.build import build
from posbench.encodings import REGISTRY
from tests.helpers import assert_close_scaled, compose_cfg, make_encoding, posbench, read_rows

INDUCTORS_OWN = {"ATEN_CPU_CAPABILITY": ""}  # empty: unset for torch and for posbench's refusal
SHORT = ["debug=smoke", "device=cpu", "train.steps=6", "train.warmup_steps=2", "eval.ratios=[1]", "eval.samples=16"]


@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("eager")
    posbench(*SHORT, "train.lengths=fixed", f"hydra.run.dir={run_dir}")
    return [row["loss"] for row in read_rows(run_dir)]


@pytest.mark.parametrize("mode", ["static", "graphs"])
def test_a_compiled_mode_trains_the_uncompiled_run(mode, eager_losses, tmp_path):
    posbench(*SHORT, "train.lengths=fixed", f"train.compile={mode}", f"hydra.run.dir={tmp_path}", timeout=600,
             env=INDUCTORS_OWN)
    rows = read_rows(tmp_path)
    assert [row["status"] for row in rows] == ["ok"]
    assert [row["loss"] for row in rows] == pytest.approx(eager_losses, rel=1e-4)


def test_flex_is_refused_in_dynamic_shapes_only():
    encoding = make_encoding("alibi", d_model=32)
    assert get_backend("auto", encoding, "cuda", dynamic_compile=True).name == "sdpa"
    assert get_backend("auto", encoding, "cuda", dynamic_compile=False).name == "flex"
    with pytest.raises(ValueError, match="train.compile=static"):
        get_backend("flex", encoding, "cuda", dynamic_compile=True)


def test_compiling_on_the_cpu_under_a_forced_aten_capability_is_refused(tmp_path):
    result = posbench(*SHORT, "train.compile=true", f"hydra.run.dir={tmp_path}", check=False,
                      env={"ATEN_CPU_CAPABILITY": "avx2"})
    assert result.returncode != 0
    assert "train.compile=true on the CPU under ATEN_CPU_CAPABILITY=avx2" in result.stderr + result.stdout


GRAPH_BREAKS = {  # encodings whose training forward cannot be one graph, and why
    "floater": "its ODE trajectory runs outside the graph (torch.compiler.disable): unrolled, its steps would take "
               "minutes to compile",
}
SEQUENCE_ENCODINGS = sorted(name for name, cls in REGISTRY.items() if cls.position_dims == 1)


@pytest.mark.parametrize("name", SEQUENCE_ENCODINGS)
def test_every_encoding_trains_as_one_graph_that_gives_the_eager_gradients(name):
    """torch.compile(fullgraph=True) through AOTAutograd without inductor: no graph break in the forward or
    its backward (train.compile's graphs stay whole: one CUDA graph a shape), and the traced path (where an
    encoding skips its host reads while compiling) gives the eager logits and gradients."""
    built = build(compose_cfg("debug=smoke", f"encoding={name}", "train.lengths=fixed", "device=cpu"),
                  torch.device("cpu"))
    model = built.model.train()
    ids = torch.randint(0, built.task.vocab_size, (3, 33), generator=torch.Generator().manual_seed(0))  # [B, T]
    pos = torch.arange(33)[None]  # [1, T]
    torch._dynamo.reset()
    traced = torch.compile(model, backend="aot_eager", fullgraph=True)
    if name in GRAPH_BREAKS:
        with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):
            traced(ids, pos)
        return
    results = []
    for forward in (model, traced):
        model.zero_grad()
        logits = forward(ids, pos)  # [B, T, V]
        logits.square().mean().backward()
        results.append([logits.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)])
    for got, expected in zip(*results):
        assert_close_scaled(got, expected, rtol=1e-5, atol_scale=1e-6)
