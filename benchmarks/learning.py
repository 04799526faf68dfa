"""How fast a small NSA model learns a copy task, against dense attention: accuracy per training step.

    python benchmarks/learning.py [--variants dense nsa ...] [--seeds 0 1] [--max-steps 600] [--out benchmarks/results]
    python benchmarks/learning.py --smoke --out /tmp/x     # a tiny model, a few steps (the test's)

The task: each sequence of T = 512 tokens is 256 distinct random tokens (of a vocabulary of 512), then the
same 256 tokens again. In the second half every next token is predictable by looking back 256 tokens,
beyond the sliding window: a two-layer model learns it with an induction head (layer 1 attends to the
previous token, layer 2 finds the earlier copy of the current token and reads what followed it). The loss
and the accuracy are over those T / 2 - 1 predictable tokens; chance is about 1 / 256.

The model: token embedding, two pre-norm layers of attention (rotary positions, 2 query heads over 1 KV
head of 16 dims) and a small MLP, a tied readout. The variants (VARIANTS) differ only in the attention of
both layers: dense causal attention in plain jnp; nsa.attention with all three branches, each gated per
query head by sigmoid(x @ w + b) with b = 0 (the paper's gating); the selected branch alone over every
block; the levers a user can pull: the gates' bias initialisation, a learning-rate warm-up, and
block_size / block_counts; and ablations that tell where the difference comes from (every block selected,
no gates, no compressed or no window branch). Adam (hand-written: no optax needed), batch 4, a fresh batch
per step from a seeded key, so that every variant of a seed starts from the same weights and sees the same
data; implementation='xla'. A run stops PATIENCE steps after its accuracy first reaches 90%, or at
--max-steps. The table reports the steps to 5% (off chance: the end of the flat start), 50% and 90%.

The accuracy of a step is that of its own batch, measured before the step's update: fresh data, so it is a
held-out accuracy of the model after that many steps. Writes learning.json (date, versions, machine, the
settings, every run's curves and steps to 5%, 50% and 90%) and learning.md (the table) to --out, after each
run; runs already in learning.json with the same settings are kept, the ones asked for are replaced.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

import nsa

THRESHOLDS = (0.05, 0.5, 0.9)  # the accuracies whose first step the table reports: off chance, half, most
PATIENCE = 20  # steps a run goes on after first reaching the last threshold

MODEL = dict(T=512, vocab=512, width=64, heads=2, kv_heads=1, head_dim=16, mlp=128, layers=2)
TRAIN = dict(batch=4, lr=3e-3, warmup=0)
NSA = dict(block_size=32, block_counts=6, window_size=64, gate_bias=(0.0, 0.0, 0.0))  # (cmp, slc, swa)
# --smoke: the same code at a size that trains in seconds (the test's)
SMOKE = dict(model=dict(T=64, vocab=64, width=16, heads=2, kv_heads=1, head_dim=8, mlp=32, layers=2),
             train=dict(batch=8, lr=1e-2, warmup=0), nsa=dict(NSA, block_size=8, block_counts=3, window_size=16))

# the kinds of attention on nsa.attention: whether the branches are gated, whether the compressed one is on
NSA_KINDS = {"nsa": dict(gated=True, compressed=True), "ungated": dict(gated=False, compressed=True),
             "no-compressed": dict(gated=True, compressed=False)}
# name -> (attention: 'dense', 'selected' or one of NSA_KINDS, what it changes in NSA or TRAIN, what it is)
VARIANTS = {
    "dense": ("dense", {}, "dense causal attention (plain jnp)"),
    "selected-all": ("selected", {}, "the selected branch alone over every block (block_counts = T / block_size), "
                                     "no gate: dense attention computed by nsa"),
    "nsa": ("nsa", {}, "nsa.attention, all three branches, gates sigmoid(x @ w + b), b = 0"),
    "nsa-all-blocks": ("nsa", dict(block_counts="all"), "nsa, every block selected (block_counts = T / block_size)"),
    "nsa-no-gates": ("ungated", {}, "nsa.attention, all three branches at weight 1 (no gates)"),
    "nsa-no-cmp": ("no-compressed", {}, "nsa without the compressed branch (g_cmp not given; the blocks are "
                                        "still selected from the compressed keys' scores)"),
    "nsa-no-window": ("nsa", dict(window_size=0), "nsa without the window branch (window_size 0, g_swa not given)"),
    "nsa-gates-slc-swa-high": ("nsa", dict(gate_bias=(0.0, 3.0, 3.0)),
                               "nsa, selected and window gate biases start at 3 (sigmoid 0.95)"),
    "nsa-gate-cmp-high": ("nsa", dict(gate_bias=(3.0, 0.0, 0.0)), "nsa, the compressed gate bias starts at 3"),
    "nsa-warmup": ("nsa", dict(warmup=100), "nsa, learning rate warmed up linearly over 100 steps"),
    "nsa-bs16": ("nsa", dict(block_size=16, block_counts=12), "nsa, block_size 16, block_counts 12 (same tokens read)"),
    "nsa-blocks10": ("nsa", dict(block_counts=10), "nsa, block_counts 10 (7 free of 13 candidate blocks, not 3)"),
}


# --------------------------------------------------------------------------- the task
def make_batch(key, batch, T, vocab):
    """tokens int [batch, T]: T / 2 distinct random tokens, then the same again."""
    keys = jax.random.split(key, batch)
    half = jax.vmap(lambda k: jax.random.permutation(k, vocab)[: T // 2])(keys)
    return jnp.concatenate([half, half], axis=1)


# --------------------------------------------------------------------------- the model
def init(key, m, gate_bias):
    """Parameters: every matrix normal / sqrt(fan_in); each layer's gate biases `gate_bias` (compressed,
    selected, window), one per query head."""
    def matrix(key, fan_in, fan_out):
        return jax.random.normal(key, (fan_in, fan_out)) / np.sqrt(fan_in)

    W, HQ, H, D = m["width"], m["heads"], m["kv_heads"], m["head_dim"]
    keys = jax.random.split(key, 1 + m["layers"])
    layers = []
    for layer_key in keys[1:]:
        k = jax.random.split(layer_key, 7)
        layers.append(dict(wq=matrix(k[0], W, HQ * D), wk=matrix(k[1], W, H * D), wv=matrix(k[2], W, H * D),
                           wo=matrix(k[3], HQ * D, W), w_gate=matrix(k[4], W, 3 * HQ),
                           b_gate=jnp.repeat(jnp.asarray(gate_bias, jnp.float32), HQ),
                           w_up=matrix(k[5], W, m["mlp"]), w_down=matrix(k[6], m["mlp"], W)))
    return dict(emb=matrix(keys[0], m["vocab"], W), layers=layers)


def rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def rotary(x, start=0):
    """Rotary position embedding of x [B, T, heads, D] at positions start .. start + T - 1 (base 10000,
    pairs (i, i + D / 2))."""
    T, D = x.shape[1], x.shape[-1]
    freq = 10000.0 ** (-jnp.arange(D // 2) / (D // 2))
    angle = (start + jnp.arange(T))[:, None] * freq[None]  # [T, D / 2]
    cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def dense_attention(q, k, v):
    """Causal softmax attention of the last T queries q [B, T, HQ, D] to k, v [B, TK, H, D] (query head j
    reads KV head j // G)."""
    T, TK, G = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    causal = jnp.arange(TK)[None, :] <= TK - T + jnp.arange(T)[:, None]
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1), v)


def attend(layer, h_q, q, k, v, kind, cfg):
    """The layer's attention output [B, T, HQ, D] ('dense', 'selected' or one of NSA_KINDS); h_q [B, T, width]
    is the normalised hidden state of the queries, which the gates read."""
    if kind == "dense":
        return dense_attention(q, k, v)
    all_blocks = k.shape[1] // cfg["block_size"]
    if kind == "selected":
        return nsa.attention(q, k, v, block_counts=all_blocks, block_size=cfg["block_size"], implementation="xla")
    B, T, HQ = q.shape[:3]
    if NSA_KINDS[kind]["gated"]:
        g_cmp, g_slc, g_swa = jnp.moveaxis(
            jax.nn.sigmoid(h_q @ layer["w_gate"] + layer["b_gate"]).reshape(B, T, 3, HQ), 2, 0)
    else:  # every branch at weight 1: a missing gate means 1, but g_cmp must be given to turn its branch on
        g_cmp, g_slc, g_swa = jnp.ones((B, T, HQ), q.dtype), None, None
    counts = all_blocks if cfg["block_counts"] == "all" else cfg["block_counts"]
    return nsa.attention(q, k, v, g_cmp=g_cmp if NSA_KINDS[kind]["compressed"] else None, g_slc=g_slc,
                         g_swa=g_swa if cfg["window_size"] > 0 else None,  # a gate of a branch that is off: an error
                         block_counts=counts, block_size=cfg["block_size"], window_size=cfg["window_size"],
                         implementation="xla")


def forward(params, tokens, kind, cfg, m):
    """Logits [B, T / 2, vocab] of the last T / 2 positions, the only ones the loss reads: the last layer
    computes only their queries (q shorter than k: the queries are the last tokens, nsa's KV-cache
    convention), which gives the loss and gradients of all T queries at half the last layer's cost."""
    B, T = tokens.shape
    HQ, H, D = m["heads"], m["kv_heads"], m["head_dim"]
    x = params["emb"][tokens]
    for i, layer in enumerate(params["layers"]):
        h = rms_norm(x)
        start = T // 2 if i == len(params["layers"]) - 1 else 0
        x, h_q = x[:, start:], h[:, start:]
        q = rotary((h_q @ layer["wq"]).reshape(B, T - start, HQ, D), start)
        k = rotary((h @ layer["wk"]).reshape(B, T, H, D))
        v = (h @ layer["wv"]).reshape(B, T, H, D)
        x = x + attend(layer, h_q, q, k, v, kind, cfg).reshape(B, T - start, HQ * D) @ layer["wo"]
        x = x + jax.nn.gelu(rms_norm(x) @ layer["w_up"]) @ layer["w_down"]
    return rms_norm(x) @ params["emb"].T


def loss_and_accuracy(params, tokens, kind, cfg, m):
    """Mean cross-entropy and accuracy of the next token over the predictable positions T / 2 .. T - 2."""
    logits = forward(params, tokens, kind, cfg, m)[:, :-1]
    targets = tokens[:, tokens.shape[1] // 2 + 1:]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
    return jnp.mean(nll), jnp.mean(logits.argmax(-1) == targets)


# --------------------------------------------------------------------------- training
def adam(params, grads, state, lr, b1=0.9, b2=0.999, eps=1e-8):
    """One Adam step (bias-corrected); state = (first moments, second moments, step count)."""
    m, s, t = state
    t = t + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    s = jax.tree.map(lambda s, g: b2 * s + (1 - b2) * g * g, s, grads)
    params = jax.tree.map(lambda p, m, s: p - lr * (m / (1 - b1 ** t)) / (jnp.sqrt(s / (1 - b2 ** t)) + eps),
                          params, m, s)
    return params, (m, s, t)


def learning_rate(step, cfg):
    """cfg['lr'], reached linearly over the first cfg['warmup'] steps (none: 0)."""
    return cfg["lr"] * jnp.minimum(1.0, (step + 1) / max(cfg["warmup"], 1))


def settings(variant, setup):
    """(attention kind, the settings a variant trains with): TRAIN, with NSA for the kinds it applies to
    (block_size alone for 'selected'), the variant's changes applied."""
    kind, changes, _ = VARIANTS[variant]
    if kind in NSA_KINDS:
        nsa_keys = [key for key in setup["nsa"] if NSA_KINDS[kind]["gated"] or key != "gate_bias"]
    else:
        nsa_keys = {"dense": [], "selected": ["block_size"]}[kind]
    cfg = dict(setup["train"], **{key: setup["nsa"][key] for key in nsa_keys})
    return kind, dict(cfg, **changes)


def train(variant, seed, setup, max_steps):
    """One run: the loss and accuracy of each step, the steps to each threshold and the time it took."""
    kind, cfg = settings(variant, setup)
    m = setup["model"]
    params = init(jax.random.key(seed), m, cfg.get("gate_bias", setup["nsa"]["gate_bias"]))  # unused ungated
    state = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params), 0)
    data_key = jax.random.key(1000 + seed)

    @jax.jit
    def step(params, state, i):
        tokens = make_batch(jax.random.fold_in(data_key, i), cfg["batch"], m["T"], m["vocab"])
        (loss, acc), grads = jax.value_and_grad(loss_and_accuracy, has_aux=True)(params, tokens, kind, cfg, m)
        params, state = adam(params, grads, state, learning_rate(i, cfg))
        return params, state, loss, acc

    losses, accuracies = [], []
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(max_steps):
        params, state, loss, acc = step(params, state, i)
        losses.append(round(float(loss), 4))
        accuracies.append(round(float(acc), 4))
        if i == 0:  # compiling, then the first step
            first_step_s = time.perf_counter() - wall
            wall, cpu = time.perf_counter(), time.process_time()
        reached = steps_to(accuracies)[str(THRESHOLDS[-1])]
        if reached is not None and i >= reached + PATIENCE:
            break
    # wall_s and cpu_s: the steps after the first, which compiles
    return dict(variant=variant, seed=seed, date=time.strftime("%Y-%m-%d"), kind=kind, config=cfg,
                steps=len(losses), loss=losses, accuracy=accuracies, steps_to=steps_to(accuracies),
                first_step_s=round(first_step_s, 1), wall_s=round(time.perf_counter() - wall, 1),
                cpu_s=round(time.process_time() - cpu, 1))


def steps_to(accuracies):
    """{threshold: the number of steps trained before the first batch whose accuracy reaches it, or None}."""
    return {str(t): next((i for i, a in enumerate(accuracies) if a >= t), None) for t in THRESHOLDS}


# --------------------------------------------------------------------------- results
def machine():
    """The CPU this runs on, its core count and its load when the benchmark started."""
    name = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    return dict(cpu=name, cores=os.cpu_count(), load_average_at_start=[round(x, 1) for x in os.getloadavg()])


def table(runs):
    """Markdown: per variant, the steps to each threshold for every seed (their mean), and the time per step."""
    head = " | ".join(f"steps to {100 * t:g}%" for t in THRESHOLDS)
    lines = [f"| variant | seeds | {head} | accuracy at the last step | CPU s / step | what |",
             "|---|---|" + "---|" * len(THRESHOLDS) + "---|---|---|"]
    for variant, (_, _, what) in VARIANTS.items():
        mine = sorted((r for r in runs if r["variant"] == variant), key=lambda r: r["seed"])
        if not mine:
            continue
        cells = []
        for t in map(str, THRESHOLDS):
            reached = [r["steps_to"][t] for r in mine]
            cell = ", ".join(f">{r['steps'] - 1}" if n is None else str(n) for n, r in zip(reached, mine))
            cells.append(cell + (f" ({statistics.mean(reached):.0f})" if None not in reached and len(mine) > 1 else ""))
        final = ", ".join(f"{r['accuracy'][-1]:.2f}" for r in mine)
        per_step = statistics.mean(r["cpu_s"] / max(r["steps"] - 1, 1) for r in mine)
        lines.append(f"| {variant} | {len(mine)} | {' | '.join(cells)} | {final} | {per_step:.2f} | {what} |")
    return "\n".join(lines)


def load(path, setup):
    """(runs, commands) of the JSON at path if its setup is `setup`, else ([], [])."""
    if not os.path.exists(path):
        return [], []
    with open(path) as f:
        previous = json.load(f)
    if previous["meta"]["setup"] != json.loads(json.dumps(setup)):
        return [], []
    return previous["runs"], previous["meta"]["commands"]


def write(out, meta, runs):
    runs = sorted(runs, key=lambda r: (list(VARIANTS).index(r["variant"]), r["seed"]))
    with open(os.path.join(out, "learning.json"), "w") as f:
        json.dump(dict(meta=meta, runs=runs), f, indent=1)
    with open(os.path.join(out, "learning.md"), "w") as f:
        commands = ", ".join(f"`{c}`" for c in meta["commands"])
        T = meta["setup"]["model"]["T"]
        f.write(f"# Copy task at T = {T}: steps to 5%, 50% and 90% accuracy\n\n"
                f"{meta['date']}, jax {meta['jax']}, {meta['machine']['cpu']} ({meta['machine']['cores']} cores, "
                f"shared), {commands}. What the task and the model are: the docstring of benchmarks/learning.py; "
                f"what it means: docs/learning.md. Steps to x%: the steps trained before the first batch with an "
                f"accuracy of x% or more, per seed (their mean); chance is about {200 / T:.1f}% (one of the T / 2 "
                f"tokens seen). A run stops {PATIENCE} steps after reaching 90% or at {meta['max_steps']} steps ('>N': "
                f"not reached in N steps). Accuracy: the step's own fresh batch, before its update. CPU s / step: "
                f"process CPU time (both cores) per step after the first (which compiles).\n\n{table(runs)}\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--max-steps", type=int, default=600)
    parser.add_argument("--smoke", action="store_true", help="a tiny model (SMOKE): seconds, not minutes")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)

    setup = SMOKE if args.smoke else dict(model=MODEL, train=TRAIN, nsa=NSA)
    path = os.path.join(args.out, "learning.json")
    runs, commands = load(path, setup)
    command = "python benchmarks/learning.py " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = dict(date=time.strftime("%Y-%m-%d"), jax=jax.__version__, jaxlib=jaxlib.__version__,
                numpy=np.__version__, python=platform.python_version(), machine=machine(),
                commands=commands + [command], setup=setup, thresholds=THRESHOLDS, patience=PATIENCE,
                max_steps=args.max_steps, variants={name: what for name, (_, _, what) in VARIANTS.items()})
    os.makedirs(args.out, exist_ok=True)
    for variant in args.variants:
        for seed in args.seeds:
            run = train(variant, seed, setup, args.max_steps)
            print(f"{variant} seed {seed}: steps to {run['steps_to']} in {run['steps']} steps, "
                  f"{run['wall_s']} s ({run['cpu_s']} s CPU)", flush=True)
            runs = [r for r in runs if (r["variant"], r["seed"]) != (variant, seed)] + [run]
            write(args.out, meta, runs)
    return runs


if __name__ == "__main__":
    main()
