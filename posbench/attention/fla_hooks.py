"""Which hooks of an encoding backend=fla's kernels run (posbench.attention.fla): the rule fla's check and every
backend's refusal read, apart from the backends themselves."""
from __future__ import annotations

from posbench.hooks import FLA, backend_hooks

KERNEL_HOOKS = {"stick_breaking": "normalize", "path": "logit_transform", "cope": "logit_transform",
                "dape": "logit_transform"}  # Encoding.fla_kernel -> the hook it runs


def fire_part(encoding):
    """The part of `encoding` (an instance or its class) whose bias FIRE's kernel computes (Encoding.bias_kernel):
    the encoding itself, or a composite's only part with a bias; None where another bias is there or none is."""
    parts = [encoding] if isinstance(encoding, type) or not hasattr(encoding, "parts") else [
        part for part in encoding.parts if "bias" in part.hooks]
    return parts[0] if len(parts) == 1 and parts[0].bias_kernel == "fire" else None


def bias_kernels_take(encoding) -> bool:
    """Whether posbench's bias kernels take the bias of `encoding` (an instance or its class): a bias of i - j alone
    (the relative bias kernel) or FIRE's (its own kernel), in every layer of a schedule."""
    entries = None if isinstance(encoding, type) else getattr(encoding, "entries", None)
    if entries is not None:  # a schedule: each layer's encoding on its own
        return all(bias_kernels_take(entry) for entry in entries.values() if "bias" in entry.hooks)
    relative = encoding.relative if isinstance(encoding, type) else encoding.bias_relative
    return relative or fire_part(encoding) is not None


def fla_missing_hooks(encoding) -> set[str]:
    """The hooks of `encoding` (an instance or its class) that backend=fla cannot run: empty where it runs it."""
    hooks = set(encoding.hooks) - {"embed"} - backend_hooks(FLA)
    kernel = encoding.fla_kernel
    if "bias" in encoding.hooks and (kernel or "decay" in encoding.hooks or encoding.position_dims != 1
                                     or not bias_kernels_take(encoding)):
        hooks.add("bias")  # the bias kernels take a bias of i - j alone or FIRE's, on 1-D positions, beside no other
        # kernel
    if kernel == "path" or (kernel and "decay" not in encoding.hooks):  # of the kernels, PaTH's alone takes a decay
        others = [part for part in getattr(encoding, "parts", ()) if not part.fla_kernel]
        if not any(KERNEL_HOOKS[kernel] in part.hooks for part in others):  # a part's hook the kernel would skip
            hooks.discard(KERNEL_HOOKS[kernel])
    return hooks
