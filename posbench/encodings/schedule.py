"""Per-layer schedules: each layer its own encoding, as long-context models ship them (Llama 4's iRoPE,
Cohere's RNoPE-SWA, Gemma 3's local and global RoPE bases; FRONTIER.md section 12). A schedule is
configuration, not a class per mix:

    encoding=schedule encoding.pattern=[rope,rope,rope,nope]
    encoding.kinds={local: {encoding: rope, base: 10000}, global: {encoding: rope, base: 1000000}}
    encoding.pattern=[local,local,local,local,local,global]

`pattern` names one encoding per layer and repeats over the layers (layer l takes pattern[l % len];
a model with fewer layers than the pattern takes its first entries, and rows record each layer's);
an entry is a registered encoding with its defaults, or a name in `kinds`, a variant with its own
parameters (`encoding:` names the registered encoding; a composite is allowed). Each entry is built
once, with the model's dims, and every hook goes to the layer's own encoding; a layer whose encoding
lacks a hook gets "no change". Sliding windows are a model setting (`model.window`, a per-layer list
repeated the same way). `embed` and `state_init` act on the model input, not on a layer (the table's
model_level hooks): an encoding with one is refused.
"""
from __future__ import annotations

from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn

from posbench.encodings.base import Encoding, LayerShape, ModelDims
from posbench.encodings.composite import agreed_logit_scale, build_part
from posbench.hooks import HOOKS

DEFAULT_PATTERN = ("rope", "rope", "rope", "nope")


def identity_score_mod(score, b, h, q_idx, kv_idx):
    return score


class Schedule(Encoding):
    name = "schedule"
    hooks = frozenset({"qk"})  # those of DEFAULT_PATTERN; every instance sets its own
    relative = True

    def __init__(self, dims: ModelDims, pattern=DEFAULT_PATTERN, kinds=None):
        super().__init__(dims)
        from posbench.encodings import REGISTRY  # lazily: the registry imports this module

        unforwarded = unforwarded_hooks(type(self))
        if unforwarded:  # a hook added to the table after this module was imported
            raise TypeError(f"schedule: no forwarding of hook(s) {unforwarded} to the layers' encodings; a schedule "
                            "would drop them")
        self.pattern, self.kinds = parse_pattern(pattern, kinds, REGISTRY)
        self.layers = [self.pattern[layer % len(self.pattern)] for layer in range(dims.n_layers)]
        built = {}
        for entry in dict.fromkeys(self.layers):  # the entries some layer takes (a model with fewer layers than
            # the pattern, e.g. debug=smoke's one, drops the rest; params() records what each layer took)
            params = dict(self.kinds.get(entry, {"encoding": entry}))
            name = params.pop("encoding")
            built[entry] = build_part(REGISTRY[name], name, dims, params)
        self.entries = nn.ModuleDict(built)
        model_level = [name for name, hook in HOOKS.items() if hook.model_level]
        embedders = [entry for entry, enc in built.items() if set(model_level) & enc.hooks]
        if embedders:
            raise ValueError(f"schedule: {embedders} act on the model input (hooks {model_level}), not on one "
                             "layer; a schedule takes encodings of the attention (qk, bias, decay, ...)")
        dims_read = {enc.position_dims for enc in built.values() if enc.hooks}
        if len(dims_read) > 1:
            raise ValueError("schedule: its entries read 1-D and 2-D positions; use entries of one kind")
        self.position_dims = dims_read.pop() if dims_read else 1
        self.hooks = frozenset().union(*(enc.hooks for enc in built.values()))
        self.relative = all(enc.relative for enc in built.values())
        self.logit_scale(dims.head_dim)  # conflicting overrides fail before training

    @property
    def bias_relative(self) -> bool:
        return all(enc.bias_relative for enc in self.entries.values() if "bias" in enc.hooks)

    def at(self, layer: int) -> Encoding:
        """The encoding of one layer."""
        return self.entries[self.layers[layer]]

    def params(self) -> dict:
        return {"pattern": list(self.pattern), "kinds": self.kinds, "layers": self.layers,
                **{entry: enc.params() for entry, enc in self.entries.items()}}

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        return self.at(layer).extra_memory(layer, shape)

    def set_train_step(self, step: int, total: int) -> None:
        for enc in self.entries.values():
            enc.set_train_step(step, total)

    def train_phase(self) -> tuple:
        return tuple(enc.train_phase() for enc in self.entries.values())

    def set_eval_length(self, train_positions: int, eval_positions: int) -> None:
        for enc in self.entries.values():
            enc.set_eval_length(train_positions, eval_positions)
        self.relative = all(enc.relative for enc in self.entries.values())  # an entry's may change with the length

    def train(self, mode: bool = True):
        super().train(mode)  # an entry may return to its training length
        self.relative = all(enc.relative for enc in self.entries.values())
        return self

    def logit_scale(self, head_dim: int) -> float:
        return agreed_logit_scale(self.name, self.entries.values(), head_dim, super().logit_scale(head_dim))

    def forward_hook(self, hook: str, *args):
        """The layer's encoding's `hook`, "no change" where it lacks it; every hook of a layer takes the layer or
        the call (call.layer) last."""
        last = args[-1]
        enc = self.at(last if isinstance(last, int) else last.layer)
        return getattr(enc, hook)(*args) if hook in enc.hooks else getattr(Encoding, hook)(self, *args)

    def score_mod(self, q_pos, k_pos, layer):
        enc = self.at(layer)
        return enc.score_mod(q_pos, k_pos, layer) if "bias" in enc.hooks else identity_score_mod


def forwarder(hook: str):
    """Schedule's method for `hook`: Schedule.forward_hook(hook, ...)."""
    def forwarded(self, *args):
        return self.forward_hook(hook, *args)

    forwarded.__name__, forwarded.__qualname__ = hook, f"Schedule.{hook}"
    return forwarded


for _hook, _spec in HOOKS.items():  # a model-level hook acts on the model input: an entry with it is refused
    if not _spec.model_level:
        setattr(Schedule, _hook, forwarder(_hook))


def unforwarded_hooks(cls) -> list[str]:
    """The layer hooks of the table that `cls` leaves to Encoding's "no change"."""
    return [name for name, hook in HOOKS.items()
            if not hook.model_level and getattr(cls, name, None) is getattr(Encoding, name, None)]


def parse_pattern(pattern, kinds, registry: dict) -> tuple[list[str], dict[str, dict]]:
    """pattern: a non-empty list of registered names or kinds; kinds: {name: {encoding: registered, ...}}."""
    choices = sorted(set(registry) - {Schedule.name})
    example = "e.g. encoding.kinds={local: {encoding: rope, base: 10000}}"
    if kinds is not None and not isinstance(kinds, (dict, DictConfig)):
        raise ValueError(f"schedule: encoding.kinds={kinds!r} must be a mapping of kind names to their encoding and "
                         f"parameters, {example}, or null (no kinds)")
    for name, params in (kinds or {}).items():
        if params is not None and not isinstance(params, (dict, DictConfig)):
            raise ValueError(f"schedule: encoding.kinds.{name}={plain(params)!r} must be a mapping with `encoding:` one "
                             f"of {choices} and that encoding's parameters, {example}")
    kinds = {str(name): dict(params or {}) for name, params in (kinds or {}).items()}
    for name, params in kinds.items():
        if name in registry:
            raise ValueError(f"schedule: kind {name!r} shadows the registered encoding of that name; rename it")
        if params.get("encoding") not in choices:
            raise ValueError(f"schedule: kind {name!r} needs `encoding:` one of the registered encodings {choices}, "
                             f"got {params.get('encoding')!r}")
    if isinstance(pattern, str) or not isinstance(pattern, (list, tuple, ListConfig)) or not pattern:
        raise ValueError(f"schedule: pattern={pattern!r} must be a non-empty list of encodings (one per layer, "
                         "repeated over the layers), e.g. encoding.pattern=[rope,rope,rope,nope]")
    entries = [str(entry) for entry in pattern]
    for entry in entries:
        if entry not in kinds and entry not in choices:
            raise ValueError(f"schedule: pattern entry {entry!r} is neither a registered encoding {choices} nor a "
                             f"kind {sorted(kinds)}")
    return entries, {name: {k: plain(v) for k, v in params.items()} for name, params in kinds.items()}


def plain(value):
    """OmegaConf containers as plain lists and dicts (kinds are recorded in every row)."""
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
