# generate.py's command line, and prompts in and text out for the decoding entry points (generate.py,
# tools/bench.py, tools/bench_serve.py): the flags and their checks; --prompt texts and JSONL prompt files,
# read with one error per bad line and rendered as token ids; the checkpoint and the draft budget a run
# decodes with; the streamed text and the report of what a run decoded.
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Literal

from mars import budget, compiled, quantize
from mars.checkpoint import (
    DEFAULT_CKPT,
    check_checkpoint,
    check_mask_row,
    load_model,
    trained_block_size,
    warn_untrained_masks,
)
from mars.cli import device_and_dtype
from mars.files import jsonl
from mars.layout import check_block_size
from mars.tokenizer import Tokenizer, plain_messages
from model import Transformer

DEFAULT_TAU = 0.9  # --threshold when none is given
MAX_TEMPERATURE = 100.0  # past it sampling is uniform to float32's precision, and float32 overflows soon after


# ---- the flags ----

@dataclass
class Settings:
    ckpt: str = DEFAULT_CKPT  # checkpoint directory, hub id (owner/name) or alias (qwen2.5-0.5b, qwen2.5-7b)
    prompt: list[str] = field(default_factory=list)  # user message(s); several after one flag or repeated
    prompts: str = ""  # JSONL file, one {"messages": [...]} or {"prompt": "..."} per line
    threshold: float | None = None  # tau: accept later slots while confidence >= tau (unset: 0.9); 1.0 = plain AR
    verify: bool = False  # self-verification (docs/method.md §9): exactly the greedy tokens, several per forward
    verify_layout: Literal["tree", "chain"] = "tree"  # --verify: a mask group per acceptance length | one
    draft_min: float = 0.0  # --verify: drafts stop at the first slot whose confidence is below this
    draft_budget: str = "auto"  # --verify, tree: drafts + masks a row; auto: timed (greedy), 12 (sampled); 0 = all
    tolerance: float = 1.0  # --verify, greedy: keep drafts rated >= tolerance x the top choice (lossy); 1 = exact
    block_size: int = 0  # B: slots per step; 0 = the B the checkpoint was trained with (its settings.json), else 4
    max_new_tokens: int = 256  # per prompt
    batch_size: int = 8  # prompts decoded together
    cache: Literal["none", "cursor", "block"] = "cursor"  # none = the uncached reference; see decode()
    block_cache_size: int = 0  # K for --cache block (0 = 32); with --cache none: the same boundaries
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on cuda or --quantize, else fp32
    # (fp32 for --quantize int4 on the kernel's AVX2 build, which works in fp32)
    device: str = "auto"  # auto (cuda when available), cpu, cuda or cuda:N
    quantize: Literal["none", "int8", "int4", "int4-torch"] = "none"  # weight-only linears, head (mars/quantize.py);
    # verify then gives exactly the quantized model's greedy tokens, which may differ from the float model's
    compile: bool = False  # torch.compile the decode steps at static shapes (mars/compiled.py; CUDA graphs on cuda)
    raw: bool = False  # take prompts as plain text instead of rendering a chat user message
    json: bool = False  # one JSON object per prompt, then a summary line
    temperature: float = 0.0  # 0 = greedy (the paper); else sample, confidence = drawn token's prob
    top_p: float = 1.0  # nucleus sampling mass, with temperature > 0
    seed: int = 0  # seeds each prompt's sampling generator with its place in the run (generate.prompt_generator)
    verbose: bool = False  # print the resolved settings (device, dtype, B, the measured budget) on stderr


def check_settings(s: Settings) -> None:
    # Everything that can be wrong with the flags alone, before any file is read.
    if s.threshold is not None and not 0.0 <= s.threshold <= 1.0:
        raise ValueError(f"--threshold {s.threshold} is outside [0, 1]; 1.0 decodes one token per step")
    if s.verify and s.threshold is not None:
        raise ValueError(f"--threshold {s.threshold} with --verify: verify emits exactly the greedy tokens, so no "
                         "threshold applies; drop one of the two flags")
    if s.compile and s.cache != "cursor":
        raise ValueError(f"--compile with --cache {s.cache}: the compiled step runs on the cursor cache; use "
                         "--cache cursor or drop --compile")
    if s.verify and s.cache == "block":
        raise ValueError("--verify with --cache block: verify needs --cache none or cursor")
    if not 0.0 < s.tolerance <= 1.0 or (s.tolerance < 1.0 and (not s.verify or s.temperature)):
        raise ValueError(f"--tolerance {s.tolerance}: a share in (0, 1], with --verify and greedy decoding (sampled "
                         "verify is exact speculative sampling, with no tolerance)")
    if s.draft_budget != "auto" and not (s.draft_budget.isascii() and s.draft_budget.isdigit()):
        raise ValueError(f"--draft-budget {s.draft_budget}: auto, or positions per row (0: the full tree)")
    if not 0.0 <= s.draft_min <= 1.0 or (s.draft_min and not s.verify):
        raise ValueError(f"--draft-min {s.draft_min}: a confidence in [0, 1], and only with --verify")
    check_block_size(s.block_size)
    for name in ("max_new_tokens", "batch_size"):
        if getattr(s, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(s, name)} must be at least 1")
    if s.block_cache_size < 0 or (s.block_cache_size and s.cache not in ("block", "none")):
        raise ValueError(f"--block-cache-size {s.block_cache_size}: needs a positive size and "
                         "--cache block (or --cache none for the reference with the same blocks)")
    if not 0 <= s.temperature <= MAX_TEMPERATURE or not 0.0 <= s.top_p <= 1.0:
        raise ValueError(f"--temperature {s.temperature} must be in [0, {MAX_TEMPERATURE:g}] and --top-p {s.top_p} "
                         "in [0, 1] (0: the top token alone)")
    if s.top_p < 1.0 and not s.temperature:
        raise ValueError(f"--top-p {s.top_p} samples: it needs --temperature above 0 (0 is greedy)")
    if not 0 <= s.seed < 2**63:
        raise ValueError(f"--seed {s.seed} must be in [0, 2**63)")
    if not s.verify and (s.draft_budget != "auto" or s.verify_layout != "tree"):
        flag = "--draft-budget" if s.draft_budget != "auto" else "--verify-layout"
        raise ValueError(f"{flag} applies to --verify only; add --verify or drop it")
    if s.verify_layout == "chain" and s.draft_budget != "auto":
        raise ValueError(f"--draft-budget {s.draft_budget} sizes the tree layout; the chain feeds one mask group "
                         "(drop one of the two flags)")
    quantize.check(s.quantize, *device_and_dtype(s.device, s.dtype, s.quantize))
    if not s.prompt and not s.prompts:
        raise ValueError("no prompt: pass --prompt TEXT or --prompts FILE.jsonl")


# ---- prompts in ----

def read_prompts(path: str) -> list[tuple[str, dict]]:
    # JSONL -> [("file:line", {"messages": [...], ...} or {"prompt": str})]; a bad line names file:line.
    if Path(path).is_dir():
        raise ValueError(f"--prompts {path}: a folder; pass a JSONL file of prompts")
    if not Path(path).exists():  # a pipe (<(...), /dev/stdin) is read as a file is
        raise FileNotFoundError(f"--prompts {path}: file not found")
    rows = []
    for i, row in jsonl(path, "save the file as UTF-8 JSON Lines, one prompt object per line"):
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            rows.append((f"{path}:{i}", {"prompt": row["prompt"]}))
        elif isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
            # A test set's rows (mars/tasks.py) end with the reference answer: not part of the prompt.
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
    for i, text in enumerate(texts, 1):  # bytes that are not UTF-8 come in as surrogates: the model would see U+FFFD
        if bad := next((c for c in text if "\udc80" <= c <= "\udcff"), None):
            raise ValueError(f"--prompt {i}: a byte that is not UTF-8 (0x{ord(bad) - 0xdc00:02x}); give the prompt in "
                             "UTF-8, or in a file with --prompts")
    rows = [(f"--prompt {i}", {"prompt": t}) for i, t in enumerate(texts, 1)] + (read_prompts(file) if file else [])
    ids = []
    for source, row in rows:
        try:
            if "messages" in row:  # as OpenAI clients send them: text parts, a developer role
                messages = plain_messages(row["messages"])
            else:
                messages = [{"role": "user", "content": row["prompt"]}]
            plain = raw and "messages" not in row  # raw text is the model's input as it is, whitespace too
            ids.append(tok.encode(row["prompt"]) if plain else
                       tok.encode_chat(messages, add_generation_prompt=True))  # checks the messages
            if not (row["prompt"] if plain else any(m["content"].strip() for m in messages)):
                raise ValueError("empty prompt; give it some text")
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from e
        if len(ids[-1]) + max_new_tokens > context:
            raise ValueError(f"{source}: {len(ids[-1])} tokens + --max-new-tokens {max_new_tokens} exceed "
                             f"the model's context of {context} (max_position_embeddings in config.json); "
                             "shorten the prompt or lower --max-new-tokens")
    return ids


# ---- the run: the checkpoint, the prompts, the model, the draft budget ----

def load(s: Settings) -> tuple[Settings, Tokenizer, list[list[int]], Transformer]:
    # Every input check runs before the weights load; a bad file exits with one line naming it and the
    # fix (status 1). -> the settings with B and the device resolved, the tokenizer, the prompts, the model.
    try:
        path, config = check_checkpoint(s.ckpt)
        s = replace(s, block_size=trained_block_size(path, s.block_size))
        tok = Tokenizer.from_pretrained(path)
        prompts = encode_prompts(s.prompt, s.prompts, s.raw, tok, s.max_new_tokens, config.max_position_embeddings)
        device, dtype = device_and_dtype(s.device, s.dtype, s.quantize)
        if s.compile:
            compiled.check_compiler(device)
        tau = DEFAULT_TAU if s.threshold is None else s.threshold
        check_mask_row(path, config, tok, "--verify" if s.verify else f"--threshold {tau:g}" if tau < 1 else "")
        if not s.verify:
            warn_untrained_masks(path, tau)
        return replace(s, device=device), tok, prompts, load_model(path, device, dtype, quantize=s.quantize)
    except (ValueError, OSError) as e:  # OSError: unreadable files (FileNotFoundError, PermissionError)
        sys.exit(f"error: {e}")


def sized_budget(s: Settings, model: Transformer, R: int) -> Settings:
    # --draft-budget auto for --verify's tree: t_R(n) measured here for a run of R rows (mars/budget.py). A
    # sampled run keeps budget.DEFAULT_BUDGET instead, as the server's sampled rows do: the budget sets how many
    # draws a step makes, so a measured one would make --seed's text follow the machine's load. The settings
    # then name the number, as the printed settings and the summary report it.
    if not (s.verify and s.verify_layout == "tree" and s.draft_budget == "auto" and s.block_size > 1):
        return s
    if s.temperature:
        draft_budget = min(budget.DEFAULT_BUDGET, s.block_size ** 2 - 1)  # at most the full tree
        why = "a sampled run's fixed budget, so that its --seed repeats its text"
    else:
        draft_budget, ns, seconds = budget.measured_budget(model, R, s.block_size - 1)
        why = (f"from a forward of 1 to {ns[-1]} positions measured here at {seconds[0] * 1e3:.1f} to "
               f"{seconds[-1] * 1e3:.1f} ms")
    if s.compile and not s.temperature:  # the compiled step's width is fed whatever the budget: the drafts that
        # fill it are free, and a greedy row's tokens do not follow the budget (a sampled row's draws do)
        widest = compiled.fullest_budget(s.block_size, draft_budget)
        if widest != draft_budget:
            why += f"; {draft_budget} widened to {widest}: --compile's step feeds that many at the same cost"
        draft_budget = widest
    print(f"--draft-budget auto: {draft_budget} positions per row at {R} rows, {why}", file=sys.stderr)
    return replace(s, draft_budget=str(draft_budget))


# ---- text out ----

def streamer(tok: Tokenizer) -> Callable[..., None]:
    # Prints one row's text as steps accept tokens, holding back an unfinished UTF-8 character until
    # the next step completes it, or until the call with final=True after the last step prints the rest.
    ids, shown = [], 0

    def on_accept(row: int, new: list[int], final: bool = False) -> None:
        nonlocal shown
        ids.extend(t for t in new if t not in tok.stop_ids)
        text = tok.decode(ids)
        if final or not text.endswith("\ufffd"):
            print(text[shown:], end="\n" if final else "", flush=True)  # the reply's line ends on stdout
            shown = len(text)
    return on_accept


def report(s, tok: Tokenizer, prompts: list[list[int]], outs: list[list[int]], forwards: list[int],
           stats, seconds: float, first: float) -> None:
    # What generate.py prints; s: its Settings (json, verify). forwards: per prompt, the forwards its row
    # took part in (the prompt's counts), so tokens per forward is per sequence, as in the paper, at any
    # batch size. stats: layout.Stats, per prompt the drafts offered and accepted with --verify.
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
               "tokens_per_second": new_tokens / seconds, **({"includes_compiling": True} if s.compile else {})}
    if s.verify:
        summary |= verify_stats(sum(stats.offered), sum(stats.accepted)) | {"layout": s.verify_layout}
        if s.verify_layout == "tree":  # generate.py has replaced auto with the number it measured
            summary["draft_budget"] = int(s.draft_budget) if s.draft_budget.isdigit() else s.draft_budget
    if s.json:
        print(json.dumps({"summary": summary}))
    else:
        accepted = (f" | drafts accepted {summary['drafts_accepted']}/{summary['drafts_offered']}"
                    if s.verify else "")
        print(f"prompt tokens {sum(map(len, prompts))} | new tokens {new_tokens} | forwards "
              f"{sum(forwards)} | {summary['tokens_per_forward']:.2f} tokens/forward{accepted} | "
              f"{summary['tokens_per_second']:.1f} tok/s | first token {first * 1000:.0f} ms"
              + (" (--compile: the times include compiling each step's shapes)" if s.compile else ""), file=sys.stderr)


def verify_stats(offered: int, accepted: int) -> dict:
    return {"drafts_offered": offered, "drafts_accepted": accepted,
            "acceptance_rate": accepted / offered if offered else None}
