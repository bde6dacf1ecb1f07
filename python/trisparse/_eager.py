"""Eager calls of a torch.library op with its registered autograd, at less host cost.

A ``torch.library.custom_op`` with ``register_autograd`` costs ~0.2 ms more host time per forward
+ backward than the same functions under a ``torch.autograd.Function`` (torch 2.11, H200 host:
542 against 326 us a step of segment_attention, whose kernels take 26 us), and GPS's steps over
small batches are host-bound. So eager calls go through an autograd.Function built from the op's
own implementation, setup_context and backward (one definition of each), and torch.compile
traces the op itself (its fake and registered autograd)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def eager_autograd(
    op,
    setup_context: Callable,
    backward: Callable,
    materialize_grads: bool = True,
    backward_op=None,
) -> Callable:
    """A callable equal to ``op(*args)``: under torch.compile the op, else an autograd.Function
    running the op's implementation (``op._init_fn``), ``setup_context(ctx, inputs, output)``
    and ``backward(ctx, *grads)`` (without a node where no input needs a gradient: the
    implementation alone). ``materialize_grads=False``: outputs the loss does not reach
    (an lse kept for the backward) give ``backward`` None, not a tensor of zeros filled per step.
    ``backward_op``: the op ``backward`` runs, given to it as ``run=`` (its default, the
    dispatcher's op, is what the registered autograd traces): eager backwards run its
    implementation, without the dispatcher's host time, except under ``create_graph`` (grad
    mode on in the backward), where the op keeps its own autograd.
    """
    impl = op._init_fn
    if backward_op is not None:
        through_op, direct = backward, functools.partial(backward, run=backward_op._init_fn)

        def backward(ctx, *grads):
            return (through_op if torch.is_grad_enabled() else direct)(ctx, *grads)

    class _Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            ctx.set_materialize_grads(materialize_grads)
            output = impl(*args)
            setup_context(ctx, args, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    _Function.__name__ = f"{op._name}_eager"

    def call(*args):
        if torch.compiler.is_compiling():
            return op(*args)
        if not torch.is_grad_enabled() or not any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args
        ):
            return impl(*args)  # nothing to differentiate: no autograd node, no saved tensors
        return _Function.apply(*args)

    return call
