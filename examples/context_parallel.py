"""Context parallelism: a tiny NSA model trained with its sequence split over 4 CPU devices, step for step equal to
the same model trained on one device.

    python examples/context_parallel.py              # 30 steps
    python examples/context_parallel.py --steps 10 --layout zigzag

Inside `jax.shard_map` over a mesh axis "sp" of P = 4 devices, each device holds T / P tokens of every sequence:
contiguously (the default: device r holds tokens [r T / P, (r + 1) T / P), as shard_map splits the batch, so
nothing is reordered) or in the zig-zag layout (device r holds chunks r and 2P - 1 - r of 2P, so that each does the
same causal work). For zig-zag the input pipeline reorders the tokens once (`nsa.context.to_context_layout`), and
the positions the model embeds come from the same helper (`nsa.context.context_positions`: what RoPE would take;
for contiguous both are the identity). `nsa.attention(..., context_axis="sp", context_layout=...)` then gives each
device its rows of the attention over the whole sequence; the rest of the model is per token. The loss is the mean
over all tokens (a psum of each device's sum), the weights are replicated, and their gradients come out summed over
the devices.

The same model also trains on one device over the whole sequences (context_axis=None). Both start from the same
weights and take the same Adam steps: the losses agree at every step within 1e-4 of ln(VOCAB), the loss's scale
(float32 roundoff: the all-gather's transpose sums dk and dv in another order), and the loss falls below the
uniform guess's ln(VOCAB).

The toy task (`batch`): sequences that repeat LAG random tokens, each target the token itself, which the layer (its
attention alone) must read from an earlier copy. Pure JAX, the XLA reference (implementation="xla"), well under a
minute.
Exit code 0 and "PASS" when both hold.
"""

import argparse
import math
import os
import sys

P = 4  # devices the sequence is split over
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before jax starts
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={P}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec  # noqa: E402

import nsa  # noqa: E402
from nsa import context  # noqa: E402

VOCAB, T, BATCH, LAG = 16, 256, 4, 40
DIM, HQ, H, D = 64, 4, 1, 16
NSA = dict(block_size=16, block_counts=4, window_size=16, implementation="xla")
LOSS_TOLERANCE = 1e-4  # the sharded and the one-device loss at every step, relative to ln(VOCAB), the loss's scale


def init(key):
    keys = jax.random.split(key, 7)
    dense = lambda key, n, m: jax.random.normal(key, (n, m), jnp.float32) / math.sqrt(n)
    return dict(embed=0.5 * jax.random.normal(keys[0], (VOCAB, DIM)),
                position=0.02 * jax.random.normal(keys[1], (T, DIM)),
                wq=dense(keys[2], DIM, HQ * D), wk=dense(keys[3], DIM, H * D), wv=dense(keys[4], DIM, H * D),
                wg=dense(keys[5], DIM, 3 * HQ), wo=dense(keys[6], HQ * D, VOCAB))


def logits(params, tokens, positions, context_axis=None, layout="contiguous"):
    """One NSA layer over tokens [B, T'] at global positions [T'] (all of a sequence, or a device's rows of it)."""
    x = params["embed"][tokens] + params["position"][positions]
    B, Tx = tokens.shape
    q = (x @ params["wq"]).reshape(B, Tx, HQ, D)
    k = (x @ params["wk"]).reshape(B, Tx, H, D)
    v = (x @ params["wv"]).reshape(B, Tx, H, D)
    g_cmp, g_slc, g_swa = jnp.split(jax.nn.sigmoid(x @ params["wg"]), 3, axis=-1)
    o = nsa.attention(q, k, v, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, context_axis=context_axis,
                      context_layout=layout, **NSA)
    return o.reshape(B, Tx, HQ * D) @ params["wo"]


def token_losses(params, tokens, targets, positions, **sharding):
    logp = jax.nn.log_softmax(logits(params, tokens, positions, **sharding))
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0] * (positions >= LAG)  # [B, T']


def one_device_loss(params, tokens, targets):
    return jnp.sum(token_losses(params, tokens, targets, jnp.arange(T))) / (BATCH * (T - LAG))


def sharded_loss(layout):
    """The loss of (params, tokens, targets, positions), the last three in `layout` over the mesh: each device's
    sum over its rows, summed over the devices (psum)."""
    mesh = Mesh(np.array(jax.devices("cpu")[:P]), ("sp",))
    seq = PartitionSpec(None, "sp")

    def local(params, tokens, targets, positions):
        own = jnp.sum(token_losses(params, tokens, targets, positions, context_axis="sp", layout=layout))
        return jax.lax.psum(own, "sp") / (BATCH * (T - LAG))

    return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), seq, seq, PartitionSpec("sp")),
                         out_specs=PartitionSpec())


def adam(loss, lr=1e-2, b1=0.9, b2=0.99):
    """A jitted Adam step of `loss(params, *batch)`: (params, state, *batch) -> (params, state, loss)."""
    @jax.jit
    def step(params, state, *batch):
        value, grads = jax.value_and_grad(loss)(params, *batch)
        m, s, n = state
        m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
        s = jax.tree_util.tree_map(lambda s, g: b2 * s + (1 - b2) * g * g, s, grads)
        n = n + 1
        update = lambda p, m, s: p - lr * (m / (1 - b1 ** n)) / (jnp.sqrt(s / (1 - b2 ** n)) + 1e-8)
        return jax.tree_util.tree_map(update, params, m, s), (m, s, n), value

    return step


def batch(rng):
    """Sequences repeating LAG random tokens; each target is the token itself, which the layer (attention only, no
    residual) reads from an earlier copy: LAG back (a selected block, the compressed rows) or by chance in the
    window. The first LAG positions are not scored."""
    tokens = np.tile(rng.integers(0, VOCAB, (BATCH, LAG)), (1, -(-T // LAG)))[:, :T]
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(tokens, jnp.int32)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layout", choices=context.LAYOUTS, default="contiguous")
    args = parser.parse_args(argv)
    params = init(jax.random.key(0))
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    one, sharded = adam(one_device_loss), adam(sharded_loss(args.layout))
    state_one = state_sharded = (zeros, zeros, 0)
    params_one = params_sharded = params
    positions = jnp.asarray(context.context_positions(T, P, args.layout))  # each row's place in the sequence
    to_layout = lambda x: context.to_context_layout(x, P, args.layout)
    rng, agree = np.random.default_rng(0), True
    for i in range(args.steps):
        tokens, targets = batch(rng)
        params_one, state_one, loss_one = one(params_one, state_one, tokens, targets)
        params_sharded, state_sharded, loss = sharded(params_sharded, state_sharded, to_layout(tokens),
                                                      to_layout(targets), positions)
        close = abs(float(loss) - float(loss_one)) <= LOSS_TOLERANCE * math.log(VOCAB)
        agree &= close
        if i % 5 == 0 or i == args.steps - 1 or not close:
            print(f"step {i:3d}: loss over {P} devices ({args.layout}) {float(loss):.6f}, on one device "
                  f"{float(loss_one):.6f}{'' if close else '  DIFFERENT'}")
    learned = float(loss) < math.log(VOCAB)
    print(f"losses agree at every step: {agree}; final loss {float(loss):.4f} against ln(VOCAB) = "
          f"{math.log(VOCAB):.4f}: {'learned' if learned else 'not learned'}")
    ok = agree and learned
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
