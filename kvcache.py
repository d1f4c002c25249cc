# A static KV cache with a committed length per row (docs/method.md §7).
#
# A forward writes its T new keys and values at each row's committed length and attends over the
# returned views. Nothing is committed until the caller says how many of those T entries are real:
# MARS commits the real tokens a step fed (those accepted the step before, and the drafts verify accepts)
# and leaves the mask slots, which the next step simply overwrites.
# No copies, no rollback. Masks (which keys a query may see) are the caller's job.
from __future__ import annotations

import torch

from model import Config


class KVCache:
    def __init__(self, config: Config, batch_size: int, max_len: int,
                 device: str | torch.device | None = None, dtype: torch.dtype = torch.float32):
        shape = (config.num_hidden_layers, batch_size, config.num_key_value_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # (layers, R, Hkv, max_len, D)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.set_lengths([0] * batch_size)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def set_lengths(self, lengths: list[int]) -> None:
        # The committed entries per row, on the host: no device sync. A forward's write columns follow from
        # them (update).
        self.lengths = list(lengths)
        self._index: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # T -> write indices, for these lengths

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v (R, Hkv, T, D) -> views (R, Hkv, S, D) with S = longest committed length + T.
        # Row r's new entries land at columns lengths[r] .. lengths[r]+T-1: a function of the committed
        # lengths alone, so every layer writes where every other does, in whatever order they run.
        T = k.shape[2]
        shortest, longest = min(self.lengths), max(self.lengths)
        if longest + T > self.max_len:
            raise RuntimeError(f"KV cache overflow: {longest} + {T} > max_len {self.max_len}")
        if shortest == longest:  # every row at the same length (one row, or prefill): a plain slice write
            self.k[layer, :, :, shortest:shortest + T] = k
            self.v[layer, :, :, shortest:shortest + T] = v
        else:
            if T not in self._index:  # the first layer to write T entries builds them; the others reuse them
                lengths = torch.tensor(self.lengths).to(k.device, non_blocking=True)  # one copy, no sync
                self._index[T] = (torch.arange(self.batch_size, device=k.device)[:, None],  # (R, 1)
                                  lengths[:, None] + torch.arange(T, device=k.device))  # (R, T)
            rows, cols = self._index[T]
            # Advanced indices around a slice put their dims first: the target is (R, T, Hkv, D).
            self.k[layer, rows, :, cols] = k.transpose(1, 2)
            self.v[layer, rows, :, cols] = v.transpose(1, 2)
        return self.k[layer, :, :, :longest + T], self.v[layer, :, :, :longest + T]

    def commit(self, kept: list[int] | int) -> None:
        # Keep the first kept[r] entries written by the last forward of row r; the rest is scratch.
        kept = [kept] * self.batch_size if isinstance(kept, int) else list(kept)
        self.set_lengths([length + new for length, new in zip(self.lengths, kept)])

    def keep_rows(self, rows: list[int]) -> None:
        # Only these rows stay, in this order (decode drops finished rows, so later forwards skip them).
        # One copy of the kept rows' buffers, once per change of the batch.
        index = torch.tensor(rows).to(self.k.device, non_blocking=True)  # one copy, no sync
        self.k, self.v = self.k.index_select(1, index), self.v.index_select(1, index)
        self.set_lengths([self.lengths[r] for r in rows])
