"""trisparse's torch ops (namespace ``trisparse``), one module per operation as the public
modules name them: each defines its ops with ``torch.library.custom_op`` over the C++ plans, and
their fake implementations (shapes only, for torch.compile). Their autograd is in
``trisparse.autograd``; the public functions, which check arguments and call them, are in the
package's top-level modules (``trisparse.attention``, ``trisparse.block_sparse``, ...)."""
