# Data sets and the MARS batch (docs/method.md §1-3): supervision, truncation, block padding, the mask,
# and the length-grouped batch order. Expected values come from loops over positions, never from
# the tensor code under test.
import json
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import data
from conftest import FIXTURES
from data import (
    IGNORE,
    encode_examples,
    load_conversations,
    load_examples,
    make_batch,
    micro_batches,
    step_batches,
)
from mars.formats import parse_function_calls, to_messages
from mars.tokenizer import Tokenizer

MASK, PAD = 99, 98
DOLCI = FIXTURES / "dolci_sample.jsonl"  # rows in the published schema


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


# ---- encoding: supervision, truncation, block padding (docs/method.md §1) ----

def chat(user: str, answer: str, system: str = "s") -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user},
            {"role": "assistant", "content": answer}]


def test_block_padding_is_supervised_eos():
    tok = Tokenizer.byte_level()
    for B in (3, 4, 8):
        for answer in ("a", "ab", "abc", "abcd", "abcde"):
            ids, sup = tok.encode_chat_with_mask(chat("hi", answer))
            data = encode_examples(tok, [chat("hi", answer)], 512, B)
            got_ids, got_sup = data[0]
            pad = len(got_ids) - len(ids)
            assert len(got_ids) % B == 0 and 0 <= pad < B
            assert got_ids[: len(ids)].tolist() == ids and got_sup[: len(ids)].tolist() == sup
            assert got_ids[len(ids):].tolist() == [tok.eos_id] * pad
            assert got_sup[len(ids):].all()
            assert data.stats["eos_pad_tokens"] == pad
            batch = make_batch([data[0]], B, tok.mask_id, tok.pad_id)
            # the real last token ("\n" after <|im_end|>) is trained to emit EOS when padded
            last = len(ids) - 1
            assert batch.labels[0, last] == (tok.eos_id if pad else IGNORE)


def test_truncation_and_drops_are_counted():
    tok = Tokenizer.byte_level()
    B, max_len = 4, 62  # rounded down to 60: no example may exceed max_len after block padding
    convs = [
        chat("hi", "short"),  # kept as is
        chat("hi", "x" * 200),  # answer truncated
        chat("y" * 200, "z"),  # prompt alone fills max_len: dropped
        [{"role": "user", "content": "no answer"}],  # nothing supervised: dropped
        chat("q" * 29, "r" * 10),  # a 59-token prompt: one answer token survives the cut, kept
        chat("q" * 30, "r" * 10),  # a 60-token prompt: nothing supervised survives, dropped
    ]
    assert len(tok.encode_chat_with_mask(convs[-1])[1]) - sum(tok.encode_chat_with_mask(convs[-1])[1]) == 60
    data = encode_examples(tok, convs, max_len, B)
    s = data.stats
    assert (s["examples"], s["kept"], s["dropped_prompt_too_long"], s["dropped_no_assistant"]) == (6, 3, 2, 1)
    assert s["truncated"] == 4  # all but the short one and the one with no answer
    assert all(n <= 60 and n % B == 0 for n in data.lengths)
    for i in range(len(data)):
        ids, sup = data[i]
        assert sup[1:].any()  # every kept example has a supervised target
    ids, sup = data[1]
    assert len(ids) == 60 and ids[-1] == ord("x")  # first max_len tokens, no EOS appended


def test_last_turn_only():
    tok = Tokenizer.byte_level()
    conv = chat("q1", "first") + [{"role": "user", "content": "q2"},
                                  {"role": "assistant", "content": "second"}]
    every = encode_examples(tok, [conv], 512, 1)
    last = encode_examples(tok, [conv], 512, 1, last_turn_only=True)
    assert every.stats["supervised_tokens"] == len("first") + 2 + len("second") + 2
    assert last.stats["supervised_tokens"] == len("second") + 2


# ---- files and formats ----

def write_lines(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_alpaca_and_sharegpt_become_messages(tmp_path):
    alpaca = {"instruction": "Add", "input": "2 and 3", "output": "5"}
    assert to_messages(alpaca, "x") == [{"role": "user", "content": "Add\n\n2 and 3"},
                                        {"role": "assistant", "content": "5"}]
    assert to_messages({"instruction": "Hi", "input": "", "output": "Hello"}, "x")[0]["content"] == "Hi"
    share = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                               {"from": "gpt", "value": "A"}]}
    assert to_messages(share, "x") == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                                       {"role": "assistant", "content": "A"}]
    msgs = {"messages": chat("q", "a"), "family": "extra keys are ignored"}
    f = write_lines(tmp_path / "mixed.jsonl", [alpaca, "", share, msgs])
    assert [len(c) for c in load_conversations(str(f))] == [2, 3, 3]
    arr = tmp_path / "alpaca.json"  # Alpaca ships as one JSON array
    arr.write_text(json.dumps([alpaca, alpaca]))
    assert len(load_conversations(str(arr))) == 2


def test_a_folder_means_its_train_files(tmp_path):
    write_lines(tmp_path / "train.jsonl", [{"messages": chat("q", "a")}] * 3)
    write_lines(tmp_path / "test.jsonl", [{"messages": chat("q", "a")}] * 2)  # never trained on
    assert len(load_conversations(str(tmp_path))) == 3
    # "train" starting a word of the name, as the hub's shards have it; inside another word it is no split.
    from data import data_files

    for name in ("train-00000-of-00002.parquet", "my_train.json", "Train.jsonl", "training.jsonl", "constraints.jsonl",
                 "part1.jsonl", "retrain_notes.jsonl"):
        (tmp_path / name).write_text("")
    assert [p.name for p in data_files(str(tmp_path))] == ["Train.jsonl", "my_train.json",
                                                           "train-00000-of-00002.parquet", "train.jsonl",
                                                           "training.jsonl"]
    for name in ("train.jsonl", "Train.jsonl", "my_train.json", "train-00000-of-00002.parquet", "training.jsonl",
                 "test.jsonl"):
        (tmp_path / name).unlink()
    assert [p.name for p in data_files(str(tmp_path))] == ["constraints.jsonl", "part1.jsonl", "retrain_notes.jsonl"]


def test_malformed_file_names_file_and_line(tmp_path):
    f = write_lines(tmp_path / "bad.jsonl", [{"messages": chat("q", "a")}, "", '{"messages": ['])
    with pytest.raises(ValueError, match=r"bad.jsonl:3: not valid JSON"):
        load_conversations(str(f))


@pytest.mark.parametrize("line, reason, what", [
    ('[1, 2]', "not an object", "expected a JSON object"),
    ('{"text": "hello"}', "unknown format", "no 'messages'"),
    ('{"messages": [{"role": "critic", "content": "x"}]}', "role 'critic'", "role 'critic'"),
    ('{"messages": [{"role": "user", "content": null}]}', "user content null", "content is NoneType"),
    ('{"conversations": [{"from": "bot", "value": "x"}]}', "from='bot'", "from='bot'"),
    ('{"messages": []}', "empty messages", "non-empty list"),
])
def test_a_bad_row_is_skipped_counted_and_named(tmp_path, line, reason, what):
    # One row never aborts the load: it is skipped, counted by reason, and the first one of each
    # reason is named by file:line. Only a file with no usable row at all is an error.
    f = write_lines(tmp_path / "bad.jsonl", [{"messages": chat("q", "a")}, "", line, line])
    counts = {}
    assert load_conversations(str(f), counts) == [chat("q", "a")]
    assert counts[f"skipped ({reason})"] == 2 and counts["chat"] == 1
    assert re.match(rf".*bad.jsonl:3: .*{what}", counts["first skipped"][f"skipped ({reason})"])
    only_bad = write_lines(tmp_path / "only.jsonl", [line])
    with pytest.raises(ValueError, match=rf"no usable row; first problem: .*only.jsonl:1: .*{what}"):
        load_conversations(str(only_bad))


def dolci_parquet(path: Path) -> Path:
    # The fixture rows as parquet with Dolci-Instruct-SFT's published schema: every message has
    # content, function_calls, functions and role, all nullable strings.
    import pyarrow as pa
    import pyarrow.parquet as pq

    message = pa.struct([("content", pa.string()), ("function_calls", pa.string()),
                         ("functions", pa.string()), ("role", pa.string())])
    schema = pa.schema([("id", pa.string()), ("messages", pa.list_(message)),
                        ("source_dataset", pa.string()), ("domain", pa.string())])
    rows = [json.loads(line) for line in DOLCI.read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def test_dolci_schema_rows_render_or_skip(tmp_path):
    # Plain rows render as chat; tool-use rows (functions, function_calls with null content,
    # environment turns) render in Qwen2.5's tool-call format; the rest are skipped and counted.
    expected_counts = {"chat": 2, "tools": 2, "skipped (role 'critic')": 1, "skipped (assistant content null)": 1,
                       "skipped (function_calls not parseable)": 1, "skipped (user content null)": 1}
    results = []
    for source in (DOLCI, dolci_parquet(tmp_path / "train.parquet")):
        counts = {}
        results.append(load_conversations(str(source), counts))
        assert {k: v for k, v in counts.items() if k != "first skipped"} == expected_counts
        assert counts["first skipped"]["skipped (role 'critic')"].startswith(f"{source}:5" if source == DOLCI
                                                                              else f"{source}: row 4")
    assert results[0] == results[1]
    chat1, chat2, tool1, tool2 = results[0]
    assert [m["role"] for m in chat2] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["role"] for m in tool1] == ["system", "user", "assistant", "user", "assistant"]
    assert tool1[0]["content"].startswith("You help with travel.\n\n# Tools\n\n") and tool1[0]["tool_markup"]
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in tool1[0]["content"]
    assert tool1[2] == {"role": "assistant", "tool_markup": True, "content":
                        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
                        '\n</tool_call>'}
    assert tool1[3] == {"role": "user", "content": '<tool_response>\n{"temperature": 24, "sky": "clear"}\n'
                                                   '</tool_response>'}
    # functions on a user message and no system message: Qwen's default system turn carries the tools
    assert tool2[0]["content"].startswith("You are Qwen, created by Alibaba Cloud.") and tool2[1]["role"] == "user"
    assert tool2[2]["content"] == ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                   '{"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "convert_currency", '
                                   '"arguments": {"amount": 100, "from": "EUR", "to": "NOK"}}\n</tool_call>')
    assert tool2[3]["content"] == ('<tool_response>\n{"temperature": 3}\n</tool_response>\n'
                                   '<tool_response>\n{"result": 1150.5}\n</tool_response>')


def test_function_calls_parse_python_and_json():
    assert parse_function_calls('f(a=1, b="x", c=true, d=null, e=[1, {"k": false}])') == [
        {"name": "f", "arguments": {"a": 1, "b": "x", "c": True, "d": None, "e": [1, {"k": False}]}}]
    assert [c["name"] for c in parse_function_calls("[a.b(x=1), c()]")] == ["a.b", "c"]
    assert parse_function_calls('{"name": "f", "arguments": {"a": 1}}') == [{"name": "f", "arguments": {"a": 1}}]
    for bad in ("f(", "f(1)", "x = 3", "f(**kw)", "", "f(a={[1]: 2})", "f(a=b)"):
        with pytest.raises(ValueError):
            parse_function_calls(bad)


def test_examples_are_tokenized_once_and_cached(tmp_path, monkeypatch):
    # The first load tokenizes and writes .mars-cache/ beside the data; the next one maps the cached
    # arrays without tokenizing; other settings (or another tokenizer) get their own cache.
    src = tmp_path / "dolci.parquet"
    dolci_parquet(src)
    tok = Tokenizer.byte_level()
    first = load_examples(str(src), tok, 2048, 4, log=lambda *a: None)  # byte-level: the tools are long
    assert len(list((tmp_path / ".mars-cache").iterdir())) == 1
    assert first.stats["rows"]["tools"] == 2 and first.stats["kept"] == 4
    assert isinstance(first.ids, np.memmap)
    direct = encode_examples(tok, load_conversations(str(src)), 2048, 4)
    assert all(np.array_equal(first[i][0], direct[i][0]) and np.array_equal(first[i][1], direct[i][1])
               for i in range(len(direct))) and len(first) == len(direct)

    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(data, "encode_examples", no_tokenizing)
    again = load_examples(str(src), tok, 2048, 4, build=False)
    assert np.array_equal(again.ids, first.ids) and again.stats == first.stats
    monkeypatch.undo()
    load_examples(str(src), tok, 1024, 4, log=lambda *a: None)  # another max_len: another cache
    assert len(list((tmp_path / ".mars-cache").iterdir())) == 2
    half = first.select(np.array([3, 1]))  # a split shares the arrays
    assert np.array_equal(half[0][0], first[3][0]) and half.lengths.tolist() == first.lengths[[3, 1]].tolist()
    assert "2 tools" in data.describe(first.stats, "train", 512)
    # a process that waits for another to build a cache gives up with a clear error, never hangs
    with pytest.raises(TimeoutError, match="waited 0 s for the first process to tokenize it"):
        monkeypatch.setattr(data, "WAIT_FOR_TOKENIZER_S", 0.2)
        load_examples(str(src), tok, 256, 4, build=False)


def test_missing_file_and_offline_hub_dataset(monkeypatch):
    import huggingface_hub.constants

    with pytest.raises(FileNotFoundError, match="no such file"):
        load_conversations("no_such_file.jsonl")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="nobody/no-such-dataset: not a local file.*local .jsonl"):
        load_conversations("nobody/no-such-dataset")


def test_parquet_files_load(tmp_path):
    # Hub data sets (Dolci among them) ship as parquet shards (pyarrow is in requirements-dev.txt).
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": chat("q", "a")}, {"messages": chat("2 + 2?", "4", system="be brief")}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train-00000.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "test-00000.parquet")
    assert load_conversations(str(tmp_path / "train-00000.parquet")) == [r["messages"] for r in rows]
    assert len(load_conversations(str(tmp_path))) == 2  # a folder of shards: its train files
    # A row this loader cannot use is skipped and counted, naming its row; it never aborts the load.
    bad = [rows[0], {"messages": [{"role": "robot", "content": "x"}]}]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "bad.parquet")
    counts = {}
    assert load_conversations(str(tmp_path / "bad.parquet"), counts) == [rows[0]["messages"]]
    assert counts["skipped (role 'robot')"] == 1
    assert counts["first skipped"]["skipped (role 'robot')"].startswith(f"{tmp_path / 'bad.parquet'}: row 1: ")
    # A file that is not parquet at all still raises, naming the file.
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match="broken.parquet: not a readable parquet file"):
        load_conversations(str(tmp_path / "broken.parquet"))


def test_parquet_without_pyarrow_says_so(tmp_path, monkeypatch):
    # Hide pyarrow (a None entry in sys.modules makes its import fail), installed or not.
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    f = tmp_path / "d.parquet"
    f.write_bytes(b"PAR1")
    with pytest.raises(SystemExit, match="d.parquet: reading parquet .* needs pyarrow, which is not installed: "
                                         "pip install -r requirements-extras.txt"):
        load_conversations(str(f))


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


def test_a_row_too_long_for_max_len_is_skipped_as_it_streams(tmp_path):
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    huge = {"messages": [{"role": "user", "content": "x" * 3000}, {"role": "assistant", "content": "yo"}]}
    f = tmp_path / "d.jsonl"
    f.write_text(f"{json.dumps(row)}\n{json.dumps(huge)}\n{json.dumps(row)}\n")
    counts = {}
    assert len(list(data.iter_conversations([f], counts, "--data d", max_bytes=1000))) == 2
    assert counts["skipped (line too long for max_len)"] == 1
    assert f"{f}:2: line over 1000 bytes" in counts["first skipped"]["skipped (line too long for max_len)"]
