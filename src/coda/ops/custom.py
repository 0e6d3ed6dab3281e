"""One helper for coda's differentiable operators: a forward and a backward `torch.library`
custom op (each with its fake kernel, so `torch.compile(fullgraph=True)` traces them) tied
together by autograd.

An operator file then only says what is specific to it:

    op = fused_op(
        "coda::my_op",
        forward=_fwd,            # annotated (the op schema comes from it): public outputs first, then
                                 # the internal ones backward needs (never returned to the user)
        fake=_fwd_fake,          # the same outputs' shapes and dtypes
        save=_save,              # _save(*forward_inputs, out=outputs) -> the arguments backward takes
                                 # after the gradients: tensors, lists of tensors, plain values
        backward=_bwd,           # annotated: (*grads of the public outputs, *saved) -> input gradients,
                                 # in the order of `grads`, a list input contributing one per element
        backward_fake=_bwd_fake,
        grads=("x", "weight"),   # the forward inputs that get gradients; the rest get None
        outputs=1,               # how many of forward's outputs are public
    )
    y = op(x, weight, eps)       # the public outputs (one tensor when outputs=1)

The ops are named `<name>_fwd` and `<name>_bwd`. Gradients of internal outputs are never
materialized (`ctx.set_materialize_grads(False)`); a public output the loss did not use gets
zeros before backward runs.

Eager calls skip the custom-op dispatch: one `torch.autograd.Function` runs the same forward,
save and backward functions. torch.library's eager path (argument flattening, schema checks,
the autograd wrapper and redispatch) cost 0.33 ms of host time per Gemma 3 layer's forward and
backward on the CPU, a quarter of coda's host time there; a model whose kernels are short (Gemma
3 at 1B) waits on it. While anything traces (torch.compile, or a dispatch mode such as fake
tensors), and for meta tensors and tensor subclasses, the custom ops run (their fake kernels
serve meta tensors).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..runtime.inductor import before_tracing, explicit_fallback

_TENSOR, _LIST, _VALUE = "tensor", "list", "value"


class FusedOp:
    """A forward/backward custom-op pair with autograd; see the module docstring."""

    def __init__(self, name: str, *, forward: Callable, fake: Callable, save: Callable, backward: Callable,
                 backward_fake: Callable, grads: Sequence[str], outputs: int = 1) -> None:
        params = list(inspect.signature(forward).parameters)
        unknown = [g for g in grads if g not in params]
        if unknown:
            raise ValueError(f"fused_op {name}: grads {unknown} are not inputs of forward {params}")
        self.name, self.outputs = name, outputs
        self._grad_slots = frozenset(params.index(g) for g in grads)
        self._forward_fn, self._backward_fn = forward, backward
        self.forward = torch.library.custom_op(f"{name}_fwd", forward, mutates_args=())
        self.forward.register_fake(before_tracing(fake))
        self.backward = torch.library.custom_op(f"{name}_bwd", backward, mutates_args=())
        self.backward.register_fake(before_tracing(backward_fake))
        self._save = save
        torch.library.register_autograd(f"{name}_fwd", self._autograd_backward, setup_context=self._setup)
        namespace, op = name.split("::")
        for suffix in ("_fwd", "_bwd"):
            explicit_fallback(getattr(getattr(torch.ops, namespace), op + suffix).default)

    def __call__(self, *args: Any) -> Any:
        out = None
        if not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None:
            lists = tuple(len(a) if _tensors(a) else None for a in args)
            flat = _flatten(args, lists)
            if all(_plain(t) for t in flat):
                out = _Eager.apply(self, lists, *flat)
        if out is None:  # tracing, or meta tensors or tensor subclasses: the custom ops handle them
            out = _outputs(self.forward(*args))
        return out[0] if self.outputs == 1 else tuple(out[: self.outputs])

    def _setup(self, ctx, inputs, output) -> None:
        output = _outputs(output)
        saved = self._save(*inputs, out=output)
        tensors, layout = [], []
        for item in saved:
            if isinstance(item, torch.Tensor):
                tensors.append(item)
                layout.append((_TENSOR, None))
            elif item and _tensors(item):
                tensors.extend(item)
                layout.append((_LIST, len(item)))
            else:
                layout.append((_VALUE, item))
        ctx.save_for_backward(*tensors)
        ctx.layout = layout
        ctx.public = [(o.shape, o.dtype, o.device) for o in output[: self.outputs]]
        ctx.input_lists = [len(x) if _tensors(x) else None for x in inputs]
        ctx.set_materialize_grads(False)  # no zeros for the internal outputs' gradients

    def _autograd_backward(self, ctx, *grads, backward: Callable | None = None):
        """The input gradients from the output ones, through `backward` (the custom op unless the
        eager path passes its function)."""
        public = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                  for g, (shape, dtype, device) in zip(grads[: self.outputs], ctx.public)]
        tensors, args = iter(ctx.saved_tensors), []
        for kind, value in ctx.layout:
            if kind == _TENSOR:
                args.append(next(tensors))
            elif kind == _LIST:
                args.append([next(tensors) for _ in range(value)])
            else:
                args.append(value)
        flat = iter((backward or self.backward)(*public, *args))
        result = []
        for i, n in enumerate(ctx.input_lists):
            if i not in self._grad_slots:
                result.append(None if n is None else [None] * n)
            elif n is None:
                result.append(next(flat))
            else:
                result.append([next(flat) for _ in range(n)])
        return tuple(result)


class _Eager(torch.autograd.Function):
    """A FusedOp's eager call: its forward, save and backward functions without the custom ops
    around them. Tensor lists come flattened (autograd tracks only tensors passed directly)."""

    @staticmethod
    def forward(ctx, op: FusedOp, lists: tuple[int | None, ...], *flat: Any) -> tuple[torch.Tensor, ...]:
        inputs = _unflatten(lists, flat)
        output = _outputs(op._forward_fn(*inputs))
        op._setup(ctx, inputs, output)
        ctx.op = op
        return output

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        grads_in = ctx.op._autograd_backward(ctx, *grads, backward=ctx.op._backward_fn)
        return (None, None, *_flatten(grads_in, ctx.input_lists))


def _outputs(out: Any) -> tuple:
    """A forward's outputs as a tuple (a forward may return one tensor)."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _plain(x: Any) -> bool:
    """Not a tensor, or a tensor the op's functions run on as they are: no subclass (a
    Parameter aside), not on the meta device (the fake kernels serve that)."""
    return not isinstance(x, torch.Tensor) or (type(x) in (torch.Tensor, torch.nn.Parameter) and not x.is_meta)


def _tensors(x: Any) -> bool:
    """Whether `x` is a list of tensors (the empty list too): an argument whose tensors autograd
    tracks one by one, and whose gradient is a list (of Nones where it gets none)."""
    return isinstance(x, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in x)


def _flatten(items: Sequence[Any], lists: Sequence[int | None]) -> list[Any]:
    """The items of each tensor list (`lists`: its length, None for any other argument) spread
    out, everything else as it is: arguments, or their gradients (a list of Nones for a tensor
    list without gradient)."""
    return [x for item, n in zip(items, lists) for x in (item if n is not None else (item,))]


def _unflatten(lists: tuple[int | None, ...], flat: Sequence[Any]) -> list[Any]:
    """The arguments `_flatten` made `flat` from."""
    items, at = [], 0
    for n in lists:
        items.append(flat[at] if n is None else list(flat[at:at + n]))
        at += 1 if n is None else n
    return items


def fused_op(name: str, **parts: Any) -> FusedOp:
    """A differentiable custom op from its parts (see the module docstring)."""
    return FusedOp(name, **parts)
