# MARS data (docs/method.md §1-4): chat files in, (ids, supervised) examples out, then the two-stream
# batch: clean tokens followed by a noisy copy whose response tokens are all <|mask|>, both at the same
# positions, under the block-causal mask of §3 (mars_mask), with right-shifted labels (make_batch).
import codecs
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from mars import cli, hub
from mars.files import TOO_LONG, jsonl, read_json, writing
from mars.formats import RowError, row_messages

IGNORE = -100  # label of a position with no supervised target (F.cross_entropy's ignore_index)
# A JSONL row longer than this many bytes per token of max_len cannot fit (a token is a few bytes of
# text, six at most per byte as a JSON escape): it is dropped as it streams, never held whole.
ROW_BYTES_PER_TOKEN = 1024
CACHE_VERSION = 2  # bump when the tokenized layout or the rendering changes: old caches are then ignored
WAIT_FOR_TOKENIZER_S = 3600.0  # how long the other processes of a run wait for rank 0 to tokenize the data


# ---- files ----

def _rows(file: Path, max_bytes: int | None = None) -> Iterator[tuple[str, object]]:
    # Streams (location, row), location = "file:line" (JSONL), "file: entry i" (JSON array) or
    # "file: row i" (parquet, read a record batch at a time): the data set is never held as Python objects.
    if file.suffix == ".parquet":
        pq = cli.optional("pyarrow.parquet", f"{file}: reading parquet (or convert it to JSONL)",
                          "requirements-extras.txt")
        try:
            batches = pq.ParquetFile(file).iter_batches(batch_size=1024)
            i = 0
            for batch in batches:
                for row in batch.to_pylist():
                    yield f"{file}: row {i}", row
                    i += 1
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise ValueError(f"{file}: not a readable parquet file ({e}); write it again or convert it "
                             "to JSONL") from e
        return
    if file.suffix == ".json":
        with open(file, "rb") as f:  # past a UTF-8 byte order mark, which Windows editors write
            head = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
        if head.startswith(b"["):  # one JSON array (Alpaca's files): small by nature, read whole
            rows = read_json(file, "write it as one JSON array of chat rows, or as JSON Lines", want=list)
            for i, row in enumerate(rows):
                yield f"{file}: entry {i}", row
            return
    for line, row in jsonl(file, "save the file as UTF-8 JSON Lines, one chat example per line", max_bytes):
        yield f"{file}:{line}", row


def _download_dataset(repo_id: str) -> list[Path]:
    root = hub.download(repo_id, "dataset", ["*.parquet", "*.jsonl"], f"--data {repo_id}: not a local file",
                        "Pass a local .jsonl/.json/.parquet file instead, e.g. one downloaded where you are online")
    files = sorted(p for p in root.rglob("*") if p.suffix in (".parquet", ".jsonl"))
    if not files:
        raise FileNotFoundError(f"--data {repo_id}: the dataset has no .parquet or .jsonl files")
    return _train_split(files)


def _train_split(files: list[Path]) -> list[Path]:
    # When some file names start a word with "train" (train.jsonl, train-00000-of-00002.parquet, my_train.json,
    # training.jsonl; not constraints.jsonl or retrain.jsonl), the others are test/validation splits: leave them out.
    return [p for p in files if re.search(r"(?<![a-z])train", p.stem.lower())] or files


def data_files(source: str, flag: str = "--data") -> list[Path]:
    # source: a chat file (.jsonl, .json, .parquet), a folder of them (its *train* files when
    # some are named so), or a Hugging Face dataset id. flag: the option that named it, for messages.
    path = Path(source)
    if path.is_dir():
        files = _train_split(sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".json", ".parquet")))
    elif path.is_file():
        files = [path]
    elif hub.HUB_ID.fullmatch(source):
        files = _download_dataset(source)
    else:
        raise FileNotFoundError(f"{flag} {source}: no such file; pass a .jsonl/.json/.parquet chat "
                                "file or a Hugging Face dataset id such as allenai/Dolci-Instruct-SFT")
    if not files:
        raise FileNotFoundError(f"{flag} {source}: the folder holds no .jsonl, .json or .parquet file")
    return files


def iter_conversations(files: list[Path], counts: dict, name: str,
                       max_bytes: int | None = None) -> Iterator[list[dict]]:
    # Streams the usable rows' messages. counts gets, per outcome, how many rows: "chat", "tools"
    # (rendered in Qwen2.5's tool-call format) and "skipped (<reason>)", plus "first skipped" (the
    # file:line and message of the first skip of each reason), so a user can look at one. Data with
    # no usable row at all raises, naming it (name: "--data SOURCE") and the first problem.
    for file in files:
        for location, row in _rows(file, max_bytes):
            try:
                if row is TOO_LONG:
                    raise RowError(f"{location}: line over {max_bytes} bytes, longer than max_len allows; it was "
                                   "skipped unread", "line too long for max_len")
                messages, kind = row_messages(row, location)
            except RowError as e:
                reason = f"skipped ({e.reason})"
                counts[reason] = counts.get(reason, 0) + 1
                counts.setdefault("first skipped", {}).setdefault(reason, str(e))
                continue
            counts[kind] = counts.get(kind, 0) + 1
            yield messages
    if not any(k in counts for k in ("chat", "tools")):
        first = counts.get("first skipped", {})
        problem = "first problem: " + next(iter(first.values())) if first else "the data holds no rows"
        raise ValueError(f"{name}: no usable row; {problem}")


def load_conversations(source: str, counts: dict | None = None, flag: str = "--data") -> list[list[dict]]:
    # All usable conversations of a (small) data set as a list; load_examples streams instead.
    counts = {} if counts is None else counts
    return list(iter_conversations(data_files(source, flag), counts, f"{flag} {source}"))


# ---- tokenized examples, cached beside the data ----

@dataclass
class Examples:
    # Tokenized examples stored back to back in flat arrays: a few bytes per token, not a Python
    # list per example (Dolci has ~2M examples). Loaded from the cache, the arrays are memory-mapped,
    # so every process of a run shares one copy in the page cache.
    ids: np.ndarray  # (total,) int32 token ids
    sup: np.ndarray  # (total,) bool, True = supervised (docs/method.md §1)
    offsets: np.ndarray  # (n + 1,) int64, stored example r is ids[offsets[r]:offsets[r + 1]]
    stats: dict = field(default_factory=dict)  # counts from encode_examples and the row outcomes
    rows: np.ndarray | None = None  # (m,) the stored examples this set holds, in order; None = all

    def __post_init__(self):
        lengths = np.diff(self.offsets)
        self._lengths = lengths if self.rows is None else lengths[self.rows]

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        stored = i if self.rows is None else self.rows[i]
        start, end = self.offsets[stored], self.offsets[stored + 1]
        return self.ids[start:end], self.sup[start:end]

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    def select(self, indices: np.ndarray) -> "Examples":
        # A subset (train / held-out split) that shares the arrays: no copy of the tokens.
        rows = np.asarray(indices, np.int64) if self.rows is None else self.rows[indices]
        return Examples(self.ids, self.sup, self.offsets, self.stats, rows)

    def save(self, folder: Path) -> None:
        # Atomic: written to a temporary folder, then renamed; a killed run leaves no half cache.
        tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}"
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            with writing(folder, "free some space there: the tokenized data is cached beside the data files"):
                for name in ("ids", "sup", "offsets"):
                    np.save(tmp / f"{name}.npy", getattr(self, name))
                (tmp / "stats.json").write_text(json.dumps(self.stats, indent=2) + "\n")
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished the same cache first
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()

    @classmethod
    def load(cls, folder: Path) -> "Examples":
        arrays = [np.load(folder / f"{name}.npy", mmap_mode="r") for name in ("ids", "sup", "offsets")]
        return cls(*arrays, stats=json.loads((folder / "stats.json").read_text()))


def encode_examples(tok, conversations: Iterable[list[dict]], max_len: int, block_size: int,
                    last_turn_only: bool = False) -> Examples:
    # docs/method.md §1. Every length is a multiple of B and at most max_len: we keep the first
    # floor(max_len / B) * B tokens (so block padding never pushes a sequence past max_len),
    # then pad with supervised EOS up to the next multiple of B.
    assert max_len >= block_size, f"max_len={max_len} is shorter than one block (block_size={block_size})"
    cap = max_len - max_len % block_size
    ids_all, sup_all, lengths, pending = [], [], [], ([], [])
    stats = dict(examples=0, kept=0, truncated=0, dropped_prompt_too_long=0,
                 dropped_no_assistant=0, eos_pad_tokens=0, tokens=0, supervised_tokens=0)
    for messages in conversations:
        stats["examples"] += 1
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
        pending[0].extend(ids)
        pending[1].extend(sup)
        lengths.append(len(ids))
        if len(pending[0]) > 1 << 22:  # flush to numpy every few million tokens: bounded Python lists
            ids_all.append(np.asarray(pending[0], np.int32))
            sup_all.append(np.asarray(pending[1], bool))
            pending = ([], [])
    ids_all.append(np.asarray(pending[0], np.int32))
    sup_all.append(np.asarray(pending[1], bool))
    ids, sup = np.concatenate(ids_all), np.concatenate(sup_all)
    offsets = np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))]).astype(np.int64)
    stats["kept"] = len(lengths)
    stats["tokens"] = int(offsets[-1])
    stats["supervised_tokens"] = int(sup.sum())
    return Examples(ids, sup, offsets, stats)


def tokenizer_key(tok) -> str:
    # What the ids depend on: the vocabulary, the special tokens and the default system prompt.
    h = hashlib.sha256()
    for token, rank in sorted(tok.ranks.items(), key=lambda kv: kv[1]):
        h.update(rank.to_bytes(4, "little") + token)
    h.update(json.dumps([sorted(tok.special.items()), tok.default_system]).encode())
    return h.hexdigest()


def load_examples(source: str, tok, max_len: int, block_size: int, last_turn_only: bool = False,
                  build: bool = True, log=print, flag: str = "--data") -> Examples:
    # The tokenized data set, tokenized once: cached beside the data in .mars-cache/ (or in
    # ~/.cache/mars when that folder is read-only), keyed by the files (path, size, mtime), the
    # tokenizer and the settings that change ids, so a resume or a second stage loads it in
    # seconds. build=False (ranks > 0 of a run): wait for the process that builds it, at most
    # WAIT_FOR_TOKENIZER_S.
    files = data_files(source, flag)
    key = hashlib.sha256(json.dumps({
        "version": CACHE_VERSION, "tokenizer": tokenizer_key(tok), "max_len": max_len,
        "block_size": block_size, "last_turn_only": last_turn_only,
        "files": [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files],
    }).encode()).hexdigest()[:20]
    base = files[0].parent
    base = base / ".mars-cache" if os.access(base, os.W_OK) else Path.home() / ".cache" / "mars"
    name = re.sub(r"[^\w.-]", "_", Path(source).name)
    folder = base / f"{name}-{key}"
    if not (folder / "stats.json").exists():
        if not build:  # rank 0 tokenizes; no collective to time out, so the wait has its own limit
            wait_s = WAIT_FOR_TOKENIZER_S
            deadline = time.monotonic() + wait_s
            while not (folder / "stats.json").exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{flag} {source}: waited {wait_s:.0f} s for the first process to tokenize it "
                                       f"into {folder}; if that process died, see its log, or tokenize once "
                                       "with a single process (python train.py --max-steps 1 ...) and relaunch")
                time.sleep(min(2.0, wait_s / 10))
        else:
            log(f"tokenizing {source} once into {folder}")
            counts = {}
            rows = iter_conversations(files, counts, f"{flag} {source}", max(1 << 20, ROW_BYTES_PER_TOKEN * max_len))
            examples = encode_examples(tok, rows, max_len, block_size, last_turn_only)
            examples.stats["rows"] = counts
            examples.save(folder)
    return Examples.load(folder)


def describe(stats: dict, name: str, max_len: int) -> str:
    text = (f"{name}: {stats['examples']} examples, {stats['kept']} kept, "
            f"{stats['truncated']} truncated to max_len={max_len}, "
            f"{stats['dropped_prompt_too_long']} dropped (prompt alone fills max_len), "
            f"{stats['dropped_no_assistant']} dropped (no assistant turn); "
            f"{stats['tokens']} tokens, {stats['supervised_tokens']} supervised, "
            f"{stats['eos_pad_tokens']} of them EOS block padding")
    rows = stats.get("rows")
    if rows:  # the per-row outcomes of reading the files
        outcomes = {k: v for k, v in rows.items() if k != "first skipped"}
        text += "\n  rows: " + ", ".join(f"{v} {k}" for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1]))
        for reason, first in rows.get("first skipped", {}).items():
            text += f"\n  first {reason}: {first}"
    return text


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
    # What a micro-batch needs on the device: ids, positions, stream ids and labels, a few bytes per
    # column. The (R, 1, T, T) mask is not stored: it is a few comparisons of pos, stream and valid,
    # so it is built where it is used, on the device, after the copy (mask, noisy_mask).
    tokens: torch.Tensor  # (R, T) ids: L clean columns, then the noisy columns (mars mode)
    pos: torch.Tensor | None  # (R, T) RoPE positions; both streams count from 0 (docs/method.md §2)
    labels: torch.Tensor  # (R, T) the clean x[p+1] where that target is supervised, else IGNORE
    L: int  # columns < L are the clean stream, columns >= L the noisy one
    noisy: torch.Tensor | None = None  # (R, T) bool, True = noisy-stream column; None = AR (causal)
    valid: torch.Tensor | None = None  # (R, T) bool, True = a real token, False = padding
    block_size: int = 1  # B of docs/method.md §3

    def to(self, device) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.tokens), move(self.pos), move(self.labels), self.L, move(self.noisy),
                     move(self.valid), self.block_size)

    def pin_memory(self) -> "Batch":
        # Page-locked host memory, so that .to(cuda) copies asynchronously.
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return Batch(pin(self.tokens), pin(self.pos), pin(self.labels), self.L, pin(self.noisy),
                     pin(self.valid), self.block_size)

    @property
    def mask(self) -> torch.Tensor | None:
        # (R, 1, T, T) bool, the whole docs/method.md §3 mask on this batch's device; None = plain causal (AR).
        if self.noisy is None:
            return None
        return mars_mask(self.pos, self.noisy, self.valid, self.block_size)

    def noisy_mask(self) -> torch.Tensor:
        # (R, 1, T - L, T): the mask's rows for the noisy queries only. The clean rows are plain
        # causal over the first L columns (docs/method.md §3), which a causal kernel does without a mask.
        return mars_mask(self.pos, self.noisy, self.valid, self.block_size, first_query=self.L)


def mars_mask(pos: torch.Tensor, noisy: torch.Tensor, valid: torch.Tensor, block_size: int,
              first_query: int = 0) -> torch.Tensor:
    # The docs/method.md §3 table, for any column layout. pos, noisy, valid: (R, T) per column: its
    # stream-local position, whether it is in the noisy stream, whether it is a real token.
    # Returns (R, 1, T - first_query, T) bool: [r, 0, i, j] = query first_query + i may attend to key j.
    T = pos.shape[1]
    pq, pk = pos[:, first_query:, None], pos[:, None, :]  # (R, Tq, 1), (R, 1, T)
    bq, bk = pq // block_size, pk // block_size
    nq, nk = noisy[:, first_query:, None], noisy[:, None, :]
    clean_clean = ~nq & ~nk & (pk <= pq)  # ordinary causal LM
    noisy_clean = nq & ~nk & (bk < bq)  # clean tokens of strictly earlier blocks
    noisy_noisy = nq & nk & (bk == bq) & (pk <= pq)  # own block, causal
    allowed = (clean_clean | noisy_clean | noisy_noisy) & valid[:, first_query:, None] & valid[:, None, :]
    # Padding is hidden from every query; a pad query sees only itself so that its softmax row is
    # not empty (an all-False row makes SDPA return NaN, which then leaks through the values).
    eye = torch.arange(first_query, T, device=pos.device)[:, None] == torch.arange(T, device=pos.device)
    return (allowed | eye)[:, None]


def make_batch(examples: list[tuple[np.ndarray, np.ndarray]], block_size: int, mask_id: int,
               pad_id: int, mode: str = "mars", prune: bool = True) -> Batch:
    # examples: (ids, supervised) pairs whose lengths are multiples of block_size (encode_examples) ->
    # the two streams at shared positions, the right-shifted labels (docs/method.md §2-4).
    B, R = block_size, len(examples)
    lengths = torch.tensor([len(ids) for ids, _ in examples])
    L = int(lengths.max())
    x = torch.full((R, L), pad_id, dtype=torch.long)  # right padding, never supervised
    sup = torch.zeros((R, L), dtype=torch.bool)
    for row, (ids, supervised) in enumerate(examples):
        x[row, : len(ids)] = torch.from_numpy(np.array(ids, np.int64))  # copies: the cache is read-only
        sup[row, : len(ids)] = torch.from_numpy(np.array(supervised, bool))
    # Right shift: the output at p predicts the clean x[p+1], in both streams.
    labels = torch.full((R, L), IGNORE, dtype=torch.long)
    labels[:, :-1] = torch.where(sup[:, 1:], x[:, 1:], IGNORE)
    if mode == "ar":  # the clean stream alone; pads sit after every real token, causal is enough
        return Batch(x, None, labels, L)

    pos = torch.arange(L).expand(R, L)
    valid = pos < lengths[:, None]  # (R, L)
    x_noisy = torch.where(sup, mask_id, x)  # supervised positions masked, the prompt stays real
    # Which noisy blocks go in. A noisy block is seen only by itself, so one with no supervised target
    # feeds no loss term and can be dropped ("dead block pruning").
    if prune:
        keep = (labels != IGNORE).view(R, L // B, B).any(-1)  # (R, L/B)
    else:
        keep = valid.view(R, L // B, B).any(-1)
    kept_per_row = keep.sum(1)  # (R,)
    # Kept block indices first, in order (stable sort on "dropped"), cut to the row that keeps most (M).
    blocks = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices[:, : int(kept_per_row.max())]
    real_block = torch.arange(blocks.shape[1]) < kept_per_row[:, None]  # (R, M)
    noisy_pos = (blocks[:, :, None] * B + torch.arange(B)).flatten(1)  # (R, M*B) original positions
    noisy_valid = real_block.repeat_interleave(B, dim=1)
    noisy_tokens = x_noisy.gather(1, noisy_pos).masked_fill(~noisy_valid, pad_id)
    noisy_labels = labels.gather(1, noisy_pos).masked_fill(~noisy_valid, IGNORE)

    tokens = torch.cat([x, noisy_tokens], 1)  # (R, T), T = L + M*B (= 2L without pruning)
    positions = torch.cat([pos, noisy_pos], 1)  # kept noisy tokens keep their positions and blocks
    stream = torch.cat([torch.zeros_like(valid), torch.ones_like(noisy_valid)], 1)
    return Batch(tokens, positions, torch.cat([labels, noisy_labels], 1), L, stream,
                 torch.cat([valid, noisy_valid], 1), B)
