"""The one place a backend is chosen: by name, or `auto` from the encoding's hooks and the device."""
from __future__ import annotations

import torch

from posbench.attention import crossover
from posbench.attention.backend import Backend
from posbench.attention.eager import EagerBackend
from posbench.attention.fla import FlaBackend, fla_refusal
from posbench.attention.flex import IN_DYNAMIC_COMPILE, FlexBackend, flex_refusal
from posbench.attention.sdpa import SdpaBackend
from posbench.checks import Choice
from posbench.encodings.base import Encoding
from posbench.hooks import EAGER, FLA, FLEX, SDPA
from posbench.settings import BACKEND_CHOICES

# auto's rule on CUDA: flex for a bias or decay from this many tokens, sdpa below. On an H100 (training, eager,
# tokens/s against nope) flex overtook sdpa between 257 and 1,025 tokens for alibi (0.51 against 0.71 at 257, 0.57
# against 0.50 at 1,025), between 1,025 and 4,097 for fox (0.41 against 0.49; 0.38 against 0.36) and between 4,097
# and 8,193 for sandwich (0.46 against 0.50; 0.49 against 0.44): this is the middle crossover. On an H200 alibi's
# flex runs at up to 33 tokens made 4-11 steps a second where the sdpa encodings' made about 50 (15 runs sharing
# it). A crossover table measured on the device (or on one of its compute capability) decides in place of this.
FLEX_FROM_TOKENS = 2048
BACKENDS: dict[str, type[Backend]] = {cls.name: cls for cls in (EagerBackend, SdpaBackend, FlexBackend,
                                                                 FlaBackend)}


def get_backend(name: str, encoding: Encoding | None = None, device: torch.device | None = None,
                dynamic_compile: bool = False, training: bool = True) -> Backend:
    """A backend by name; `auto` takes the fastest one that runs every hook the encoding needs on
    the device, for training and evaluation alike: on CUDA flex for a bias with a score_mod or a
    decay (SDPA would take a dense mask, or a head size the flash kernel refuses) where heads have
    at least 16 features (flex's CUDA kernels refuse fewer), flex can differentiate it
    (Encoding.flex_trains) and the model is not trained in a graph with dynamic shapes
    (`dynamic_compile`: flex is refused there; train.compile=static and graphs give it fixed shapes), flex's
    limits (posbench.attention.flex.flex_refusal), and, for `training`, flex trains it at speed
    (Encoding.flex_trains_slowly), else sdpa; on CPU sdpa (its fused kernel with the causal
    flag beat compiled flex 1.4-1.7x in evaluation at 4k tokens, and flex cannot train there); eager for hooks
    neither runs."""
    if name == "auto":
        if encoding is None:
            raise ValueError("backend=auto needs the encoding to choose for")
        needed = set(encoding.hooks) - {"embed"}
        name = SDPA if needed <= SdpaBackend.supported_hooks else EAGER
        if (name == SDPA and needed & {"bias", "decay"} and on_cuda(device)
                and flex_refusal(encoding, head_dim(encoding), True, True, dynamic_compile) is None
                and not (training and encoding.flex_trains_slowly)):
            try:
                FlexBackend().check(encoding)
                name = FLEX
            except ValueError:  # a bias without a score_mod stays on sdpa
                pass
    Choice(BACKEND_CHOICES)("backend.name", name)
    if name == FLEX and dynamic_compile:
        raise ValueError(IN_DYNAMIC_COMPILE)
    return BACKENDS[name]()


def on_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def head_dim(encoding: Encoding) -> int:
    return encoding.dims.d_model // encoding.dims.n_heads


def runnable(encoding: Encoding, device, training: bool, dynamic_compile: bool, windowed: bool) -> list[str]:
    """The backends that can run `encoding` here: for training (on CUDA for flex, with heads of 16 features,
    an encoding flex can differentiate and fixed shapes), or for evaluation."""
    names = []
    for name, cls in BACKENDS.items():
        backend = cls()
        try:
            backend.check(encoding)
        except ValueError:
            continue
        if windowed and not backend.runs_windows:
            continue
        if name == FLEX and flex_refusal(encoding, head_dim(encoding), on_cuda(device), training, dynamic_compile):
            continue
        if name == FLA and fla_refusal(on_cuda(device), encoding):
            continue
        names.append(name)
    return names


def measured_backend(name: str, encoding: Encoding, device, tokens: int, compile_mode=False, training: bool = True,
                     windowed: bool = False) -> Backend:
    """The backend for `tokens` tokens: `auto` takes the crossover table's fastest where the device has a
    table with the encoding in it (posbench.attention.crossover), else its rule (get_backend, with sdpa in
    place of flex below FLEX_FROM_TOKENS); a backend
    named outright is that backend. Evaluation runs uncompiled: compile_mode applies to training only."""
    dynamic_compile = training and compile_mode is True
    chosen = get_backend(name, encoding, device, dynamic_compile=dynamic_compile, training=training)
    if name == "auto" and chosen.name == FLEX and tokens < FLEX_FROM_TOKENS:
        chosen = SdpaBackend()  # flex's fixed cost per call outweighs its savings on short sequences
    if chosen.name == FLEX:  # named outright (auto takes flex only where it runs): refused before training
        refusal = flex_refusal(encoding, head_dim(encoding), on_cuda(device), training, dynamic_compile)
        if refusal:
            raise ValueError(refusal)
    if chosen.name == FLA:  # named outright: refused before training where it cannot run
        refusal = fla_refusal(on_cuda(device), encoding)
        if refusal:
            raise ValueError(refusal)
    table = crossover.device_table(device) if name == "auto" else None
    if table is None:
        return chosen
    fastest = crossover.fastest(table.paths, encoding.name, compile_mode if training else False, tokens,
                                runnable(encoding, device, training, dynamic_compile, windowed), chosen.name)
    return BACKENDS[fastest]() if fastest else chosen
