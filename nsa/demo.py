"""`python -m nsa.demo`: NSA on a built-in example, checked against dense masked attention.

It runs `nsa.attention` on random q, k, v and gates (no model, nothing trained), recomputes the same
output densely in plain jnp (each branch as a softmax over all T keys under an explicit [T, T] mask, or
[T, NC] for the compressed keys), prints the largest difference with PASS or FAIL (exit code 1 on FAIL), checks the
selection against the dense compressed scores, prints how sparse the attention is, and draws which
blocks each query selected to demo_selection.png (with matplotlib: `pip install '.[demo]'` from a checkout; without
it the demo says so and skips the picture). With random inputs the compressed scores carry no
information, so the blocks picked beyond the forced ones look like noise: the picture shows which blocks
a query may read and how few keys that is, not what a model attends to. In a trained model the picked
blocks follow the content, e.g. a query keeps selecting the block of a fact it must retrieve (notebook 05
shows that for a model trained on the CPU).
"""

import argparse
import importlib.util
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import nsa

# The example: one sequence of 2048 tokens, 16 query heads in 2 groups of 8 (GQA), as in the paper's
# configuration scaled down: blocks of 64 tokens, 8 selected blocks per query, a 256-token window.
# The inputs are random (`example`): what they show, and what a trained model's selection would show instead.
RANDOM_INPUTS_NOTE = ("the inputs are random (no trained model): beyond the forced blocks the selection follows "
                      "random scores and looks like noise; in a trained model the selected blocks follow the "
                      "content (notebook 05: a query keeps selecting the block of the fact it retrieves)")
B, T, HQ, H, D = 1, 2048, 16, 2, 64
BLOCK_SIZE, BLOCK_COUNTS, WINDOW_SIZE = 64, 8, 256
TOLERANCE = 1e-4  # max abs error allowed between nsa.attention and the dense computation (fp32)


def example(seed=0):
    """Random q, k, v [B, T, heads, D] and gates [B, T, HQ] in (0, 1)."""
    kq, kk, kv, kg = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(kq, (B, T, HQ, D), jnp.float32)
    k = jax.random.normal(kk, (B, T, H, D), jnp.float32)
    v = jax.random.normal(kv, (B, T, H, D), jnp.float32)
    g_cmp, g_slc, g_swa = jax.nn.sigmoid(jax.random.normal(kg, (3, B, T, HQ), jnp.float32))
    return q, k, v, g_cmp, g_slc, g_swa


# --------------------------------------------------------------------------- dense reference
def _attend(s, mask, v):
    """softmax(s) @ v over the keys where mask is True; rows that see no key give 0.

    s [B, H, G, T, K], mask broadcastable to it, v [B, K, H, D] -> [B, H, G, T, D].
    """
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(total > 0, total, 1.0)
    return jnp.einsum("bhgtk,bkhd->bhgtd", p, v), p


def block_mask(block_indices):
    """bool [B, H, T, T]: key j is in a block listed in block_indices[b, t, h, :] and j <= t."""
    num_blocks = T // BLOCK_SIZE
    listed = jax.nn.one_hot(block_indices, num_blocks, dtype=jnp.int32).sum(axis=-2) > 0  # -1 -> no block
    keys = jnp.repeat(listed, BLOCK_SIZE, axis=-1)  # [B, T, H, T]
    causal = jnp.tril(jnp.ones((T, T), bool))
    return jnp.transpose(keys, (0, 2, 1, 3)) & causal


def window_mask():
    """bool [T, T]: t - WINDOW_SIZE < j <= t."""
    t, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    return (j <= t) & (j > t - WINDOW_SIZE)


def compressed_mask():
    """bool [T, NC]: query t sees compressed block c iff its last token (c + 1) * bs - 1 <= t."""
    t, c = jnp.arange(T)[:, None], jnp.arange(T // BLOCK_SIZE)[None, :]
    return (c + 1) * BLOCK_SIZE - 1 <= t


@jax.jit
def dense_nsa(q, k, v, g_cmp, g_slc, g_swa, block_indices):
    """o = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa, each branch a dense masked softmax.

    Also returns the compressed-attention probabilities [B, H, G, T, NC], which select_blocks scores.
    """
    G = HQ // H
    scale = D ** -0.5
    qg = q.reshape(B, T, H, G, D)
    # compressed keys and values: the mean of each block of BLOCK_SIZE tokens (T is a multiple of it)
    k_cmp = k.reshape(B, T // BLOCK_SIZE, BLOCK_SIZE, H, D).mean(axis=2)
    v_cmp = v.reshape(B, T // BLOCK_SIZE, BLOCK_SIZE, H, D).mean(axis=2)
    o_cmp, p_cmp = _attend(scale * jnp.einsum("bthgd,bchd->bhgtc", qg, k_cmp), compressed_mask(), v_cmp)

    s = scale * jnp.einsum("bthgd,bjhd->bhgtj", qg, k)  # every query against every key: [B, H, G, T, T]
    o_slc, _ = _attend(s, block_mask(block_indices)[:, :, None], v)
    o_swa, _ = _attend(s, window_mask(), v)

    def gate(g):  # [B, T, HQ] -> [B, H, G, T, 1]
        return jnp.transpose(g.reshape(B, T, H, G), (0, 2, 3, 1))[..., None]

    o = gate(g_cmp) * o_cmp + gate(g_slc) * o_slc + gate(g_swa) * o_swa
    return jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(B, T, HQ, D), p_cmp


# --------------------------------------------------------------------------- checks and statistics
def check_selection(block_indices, p_cmp, tol=1e-5):
    """Problems (a list of strings) of the selection against the dense compressed scores.

    Each row must hold min(S, t // bs + 1) distinct blocks <= t // bs, among them the forced blocks
    0, t // bs - 1, t // bs, and no unselected block may score higher than a selected one.
    """
    idx = np.asarray(block_indices)[0]  # [T, H, S]
    score = np.asarray(p_cmp.mean(axis=2))[0].transpose(1, 0, 2)  # [T, H, NC]
    S, NC = idx.shape[-1], score.shape[-1]
    cur = (np.arange(T) // BLOCK_SIZE)[:, None, None]
    block = np.arange(NC)
    selected = np.zeros((T, H, NC + 1), bool)
    np.put_along_axis(selected, np.where(idx < 0, NC, idx), True, axis=-1)
    selected = selected[..., :NC]
    forced = (block == 0) | (block == cur - 1) | (block == cur)
    candidate = (block <= cur) & ~forced
    problems = []
    if np.any(idx > cur):
        problems.append("a block after the query's own block is selected")
    if np.any(selected.sum(-1) != np.minimum(S, cur[..., 0] + 1)) or np.any((idx >= 0).sum(-1) != selected.sum(-1)):
        problems.append("a row does not hold min(block_counts, t // block_size + 1) distinct blocks")
    if S >= 3 and np.any(forced & (block <= cur) & ~selected):
        problems.append("a forced block (0, t // bs - 1 or t // bs) is missing")
    worst_in = np.where(selected & candidate, score, np.inf).min(-1)
    best_out = np.where(~selected & candidate, score, -np.inf).max(-1)
    if np.any(best_out > worst_in + tol):
        problems.append(f"an unselected block outscores a selected one by up to {np.max(best_out - worst_in):.2e}")
    return problems


def attended_share(block_indices):
    """Share of its causal keys (t + 1) that each (query, KV head) reads: [H, T], selected or window."""
    read = block_mask(block_indices)[0] | window_mask()  # [H, T, T]
    return np.asarray(read.sum(-1)) / np.arange(1, T + 1)


# --------------------------------------------------------------------------- picture
def draw(block_indices, share, path, head=0):
    """Saves `figure(block_indices, share, head)` to path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(block_indices, share, head)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def figure(block_indices, share, head=0):
    """The figure of which blocks each query of KV head `head` selected, next to the share of keys read."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    idx = np.asarray(block_indices)[0, :, head]  # [T, S]
    NB = T // BLOCK_SIZE
    t = np.arange(T)
    cur = t // BLOCK_SIZE
    # 0: after the query's block (never selectable), 1: not selected, 2: selected by score, 3: forced
    image = np.where(np.arange(NB)[None] > cur[:, None], 0, 1)
    for slot in range(idx.shape[1]):
        valid = idx[:, slot] >= 0
        image[t[valid], idx[valid, slot]] = 2
    for forced in (0 * cur, cur - 1, cur):
        ok = (forced >= 0) & (image[t, np.maximum(forced, 0)] == 2)
        image[t[ok], forced[ok]] = 3
    colors = ["#e6e6e6", "#ffffff", "#1f4e9c", "#e8871e"]

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 7.5), gridspec_kw=dict(width_ratios=[3, 2]))
    ax.imshow(image, cmap=ListedColormap(colors), vmin=0, vmax=3, aspect="auto", interpolation="nearest",
              extent=(-0.5, NB - 0.5, T - 0.5, -0.5))
    ax.step(cur + 0.5, t, where="post", color="black", lw=1.2)
    window_start = np.maximum(t - WINDOW_SIZE + 1, 0) / BLOCK_SIZE - 0.5
    ax.plot(window_start, t, color="#c0392b", lw=1, ls="--")
    ax.set_xlabel(f"key block ({BLOCK_SIZE} tokens each)")
    ax.set_ylabel("query position t")
    ax.set_xticks(range(0, NB, 4))
    ax.set_title(f"Blocks selected by KV head {head} ({BLOCK_COUNTS} per query)\n"
                 "on random q, k (no trained model): the free picks are noise", fontsize=10)
    ax.legend(handles=[Patch(color=colors[3], label="selected: forced (0, current, previous)"),
                       Patch(color=colors[2], label="selected: top compressed score"),
                       Patch(facecolor=colors[1], edgecolor="#999999", label="not selected"),
                       Patch(color=colors[0], label="after the query (causal)"),
                       plt.Line2D([], [], color="black", lw=1.2, label="causal boundary"),
                       plt.Line2D([], [], color="#c0392b", lw=1, ls="--",
                                  label=f"sliding window start ({WINDOW_SIZE} tokens)")],
              loc="upper right", fontsize=8, framealpha=0.95)

    ax2.plot(t, 100 * share.mean(0), color="#1f4e9c")
    ax2.set_xlim(0, T - 1)
    ax2.set_ylim(0, 105)
    ax2.set_xlabel("query position t")
    ax2.set_ylabel("% of the causal keys (t + 1) read")
    ax2.set_title("Raw keys read: selected blocks + window")
    ax2.grid(alpha=0.3)
    fig.suptitle(f"Native Sparse Attention on random inputs, T = {T}, block_size = {BLOCK_SIZE}, "
                 f"block_counts = {BLOCK_COUNTS}, window_size = {WINDOW_SIZE}")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- main
def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m nsa.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="demo_selection.png", help="where to save the picture")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    print(f"nsa {nsa.__version__}, jax {jax.__version__} on {jax.default_backend()}: B={B} T={T} HQ={HQ} "
          f"H={H} D={D} block_size={BLOCK_SIZE} block_counts={BLOCK_COUNTS} window_size={WINDOW_SIZE}")
    print(f"inputs: random q, k, v and gates (seed {args.seed}); {RANDOM_INPUTS_NOTE}")
    q, k, v, g_cmp, g_slc, g_swa = example(args.seed)
    config = dict(block_size=BLOCK_SIZE, block_counts=BLOCK_COUNTS, window_size=WINDOW_SIZE)

    with jax.default_matmul_precision("highest"):
        start = time.perf_counter()
        o = jax.jit(lambda *a: nsa.attention(*a[:3], g_cmp=a[3], g_slc=a[4], g_swa=a[5], **config))(
            q, k, v, g_cmp, g_slc, g_swa).block_until_ready()
        print(f"nsa.attention: {time.perf_counter() - start:.1f} s (compile and run)")

        k_cmp = nsa.compress(k, block_size=BLOCK_SIZE)
        block_indices = nsa.select_blocks(q, k_cmp, block_counts=BLOCK_COUNTS, block_size=BLOCK_SIZE)
        start = time.perf_counter()
        o_dense, p_cmp = dense_nsa(q, k, v, g_cmp, g_slc, g_swa, block_indices)
        o_dense.block_until_ready()
        print(f"dense masked attention: {time.perf_counter() - start:.1f} s (compile and run)")

    error = float(jnp.max(jnp.abs(o.astype(jnp.float32) - o_dense)))
    ok = bool(np.isfinite(error)) and error <= TOLERANCE
    print(f"max |nsa.attention - dense| = {error:.2e} (tolerance {TOLERANCE:.0e}): {'PASS' if ok else 'FAIL'}")
    problems = check_selection(block_indices, p_cmp)
    print(f"nsa.select_blocks against the dense compressed scores: {'PASS' if not problems else 'FAIL'}")
    for problem in problems:
        print(f"  {problem}")
    ok = ok and not problems

    share = attended_share(block_indices)
    print(f"each query attends {100 * share.mean():.1f}% of its causal keys on average "
          f"(at the last query: {100 * share[:, -1].mean():.1f}%): {BLOCK_COUNTS} blocks of {BLOCK_SIZE} "
          f"and a {WINDOW_SIZE}-token window, plus {T // BLOCK_SIZE} compressed keys at most")

    if importlib.util.find_spec("matplotlib") is None:
        print("no picture of the selected blocks: it needs matplotlib (from a checkout: pip install '.[demo]')")
    else:
        path = os.path.abspath(args.output)
        draw(block_indices, share, path)
        print(f"saved the selected blocks of KV head 0 to {path} (random inputs: the free picks are noise)")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
