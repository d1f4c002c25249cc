# The Qwen2.5 tokenizer on tiktoken, its Hugging Face files, and the ChatML template (docs/method.md §13-14).
#
# Qwen2's byte-level BPE run by tiktoken. The Hugging Face files are only read and written here;
# tiktoken's rank-based BPE gives the same ids because merge i creates token 256+i. The MARS mask token
# (docs/method.md §2) is added after every existing token unless the files already have one: the token that
# tokenizer_config.json names as mask_token (the published MARS checkpoints' layout), or <|mask|>.
import base64
import json
import re
import unicodedata
from collections.abc import Iterable
from pathlib import Path

import tiktoken

from mars.files import read_json, read_text

# Qwen2's pre-tokenizer: digits split one at a time.
PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501
MASK = "<|mask|>"  # the MARS mask token (docs/method.md §2), added after every existing token
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# A bare *.tiktoken file has no special tokens: these are Qwen2.5's, in id order after the ranks.
QWEN25_SPECIALS = CHATML + [
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
    "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
    "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]
ROLES = ("system", "user", "assistant")
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# Qwen2.5's tool-call tags are added tokens of their own. A message flagged "tool_markup" (rendered
# by data.py in Qwen2.5's tool-call format) gets their ids, as the chat template's text gets them
# from Hugging Face's tokenizer; every other text stays ordinary (docs/method.md §13).
TOOL_MARKUP = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")  # the last two: Qwen3's files


# Qwen2.5's tool use: the signatures go into the system turn between these texts, one JSON object per line
# (formats.tools_system renders it for training, chat_template below for transformers and vLLM).
TOOLS_HEAD = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
              "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
              '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
              "<args-json-object>}\n</tool_call>")


def _jinja_string(text: str) -> str:  # a single-quoted Jinja string: its backslashes, quotes and newlines escaped
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def chat_template(default_system: str | None) -> str:
    # The Jinja twin of encode_chat, saved so that transformers' apply_chat_template (and vLLM) render the ids
    # training rendered: plain turns, and tool use as formats.py renders it (Qwen2.5's format: `tools` in the
    # system turn, an assistant turn's `tool_calls` as <tool_call> blocks, `tool` turns as one user turn).
    default = (f"{{%- elif messages[0]['role'] != 'system' %}}"
               f"{{{{- {_jinja_string(f'<|im_start|>system{chr(10)}{default_system}<|im_end|>{chr(10)}')} }}}}"
               if default_system is not None else "")  # one literal, as TEMPLATE_DEFAULT finds it
    return (
        "{%- if tools %}"
        "{{- '<|im_start|>system\\n' }}"
        "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
        f"{{%- else %}}{{{{- {_jinja_string(DEFAULT_SYSTEM)} }}}}{{%- endif %}}"
        f"{{{{- {_jinja_string(TOOLS_HEAD)} }}}}"
        "{%- for tool in tools %}{{- '\\n' }}"
        "{%- if tool['function'] is defined %}{{- tool | tojson }}"
        "{%- else %}{{- {'type': 'function', 'function': tool} | tojson }}{%- endif %}"
        "{%- endfor %}"
        f"{{{{- {_jinja_string(TOOLS_TAIL)} + '<|im_end|>\\n' }}}}"
        + default + "{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message['role'] == 'system' and loop.first and tools %}"
        "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
        "{{- '<|im_start|>assistant' }}"
        "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
        "{%- for call in message['tool_calls'] %}"
        "{%- if call['function'] is defined %}{%- set call = call['function'] %}{%- endif %}"
        "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
        "{%- if call['arguments'] is string %}{{- call['arguments'] }}{%- else %}{{- call['arguments'] | tojson }}"
        "{%- endif %}"
        "{{- '}\\n</tool_call>' }}"
        "{%- endfor %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- elif message['role'] == 'tool' %}"
        "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- else %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


# A Qwen template's default system block, as a literal Jinja string: '<|im_start|>system\nTEXT<|im_end|>\n'.
TEMPLATE_DEFAULT = r"'<\|im_start\|>system\\n((?:[^'\\]|\\.)*?)<\|im_end\|>\\n'"


def _unquote(text: str) -> str:  # a Jinja single-quoted string's escapes (\n, \', \\)
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], text)


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's map: printable bytes stand for themselves, the other 68 are shifted to chr(256+n), so
    # every vocabulary string is printable. tokenizer.json / vocab.json are written in it.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    byte_values, code_points = list(printable), list(printable)
    for byte in range(256):
        if byte not in printable:
            byte_values.append(byte)
            code_points.append(256 + len(code_points) - len(printable))
    return {byte: chr(code) for byte, code in zip(byte_values, code_points)}


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def _to_str(token: bytes) -> str:
    return "".join(BYTE_TO_CHAR[b] for b in token)


TOKENIZER_REMEDY = "re-download or re-save the tokenizer"


def _read_text(file: Path) -> str:
    return read_text(file, TOKENIZER_REMEDY)


def _read_json(file: Path) -> dict:
    return read_json(file, TOKENIZER_REMEDY)


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
        raise ValueError(f"{file}: bad added_tokens_decoder ({e!r}): {TOKENIZER_REMEDY}") from e


def _mask_token(folder: Path, special: dict[str, int]) -> str:
    # The files' own mask token, so its id is kept: tokenizer_config.json's mask_token (a string, or
    # {"content": ...} in older files), else special_tokens_map.json's, else <|mask|>. transformers'
    # add_special_tokens({"mask_token": ...}) writes the first, so a checkpoint made that way loads
    # with the id it was trained with, whatever that id is.
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        file = folder / name
        if not file.exists():
            continue
        token = _read_json(file).get("mask_token")
        token = token.get("content") if isinstance(token, dict) else token
        if token is None:
            continue
        if not isinstance(token, str) or token not in special:
            raise ValueError(f"{file}: mask_token {token!r} is not an added token of this tokenizer; add it "
                             "to the added tokens, or remove mask_token to give <|mask|> the next free id")
        return token
    return MASK


def _load_tokenizer_json(file: Path):
    content = _read_json(file)
    try:
        model, entries = content["model"], content.get("added_tokens") or []
        if model.get("type", "BPE") != "BPE":
            raise ValueError(f"{file} holds a {model['type']} model: only byte-level BPE is supported")
        added = {e["content"]: e["id"] for e in entries}
        nonspecial = {e["content"] for e in entries if not e.get("special", True)}
        # merges are "a b" strings in older files and [a, b] pairs in newer ones
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        ranks = _ranks_from_vocab(model["vocab"], file)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{file} is not a BPE tokenizer.json (bad or missing {e}): {TOKENIZER_REMEDY}") from e
    if json.dumps(PAT) not in json.dumps(content.get("pre_tokenizer")):
        raise ValueError(f"{file}: pre-tokenizer is not Qwen2's regex, so ids would differ from the "
                         "model's training: only Qwen2-style tokenizers are supported")
    return ranks, added, nonspecial, merges


def _load_vocab_merges(folder: Path):
    vocab = _read_json(folder / "vocab.json")
    lines = _read_text(folder / "merges.txt").splitlines()
    merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
    added, nonspecial = _added_from_config(folder) or (_default_specials(len(vocab)), set())
    return _ranks_from_vocab(vocab, folder / "vocab.json"), added, nonspecial, merges


def _load_tiktoken(file: Path, folder: Path):
    ranks = {}
    for number, line in enumerate(_read_text(file).splitlines(), 1):
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{file}:{number}: expected '<base64 token> <rank>', got {line[:60]!r}") from e
    added, nonspecial = _added_from_config(folder) or (_default_specials(max(ranks.values()) + 1), set())
    return ranks, added, nonspecial, None


MAX_ID = 2**24  # every id gets an embedding row; the largest vocabularies in use hold about 2**18


def _check_ids(ranks: dict[bytes, int], special: dict[str, int], source: Path) -> None:
    # tiktoken takes ids as u32 and panics on two tokens with one id, so the ids are checked here, where
    # the file is known: integers in [0, MAX_ID), each naming one token. An added token may repeat a
    # vocabulary entry that has its text and its id (GPT-2-style files list <|endoftext|> in both).
    owner: dict[int, bytes] = {}
    for token, i in [*ranks.items(), *((s.encode(), i) for s, i in special.items())]:
        if type(i) is not int or not 0 <= i < MAX_ID:
            raise ValueError(f"{source}: token {token!r} has id {i!r}, not an integer in [0, {MAX_ID}): "
                             f"{TOKENIZER_REMEDY}")
        if owner.setdefault(i, token) != token:
            raise ValueError(f"{source}: tokens {owner[i]!r} and {token!r} share id {i}; every id must name "
                             f"one token: {TOKENIZER_REMEDY}")


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


def plain_messages(messages):
    # Messages as OpenAI clients send them, made what check_messages takes: content given as a list of parts,
    # [{"type": "text", "text": ...}, ...], has its text parts joined with newlines (as vLLM does; other parts,
    # images or audio, cannot be honoured), and the "developer" role, which newer clients send in place of
    # "system", becomes "system". A tool turn is refused as such. Anything else passes as it is, for
    # check_messages to name.
    if not isinstance(messages, list):
        return messages
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            for j, part in enumerate(m["content"]):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    if kind == "text":
                        raise ValueError(f"messages[{i}].content[{j}] is a text part without a string \"text\": "
                                         "{'type': 'text', 'text': ...}")
                    raise ValueError(f"messages[{i}].content[{j}] is a {str(kind)[:40]!r} part; only text is "
                                     "taken: {'type': 'text', 'text': ...}")
            m = {**m, "content": "\n".join(part["text"] for part in m["content"])}
        if isinstance(m, dict) and m.get("role") == "developer":
            m = {**m, "role": "system"}
        calls = isinstance(m, dict) and (m.get("tool_calls") or m.get("function_call"))
        if calls or isinstance(m, dict) and m.get("role") in ("tool", "function"):
            raise ValueError(f"messages[{i}] is a tool call or a tool's output, and tool calling is not supported "
                             "here; send the conversation without its tool turns")
        out.append(m)
    return out


def check_messages(messages: list[dict]) -> None:
    # The one check of chat messages: the template, data files (formats.to_messages prefixes file:line)
    # and the server's requests all go through it.
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, "
                         f"got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with a str 'content', got {m!r:.80}")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] has role {m.get('role')!r}: expected 'system', 'user' or "
                             "'assistant' (map other roles to these first)")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be a dict with a str 'content'; its content is "
                             f"{type(m.get('content')).__name__}: give it the message's text")


class Tokenizer:
    def __init__(self, ranks: dict[bytes, int], special: dict[str, int],
                 merges: list[tuple[str, str]] | None = None, nonspecial: Iterable[str] = (),
                 default_system: str | None = DEFAULT_SYSTEM, mask_token: str = MASK):
        special = dict(special)
        # docs/method.md §2: the mask takes the first free id, unless the files already have it (our own
        # saves and the published MARS checkpoints list it as an added token, 151665 for Qwen2.5)
        special.setdefault(mask_token, max(*ranks.values(), *special.values()) + 1)
        self.ranks, self.special = ranks, special  # special: every added token, the mask included
        self.mask_token = mask_token
        self._merges = merges  # kept from the source files, so a save writes them back unchanged
        self._nonspecial = set(nonspecial)  # added tokens HF marks "special": false (<tool_call>, ...)
        # Rendered first when a chat has no system message; None renders no system block at all.
        self.default_system = default_system
        self._enc = tiktoken.Encoding("qwen2", pat_str=PAT, mergeable_ranks=ranks, special_tokens=special)
        self.eos_id = special["<|im_end|>"]
        self.pad_id = special["<|endoftext|>"]
        self.im_start_id = special["<|im_start|>"]
        self.mask_id = special[mask_token]
        self.stop_ids = frozenset({self.eos_id, self.pad_id})
        self.vocab_size = self._enc.max_token_value + 1  # one past the last added token; the model may have spare rows

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
            source = path / "tokenizer.json"
            ranks, special, nonspecial, merges = _load_tokenizer_json(source)
        elif path.is_dir() and (path / "vocab.json").exists() and (path / "merges.txt").exists():
            source = path / "vocab.json"  # and tokenizer_config.json's added tokens
            ranks, special, nonspecial, merges = _load_vocab_merges(path)
        elif len(tiktokens) == 1:
            source = tiktokens[0]
            ranks, special, nonspecial, merges = _load_tiktoken(tiktokens[0], folder)
        elif tiktokens:
            raise ValueError(f"several *.tiktoken files in {path} ({', '.join(t.name for t in tiktokens)}): "
                             "pass the path of the one to use")
        else:
            raise FileNotFoundError(f"no tokenizer files in {path}: expected tokenizer.json, "
                                    "vocab.json+merges.txt or *.tiktoken")
        _check_ids(ranks, special, source)
        missing = [s for s in CHATML if s not in special]
        if missing:
            raise ValueError(f"tokenizer in {path} has no {', '.join(missing)}: the chat format needs "
                             "Qwen2's ChatML special tokens")
        # Our saves record their default system prompt; a chat template's own default block names its
        # (Qwen2-Instruct's "You are a helpful assistant."); other Qwen files imply Qwen2.5's.
        # Newer transformers saves the template as chat_template.jinja, which wins over the config's.
        config, jinja = folder / "tokenizer_config.json", folder / "chat_template.jinja"
        settings = _read_json(config) if config.exists() else {}
        template = _read_text(jinja) if jinja.is_file() else settings.get("chat_template")
        found = re.search(TEMPLATE_DEFAULT, template) if isinstance(template, str) else None
        default_system = settings.get("default_system", _unquote(found[1]) if found else DEFAULT_SYSTEM)
        return cls(ranks, special, merges, nonspecial, default_system, _mask_token(folder, special))

    @classmethod
    def byte_level(cls) -> "Tokenizer":
        # For the tiny CPU demo model: one token per byte (no merges), ChatML specials, then the mask.
        # No default system prompt: Qwen's would be ~70 bytes of every byte-level example.
        return cls({bytes([b]): b for b in range(256)}, {s: 256 + i for i, s in enumerate(CHATML)},
                   merges=[], default_system=None)

    def encode(self, text: str) -> list[int]:
        # NFC first, as HF's normalizer does. encode_ordinary never emits special ids, so a
        # "<|im_end|>" typed by a user stays plain text (docs/method.md §13).
        return self._enc.encode_ordinary(unicodedata.normalize("NFC", text))

    def decode(self, ids: list[int]) -> str:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the tokenizer's {self.vocab_size} ids: "
                             "mask the model's logits beyond vocab_size before sampling")
        return self._enc.decode(ids, errors="replace")

    def encode_chat_with_mask(self, messages: list[dict], *, add_generation_prompt: bool = False,
                              last_turn_only: bool = False) -> tuple[list[int], list[bool]]:
        # Qwen2.5 ChatML (docs/method.md §13). supervised[i] marks the training targets: the assistant
        # content, its <|im_end|> and the "\n" after it, of every reply not flagged "train": False (the data's
        # empty replies and weight-0 turns: formats.py), or of the last such reply alone.
        check_messages(messages)
        if messages[0]["role"] != "system" and self.default_system is not None:
            messages = [{"role": "system", "content": self.default_system}, *messages]
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("train", True)),
                   default=-1)
        ids, supervised, newline = [], [], self.encode("\n")
        markup = {t for t in TOOL_MARKUP if t in self.special}
        for i, m in enumerate(messages):
            # Encode the text between two specials in one go, as HF does on the rendered string.
            header = self.encode(m["role"] + "\n")
            text = m["role"] + "\n" + m["content"]
            body = (self._enc.encode(unicodedata.normalize("NFC", text), allowed_special=markup, disallowed_special=())
                    if m.get("tool_markup") else self.encode(text))
            # Content starting with a newline can merge with the header's "\n": that token is supervised.
            shared = next((k for k, (a, b) in enumerate(zip(header, body)) if a != b), len(header))
            trained = m["role"] == "assistant" and m.get("train", True) and (i == last or not last_turn_only)
            ids += [self.im_start_id, *body, self.eos_id, *newline]
            supervised += [False] * (1 + shared) + [trained] * (len(body) - shared + 1 + len(newline))
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
            "mask_token": self.mask_token,  # so transformers' mask_token_id and our mask_id agree on reload
            "add_bos_token": False, "add_prefix_space": False, "clean_up_tokenization_spaces": False,
            "errors": "replace", "split_special_tokens": False,
            "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added},
        }
        tokenizer_text = json.dumps(tokenizer_json, ensure_ascii=False)  # compact: 150k merges
        (path / "tokenizer.json").write_text(tokenizer_text, encoding="utf-8")
        config_text = json.dumps(config, indent=2, ensure_ascii=False)
        (path / "tokenizer_config.json").write_text(config_text, encoding="utf-8")
        (path / "chat_template.jinja").unlink(missing_ok=True)  # another template's, which would win over this one
