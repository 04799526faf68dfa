"""Greedy generation with NSA over a KV cache: a tiny random-weight transformer, checked step by step.

    python examples/generate.py                   # 2 prompts of different lengths, 24 new tokens each
    python examples/generate.py --steps 64 --implementation xla

The model: token embedding, `LAYERS` pre-norm blocks (NSA attention with learned-style gates, then an
MLP), output projection; rotary position embeddings on q and k. Random weights: it generates nonsense,
but every step does what a real model's serving loop does:

1. **Prefill.** The prompts (right-padded to one length, `lens` the true lengths) run through the model in
   the full-sequence mode of `nsa.attention` (causal: a token never sees the padding after it), and each
   layer's keys and values go into its cache with `nsa.prefill_cache`.
2. **Decode.** A `jax.lax.fori_loop` over steps, the caches in the carry: each step embeds the last token of
   every sequence, and each layer appends its key and value (`nsa.append_to_cache`) and attends with the
   cache (`nsa.attention(..., k_cmp=cache.k_cmp, v_cmp=cache.v_cmp, kv_lens=cache.lens)`); the position
   of the new token (for the rotary embedding) is its sequence's length before the append. The sequences
   have different lengths throughout (a ragged batch); the loop compiles once.
3. **Check.** For every generated token, the whole model is run again on the whole sequence so far,
   without a cache; its next-token logits must match the cached step's and give the same token.

Exit code 0 and "PASS" when every step matches.
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import nsa

VOCAB, DIM, LAYERS = 97, 64, 2
HQ, H, D = 8, 2, 16  # G = 4 query heads share a KV head
NSA = dict(block_size=8, block_counts=3, window_size=16)
TOLERANCE = 1e-4  # relative error allowed between cached and recomputed logits (float32)


def init(seed=0):
    """Random weights: a dict of arrays (a pytree)."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 2 + 6 * LAYERS))
    normal = lambda shape, fan_in: jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(fan_in)
    layer = lambda: dict(wq=normal((DIM, HQ * D), DIM), wk=normal((DIM, H * D), DIM), wv=normal((DIM, H * D), DIM),
                         wg=normal((DIM, 3 * HQ), DIM), wo=normal((HQ * D, DIM), HQ * D),
                         mlp=normal((DIM, 4 * DIM), DIM))
    return dict(embed=normal((VOCAB, DIM), 1.0), unembed=normal((DIM, VOCAB), DIM),
                layers=[layer() for _ in range(LAYERS)])


def rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def rotary(x, positions):
    """Rotary position embedding of x [B, T, heads, D] at positions int [B, T]."""
    freq = 1.0 / (10000.0 ** (jnp.arange(0, D, 2) / D))
    angle = positions[:, :, None, None].astype(jnp.float32) * freq  # [B, T, 1, D / 2]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.stack([x1 * jnp.cos(angle) - x2 * jnp.sin(angle), x1 * jnp.sin(angle) + x2 * jnp.cos(angle)],
                     axis=-1).reshape(x.shape)


def project(layer, x, positions):
    """q [B, T, HQ, D], k, v [B, T, H, D] and the three gates [B, T, HQ] of a block's input x [B, T, DIM]."""
    B, T = x.shape[:2]
    h = rms_norm(x)
    q = rotary((h @ layer["wq"]).reshape(B, T, HQ, D), positions)
    k = rotary((h @ layer["wk"]).reshape(B, T, H, D), positions)
    v = (h @ layer["wv"]).reshape(B, T, H, D)
    gates = jax.nn.sigmoid(h @ layer["wg"]).reshape(B, T, 3, HQ)
    return q, k, v, dict(g_cmp=gates[:, :, 0], g_slc=gates[:, :, 1], g_swa=gates[:, :, 2])


def finish(layer, x, o):
    """The block's output: x + attention output projected, then + MLP."""
    x = x + o.reshape(*o.shape[:2], HQ * D) @ layer["wo"]
    return x + jax.nn.gelu(rms_norm(x) @ layer["mlp"]) @ layer["mlp"].T


def forward(params, tokens, implementation):
    """Logits [B, T, VOCAB] of the whole sequences tokens int [B, T] (no cache), and each layer's k, v."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    x = params["embed"][tokens]
    kvs = []
    for layer in params["layers"]:
        q, k, v, gates = project(layer, x, positions)
        x = finish(layer, x, nsa.attention(q, k, v, **gates, **NSA, implementation=implementation))
        kvs.append((k, v))
    return rms_norm(x) @ params["unembed"], kvs


def decode_step(params, caches, tokens, implementation):
    """One new token per sequence (tokens int [B]): (logits [B, VOCAB], the caches with it appended)."""
    x = params["embed"][tokens][:, None]  # [B, 1, DIM]
    positions = caches[0].lens[:, None]  # the new token's position: its sequence's length so far
    new_caches = []
    for layer, cache in zip(params["layers"], caches):
        q, k, v, gates = project(layer, x, positions)
        cache = nsa.append_to_cache(cache, k, v, block_size=NSA["block_size"])
        o = nsa.attention(q, cache.k, cache.v, k_cmp=cache.k_cmp, v_cmp=cache.v_cmp, kv_lens=cache.lens, **gates,
                          **NSA, implementation=implementation)
        x = finish(layer, x, o)
        new_caches.append(cache)
    return (rms_norm(x) @ params["unembed"])[:, 0], new_caches


def generate(params, prompts, lens, steps, capacity, implementation=None):
    """Greedy generation: (tokens int [B, steps], logits [steps, B, VOCAB]) after prompts int [B, TP]
    (right-padded, true lengths lens [B]). Prefill, then a jitted fori_loop of decode steps."""
    lens = jnp.asarray(lens, jnp.int32)
    logits, kvs = jax.jit(forward, static_argnums=2)(params, prompts, implementation)
    caches = [nsa.prefill_cache(k, v, block_size=NSA["block_size"], capacity=capacity, lens=lens) for k, v in kvs]
    first = jnp.argmax(logits[jnp.arange(len(lens)), lens - 1], axis=-1)  # each prompt's last real token

    def body(i, carry):
        caches, tokens, all_logits, token = carry
        tokens = tokens.at[:, i].set(token)
        step_logits, caches = decode_step(params, caches, token, implementation)
        return caches, tokens, all_logits.at[i].set(step_logits), jnp.argmax(step_logits, axis=-1)

    B = prompts.shape[0]
    carry = (caches, jnp.zeros((B, steps), jnp.int32), jnp.zeros((steps, B, VOCAB)), first.astype(jnp.int32))
    run = jax.jit(lambda carry: jax.lax.fori_loop(0, steps, body, carry), donate_argnums=0)
    _, tokens, all_logits, _ = run(carry)
    return tokens, all_logits


def check(params, prompts, lens, tokens, logits, implementation=None):
    """The largest relative difference between the cached logits of each step and those of the whole model
    on the whole sequence so far, and whether every generated token is the recomputed argmax."""
    worst, same = 0.0, True
    for b, n in enumerate(lens):
        sequence = jnp.concatenate([prompts[b, :n], tokens[b]])[None]
        full, _ = forward(params, sequence, implementation)
        want = full[0, n:n + tokens.shape[1]]  # the logits after the prompt's last token and each new one
        got = logits[:, b]
        worst = max(worst, float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))))
        # token i + 1 was chosen from step i's logits; token 0 from the prompt's
        same &= bool(jnp.all(jnp.argmax(want[:-1], axis=-1) == tokens[b, 1:]))
    return worst, same


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="tokens to generate per sequence")
    parser.add_argument("--implementation", default=None, choices=["xla", "triton", "pallas"],
                        help="nsa's implementation (default: the best for the platform)")
    args = parser.parse_args(argv)
    params = init()
    rng = np.random.default_rng(0)
    lens = [37, 13]  # a ragged batch: prompts of 37 and 13 tokens, right-padded
    prompts = jnp.asarray(rng.integers(0, VOCAB, (len(lens), max(lens))), jnp.int32)
    capacity = max(lens) + args.steps
    start = time.perf_counter()
    tokens, logits = generate(params, prompts, lens, args.steps, capacity, args.implementation)
    tokens.block_until_ready()
    print(f"generated {args.steps} tokens for {len(lens)} prompts of {list(lens)} tokens "
          f"in {time.perf_counter() - start:.1f} s (compile included)")
    for b in range(len(lens)):
        print(f"  sequence {b}: ... {np.asarray(prompts[b, lens[b] - 5:lens[b]]).tolist()} -> "
              f"{np.asarray(tokens[b]).tolist()}")
    worst, same = check(params, prompts, lens, tokens, logits, args.implementation)
    ok = worst <= TOLERANCE and same
    print(f"cached vs full recompute at every step: largest relative logit difference {worst:.2e} "
          f"(tolerance {TOLERANCE:.0e}), same tokens: {same}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
