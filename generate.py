# MARS decoding (MARS.md §6) with three KV-cache strategies (§7), sampling, and a CLI.
#
# Each step appends mask tokens after the committed text and runs one causal forward. Slot 0 is the
# ordinary next-token prediction from the last real token; slot i > 0 comes from the (i-1)-th mask.
# Slot 0 is always accepted, later slots left to right while their confidence is >= tau.
#
#   python generate.py --ckpt runs/demo/mars --prompt "What is 12 + 7?" --threshold 0.9
from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Literal

import torch

import cli
from hub import resolve_checkpoint
from kvcache import KVCache
from model import DTYPES, Config, Transformer, checkpoint_files
from tokenizer import Tokenizer

DEFAULT_CKPT = "runs/demo/mars"  # where `make demo` leaves its MARS checkpoint
CACHES = ("none", "step", "cursor", "block")
Stops = set[int] | frozenset[int]  # token ids that end a row: <|im_end|>, <|endoftext|>
OnAccept = Callable[[int, list[int]], None]  # (row, tokens accepted this step), for streaming


# ---- one step: candidates, confidences, acceptance ----

def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    # logits (..., V) -> token (...), confidence (...): the token's probability in float32 (§6.3).
    probs = torch.softmax(logits.float() / (temperature or 1.0), dim=-1)
    if temperature == 0:
        conf, tok = probs.max(dim=-1)  # greedy: the paper's setting
        return tok, conf
    if top_p < 1.0:  # keep the smallest set of tokens whose mass reaches top_p, then renormalise
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    tok = torch.multinomial(probs.flatten(0, -2), 1, generator=generator).view(probs.shape[:-1])
    return tok, probs.gather(-1, tok[..., None])[..., 0]


def accept_count(conf: torch.Tensor, tau: float | list[float]) -> torch.Tensor:
    # conf (R, W) -> accepted slots per row (R,): slot 0 always, then while conf >= tau (§6.4).
    # tau: one threshold, or one per row (a server mixes requests with their own thresholds).
    # tau == 1.0 is one token per step by rule: a bf16 probability can round to exactly 1.0.
    taus = [tau] * conf.shape[0] if isinstance(tau, (int, float)) else list(tau)
    if min(taus) >= 1.0 or conf.shape[1] == 1:
        return torch.ones(conf.shape[0], dtype=torch.long, device=conf.device)
    t = torch.tensor(taus, dtype=conf.dtype, device=conf.device)[:, None]  # (R, 1)
    ok = (conf[:, 1:] >= t) & (t < 1.0)
    return 1 + ok.long().cumprod(dim=1).sum(dim=1)


def allowed(logits: torch.Tensor, mask_id: int, vocab_size: int | None) -> torch.Tensor:
    # Candidates are real tokens: not the mask (an input symbol only), not the spare embedding rows
    # past the tokenizer's vocabulary, which it cannot decode.
    logits = logits[..., :vocab_size]
    logits[..., mask_id] = float("-inf")
    return logits


def trim_at_stop(tokens: list[int], stop_ids: Stops) -> list[int]:
    # Keep up to and including the first stop token: what a step accepted after EOS is dropped.
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:i + 1]
    return tokens


def window(n_out: int, B: int, max_new_tokens: int, block: int) -> int:
    # How many slots a row may fill this step: B, capped by the token budget and, with block = K > 0,
    # by the end of the row's current K-token output block (§7: a step never accepts past it).
    end = (n_out // block + 1) * block if block else max_new_tokens
    return min(n_out + B, max_new_tokens, end) - n_out


# ---- the reference: the uncached sliding window, one sequence (§6) ----

@torch.inference_mode()
def decode_naive(model: Transformer, prompt: list[int], mask_id: int, stop_ids: Stops,
                 tau: float = 0.9, B: int = 4, max_new_tokens: int = 256,
                 block: int = 0, vocab_size: int | None = None) -> tuple[list[int], int]:
    # Re-runs prompt + output + B masks every step, plain causal. Every cache mode must reproduce
    # its tokens exactly (greedy, float32); `block` adds the block-cache boundaries of §7.
    out, forwards = [], 0
    while len(out) < max_new_tokens and not (out and out[-1] in stop_ids):
        c = len(prompt) + len(out)
        x = torch.tensor([prompt + out + [mask_id] * B], device=model.model.embed_tokens.weight.device)
        logits = model(x)[:, c - 1:c + B - 1]  # slot i from position c + i - 1; (1, B, V)
        tok, conf = sample(allowed(logits, mask_id, vocab_size))
        n = min(accept_count(conf, tau).item(), window(len(out), B, max_new_tokens, block))
        out += trim_at_stop(tok[0, :n].tolist(), stop_ids)
        forwards += 1
    return out, forwards


# ---- batched decoding: none, cursor and block caches in one loop (§7) ----

@torch.inference_mode()
def decode_step(model: Transformer, seqs: list[list[int]], w: list[int], mask_id: int, stop_ids: Stops,
                tau: float | list[float], kv: KVCache | None = None, temperature: float | list[float] = 0.0,
                top_p: float = 1.0, generator: torch.Generator | None = None,
                vocab_size: int | None = None) -> tuple[list[list[int]], list[int]]:
    # One forward of §6 for every row at once; decode() and serve.py's continuous batching both run it.
    # seqs[b]: row b's prompt + output so far; w[b]: the slots it may fill (0 = it sits this step out).
    # tau and temperature: one value, or one per row. Returns the tokens each row accepted (cut after
    # a stop token; [] when w[b] = 0) and len(u_b), what a cursor cache commits. Committing is the
    # caller's choice (§7), so this function leaves kv.lengths as it found them.
    #
    # Row b feeds its uncommitted real tokens u_b (everything past the cache's committed length: the
    # prompt at first) and then w_b - 1 masks: the B-th mask of §6 would only feed the unused last
    # logit. Rows are right-padded to the longest, so every row's cache columns are exactly its
    # positions, and causality alone hides both the pads and the other rows' stale columns.
    R, device = len(seqs), model.model.embed_tokens.weight.device
    lengths = kv.lengths if kv else [0] * R
    u = [seqs[b][lengths[b]:] if w[b] else [] for b in range(R)]
    rows = [u[b] + [mask_id] * max(w[b] - 1, 0) for b in range(R)]
    T, W = max(map(len, rows)), max(w)
    x = torch.tensor([r + [mask_id] * (T - len(r)) for r in rows], device=device)  # (R, T)
    # Query j of row b sits at position (= cache column) lengths[b] + j and sees columns <= it.
    pos = torch.tensor(lengths, device=device)[:, None] + torch.arange(T, device=device)  # (R, T)
    mask = None if kv is None else (
        torch.arange(max(lengths) + T, device=device) <= pos[..., None])[:, None]  # (R, 1, T, S)
    h = model.hidden(x, pos, mask, kv)  # (R, T, C)
    # Slot i of row b reads position len(u_b) - 1 + i; the lm_head runs on those W positions only.
    idx = torch.tensor([[min(max(len(u[b]) - 1 + i, 0), T - 1) for i in range(W)] for b in range(R)],
                       device=device)  # (R, W)
    logits = allowed(model.head(h.gather(1, idx[..., None].expand(-1, -1, h.shape[-1]))), mask_id,
                     vocab_size)  # (R, W, V)
    if isinstance(temperature, (int, float)):
        tok, conf = sample(logits, temperature, top_p, generator)  # (R, W)
    else:  # per-row temperatures: greedy rows take the argmax, the others sample at their own
        tok, conf = sample(logits)
        hot = [b for b in range(R) if temperature[b] > 0]
        if hot:
            t = torch.tensor([temperature[b] for b in hot], device=device)[:, None, None]
            tok[hot], conf[hot] = sample(logits[hot].float() / t, 1.0, top_p, generator)
    n = accept_count(conf, tau)
    step = torch.cat([n[:, None], tok], dim=1).tolist()  # the one device sync per step
    new = [trim_at_stop(step[b][1:1 + min(step[b][0], w[b])], stop_ids) if w[b] else [] for b in range(R)]
    return new, [len(ub) for ub in u]


@torch.inference_mode()
def decode(model: Transformer, prompts: list[list[int]], mask_id: int, stop_ids: Stops,
           tau: float = 0.9, B: int = 4, max_new_tokens: int = 256, cache: str = "cursor",
           block: int = 0, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None, vocab_size: int | None = None,
           on_accept: OnAccept | None = None) -> tuple[list[list[int]], list[int]]:
    # Returns each row's new tokens (up to and including its first stop token) and the forwards
    # that row took part in (the prompt forward counts). `block` = K, the output block size:
    # required by cache="block", optional for "none" (the reference with the same boundaries).
    # vocab_size: logits past it (spare embedding rows the tokenizer cannot decode) never compete.
    #
    # Each step is one decode_step over the batch. After it, row b commits of what it fed (u_b):
    #   none:   nothing, there is no cache (u_b is the whole sequence every step);
    #   cursor: all of u_b, now computed from real tokens; the mask entries are overwritten next step;
    #   block:  only what lies before the current block, so the prefix stays frozen within a block
    #           and each step re-runs the block from its start.
    if cache == "block" and block < 1:
        raise ValueError("cache='block' needs block >= 1, the output block size K")
    if tau >= 1.0:  # one token per step by rule (§6), so the masks would be dead weight: plain AR
        B = 1
    if cache == "step":  # §7's single sequence: a batch is decoded one prompt at a time
        results = [decode(model, [p], mask_id, stop_ids, tau=tau, B=B, max_new_tokens=max_new_tokens,
                          cache="cursor", temperature=temperature, top_p=top_p, generator=generator,
                          vocab_size=vocab_size, on_accept=on_accept and (lambda _, t, i=i: on_accept(i, t)))
                   for i, p in enumerate(prompts)]
        return [o[0] for o, _ in results], [f[0] for _, f in results]
    R, device = len(prompts), model.model.embed_tokens.weight.device
    kv = None
    if cache != "none":
        max_len = max(map(len, prompts)) + max_new_tokens + max(block, B) + B
        kv = KVCache(model.config, R, max_len, device, model.model.embed_tokens.weight.dtype)
    out: list[list[int]] = [[] for _ in prompts]
    forwards, done = [0] * R, [False] * R
    k = 0  # block mode: the batch's current output block (every row is in the same one)
    while not all(done):
        if cache == "block" and all(done[b] or len(out[b]) == (k + 1) * block for b in range(R)):
            k += 1  # every row filled block k: this forward commits it and opens block k + 1
        # Slots per row; 0 = the row sits this step out: finished, or waiting for the batch to fill block k.
        w = [0 if done[b] or cache == "block" and len(out[b]) == (k + 1) * block
             else window(len(out[b]), B, max_new_tokens, block) for b in range(R)]
        new, fed = decode_step(model, [p + o for p, o in zip(prompts, out)], w, mask_id, stop_ids, tau, kv,
                               temperature, top_p, generator, vocab_size)
        for b in range(R):
            if not w[b]:
                continue
            out[b] += new[b]
            forwards[b] += 1
            done[b] = new[b][-1] in stop_ids or len(out[b]) == max_new_tokens
            if on_accept:
                on_accept(b, new[b])
        if kv is not None:
            start = [len(prompts[b]) + k * block for b in range(R)]  # the current block's start
            kv.commit([0 if not w[b] else fed[b] if cache == "cursor" else start[b] - kv.lengths[b]
                       for b in range(R)])
    return out, forwards


# ---- CLI ----

@dataclass
class Settings:
    ckpt: str = DEFAULT_CKPT  # checkpoint directory, hub id (owner/name) or alias (qwen2.5-0.5b, qwen2.5-7b)
    prompt: list[str] = field(default_factory=list)  # user message(s); several after one flag or repeated
    prompts: str = ""  # JSONL file, one {"messages": [...]} or {"prompt": "..."} per line
    threshold: float = 0.9  # tau: accept slots after the first while confidence >= tau; 1.0 = plain AR
    block_size: int = 4  # B: slots per step, the window the model was trained with
    max_new_tokens: int = 256  # per prompt
    batch_size: int = 8  # prompts decoded together
    cache: Literal["none", "step", "cursor", "block"] = "cursor"  # none = sliding-window reference; see decode()
    block_cache_size: int = 0  # K for --cache block (0 = 32); with --cache none: the same boundaries
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto = bfloat16 on cuda, float32 on cpu
    device: str = "auto"  # auto (cuda when available), cpu, cuda or cuda:N
    raw: bool = False  # take prompts as plain text instead of rendering a chat user message
    json: bool = False  # one JSON object per prompt, then a summary line
    temperature: float = 0.0  # 0 = greedy (the paper); else sample, confidence = drawn token's prob
    top_p: float = 1.0  # nucleus sampling mass, with temperature > 0
    seed: int = 0  # seeds the sampling generator


def check_settings(s: Settings) -> None:
    # Everything that can be wrong with the flags alone, before any file is read.
    if not 0.0 <= s.threshold <= 1.0:
        raise ValueError(f"--threshold {s.threshold} is outside [0, 1]; 1.0 decodes one token per step")
    for name in ("block_size", "max_new_tokens", "batch_size"):
        if getattr(s, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(s, name)} must be at least 1")
    if s.block_cache_size < 0 or (s.block_cache_size and s.cache not in ("block", "none")):
        raise ValueError(f"--block-cache-size {s.block_cache_size}: needs a positive size and "
                         "--cache block (or --cache none for the reference with the same blocks)")
    if s.temperature < 0 or not 0.0 < s.top_p <= 1.0:
        raise ValueError(f"--temperature {s.temperature} must be >= 0 and --top-p {s.top_p} in (0, 1]")
    device_and_dtype(s.device, s.dtype)
    if not s.prompt and not s.prompts:
        raise ValueError("no prompt: pass --prompt TEXT or --prompts FILE.jsonl")


def device_and_dtype(device: str, dtype: str) -> tuple[str, torch.dtype]:
    # "auto" -> cuda when available, and bfloat16 on cuda, float32 on cpu.
    if device != "auto" and device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", device):
        raise ValueError(f"--device {device}: choose auto, cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here; use --device cpu")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    return device, DTYPES[("bfloat16" if device.startswith("cuda") else "float32") if dtype == "auto" else dtype]


def check_checkpoint(ckpt: str) -> tuple[Path, Config]:
    # A directory, an alias or a hub id (downloaded on first use) -> (local directory, its config).
    # Reads config.json and the safetensors headers only; the weights load later.
    if ckpt == DEFAULT_CKPT and not Path(ckpt).is_dir():
        raise FileNotFoundError(f"no checkpoint at {ckpt}: run `make demo` (or `make quickstart`) "
                                "first, or pass --ckpt DIR")
    path = resolve_checkpoint(ckpt)
    config = Config.from_json(path / "config.json")
    checkpoint_files(path)
    return path, config


def read_prompts(path: str) -> list[tuple[str, dict]]:
    # JSONL -> [("file:line", {"messages": [...], ...} or {"prompt": str})]; a bad line names file:line.
    if not Path(path).is_file():
        raise FileNotFoundError(f"--prompts {path}: file not found")
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from e
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            rows.append((f"{path}:{i}", {"prompt": row["prompt"]}))
        elif isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
            # A test set's rows (tasks.py) end with the reference answer: not part of the prompt.
            # Other keys ("family", "answer") stay for the callers that score the outputs.
            messages = list(row["messages"])
            while len(messages) > 1 and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
                messages.pop()
            rows.append((f"{path}:{i}", {**row, "messages": messages}))
        else:
            raise ValueError(f'{path}:{i}: expected {{"prompt": "text"}} or {{"messages": [{{"role": ..., '
                             '"content": ...}, ...]}')
    if not rows:
        raise ValueError(f"{path}: no prompts in the file")
    return rows


def encode_prompts(texts: list[str], file: str, raw: bool, tok: Tokenizer, max_new_tokens: int,
                   context: int) -> list[list[int]]:
    # --prompt texts, then the file's lines, as token ids: chat-rendered unless raw (file "messages"
    # are always chat). Checks each fits the context with its max_new_tokens.
    rows = [(f"--prompt {i}", {"prompt": t}) for i, t in enumerate(texts, 1)] + (read_prompts(file) if file else [])
    ids = []
    for where, row in rows:
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        try:
            ids.append(tok.encode(row["prompt"]) if raw and "prompt" in row else
                       tok.encode_chat(messages, add_generation_prompt=True))  # checks the messages
            if not any(m["content"].strip() for m in messages):
                raise ValueError("empty prompt; give it some text")
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        if len(ids[-1]) + max_new_tokens > context:
            raise ValueError(f"{where}: {len(ids[-1])} tokens + --max-new-tokens {max_new_tokens} exceed "
                             f"the model's context of {context} (max_position_embeddings in config.json); "
                             "shorten the prompt or lower --max-new-tokens")
    return ids


def streamer(tok: Tokenizer) -> OnAccept:
    # Prints one row's text as steps accept tokens, holding back an unfinished UTF-8 character.
    ids, shown = [], 0

    def on_accept(row: int, new: list[int]) -> None:
        nonlocal shown
        ids.extend(t for t in new if t not in tok.stop_ids)
        text = tok.decode(ids)
        if not text.endswith("\ufffd"):
            print(text[shown:], end="", flush=True)
            shown = len(text)
    return on_accept


def main(argv: list[str] | None = None) -> None:
    s = cli.parse(Settings, argv, "MARS decoding: several tokens per forward (MARS.md §6-7).")
    try:  # every input check runs before the weights load
        check_settings(s)
        path, config = check_checkpoint(s.ckpt)
        tok = Tokenizer.from_pretrained(path)
        prompts = encode_prompts(s.prompt, s.prompts, s.raw, tok, s.max_new_tokens, config.max_position_embeddings)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    device, dtype = device_and_dtype(s.device, s.dtype)
    block = s.block_cache_size or (32 if s.cache == "block" else 0)
    model = Transformer.from_pretrained(path, device=device, dtype=dtype).eval()
    generator = torch.Generator(device=device).manual_seed(s.seed)
    if not s.json:
        print({**asdict(s), "device": device, "dtype": str(dtype), "block_cache_size": block}, file=sys.stderr)

    outs, forwards, first, seconds = [], [], None, 0.0
    for i in range(0, len(prompts), s.batch_size):
        batch = prompts[i:i + s.batch_size]
        stream = streamer(tok) if len(prompts) == 1 and not s.json else None
        t0 = time.perf_counter()

        def on_accept(row: int, new: list[int], t0: float = t0, stream: OnAccept | None = stream) -> None:
            nonlocal first
            first = first or time.perf_counter() - t0
            if stream:
                stream(row, new)

        o, f = decode(model, batch, tok.mask_id, tok.stop_ids, tau=s.threshold, B=s.block_size,
                      max_new_tokens=s.max_new_tokens, cache=s.cache, block=block,
                      temperature=s.temperature, top_p=s.top_p, generator=generator,
                      vocab_size=tok.vocab_size, on_accept=on_accept)
        seconds += time.perf_counter() - t0
        outs += o
        forwards += f

    # forwards: summed over prompts, each counting the forwards its row took part in (§6: the
    # prompt's counts), so tokens per forward is per sequence, as in the paper, at any batch size.
    new_tokens = sum(map(len, outs))
    for i, (p, o, f) in enumerate(zip(prompts, outs, forwards)):
        text = tok.decode([t for t in o if t not in tok.stop_ids])
        if s.json:
            print(json.dumps({"prompt_ids": p, "output_ids": o, "text": text, "forwards": f,
                              "tokens_per_forward": len(o) / f}))
        elif len(prompts) > 1:
            print(f"--- {i + 1} ---\n{text}")
    summary = {"prompts": len(prompts), "new_tokens": new_tokens, "forwards": sum(forwards),
               "tokens_per_forward": new_tokens / sum(forwards), "seconds": seconds,
               "tokens_per_second": new_tokens / seconds}
    if s.json:
        print(json.dumps({"summary": summary}))
    else:
        print(f"\nprompt tokens {sum(map(len, prompts))} | new tokens {new_tokens} | forwards "
              f"{sum(forwards)} | {summary['tokens_per_forward']:.2f} tokens/forward | "
              f"{summary['tokens_per_second']:.1f} tok/s | first token {first * 1000:.0f} ms", file=sys.stderr)


if __name__ == "__main__":
    main()
