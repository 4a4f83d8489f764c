"""The encoding registry: name -> class. Each name has one `configs/encoding/<name>.yaml`.
Classes with position_dims = 2 read (row, column) positions and run on grid tasks only."""
from posbench.encodings.alibi import ALiBi
from posbench.encodings.alibi_2d import ALiBi2D
from posbench.encodings.base import HOOKS, Encoding, ModelDims
from posbench.encodings.baselines import Binary, Index, Normalized
from posbench.encodings.cable import CABLE
from posbench.encodings.complex_order import ComplexOrder
from posbench.encodings.composite import Composite
from posbench.encodings.cope import CoPE
from posbench.encodings.dape import DAPE
from posbench.encodings.deberta import DeBERTa
from posbench.encodings.drope import DroPE
from posbench.encodings.fire import FIRE
from posbench.encodings.floater import Floater
from posbench.encodings.fope import FoPE
from posbench.encodings.fox import FoX
from posbench.encodings.gated import Gated
from posbench.encodings.grape import GRAPE
from posbench.encodings.hierarchical import Hierarchical
from posbench.encodings.kerple import Kerple
from posbench.encodings.learned import Learned
from posbench.encodings.learned_2d import Learned2D
from posbench.encodings.nope import NoPE
from posbench.encodings.path import PaTH
from posbench.encodings.pope import PoPE
from posbench.encodings.rope import RoPE
from posbench.encodings.rope_2d import RoPE2D, RoPEMixed
from posbench.encodings.sandwich import Sandwich
from posbench.encodings.scale_invariant import ScaleInvariant
from posbench.encodings.schedule import Schedule
from posbench.encodings.selective import Selective
from posbench.encodings.self_extend import SelfExtend
from posbench.encodings.shaw import Shaw
from posbench.encodings.sinusoidal import Sinusoidal
from posbench.encodings.sinusoidal_2d import Sinusoidal2D
from posbench.encodings.ssmax import SSMax
from posbench.encodings.stick_breaking import StickBreaking
from posbench.encodings.string_rope import STRING
from posbench.encodings.t5 import T5
from posbench.encodings.t5_2d import T52D
from posbench.encodings.tape import TAPE
from posbench.encodings.temperature import Temperature
from posbench.encodings.transformer_xl import TENER, TransformerXL
from posbench.encodings.urpe import URPE
from posbench.encodings.xpos import XPos

REGISTRY: dict[str, type[Encoding]] = {cls.name: cls for cls in (NoPE, Sinusoidal, Learned, RoPE, ALiBi, T5,
                                                               Index, Normalized, Binary, Hierarchical,
                                                               ComplexOrder, Floater,
                                                               Kerple, FIRE, Sandwich, XPos,
                                                               Shaw, TransformerXL, TENER, DeBERTa, URPE,
                                                               Composite,
                                                               Sinusoidal2D, Learned2D, RoPE2D, RoPEMixed, T52D,
                                                               ALiBi2D,
                                                               FoX, SSMax, CABLE, Gated,
                                                               CoPE, DAPE, StickBreaking,
                                                               SelfExtend, Schedule, Temperature, PaTH, DroPE,
                                                               Selective, PoPE, FoPE, GRAPE,
                                                               ScaleInvariant, STRING, TAPE)}


def get_encoding(name: str) -> type[Encoding]:
    if name not in REGISTRY:
        raise KeyError(f"unknown encoding {name!r}; registered: {sorted(REGISTRY)}")
    return REGISTRY[name]


__all__ = ["HOOKS", "REGISTRY", "Encoding", "ModelDims", "get_encoding"]
