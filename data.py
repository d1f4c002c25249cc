import base64
import json
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tiktoken
import torch

# ---- tokenizer ----
# Qwen2's byte-level BPE run by tiktoken (QWEN2.md §3). The Hugging Face files are only read and
# written here; tiktoken's rank-based BPE gives the same ids because merge i creates token 256+i.

# Qwen2's pre-tokenizer: digits split one at a time.
PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
MASK = "<|mask|>"  # the MARS mask token (MARS.md §2), added after every existing token
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# A bare *.tiktoken file has no special tokens: these are Qwen2.5's, in id order after the ranks.
QWEN25_SPECIALS = CHATML + [
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
    "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
    "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def chat_template(default_system: str | None) -> str:
    # The Jinja twin of encode_chat, saved so transformers' apply_chat_template renders the same ids.
    system = ("{%- if messages[0]['role'] != 'system' %}"
              "{{- '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' }}"
              "{%- endif %}") if default_system is not None else ""
    return (system + "{%- for message in messages %}"
            "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's map: printable bytes stand for themselves, the other 68 are shifted to chr(256+n), so
    # every vocabulary string is printable. tokenizer.json / vocab.json are written in it.
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def _to_str(token: bytes) -> str:
    return "".join(BYTE_TO_CHAR[b] for b in token)


def _read_json(file: Path) -> dict:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}): re-download or re-save the tokenizer") from e


def _ranks_from_vocab(vocab: dict[str, int], file: Path) -> dict[bytes, int]:
    try:
        return {bytes(CHAR_TO_BYTE[c] for c in s): i for s, i in vocab.items()}
    except KeyError as e:
        raise ValueError(f"{file}: vocabulary entry uses {e} outside the GPT-2 byte alphabet: "
                         "only byte-level BPE tokenizers (Qwen2 style) are supported") from e


def _added_from_config(folder: Path) -> tuple[dict[str, int], set[str]] | None:
    file = folder / "tokenizer_config.json"
    if not file.exists():
        return None
    try:
        entries = _read_json(file).get("added_tokens_decoder", {})
        added = {t["content"]: int(i) for i, t in entries.items()}
        return added, {t["content"] for t in entries.values() if not t.get("special", True)}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{file}: bad added_tokens_decoder ({e!r}): "
                         "re-download or re-save the tokenizer") from e


def _load_tokenizer_json(file: Path):
    t = _read_json(file)
    try:
        model, entries = t["model"], t.get("added_tokens") or []
        if model.get("type", "BPE") != "BPE":
            raise ValueError(f"{file} holds a {model['type']} model: only byte-level BPE is supported")
        added = {e["content"]: e["id"] for e in entries}
        nonspecial = {e["content"] for e in entries if not e.get("special", True)}
        # merges are "a b" strings in older files and [a, b] pairs in newer ones
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        ranks = _ranks_from_vocab(model["vocab"], file)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{file} is not a BPE tokenizer.json (bad or missing {e}): "
                         "re-download or re-save the tokenizer") from e
    if json.dumps(PAT) not in json.dumps(t.get("pre_tokenizer")):
        raise ValueError(f"{file}: pre-tokenizer is not Qwen2's regex, so ids would differ from the "
                         "model's training: only Qwen2-style tokenizers are supported")
    return ranks, added, nonspecial, merges


def _load_vocab_merges(folder: Path):
    vocab = _read_json(folder / "vocab.json")
    lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
    added, nonspecial = _added_from_config(folder) or (_default_specials(len(vocab)), set())
    return _ranks_from_vocab(vocab, folder / "vocab.json"), added, nonspecial, merges


def _load_tiktoken(file: Path, folder: Path):
    ranks = {}
    for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{file}:{n}: expected '<base64 token> <rank>', got {line[:60]!r}") from e
    added, nonspecial = _added_from_config(folder) or (_default_specials(max(ranks.values()) + 1), set())
    return ranks, added, nonspecial, None


def _default_specials(first_id: int) -> dict[str, int]:
    return {s: first_id + i for i, s in enumerate(QWEN25_SPECIALS)}


def _bpe(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    # tiktoken's BPE on one token, using only merges ranked below max_rank
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        pairs = [(ranks.get(a + b, max_rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank >= max_rank:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def _merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[str, str]]:
    # The standard tiktoken -> HF conversion: token r is the merge of the two parts that BPE with
    # ranks < r leaves of its bytes. Merges sorted by rank reproduce tiktoken in HF's merge-based BPE.
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            a, b = _bpe(ranks, token, rank)
            merges.append((_to_str(a), _to_str(b)))
    return merges


def _check_messages(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, "
                         f"got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be a dict with a str 'content', got {m!r:.80}")
        if m.get("role") not in ("system", "user", "assistant"):
            raise ValueError(f"messages[{i}] has role {m.get('role')!r}: "
                             "expected 'system', 'user' or 'assistant'")


class Tokenizer:
    def __init__(self, ranks: dict[bytes, int], special: dict[str, int],
                 merges: list[tuple[str, str]] | None = None, nonspecial: Iterable[str] = (),
                 default_system: str | None = DEFAULT_SYSTEM):
        special = dict(special)
        # MARS.md §2: the mask takes the first free id, unless the files already have it (our own save)
        special.setdefault(MASK, max(*ranks.values(), *special.values()) + 1)
        self.ranks, self.special = ranks, special  # special: every added token, the mask included
        self._merges = merges  # kept from the source files, so a save writes them back unchanged
        self._nonspecial = set(nonspecial)  # added tokens HF marks "special": false (<tool_call>, ...)
        # Rendered first when a chat has no system message; None renders no system block at all.
        self.default_system = default_system
        self._enc = tiktoken.Encoding("qwen2", pat_str=PAT, mergeable_ranks=ranks, special_tokens=special)
        self.eos_id = special["<|im_end|>"]
        self.pad_id = special["<|endoftext|>"]
        self.im_start_id = special["<|im_start|>"]
        self.mask_id = special[MASK]
        self.stop_ids = frozenset({self.eos_id, self.pad_id})
        self.vocab_size = self._enc.max_token_value + 1  # = mask_id + 1; the model may have spare rows

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Tokenizer":
        # path: a checkpoint directory, or one *.tiktoken file
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"tokenizer path {path} does not exist")
        if path.is_file() and path.suffix != ".tiktoken":
            raise ValueError(f"{path} is a file: pass its directory, or a *.tiktoken file")
        folder = path if path.is_dir() else path.parent
        tiktokens = [path] if path.is_file() else sorted(path.glob("*.tiktoken"))
        if path.is_dir() and (path / "tokenizer.json").exists():
            ranks, special, nonspecial, merges = _load_tokenizer_json(path / "tokenizer.json")
        elif path.is_dir() and (path / "vocab.json").exists() and (path / "merges.txt").exists():
            ranks, special, nonspecial, merges = _load_vocab_merges(path)
        elif len(tiktokens) == 1:
            ranks, special, nonspecial, merges = _load_tiktoken(tiktokens[0], folder)
        elif tiktokens:
            raise ValueError(f"several *.tiktoken files in {path} ({', '.join(t.name for t in tiktokens)}): "
                             "pass the path of the one to use")
        else:
            raise FileNotFoundError(f"no tokenizer files in {path}: expected tokenizer.json, "
                                    "vocab.json+merges.txt or *.tiktoken")
        missing = [s for s in CHATML if s not in special]
        if missing:
            raise ValueError(f"tokenizer in {path} has no {', '.join(missing)}: the chat format needs "
                             "Qwen2's ChatML special tokens")
        # Our saves record their default system prompt; Qwen's own files imply Qwen's.
        config = folder / "tokenizer_config.json"
        default_system = DEFAULT_SYSTEM
        if config.exists():
            default_system = _read_json(config).get("default_system", DEFAULT_SYSTEM)
        return cls(ranks, special, merges, nonspecial, default_system)

    @classmethod
    def byte_level(cls) -> "Tokenizer":
        # For the tiny CPU demo model: one token per byte (no merges), ChatML specials, then the mask.
        # No default system prompt: Qwen's would be ~70 bytes of every byte-level example.
        return cls({bytes([b]): b for b in range(256)}, {s: 256 + i for i, s in enumerate(CHATML)},
                   merges=[], default_system=None)

    def encode(self, text: str) -> list[int]:
        # NFC first, as HF's normalizer does. encode_ordinary never emits special ids, so a
        # "<|im_end|>" typed by a user stays plain text (QWEN2.md §3).
        return self._enc.encode_ordinary(unicodedata.normalize("NFC", text))

    def decode(self, ids: list[int]) -> str:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the tokenizer's {self.vocab_size} ids: "
                             "mask the model's logits beyond vocab_size before sampling")
        return self._enc.decode(ids, errors="replace")

    def encode_chat_with_mask(self, messages: list[dict], *, add_generation_prompt: bool = False,
                              last_turn_only: bool = False) -> tuple[list[int], list[bool]]:
        # Qwen2.5 ChatML (QWEN2.md §3). supervised[i] marks the training targets of MARS.md §1: the
        # assistant content, its <|im_end|> and the "\n" after it.
        _check_messages(messages)
        if messages[0]["role"] != "system" and self.default_system is not None:
            messages = [{"role": "system", "content": self.default_system}, *messages]
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        ids, supervised, newline = [], [], self.encode("\n")
        for i, m in enumerate(messages):
            # Encode the text between two specials in one go, as HF does on the rendered string.
            header = self.encode(m["role"] + "\n")
            body = self.encode(m["role"] + "\n" + m["content"])
            # Content starting with a newline can merge with the header's "\n": that token is supervised.
            n = next((k for k, (a, b) in enumerate(zip(header, body)) if a != b), len(header))
            sup = m["role"] == "assistant" and (i == last or not last_turn_only)
            ids += [self.im_start_id, *body, self.eos_id, *newline]
            supervised += [False] * (1 + n) + [sup] * (len(body) - n + 1 + len(newline))
        if add_generation_prompt:
            prompt = [self.im_start_id, *self.encode("assistant\n")]
            ids += prompt
            supervised += [False] * len(prompt)
        return ids, supervised

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        return self.encode_chat_with_mask(messages, add_generation_prompt=add_generation_prompt)[0]

    def save_pretrained(self, path: str | Path) -> None:
        # Writes what HF tokenizers and transformers' AutoTokenizer load: a Qwen2-style tokenizer.json
        # (merges reconstructed from the ranks when the source was a *.tiktoken) and tokenizer_config.json.
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        merges = self._merges if self._merges is not None else _merges_from_ranks(self.ranks)
        added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": s not in self._nonspecial}
                 for s, i in sorted(self.special.items(), key=lambda kv: kv[1])]
        # use_regex=False: the Split before it has already applied Qwen2's regex
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                      "use_regex": False}
        tokenizer_json = {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": PAT}, "behavior": "Isolated", "invert": False},
                byte_level]},
            "post_processor": byte_level, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                      "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False,
                      "vocab": {_to_str(t): i for t, i in sorted(self.ranks.items(), key=lambda kv: kv[1])},
                      "merges": [list(m) for m in merges]},
        }
        config = {
            "tokenizer_class": "Qwen2Tokenizer",
            "chat_template": chat_template(self.default_system), "default_system": self.default_system,
            "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None,
            "add_bos_token": False, "add_prefix_space": False, "clean_up_tokenization_spaces": False,
            "errors": "replace", "split_special_tokens": False,
            "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added},
        }
        tokenizer_text = json.dumps(tokenizer_json, ensure_ascii=False)  # compact: 150k merges
        (path / "tokenizer.json").write_text(tokenizer_text, encoding="utf-8")
        config_text = json.dumps(config, indent=2, ensure_ascii=False)
        (path / "tokenizer_config.json").write_text(config_text, encoding="utf-8")


# ---- data sets and the MARS batch ----
# Chat files in, (ids, supervised) examples out (MARS.md §1), then the two-stream batch with its
# block mask (MARS.md §2-3) and right-shifted labels (MARS.md §4).

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant"}
HF_DATASET_ID = re.compile(r"[\w.-]+/[\w.-]+")
IGNORE = -100  # label of a position with no supervised target (F.cross_entropy's ignore_index)


def to_messages(row: dict, where: str) -> list[dict]:
    # One data row -> [{"role", "content"}, ...]. Accepts chat ("messages"), ShareGPT
    # ("conversations" of {"from", "value"}) and Alpaca ("instruction", "input", "output").
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "messages" in row:
        messages = row["messages"]
    elif "conversations" in row:
        turns = row["conversations"]
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise ValueError(f"{where}: 'conversations' must be a list of {{'from', 'value'}} objects")
        for i, t in enumerate(turns):
            if t.get("from") not in SHAREGPT_ROLES:
                raise ValueError(f"{where}: conversations[{i}] has from={t.get('from')!r}; expected "
                                 f"one of {', '.join(SHAREGPT_ROLES)}")
        messages = [{"role": SHAREGPT_ROLES[t["from"]], "content": t.get("value")} for t in turns]
    elif "instruction" in row and "output" in row:
        prompt, extra = row["instruction"], row.get("input") or ""
        if not isinstance(prompt, str) or not isinstance(extra, str):
            raise ValueError(f"{where}: Alpaca 'instruction' and 'input' must be strings")
        user = f"{prompt}\n\n{extra}" if extra else prompt  # the Alpaca convention
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]
    else:
        raise ValueError(f"{where}: no 'messages' (chat), 'conversations' (ShareGPT) or "
                         f"'instruction' + 'output' (Alpaca) key; keys are {sorted(row)[:8]}")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: messages must be a non-empty list of {{'role', 'content'}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise ValueError(f"{where}: messages[{i}] has role {role!r}; expected system, user or "
                             "assistant (map other roles to these before training)")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: messages[{i}] content is {type(m.get('content')).__name__}, "
                             "expected a string")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _rows(file: Path):
    # Yields (where, row), where = "file:line" (JSONL), "file: entry i" (JSON array) or "file: row i".
    if file.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(f"{file}: reading parquet needs pyarrow, which is not installed; "
                              "pip install pyarrow, or convert the file to JSONL") from e
        for i, row in enumerate(pq.read_table(file).to_pylist()):
            yield f"{file}: row {i}", row
        return
    text = file.read_text(encoding="utf-8")
    if file.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})") from e
        for i, row in enumerate(rows):
            yield f"{file}: entry {i}", row
        return
    for n, line in enumerate(text.splitlines(), 1):  # JSONL: one object per line
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}:{n}: not valid JSON ({e.msg}, column {e.colno}); "
                             "each line must hold one JSON object") from e
        yield f"{file}:{n}", row


def _download_dataset(repo_id: str) -> list[Path]:
    from huggingface_hub import snapshot_download

    try:
        root = Path(snapshot_download(repo_id, repo_type="dataset",
                                      allow_patterns=["*.parquet", "*.jsonl"]))
    except Exception as e:  # offline, unknown id, gated, ...: the fix is the same
        raise FileNotFoundError(
            f"--data {repo_id}: not a local file, and downloading the Hugging Face dataset "
            f"failed ({type(e).__name__}). Offline? Pass a local .jsonl/.json/.parquet file "
            f"instead, e.g. one downloaded where you are online") from e
    files = sorted(p for p in root.rglob("*") if p.suffix in (".parquet", ".jsonl"))
    if not files:
        raise FileNotFoundError(f"--data {repo_id}: the dataset has no .parquet or .jsonl files")
    return _train_split(files)


def _train_split(files: list[Path]) -> list[Path]:
    # When some file names say "train", the others are test/validation splits: leave them out.
    return [p for p in files if "train" in p.name] or files


def load_conversations(spec: str) -> list[list[dict]]:
    # spec: a chat file (.jsonl, .json, .parquet), a folder of them (its *train* files when
    # some are named so), or a Hugging Face dataset id.
    path = Path(spec)
    if path.is_dir():
        files = _train_split(sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".json", ".parquet")))
    elif path.is_file():
        files = [path]
    elif HF_DATASET_ID.fullmatch(spec):
        files = _download_dataset(spec)
    else:
        raise FileNotFoundError(f"--data {spec}: no such file; pass a .jsonl/.json/.parquet chat "
                                "file or a Hugging Face dataset id such as allenai/Dolci-Instruct-SFT")
    if not files:
        raise FileNotFoundError(f"--data {spec}: the folder holds no .jsonl, .json or .parquet file")
    return [to_messages(row, where) for file in files for where, row in _rows(file)]


@dataclass
class Examples:
    # Tokenized examples stored back to back in flat arrays: a few bytes per token, not a Python
    # list per example (Dolci has ~2M examples).
    ids: np.ndarray  # (total,) int32 token ids
    sup: np.ndarray  # (total,) bool, True = supervised (MARS.md §1)
    offsets: np.ndarray  # (n + 1,) int64, example i is ids[offsets[i]:offsets[i + 1]]
    stats: dict = field(default_factory=dict)  # counts from encode_examples

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b], self.sup[a:b]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def encode_examples(tok, conversations: list[list[dict]], max_len: int, block_size: int,
                    last_turn_only: bool = False) -> Examples:
    # MARS.md §1. Every length is a multiple of B and at most max_len: we keep the first
    # floor(max_len / B) * B tokens (so block padding never pushes a sequence past max_len),
    # then pad with supervised EOS up to the next multiple of B.
    if max_len < block_size:
        raise ValueError(f"max_len={max_len} is shorter than one block (block_size={block_size})")
    cap = max_len - max_len % block_size
    ids_all, sup_all, offsets = [], [], [0]
    stats = dict(examples=len(conversations), kept=0, truncated=0, dropped_prompt_too_long=0,
                 dropped_no_assistant=0, eos_pad_tokens=0, tokens=0, supervised_tokens=0)
    for messages in conversations:
        ids, sup = tok.encode_chat_with_mask(messages, last_turn_only=last_turn_only)
        if not any(sup):
            stats["dropped_no_assistant"] += 1
            continue
        if len(ids) > cap:
            ids, sup = ids[:cap], sup[:cap]
            stats["truncated"] += 1
        # Position p is trained to predict x[p+1], so position 0 is never a target: an example
        # needs a supervised token at 1.. to contribute to the loss.
        if not any(sup[1:]):
            stats["dropped_prompt_too_long"] += 1
            continue
        pad = -len(ids) % block_size
        ids, sup = ids + [tok.eos_id] * pad, sup + [True] * pad  # learn to keep emitting EOS
        stats["eos_pad_tokens"] += pad
        ids_all.append(np.asarray(ids, np.int32))
        sup_all.append(np.asarray(sup, bool))
        offsets.append(offsets[-1] + len(ids))
    stats["kept"] = len(ids_all)
    stats["tokens"] = offsets[-1]
    stats["supervised_tokens"] = int(sum(s.sum() for s in sup_all))
    cat = lambda xs, dtype: np.concatenate(xs) if xs else np.zeros(0, dtype)  # noqa: E731
    return Examples(cat(ids_all, np.int32), cat(sup_all, bool), np.asarray(offsets, np.int64), stats)


def describe(stats: dict, name: str, max_len: int) -> str:
    return (f"{name}: {stats['examples']} examples, {stats['kept']} kept, "
            f"{stats['truncated']} truncated to max_len={max_len}, "
            f"{stats['dropped_prompt_too_long']} dropped (prompt alone fills max_len), "
            f"{stats['dropped_no_assistant']} dropped (no assistant turn); "
            f"{stats['tokens']} tokens, {stats['supervised_tokens']} supervised, "
            f"{stats['eos_pad_tokens']} of them EOS block padding")


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


@dataclass
class Batch:
    tokens: torch.Tensor  # (N, T) ids: L clean columns, then the noisy columns (mars mode)
    pos: torch.Tensor | None  # (N, T) RoPE positions; both streams count from 0 (MARS.md §2)
    mask: torch.Tensor | None  # (N, 1, T, T) bool, True = may attend; None = plain causal
    labels: torch.Tensor  # (N, T) the clean x[p+1] where that target is supervised, else IGNORE
    L: int  # columns < L are the clean stream, columns >= L the noisy one

    def to(self, device) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.tokens), move(self.pos), move(self.mask), move(self.labels), self.L)


def mars_mask(pos: torch.Tensor, noisy: torch.Tensor, valid: torch.Tensor, block_size: int) -> torch.Tensor:
    # The MARS.md §3 table, for any column layout. pos, noisy, valid: (N, T) per column: its
    # stream-local position, whether it is in the noisy stream, whether it is a real token.
    # Returns (N, 1, T, T) bool: [n, 0, i, j] = query i may attend to key j.
    pq, pk = pos[:, :, None], pos[:, None, :]  # (N, T, 1), (N, 1, T)
    bq, bk = pq // block_size, pk // block_size
    nq, nk = noisy[:, :, None], noisy[:, None, :]
    clean_clean = ~nq & ~nk & (pk <= pq)  # ordinary causal LM
    noisy_clean = nq & ~nk & (bk < bq)  # clean tokens of strictly earlier blocks
    noisy_noisy = nq & nk & (bk == bq) & (pk <= pq)  # own block, causal
    allowed = (clean_clean | noisy_clean | noisy_noisy) & valid[:, :, None] & valid[:, None, :]
    # Padding is hidden from every query; a pad query sees only itself so that its softmax row is
    # not empty (an all-False row makes SDPA return NaN, which then leaks through the values).
    eye = torch.eye(pos.shape[1], dtype=torch.bool, device=pos.device)
    return (allowed | eye)[:, None]


def make_batch(examples: list[tuple[np.ndarray, np.ndarray]], block_size: int, mask_id: int,
               pad_id: int, mode: str = "mars", prune: bool = True) -> Batch:
    # examples: (ids, supervised) pairs whose lengths are multiples of block_size (encode_examples).
    B, N = block_size, len(examples)
    lens = torch.tensor([len(ids) for ids, _ in examples])
    L = int(lens.max())
    x = torch.full((N, L), pad_id, dtype=torch.long)  # right padding (MARS.md §1)
    sup = torch.zeros((N, L), dtype=torch.bool)
    for n, (ids, s) in enumerate(examples):
        x[n, : len(ids)] = torch.from_numpy(np.asarray(ids, np.int64))
        sup[n, : len(ids)] = torch.from_numpy(np.asarray(s, bool))
    # Right shift (MARS.md §4): the output at p predicts the clean x[p+1], in both streams.
    labels = torch.full((N, L), IGNORE, dtype=torch.long)
    labels[:, :-1] = torch.where(sup[:, 1:], x[:, 1:], IGNORE)
    if mode == "ar":  # the clean stream alone; pads sit after every real token, causal is enough
        return Batch(x, None, None, labels, L)

    pos = torch.arange(L).expand(N, L)
    valid = pos < lens[:, None]  # (N, L)
    noisy = torch.where(sup, mask_id, x)  # x~: supervised positions masked, prompt stays real
    # Which noisy blocks go in. A noisy block is seen only by itself (MARS.md §3), so one with no
    # supervised target feeds no loss term and can be dropped ("dead block pruning").
    if prune:
        keep = (labels != IGNORE).view(N, L // B, B).any(-1)  # (N, L/B)
    else:
        keep = valid.view(N, L // B, B).any(-1)
    K = keep.sum(1)  # kept blocks per row
    # Kept block indices first, in order (stable sort on "dropped"), cut to the longest row.
    blk = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices[:, : int(K.max())]
    kept = torch.arange(blk.shape[1]) < K[:, None]  # (N, Kmax)
    npos = (blk[:, :, None] * B + torch.arange(B)).flatten(1)  # (N, Kmax*B) original positions
    nvalid = kept.repeat_interleave(B, dim=1)
    ntok = noisy.gather(1, npos).masked_fill(~nvalid, pad_id)
    nlab = labels.gather(1, npos).masked_fill(~nvalid, IGNORE)

    tokens = torch.cat([x, ntok], 1)  # (N, T), T = L + Kmax*B (= 2L without pruning)
    positions = torch.cat([pos, npos], 1)  # kept noisy tokens keep their positions and blocks
    stream = torch.cat([torch.zeros_like(valid), torch.ones_like(nvalid)], 1)
    mask = mars_mask(positions, stream, torch.cat([valid, nvalid], 1), B)
    return Batch(tokens, positions, mask, torch.cat([labels, nlab], 1), L)
