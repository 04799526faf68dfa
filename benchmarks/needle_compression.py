"""Does the paper's compression help notebook 05's needle task? A measurement, on the CPU.

    python -m benchmarks.needle_compression --out benchmarks/results [--seeds 0 1 2] [--steps 300]

Notebook 05 (`notebooks/05_needle.ipynb`) trains one NSA layer to retrieve a value planted as 8 repeated tokens
somewhere in 1024 filler tokens, far outside a 128-token window, with nsa's default compression: the mean of
each 32-token selection block. This script trains the same model on the same task with three compressions of
the keys and values that the compressed branch attends and the selection scores (Eq. 9), all selecting 6 blocks
of l' = 32:

  mean 32/32   the notebook's: k_cmp = the mean of each block (l = d = l' = 32);
  mean 16/8    overlapping means, windows of l = 16 every d = 8 (the paper's ratios l' = 2l = 4d);
  phi 16/8     the same windows through the paper's learned phi (an intra-window position embedding, then an
               MLP over the flattened window, one for k and one for v), as in examples/learned_compression.py.

For each seed and compression it records, every 10 steps, the held-out accuracy (128 sequences) and whether the
needle's block is among the final query's selected blocks, and reports the first step reaching 50% and 90%
accuracy and the final numbers. Writes needle-compression.json into --out and prints a table.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import nsa

T, NEEDLE = 1024, 8  # sequence length, needle length
N_VAL, QUERY, VOCAB = 16, 16, 32  # value tokens 0..15, query token 16, filler 17..31
BS, NSEL, WIN = 32, 6, 128  # selection block l', blocks selected per query, sliding window
HQ, H, D, DM, HIDDEN = 4, 1, 32, 64, 64  # query heads, KV heads, head dim, model width, phi's hidden width
B, LR, EVERY = 16, 1e-2, 10  # batch, Adam learning rate, steps between held-out checks
COMPRESSIONS = {"mean 32/32": (32, 32, False), "mean 16/8": (16, 8, False), "phi 16/8": (16, 8, True)}


def make_batch(key, n):
    """n sequences: tokens [n, T], the value to retrieve [n], the needle's selection block [n] (notebook 05's)."""
    k1, k2, k3 = jax.random.split(key, 3)
    toks = jax.random.randint(k1, (n, T), QUERY + 1, VOCAB)
    start = jax.random.randint(k2, (n,), BS + 1, T - WIN - 2 * BS - NEEDLE + 1)
    val = jax.random.randint(k3, (n,), 0, N_VAL)
    toks = toks.at[jnp.arange(n)[:, None], start[:, None] + jnp.arange(NEEDLE)].set(val[:, None])
    return toks.at[:, T - 1].set(QUERY), val, (start + NEEDLE // 2) // BS


def init(key, l, learned):
    ks = jax.random.split(key, 11)
    w = lambda k, shape, fan_in: jax.random.normal(k, shape) / np.sqrt(fan_in)
    p = dict(emb=w(ks[0], (VOCAB, DM), 1.0), wq=w(ks[1], (DM, HQ * D), DM), wk=w(ks[2], (DM, H * D), DM),
             wv=w(ks[3], (DM, H * D), DM), w_gate=w(ks[4], (DM, 3 * HQ), DM), wo=w(ks[5], (HQ * D, DM), HQ * D),
             readout=w(ks[6], (DM, N_VAL), DM))
    if learned:
        for name, k1, k2 in (("phi_k", ks[7], ks[8]), ("phi_v", ks[9], ks[10])):
            p[name] = dict(position=jnp.zeros((l, D)), w1=w(k1, (l * D, HIDDEN), l * D), w2=w(k2, (HIDDEN, D), HIDDEN))
    return p


def phi(params, windows):
    """windows [n, NC, l, H, D] -> rows [n, NC, H, D]: position embedding, then an MLP over the whole window."""
    x = jnp.moveaxis(windows + params["position"][None, None, :, None, :], 3, 2)
    return jax.nn.gelu(x.reshape(*x.shape[:3], -1) @ params["w1"]) @ params["w2"]


def compressed(p, k, v, l, d):
    """k_cmp, v_cmp [n, NC, H, D]: the windows' means, or phi of them where the model has phi."""
    if "phi_k" not in p:
        return nsa.compress(k, block_size=l, stride=d), nsa.compress(v, block_size=l, stride=d)
    return (phi(p["phi_k"], nsa.compression_windows(k, block_size=l, stride=d)[0]),
            phi(p["phi_v"], nsa.compression_windows(v, block_size=l, stride=d)[0]))


def forward(p, toks, l, d):
    """Logits over the 16 values [n, 16] and the final query's selected blocks [n, NSEL]."""
    n = toks.shape[0]
    x = p["emb"][toks]
    q = (x[:, -1:] @ p["wq"]).reshape(n, 1, HQ, D)
    k, v = (x @ p["wk"]).reshape(n, T, H, D), (x @ p["wv"]).reshape(n, T, H, D)
    k_cmp, v_cmp = compressed(p, k, v, l, d)
    blocks = dict(block_counts=NSEL, block_size=BS, compress_block_size=l, compress_stride=d,
                  kv_lens=jnp.full((n,), T, jnp.int32))  # q is the last token
    g = jax.nn.sigmoid(x[:, -1:] @ p["w_gate"]).reshape(n, 1, 3, HQ)
    o = nsa.attention(q, k, v, k_cmp=k_cmp, v_cmp=v_cmp, g_cmp=g[:, :, 0], g_slc=g[:, :, 1], g_swa=g[:, :, 2],
                      window_size=WIN, **blocks)
    idx = nsa.select_blocks(q, k_cmp, **blocks)[:, 0, 0]
    return (x[:, -1] + o.reshape(n, HQ * D) @ p["wo"]) @ p["readout"], idx


def loss_fn(p, toks, val, l, d):
    logits, _ = forward(p, toks, l, d)
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(val)), val])


def adam(p, grads, state, b1=0.9, b2=0.999, eps=1e-8):
    m, s, t = state
    t = t + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    s = jax.tree.map(lambda s, g: b2 * s + (1 - b2) * g * g, s, grads)
    p = jax.tree.map(lambda p, m, s: p - LR * (m / (1 - b1 ** t)) / (jnp.sqrt(s / (1 - b2 ** t)) + eps), p, m, s)
    return p, (m, s, t)


def train(name, seed, steps):
    l, d, learned = COMPRESSIONS[name]
    step = jax.jit(lambda p, state, key: adam(p, jax.grad(loss_fn)(p, *make_batch(key, B)[:2], l, d), state))
    evaluate = jax.jit(lambda p, toks: forward(p, toks, l, d))
    eval_toks, eval_val, eval_block = make_batch(jax.random.PRNGKey(12345), 128)
    p = init(jax.random.PRNGKey(seed), l, learned)
    state = (jax.tree.map(jnp.zeros_like, p), jax.tree.map(jnp.zeros_like, p), 0)
    history = dict(step=[], accuracy=[], needle_selected=[])
    t0 = time.time()
    for i in range(steps + 1):
        if i % EVERY == 0:
            logits, idx = evaluate(p, eval_toks)
            history["step"].append(i)
            history["accuracy"].append(float(jnp.mean(logits.argmax(-1) == eval_val)))
            history["needle_selected"].append(float(jnp.mean(jnp.any(idx == eval_block[:, None], axis=-1))))
        if i < steps:
            p, state = step(p, state, jax.random.PRNGKey(1000 * (seed + 1) + i))
    first = lambda threshold: next((s for s, a in zip(history["step"], history["accuracy"]) if a >= threshold), None)
    row = dict(compression=name, l=l, d=d, learned_phi=learned, seed=seed, steps=steps, to_50=first(0.5),
               to_90=first(0.9), final_accuracy=history["accuracy"][-1],
               final_needle_selected=history["needle_selected"][-1], seconds=time.time() - t0, history=history)
    print(json.dumps({k: v for k, v in row.items() if k != "history"}), flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    jax.config.update("jax_default_matmul_precision", "float32")
    rows = [train(name, seed, args.steps) for seed in args.seeds for name in COMPRESSIONS]
    result = dict(date=time.strftime("%Y-%m-%d"), jax=jax.__version__, backend=jax.default_backend(), rows=rows)
    with open(f"{args.out}/needle-compression.json", "w") as f:
        json.dump(result, f, indent=1)
    print("| compression | seed | steps to 50% | steps to 90% | final accuracy | needle's block selected |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['compression']} | {r['seed']} | {r['to_50']} | {r['to_90']} | {r['final_accuracy']:.3f} | "
              f"{r['final_needle_selected']:.3f} |")


if __name__ == "__main__":
    main()
