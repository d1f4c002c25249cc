# Chat files in, (ids, supervised) examples out (docs/method.md §1): the file formats (JSONL, a JSON array,
# parquet), a folder's train split, hub data sets, rows streamed and counted by outcome, and the tokenized
# examples cached beside the data as memory-mapped arrays. The rule that cuts and pads one example to whole
# blocks is data.fit_to_blocks; which tokens are supervised is Tokenizer.encode_chat_with_mask.
import codecs
import hashlib
import itertools
import json
import multiprocessing
import os
import pickle
import re
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from multiprocessing import connection
from pathlib import Path

import numpy as np

from data import fit_to_blocks, reply_end
from mars import cli, hub
from mars.files import TOO_LONG, jsonl, read_json, writing
from mars.formats import RowError, row_messages

# A JSONL line longer than this is no chat row (a whole data set on one line, say): it is dropped as it streams,
# never held whole. Any shorter row is read, and cut to --max-len like every other (docs/method.md §1); one this
# long takes a worker about a second and a few hundred MB to tokenize whole.
MAX_ROW_BYTES = 16 << 20
CACHE_VERSION = 6  # bump when the tokenized layout or the rendering changes: old caches are then ignored
WAIT_FOR_TOKENIZER_S = 3600.0  # how long a process of a run waits for another's share of the tokenizing
# A run that is the only process on its machine tokenizes data files this large in worker processes, a share of
# the rows each, up to MAX_WORKERS of them (Dolci's ~2M rows take a quarter of an hour on one core);
# MARS_TOKENIZE_WORKERS=N sets their number (workers).
WORKERS_FROM_BYTES = 64 << 20
MAX_WORKERS = 8
JSON_MEMORY = 3  # bytes of Python objects per byte of a JSON array read whole (2.6 measured): workers fit memory
PROGRESS_S = 30.0  # seconds between the lines on the rows tokenized so far


# ---- files ----

def _rows(file: Path, max_bytes: int | None = None) -> Iterator[tuple[str, object]]:
    # Streams (location, row), location = "file:line" (JSONL), "file: entry i" (JSON array) or
    # "file: row i" (parquet, read a record batch at a time): the data set is never held as Python objects.
    if file.suffix.lower() == ".parquet":
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
    if file.suffix.lower() == ".json":
        head = json_head(file)
        if head.startswith(b"["):  # one JSON array (Alpaca's files): small by nature, read whole
            rows = read_json(file, "write it as one JSON array of chat rows, or as JSON Lines", want=list)
            for i, row in enumerate(rows):
                yield f"{file}: entry {i}", row
            return
        first = head.split(b"\n", 1)[0].strip()
        if b"\n" in head and first.startswith(b"{") and not first.endswith(b"}"):  # an object over several lines
            raise ValueError(f"{file}: a .json file holds one JSON array of chat rows ([{{...}}, ...]) or JSON Lines "
                             "(one row a line), and this one starts with an object over several lines: wrap the "
                             "rows in [ ] or write each on one line")
    for line, row in jsonl(file, "save the file as UTF-8 JSON Lines, one chat example per line", max_bytes):
        yield f"{file}:{line}", row


METADATA = ("dataset_info", "dataset_infos", "dataset_dict", "state")  # the hub's .json files that hold no rows


def is_data(p: Path) -> bool:  # hidden files (macOS's ._train.jsonl) are not data
    suffix = p.suffix.lower()
    return (suffix in hub.DATA_SUFFIXES and not p.name.startswith(".")
            and not (suffix == ".json" and p.stem.lower() in METADATA))


def json_head(file: Path) -> bytes:  # its first bytes past a UTF-8 byte order mark (Windows editors write one)
    with open(file, "rb") as f:
        return f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()


def json_array(file: Path) -> bool:  # a .json file that holds one JSON array, which is read whole
    return file.suffix.lower() == ".json" and json_head(file).startswith(b"[")


def _download_dataset(repo_id: str) -> list[Path]:
    # Its .parquet and .jsonl files, or where it has none its .json files (Alpaca's), of the train split. The
    # hub's patterns tell case: "*.[jJ][sS][oO][nN]".
    for suffixes in ((".parquet", ".jsonl"), (".json",)):
        patterns = ["*." + "".join(f"[{c}{c.upper()}]" for c in x[1:]) for x in suffixes]
        root = hub.download(repo_id, "dataset", patterns, f"--data {repo_id}: not a local file",
                            "Pass a local .jsonl/.json/.parquet file instead, e.g. one downloaded where you are online")
        files = [p for p in data_below(root) if p.suffix.lower() in suffixes]
        if files:
            return _train_split(files, root, f"--data {repo_id}", whole=True)
    raise FileNotFoundError(f"--data {repo_id}: the dataset has no .parquet, .jsonl or .json files")


def data_below(root: Path) -> list[Path]:
    # The data files in root's tree, sorted; none under a hidden folder (this code's own .mars-cache/, the hub's
    # .cache/ in a local download).
    return sorted(p for p in root.rglob("*") if is_data(p) and p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(root).parts))


def _train_split(files: list[Path], root: Path, name: str, whole: bool = False) -> list[Path]:
    # When some file names, or the folders below root that hold them, start a word with "train" (train.jsonl,
    # train-00000-of-00002.parquet, my_train.json, training.jsonl, data/train/0000.parquet; not constraints.jsonl
    # or retrain.jsonl), the others are test/validation splits: leave them out. The hub's shards name their
    # split (train_sft-00000-of-00003.parquet): shards of two train splits (train_sft and train_gen) are
    # refused, not mixed; with `whole` (a hub download), a set of shards must be whole (numbered from 0 or 1):
    # a local folder may hold a part of a split on purpose.
    named = [p for p in files if re.search(r"(?<![a-z])train", p.relative_to(root).with_suffix("").as_posix().lower())]
    chosen = named or files
    shards: dict[tuple, set[int]] = {}
    for p in chosen:
        if m := re.fullmatch(r"(.*)-(\d+)-of-(\d+)(-[0-9a-f]+)?", p.stem):
            shards.setdefault((p.parent, m[1], int(m[3]), len(m[2]), p.suffix), set()).add(int(m[2]))
    splits = sorted({stem for _, stem, _, _, _ in shards if re.match(r"train", stem.lower())})
    if len(splits) > 1:
        raise ValueError(f"{name}: its train files are of {len(splits)} splits ({', '.join(splits)}); pass the "
                         "files of one, a folder that holds them alone: hf download --repo-type dataset ID "
                         + " or ".join(f"--include '*{split}-*'" for split in splits)
                         + " --local-dir DIR, then --data DIR (files of yours: name them as one split to mix them)")
    for (folder, stem, total, width, suffix), have in shards.items() if whole else ():
        first = 1 if max(have) == total else 0  # the hub numbers datasets' shards from 0; some tools from 1
        if missing := sorted(set(range(first, total + first)) - have):
            raise FileNotFoundError(f"{name}: {folder / stem}-{missing[0]:0{width}d}-of-{total:0{width}d}*{suffix} is "
                                    f"missing ({len(missing)} of its {total} shards): a partial download; fetch the "
                                    "whole split again (hf download --repo-type dataset ID, where you are online)")
    return chosen


def check_source(source: str, flag: str = "--data") -> None:
    # A path that is not there (runs/x/y with a runs/ folder here is a typo, not a hub id) is never downloaded:
    # said by data_files, and by train.py before the model loads.
    path = Path(source)
    if not (path.is_dir() or path.is_file() or hub.HUB_ID.fullmatch(source) and not hub.looks_local(source)):
        raise FileNotFoundError(f"{flag} {source}: no such file or folder{hub.nearby(path)}; pass a "
                                ".jsonl/.json/.parquet chat file, a folder of them or a Hugging Face dataset id "
                                "such as allenai/Dolci-Instruct-SFT")


def data_files(source: str, flag: str = "--data") -> list[Path]:
    # source: a chat file (.jsonl, .json, .parquet), a folder of them (its *train* files when
    # some are named so), or a Hugging Face dataset id. flag: the option that named it, for messages.
    check_source(source, flag)
    path = Path(source)
    if path.is_dir():  # its own files; where it has none, those in its folders (a hub download's data/)
        files = sorted(p for p in path.iterdir() if is_data(p) and p.is_file()) or data_below(path)
        files = _train_split(files, path, f"{flag} {source}")
    elif path.is_file():
        files = [path]
    else:
        files = _download_dataset(source)
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
                    raise RowError(f"{location}: line over {max_bytes / 2**20:g} MiB, too long for one chat row; it "
                                   "was skipped unread (is the file one JSON array? then name it .json)",
                                   "line too long")
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
        # Atomic: written to a temporary folder, then renamed; a killed run leaves no half cache. The temporary
        # folder is named for this machine and process: one that a dead process here left goes now.
        mine = f".tmp-{folder.name}-{this_host()}-"  # then the process id, and nothing else
        tmp = folder.parent / f"{mine}{os.getpid()}"
        for stale in left_by_dead(folder.parent, mine):
            shutil.rmtree(stale, ignore_errors=True)
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
                    last_turn_only: bool = False, holes: bool = False, log=None, every_s: float = 30.0,
                    tick=None) -> Examples:
    # docs/method.md §1: each conversation through the chat template (its supervised tokens), then cut and
    # block-padded (data.fit_to_blocks); the stats count what was truncated, dropped and padded. holes: a
    # dropped conversation leaves an empty example, so that example r is conversation r (a part of the
    # rows, for join_parts). log: given, a line on the rows done every every_s seconds (a large data set
    # takes minutes). tick: given, called with the rows done since its last call, every 1024 rows and at the end.
    assert max_len >= block_size, f"max_len={max_len} is shorter than one block (block_size={block_size})"
    cap = max_len - max_len % block_size  # what fit_to_blocks keeps of an example
    ids_all, sup_all, lengths, pending = [], [], [], ([], [])
    stats = dict(examples=0, kept=0, truncated=0, dropped_prompt_too_long=0,
                 dropped_no_assistant=0, eos_pad_tokens=0, tokens=0, supervised_tokens=0)
    t0 = time.monotonic()
    report = t0 + every_s
    for messages in conversations:
        stats["examples"] += 1
        if tick is not None and stats["examples"] % 1024 == 0:
            tick(1024)
        if log is not None and (now := time.monotonic()) >= report:
            log(f"tokenizing: {stats['examples'] - 1} rows done, {(stats['examples'] - 1) / (now - t0):.0f} rows/s")
            report = now + every_s
        ids, sup = tok.encode_chat_with_mask(messages, last_turn_only=last_turn_only)
        if not any(sup):
            stats["dropped_no_assistant"] += 1
            lengths += [0] * holes
            continue
        end = reply_end(sup)  # the turns after the last reply, with no target, are no part of the example
        stats["truncated"] += int(end > cap)
        fitted = fit_to_blocks(ids, sup, max_len, block_size, tok.eos_id)
        if fitted is None:
            stats["dropped_prompt_too_long"] += 1
            lengths += [0] * holes
            continue
        stats["eos_pad_tokens"] += len(fitted[0]) - min(end, cap)
        ids, sup = fitted
        pending[0].extend(ids)
        pending[1].extend(sup)
        lengths.append(len(ids))
        if len(pending[0]) > 1 << 22:  # flush to numpy every few million tokens: bounded Python lists
            ids_all.append(np.asarray(pending[0], np.int32))
            sup_all.append(np.asarray(pending[1], bool))
            pending = ([], [])
    if tick is not None:
        tick(stats["examples"] % 1024)
    ids_all.append(np.asarray(pending[0], np.int32))
    sup_all.append(np.asarray(pending[1], bool))
    ids, sup = np.concatenate(ids_all), np.concatenate(sup_all)
    offsets = np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))]).astype(np.int64)
    stats["kept"] = int(np.count_nonzero(lengths))  # a kept example has at least one block
    stats["tokens"] = int(offsets[-1])
    stats["supervised_tokens"] = int(sup.sum())
    return Examples(ids, sup, offsets, stats)


def this_host() -> str:  # this machine's name, as a part of a file name
    return re.sub(r"[^\w.-]", "_", socket.gethostname())


def left_by_dead(folder: Path, mine: str, after: str = "") -> list[Path]:
    # What dead processes of this machine left in folder: the names `mine` + a process id + `after` (a regex).
    found = []
    for path in folder.glob(f"{mine}*"):
        if (m := re.fullmatch(rf"(\d+){after}", path.name.removeprefix(mine))) and not alive(int(m[1])):
            found.append(path)
    return found


def alive(pid: int) -> bool:  # a process of that id runs on this machine
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def tokenizer_key(tok) -> str:
    # What the ids depend on: the vocabulary, the special tokens and the default system prompt.
    h = hashlib.sha256()
    for token, rank in sorted(tok.ranks.items(), key=lambda kv: kv[1]):
        h.update(rank.to_bytes(4, "little") + token)
    h.update(json.dumps([sorted(tok.special.items()), tok.default_system]).encode())
    return h.hexdigest()


def join_parts(parts: list[Examples]) -> Examples:
    # parts[j] of n holds conversations j, j + n, j + 2n, ..., one example each, empty where dropped
    # (encode_examples with holes) -> the kept examples in the rows' order with the stats summed: what one
    # process tokenizing every row makes. Every process read all the rows: the row counts are part 0's.
    n, total = len(parts), sum(len(p) for p in parts)
    kept = [ex for ex in (parts[r % n][r // n] for r in range(total)) if len(ex[0])]
    lengths = np.array([len(ids) for ids, _ in kept], np.int64)
    ids = np.concatenate([np.zeros(0, np.int32)] + [ids for ids, _ in kept])
    sup = np.concatenate([np.zeros(0, bool)] + [sup for _, sup in kept])
    stats = {k: sum(p.stats[k] for p in parts) for k in parts[0].stats if k != "rows"}
    stats["rows"] = parts[0].stats.get("rows", {})
    return Examples(ids, sup, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), stats)


def load_examples(source: str, tok, max_len: int, block_size: int, last_turn_only: bool = False,
                  part: tuple[int, int] = (0, 1), log=print, flag: str = "--data") -> Examples:
    # The tokenized data set, tokenized once: cached beside the data in .mars-cache/ (or in
    # ~/.cache/mars when that folder is read-only), keyed by the files (path, size, mtime), the
    # tokenizer and the settings that change ids, so a resume or a second stage loads it in
    # seconds. part (i, n): this process is the i-th of the n on this machine (local rank, local world
    # size). Without a cache, each reads every row and tokenizes rows i, i + n, ... into a part folder
    # beside the cache (reading is cheap next to tokenizing, and a stride balances long and short rows);
    # process 0 joins the parts into the cache (join_parts) and the others wait for it. A wait gives up
    # after WAIT_FOR_TOKENIZER_S. A run alone on its machine shares large files out to worker processes
    # (workers, in_workers) the same way.
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

    def wait(path: Path, who: str) -> None:  # no collective to time out, so the wait has its own limit
        wait_s = WAIT_FOR_TOKENIZER_S
        deadline = time.monotonic() + wait_s
        while not (done(path) or done(folder)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{flag} {source}: waited {wait_s:.0f} s for {who} to tokenize it into {path}; "
                                   "if that process died, see its log, or tokenize once with a single process "
                                   "(python train.py --max-steps 1 ...) and relaunch")
            time.sleep(min(0.5, wait_s / 10))

    def join(parts: list[Path]) -> None:  # the shares into the cache, then gone
        try:
            if not done(folder):
                join_parts([Examples.load(p) for p in parts]).save(folder)
        except FileNotFoundError:  # another process on these files (another run, or another machine's first
            if not done(folder):  # process sharing this folder) joined the shares first, and removed them
                raise
        for p in parts:
            shutil.rmtree(p, ignore_errors=True)

    i, n = part
    share = partial(encode_share, files, f"{flag} {source}", tok, max_len, block_size, last_turn_only)
    host = this_host()  # machines sharing the disk each tokenize and join their own shares
    if not done(folder) and n == 1 and (w := workers(files)) > 1:  # the only process here: its cores share the rows
        parts = [base / f".{folder.name}-{host}-part-{j}-of-{w}" for j in range(w)]
        # a killed run's shares at another count (this takes no other run to be tokenizing these files here)
        for stale in set(base.glob(f".{folder.name}-{host}-part-*")) - set(parts):
            shutil.rmtree(stale, ignore_errors=True)
        saved = sum(map(done, parts))
        log(f"tokenizing {source} once into {folder}, a 1/{w} share in each of {w} worker processes"
            + (f"; {saved} of the shares {'was' if saved == 1 else 'were'} saved by an earlier run" if saved else ""))
        in_workers(share, parts, log)
        join(parts)
    if not done(folder):
        parts = [base / f".{folder.name}-{host}-part-{j}-of-{n}" for j in range(n)] if n > 1 else [folder]
        if not done(parts[i]):
            log(f"tokenizing {source} once into {folder}" + (f", a 1/{n} share in each of {n} processes" * (n > 1)))
            share(i, n, parts[i], log if i == 0 else None)
        if i > 0:
            wait(folder, "the first process")
        elif n > 1:
            for j in range(1, n):
                wait(parts[j], f"process {j} of {n}")
            join(parts)
    return Examples.load(folder)


def done(folder: Path) -> bool:  # a saved Examples: Examples.save renames a whole folder into place
    return (folder / "stats.json").exists()


def encode_share(files: list[Path], name: str, tok, max_len: int, block_size: int, last_turn_only: bool, i: int,
                 n: int, folder: Path, log=None, tick=None) -> None:
    # Rows i, i + n, i + 2n, ... of the files tokenized into folder (every row, n = 1); the rows' outcomes are
    # counted over all of them, as each share reads every row.
    counts = {}
    rows = iter_conversations(files, counts, name, MAX_ROW_BYTES)
    examples = encode_examples(tok, itertools.islice(rows, i, None, n), max_len, block_size, last_turn_only,
                               holes=n > 1, log=log, tick=tick)
    examples.stats["rows"] = counts
    examples.save(folder)


def workers(files: list[Path]) -> int:
    # How many processes tokenize files when a run is the only process on its machine: MARS_TOKENIZE_WORKERS when
    # set (1: the run's own process), else one a core up to MAX_WORKERS for files of WORKERS_FROM_BYTES or more.
    if env := os.environ.get("MARS_TOKENIZE_WORKERS"):
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"MARS_TOKENIZE_WORKERS={env!r}: give a number of processes, 1 or more (1: tokenize in "
                             "the run's own process)")
        return int(env)
    if sum(f.stat().st_size for f in files) < WORKERS_FROM_BYTES:
        return 1
    n = max(1, min(MAX_WORKERS, cli.cores()))
    # A worker reads each JSON array whole, one file at a time: as many workers as the free memory holds of the
    # largest (unknown free memory: no bound).
    largest = max((f.stat().st_size for f in files if json_array(f)), default=0)
    free = cli.available_memory() if largest else None
    return n if free is None else min(n, max(1, free // (JSON_MEMORY * largest)))


ROWS_DONE = None  # in a worker process: the rows every worker has tokenized so far, shared


def _tick(rows: int) -> None:
    if not multiprocessing.parent_process().is_alive():  # the run was killed: its workers stop too
        os._exit(1)
    with ROWS_DONE.get_lock():
        ROWS_DONE.value += rows


def _share_main(share_file: Path, j: int, w: int, folder: Path, counter, errors) -> None:  # a worker process
    global ROWS_DONE
    ROWS_DONE = counter
    try:
        share = pickle.loads(share_file.read_bytes())
        share(j, w, folder, None, _tick)
    except BaseException as e:  # to the run, which raises it as its own, with this process's traceback
        e.add_note(f"in tokenizing worker {j} of {w}:\n{traceback.format_exc()}")
        try:
            errors.put(e)
        except Exception:  # an error that does not pickle
            errors.put(RuntimeError(f"{type(e).__name__}: {e}"))
        sys.exit(1)


def in_workers(share, parts: list[Path], log) -> None:
    # share(j, w, parts[j], None, tick) for each part j of w not yet saved (a killed run's finished shares stay),
    # each in a process of its own, all at once, with a line every PROGRESS_S seconds on the rows done. The first
    # share that fails ends the others, and its error is raised here; so does an interrupt, and a killed run's
    # workers stop at their next 1024 rows. Spawned, not forked: the run may hold threads (torch's) and CUDA.
    # share (the tokenizer, megabytes) goes through a file of this user's alone, in the temporary folder: as a
    # Process argument it would be written into a pipe the child reads only once it has imported the run's main
    # module, and a child that dies before that would leave this process blocked in start() for good. Its name
    # holds this process's id: a file that a killed run here left goes now.
    ctx = multiprocessing.get_context("spawn")
    counter, errors, t0 = ctx.Value("q", 0), ctx.SimpleQueue(), time.monotonic()
    todo = [j for j in range(len(parts)) if not done(parts[j])]
    mine = f"mars-tokenizer-{this_host()}-"
    for stale in left_by_dead(Path(tempfile.gettempdir()), mine, after=r"-.*\.pickle"):
        stale.unlink(missing_ok=True)
    share_file = None
    procs = []
    shown = t0
    try:
        with writing(Path(tempfile.gettempdir()) / mine, "free some space in the temporary folder (TMPDIR)"):
            fd, name = tempfile.mkstemp(prefix=f"{mine}{os.getpid()}-", suffix=".pickle")  # mode 0600
            share_file = Path(name)
            with os.fdopen(fd, "wb") as f:
                f.write(pickle.dumps(share) if todo else b"")
        procs = [ctx.Process(target=_share_main, args=(share_file, j, len(parts), parts[j], counter, errors),
                             daemon=True, name=f"mars-tokenize-{j}") for j in todo]
        for proc in procs:
            proc.start()
        while (live := [proc for proc in procs if proc.exitcode is None]) and not any(proc.exitcode for proc in procs):
            connection.wait([proc.sentinel for proc in live], timeout=max(0.0, shown + PROGRESS_S - time.monotonic()))
            if (now := time.monotonic()) >= shown + PROGRESS_S:
                shown = now
                log(f"tokenizing: about {counter.value} rows done, {counter.value / (now - t0):.0f} rows/s "
                    f"in {len(live)} process" + "es" * (len(live) != 1))
        if failed := next((proc for proc in procs if proc.exitcode), None):
            if not errors.empty():
                raise errors.get()
            raise RuntimeError(f"a tokenizing worker process ended with exit status {failed.exitcode} (killed: out of "
                               "memory?); MARS_TOKENIZE_WORKERS=1 tokenizes in the run's own process")
    finally:
        for proc in procs:
            if proc.pid is not None:  # started
                if proc.exitcode is None:
                    proc.terminate()
                proc.join()
        if share_file is not None:
            share_file.unlink(missing_ok=True)
    if procs:
        log(f"tokenized {counter.value} rows in {time.monotonic() - t0:.0f} s in {len(procs)} worker process"
            + "es" * (len(procs) != 1))


def describe(stats: dict, name: str, max_len: int) -> str:
    text = (f"{name}: {stats['examples']} examples, {stats['kept']} kept, "
            f"{stats['truncated']} truncated to max_len={max_len}, "
            f"{stats['dropped_prompt_too_long']} dropped (prompt alone fills max_len), "
            f"{stats['dropped_no_assistant']} dropped (no reply to train on); "
            f"{stats['tokens']} tokens, {stats['supervised_tokens']} supervised, "
            f"{stats['eos_pad_tokens']} of them EOS block padding")
    rows = stats.get("rows")
    if rows:  # the per-row outcomes of reading the files
        outcomes = {k: v for k, v in rows.items() if k != "first skipped"}
        text += "\n  rows: " + ", ".join(f"{v} {k}" for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1]))
        for reason, first in rows.get("first skipped", {}).items():
            text += f"\n  first {reason}: {first}"
    return text
