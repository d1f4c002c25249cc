# kvcache.py (docs/method.md §7): writes land at each row's committed length, only what the
# caller commits survives, and the uncommitted tail (MARS's mask slots) is overwritten next step.
import pytest
import torch

from kvcache import KVCache
from model import Config

CONFIG = Config(vocab_size=11, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1)  # head_dim 4


def kv(R: int, T: int, value: float) -> torch.Tensor:
    # (R, Hkv, T, D) whose entry (b, :, t, :) is value + 10 b + t, so every column says where it came from
    return (value + 10 * torch.arange(R)[:, None] + torch.arange(T)).float()[:, None, :, None].expand(R, 1, T, 4)


def column(cache: KVCache, layer: int, b: int) -> list[float]:
    return cache.k[layer, b, 0, :, 0].tolist()


def test_ragged_commit_and_overwrite():
    cache = KVCache(CONFIG, batch_size=2, max_len=8)
    for layer in range(2):
        k, v = cache.update(layer, kv(2, 3, 100), -kv(2, 3, 100))
        assert k.shape == v.shape == (2, 1, 3, 4)  # S = max length 0 + T 3
    cache.commit([2, 1])  # row 0 keeps 2 of its 3 entries, row 1 keeps 1
    assert cache.lengths == [2, 1]

    for layer in range(2):
        k, v = cache.update(layer, kv(2, 2, 200), -kv(2, 2, 200))
        assert k.shape == (2, 1, 4, 4)  # S = max length 2 + T 2
        assert torch.equal(v, -k)
    # Row 0: committed 100, 101, then the new 200, 201 at columns 2-3.
    assert column(cache, 1, 0)[:4] == [100, 101, 200, 201]
    # Row 1: committed 110, then 210, 211 at columns 1-2: the uncommitted 111, 112 are overwritten.
    assert column(cache, 1, 1)[:4] == [110, 210, 211, 0]
    assert column(cache, 0, 1)[:4] == [110, 210, 211, 0]  # same columns in every layer

    cache.commit([0, 2])  # row 0 rejects everything it just wrote
    for layer in range(2):
        cache.update(layer, kv(2, 1, 300), -kv(2, 1, 300))
    assert column(cache, 0, 0)[:4] == [100, 101, 300, 201]
    assert column(cache, 0, 1)[:5] == [110, 210, 211, 310, 0]
    assert cache.lengths == [2, 3]


def test_a_short_commit_rewinds_and_overflow_is_refused():
    cache = KVCache(CONFIG, batch_size=1, max_len=5)
    cache.update(0, kv(1, 4, 0), kv(1, 4, 0))
    cache.commit(1)  # one of the four entries is real: the next write starts at column 1
    cache.update(0, kv(1, 2, 50), kv(1, 2, 50))
    assert column(cache, 0, 0) == [0, 50, 51, 3, 0]
    cache.commit(2)
    with pytest.raises(RuntimeError, match="KV cache overflow: 3 \\+ 3 > max_len 5"):
        cache.update(0, kv(1, 3, 0), kv(1, 3, 0))


def test_keep_drops_rows_and_the_rest_continue_as_before():
    cache = KVCache(CONFIG, batch_size=3, max_len=8)
    cache.update(0, kv(3, 3, 100), -kv(3, 3, 100))
    cache.commit([3, 1, 2])
    cache.keep_rows([2, 0])  # row 1 finished; rows 2 and 0 go on, in that order
    assert cache.batch_size == 2 and cache.lengths == [2, 3]
    assert column(cache, 0, 0)[:2] == [120, 121] and column(cache, 0, 1)[:3] == [100, 101, 102]
    k, _ = cache.update(0, kv(2, 1, 300), -kv(2, 1, 300))  # the next write lands at each kept row's length
    assert column(cache, 0, 0)[:3] == [120, 121, 300] and column(cache, 0, 1)[:4] == [100, 101, 102, 310]
    assert k.shape == (2, 1, 4, 4)


def test_every_layer_writes_at_the_committed_lengths_in_any_order():
    # The write columns come from the committed lengths alone: layers may run in any order.
    cache = KVCache(CONFIG, batch_size=2, max_len=8)
    cache.update(0, kv(2, 2, 100), -kv(2, 2, 100))
    cache.update(1, kv(2, 2, 100), -kv(2, 2, 100))
    cache.commit([2, 1])  # ragged from here on
    for layer in (1, 0):  # layer 1 first
        cache.update(layer, kv(2, 2, 500 + layer * 100), -kv(2, 2, 500))
    assert column(cache, 1, 0)[:4] == [100, 101, 600, 601] and column(cache, 1, 1)[:3] == [110, 610, 611]
    assert column(cache, 0, 0)[:4] == [100, 101, 500, 501] and column(cache, 0, 1)[:3] == [110, 510, 511]
