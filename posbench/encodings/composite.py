"""Composite (hybrid) encodings: the hooks of several registered encodings applied together
(article 004's hybrids, e.g. rope + t5 bias, learned + alibi), with no change to the model.

Parts are registry names built with the composite's ModelDims, each with optional
parameters: `parts=[rope, t5]`, `part_params={t5: {num_buckets: 16}}`. A name appears at
most once (its parameters are keyed by name), and a composite cannot be a part.

How the parts' hooks combine, in the fixed order of posbench.hooks (the parts' order
is the order of `parts`): by the table's `combine` column, one rule for every hook
(Composite.combine), embed alone written out; a hook without a combination fails construction.
  embed        one part: its own. Several: `embed_rule=error` (default) refuses them;
               `embed_rule=sum` adds each part's position vector to the token embedding,
               x + p_1 + p_2 + ... (each part's embed applied in turn). A part that
               replaces the token embedding instead of adding to it (complex_order,
               `replaces_token_embedding`) cannot be summed and is refused.
  qk           at most one part may own it: two rotations (rope + xpos) do not commute in
               general, so their product would depend on the order; refused. A part whose
               qk widens q and k (pope: 2d) beside one that reads q or k (key_term,
               reads_query_key) or sets its own logit scale: refused.
  query_scale  multiplied (ssmax beside rope: the query rotated, then scaled).
  decay        the levels summed (alibi beside fox: c = c_alibi + c_fox).
  bias         summed.
  key_term     summed.
  logit_transform  applied in sequence.
  normalize    at most one part may own it (it replaces softmax); refused.
  value_term   summed.
  prob         applied in sequence, each part's modulation multiplying the previous output.
  output       applied in sequence.
  kv           applied in sequence.
  logit_scale  the default 1/sqrt(d) unless a part overrides it (tener 1, deberta
               1/sqrt(3d)): one override, or several agreeing ones, win; two different
               overrides are refused.
  set_eval_length, set_train_step  forwarded to every part.
Traits come from the built parts: `hooks` is the union of theirs, `replaces_token_embedding`
and `widens_query_key` hold when a part's does. `relative` holds when every part is relative
and no part's content term meets another part's rotation: attention applies `qk` before `key_term`
whatever the order of `parts`, so a content term (shaw, transformer_xl, tener, deberta:
q_i . r(i - j), u . k_j, ...) reads R_i q_i and R_j k_j, which depend on i and j themselves
(rope or xpos beside one of them: shifting every position by 100 moves logits of unit-scale
parameters by 5 to 13). Biases, probability modulations and value terms read no q or k and
stay relative beside a rotation. The class attributes are the traits of the default parts
[rope, t5]; each instance sets its own.

The bias is built once for all layers when every part with a bias shares it across layers.
Parts read one kind of positions: all 1-D (on a grid, the raster index) or all 2-D (row,
column), `position_dims` the composite's; a 1-D part beside a 2-D part is refused (a part
with no hooks goes with either).
"""
from __future__ import annotations

import inspect

from torch import nn

from posbench.checks import Choice
from posbench.encodings.base import Encoding, LayerShape, ModelDims
from posbench.hooks import HOOKS

EMBED_RULES = ("error", "sum")
COMBINE_RULES = ("sum", "product", "sequence", "one")  # the values of the table's combine column
DEFAULT_PARTS = ("rope", "t5")


class Composite(Encoding):
    name = "composite"
    # the traits of DEFAULT_PARTS; every instance sets those of its own parts
    hooks = frozenset({"qk", "bias"})
    relative = True
    flex_trains = False  # t5's

    def __init__(self, dims: ModelDims, parts=DEFAULT_PARTS, part_params=None, embed_rule: str = "error"):
        super().__init__(dims)
        from posbench.encodings import REGISTRY  # lazily: the registry imports this module

        uncombined = uncombined_hooks(type(self))
        if uncombined:  # a hook added to the table after this module was imported, or with a new rule
            rules = {name: HOOKS[name].combine for name in uncombined}
            raise TypeError(f"composite: no combination of hook(s) {rules} (combine rules: {list(COMBINE_RULES)}); "
                            "a composite would drop their parts' terms")
        Choice(EMBED_RULES)("embed_rule", embed_rule, "composite")
        names = parse_parts(parts, REGISTRY)
        params_by_name = parse_part_params(part_params, names)
        self.embed_rule = embed_rule
        self.parts = nn.ModuleList(build_part(REGISTRY[name], name, dims, params_by_name.get(name, {}))
                                   for name in names)
        self.hooks = frozenset().union(*(part.hooks for part in self.parts))
        self.relative = self.shift_invariant()
        self.replaces_token_embedding = any(part.replaces_token_embedding for part in self.parts)
        self.widens_query_key = any(part.widens_query_key for part in self.parts)
        self.bias_layers_shared = all(part.bias_layers_shared for part in self.parts_with("bias"))
        self.flex_trains = all(part.flex_trains for part in self.parts)
        self.flex_trains_slowly = "; ".join(part.flex_trains_slowly for part in self.parts if part.flex_trains_slowly)
        kernels = [part.fla_kernel for part in self.parts if part.fla_kernel]
        self.fla_kernel = kernels[0] if len(kernels) == 1 else ""  # backend=fla: its part's kernel (PaTH-FoX)
        self.position_dims = self.check_position_dims()
        self.check_single_owners()
        self.check_widened_query_key()
        self.logit_scale(dims.head_dim)  # conflicting overrides fail before training

    def check_single_owners(self) -> None:
        embedders = self.parts_with("embed")
        if len(embedders) > 1:
            names = [part.name for part in embedders]
            if self.embed_rule == "error":
                raise ValueError(f"composite: parts {names} all have an embed hook; set encoding.embed_rule=sum to "
                                 "add their position vectors to the token embedding, or keep one of them")
            replacing = [part.name for part in embedders if part.replaces_token_embedding]
            if replacing:
                raise ValueError(f"composite: embed_rule=sum cannot add {replacing} to {names}: it replaces the "
                                 "token embedding instead of adding a position vector; keep it as the only "
                                 "embedding part")
        rotators = self.parts_with("qk")
        if len(rotators) > 1:
            raise ValueError(f"composite: parts {[part.name for part in rotators]} all transform q and k (qk hook); "
                             "at most one part may own it, since two position-dependent transforms do not "
                             "commute in general; keep one of them")
        for hook in (name for name, spec in HOOKS.items() if spec.combine == "one" and name != "qk"):
            owners = self.parts_with(hook)
            if len(owners) > 1:
                raise ValueError(f"composite: parts {[part.name for part in owners]} all have a {hook} hook "
                                 f"({HOOKS[hook].what}); at most one part may own it; keep one of them")

    def check_widened_query_key(self) -> None:
        """A part whose qk returns q and k wider than d (pope: 2d) beside a part that reads q or k themselves, or
        that sets its own logit scale: attention takes the scale at q's width, which only the widening part reads
        as d."""
        wideners = [part.name for part in self.parts if part.widens_query_key]
        if not wideners:
            return
        head_dim = self.dims.head_dim
        default = Encoding.logit_scale(self, head_dim)
        readers = [part.name for part in self.parts if "key_term" in part.hooks or part.reads_query_key]
        scales = {part.name: part.logit_scale(head_dim) for part in self.parts
                  if not part.widens_query_key and part.logit_scale(head_dim) != default}
        reasons = []
        if readers:
            reasons.append(f"parts {readers} read q or k themselves (a key term or reads_query_key) with tables as "
                           "wide as the head, which the wider q and k do not fit")
        if scales:
            reasons.append(f"parts {list(scales)} set their own logit scale {scales}, and beside the wider q and k "
                           f"{wideners} keep the head's 1/sqrt(d) = {default:.4g}: one scale serves every part")
        if reasons:
            raise ValueError(f"composite: parts {wideners} return q and k wider than the head size d = {head_dim} from "
                             f"their qk hook; {'; and '.join(reasons)}. Combine {wideners} only with parts that read "
                             "no q or k and keep the scale 1/sqrt(d) (a bias, decay, prob, ...)")

    @property
    def bias_relative(self) -> bool:
        """The summed bias depends on i - j only when every biasing part's does (a rotation or content
        term beside it does not change the bias: rope + shaw + alibi keeps alibi's offset rows)."""
        return all(part.bias_relative for part in self.parts_with("bias"))

    def shift_invariant(self) -> bool:
        """Every part relative, and no part reading the q and k another part rotated (a content term,
        CoPE's table lookup, PaTH's products)."""
        readers = [part for part in self.parts if "key_term" in part.hooks or part.reads_query_key]
        rotated_content = any(rotator is not reader for rotator in self.parts_with("qk") for reader in readers)
        return all(part.relative for part in self.parts) and not rotated_content

    def check_position_dims(self) -> int:
        by_dims = {dims: [part.name for part in self.parts if part.hooks and part.position_dims == dims]
                   for dims in (1, 2)}
        if by_dims[1] and by_dims[2]:
            raise ValueError(f"composite: parts {by_dims[1]} read 1-D positions (the raster index on a grid) but "
                             f"parts {by_dims[2]} read (row, column) positions; combine parts of one kind, "
                             "e.g. encoding.parts=[rope_2d,t5_2d] or [rope,t5]")
        return 2 if by_dims[2] else 1

    def parts_with(self, hook: str) -> list[Encoding]:
        return [part for part in self.parts if hook in part.hooks]

    def params(self) -> dict:
        return {"parts": [part.name for part in self.parts], "embed_rule": self.embed_rule,
                **{part.name: part.params() for part in self.parts}}

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        return sum(part.extra_memory(layer, shape) for part in self.parts)

    def kernel_memory(self, layer: int, shape: LayerShape) -> float:
        return sum(part.kernel_memory(layer, shape) for part in self.parts)

    def set_train_step(self, step: int, total: int) -> None:
        for part in self.parts:
            part.set_train_step(step, total)

    def train_phase(self) -> tuple:
        return tuple(part.train_phase() for part in self.parts)

    def set_eval_length(self, train_positions: int, eval_positions: int) -> None:
        for part in self.parts:
            part.set_eval_length(train_positions, eval_positions)
        self.relative = self.shift_invariant()  # a part's may change with the length (self_extend, longrope's start)

    def train(self, mode: bool = True):
        super().train(mode)  # a part may return to its training length
        self.relative = self.shift_invariant()
        return self

    def logit_scale(self, head_dim: int) -> float:
        return agreed_logit_scale(self.name, self.parts, head_dim, super().logit_scale(head_dim))

    def combine(self, hook: str, *args):
        """The parts' `hook` combined by the table's rule: sum or product of their terms (None, no term, left
        out), sequence (each part's output replaces the leading inputs of the next: one tensor, or a tuple such
        as kv's (k, v)), one (the only owner, checked at construction). No part: Encoding's "no change"."""
        parts = self.parts_with(hook)
        if not parts:
            return getattr(Encoding, hook)(self, *args)
        rule = HOOKS[hook].combine
        out = getattr(parts[0], hook)(*args)
        for part in parts[1:]:
            if rule == "sequence":
                args = (*out, *args[len(out):]) if isinstance(out, tuple) else (out, *args[1:])
                out = getattr(part, hook)(*args)
            else:
                out = combined_terms(rule, out, getattr(part, hook)(*args))
        return out

    def embed(self, x, pos, ids):
        # sum: each part's embed returns its input plus its position vector, so in turn x + p_1 + p_2 + ...
        for part in self.parts_with("embed"):
            x = part.embed(x, pos, ids)  # [B, L, D]
        return x

    def score_mod(self, q_pos, k_pos, layer):  # the summed bias, one score at a time
        mods = [part.score_mod(q_pos, k_pos, layer) for part in self.parts_with("bias")]
        if not mods or any(mod is None for mod in mods):
            return None

        def composite(score, b, h, q_idx, kv_idx):
            for mod in mods:  # each part adds its bias
                score = mod(score, b, h, q_idx, kv_idx)
            return score

        return composite


def combiner(hook: str):
    """Composite's method for `hook`: Composite.combine(hook, ...)."""
    def combined(self, *args):
        return self.combine(hook, *args)

    combined.__name__, combined.__qualname__ = hook, f"Composite.{hook}"
    return combined


for _hook in HOOKS:  # every hook the class does not combine by hand (embed) gets the table's rule
    if _hook not in vars(Composite):
        setattr(Composite, _hook, combiner(_hook))


def uncombined_hooks(cls) -> list[str]:
    """The hooks of the table that `cls` leaves to Encoding's "no change", or whose rule it does not know."""
    return [name for name, hook in HOOKS.items()
            if getattr(cls, name, None) is getattr(Encoding, name, None) or hook.combine not in COMBINE_RULES]


def combined_terms(rule: str, total, term):
    """total + term (sum) or total * term (product), broadcasting; None (no term) leaves the other."""
    if total is None or term is None:
        return term if total is None else total
    return total + term if rule == "sum" else total * term


def agreed_logit_scale(owner: str, parts, head_dim: int, default: float) -> float:
    """The one logit scale the parts agree on: the default unless a part overrides it (tener 1, deberta
    1/sqrt(3d)); two different overrides are refused."""
    overrides = {}
    for part in parts:  # by value: a urpe part inherits Composite's method
        scale = part.logit_scale(head_dim)
        if scale != default:
            overrides[part.name] = scale
    if len(set(overrides.values())) > 1:
        raise ValueError(f"{owner}: parts disagree on the logit scale {overrides} (head size {head_dim}); "
                         "combine parts that keep the same scale")
    return next(iter(overrides.values()), default)


def parse_parts(parts, registry: dict) -> list[str]:
    if isinstance(parts, str) or not parts:
        raise ValueError(f"composite: parts={parts!r} must be a non-empty list of encoding names, "
                         "e.g. encoding.parts=[rope,t5]")
    names = [str(name) for name in parts]
    choices = sorted(set(registry) - {Composite.name})
    for name in names:
        if name == Composite.name:
            raise ValueError("composite: a composite cannot be a part of a composite; list its parts directly")
        if name not in registry:
            raise ValueError(f"composite: unknown part {name!r}; registered encodings: {choices}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"composite: parts {repeated} appear more than once; each part may appear once "
                         "(its parameters are keyed by name)")
    return names


def parse_part_params(part_params, names: list[str]) -> dict[str, dict]:
    """{name: {param: value}} (None for no parameters) -> plain dicts, keys checked against parts."""
    params_by_name = {str(name): dict(values or {}) for name, values in (part_params or {}).items()}
    stray = sorted(set(params_by_name) - set(names))
    if stray:
        raise ValueError(f"composite: part_params names {stray}, which are not among parts={names}")
    return params_by_name


def build_part(cls: type[Encoding], name: str, dims: ModelDims, params: dict) -> Encoding:
    signature = inspect.signature(cls.__init__).parameters
    accepted = [key for key in signature if key not in ("self", "dims")]
    takes_any = any(arg.kind is inspect.Parameter.VAR_KEYWORD for arg in signature.values())
    unknown = sorted(set(params) - set(accepted))
    if unknown and not takes_any:
        raise ValueError(f"composite: part {name} has no parameter(s) {unknown}; its parameters: {accepted}")
    return cls(dims, **params)
