"""Runs nsa's Triton kernels on the CPU in Triton's interpreter (TRITON_INTERPRET=1), for CI.

Only the `triton` package is needed: no GPU, no torch, no jax_triton. `interpret_call` has
jax_triton.triton_call's signature and runs the kernel on NumPy buffers inside jax.pure_callback, so
it also works under jit; `install` routes implementation="triton" to it for one test. The
interpreter handles float32 and float16 (not bfloat16: that dtype is tested on the GPU).
"""

import os
import threading

import jax
import numpy as np

# XLA's CPU runtime may run two independent callbacks at once, and the interpreter patches triton.language
# for the duration of a kernel (an interpreted sort then failed with "Did you forget to add @triton.jit?")
_ONE_KERNEL_AT_A_TIME = threading.Lock()


class _Buffer:
    """Just enough of torch.Tensor (and its storage) for Triton's interpreter: a pointer and a dtype."""

    def __init__(self, array):
        self.array = array
        self.dtype = f"torch.{array.dtype.name}"  # how Triton names the element type of a tensor

    def data_ptr(self):
        return self.array.ctypes.data

    def untyped_storage(self):
        return self

    def cpu(self):  # the interpreter copies arguments to the host: these already are
        return self

    def new_empty(self, *args, **kwargs):
        return self

    def set_(self, *args):
        return self

    def storage_offset(self):
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def copy_(self, other):
        return self


def interpret_call(*args, kernel, out_shape, grid, num_warps=None, num_stages=None, input_output_aliases=None,
                   zeroed_outputs=(), name="", **metaparams):
    """jax_triton.triton_call's contract (outputs zero-initialized), run by the interpreter."""
    single = not isinstance(out_shape, (list, tuple))
    outs = [out_shape] if single else list(out_shape)
    aliases = dict(input_output_aliases or {})
    is_array = [hasattr(a, "shape") and hasattr(a, "dtype") for a in args]

    def host(*arrays):
        arrays = iter(arrays)
        inputs = [np.array(next(arrays)) if arr else a for a, arr in zip(args, is_array)]
        outputs = [np.zeros(o.shape, o.dtype) for o in outs]
        for i, o in aliases.items():
            outputs[o][...] = inputs[i]
        launch = grid(metaparams) if callable(grid) else grid
        with _ONE_KERNEL_AT_A_TIME:
            kernel[tuple(launch)](*[_Buffer(x) if isinstance(x, np.ndarray) else x for x in inputs],
                                  *[_Buffer(x) for x in outputs], **metaparams)
        return outputs

    result = jax.pure_callback(host, [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs],
                               *[a for a, arr in zip(args, is_array) if arr])
    return result[0] if single else result


def _loop_bounds_as_ints(monkeypatch):
    """Triton 3.6's interpreter turns a tensor loop bound into an int with int(array of shape (1,)),
    which NumPy >= 2.3 refuses; the kernels loop over data-dependent ranges, so read element 0."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch)


def install(monkeypatch):
    """Routes implementation="triton" to the interpreted kernels for one test (a pytest monkeypatch).

    TRITON_INTERPRET=1 must already be set when nsa.triton is first imported (tests/conftest.py)."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before nsa.triton is imported"
    from nsa import _dispatch
    from nsa.triton import _launch

    _loop_bounds_as_ints(monkeypatch)

    monkeypatch.setattr(_launch, "_call", interpret_call)
    real = _dispatch.import_error
    monkeypatch.setattr(_dispatch, "import_error", lambda family: None if family == "triton" else real(family))
