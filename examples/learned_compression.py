"""The paper's learned compression: an MLP phi over overlapping windows of tokens, trained inside NSA.

    python examples/learned_compression.py              # 300 steps, then the finite-difference check
    python examples/learned_compression.py --steps 100

NSA's compressed branch (arXiv 2502.11089, Eq. 7) turns each window of l tokens, taken every d tokens, into one
compressed key and one compressed value with a learned phi: "an MLP with intra-block position encoding". nsa
gives the windows (`nsa.compression_windows`); the model applies its own phi and passes the rows to
`nsa.attention` as k_cmp and v_cmp with the same compress_block_size and compress_stride. The rows do two
jobs: the compressed branch attends over them, and their attention probabilities, summed over each selection
block of l' tokens by Eq. 9, choose the blocks the selected branch reads. Gradients reach phi through the
first (block choice is discrete).

Here, at a quarter of the paper's sizes (l = 8, d = 4, l' = 16, against 32, 16, 64), a one-layer model learns a
toy task: each target is the token LAG positions back, past the sliding window, so the answer comes from the
compressed rows or from a selected block. Pure JAX (a hand-written Adam, no optimizer library), float32, on the
CPU in well under a minute. Then, in float64, the gradient with respect to each of phi's weights is checked
against central finite differences along a random direction.

Exit code 0 and "PASS" when the loss went down, below the uniform guess's ln(VOCAB), and every gradient agrees.
"""

import argparse
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

import nsa

VOCAB, T, BATCH, LAG = 16, 128, 8, 40
DIM, HQ, H, D = 64, 4, 1, 16  # G = 4 query heads share one KV head
L, STRIDE, BLOCK = 8, 4, 16  # compression windows of L tokens every STRIDE; selection blocks of BLOCK
NSA = dict(block_size=BLOCK, compress_block_size=L, compress_stride=STRIDE, block_counts=4, window_size=16)
HIDDEN = 64  # phi's hidden width
GRAD_TOLERANCE = 1e-6  # relative error of a float64 central difference against the gradient


def dense(key, fan_in, fan_out):
    return jax.random.normal(key, (fan_in, fan_out), jnp.float32) / math.sqrt(fan_in)


def init_phi(key):
    """The paper's phi for one of k and v: a position embedding of the L slots of a window, added to its tokens,
    then a two-layer MLP over the flattened window [L * D] -> [D]."""
    k_pos, k1, k2 = jax.random.split(key, 3)
    return dict(position=0.02 * jax.random.normal(k_pos, (L, D), jnp.float32),
                w1=dense(k1, L * D, HIDDEN), w2=dense(k2, HIDDEN, D))


def phi(params, windows):
    """windows [B, NC, L, H, D] (zero past a sequence's end) -> compressed rows [B, NC, H, D]."""
    x = windows + params["position"][None, None, :, None, :]
    x = jnp.moveaxis(x, 3, 2).reshape(*x.shape[:2], x.shape[3], L * D)  # [B, NC, H, L * D]
    return jax.nn.gelu(x @ params["w1"]) @ params["w2"]


def init(key):
    keys = jax.random.split(key, 9)
    return dict(embed=jax.random.normal(keys[0], (VOCAB, DIM), jnp.float32),
                position=jax.random.normal(keys[1], (T, DIM), jnp.float32),
                wq=dense(keys[2], DIM, HQ * D), wk=dense(keys[3], DIM, H * D), wv=dense(keys[4], DIM, H * D),
                wg=dense(keys[5], DIM, 3 * HQ), wo=dense(keys[6], HQ * D, VOCAB),
                phi_k=init_phi(keys[7]), phi_v=init_phi(keys[8]))


def logits(params, tokens, implementation=None):
    """tokens int [B, T] -> next-answer logits [B, T, VOCAB]: one NSA layer with learned compression."""
    B = tokens.shape[0]
    x = params["embed"][tokens] + params["position"][None]
    q = (x @ params["wq"]).reshape(B, T, HQ, D)
    k = (x @ params["wk"]).reshape(B, T, H, D)
    v = (x @ params["wv"]).reshape(B, T, H, D)
    window = dict(block_size=L, stride=STRIDE)
    k_cmp = phi(params["phi_k"], nsa.compression_windows(k, **window)[0])
    v_cmp = phi(params["phi_v"], nsa.compression_windows(v, **window)[0])
    g = jax.nn.sigmoid(x @ params["wg"]).reshape(B, T, 3, HQ)
    o = nsa.attention(q, k, v, k_cmp=k_cmp, v_cmp=v_cmp, g_cmp=g[:, :, 0], g_slc=g[:, :, 1], g_swa=g[:, :, 2],
                      implementation=implementation, **NSA)
    return o.reshape(B, T, HQ * D) @ params["wo"]


def batch(key):
    """Random tokens, and as targets the token LAG back (scored only where there is one)."""
    tokens = jax.random.randint(key, (BATCH, T), 0, VOCAB)
    return tokens, jnp.roll(tokens, LAG, axis=1)


def loss_fn(params, tokens, targets):
    logp = jax.nn.log_softmax(logits(params, tokens), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(nll[:, LAG:])


def adam(lr, b1=0.9, b2=0.99, eps=1e-8):
    def init_state(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return dict(m=zeros, v=zeros, step=jnp.zeros((), jnp.int32))

    def update(grads, state, params):
        step = state["step"] + 1
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
        correction = jnp.sqrt(1 - b2 ** step) / (1 - b1 ** step)
        params = jax.tree.map(lambda p, m, v: p - lr * correction * m / (jnp.sqrt(v) + eps), params, m, v)
        return params, dict(m=m, v=v, step=step)

    return init_state, update


def train(steps, seed=0):
    init_state, update = adam(3e-3)

    @jax.jit
    def step(params, state, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch(key))
        params, state = update(grads, state, params)
        return params, state, loss

    params = init(jax.random.key(seed))
    state = init_state(params)
    losses = []
    for i, key in enumerate(jax.random.split(jax.random.key(seed + 1), steps)):
        params, state, loss = step(params, state, key)
        losses.append(float(loss))
        if i % 50 == 0 or i == steps - 1:
            print(f"step {i:4d}  loss {losses[-1]:.3f}", flush=True)
    return params, np.array(losses)


def check_phi_gradients(params, seed=2, eps=1e-5):
    """In float64: for each of phi's weights w, d loss / d w along a random unit direction u, from the gradient
    (<grad, u>) and from central differences ((loss(w + eps u) - loss(w - eps u)) / 2 eps). Returns the
    relative errors (against the larger of |<grad, u>| and the gradient's norm, the quantity's natural size)."""
    params = jax.tree.map(lambda p: p.astype(jnp.float64), params)
    tokens, targets = batch(jax.random.key(seed))
    loss = jax.jit(lambda p: loss_fn(p, tokens, targets))
    grads = jax.jit(jax.grad(loss_fn))(params, tokens, targets)
    errors = {}
    keys = iter(jax.random.split(jax.random.key(seed + 1), 16))
    for branch in ("phi_k", "phi_v"):
        for name, w in params[branch].items():
            u = jax.random.normal(next(keys), w.shape, jnp.float64)
            u = u / jnp.linalg.norm(u)
            moved = lambda s: loss({**params, branch: {**params[branch], name: w + s * u}})
            finite_difference = float((moved(eps) - moved(-eps)) / (2 * eps))
            g = grads[branch][name]
            analytic = float(jnp.vdot(g, u))
            scale = max(abs(analytic), float(jnp.linalg.norm(g)))
            errors[f"{branch}.{name}"] = abs(finite_difference - analytic) / scale
            print(f"d loss / d {branch}.{name} along u: gradient {analytic:+.6e}, finite difference "
                  f"{finite_difference:+.6e}, relative error {errors[f'{branch}.{name}']:.1e}", flush=True)
    return errors


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)  # the gradient check's float64; the model itself is float32
    params, losses = train(args.steps)
    window = max(1, args.steps // 10)
    first, last = losses[:window].mean(), losses[-window:].mean()
    learned = last < first and last < math.log(VOCAB)
    print(f"mean loss of the first {window} steps {first:.3f}, of the last {window} {last:.3f}; "
          f"uniform guess ln({VOCAB}) = {math.log(VOCAB):.3f}: {'learned' if learned else 'NOT learned'}")
    errors = check_phi_gradients(params)
    agree = all(e <= GRAD_TOLERANCE for e in errors.values())
    print(f"phi's gradients {'agree' if agree else 'DISAGREE'} with finite differences (largest relative error "
          f"{max(errors.values()):.1e}, tolerance {GRAD_TOLERANCE:.0e})")
    ok = learned and agree
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
