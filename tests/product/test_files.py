# files.py: every reader names the file, the line and the fix, in the one wording all callers share.
import json
import os
import re

import pytest
import torch

from mars import adapter, files
from mars.files import jsonl, read_json, read_settings

FIX = "do the fix"


def test_jsonl_names_the_line_of_bad_bytes_and_bad_json(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_bytes(b'{"a": 1}\n\n{"b": 2}\n')
    assert list(jsonl(f, FIX)) == [(1, {"a": 1}), (3, {"b": 2})]  # blank lines skipped, numbers kept
    f.write_bytes(b'{"a": 1}\n{"b": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{f}:2: not UTF-8 text (byte 0xe9); {FIX}")):
        list(jsonl(f, FIX))
    f.write_bytes(b'{"a": 1}\n{"a": 1}\n{"b": \n')
    with pytest.raises(ValueError, match=re.escape(f"{f}:3: not valid JSON (") + f".*; {FIX}"):
        list(jsonl(f, FIX))
    f.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{f}:1: JSON nested too deeply; {FIX}")):
        list(jsonl(f, FIX))


def test_read_json_names_the_line_and_the_wrong_type(tmp_path):
    f = tmp_path / "x.json"
    f.write_text('{\n  "a": 1,\n  "b": ]\n}')
    with pytest.raises(ValueError, match=re.escape(f"{f}:3: not valid JSON")):
        read_json(f, FIX)
    f.write_text("[1, 2]")
    with pytest.raises(ValueError, match=re.escape(f"{f}: holds a JSON list, not an object; {FIX}")):
        read_json(f, FIX)
    assert read_json(f, FIX, want=list) == [1, 2]


def test_settings_are_only_defaults(tmp_path):
    assert read_settings(tmp_path) == {}  # missing
    (tmp_path / "settings.json").write_bytes(b"\xff")
    assert read_settings(tmp_path) == {}  # unreadable: no defaults, no crash
    (tmp_path / "settings.json").write_text('{"block_size": 8}')
    assert read_settings(tmp_path) == {"block_size": 8}


def test_an_adapter_config_is_read_with_the_same_errors(tmp_path):
    (tmp_path / adapter.CONFIG).write_text('{"type": "gated-lora",')
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / adapter.CONFIG}:1: not valid JSON")):
        adapter.read_config(tmp_path)
    (tmp_path / adapter.CONFIG).write_text('{"type": "gated-lora", "base": "b", "rank": 4}')
    with pytest.raises(ValueError, match="missing alpha, mask_id; save the run again with train.py"):
        adapter.read_config(tmp_path)


def test_the_utf8_error_is_written_once():
    # Every module that reads user text goes through files.py: no other file spells the message.
    from pathlib import Path
    root = Path(files.__file__).parent
    spelled = [p.name for p in [*root.glob("*.py"), *root.glob("tools/*.py")] if "not UTF-8 text" in p.read_text()]
    assert spelled == ["files.py"]


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/outside.safetensors",
                                   "sub/../../outside.safetensors"])
def test_a_checkpoint_index_names_only_its_own_files(tmp_path, shard):
    # A file name in the checkpoint's folder, never a path out of it. A link in the folder is one of its
    # files: the Hugging Face cache links every file of a snapshot to its blob.
    from safetensors.torch import save_file

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"lm_head.weight": torch.zeros(2, 2)}, tmp_path / "outside.safetensors")
    (ckpt / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    index = ckpt / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": shard}}))
    with pytest.raises(ValueError, match=re.escape(f"{index}: shard {shard!r} lies outside the checkpoint")):
        files.checkpoint_files(ckpt)
    save_file({"lm_head.weight": torch.zeros(2, 2)}, ckpt / "own.safetensors")
    for own in ("own.safetensors", "link.safetensors"):
        index.write_text(json.dumps({"weight_map": {"lm_head.weight": own}}))
        assert files.checkpoint_files(ckpt) == {ckpt / own: ["lm_head.weight"]}


def test_a_bom_is_accepted_and_a_line_too_long_is_skipped_unread(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"a": 1}\n' + b'{"b": "' + b"x" * (1 << 20) + b'"}\n{"c": 3}')
    assert list(jsonl(f, FIX, max_bytes=1000)) == [(1, {"a": 1}), (2, files.TOO_LONG), (3, {"c": 3})]
    j = tmp_path / "x.json"
    j.write_bytes(b'\xef\xbb\xbf{"a": 1}')
    assert read_json(j, FIX) == {"a": 1}


def test_config_sizes_are_checked_before_a_tensor_is_built(tmp_path):
    from model import Config

    base = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}
    f = tmp_path / "config.json"
    f.write_text(json.dumps({**base, "num_hidden_layers": 1_000_000}))
    with pytest.raises(ValueError, match=re.escape(f"{f}: num_hidden_layers is 1000000, it must be at most 1024")):
        files.read_config(f, Config)
    f.write_text(json.dumps({**base, "hidden_size": 32768, "intermediate_size": 1 << 18, "num_hidden_layers": 1024,
                             "num_attention_heads": 256, "num_key_value_heads": 256}))
    with pytest.raises(ValueError, match=re.escape(f"{f}: these sizes make ") + r".*more than this machine's"):
        files.read_config(f, Config)
    f.write_text(json.dumps(base))
    assert files.read_config(f, Config)["num_hidden_layers"] == 2


def test_a_full_disk_while_writing_names_the_file_and_other_errors_pass(tmp_path):
    import errno

    with pytest.raises(OSError, match=re.escape(f"no space left on {tmp_path} to write x.json: {FIX}")) as e:
        with files.writing(tmp_path / "x.json", FIX):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert e.value.__cause__.errno == errno.ENOSPC
    with pytest.raises(PermissionError):  # not a full disk: raised as it was
        with files.writing(tmp_path / "x.json", FIX):
            raise PermissionError(errno.EACCES, "Permission denied")
    if os.path.exists("/dev/full"):  # the kernel's own full device, where the container has it
        with pytest.raises(OSError, match="no space left on /dev to write full"):
            with files.writing("/dev/full"), open("/dev/full", "w") as f:
                f.write("x")
                f.flush()


def test_normal_modes_give_every_file_the_mode_of_a_new_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "model.safetensors").chmod(0o600)  # as safetensors writes it
    (tmp_path / "config.json").write_text("{}")
    umask = os.umask(0o027)
    try:
        files.normal_modes(tmp_path)
    finally:
        os.umask(umask)
    assert {f.name: f.stat().st_mode & 0o777 for f in tmp_path.iterdir()} == {"model.safetensors": 0o640,
                                                                            "config.json": 0o640}
