# MARS data (MARS.md §1-4): chat files in, (ids, supervised) examples out, then the two-stream
# batch: clean tokens followed by a noisy copy whose response tokens are all <|mask|>, both at the same
# positions, under the block-causal mask of §3 (mars_mask), with right-shifted labels (make_batch).
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import hub
from tokenizer import check_messages

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant"}
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
    try:
        check_messages(messages)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _rows(file: Path):
    # Yields (where, row), where = "file:line" (JSONL), "file: entry i" (JSON array) or "file: row i".
    if file.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(f"{file}: reading parquet needs pyarrow, which is not installed; "
                              "pip install pyarrow, or convert the file to JSONL") from e
        try:
            table = pq.read_table(file)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise ValueError(f"{file}: not a readable parquet file ({e}); write it again or convert it "
                             "to JSONL") from e
        for i, row in enumerate(table.to_pylist()):
            yield f"{file}: row {i}", row
        return
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{file}:{line}: not UTF-8 text (byte {raw[e.start]:#04x}); save the file as "
                         "UTF-8") from e
    if file.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})") from e
        except RecursionError as e:
            raise ValueError(f"{file}: JSON nested too deeply for chat data") from e
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
        except RecursionError as e:
            raise ValueError(f"{file}:{n}: JSON nested too deeply for a chat example") from e
        yield f"{file}:{n}", row


def _download_dataset(repo_id: str) -> list[Path]:
    root = hub.download(repo_id, "dataset", ["*.parquet", "*.jsonl"], f"--data {repo_id}: not a local file",
                        "Pass a local .jsonl/.json/.parquet file instead, e.g. one downloaded where you are online")
    files = sorted(p for p in root.rglob("*") if p.suffix in (".parquet", ".jsonl"))
    if not files:
        raise FileNotFoundError(f"--data {repo_id}: the dataset has no .parquet or .jsonl files")
    return _train_split(files)


def _train_split(files: list[Path]) -> list[Path]:
    # When some file names say "train", the others are test/validation splits: leave them out.
    return [p for p in files if "train" in p.name] or files


def load_conversations(spec: str, flag: str = "--data") -> list[list[dict]]:
    # spec: a chat file (.jsonl, .json, .parquet), a folder of them (its *train* files when
    # some are named so), or a Hugging Face dataset id. flag: the option that named it, for messages.
    path = Path(spec)
    if path.is_dir():
        files = _train_split(sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".json", ".parquet")))
    elif path.is_file():
        files = [path]
    elif hub.HUB_ID.fullmatch(spec):
        files = _download_dataset(spec)
    else:
        raise FileNotFoundError(f"{flag} {spec}: no such file; pass a .jsonl/.json/.parquet chat "
                                "file or a Hugging Face dataset id such as allenai/Dolci-Instruct-SFT")
    if not files:
        raise FileNotFoundError(f"{flag} {spec}: the folder holds no .jsonl, .json or .parquet file")
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
    # What a micro-batch needs on the device: ids, positions, stream ids and labels, a few bytes per
    # column. The (N, 1, T, T) mask is not stored: it is a few comparisons of pos, stream and valid,
    # so it is built where it is used, on the device, after the copy (mask, noisy_mask).
    tokens: torch.Tensor  # (N, T) ids: L clean columns, then the noisy columns (mars mode)
    pos: torch.Tensor | None  # (N, T) RoPE positions; both streams count from 0 (MARS.md §2)
    labels: torch.Tensor  # (N, T) the clean x[p+1] where that target is supervised, else IGNORE
    L: int  # columns < L are the clean stream, columns >= L the noisy one
    noisy: torch.Tensor | None = None  # (N, T) bool, True = noisy-stream column; None = AR (causal)
    valid: torch.Tensor | None = None  # (N, T) bool, True = a real token, False = padding
    block_size: int = 1  # B of MARS.md §3

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
        # (N, 1, T, T) bool, the whole MARS.md §3 mask on this batch's device; None = plain causal (AR).
        if self.noisy is None:
            return None
        return mars_mask(self.pos, self.noisy, self.valid, self.block_size)

    def noisy_mask(self) -> torch.Tensor:
        # (N, 1, T - L, T): the mask's rows for the noisy queries only. The clean rows are plain
        # causal over the first L columns (MARS.md §3), which a causal kernel does without a mask.
        return mars_mask(self.pos, self.noisy, self.valid, self.block_size, first_query=self.L)


def mars_mask(pos: torch.Tensor, noisy: torch.Tensor, valid: torch.Tensor, block_size: int,
              first_query: int = 0) -> torch.Tensor:
    # The MARS.md §3 table, for any column layout. pos, noisy, valid: (N, T) per column: its
    # stream-local position, whether it is in the noisy stream, whether it is a real token.
    # Returns (N, 1, T - first_query, T) bool: [n, 0, i, j] = query first_query + i may attend to key j.
    T = pos.shape[1]
    pq, pk = pos[:, first_query:, None], pos[:, None, :]  # (N, Tq, 1), (N, 1, T)
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
        return Batch(x, None, labels, L)

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
    return Batch(tokens, positions, torch.cat([labels, nlab], 1), L, stream, torch.cat([valid, nvalid], 1), B)
