"""Attention: the layer (`layer`), what its hooks and backends see (`context`), one module per
backend (`eager`, `sdpa` with the fused CPU kernel of `fused_cpu`, `flex`, `fla`: fla-core's kernel for a
decay on CUDA) and the one place a backend is chosen (`select`). The hooks and their order are declared in
`posbench.hooks`."""
from posbench.attention.backend import Backend
from posbench.attention.context import AttentionCall, PositionContext, causal_mask
from posbench.attention.eager import EagerBackend
from posbench.attention.flex import FlexBackend
from posbench.attention.layer import Attention, query_key_hooks
from posbench.attention.sdpa import SdpaBackend
from posbench.attention.select import BACKENDS, get_backend

__all__ = ["BACKENDS", "Attention", "AttentionCall", "Backend", "EagerBackend", "FlexBackend", "PositionContext",
           "SdpaBackend", "causal_mask", "get_backend", "query_key_hooks"]
