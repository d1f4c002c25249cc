# Chat files in, (ids, supervised) examples out (mars/examples.py): the file formats and the hub, rows
# skipped and counted by reason, the counts of what encoding truncated and dropped, and the tokenized
# examples cached beside the data. The rule each example goes through is tests/spec/test_data.py's.
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES
from data import fit_to_blocks
from mars import cli, examples
from mars.examples import data_files, encode_examples, load_conversations, load_examples
from mars.formats import parse_function_calls, to_messages
from mars.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]

DOLCI = FIXTURES / "dolci_sample.jsonl"  # rows in the published schema


def chat(user: str, answer: str, system: str = "s") -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user},
            {"role": "assistant", "content": answer}]


# ---- encoding: what was truncated, dropped and padded is counted (docs/method.md §1) ----

def test_each_example_is_fit_to_blocks_and_its_padding_counted():
    tok = Tokenizer.byte_level()
    for B in (3, 4, 8):
        for answer in ("a", "ab", "abc", "abcd", "abcde"):
            ids, sup = tok.encode_chat_with_mask(chat("hi", answer))
            data = encode_examples(tok, [chat("hi", answer)], 512, B)
            want_ids, want_sup = fit_to_blocks(ids, sup, 512, B, tok.eos_id)
            assert data[0][0].tolist() == want_ids and data[0][1].tolist() == want_sup
            assert data.stats["eos_pad_tokens"] == len(want_ids) - len(ids)


def test_the_turns_after_the_last_reply_go_and_the_padding_follows_the_reply():
    # A user turn after the last reply has no target: kept, its end would be where the supervised padding
    # starts, teaching <|im_end|> after a user turn (docs/method.md §1 pads after a reply).
    tok = Tokenizer.byte_level()
    reply = chat("hi", "yo")
    data = encode_examples(tok, [reply + [{"role": "user", "content": "thanks"}]], 512, 7)
    assert data[0][0].tolist() == encode_examples(tok, [reply], 512, 7)[0][0].tolist()
    ids, sup = data[0][0].tolist(), data[0][1].tolist()
    n = len(tok.encode_chat_with_mask(reply)[0])  # the reply's tokens, then the padding
    assert tok.decode(ids) == tok.decode(tok.encode_chat(reply)) + "<|im_end|>" * (len(ids) - n) and len(ids) > n
    assert all(sup[n - 1:])  # the reply's last token and every pad after it are targets


def test_tokenizing_says_how_far_it_is(monkeypatch):
    # A large data set takes minutes to tokenize: a line every every_s seconds (here a fake clock's 1 s a row).
    clock = iter(range(100))
    monkeypatch.setattr(examples.time, "monotonic", lambda: next(clock))
    lines = []
    encode_examples(Tokenizer.byte_level(), [chat("hi", "there")] * 7, 64, 4, log=lines.append, every_s=3)
    assert lines == ["tokenizing: 2 rows done, 1 rows/s", "tokenizing: 5 rows done, 1 rows/s"]


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
    for name in ("train-00000-of-00001.parquet", "my_train.json", "Train.jsonl", "training.jsonl", "constraints.jsonl",
                 "part1.jsonl", "retrain_notes.jsonl"):
        (tmp_path / name).write_text("")
    assert [p.name for p in data_files(str(tmp_path))] == ["Train.jsonl", "my_train.json",
                                                           "train-00000-of-00001.parquet", "train.jsonl",
                                                           "training.jsonl"]
    for name in ("train.jsonl", "Train.jsonl", "my_train.json", "train-00000-of-00001.parquet", "training.jsonl",
                 "test.jsonl"):
        (tmp_path / name).unlink()
    assert [p.name for p in data_files(str(tmp_path))] == ["constraints.jsonl", "part1.jsonl", "retrain_notes.jsonl"]


def test_a_hub_dataset_means_its_train_split_whatever_its_layout(tmp_path, monkeypatch):
    # Splits as folders (data/train/, data/test/), and a dataset of .json files alone (Alpaca's), its metadata
    # beside them; a hidden file (macOS's ._ copies) and a suffix in capitals in a local folder.
    from mars import hub

    snapshots = {"org/folders": ["data/train/0000.parquet", "data/test/0000.parquet", "README.md"],
                 "org/alpaca": ["alpaca_data_cleaned.json", "dataset_info.json"],
                 "org/mixed": ["train.jsonl", "extra/notes.json"]}
    for repo, files in snapshots.items():
        for name in files:
            (tmp_path / repo / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / repo / name).write_text("")
    asked = []
    monkeypatch.setattr(hub, "download", lambda repo, kind, patterns, *a: asked.append(patterns) or tmp_path / repo)
    assert [p.relative_to(tmp_path / "org").as_posix() for p in data_files("org/folders")] == [
        "folders/data/train/0000.parquet"]
    asked.clear()
    assert [p.name for p in data_files("org/alpaca")] == ["alpaca_data_cleaned.json"]
    assert [p.name for p in data_files("org/mixed")] == ["train.jsonl"]  # its .json files never asked for
    # what the hub's own filter takes: every case, and .json only where the first patterns found nothing
    from huggingface_hub.utils import filter_repo_objects

    names = ["TRAIN.JSONL", "b.Parquet", "c.json", "d.txt"]
    assert [list(filter_repo_objects(names, allow_patterns=p)) for p in asked] == [
        ["TRAIN.JSONL", "b.Parquet"], ["c.json"], ["TRAIN.JSONL", "b.Parquet"]]
    local = tmp_path / "local"
    local.mkdir()
    for name in ("ALL.JSONL", "._ALL.jsonl", ".hidden.json"):
        (local / name).write_text("")
    assert [p.name for p in data_files(str(local))] == ["ALL.JSONL"]
    (local / "ROWS.JSON").write_text(json.dumps([{"messages": chat("q", "a")}]))
    assert len(load_conversations(str(local / "ROWS.JSON"))) == 1  # read as the JSON array it is


def test_a_hub_datasets_train_files_are_one_whole_split_and_never_this_codes_cache(tmp_path, monkeypatch):
    # HuggingFaceH4/ultrachat_200k's layout: train_sft and train_gen are two splits, refused rather than mixed; a
    # shard that an interrupted download left out is named; the token cache written into a snapshot is not data;
    # a local download (hf download --local-dir) keeps its files in data/, and its .cache/huggingface is not data.
    from mars import hub

    snap = tmp_path / "snap"
    names = [f"data/{split}-0000{i}-of-00002-ab12.parquet" for split in ("train_sft", "train_gen", "test_sft")
             for i in range(2)]
    for name in names + [".mars-cache/x/stats.json", ".cache/huggingface/download/data/y.json"]:
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).write_text("")
    monkeypatch.setattr(hub, "download", lambda *a: snap)
    with pytest.raises(ValueError, match=r"--data org/ultra: its train files are of 2 splits \(train_gen, train_sft\); "
                                         r"pass the files of one"):
        data_files("org/ultra")
    with pytest.raises(ValueError, match=r"--data .*snap: its train files are of 2 splits"):  # the local download
        data_files(str(snap))
    for name in names[2:]:
        (snap / name).unlink()
    assert [p.name for p in data_files("org/ultra")] == [Path(n).name for n in names[:2]]
    assert [p.name for p in data_files(str(snap))] == [Path(n).name for n in names[:2]]
    (snap / names[1]).unlink()
    with pytest.raises(FileNotFoundError, match=r"--data org/ultra: .*data/train_sft-00001-of-00002\*\.parquet is "
                                                r"missing \(1 of its 2 shards\): a partial download"):
        data_files("org/ultra")
    assert [p.name for p in data_files(str(snap))] == [Path(names[0]).name]  # a local folder may hold a part
    (snap / names[0]).unlink()
    # a user's own files: shards numbered from 1, and two train files that are no hub split
    own = tmp_path / "own"
    for n in ("rows-001-of-002.jsonl", "rows-002-of-002.jsonl", "train_a.jsonl", "train_b.jsonl", "test.jsonl"):
        (own / n).parent.mkdir(exist_ok=True)
        (own / n).write_text("")
    assert [p.name for p in data_files(str(own))] == ["train_a.jsonl", "train_b.jsonl"]
    for n in ("train_a.jsonl", "train_b.jsonl", "test.jsonl"):
        (own / n).unlink()
    assert len(data_files(str(own))) == 2
    (snap / "alpaca.json").write_text(json.dumps([{"messages": chat("q", "a")}]))  # a .json-only dataset, cached
    assert [p.name for p in data_files("org/ultra")] == ["alpaca.json"]


def test_malformed_file_names_file_and_line(tmp_path):
    f = write_lines(tmp_path / "bad.jsonl", [{"messages": chat("q", "a")}, "", '{"messages": ['])
    with pytest.raises(ValueError, match=r"bad.jsonl:3: not valid JSON"):
        load_conversations(str(f))


@pytest.mark.parametrize("line, reason, what", [
    ('[1, 2]', "not an object",
     "expected a JSON object, got list; a file that is one JSON array of rows is read as one when named .json"),
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
                                                   '</tool_response>', "tool_markup": True}
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
    # Llama's "parameters", OpenAI's arguments as JSON text, calls already parsed (parquet), and a keyword
    # argument name on a line of its own
    assert parse_function_calls('{"name": "f", "parameters": {"a": 1}}') == [{"name": "f", "arguments": {"a": 1}}]
    assert parse_function_calls([{"function": {"name": "f", "arguments": '{"a": 1}'}}]) == [
        {"name": "f", "arguments": {"a": 1}}]
    assert parse_function_calls('convert(\n    amount=1,\n    from="EUR")') == [
        {"name": "convert", "arguments": {"amount": 1, "from": "EUR"}}]
    for bad in ("f(", "f(1)", "x = 3", "f(**kw)", "", "f(a={[1]: 2})", "f(a=b)", "f(a={1, 2})", "[1]", "[]",
                '{"name": "f", "arguments": "3"}'):
        with pytest.raises(ValueError):
            parse_function_calls(bad)


def test_openai_and_llama_factory_tool_rows_render_as_dolcis():
    # The same tool-use conversation in OpenAI's schema (tool_calls with the arguments as JSON text, tool turns,
    # the row's tools) and in LLaMA-Factory's ShareGPT (function_call and observation turns) renders as the Dolci
    # row does, whose tokens test_tokenizer.py checks against Qwen2.5's template.
    lines = DOLCI.read_text(encoding="utf-8").splitlines()
    dolci = json.loads(lines[2])
    signatures = json.loads(dolci["messages"][0]["functions"])
    call = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    turns = [("system", "You help with travel."), ("user", "Is it warm in Paris?"), ("assistant", None),
             ("tool", '{"temperature": 24, "sky": "clear"}'), ("assistant", "Yes: 24 °C and clear skies in Paris.")]
    openai = {"tools": [{"type": "function", "function": t} for t in signatures], "messages": [
        {"role": role, "content": text} for role, text in turns]}
    openai["messages"][2] = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {**call, "arguments": json.dumps(call["arguments"])}}]}
    llama_factory = {"system": "You help with travel.", "tools": json.dumps(signatures), "conversations": [
        {"from": "human", "value": turns[1][1]}, {"from": "function_call", "value": json.dumps(call)},
        {"from": "observation", "value": turns[3][1]}, {"from": "gpt", "value": turns[4][1]}]}
    expected = to_messages(dolci, "dolci")
    assert expected[2]["content"].startswith("<tool_call>\n") and "# Tools" in expected[0]["content"]
    assert to_messages(openai, "openai") == expected
    assert to_messages(llama_factory, "llama-factory") == expected
    # as parquet files flattened from OpenAI's rows hold them: content as a list of text parts, and "[]" as JSON
    # text for a turn with no calls
    openai["messages"][1]["content"] = [{"type": "text", "text": "Is it warm"}, {"type": "text", "text": "in Paris?"}]
    openai["messages"][4]["tool_calls"] = "[]"
    flat = to_messages(openai, "openai")
    assert flat[1]["content"] == "Is it warm\nin Paris?" and flat[2:] == expected[2:]


def test_weight_0_turns_and_empty_replies_are_context_not_targets(tmp_path):
    # OpenAI's fine-tuning schema (and ShareGPT's) mark a reply kept as context with weight 0; an empty reply
    # would teach only <|im_end|>. Either is rendered and attended to, never a target; a row left with no
    # target is dropped and counted, and a weight other than 0 or 1 skips its row.
    tok = Tokenizer.byte_level()
    turns = [("user", "q1"), ("assistant", "BAD"), ("user", "q2"), ("assistant", "good"), ("user", "q3"),
             ("assistant", " \n")]
    openai = {"messages": [{"role": r, "content": c, **({"weight": 0} if c == "BAD" else {})} for r, c in turns]}
    sharegpt = {"conversations": [{"from": {"user": "human", "assistant": "gpt"}[r], "value": c,
                                   **({"weight": 0} if c == "BAD" else {})} for r, c in turns]}
    plain = [{"role": r, "content": c} for r, c in turns]
    for row in (openai, sharegpt):
        messages = to_messages(row, "x")
        ids, sup = tok.encode_chat_with_mask(messages)
        assert ids == tok.encode_chat(plain)  # the same text as without the weights
        trained = tok.decode([i for i, s in zip(ids, sup) if s])
        assert trained == "good<|im_end|>\n", trained
        for last_only in (False, True):  # the last reply to train on is "good"
            assert tok.encode_chat_with_mask(messages, last_turn_only=last_only)[1] == sup
    only_context = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0}]}
    empty = {"instruction": "Say nothing", "output": ""}
    bad = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0.5}]}
    f = write_lines(tmp_path / "w.jsonl", [openai, only_context, empty, bad, sharegpt])
    counts = {}
    conversations = load_conversations(str(f), counts)
    assert len(conversations) == 4 and counts["skipped (bad weight)"] == 1
    assert "w.jsonl:4: messages[1] has weight 0.5" in counts["first skipped"]["skipped (bad weight)"]
    data = encode_examples(tok, conversations, 512, 4)
    assert data.stats["dropped_no_assistant"] == 2 and data.stats["kept"] == 2


def test_rows_of_several_formats_in_one_file_and_their_system_and_history():
    # pandas and parquet give every row every format's keys, null where unused; LLaMA-Factory's Alpaca rows
    # carry a system prompt and earlier turns beside the instruction.
    alpaca = {"messages": None, "conversations": None, "instruction": "Greet me", "input": "", "output": "Arr!",
              "system": "You are a pirate.", "history": [["Hi", "Ahoy"]]}
    assert to_messages(alpaca, "x") == [
        {"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Ahoy"}, {"role": "user", "content": "Greet me"},
        {"role": "assistant", "content": "Arr!"}]
    share = {"messages": None, "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}],
             "instruction": None, "output": None, "system": ""}  # an empty system: the tokenizer's default
    assert to_messages(share, "x") == [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    with pytest.raises(ValueError, match="x: messages must be a non-empty list"):
        to_messages({"messages": None, "conversations": None}, "x")
    for row in ({"messages": None, "instruction": "Hi", "output": None},  # a reply missing
                {"instruction": "Hi", "context": "", "response": "Hello", "category": "qa"}):  # Dolly's schema
        with pytest.raises(ValueError, match=re.escape("x: an Alpaca row ('instruction') needs its 'output'; keys "
                                                       f"are {sorted(row)}")):
            to_messages(row, "x")
    with pytest.raises(ValueError, match="x: a 'system' key and a system turn that differ; keep one"):
        to_messages({"messages": chat("q", "a"), "system": "S"}, "x")
    assert to_messages({"messages": chat("q", "a"), "system": "s"}, "x") == chat("q", "a")  # the same one twice


@pytest.mark.parametrize("message, reason", [
    ({"role": "assistant", "content": None, "function_calls": 'tag(items={"a", "b"})'}, "function_calls not parseable"),
    ({"role": "assistant", "content": None, "function_calls": 'f(x=b"ab")'}, "function_calls not parseable"),
    ({"role": "assistant", "content": ["a"], "function_calls": "f(x=1)"}, "assistant content list"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
     "function_calls not parseable"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
     "function_calls not parseable"),
    ({"role": "assistant", "content": None, "function_calls": "f(x=1e999)"}, "function_calls not parseable"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": '{"x": NaN}'}}]},
     "function_calls not parseable")])
def test_a_row_whose_calls_have_no_json_form_is_skipped_not_a_crash(tmp_path, message, reason):
    good = {"messages": chat("q", "a")}
    bad = {"messages": [{"role": "user", "content": "q"}, message]}
    counts = {}
    f = write_lines(tmp_path / "calls.jsonl", [good, bad])
    assert len(load_conversations(str(f), counts)) == 1
    assert counts[f"skipped ({reason})"] == 1 and counts["first skipped"][f"skipped ({reason})"].startswith(f"{f}:2")
    sharegpt = {"conversations": [{"from": ["human"], "value": "q"}]}
    with pytest.raises(ValueError, match=r"conversations\[0\] has from=\['human'\]"):
        to_messages(sharegpt, "x")


@pytest.fixture(autouse=True)
def no_worker_setting(monkeypatch):  # the tests set MARS_TOKENIZE_WORKERS themselves, not the caller's shell
    monkeypatch.delenv("MARS_TOKENIZE_WORKERS", raising=False)


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

    monkeypatch.setattr(examples, "encode_examples", no_tokenizing)
    again = load_examples(str(src), tok, 2048, 4, part=(1, 2))  # a second process: the cache, no share
    assert np.array_equal(again.ids, first.ids) and again.stats == first.stats
    monkeypatch.undo()
    load_examples(str(src), tok, 1024, 4, log=lambda *a: None)  # another max_len: another cache
    assert len(list((tmp_path / ".mars-cache").iterdir())) == 2
    half = first.select(np.array([3, 1]))  # a split shares the arrays
    assert np.array_equal(half[0][0], first[3][0]) and half.lengths.tolist() == first.lengths[[3, 1]].tolist()
    assert "2 tools" in examples.describe(first.stats, "train", 512)
    # a process that waits for another to build a cache gives up with a clear error, never hangs
    with pytest.raises(TimeoutError, match="waited 0 s for the first process to tokenize it"):
        monkeypatch.setattr(examples, "WAIT_FOR_TOKENIZER_S", 0.2)
        load_examples(str(src), tok, 256, 4, part=(1, 2), log=lambda *a: None)
    # the process that joins the shares gives up the same way on a share that never comes
    with pytest.raises(TimeoutError, match=r"waited 0 s for process 1 of 2 to tokenize it into .*-part-1-of-2"):
        load_examples(str(src), tok, 128, 4, part=(0, 2), log=lambda *a: None)


def test_processes_tokenize_a_share_each_and_join_it_in_row_order(tmp_path):
    # Under torchrun each process of a machine tokenizes every n-th row and the first joins the shares:
    # the cache equals what one process tokenizing every row writes, drops, skips and counts included.
    from concurrent.futures import ThreadPoolExecutor

    tok = Tokenizer.byte_level()
    convs = [chat(f"q{i}", "a" * (i + 1)) for i in range(9)]
    convs[2] = chat("y" * 200, "z")  # prompt alone fills max_len: dropped
    convs[5] = [{"role": "user", "content": "no answer"}]  # nothing supervised: dropped
    rows = [json.dumps({"messages": c}) for c in convs]
    rows.insert(7, json.dumps({"messages": [{"role": "critic", "content": "x"}]}))  # skipped while read
    src, alone = tmp_path / "chats.jsonl", tmp_path / "one" / "chats.jsonl"
    alone.parent.mkdir()
    for path in (src, alone):
        path.write_text("\n".join(rows) + "\n")
    for n in (2, 3, 4):  # 9 conversations: shares of unequal sizes
        max_len = 64 + 4 * n  # a cache of its own
        one = load_examples(str(alone), tok, max_len, 4, log=lambda *a: None)
        with ThreadPoolExecutor(n) as pool:
            got = list(pool.map(lambda i, n=n, max_len=max_len: load_examples(
                str(src), tok, max_len, 4, part=(i, n), log=lambda *a: None), range(n)))
        assert len(one) == 7 and one.stats["rows"]["skipped (role 'critic')"] == 1
        assert one.stats["dropped_prompt_too_long"] == one.stats["dropped_no_assistant"] == 1
        for g in got:  # every process maps the one joined cache
            assert g.offsets.tolist() == one.offsets.tolist()
            assert json.dumps(g.stats).replace(str(src), str(alone)) == json.dumps(one.stats)  # the first skip's file
            assert np.array_equal(g.ids, one.ids) and np.array_equal(g.sup, one.sup)
    assert [p.name for p in (tmp_path / ".mars-cache").iterdir() if "-part-" in p.name] == []  # shares removed


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



def test_a_line_too_long_for_a_row_is_skipped_as_it_streams_and_a_long_reply_is_cut(tmp_path, monkeypatch):
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    huge = {"messages": [{"role": "user", "content": "x" * 3000}, {"role": "assistant", "content": "yo"}]}
    f = tmp_path / "d.jsonl"
    f.write_text(f"{json.dumps(row)}\n{json.dumps(huge)}\n{json.dumps(row)}\n")
    counts = {}
    assert len(list(examples.iter_conversations([f], counts, "--data d", max_bytes=1000))) == 2
    assert counts["skipped (line too long)"] == 1
    assert f"{f}:2: line over {1000 / 2**20:g} MiB" in counts["first skipped"]["skipped (line too long)"]
    # Under the limit, a row of any length is read: a short prompt with a reply of 3 MB is kept, cut to max_len.
    long = {"messages": [{"role": "user", "content": "write a lot"}, {"role": "assistant", "content": "ab " * 10**6}]}
    f.write_text(f"{json.dumps(row)}\n{json.dumps(long)}\n")
    got = load_examples(str(f), Tokenizer.byte_level(), max_len=64, block_size=4)
    assert len(got) == 2 and got.lengths[1] == 64


def test_a_mistyped_local_path_is_not_found_and_never_downloaded(tmp_path, monkeypatch):
    # data/ is a folder here, so data/trian.jsonl is a path with a typo, not the hub dataset "data/trian.jsonl":
    # it is named as not found, with no download tried. So is a path that starts with ./ or /. An owner/name
    # with no folder `owner` here is still a hub id.
    import huggingface_hub

    calls, snapshot = [], tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "train.jsonl").write_text(json.dumps({"messages": chat("q", "a")}) + "\n")

    def snapshot_download(repo_id, repo_type=None, allow_patterns=None, **_):
        calls.append(repo_id)
        return str(snapshot)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "demo").mkdir(parents=True)
    cases = [("data/trian.jsonl", ""), ("data/dmo", " (did you mean data/demo?)"), ("./train.jsonl", ""),
             (str(tmp_path / "gone" / "d.jsonl"), f" ({tmp_path / 'gone'} does not exist)")]
    for source, hint in cases:
        with pytest.raises(FileNotFoundError) as e:
            load_conversations(source)
        assert str(e.value).startswith(f"--data {source}: no such file or folder{hint}; pass a .jsonl/.json/"
                                       ".parquet chat file"), str(e.value)
        assert "download" not in str(e.value) and "Offline" not in str(e.value)
    with pytest.raises(FileNotFoundError, match=r"^--eval-data data/trian.jsonl: no such file or folder"):
        data_files("data/trian.jsonl", "--eval-data")
    assert calls == []
    assert load_conversations("owner/name") == [chat("q", "a")] and calls == ["owner/name"]


def test_a_cache_write_that_a_killed_run_left_goes_at_the_next_write(tmp_path):
    # Its temporary folder names the machine and the process: one whose process is dead goes; one of a live
    # process, or of another machine sharing the disk, stays.
    tok = Tokenizer.byte_level()
    src = write_lines(tmp_path / "chats.jsonl", [{"messages": chat(f"q{i}", "a")} for i in range(5)])
    load_examples(str(src), tok, 64, 4, log=lambda *a: None)
    (folder,) = (tmp_path / ".mars-cache").iterdir()
    shutil.rmtree(folder)
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    host = examples.this_host()
    stale, live, other, longer = (tmp_path / ".mars-cache" / f".tmp-{folder.name}-{h}-{pid}" for h, pid in (
        (host, gone.pid), (host, os.getppid()), ("elsewhere", gone.pid), (f"{host}-b", gone.pid)))  # host-b: another
    for f in (stale, live, other, longer):
        f.mkdir()
        (f / "ids.npy").write_bytes(b"half")
    assert len(load_examples(str(src), tok, 64, 4, log=lambda *a: None)) == 5
    assert folder.is_dir() and not stale.exists() and live.exists() and other.exists() and longer.exists()


def test_a_lone_process_shares_large_data_out_to_worker_processes(tmp_path, monkeypatch):
    # One process (no torchrun) and MARS_TOKENIZE_WORKERS=2 (as large files get by themselves): spawned workers
    # tokenize a share each, with lines on the rows done, and the cache equals one process's, counts included; a
    # share's error is the run's; a share a killed run saved is kept.
    tok = Tokenizer.byte_level()
    rows = [json.dumps({"messages": chat(f"q{i}", "a" * (1 + i % 50))}) for i in range(2500)]
    rows[3] = json.dumps({"messages": [{"role": "critic", "content": "x"}]})  # skipped while read
    src, alone = tmp_path / "chats.jsonl", tmp_path / "one" / "chats.jsonl"
    alone.parent.mkdir()
    for path in (src, alone):
        path.write_text("\n".join(rows) + "\n")
    one, ref = (load_examples(str(alone), tok, max_len, 4, log=lambda *a: None) for max_len in (128, 64))
    monkeypatch.setenv("MARS_TOKENIZE_WORKERS", "2")
    monkeypatch.setattr(examples, "PROGRESS_S", 0.2)
    lines = []
    got = load_examples(str(src), tok, 128, 4, log=lines.append)
    assert lines[0].endswith("a 1/2 share in each of 2 worker processes")
    assert any(re.fullmatch(r"tokenizing: about \d+ rows done, \d+ rows/s in (2 processes|1 process)", x)
               for x in lines[1:])
    assert re.fullmatch(r"tokenized 2499 rows in \d+ s in 2 worker processes", lines[-1])
    assert len(one) == 2499 and got.offsets.tolist() == one.offsets.tolist()
    assert np.array_equal(got.ids, one.ids) and np.array_equal(got.sup, one.sup)
    assert json.dumps(got.stats).replace(str(src), str(alone)) == json.dumps(one.stats)
    assert [p.name for p in (tmp_path / ".mars-cache").iterdir()] == [Path(got.ids.filename).parent.name]

    bad = tmp_path / "bad" / "chats.jsonl"  # a share's error reaches the run as one process's would
    bad.parent.mkdir()
    bad.write_text(rows[3] + "\n")
    with pytest.raises(ValueError, match=r"--data .*chats.jsonl: no usable row; .*role 'critic'") as e:
        load_examples(str(bad), tok, 128, 4, log=lambda *a: None)
    assert re.match(r"in tokenizing worker [01] of 2:\nTraceback", e.value.__notes__[0])  # and where in the worker

    def killed_after_share_0(share, parts, log):  # a run killed once share 0 was saved (and marked)
        share(0, len(parts), parts[0])
        stats = json.loads((parts[0] / "stats.json").read_text())
        (parts[0] / "stats.json").write_text(json.dumps(stats | {"eos_pad_tokens": stats["eos_pad_tokens"] + 1000}))
        (parts[0].parent / parts[0].name.replace("-of-2", "-of-3")).mkdir()  # and a share of a run with 3 workers
        raise KeyboardInterrupt

    real = examples.in_workers
    monkeypatch.setattr(examples, "in_workers", killed_after_share_0)
    with pytest.raises(KeyboardInterrupt):
        load_examples(str(src), tok, 64, 4, log=lambda *a: None)
    monkeypatch.setattr(examples, "in_workers", real)
    lines.clear()
    again = load_examples(str(src), tok, 64, 4, log=lines.append)  # share 0 is not tokenized again
    assert lines[0].endswith("; 1 of the shares was saved by an earlier run")
    assert re.fullmatch(r"tokenized 1249 rows in \d+ s in 1 worker process", lines[-1])  # share 1's rows alone
    assert np.array_equal(again.ids, ref.ids) and again.stats["eos_pad_tokens"] == ref.stats["eos_pad_tokens"] + 1000
    assert sorted(p.name.startswith(".") for p in (tmp_path / ".mars-cache").iterdir()) == [False, False]


WORKER_DIES_AS_IT_STARTS = """
import os, signal, sys
if __name__ == "__mp_main__":  # a worker, as it imports the run's main module: killed (the OOM killer, say)
    os.kill(os.getpid(), signal.SIGKILL)
from mars.examples import load_examples
from mars.tokenizer import Tokenizer

if __name__ == "__main__":
    tok = Tokenizer.byte_level()
    tok.ballast = os.urandom(4 << 20)  # Qwen2.5's tokenizer pickles to megabytes, past a pipe's buffer
    os.environ["MARS_TOKENIZE_WORKERS"] = "2"
    load_examples(sys.argv[1], tok, 64, 4)
"""


def test_a_worker_that_dies_as_it_starts_ends_the_run_with_its_cause(tmp_path):
    # Not a run blocked for good in starting it: the tokenizer goes to the workers through a file.
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": chat(f"q{i}", "a")}) + "\n"
                                                  for i in range(50)))
    (tmp_path / "run.py").write_text(WORKER_DIES_AS_IT_STARTS)
    (tmp_path / "tmp").mkdir()
    stale = tmp_path / "tmp" / f"mars-tokenizer-{examples.this_host()}-4194999-x.pickle"  # a killed run's, pid gone
    stale.write_bytes(b"x")
    done = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path / "chats.jsonl")], timeout=120,
                          capture_output=True, text=True,
                          env=os.environ | {"PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path / "tmp")})
    assert done.returncode == 1 and "ended with exit status -9 (killed: out of memory?)" in done.stderr
    assert not list((tmp_path / "tmp").glob("mars-tokenizer-*"))  # its file gone with it


def test_tokenizing_workers_one_a_core_within_a_containers_quota(tmp_path, monkeypatch):
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.truncate(examples.WORKERS_FROM_BYTES)
    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    monkeypatch.setattr(cli, "CPU_QUOTA", tmp_path / "cpu.max")
    assert examples.workers([big]) == examples.MAX_WORKERS == 8  # no quota file: the affinity's 12, capped
    for quota, n in (("max 100000", 8), ("250000 100000", 2), ("50000 100000", 1)):
        (tmp_path / "cpu.max").write_text(quota + "\n")
        assert examples.workers([big]) == n, quota
    assert examples.workers([tmp_path / "cpu.max"]) == 1  # small data: the run's own process
    # A worker reads a JSON array whole, about 3 bytes a byte: as many workers as the free memory holds of the
    # largest. JSON Lines named .json stream, and where the free memory is unknown (not Linux) there is no bound.
    (tmp_path / "cpu.max").unlink()
    array, lines = tmp_path / "big.json", tmp_path / "lines.json"
    array.write_bytes(b"[" + b" " * (examples.WORKERS_FROM_BYTES - 1))
    lines.write_bytes(b'{"messages": []}\n' + b" " * (examples.WORKERS_FROM_BYTES * 4))
    for free, n in ((100 * examples.WORKERS_FROM_BYTES, 8), (7 * examples.WORKERS_FROM_BYTES, 2), (0, 1), (None, 8)):
        monkeypatch.setattr(cli, "available_memory", lambda free=free: free)
        assert examples.workers([big, array, lines]) == n and examples.workers([big, lines]) == 8
    monkeypatch.undo()
    monkeypatch.setattr(cli, "CPU_QUOTA", tmp_path / "cpu.max")
    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    # This machine's free memory, and within a container's limit: what is left under memory.max.
    assert cli.available_memory() > 0
    (tmp_path / "memory.max").write_text(f"{3 << 20}\n")
    (tmp_path / "memory.current").write_text(f"{1 << 20}\n")
    monkeypatch.setattr(cli, "MEMORY_MAX", tmp_path / "memory.max")
    monkeypatch.setattr(cli, "MEMORY_USED", tmp_path / "memory.current")
    assert cli.available_memory() == 2 << 20
    (tmp_path / "memory.max").write_text("max\n")
    assert cli.available_memory() > 0
    monkeypatch.setenv("MARS_TOKENIZE_WORKERS", "3")
    assert examples.workers([tmp_path / "cpu.max"]) == 3


def test_a_worker_killed_while_tokenizing_ends_the_others_and_says_so(tmp_path, monkeypatch):
    # A worker killed (for memory, say) ends the run's tokenizing with the cause and the way out; no worker is left.
    rows = "\n".join(json.dumps({"messages": chat(f"q{i}", "a" * 40)}) for i in range(50_000)) + "\n"
    (tmp_path / "chats.jsonl").write_text(rows)
    monkeypatch.setenv("MARS_TOKENIZE_WORKERS", "2")
    killed, deadline = [], time.monotonic() + 60

    def kill_a_worker():
        while not (children := [c for c in multiprocessing.active_children() if c.name.startswith("mars-tokenize-")]):
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        os.kill(children[0].pid, signal.SIGKILL)
        killed.append(children[0].pid)

    threading.Thread(target=kill_a_worker, daemon=True).start()
    with pytest.raises(RuntimeError, match=r"exit status -9 \(killed: out of memory\?\); MARS_TOKENIZE_WORKERS=1"):
        load_examples(str(tmp_path / "chats.jsonl"), Tokenizer.byte_level(), 256, 4, log=lambda *a: None)
    assert killed and multiprocessing.active_children() == []
    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", lambda self: exec("raise OSError(11, 'EAGAIN')"))
    with pytest.raises(OSError, match="EAGAIN"):  # a start that fails is the error, and nothing is left running
        load_examples(str(tmp_path / "chats.jsonl"), Tokenizer.byte_level(), 128, 4, log=lambda *a: None)
    monkeypatch.undo()
    monkeypatch.setenv("MARS_TOKENIZE_WORKERS", "2")
    monkeypatch.setenv("MARS_TOKENIZE_WORKERS", "two")
    with pytest.raises(ValueError, match="MARS_TOKENIZE_WORKERS='two': give a number of processes, 1 or more"):
        load_examples(str(tmp_path / "chats.jsonl"), Tokenizer.byte_level(), 256, 4, log=lambda *a: None)
