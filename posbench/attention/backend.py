"""The backend interface: a backend runs one attention call (`AttentionCall`) with the hooks the hook
table (`posbench.hooks`) says it runs, and refuses an encoding that needs others, naming the
backends that can."""
from __future__ import annotations

import torch

from posbench.attention.context import AttentionCall
from posbench.attention.fla_hooks import fla_missing_hooks
from posbench.encodings.base import Encoding
from posbench.hooks import BACKEND_NAMES, FLA, backends_for


def backends_that_run(encoding: Encoding) -> list[str]:
    """The backends that run every hook `encoding` needs, eager last; fla where its kernels take them, whatever
    the hook table says (a kernel runs a logit hook whole; its bias kernel takes a bias of i - j alone)."""
    by_table = backends_for(set(encoding.hooks) - {"embed"})
    fla_runs = encoding.dims.causal and not fla_missing_hooks(encoding)
    return [name for name in BACKEND_NAMES if (name in by_table and name != FLA) or (name == FLA and fla_runs)]


def suggested(valid: list[str]) -> str:
    """The backend a refusal suggests among `valid`: the first that runs on any device (fla needs CUDA)."""
    return next((name for name in valid if name != FLA), valid[0])


class Backend:
    name = ""
    supported_hooks: frozenset[str] = frozenset()  # from the hook table: posbench.hooks.backend_hooks(name)
    takes_bias = True  # the caller builds the bias tensor (flex builds its own score_mod instead)
    runs_windows = True  # runs a sliding window (AttentionCall.window)
    train_block: int | None = None  # queries per block of a causal layer with logits in training (None: one call)
    per_sequence_logits = False  # a block holds [B, H, b, Lk] logits (not a [1, H, b, Lk] bias): sizes chunks
    kernel_attention = False  # runs an encoding's own attention (Encoding.fla_kernel) in a kernel: none of what the
    # encoding declares for its eager path (extra_memory) is allocated

    def runs_kernel_of(self, encoding: Encoding) -> bool:
        """Whether this backend runs `encoding`'s attention in its own kernel (the guard counts no extra memory)."""
        return self.kernel_attention and bool(encoding.fla_kernel)

    def check(self, encoding: Encoding) -> None:
        missing = set(encoding.hooks) - {"embed"} - self.supported_hooks
        if missing:
            valid = backends_that_run(encoding)
            raise ValueError(f"backend={self.name} cannot run the {sorted(missing)} hook(s) that encoding "
                             f"{encoding.name} needs; use backend={suggested(valid)} (backends that can: {valid})")

    def bakes_mask(self, q: torch.Tensor) -> bool:
        """A causal block's -inf goes into its bias (True), or the backend masks the block itself."""
        return False

    def decay_room(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """q, k, v made ready once for a layer's blocks under a decay (AttentionCall.decay_room), or None
        where the backend takes the decay as it is."""
        return None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """q: [B, H, Lq, d], k, v: [B, H, Lk, d] -> [B, H, Lq, d]."""
        raise NotImplementedError


def call_bias(call: AttentionCall) -> torch.Tensor | None:
    """The call's bias [B', H, Lq, Lk]: the one the caller built, else the encoding's, else None."""
    if call.bias is None and "bias" in call.encoding.hooks:
        return call.encoding.bias(call.q_pos, call.k_pos, call.layer)
    return call.bias

