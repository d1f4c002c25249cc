# hub.py: --ckpt and --init take a directory, an alias or a hub id, resolved by one function; the
# hub is never reached here: the download function is replaced by one that serves a local folder.
import json
import random

import huggingface_hub
import pytest

import generate
from conftest import tiny_checkpoint
from mars import hub
from mars.examples import load_conversations


@pytest.fixture
def snapshot(tmp_path):
    # A tiny checkpoint in a folder that stands for the hub cache's snapshot of any repository.
    tiny_checkpoint(tmp_path / "snapshot")
    return tmp_path / "snapshot"


@pytest.fixture
def fake_hub(monkeypatch, snapshot):
    # Replaces the one download call; returns the list of (repo_id, repo_type, patterns) it was asked for.
    calls = []

    def snapshot_download(repo_id, repo_type=None, allow_patterns=None, **_):
        calls.append((repo_id, repo_type, allow_patterns))
        return str(snapshot)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_alias_hub_id_and_directory(fake_hub, snapshot):
    assert hub.resolve_checkpoint(str(snapshot)) == snapshot and fake_hub == []  # a directory: no download
    assert hub.resolve_checkpoint("qwen2.5-0.5b") == snapshot
    assert hub.resolve_checkpoint("QWEN2.5-7B") == snapshot
    assert hub.resolve_checkpoint("Xalphinions/MARS-Qwen2.5-0.5B-blk4") == snapshot
    assert [c[0] for c in fake_hub] == ["Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct",
                                        "Xalphinions/MARS-Qwen2.5-0.5B-blk4"]
    patterns = fake_hub[0][2]
    assert fake_hub[0][1] == "model" and {"*.json", "*.safetensors", "*.txt"} <= set(patterns)
    assert "*.bin" not in patterns  # no second copy of the weights


def test_generate_takes_a_hub_id(fake_hub, snapshot, capsys):
    argv = ["--prompt", "hi", "--max-new-tokens", "6", "--json", "--device", "cpu"]
    generate.main(["--ckpt", str(snapshot), *argv])
    local = capsys.readouterr().out.splitlines()[0]
    generate.main(["--ckpt", "qwen2.5-0.5b", *argv])
    assert capsys.readouterr().out.splitlines()[0] == local
    assert [c[0] for c in fake_hub] == ["Qwen/Qwen2.5-0.5B-Instruct"]


def test_tools_take_a_hub_id(fake_hub, capsys):
    from tools import bench

    bench.main(["--ckpt", "owner/model", "--reps", "1", "--batch-sizes", "1", "--thresholds", "0.9",
                "--max-new-tokens", "4", "--no-hf", "--device", "cpu"])
    assert "| 1 | AR + KV cache |" in capsys.readouterr().out
    assert [c[0] for c in fake_hub] == ["owner/model"]


def test_train_init_takes_an_alias(fake_hub, tmp_path):
    import train

    chat = [{"role": "user", "content": "add 2 3"}, {"role": "assistant", "content": "5"}]
    (tmp_path / "d.jsonl").write_text((json.dumps({"messages": chat}) + "\n") * 4)
    train.main(["--init", "qwen2.5-0.5b", "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "run"),
                "--device", "cpu", "--batch-size", "2", "--global-batch", "2", "--max-steps", "1",
                "--eval-every", "0", "--save-every", "0"])
    assert [c[0] for c in fake_hub] == ["Qwen/Qwen2.5-0.5B-Instruct"]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["hidden_size"] == 32  # the snapshot's model


def test_eval_takes_a_hub_id_for_model_and_data(fake_hub, snapshot, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mars import eval as evaluation
    from mars.tasks import make_example

    (tmp_path / "demo.jsonl").write_text(json.dumps(make_example("arithmetic", random.Random(0))) + "\n")
    evaluation.main(["--ckpt", "qwen2.5-0.5b", "--task", "demo", "--data", str(tmp_path / "demo.jsonl"),
                     "--modes", "ar", "--max-new-tokens", "4", "--device", "cpu", "--out", str(tmp_path / "x.json")])
    assert [c[0] for c in fake_hub] == ["Qwen/Qwen2.5-0.5B-Instruct"]
    assert json.loads((tmp_path / "x.json").read_text())  # it ran to its summary
    # GSM8K from the hub: the test split's parquet, fetched by the same download function
    (snapshot / "main").mkdir()
    row = {"question": "1 + 1?", "answer": "#### 2"}
    pq.write_table(pa.Table.from_pylist([row]), snapshot / "main" / "test-0.parquet")
    assert evaluation.gsm8k_rows("openai/gsm8k") == [row]
    assert fake_hub[-1] == ("openai/gsm8k", "dataset", ["main/test-*"])


def test_offline_is_one_line(monkeypatch, tmp_path, capsys):
    # The real download function, offline, with an empty cache.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        generate.main(["--ckpt", "qwen2.5-7b", "--prompt", "hi"])
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("error: --ckpt qwen2.5-7b: not a local directory, and downloading "
                              "Qwen/Qwen2.5-7B-Instruct from the Hugging Face hub failed (")
    assert message.endswith("Offline? Download it where you are online (hf download Qwen/Qwen2.5-7B-Instruct) "
                            "and pass its directory: --ckpt PATH")


def test_a_cached_snapshot_without_weights_says_so(monkeypatch, tmp_path):
    # Offline, the hub's cache can hand back a snapshot of the configs alone (a tokenizer fetched before), or
    # some shards of a sharded model: said as a partial download, not as a folder to convert.
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **kw: str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="lacks [*].safetensors weights: a partial download"):
        hub.resolve_checkpoint("qwen2.5-0.5b")
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"")
    assert hub.resolve_checkpoint("qwen2.5-0.5b") == tmp_path
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    (tmp_path / "model.safetensors").write_bytes(b"")  # whole weights beside an earlier save's index: they are read
    assert hub.resolve_checkpoint("qwen2.5-0.5b") == tmp_path
    for f in tmp_path.glob("model*"):
        f.unlink()
    with pytest.raises(FileNotFoundError) as e:
        hub.resolve_checkpoint("qwen2.5-0.5b")
    assert str(e.value) == (f"--ckpt qwen2.5-0.5b: the cached copy of Qwen/Qwen2.5-0.5B-Instruct ({tmp_path}) lacks "
                            "*.safetensors weights: a partial download, which offline cannot complete (or a "
                            "repository of .bin weights only, which this code does not read). Download it where you "
                            "are online (hf download Qwen/Qwen2.5-0.5B-Instruct) and pass its directory: --ckpt PATH")


def test_an_adapters_base_offline_says_where_to_set_it(monkeypatch, tmp_path):
    import huggingface_hub.constants

    from mars import adapter, checkpoint

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    (tmp_path / "ad").mkdir()
    (tmp_path / "ad" / adapter.CONFIG).write_text(json.dumps({"type": "gated-lora", "base": "qwen2.5-0.5b", "rank": 4,
                                                              "alpha": 8, "mask_id": 151665}))
    with pytest.raises(FileNotFoundError) as e:
        checkpoint.adapter_base(tmp_path / "ad")
    config = tmp_path / "ad" / adapter.CONFIG
    assert str(e.value).endswith(f"Offline? Download it where you are online (hf download Qwen/Qwen2.5-0.5B-Instruct) "
                                 f"and set \"base\" in {config} to its directory"), str(e.value)


def test_not_a_directory_alias_or_id(tmp_path):
    with pytest.raises(FileNotFoundError, match="--ckpt a/b/c: checkpoint directory not found, and not an alias "
                                                r"\(qwen2.5-0.5b, qwen2.5-7b\) or a hub id"):
        hub.resolve_checkpoint("a/b/c")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="config.json is a file: pass the checkpoint directory"):
        hub.resolve_checkpoint(str(tmp_path / "config.json"))


def test_datasets_download_through_the_same_function(monkeypatch, tmp_path):
    calls = []
    (tmp_path / "train.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                                                   {"role": "assistant", "content": "a"}]}) + "\n")
    (tmp_path / "test.jsonl").write_text("not read\n")

    def snapshot_download(repo_id, repo_type=None, allow_patterns=None, **_):
        calls.append((repo_id, repo_type))
        return str(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert load_conversations("allenai/Dolci-Instruct-SFT") == [[{"role": "user", "content": "q"},
                                                                 {"role": "assistant", "content": "a"}]]
    assert calls == [("allenai/Dolci-Instruct-SFT", "dataset")]


def test_a_mistyped_local_path_is_not_found_and_never_downloaded(fake_hub, snapshot, tmp_path, monkeypatch):
    # runs/ is a folder here, so runs/nope is a path with a typo, not a hub id: generate, serve and eval say
    # "not found" and name it, offline, with no download tried. So does a path that starts with ./ or /. An
    # owner/name with no folder `owner` here is still a hub id.
    import huggingface_hub.constants

    from mars import eval as evaluation
    from mars import serve

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "quickstart").mkdir(parents=True)
    cases = [("runs/nope", ""), ("runs/quickstrt", " (did you mean runs/quickstart?)"), ("./nope", ""),
             ("runs/gone/mars", " (runs/gone does not exist)"), (str(tmp_path / "gone" / "x"),
                                                                 f" ({tmp_path / 'gone'} does not exist)")]
    for main, flags in ((generate.main, ["--prompt", "hi"]), (serve.main, ["--port", "0"]),
                        (evaluation.main, ["--task", "demo"])):
        for spec, hint in cases:
            with pytest.raises(SystemExit) as e:
                main(["--ckpt", spec, *flags])
            assert str(e.value).startswith(f"error: --ckpt {spec}: checkpoint directory not found{hint}; pass the "
                                           "folder train.py wrote"), (main, str(e.value))
            assert "download" not in str(e.value) and "Offline" not in str(e.value)
    assert fake_hub == []
    assert hub.resolve_checkpoint("owner/model") == snapshot and [c[0] for c in fake_hub] == ["owner/model"]
