# mars/serve.py's ServerCache: kvcache.KVCache with the row slots a server needs. A view of a run of
# slots shares the buffers and its commits reach the whole cache; a row moves into a free slot below it
# with its entries; truncate empties a finished row's slot.
import pytest
import torch

from mars.serve import ServerCache
from model import Config

CONFIG = Config(vocab_size=11, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1)  # head_dim 4


def kv(R: int, T: int, value: float) -> torch.Tensor:
    # (R, Hkv, T, D) whose entry (b, :, t, :) is value + 10 b + t, so every column says where it came from
    return (value + 10 * torch.arange(R)[:, None] + torch.arange(T)).float()[:, None, :, None].expand(R, 1, T, 4)


def column(cache: ServerCache, layer: int, b: int) -> list[float]:
    return cache.k[layer, b, 0, :, 0].tolist()


def test_truncate_rewinds_and_overflow_is_refused():
    cache = ServerCache(CONFIG, batch_size=1, max_len=5)
    cache.update(0, kv(1, 4, 0), kv(1, 4, 0))
    cache.commit(4)
    cache.truncate([1])  # back to one entry: the next write starts at column 1
    cache.update(0, kv(1, 2, 50), kv(1, 2, 50))
    assert column(cache, 0, 0) == [0, 50, 51, 3, 0]
    cache.commit(2)
    with pytest.raises(RuntimeError, match="KV cache overflow: 3 \\+ 3 > max_len 5"):
        cache.update(0, kv(1, 3, 0), kv(1, 3, 0))


def test_move_gives_a_rows_entries_to_another_slot():
    cache = ServerCache(CONFIG, batch_size=3, max_len=8)
    cache.update(0, kv(3, 3, 100), -kv(3, 3, 100))
    cache.commit([1, 2, 3])
    cache.truncate([0, 2, 3])  # slot 0 finished
    cache.move(2, 0)  # the last row closes the gap
    assert cache.lengths == [3, 2, 0]
    assert column(cache, 0, 0)[:3] == [120, 121, 122] and column(cache, 0, 1)[:2] == [110, 111]
    cache.update(0, kv(3, 1, 300), -kv(3, 1, 300))  # the moved row goes on at its own length
    assert column(cache, 0, 0)[:4] == [120, 121, 122, 300] and column(cache, 0, 2)[0] == 320
    with pytest.raises(RuntimeError, match="move\\(\\) on a view of rows"):
        cache.rows(0, 2).move(1, 0)


def test_rows_0_to_n_are_a_view_of_the_first_rows():
    cache = ServerCache(CONFIG, batch_size=3, max_len=8)
    cache.update(0, kv(3, 2, 100), -kv(3, 2, 100))
    cache.commit([2, 1, 2])
    view = cache.rows(0, 2)
    view.update(0, kv(2, 1, 300), -kv(2, 1, 300))  # rows 0 and 1 alone, written into the shared buffers
    cache.commit([1, 1, 0])
    assert cache.lengths == [3, 2, 2]
    assert column(cache, 0, 0)[:3] == [100, 101, 300] and column(cache, 0, 1)[:2] == [110, 310]
    assert column(cache, 0, 2)[:3] == [120, 121, 0]  # the third row untouched
    # A commit on the view reaches its owner: the view's rows are the owner's first rows.
    view = cache.rows(0, 2)
    view.update(0, kv(2, 1, 400), -kv(2, 1, 400))
    view.commit([1, 0])
    assert view.lengths == [4, 2] and cache.lengths == [4, 2, 2]
    assert column(cache, 0, 0)[:4] == [100, 101, 300, 400]
    view.truncate([3, 2])
    assert cache.lengths == [3, 2, 2]
    with pytest.raises(RuntimeError, match="on a view of rows"):
        view.keep_rows([0])


def test_a_view_of_the_last_rows_writes_and_commits_there_alone():
    cache = ServerCache(CONFIG, batch_size=3, max_len=8)
    cache.update(0, kv(3, 2, 100), -kv(3, 2, 100))
    cache.commit([2, 2, 0])  # the third row has just joined: nothing cached yet
    view = cache.rows(2, 3)
    assert view.lengths == [0]
    view.update(0, kv(1, 3, 500), -kv(1, 3, 500))  # its prompt alone
    view.commit(3)
    assert cache.lengths == [2, 2, 3] and column(cache, 0, 2)[:3] == [500, 501, 502]
    assert column(cache, 0, 0)[:3] == [100, 101, 0] and column(cache, 0, 1)[:2] == [110, 111]
