# Prompts in and text out for the decoding entry points (generate.py, tools/bench.py, tools/bench_serve.py):
# --prompt texts and JSONL prompt files, read with one error per bad line and rendered as token ids; the
# streamed text and the report of what a run decoded.
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

from files import jsonl
from tokenizer import Tokenizer


def read_prompts(path: str) -> list[tuple[str, dict]]:
    # JSONL -> [("file:line", {"messages": [...], ...} or {"prompt": str})]; a bad line names file:line.
    if not Path(path).is_file():
        raise FileNotFoundError(f"--prompts {path}: file not found")
    rows = []
    for i, row in jsonl(path, "save the file as UTF-8 JSON Lines, one prompt object per line"):
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
    for source, row in rows:
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        try:
            ids.append(tok.encode(row["prompt"]) if raw and "prompt" in row else
                       tok.encode_chat(messages, add_generation_prompt=True))  # checks the messages
            if not any(m["content"].strip() for m in messages):
                raise ValueError("empty prompt; give it some text")
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from e
        if len(ids[-1]) + max_new_tokens > context:
            raise ValueError(f"{source}: {len(ids[-1])} tokens + --max-new-tokens {max_new_tokens} exceed "
                             f"the model's context of {context} (max_position_embeddings in config.json); "
                             "shorten the prompt or lower --max-new-tokens")
    return ids


def streamer(tok: Tokenizer) -> Callable[[int, list[int]], None]:
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


def report(s, tok: Tokenizer, prompts: list[list[int]], outs: list[list[int]], forwards: list[int],
           stats, seconds: float, first: float) -> None:
    # What generate.py prints; s: its Settings (json, verify). forwards: per prompt, the forwards its row
    # took part in (the prompt's counts), so tokens per forward is per sequence, as in the paper, at any
    # batch size. stats: generate.Stats, per prompt the drafts offered and accepted with --verify.
    new_tokens = sum(map(len, outs))
    for i, (p, o, f) in enumerate(zip(prompts, outs, forwards)):
        text = tok.decode([t for t in o if t not in tok.stop_ids])
        if s.json:
            drafts = verify_stats(stats.offered[i], stats.accepted[i]) if s.verify else {}
            print(json.dumps({"prompt_ids": p, "output_ids": o, "text": text, "forwards": f,
                              "tokens_per_forward": len(o) / f, **drafts}))
        elif len(prompts) > 1:
            print(f"--- {i + 1} ---\n{text}")
    summary = {"prompts": len(prompts), "new_tokens": new_tokens, "forwards": sum(forwards),
               "tokens_per_forward": new_tokens / sum(forwards), "seconds": seconds,
               "tokens_per_second": new_tokens / seconds}
    if s.verify:
        summary |= verify_stats(sum(stats.offered), sum(stats.accepted))
    if s.json:
        print(json.dumps({"summary": summary}))
    else:
        accepted = (f" | drafts accepted {summary['drafts_accepted']}/{summary['drafts_offered']}"
                    if s.verify else "")
        print(f"\nprompt tokens {sum(map(len, prompts))} | new tokens {new_tokens} | forwards "
              f"{sum(forwards)} | {summary['tokens_per_forward']:.2f} tokens/forward{accepted} | "
              f"{summary['tokens_per_second']:.1f} tok/s | first token {first * 1000:.0f} ms", file=sys.stderr)


def verify_stats(offered: int, accepted: int) -> dict:
    return {"drafts_offered": offered, "drafts_accepted": accepted,
            "acceptance_rate": accepted / offered if offered else None}
