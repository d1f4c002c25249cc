# The MARS batch (docs/method.md §1-3): one example cut and padded to whole blocks, the two streams and the
# mask, and the length-grouped batch order. Expected values come from loops over positions, never from
# the tensor code under test. Reading chat files and caching examples: tests/product/test_examples.py.
import random

import numpy as np
import pytest
import torch

from data import IGNORE, fit_to_blocks, make_batch, micro_batches, step_batches
from mars.tokenizer import Tokenizer

MASK, PAD = 99, 98


def random_examples(B: int, seed: int, n: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    # Lengths are multiples of B (as after block padding). Supervision: a prompt, then assistant
    # spans with unsupervised "user" spans between them (multi-turn), so some blocks are dead.
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = max(3, B * rng.randint(2, 9))
        length += -length % B
        sup, p = [False] * length, rng.randint(1, length - 2)
        while p < length:
            span = rng.randint(1, 2 * B)
            for q in range(p, min(length, p + span)):
                sup[q] = True
            p += span + rng.choice([0, rng.randint(1, 3 * B)])  # sometimes a user turn between
        ids = [rng.randrange(0, 90) for _ in range(length)]
        out.append((np.array(ids), np.array(sup)))
    return out


def expected_layout(examples, B, prune):
    # Per row: the noisy positions that go in, read off docs/method.md §3 one position at a time.
    rows = []
    for ids, sup in examples:
        n = len(ids)
        if prune:  # keep a block iff some position p in it has a supervised target x[p+1]
            blocks = sorted({p // B for p in range(n - 1) if sup[p + 1]})
        else:
            blocks = list(range(n // B))
        rows.append([b * B + o for b in blocks for o in range(B)])
    return rows


def allowed(q, k, B):
    # q, k: (stream, position). The docs/method.md §3 table, literally.
    (sq, i), (sk, j) = q, k
    if sq == "clean" and sk == "clean":
        return j <= i
    if sq == "clean" and sk == "noisy":
        return False
    if sq == "noisy" and sk == "clean":
        return j // B < i // B
    return j // B == i // B and j <= i


@pytest.mark.parametrize("B", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("prune", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_matches_the_table_position_by_position(B, prune, seed):
    examples = random_examples(B, seed)
    batch = make_batch(examples, B, MASK, PAD, "mars", prune)
    L = max(len(ids) for ids, _ in examples)
    layout = expected_layout(examples, B, prune)
    K = max(len(r) for r in layout)
    assert batch.L == L and batch.tokens.shape == (len(examples), L + K)
    if not prune:
        assert K == L  # the full [clean | noisy] sequence of length 2L
    for n, (ids, sup) in enumerate(examples):
        length = len(ids)
        # columns: (stream, position, real token?)
        cols = [("clean", p, p < length) for p in range(L)]
        cols += [("noisy", p, True) for p in layout[n]]
        cols += [("noisy", None, False)] * (K - len(layout[n]))
        m = batch.mask[n, 0]
        for a, (sa, pa, va) in enumerate(cols):
            if va:  # tokens, shared positions and right-shifted labels of real columns
                assert batch.pos[n, a] == pa
                want = MASK if (sa == "noisy" and sup[pa]) else ids[pa]
                assert batch.tokens[n, a] == want
                target = ids[pa + 1] if pa + 1 < length and sup[pa + 1] else IGNORE
                assert batch.labels[n, a] == target
            else:
                assert batch.labels[n, a] == IGNORE
            for b, (sb, pb, vb) in enumerate(cols):
                if a == b:
                    want = True  # every query sees itself: a pad query's row is never empty
                elif not (va and vb):
                    want = False  # padding is hidden from attention
                else:
                    want = allowed((sa, pa), (sb, pb), B)
                assert bool(m[a, b]) == want, (n, a, b, cols[a], cols[b])


def test_pruning_keeps_the_targets_and_drops_prompt_blocks():
    # One long prompt (36 tokens) and a short answer: 9 of 11 noisy blocks are dead.
    ids = np.arange(44) % 90
    sup = np.array([False] * 36 + [True] * 8)
    full = make_batch([(ids, sup)], 4, MASK, PAD, "mars", prune=False)
    pruned = make_batch([(ids, sup)], 4, MASK, PAD, "mars", prune=True)
    assert full.tokens.shape[1] == 88
    # position 35 predicts x[36], the first answer token, so block 8 (32..35) stays alive
    assert pruned.tokens.shape[1] == 44 + 12
    assert pruned.pos[0, 44:].tolist() == list(range(32, 44))
    n_targets = lambda b: int((b.labels[:, b.L:] != IGNORE).sum())  # noqa: E731
    assert n_targets(pruned) == n_targets(full) == 8


def test_ar_batch_is_the_clean_stream():
    examples = random_examples(4, 3)
    ar, mars = make_batch(examples, 4, MASK, PAD, "ar"), make_batch(examples, 4, MASK, PAD, "mars")
    assert ar.mask is None and ar.tokens.shape[1] == mars.L
    assert torch.equal(ar.tokens, mars.tokens[:, : mars.L])
    assert torch.equal(ar.labels, mars.labels[:, : mars.L])


# ---- one example: supervision, the cut, block padding (docs/method.md §1) ----

def chat(user: str, answer: str, system: str = "s") -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user},
            {"role": "assistant", "content": answer}]


def test_block_padding_is_supervised_eos():
    tok = Tokenizer.byte_level()
    for B in (3, 4, 8):
        for answer in ("a", "ab", "abc", "abcd", "abcde"):
            ids, sup = tok.encode_chat_with_mask(chat("hi", answer))
            got_ids, got_sup = fit_to_blocks(ids, sup, 512, B, tok.eos_id)
            pad = len(got_ids) - len(ids)
            assert len(got_ids) % B == 0 and 0 <= pad < B
            assert got_ids[: len(ids)] == ids and got_sup[: len(ids)] == sup
            assert got_ids[len(ids):] == [tok.eos_id] * pad
            assert all(got_sup[len(ids):])
            batch = make_batch([(got_ids, got_sup)], B, tok.mask_id, tok.pad_id)
            # the real last token ("\n" after <|im_end|>) is trained to emit EOS when padded
            last = len(ids) - 1
            assert batch.labels[0, last] == (tok.eos_id if pad else IGNORE)


def test_the_cut_keeps_whole_blocks_and_drops_an_example_with_no_target_left():
    # max_len 62, B 4: at most 60 tokens are kept, so block padding never pushes an example past max_len.
    eos = 7
    ids = list(range(100, 170))
    answer_at = lambda start: [False] * start + [True] * (70 - start)  # noqa: E731
    assert fit_to_blocks(ids, answer_at(30), 62, 4, eos) == (ids[:60], answer_at(30)[:60])  # no EOS appended
    assert fit_to_blocks(ids, answer_at(59), 62, 4, eos) == (ids[:60], [False] * 59 + [True])  # one target left
    assert fit_to_blocks(ids, answer_at(60), 62, 4, eos) is None  # the prompt alone fills max_len
    # Position p predicts x[p+1]: a supervised token at position 0 is no target.
    assert fit_to_blocks([5, 6, 7], [True, False, False], 62, 4, eos) is None
    # The turns after the last reply have no target and go: the padding follows the reply, never a user turn.
    assert fit_to_blocks([5, 6, 7], [False, True, False], 62, 4, eos) == ([5, 6, eos, eos], [False, True, True, True])
    assert fit_to_blocks(ids[:10], [True] * 10, 12, 4, eos) == (ids[:10] + [eos] * 2, [True] * 12)


# ---- batch order: length-grouped, seeded, sharded ----

def test_step_batches_are_grouped_seeded_and_cover_the_data():
    rng = np.random.default_rng(0)
    lengths = rng.integers(4, 500, size=1000)
    G = 16
    order = step_batches(lengths, G, seed=42, epoch=0)
    assert order.shape == (1000 // G, G)
    assert len(set(order.ravel().tolist())) == order.size  # each example at most once per epoch
    assert np.array_equal(order, step_batches(lengths, G, seed=42, epoch=0))  # deterministic
    assert not np.array_equal(order, step_batches(lengths, G, seed=42, epoch=1))  # reshuffled
    # Padding per step (longest * G - sum) is far below a random order's.
    pad = lambda o: sum(lengths[s].max() * len(s) - lengths[s].sum() for s in o)  # noqa: E731
    random_order = rng.permutation(1000)[: order.size].reshape(order.shape)
    assert pad(order) < 0.2 * pad(random_order)


def test_micro_batches_split_a_step_over_ranks():
    step = np.arange(24)
    one = micro_batches(step, 3)
    assert one.shape == (8, 3)
    two = [micro_batches(step, 3, r, 2) for r in range(2)]
    assert all(t.shape == (4, 3) for t in two)
    assert sorted(np.concatenate([t.ravel() for t in two]).tolist()) == list(range(24))

