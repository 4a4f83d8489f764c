"""The encoding registry: name -> class. Each name has one `configs/encoding/<name>.yaml`."""
from posbench.encodings.alibi import ALiBi
from posbench.encodings.base import HOOKS, Encoding, ModelDims
from posbench.encodings.learned import Learned
from posbench.encodings.nope import NoPE
from posbench.encodings.rope import RoPE
from posbench.encodings.sinusoidal import Sinusoidal
from posbench.encodings.t5 import T5

REGISTRY: dict[str, type[Encoding]] = {cls.name: cls for cls in (NoPE, Sinusoidal, Learned, RoPE, ALiBi, T5)}


def get_encoding(name: str) -> type[Encoding]:
    if name not in REGISTRY:
        raise KeyError(f"unknown encoding {name!r}; registered: {sorted(REGISTRY)}")
    return REGISTRY[name]


__all__ = ["HOOKS", "REGISTRY", "Encoding", "ModelDims", "get_encoding"]
