"""Greedy generation with NSA over a KV cache: a tiny random-weight transformer, checked step by step.

    python examples/generate.py                   # 2 prompts of different lengths, 24 new tokens each
    python examples/generate.py --steps 64 --implementation xla

The model (Flax NNX, needs `pip install '.[nnx]'`): token embedding, `LAYERS` pre-norm blocks (the ready-made
layer `nsa.nnx.NativeSparseAttention`, which holds the q/k/v/o and gate projections and the rotary embedding,
then an MLP), output projection. Random weights: it generates nonsense, but every step does what a real
model's serving loop does:

1. **Prefill.** The prompts (right-padded to one length, `lens` the true lengths) run through the model, each
   layer's `prefill` attending over whole sequences (causal: a token never sees the padding after it) and
   returning a KV cache (`nsa.KVCache`) that holds each prompt's keys and values.
2. **Decode.** A `jax.lax.fori_loop` over steps, the caches in the carry (donated): each step embeds the last
   token of every sequence, and each layer's `step` appends its key and value to its cache and attends with
   the cache, at the position its sequence's length gives. The sequences have different lengths throughout
   (a ragged batch); the loop compiles once.
3. **Check.** The whole model is run again on the whole sequences, without a cache; at every generated
   token its next-token logits must match the cached step's and give the same token.

Exit code 0 and "PASS" when every step matches.
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nsa.nnx import NativeSparseAttention

VOCAB, DIM, LAYERS = 97, 64, 2
HQ, H, D = 8, 2, 16  # G = 4 query heads share a KV head
NSA = dict(block_size=8, block_counts=3, window_size=16)
TOLERANCE = 1e-4  # relative error allowed between cached and recomputed logits (float32)


def rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


class Block(nnx.Module):
    """A pre-norm block on x [B, T, DIM]: x + attention(norm(x)), then x + MLP(norm(x)). The attention runs
    over whole sequences (`__call__`), or fills a cache (`prefill`), or extends one (`step`)."""

    def __init__(self, implementation, rngs):
        self.attention = NativeSparseAttention(hidden_size=DIM, num_heads=HQ, num_kv_heads=H, head_dim=D, **NSA,
                                               implementation=implementation, rngs=rngs)
        self.up = nnx.Linear(DIM, 4 * DIM, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(4 * DIM, DIM, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.mlp(x + self.attention(rms_norm(x)))

    def prefill(self, x, lens, capacity):
        y, cache = self.attention.prefill(rms_norm(x), capacity=capacity, lens=lens)
        return self.mlp(x + y), cache

    def step(self, x, cache, lens=None):
        y, cache = self.attention.step(rms_norm(x), cache, lens=lens)
        return self.mlp(x + y), cache

    def mlp(self, x):
        return x + self.down(jax.nn.gelu(self.up(rms_norm(x))))


class Model(nnx.Module):
    """Tokens int [B, T] -> next-token logits [B, T, VOCAB]; random weights from `seed`."""

    def __init__(self, implementation=None, seed=0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.blocks = nnx.List([Block(implementation, rngs) for _ in range(LAYERS)])
        self.unembed = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        """The logits of whole sequences, no cache."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.unembed(rms_norm(x))

    def prefill(self, prompts, lens, capacity):
        """(logits [B, TP, VOCAB], one cache per layer) of right-padded prompts int [B, TP] (lens [B] long)."""
        x, caches = self.embed(prompts), []
        for block in self.blocks:
            x, cache = block.prefill(x, lens, capacity)
            caches.append(cache)
        return self.unembed(rms_norm(x)), caches

    def step(self, tokens, caches):
        """One new token per sequence (tokens int [B]): (logits [B, VOCAB], the caches with it appended)."""
        logits, caches = self.extend(tokens[:, None], caches)
        return logits[:, 0], caches

    def extend(self, tokens, caches, lens=None):
        """New tokens of each sequence, tokens int [B, TN] (sequence b's first lens[b] rows, int [B], default TN;
        contiguous or paged caches): (logits [B, TN, VOCAB], the caches with them appended)."""
        x, new_caches = self.embed(tokens), []
        for block, cache in zip(self.blocks, caches):
            x, cache = block.step(x, cache, lens)
            new_caches.append(cache)
        return self.unembed(rms_norm(x)), new_caches


def generate(model, prompts, lens, steps, capacity):
    """Greedy generation: (tokens int [B, steps], logits [steps, B, VOCAB]) after prompts int [B, TP]
    (right-padded, true lengths lens [B]). A jitted prefill, then a jitted fori_loop of decode steps."""
    graphdef, state = nnx.split(model)  # jax.jit takes the weights as a pytree: nnx.merge rebuilds the model
    lens = jnp.asarray(lens, jnp.int32)
    prefill = jax.jit(lambda state, prompts, lens: nnx.merge(graphdef, state).prefill(prompts, lens, capacity))
    logits, caches = prefill(state, prompts, lens)
    first = jnp.argmax(logits[jnp.arange(len(lens)), lens - 1], axis=-1)  # after each prompt's last real token

    def decode(state, carry):
        model = nnx.merge(graphdef, state)

        def body(i, carry):
            caches, tokens, all_logits, token = carry
            tokens = tokens.at[:, i].set(token)
            step_logits, caches = model.step(token, caches)
            return caches, tokens, all_logits.at[i].set(step_logits), jnp.argmax(step_logits, axis=-1)

        return jax.lax.fori_loop(0, steps, body, carry)

    B = prompts.shape[0]
    carry = (caches, jnp.zeros((B, steps), jnp.int32), jnp.zeros((steps, B, VOCAB)), first.astype(jnp.int32))
    _, tokens, all_logits, _ = jax.jit(decode, donate_argnums=1)(state, carry)
    return tokens, all_logits


def check(model, prompts, lens, tokens, logits):
    """The largest relative difference between the cached logits of each step and those of the whole model
    on the whole sequences (right-padded into one batch: causal, so the padding changes nothing before it),
    and whether every generated token is the recomputed argmax."""
    steps = tokens.shape[1]
    sequences = jnp.stack([jnp.concatenate([prompts[b, :n], tokens[b], prompts[b, n:]]) for b, n in enumerate(lens)])
    full = nnx.jit(lambda model, tokens: model(tokens))(model, sequences)
    worst, same = 0.0, True
    for b, n in enumerate(lens):
        want = full[b, n:n + steps]  # the logits after each generated token: step i fed token i
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
    model = Model(args.implementation)
    rng = np.random.default_rng(0)
    lens = [37, 13]  # a ragged batch: prompts of 37 and 13 tokens, right-padded
    prompts = jnp.asarray(rng.integers(0, VOCAB, (len(lens), max(lens))), jnp.int32)
    capacity = max(lens) + args.steps
    start = time.perf_counter()
    tokens, logits = generate(model, prompts, lens, args.steps, capacity)
    tokens.block_until_ready()
    print(f"generated {args.steps} tokens for {len(lens)} prompts of {list(lens)} tokens "
          f"in {time.perf_counter() - start:.1f} s (compile included)")
    for b in range(len(lens)):
        print(f"  sequence {b}: ... {np.asarray(prompts[b, lens[b] - 5:lens[b]]).tolist()} -> "
              f"{np.asarray(tokens[b]).tolist()}")
    worst, same = check(model, prompts, lens, tokens, logits)
    ok = worst <= TOLERANCE and same
    print(f"cached vs full recompute at every step: largest relative logit difference {worst:.2e} "
          f"(tolerance {TOLERANCE:.0e}), same tokens: {same}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
