"""The autograd of trisparse's torch ops (``trisparse.ops``), one module per operation: each
registers its op's backward once (``register_autograd``: what torch.compile traces) and builds
the eager call from the same setup and backward functions (``_eager.eager_autograd``: an
autograd.Function, ~0.2 ms less host time a step than the op's own dispatch)."""
