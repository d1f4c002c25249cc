# Prompts for the decoding entry points (generate.py, tools/bench.py, tools/bench_serve.py): --prompt
# texts and JSONL prompt files, read with one error per bad line, and rendered as token ids.
from __future__ import annotations

from pathlib import Path

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
