"""Continuous batching with NSA over a paged KV cache: requests come and go, prompts are prefilled in chunks beside
other sequences' decode steps, and every generated token is checked against a full recompute.

    python examples/serving.py                    # 7 requests through 3 slots, a pool of 9 pages of 16 tokens
    python examples/serving.py --implementation xla

The model is examples/generate.py's (a tiny random-weight transformer of `nsa.nnx.NativeSparseAttention` layers;
needs `pip install '.[nnx]'`). What a serving engine does around it, in a few dozen lines:

1. **Pages.** Each layer's cache is an `nsa.PagedKVCache`: one pool of pages, one page table [SLOTS, MAX_PAGES]
   that every layer shares (the same tokens sit in the same rows of each layer's pool). `PageAllocator` hands
   out page ids from a free list as a sequence grows into a new page, and takes them back when its request ends:
   the pool holds fewer pages than SLOTS full-length sequences would need.
2. **Ragged steps.** Every step runs one jitted function over all slots: a request still reading its prompt feeds
   up to CHUNK prompt tokens, a generating one its last token, an idle slot nothing (`lens`, the new tokens of
   each slot, in `nsa.append_to_cache(..., lens=)` and `nsa.attention(..., q_lens=)`). A step is a decode step
   (1 row per slot) or, while any prompt is being read, a chunk (CHUNK rows): two compilations in all. The caches
   are donated: the pool is written in place.
3. **Requests.** They arrive at different steps, wait for a free slot, and leave when they have generated their
   tokens; a freed slot's length is reset to 0 and its page table row to -1 (no page) before the next request
   takes it.
4. **Check.** When a request ends, the whole model runs again on its prompt and generated tokens, without a
   cache: the logits of each generated token must match those the serving steps produced, and give the same
   greedy token.

Exit code 0 and "PASS" when every request matches.
"""

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate import TOLERANCE, VOCAB, Model  # noqa: E402

SLOTS, CHUNK = 3, 8  # sequences served at once; prompt tokens read per step
PAGE_SIZE, NUM_PAGES, MAX_PAGES = 16, 9, 4  # a sequence holds up to 64 tokens; the pool 144, not 3 * 64


@dataclasses.dataclass
class Request:
    arrival: int  # the step it arrives at
    prompt: np.ndarray  # int [TP]
    new_tokens: int  # how many tokens to generate
    generated: list = dataclasses.field(default_factory=list)  # its tokens so far
    logits: list = dataclasses.field(default_factory=list)  # [VOCAB] of each generated token but the last
    read: int = 0  # prompt tokens in the cache


class PageAllocator:
    """Page ids from a free list: `grow` gives a slot's sequence the pages its next tokens need, `release` takes
    all of a slot's pages back. The page table [SLOTS, MAX_PAGES] (-1: no page) is the host's copy of what every
    layer's cache holds."""

    def __init__(self):
        self.free = list(range(NUM_PAGES))
        self.table = np.full((SLOTS, MAX_PAGES), -1, np.int32)
        self.handed_out = 0  # pages given out, reused ones counted again

    def grow(self, slot, length):
        """Pages for the first `length` tokens of the slot's sequence."""
        for page in range(-(-length // PAGE_SIZE)):
            if self.table[slot, page] < 0:
                if not self.free:
                    raise RuntimeError("the pool is out of pages: more than it holds are in flight")
                self.table[slot, page] = self.free.pop()
                self.handed_out += 1

    def release(self, slot):
        self.free += [int(p) for p in self.table[slot] if p >= 0]
        self.table[slot] = -1


def requests(seed=0):
    """Seven requests: prompts of 5 to 30 tokens, 4 to 12 new tokens, arriving over the first 12 steps."""
    rng = np.random.default_rng(seed)
    return [Request(int(arrival), rng.integers(0, VOCAB, int(length)), int(new))
            for arrival, length, new in zip([0, 0, 1, 3, 6, 9, 12], rng.integers(5, 31, 7), rng.integers(4, 13, 7))]


def serve(model, pending):
    """Runs the requests `pending` to completion; returns them with their tokens and logits, the steps run and
    the pages handed out."""
    graphdef, state = nnx.split(model)
    layer = model.blocks[0].attention
    caches = [layer.init_paged_cache(NUM_PAGES, PAGE_SIZE, SLOTS, MAX_PAGES) for _ in model.blocks]

    # the caches donated: the pools are written in place
    forward = jax.jit(lambda state, tokens, lens, caches: nnx.merge(graphdef, state).extend(tokens, caches, lens),
                      donate_argnums=3)
    pages, slots, done, step = PageAllocator(), [None] * SLOTS, [], 0
    pending = sorted(pending, key=lambda r: r.arrival)
    while pending or any(slots):
        for slot in range(SLOTS):  # admit arrived requests into free slots
            if slots[slot] is None and pending and pending[0].arrival <= step:
                slots[slot] = pending.pop(0)
        feed = np.zeros(SLOTS, np.int32)  # new tokens of each slot this step
        for slot, r in enumerate(slots):
            if r is not None:
                feed[slot] = min(CHUNK, len(r.prompt) - r.read) if r.read < len(r.prompt) else 1
        TN = CHUNK if feed.max() > 1 else 1
        tokens = np.zeros((SLOTS, TN), np.int32)
        for slot, r in enumerate(slots):
            if r is None:
                continue
            if r.read < len(r.prompt):
                tokens[slot, :feed[slot]] = r.prompt[r.read:r.read + feed[slot]]
            else:
                tokens[slot, 0] = r.generated[-1]
            pages.grow(slot, len(r.prompt) + len(r.generated) if r.read == len(r.prompt) else r.read + feed[slot])
        caches = [c.replace(page_table=jnp.asarray(pages.table)) for c in caches]  # each its own: all are donated
        logits, caches = forward(state, jnp.asarray(tokens), jnp.asarray(feed), caches)
        logits = np.asarray(logits)
        for slot, r in enumerate(slots):
            if r is None:
                continue
            last = logits[slot, feed[slot] - 1]  # after the slot's last new token
            if r.read < len(r.prompt):
                r.read += feed[slot]
                if r.read < len(r.prompt):
                    continue  # more of the prompt to read
            else:
                r.logits.append(last)
            r.generated.append(int(np.argmax(last)))
            if len(r.generated) == r.new_tokens:  # the request ends: its slot is free, its pages go back
                done.append(r)
                slots[slot] = None
                pages.release(slot)
                caches = [c.replace(lens=c.lens.at[slot].set(0)) for c in caches]
        step += 1
    return done, step, pages.handed_out


def check(model, request):
    """The largest relative difference between the serving logits of each generated token and those of the whole
    model on the whole sequence, and whether every generated token is the recomputed greedy choice."""
    sequence = np.concatenate([request.prompt, request.generated])
    full = np.asarray(nnx.jit(lambda model, tokens: model(tokens))(model, jnp.asarray(sequence)[None]))[0]
    TP = len(request.prompt)
    want = full[TP:TP + len(request.logits)]  # the logits after each generated token but the last
    worst = float(np.max(np.abs(np.stack(request.logits) - want)) / np.max(np.abs(want)))
    same = request.generated[0] == int(np.argmax(full[TP - 1])) and all(
        request.generated[i + 1] == int(np.argmax(want[i])) for i in range(len(want)))  # token i + 1 from logits i
    return worst, same


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--implementation", default=None, choices=["xla", "triton", "pallas"],
                        help="nsa's implementation (default: the best for the platform)")
    args = parser.parse_args(argv)
    model = Model(args.implementation)
    finished, steps, handed_out = serve(model, requests())
    ok = len(finished) == 7
    print(f"served {len(finished)} requests through {SLOTS} slots in {steps} steps; a pool of {NUM_PAGES} pages of "
          f"{PAGE_SIZE} tokens handed out {handed_out} pages")
    for r in sorted(finished, key=lambda r: r.arrival):
        worst, same = check(model, r)
        ok &= worst <= TOLERANCE and same
        print(f"  arrived at step {r.arrival:2}: prompt of {len(r.prompt):2} tokens -> {r.generated}; against a full "
              f"recompute: largest relative logit difference {worst:.1e}, same tokens: {same}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
