"""The one place a backend is chosen: by name, or `auto` from the encoding's hooks and the device."""
from __future__ import annotations

import torch

from posbench.attention.backend import Backend
from posbench.attention.eager import EagerBackend
from posbench.attention.flex import CUDA_MIN_HEAD_DIM, FlexBackend
from posbench.attention.sdpa import SdpaBackend
from posbench.encodings.base import Encoding

BACKENDS: dict[str, type[Backend]] = {cls.name: cls for cls in (EagerBackend, SdpaBackend, FlexBackend)}
# the causal mask_mod closes over lk - lq, a derived symbolic size under dynamic=True (pytorch issue 182606)
FLEX_IN_COMPILE = ("backend=flex cannot train inside a graph with dynamic shapes (train.compile=true or graphs): "
                   "inductor failed to lower the compiled model's FlexAttention (torch 2.11, alibi and fox on an "
                   "H200: ShapeAsConstantBuffer); use train.compile=static (a graph per shape), backend=auto "
                   "(sdpa there) or train.compile=false")


def get_backend(name: str, encoding: Encoding | None = None, device: torch.device | None = None,
                dynamic_compile: bool = False) -> Backend:
    """A backend by name; `auto` takes the fastest one that runs every hook the encoding needs on
    the device, for training and evaluation alike: on CUDA flex for a bias with a score_mod or a
    decay (SDPA would take a dense mask, or a head size the flash kernel refuses) where heads have
    at least 16 features (flex's CUDA kernels refuse fewer), flex can differentiate it
    (Encoding.flex_trains) and the model is not trained in a graph with dynamic shapes
    (`dynamic_compile`: flex is refused there, FLEX_IN_COMPILE; train.compile=static gives it fixed
    shapes), else sdpa; on CPU sdpa (its fused kernel with the causal flag beat compiled flex 1.4-1.7x
    in evaluation at 4k tokens, and flex cannot train there); eager for hooks neither runs."""
    if name == "auto":
        if encoding is None:
            raise ValueError("backend=auto needs the encoding to choose for")
        needed = set(encoding.hooks) - {"embed"}
        name = "sdpa" if needed <= SdpaBackend.supported_hooks else "eager"
        head_dim = encoding.dims.d_model // encoding.dims.n_heads
        if (name == "sdpa" and needed & {"bias", "decay"} and device is not None and torch.device(device).type == "cuda"
                and head_dim >= CUDA_MIN_HEAD_DIM and encoding.flex_trains and not dynamic_compile):
            try:
                FlexBackend().check(encoding)
                name = "flex"
            except ValueError:  # a bias without a score_mod stays on sdpa
                pass
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {['auto', *sorted(BACKENDS)]}")
    if name == "flex" and dynamic_compile:
        raise ValueError(FLEX_IN_COMPILE)
    return BACKENDS[name]()
