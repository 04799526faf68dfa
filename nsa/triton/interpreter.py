"""Runs nsa's Triton kernels on the CPU in Triton's interpreter: how CI tests the kernel bodies, and a way to
step through a kernel (or print from it) on a laptop.

    import os
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported: read when a kernel is decorated
    import nsa
    from nsa.triton import interpreter

    with interpreter.interpreted():
        o = nsa.selected_attention(q, k, v, block_indices, block_size=16, implementation="triton")

Only the `triton` package is needed (CI tests Triton 3.6 and 3.9): no GPU, no torch, no jax_triton.
`interpret_call` has jax_triton.triton_call's signature and runs the kernel on NumPy buffers inside
jax.pure_callback, so it also works under jit; `interpreted` routes implementation="triton" to it while it
is active. The interpreter handles float32 and float16 (not bfloat16: that dtype is tested on the GPU).
Every grid program runs one after another on the host: exact, and slow.
"""

import contextlib
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


def _undefined(shape, dtype):
    """An output's contents before the kernel writes it: NaN for floats, -7 for integers (neither zero nor -1, the
    kernels' own fill values)."""
    return np.full(shape, np.nan if np.issubdtype(dtype, np.floating) else -7, dtype)


def interpret_call(*args, kernel, out_shape, grid, num_warps=None, num_stages=None, input_output_aliases=None,
                   zeroed_outputs=(), name="", **metaparams):
    """jax_triton.triton_call's contract, run by the interpreter: the outputs named in zeroed_outputs start at
    zero, the others (undefined on the GPU) start as `_undefined` fills them, so that a kernel that reads an output
    it did not write fails here too."""
    single = not isinstance(out_shape, (list, tuple))
    outs = [out_shape] if single else list(out_shape)
    aliases = dict(input_output_aliases or {})
    is_array = [hasattr(a, "shape") and hasattr(a, "dtype") for a in args]

    def host(*arrays):
        arrays = iter(arrays)
        inputs = [np.array(next(arrays)) if arr else a for a, arr in zip(args, is_array)]
        outputs = [np.zeros(o.shape, o.dtype) if i in zeroed_outputs else _undefined(o.shape, o.dtype)
                   for i, o in enumerate(outs)]
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


def _loop_bounds_as_ints(original):
    """Triton 3.6's interpreter turns a tensor loop bound into an int with int(array of shape (1,)), which
    NumPy >= 2.3 refuses; the kernels loop over data-dependent ranges, so read element 0. Wraps the
    interpreter's `_patch_lang_tensor` (`original`)."""

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    return patch


def _comparisons_as_int1(builder):
    """Triton's interpreter (3.6 to 3.9 at least) gives the handle of a comparison the operands' element type
    (int32 for `blk >= 0`) around its bool data, while the tensor is typed int1: splatting such a scalar to a
    block (`(blk >= 0) & (j < BS)`) then makes int32 data, an int32 mask, which 3.9's load refuses ("mask has
    unsupported dtype"; 3.6 read it as 0 / 1). Returns (builder, name, method) for each comparison method of
    the interpreter's `builder` class, its handle typed int1 as the compiled kernel's is."""
    from triton import language as tl

    def as_int1(compare):
        def method(self, lhs, rhs):
            handle = compare(self, lhs, rhs)
            return type(handle)(handle.data, tl.int1)

        return method

    return [(builder, name, as_int1(getattr(builder, name))) for name in dir(builder)
            if name.startswith(("create_icmp", "create_fcmp"))]


@contextlib.contextmanager
def interpreted():
    """While active, implementation="triton" runs nsa's Triton kernels in Triton's interpreter (any
    platform; implementation=None still picks what the platform runs). TRITON_INTERPRET=1 must be set
    before triton is first imported; a RuntimeError says so otherwise."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("interpreted(): set the environment variable TRITON_INTERPRET=1 before triton is first "
                           f"imported (it is {os.environ.get('TRITON_INTERPRET')!r})")
    from triton.runtime import interpreter

    from nsa.triton import _launch

    patches = [(_launch, "_call", interpret_call),
               (interpreter, "_patch_lang_tensor", _loop_bounds_as_ints(interpreter._patch_lang_tensor)),
               *_comparisons_as_int1(interpreter.InterpreterBuilder)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
