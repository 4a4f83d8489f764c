"""Where a method's attention time goes: one layer's attention call, forward and backward, split into its parts
and timed against nope's fused causal kernel on the same q, k, v. For the rows of results/gpu/<device>/encodings.csv
below the GPU issue's targets, whose step costs are measured but not their causes.

Parts, each in milliseconds and as a multiple of `nope` (sdpa with is_causal, no mask):
- `sdpa, constant bias`: the encoding's bias as sdpa's mask with no gradient (what leaving the flash
  kernel for one that reads a [1, H, L, L] mask costs);
- `sdpa, bias gradient`: the same mask as a leaf that needs its gradient (what sdpa's gradient of the mask adds);
- `bias alone`: the encoding's learned bias [1, H, L, L] built and differentiated, without attention (a
  decay's: `decay levels alone`, [B, H, L]);
- `<backend> call`: posbench's backend running the whole call (bias built, attention, both backwards), for
  each backend that runs the encoding (fla where fla-core is installed on CUDA); every query in one call, where
  a layer trains the eager methods in blocks of 128 queries;
- methods with logit hooks (cope, dape, stick-breaking, PaTH): `eager, no hooks`, the eager path's own floor (the
  logits formed, softmax, p.V), beside their eager call;
- decays only, `sdpa, decay in N columns`: the decay's column after the head's (N = d + 1), and padded with
  zeros to a multiple of 8, as posbench's sdpa call does on CUDA (the fused kernels' head-size alignment);
- fire only, `bias alone, dense MLP`: its bias with the MLP evaluated as Linear-ReLU-Linear on every pair
  rather than by its piecewise-linear segments (posbench.encodings.fire.piecewise_linear_mlp); and `bias alone,
  segment sums by bincount`: the segments read as posbench reads them, their gradient summed by one histogram
  (`SegmentRows`) rather than gather's scatter-add.

    python scripts/attention_costs.py [--encodings alibi,kerple,sandwich,fox,t5,fire,cope,dape,stick_breaking,path]
        [--tokens 1025,4097,8193]
        [--tokens-per-step 65536] [--device auto] [--backends sdpa,fla,eager] [--budget-s 120] [--out FILE.csv]
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a file: import posbench from this checkout

FIELDS = ["device", "encoding", "tokens", "batch_size", "part", "ms", "times_nope", "status"]
REPEATS = 5  # timed passes per part, after one untimed
CALL_BACKENDS = "sdpa,fla,eager"  # --backends: flex compiles a kernel per method, seconds each on a GPU


def timed_ms(run, device) -> float:
    """Median milliseconds of run() (a forward and its backward) over REPEATS passes, after one untimed."""
    from posbench.build import sync

    run()
    seconds = []
    for _ in range(REPEATS):
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        seconds.append(time.perf_counter() - start)
    return 1000 * statistics.median(seconds)


def parts(encoding, tokens: int, batch: int, device, backends: list[str]) -> dict:
    """part name -> a function running it forward and backward once."""
    from posbench.attention.context import AttentionCall, causal_mask
    from posbench.attention.eager import EagerBackend
    from posbench.encodings import REGISTRY, fire

    heads, width = encoding.dims.n_heads, encoding.dims.d_model // encoding.dims.n_heads
    generator = torch.Generator(device).manual_seed(0)

    def normal(*shape, grad=False):
        return torch.randn(*shape, device=device, generator=generator).requires_grad_(grad)

    q, k, v = (normal(batch, heads, tokens, width, grad=True) for _ in range(3))  # [B, H, L, d] each
    grad_out = normal(batch, heads, tokens, width)  # [B, H, L, d]
    positions = torch.arange(tokens, device=device)[None]  # [1, L]
    x = normal(batch, tokens, encoding.dims.d_model)  # [B, L, D]: the layer's input, read by content decays (fox)

    def new_call() -> AttentionCall:
        call = AttentionCall(encoding, positions, positions, 0, causal=True, x=x)
        if "decay" in encoding.hooks:
            call.q_levels = call.k_levels = encoding.decay(call)  # [B|1, H, L]: queries and keys alike
        return call

    def built_bias():  # [B', H, L, L]: the bias, or the decay's c_i - c_j
        if "decay" in encoding.hooks:
            call = new_call()
            return (call.q_levels[..., :, None] - call.k_levels[..., None, :]).float()
        return encoding.bias(positions, positions, 0)

    def attention(mask=None):
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None
                                                      ).backward(grad_out)

    found = {"nope": attention()}
    if not encoding.hooks & {"bias", "decay"}:  # logit hooks (cope, dape, stick-breaking): their eager path's floor
        plain = EagerBackend()
        nope_call = AttentionCall(REGISTRY["nope"](encoding.dims), positions, positions, 0, causal=True, x=x)
        found["eager, no hooks"] = lambda: plain.attend(q, k, v, nope_call).backward(grad_out)
        return found | backend_calls(encoding, q, k, v, grad_out, new_call, device, backends)
    with torch.no_grad():
        constant = built_bias().masked_fill(~causal_mask(tokens, tokens, device), float("-inf"))  # [B', H, L, L]
    learned = constant.clone().requires_grad_()
    grad_bias = normal(*constant.shape)  # [B', H, L, L]
    found |= {"sdpa, constant bias": attention(constant), "sdpa, bias gradient": attention(learned)}
    if "decay" in encoding.hooks:
        levels = new_call().k_levels  # [B|1, H, L]
        if levels.requires_grad:  # learned levels (fox's gates; alibi's are fixed)
            grad_levels = normal(*levels.shape).to(levels.dtype)
            found["decay levels alone"] = lambda: new_call().k_levels.backward(grad_levels)
    elif built_bias().requires_grad:  # a learned bias
        found["bias alone"] = lambda: built_bias().backward(grad_bias)
    if encoding.name == "fire":
        def dense_bias():
            with mock.patch.object(fire, "piecewise_linear_mlp",
                                   lambda mlp, values: mlp(values[..., None]).movedim(-1, 0)):
                built_bias().backward(grad_bias)

        def histogram_bias():
            with mock.patch.object(fire, "segment_rows", SegmentRows.apply):
                built_bias().backward(grad_bias)
        found["bias alone, dense MLP"] = dense_bias
        found["bias alone, segment sums by bincount"] = histogram_bias
    if "decay" in encoding.hooks:  # the decay's column alone (d + 1), and padded to a multiple of 8 (sdpa on CUDA)
        for columns in sorted({1, 1 + -(width + 1) % 8}):
            found[f"sdpa, decay in {width + columns} columns"] = (
                lambda columns=columns: decay_call(q, k, v, new_call(), columns).backward(grad_out))
    return found | backend_calls(encoding, q, k, v, grad_out, new_call, device, backends)


def backend_calls(encoding, q, k, v, grad_out, new_call, device, backends: list[str]) -> dict:
    """`<backend> call` -> the whole call forward and backward, for each of `backends` that runs the encoding here."""
    from posbench.attention import get_backend
    from posbench.attention.fla import fla_refusal
    from posbench.attention.fla_hooks import fla_missing_hooks
    from posbench.attention.flex import flex_refusal

    found = {}
    for name in backends:
        if name == "flex" and flex_refusal(encoding, q.shape[-1], device.type == "cuda", training=True):
            continue  # flex trains on CUDA only
        if name == "fla" and (fla_refusal(device.type == "cuda", encoding) or fla_missing_hooks(encoding)):
            continue  # fla-core's kernels: CUDA, installed, an encoding they run
        backend = get_backend(name, encoding, device)
        try:
            backend.check(encoding)
        except ValueError:  # this backend cannot run the encoding's hooks
            continue
        found[f"{name} call"] = lambda backend=backend: backend.attend(q, k, v, new_call()).backward(grad_out)
    return found


def decay_call(q, k, v, call, columns: int):
    """posbench's sdpa decay column (q: ones, k: (c_ref - c_j) / scale, v: zeros) with `columns` columns in all
    (the rest zeros): [B, H, L, d]."""
    from posbench.attention.sdpa import with_decay_column

    width = q.shape[-1]
    scale = call.encoding.logit_scale(width)
    q, k, v = with_decay_column(q, k, v, call, scale, columns)  # [B, H, L, d + columns]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[..., :width]


class SegmentRows(torch.autograd.Function):
    """fire's segment lookup (posbench.encodings.fire.segment_rows) with its backward as one histogram: each
    segment's gradient rows summed by bincount, whose CUDA kernel sums small histograms in shared memory, against
    gather's backward, whose scatter-add sends every pair's gradient to the same few rows in global memory."""

    @staticmethod
    def forward(ctx, table, segment):
        ctx.save_for_backward(segment)
        ctx.segments = table.shape[1]
        return table.index_select(1, segment)  # [H, N]

    @staticmethod
    def backward(ctx, grad):
        segment, = ctx.saved_tensors
        heads = grad.shape[0]
        bins = (torch.arange(heads, device=grad.device)[:, None] * ctx.segments + segment).reshape(-1)  # [H N]
        sums = torch.bincount(bins, weights=grad.reshape(-1), minlength=heads * ctx.segments)  # [H S]
        return sums.view(heads, ctx.segments).to(grad.dtype), None


def measure(encoding_name: str, tokens: int, tokens_per_step: int, device, device_label: str,
            backends: list[str]) -> Iterator[dict]:
    """The rows of one encoding at one length, each as it is timed."""
    from posbench.build import build
    from scripts.gpu_measure import compose_cfg, sequence_task_length

    batch = max(1, tokens_per_step // tokens)
    cfg = compose_cfg([f"encoding={encoding_name}", "model=small", f"train.length={sequence_task_length(tokens)}",
                       f"device={device.type}"])
    encoding = build(cfg, device).encoding
    nope_ms = None
    for part, run in parts(encoding, tokens, batch, device, backends).items():
        row = {"device": device_label, "encoding": encoding_name, "tokens": tokens, "batch_size": batch, "part": part}
        try:
            row |= {"ms": round(timed_ms(run, device), 3), "status": "ok"}
        except torch.OutOfMemoryError:
            row |= {"ms": "", "status": "out of memory"}
            torch.cuda.empty_cache()
        if part == "nope":
            nope_ms = row["ms"] or None
        row["times_nope"] = round(row["ms"] / nope_ms, 2) if row["ms"] != "" and nope_ms else ""
        print(f"{encoding_name:>9} {tokens:>6} x {batch:<4} {part:<32} {row['ms']!s:>10} ms  "
              f"{row['times_nope']!s:>6} x nope  {row['status']}", flush=True)
        yield row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encodings", default="alibi,kerple,sandwich,fox,t5,fire,cope,dape,stick_breaking,path")
    parser.add_argument("--tokens", default="1025,4097,8193", help="sequence lengths")
    parser.add_argument("--tokens-per-step", type=int, default=65536, help="batch = this // tokens")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--backends", default=CALL_BACKENDS, help="the backends whose whole call is timed, "
                        "of sdpa,flex,fla,eager")
    parser.add_argument("--budget-s", type=float, default=120, help="no new length is started past this")
    parser.add_argument("--out", type=Path, help="a CSV of the rows (written after each row)")
    args = parser.parse_args(argv)
    from posbench.hooks import BACKEND_NAMES

    unknown = sorted(set(args.backends.split(",")) - set(BACKEND_NAMES))
    if unknown:
        raise SystemExit(f"--backends: unknown {unknown}; choose from {list(BACKEND_NAMES)}")

    from posbench.build import resolve_device
    from scripts.gpu_measure import device_name

    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    device = resolve_device(args.device)
    label, deadline, rows = device_name(device), time.monotonic() + args.budget_s, []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name in args.encodings.split(","):
            if time.monotonic() > deadline:
                print(f"budget of {args.budget_s:g} s spent: {name} at {tokens} tokens and later not measured")
                return rows
            for row in measure(name, tokens, args.tokens_per_step, device, label, args.backends.split(",")):
                rows.append(row)
                write_rows(args.out, rows)
    return rows


def write_rows(path: Path | None, rows: list[dict]) -> None:
    """The rows so far to `path` (none: nothing written): a call stopped mid-encoding keeps what it timed."""
    if path is None:
        return
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, FIELDS)
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
