# Reading what users and checkpoints hand the project: UTF-8 text, JSON, JSON Lines, a checkpoint's
# config.json and its safetensors files; and a full disk while writing. Each error is written here once
# and names the file, the line where there is one, and the fix (the caller supplies the fix: "save the
# file as UTF-8", "restore the file from the original checkpoint"). Below every other module: it imports
# none of them.
from __future__ import annotations

import codecs
import errno
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import MISSING, fields
from pathlib import Path

CONFIG_FIX = "restore the file from the original checkpoint"
WEIGHT_FILE = r"model\.safetensors|model-\d+-of-\d+\.safetensors"  # a save's weights, one file or shards


def is_weight_file(name: str) -> bool:  # as transformers names them; never a user's model_ema.safetensors
    return re.fullmatch(WEIGHT_FILE, name) is not None
TOO_LONG = object()  # what jsonl() yields for a line longer than its max_bytes, which it never holds whole


@contextmanager
def writing(file: str | Path, fix: str = "free some space or choose another --out") -> Iterator[None]:
    # A full disk while writing `file` is one line naming the folder, the file and the fix, where Python
    # alone gives "[Errno 28] No space left on device" and no file name.
    try:
        yield
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise OSError(f"no space left on {Path(file).parent} to write {Path(file).name}: {fix}") from e


def write_atomic(path: Path, text: str) -> None:
    # Written beside the target, then renamed over it: a killed run never leaves half a file.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def normal_modes(folder: Path) -> None:
    # Every file in `folder` gets the mode open() gives a new file, 0o666 less the umask, as the rest of
    # a checkpoint has it: safetensors writes its files 0600, which the other users of a shared run
    # could not read. The umask is read off a new file: os.umask reads it only by setting it, for every
    # thread at once.
    probe = folder / ".mode-probe"
    probe.touch()
    mode = probe.stat().st_mode & 0o777
    probe.unlink()
    for file in folder.iterdir():
        if file.is_file() and not file.is_symlink():
            file.chmod(mode)


def utf8(raw: bytes, file: str | Path, fix: str, first_line: int = 1) -> str:
    # Decoded text, or an error naming the line of the first bad byte. first_line: the line `raw`
    # starts at, for a file read line by line.
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + raw[:e.start].count(b"\n")
        raise ValueError(f"{file}:{line}: not UTF-8 text (byte {raw[e.start]:#04x}); {fix}") from e


def read_text(file: str | Path, fix: str) -> str:
    # A UTF-8 byte order mark (Windows editors write one) is no part of the text.
    return utf8(Path(file).read_bytes().removeprefix(codecs.BOM_UTF8), file, fix)


def parse_json(text: str, file: str | Path, fix: str, line: int | None = None):
    # line: the file's line that `text` is (JSON Lines); else the error's own line is named.
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}:{line or e.lineno}: not valid JSON ({e.msg}, column {e.colno}); {fix}") from e
    except RecursionError as e:
        raise ValueError(f"{file}{f':{line}' if line else ''}: JSON nested too deeply; {fix}") from e


def read_json(file: str | Path, fix: str, want: type = dict):
    # The file's JSON value, which must be a `want` (an object by default).
    value = parse_json(read_text(file, fix), file, fix)
    if not isinstance(value, want):
        expected = "an object" if want is dict else "a list"
        raise ValueError(f"{file}: holds a JSON {type(value).__name__}, not {expected}; {fix}")
    return value


def jsonl(file: str | Path, fix: str, max_bytes: int | None = None) -> Iterator[tuple[int, object]]:
    # (line number, value) for every non-blank line, streamed: a large data set is never read whole. A
    # line over max_bytes gives (n, TOO_LONG): it is skipped to its newline in bounded reads, never held.
    with open(file, "rb") as f:
        n = 0
        while raw := f.readline(-1 if max_bytes is None else max_bytes + 1):
            n += 1
            if max_bytes is not None and len(raw) > max_bytes and not raw.endswith(b"\n"):
                while (rest := f.readline(1 << 16)) and not rest.endswith(b"\n"):
                    pass
                yield n, TOO_LONG
                continue
            line = utf8(raw.removeprefix(codecs.BOM_UTF8) if n == 1 else raw, file, fix, n)
            if line.strip():
                yield n, parse_json(line, file, fix, n)


def read_settings(path: str | Path) -> dict:
    # A run's settings.json (train.py writes it), or {} where there is none or it cannot be read: it
    # only ever supplies defaults.
    try:
        return read_json(Path(path) / "settings.json", "")
    except (OSError, ValueError):
        return {}


# ---- a checkpoint's config.json ----

def config_kwargs(d: dict, cls: type, source: str) -> dict:
    # A config.json's object -> the keyword arguments of the dataclass `cls` (model.Config), checked.
    # Refuses what the model does not implement instead of silently computing other logits.
    if d.get("model_type") is not None and str(d["model_type"]).lower() != "qwen2":  # transformers' Qwen2 takes these
        raise ValueError(f"{source}: model_type {json.dumps(d['model_type'])[:40]} is "
                         "not supported: this code runs Qwen2 / Qwen2.5 causal LMs (model_type \"qwen2\", "
                         "Qwen2ForCausalLM) only")
    if d.get("quantization_config") is not None:
        method = d["quantization_config"].get("quant_method") if isinstance(d["quantization_config"], dict) else None
        raise ValueError(f"{source}: a quantized checkpoint ({method or 'quantization_config'}) is not supported; "
                         "pass the unquantized model (--quantize quantizes it here)")
    if d.get("hidden_act", "silu") not in ("silu", "swish"):  # one function, two names
        raise ValueError(f"{source}: hidden_act {json.dumps(d['hidden_act'])} is not supported (Qwen2 uses silu); "
                         f"{CONFIG_FIX}")
    if d.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window=true is not supported (every Qwen2.5 "
                         "config has it off); set it to false")
    for name in ("rope_parameters", "rope_scaling"):
        if d.get(name) is not None and not isinstance(d[name], dict):
            raise ValueError(f"{source}: {name} is {json.dumps(d[name])[:60]}, not an object; {CONFIG_FIX}")
    rope = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type")) or rope.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"{source}: rope scaling '{rope_type}' is not supported; remove "
                         "rope_scaling to use plain RoPE")
    # transformers 5.x writes rope_parameters.rope_theta and dtype; 4.x rope_theta and torch_dtype.
    d = dict(d)
    if "rope_theta" in d and "rope_theta" in rope and d["rope_theta"] != rope["rope_theta"]:
        raise ValueError(f"{source}: rope_theta {d['rope_theta']} and rope_parameters.rope_theta "
                         f"{rope['rope_theta']} disagree; keep the one the model was trained with")
    if "rope_theta" not in d and "rope_theta" in rope:
        d["rope_theta"] = rope["rope_theta"]
    # What transformers' Qwen2Config assumes when a file leaves them out (Qwen2.5's files give both).
    d.setdefault("rope_theta", 10000.0)
    d.setdefault("tie_word_embeddings", False)
    if "torch_dtype" not in d and "dtype" in d:
        d["torch_dtype"] = d["dtype"]
    if d.get("head_dim") is None:
        d.pop("head_dim", None)
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in d]
    if missing:
        raise ValueError(f"{source}: missing field(s) {', '.join(missing)}")
    d = {k: v for k, v in d.items() if k in {f.name for f in fields(cls)}}
    check_fields(d, source)
    return d


def check_fields(d: dict, source: str) -> None:
    # A config.json is user input: a "128" string or a 0 head count would otherwise surface as a
    # TypeError or ZeroDivisionError deep inside the model. type(), not isinstance: True is no count.
    def bad(name: str, want: str) -> ValueError:
        return ValueError(f"{source}: {name} is {json.dumps(d[name])[:40]}, it must be {want}; fix it "
                          f"or {CONFIG_FIX}")

    counts = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings")
    for name in counts:
        if name in d and (type(d[name]) is not int or d[name] < 1):
            raise bad(name, "a positive integer")
    if "head_dim" in d and (type(d["head_dim"]) is not int or d["head_dim"] < 0 or d["head_dim"] % 2):
        raise bad("head_dim", "an even integer (RoPE rotates pairs; 0 = hidden_size / num_attention_heads)")
    for name in ("rms_norm_eps", "rope_theta"):
        if name in d and (type(d[name]) not in (int, float) or not 0 < d[name] < float("inf")):
            raise bad(name, "a positive number")
    if "tie_word_embeddings" in d and type(d["tie_word_embeddings"]) is not bool:
        raise bad("tie_word_embeddings", "true or false")
    if "torch_dtype" in d and not isinstance(d["torch_dtype"], str):
        raise bad("torch_dtype", "a string such as bfloat16 or float32")
    for name in ("bos_token_id", "eos_token_id"):  # Hugging Face also allows a list of ids
        v = d.get(name)
        ids = v if isinstance(v, list) else [v]
        if not all(i is None or type(i) is int and i >= 0 for i in ids):
            raise bad(name, "a token id, a list of them, or null")
    for name, most in MAX_SIZES.items():
        if name in d and d[name] > most:
            raise bad(name, f"at most {most} (no Qwen2 checkpoint comes near)")
    heads, kv = d["num_attention_heads"], d["num_key_value_heads"]
    if heads % kv:
        raise bad("num_key_value_heads", f"a divisor of num_attention_heads ({heads})")
    if not d.get("head_dim") and (d["hidden_size"] % heads or d["hidden_size"] // heads % 2):
        raise bad("hidden_size", f"a multiple of num_attention_heads ({heads}) with an even quotient, "
                  "or head_dim must be given")


# Bounds on config.json's sizes, far above every Qwen2 (80 layers, hidden 8192, vocab 152k): a corrupted or
# hostile file is refused before a module is built, not after minutes and gigabytes.
MAX_SIZES = {"num_hidden_layers": 1024, "hidden_size": 1 << 16, "intermediate_size": 1 << 18,
             "num_attention_heads": 1024, "num_key_value_heads": 1024, "vocab_size": 1 << 23, "head_dim": 1024,
             "max_position_embeddings": 1 << 24}


def parameter_count(d: dict) -> int:
    # The parameters a checked config builds: embeddings (twice when untied), and per layer the attention
    # (q, k, v with biases, o), the MLP (gate, up, down) and two norms.
    h, layers, vocab = d["hidden_size"], d["num_hidden_layers"], d["vocab_size"]
    hd = d.get("head_dim") or h // d["num_attention_heads"]
    q, kv = d["num_attention_heads"] * hd, d["num_key_value_heads"] * hd
    attention = h * q + q + 2 * (h * kv + kv) + q * h
    per_layer = attention + 3 * h * d["intermediate_size"] + 2 * h
    return vocab * h * (1 if d.get("tie_word_embeddings") else 2) + layers * per_layer + h


def memory_bytes() -> int:
    # This machine's RAM plus its GPUs' memory: no model larger than that can be built here.
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    import torch

    if torch.cuda.is_available():
        total += sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return total


def check_size(d: dict, source: str) -> None:
    # At 2 bytes a parameter (bfloat16, the smallest dtype we build in), the model must fit this machine.
    n, have = parameter_count(d), memory_bytes()
    if 2 * n > have:
        raise ValueError(f"{source}: these sizes make {n / 1e9:.1f}B parameters, {2 * n / 2**30:.0f} GiB in "
                         f"bfloat16, more than this machine's {have / 2**30:.0f} GiB of memory; fix "
                         f"num_hidden_layers, hidden_size, intermediate_size or vocab_size, or {CONFIG_FIX}")


def read_config(file: str | Path, cls: type) -> dict:
    # config.json -> checked keyword arguments for `cls` (model.Config).
    file = Path(file)
    if not file.is_file():
        raise FileNotFoundError(f"{file}: config.json not found; a checkpoint directory holds "
                                "config.json plus model.safetensors (or shards and an index)")
    kwargs = config_kwargs(read_json(file, CONFIG_FIX), cls, str(file))
    check_size(kwargs, str(file))
    return kwargs


# ---- a checkpoint's safetensors files ----

def open_safetensors(file: Path):
    # safe_open, with a truncated or corrupted file (a cut download, random bytes) named in a ValueError.
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(file, framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e}); it is truncated or corrupted: "
                         "download or copy it again") from e


def checkpoint_files(path: Path) -> dict[Path, list[str]]:
    # {safetensors file: tensor names in it}, from the index when sharded.
    index, single = path / "model.safetensors.index.json", path / "model.safetensors"
    if index.is_file() and not single.is_file():  # transformers reads model.safetensors first, as here: an
        # index left beside it by an earlier sharded save (transformers' save_pretrained keeps it) is stale
        fix = "it needs a 'weight_map' object of tensor name -> file name; " + CONFIG_FIX
        weight_map = read_json(index, fix).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: corrupted index; {fix}")
        files: dict[Path, list[str]] = {}
        for name, file in weight_map.items():
            # A shard is a file of this checkpoint: never "../x" or an absolute path. It may be a link (the
            # Hugging Face cache links each file of a snapshot to its blob).
            if Path(file).is_absolute() or ".." in Path(file).parts:
                raise ValueError(f"{index}: shard {file!r} lies outside the checkpoint {path}; a shard is a file "
                                 f"name in the checkpoint's own folder: {CONFIG_FIX}")
            files.setdefault(path / file, []).append(name)
        if missing := next((file for file in files if not file.is_file()), None):  # first: a partial download
            raise FileNotFoundError(f"{index}: shard {missing.name} is listed but missing")
        for file, names in files.items():
            with open_safetensors(file) as f:
                held = set(f.keys())
                if lost := next((name for name in names if name not in held), None):
                    raise ValueError(f"{index}: names {file.name} for tensor '{lost}', which that shard does not "
                                     f"hold: the index and the shards are of different saves; {CONFIG_FIX}")
        return files
    if not single.is_file():
        shards = sorted(p.name for p in path.glob("model-*.safetensors"))
        raise FileNotFoundError(f"{path}: shards ({', '.join(shards[:2])}{', ...' * (len(shards) > 2)}) but no "
                                "model.safetensors.index.json, which says where each tensor is: copy it from where "
                                "the shards came from" if shards else
                                f"{path}: no model.safetensors or model.safetensors.index.json; "
                                "convert .bin checkpoints to safetensors first")
    with open_safetensors(single) as f:
        return {single: list(f.keys())}
