# MARS data (docs/method.md §1-3). An example is (ids, supervised), cut and padded to whole blocks
# (fit_to_blocks); a batch puts the clean tokens and a noisy copy whose response tokens are all <|mask|>
# side by side at shared positions (make_batch), under the block-causal mask of §3 (mars_mask), with
# right-shifted labels. Then the order of the examples: length-grouped steps, split into micro-batches.
# Reading chat files and caching the tokenized examples is mars/examples.py.
from dataclasses import dataclass

import numpy as np
import torch

IGNORE = -100  # label of a position with no supervised target (F.cross_entropy's ignore_index)


# ---- one example (docs/method.md §1) ----

def reply_end(sup: list[bool]) -> int:
    # The tokens up to the last reply's end: the turns after it have no target (docs/method.md §1).
    return len(sup) - sup[::-1].index(True) if any(sup) else 0


def fit_to_blocks(ids: list[int], sup: list[bool], max_len: int, block_size: int,
                  eos_id: int) -> tuple[list[int], list[bool]] | None:
    # docs/method.md §1. ids, sup: one chat through the template, sup[i] = token i is supervised (the
    # assistant turns, Tokenizer.encode_chat_with_mask). Drops the turns after the last reply, keeps the first
    # floor(max_len / B) * B tokens, so block padding never pushes a sequence past max_len, then pads with
    # supervised EOS up to the next multiple of B: after a reply, the model learns to keep ending. None: no
    # supervised target survives the cut.
    cap = min(max_len - max_len % block_size, reply_end(sup))
    ids, sup = ids[:cap], sup[:cap]
    # Position p is trained to predict x[p+1], so position 0 is never a target.
    if not any(sup[1:]):
        return None
    pad = -len(ids) % block_size
    return ids + [eos_id] * pad, sup + [True] * pad


# ---- the batch: two streams under one mask (docs/method.md §2-3) ----

@dataclass
class Batch:
    # What a micro-batch needs on the device: ids, positions, stream ids and labels, a few bytes per
    # column. The (R, 1, T, T) mask is not stored: it is a few comparisons of pos, stream and valid,
    # so it is built where it is used, on the device, after the copy (mask, noisy_mask).
    tokens: torch.Tensor  # (R, T) ids: L clean columns, then the noisy columns (mars mode)
    pos: torch.Tensor | None  # (R, T) RoPE positions; both streams count from 0 (docs/method.md §2)
    labels: torch.Tensor  # (R, T) the clean x[p+1] where that target is supervised, else IGNORE
    L: int  # columns < L are the clean stream, columns >= L the noisy one
    noisy: torch.Tensor | None = None  # (R, T) bool, True = noisy-stream column; None = AR (causal)
    valid: torch.Tensor | None = None  # (R, T) bool, True = a real token, False = padding
    block_size: int = 1  # B of docs/method.md §3

    def to(self, device) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(tokens=move(self.tokens), pos=move(self.pos), labels=move(self.labels), L=self.L,
                     noisy=move(self.noisy), valid=move(self.valid), block_size=self.block_size)

    def pin_memory(self) -> "Batch":
        # Page-locked host memory, so that .to(cuda) copies asynchronously.
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return Batch(tokens=pin(self.tokens), pos=pin(self.pos), labels=pin(self.labels), L=self.L,
                     noisy=pin(self.noisy), valid=pin(self.valid), block_size=self.block_size)

    @property
    def mask(self) -> torch.Tensor | None:
        # (R, 1, T, T) bool, the whole docs/method.md §3 mask on this batch's device; None = plain causal (AR).
        if self.noisy is None:
            return None
        return mars_mask(self.pos, self.noisy, self.valid, self.block_size)

    def noisy_mask(self) -> torch.Tensor:
        # (R, 1, T - L, T): the mask's rows for the noisy queries only. The clean rows are plain
        # causal over the first L columns (docs/method.md §3), which a causal kernel does without a mask.
        return mars_mask(self.pos, self.noisy, self.valid, self.block_size, first_query=self.L)


def mars_mask(pos: torch.Tensor, noisy: torch.Tensor, valid: torch.Tensor, block_size: int,
              first_query: int = 0) -> torch.Tensor:
    # The docs/method.md §3 table, for any column layout. pos, noisy, valid: (R, T) per column: its
    # stream-local position, whether it is in the noisy stream, whether it is a real token.
    # Returns (R, 1, T - first_query, T) bool: [r, 0, i, j] = query first_query + i may attend to key j.
    T = pos.shape[1]
    pq, pk = pos[:, first_query:, None], pos[:, None, :]  # (R, Tq, 1), (R, 1, T)
    bq, bk = pq // block_size, pk // block_size
    nq, nk = noisy[:, first_query:, None], noisy[:, None, :]
    clean_clean = ~nq & ~nk & (pk <= pq)  # ordinary causal LM
    noisy_clean = nq & ~nk & (bk < bq)  # clean tokens of strictly earlier blocks
    noisy_noisy = nq & nk & (bk == bq) & (pk <= pq)  # own block, causal
    allowed = (clean_clean | noisy_clean | noisy_noisy) & valid[:, first_query:, None] & valid[:, None, :]
    # Padding is hidden from every query; a pad query sees only itself so that its softmax row is
    # not empty (an all-False row makes SDPA return NaN, which then leaks through the values).
    eye = torch.arange(first_query, T, device=pos.device)[:, None] == torch.arange(T, device=pos.device)
    return (allowed | eye)[:, None]


def make_batch(examples: list[tuple[np.ndarray, np.ndarray]], block_size: int, mask_id: int,
               pad_id: int, mode: str = "mars", prune: bool = True) -> Batch:
    # examples: (ids, supervised) pairs whose lengths are multiples of block_size (fit_to_blocks) ->
    # the two streams at shared positions, the right-shifted labels (docs/method.md §2-4).
    B, R = block_size, len(examples)
    lengths = torch.tensor([len(ids) for ids, _ in examples])
    L = int(lengths.max())
    x = torch.full((R, L), pad_id, dtype=torch.long)  # right padding, never supervised
    sup = torch.zeros((R, L), dtype=torch.bool)
    for row, (ids, supervised) in enumerate(examples):
        x[row, : len(ids)] = torch.from_numpy(np.array(ids, np.int64))  # copies: the cache is read-only
        sup[row, : len(ids)] = torch.from_numpy(np.array(supervised, bool))
    # Right shift: the output at p predicts the clean x[p+1], in both streams.
    labels = torch.full((R, L), IGNORE, dtype=torch.long)
    labels[:, :-1] = torch.where(sup[:, 1:], x[:, 1:], IGNORE)
    if mode == "ar":  # the clean stream alone; pads sit after every real token, causal is enough
        return Batch(tokens=x, pos=None, labels=labels, L=L)

    pos = torch.arange(L).expand(R, L)
    valid = pos < lengths[:, None]  # (R, L)
    x_noisy = torch.where(sup, mask_id, x)  # supervised positions masked, the prompt stays real
    # Which noisy blocks go in. A noisy block is seen only by itself, so one with no supervised target
    # feeds no loss term and can be dropped ("dead block pruning").
    if prune:
        keep = (labels != IGNORE).view(R, L // B, B).any(-1)  # (R, L/B)
    else:
        keep = valid.view(R, L // B, B).any(-1)
    kept_per_row = keep.sum(1)  # (R,)
    # Kept block indices first, in order (stable sort on "dropped"), cut to the row that keeps most (M).
    blocks = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices[:, : int(kept_per_row.max())]
    real_block = torch.arange(blocks.shape[1]) < kept_per_row[:, None]  # (R, M)
    noisy_pos = (blocks[:, :, None] * B + torch.arange(B)).flatten(1)  # (R, M*B) original positions
    noisy_valid = real_block.repeat_interleave(B, dim=1)
    noisy_tokens = x_noisy.gather(1, noisy_pos).masked_fill(~noisy_valid, pad_id)
    noisy_labels = labels.gather(1, noisy_pos).masked_fill(~noisy_valid, IGNORE)

    tokens = torch.cat([x, noisy_tokens], 1)  # (R, T), T = L + M*B (= 2L without pruning)
    positions = torch.cat([pos, noisy_pos], 1)  # kept noisy tokens keep their positions and blocks
    stream = torch.cat([torch.zeros_like(valid), torch.ones_like(noisy_valid)], 1)
    return Batch(tokens=tokens, pos=positions, labels=torch.cat([labels, noisy_labels], 1), L=L, noisy=stream,
                 valid=torch.cat([valid, noisy_valid], 1), block_size=B)


# ---- the order of the examples ----

def step_batches(lengths: np.ndarray, global_batch: int, seed: int, epoch: int,
                 group: int = 64) -> np.ndarray:
    # One epoch's optimizer steps as a (steps, global_batch) array of example indices.
    # Length grouping: shuffle, cut into mega-chunks of `group` steps, sort each chunk by length,
    # cut it into steps, then shuffle the steps. A step holds examples of similar length, so
    # padding stays small. A pure function of (seed, epoch): resuming at step k needs only k.
    # The last len % global_batch examples of the shuffled order sit this epoch out.
    rng = np.random.default_rng([seed, epoch])
    steps = len(lengths) // global_batch
    perm = rng.permutation(len(lengths))[: steps * global_batch]
    chunks = []
    for start in range(0, len(perm), global_batch * group):
        chunk = perm[start : start + global_batch * group]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]  # longest first
        chunks.append(chunk.reshape(-1, global_batch))
    if not chunks:
        return np.zeros((0, global_batch), np.int64)
    return np.concatenate(chunks)[rng.permutation(steps)]


def micro_batches(step: np.ndarray, batch_size: int, rank: int = 0, world: int = 1) -> np.ndarray:
    # A step's global_batch indices (sorted by length) -> this rank's (grad_accum, batch_size)
    # micro-batches. Micro-batch m goes to rank m % world, so ranks get similar lengths.
    return step.reshape(-1, batch_size)[rank::world]
