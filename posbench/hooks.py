"""The hook table: every hook an encoding may fill, in the fixed order attention applies them,
with the backends that run it and how a composite combines its parts' hooks. Backends,
validation, composites and the layer read this table; nothing else names the order.

    embed, state_init (model input) -> kv -> qkv -> qk -> query_scale -> layer_pass (once, every query)
    -> [per block of queries:] logits = q.k^T * scale + decay + bias + key_term -> logit_transform -> mask
    -> normalize (softmax by default) -> prob -> p.V + value_term -> state_update -> output -> [the block's
    feed-forward] -> state_mlp

A position state (state_init) is built once per forward from the positions and handed from layer to layer:
each layer reads it (qkv, which may widen v with state columns attended by the same weights),
updates it from what attention returned (state_update) and after its feed-forward (state_mlp).

Hooks that see content receive the call (`posbench.attention.context.AttentionCall`): the
layer's input, the positions, the mask, the layer. Today's position-only hooks keep their
signatures (see `posbench.encodings.base.Encoding`).
"""
from __future__ import annotations

from dataclasses import dataclass

# The attention backends' names, declared here only: the fastest first, eager (runs every hook: the reference) last.
# fla (fla-core's Triton kernels, CUDA only, an optional extra): auto's rule never takes it; a device's crossover table
# may, where it measured fla fastest and fla-core is installed.
SDPA, FLEX, FLA, EAGER = "sdpa", "flex", "fla", "eager"
BACKEND_NAMES = (SDPA, FLEX, FLA, EAGER)
ALL_BACKENDS = frozenset(BACKEND_NAMES)


@dataclass(frozen=True)
class Hook:
    name: str
    what: str  # one line for errors and the README
    backends: frozenset[str]  # the backends that run it (eager runs every hook: the reference)
    needs_logits: bool  # a backend running it holds logits (or a bias) of a block of queries x keys
    combine: str  # a composite with several parts that fill it: sum, product, sequence, or one (refused)
    model_level: bool = False  # runs at the model input, not in a layer (a schedule's entries may not have it)


HOOKS: dict[str, Hook] = {hook.name: hook for hook in (
    Hook("embed", "position vectors on the token embedding (model input)", ALL_BACKENDS, False, "sum", True),
    Hook("state_init", "a position state from the positions (model input), read and updated by every layer (TAPE)",
         ALL_BACKENDS, False, "one", True),
    Hook("kv", "keys and values mixed along time from the layer's input, before qk (FoX Pro's token shifts)",
         ALL_BACKENDS, False, "sequence"),
    Hook("qkv", "q and k transformed by a state of the layer's tokens (its input: GRAPE-M-ctx's phases; the position "
         "state: TAPE), v possibly widened with state columns attention averages", ALL_BACKENDS, False, "one"),
    Hook("qk", "a position-dependent transform of q and k (rotations)", ALL_BACKENDS, False, "one"),
    Hook("query_scale", "q times a factor per query and head (keys seen: SSMax, temperature)",
         ALL_BACKENDS, False, "product"),
    Hook("layer_pass", "once per layer over every query before the blocks: a state every block's hooks read "
         "(call.layer_state; selective attention's selection sums)", ALL_BACKENDS, False, "one"),
    Hook("decay", "a causal bias c_i - c_j from per-token levels c (ALiBi causal, FoX's forget gates)",
         ALL_BACKENDS, False, "sum"),
    Hook("bias", "a [B', H, Lq, Lk] bias on the scaled logits (fla: of i - j alone, looked up per offset)",
         frozenset({SDPA, FLEX, FLA, EAGER}), True, "sum"),
    Hook("key_term", "a content-dependent logit term (q against position vectors)", frozenset({EAGER}), True,
         "sum"),
    Hook("logit_transform", "every head's logits at once, before the mask (CoPE, DAPE)", frozenset({EAGER}),
         True, "sequence"),
    Hook("normalize", "replaces softmax (stick-breaking)", frozenset({EAGER}), True, "one"),
    Hook("prob", "a modulation of the attention probabilities", frozenset({EAGER}), True, "sequence"),
    Hook("value_term", "a term added to p.V", frozenset({EAGER}), True, "sum"),
    Hook("state_update", "the position state updated from the attended state columns; the heads' output back to "
         "v's width (TAPE)", ALL_BACKENDS, False, "one"),
    Hook("output", "the heads' output from the layer's input, before the output projection (FoX Pro's norm, gate)",
         ALL_BACKENDS, False, "sequence"),
    Hook("state_mlp", "the position state updated from the block's feed-forward output (TAPE)", ALL_BACKENDS, False,
         "one"),
)}


def backend_hooks(backend: str) -> frozenset[str]:
    """The hooks a backend runs."""
    return frozenset(name for name, hook in HOOKS.items() if backend in hook.backends)


def backends_for(hooks) -> list[str]:
    """The backends that run every one of `hooks`, eager last (the reference, slowest)."""
    return [name for name in BACKEND_NAMES if set(hooks) <= backend_hooks(name)]


def needs_logits(hooks) -> bool:
    return any(HOOKS[name].needs_logits for name in hooks)
