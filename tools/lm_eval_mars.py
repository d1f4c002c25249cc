# lm-evaluation-harness model "mars": the paper's benchmarks (docs/method.md §8) through the harness itself.
#
#   python -m tools.lm_eval_mars --model mars --model_args ckpt=DIR,threshold=0.9,block_size=4 \
#       --tasks gsm8k_cot --apply_chat_template --batch_size 16
#
# lm-eval finds models by name in its registry, so this module registers "mars" on import and, run as
# a script, hands its arguments to lm-eval's own CLI (every lm_eval flag works). From Python:
# `import tools.lm_eval_mars` and then `lm_eval.simple_evaluate(model="mars", model_args=...)`.
#
# - generate_until runs generate.decode, the batched decoder of generate.py (docs/method.md §6-7): the
#   threshold, the cache, greedy or sampled, and verify=true for lossless self-verification (§9). The
#   text is cut right before the first stop sequence (the harness's `until`). Tokens per forward and
#   tokens/s are printed per task.
# - loglikelihood and loglikelihood_rolling run the plain causal forward: at tau = 1 a MARS model is
#   an ordinary LM, so multiple-choice and perplexity tasks score it like any other.
#
# lm-eval is an optional extra (requirements-eval.txt), never needed by the rest of the project.
from __future__ import annotations

import re
import sys
import time
import typing
from dataclasses import asdict, dataclass, fields, replace

import torch

from mars import cli

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    from tqdm import tqdm
except ImportError:  # one line naming the requirements file, even for --help
    cli.optional("lm_eval", "tools/lm_eval_mars.py (the lm-eval model)", "requirements-eval.txt")
    raise

import generate
from mars.checkpoint import DEFAULT_CKPT, check_checkpoint, check_mask_row, load_model, trained_block_size
from mars.cli import device_and_dtype
from mars.layout import MAX_BLOCK_SIZE
from mars.tokenizer import Tokenizer
from mars.tokenizer import chat_template as jinja_template

GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature", "top_p"}  # what generate.decode can honour
HEAD_CHUNK = 1024  # positions per lm_head call when scoring: (1024, 151936) float32 logits are 0.6 GB


@dataclass
class Settings:
    ckpt: str = DEFAULT_CKPT  # checkpoint directory, hub id (owner/name) or alias (qwen2.5-0.5b, qwen2.5-7b)
    threshold: float = 0.9  # tau: accept slots after the first while confidence >= tau; 1.0 = plain AR
    block_size: int = 0  # B: slots per step; 0 = the B the checkpoint was trained with (its settings.json), else 4
    cache: typing.Literal["none", "cursor", "block"] = "cursor"  # as generate.py --cache
    block_cache_size: int = 0  # K for cache=block (0 = 32)
    verify: bool = False  # lossless self-verification (docs/method.md §9): generate.Options(verify=True)
    verify_layout: typing.Literal["tree", "chain"] = "tree"  # with verify: where the next drafts' masks go (§9)
    draft_min: float = 0.0  # with verify: drop drafts from the first slot below this confidence
    batch_size: int = 8  # requests decoded or scored together (the harness's --batch_size)
    max_gen_toks: int = 256  # new tokens per request when the task sets none
    max_length: int = 0  # context for scoring and prompt truncation; 0 = max_position_embeddings
    temperature: float = 0.0  # for tasks that set neither do_sample nor temperature; 0 = greedy
    top_p: float = 1.0  # nucleus mass when sampling, for tasks that set none
    seed: int = 0  # seeds each request's sampling generator with its place in the call, as generate.py seeds prompts
    device: str = "auto"  # auto (cuda when available), cpu, cuda or cuda:N
    dtype: typing.Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto = bfloat16 on cuda, float32 on cpu


def parse_settings(args: dict) -> Settings:
    # --model_args (already typed by the harness: "0.9" -> 0.9, "true" -> True) -> Settings, checked.
    args, hints, known = dict(args), typing.get_type_hints(Settings), {f.name for f in fields(Settings)}
    if args.get("batch_size") in ("auto", None) or str(args.get("batch_size")).startswith("auto:"):
        args.pop("batch_size", None)  # the harness's automatic batch size: ours is a plain number
    args.pop("max_batch_size", None)
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"mars model_args: unknown {', '.join(unknown)}; the settings are {', '.join(sorted(known))}")
    typed = {}
    for k, v in args.items():
        hint = hints[k]
        if typing.get_origin(hint) is typing.Literal:
            if v not in typing.get_args(hint):
                raise ValueError(f"mars model_args: {k}={v!r}; choose one of {', '.join(typing.get_args(hint))}")
            typed[k] = v
        elif hint is bool and not isinstance(v, bool):
            raise ValueError(f"mars model_args: {k}={v!r}; write true or false")
        elif hint in (int, float):  # the harness's own flags (--batch_size) arrive as text
            try:
                number = float(v) if not isinstance(v, bool) else None
            except ValueError:
                number = None
            if number is None or hint is int and number != int(number):
                raise ValueError(f"mars model_args: {k}={v!r} is not a{'n integer' if hint is int else ' number'}")
            typed[k] = hint(number)
        else:
            typed[k] = hint(v)
    s = Settings(**typed)
    B_ok = 0 <= s.block_size <= MAX_BLOCK_SIZE
    if not 0.0 <= s.threshold <= 1.0 or min(s.batch_size, s.max_gen_toks) < 1 or not B_ok:
        raise ValueError(f"mars model_args: threshold={s.threshold} must be in [0, 1], batch_size and max_gen_toks "
                         f"at least 1, block_size 1 to {MAX_BLOCK_SIZE} (or 0: the checkpoint's own)")
    if s.verify and "verify" not in {f.name for f in fields(generate.Options)}:
        raise ValueError("mars model_args: verify=true needs generate.Options(verify=True) (docs/method.md §9), "
                         "which this generate.py does not have")
    if s.verify and s.cache == "block":
        raise ValueError("mars model_args: verify=true needs cache=none or cache=cursor: the block cache keeps "
                         "its prefix frozen within a block, so it cannot commit the drafts it accepts")
    return s


def special_pattern(tok: Tokenizer) -> re.Pattern:
    # Every added token's text, longest first: a prompt the harness rendered with the chat template
    # carries <|im_start|> etc. as text, and a Hugging Face tokenizer would read them as those tokens.
    return re.compile("(" + "|".join(map(re.escape, sorted(tok.special, key=len, reverse=True))) + ")")


def stop_at(text: str, until: list[str]) -> str:
    # The text before the first occurrence of any stop sequence (the harness's rule), else all of it.
    cut = min((i for i in (text.find(u) for u in until if u) if i >= 0), default=len(text))
    return text[:cut]


@register_model("mars")
class MarsLM(TemplateLM):
    def __init__(self, **model_args):
        super().__init__()
        self.settings = s = parse_settings(model_args)
        path, config = check_checkpoint(s.ckpt)  # the same resolution as generate.py and serve.py
        self.settings = s = replace(s, block_size=trained_block_size(path, s.block_size))
        device, dtype = device_and_dtype(s.device, s.dtype)
        self.path, self._device = path, torch.device(device)
        self.tok = Tokenizer.from_pretrained(path)
        self.config = config
        self.model = load_model(path, device, dtype)
        self.context = s.max_length or config.max_position_embeddings
        self.specials = special_pattern(self.tok)
        self.stats: dict[str, dict] = {}  # per task: requests, new_tokens, forwards, seconds (generate_until)
        print(f"mars: {path} on {device} ({dtype}); {asdict(s)}", file=sys.stderr)

    # ---- what the harness asks of every model ----

    @property
    def eot_token_id(self) -> int:
        # <|im_end|>, what a Hugging Face tokenizer of these checkpoints calls eos, so an empty context is
        # conditioned as lm-eval's "hf" model conditions it (Qwen has no BOS).
        return self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self.context

    @property
    def tokenizer_name(self) -> str:
        return str(self.path)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return jinja_template(self.tok.default_system) if chat_template else None

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        # Rendered by the same code as generate.py's chat prompts. Without a generation prompt the
        # harness has started the answer itself (a prefilled last assistant turn), which stays open.
        if not add_generation_prompt and chat_history[-1]["role"] == "assistant":
            head = self.tok.encode_chat(chat_history[:-1], add_generation_prompt=True)
            return self.tok.decode(head) + chat_history[-1]["content"]
        return self.tok.decode(self.tok.encode_chat(chat_history, add_generation_prompt=add_generation_prompt))

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # Text between added tokens is encoded as generate.py encodes text; no BOS is ever added (docs/method.md §13).
        ids = []
        for i, piece in enumerate(self.specials.split(string)):
            ids += [self.tok.special[piece]] if i % 2 else self.tok.encode(piece)
        return ids

    # ---- scoring: the plain causal forward ----

    @torch.inference_mode()
    def _loglikelihood_tokens(self, requests: list[tuple], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        # requests: (cache key or None, context ids, continuation ids). Returns per request the sum of
        # log p(continuation token | everything before it), from a float32 log-softmax over the whole
        # vocabulary, and whether every continuation token is the argmax.
        R, pad = self.settings.batch_size, self.tok.pad_id
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool]] = [(0.0, True)] * len(requests)
        for start in tqdm(range(0, len(order), R), disable=disable_tqdm, desc="mars: scoring"):
            rows = []
            for i in order[start:start + R]:
                full = (requests[i][1] + requests[i][2])[-(self.context + 1):]  # keep the end
                n = min(len(requests[i][2]), len(full) - 1)  # scored tokens: the continuation's
                rows.append((i, full[:-1], full[len(full) - n:]))
            T = max(len(x) for _, x, _ in rows)
            # Right padding: under the causal mask a pad never reaches a real position.
            x = torch.tensor([x + [pad] * (T - len(x)) for _, x, _ in rows], device=self._device)
            h = self.model.hidden(x)  # (R, T, C)
            for r, (i, inp, target) in enumerate(rows):
                logp, greedy = 0.0, True
                for a in range(0, len(target), HEAD_CHUNK):  # the lm_head only where a token is scored
                    t = torch.tensor(target[a:a + HEAD_CHUNK], device=self._device)
                    first = len(inp) - len(target) + a  # position whose output predicts target[a]
                    logits = self.model.head(h[r, first:first + len(t)]).float()  # (n, V)
                    logp += logits.log_softmax(-1).gather(-1, t[:, None]).sum().item()
                    greedy = greedy and bool((logits.argmax(-1) == t).all())
                results[i] = (logp, greedy)
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        # The harness's disjoint windows of at most max_length tokens, each conditioned on as much of
        # the text before it as fits; the first on <|im_end|> (eot_token_id). Summed per request.
        windows, owner = [], []
        for k, (string,) in enumerate(r.args for r in requests):
            for w in get_rolling_token_windows(self.tok_encode(string), self.prefix_token_id, self.context, 1):
                windows.append((None, *make_disjoint_window(w)))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (logp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[k] += logp
        for r, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return totals

    # ---- generation: generate.decode ----

    def sampling(self, task: str, gen_kwargs: dict) -> tuple[list[str], int, float, float]:
        # A request's generation settings -> (until, max_gen_toks, temperature, top_p). Greedy unless
        # the task samples (do_sample, or a temperature > 0 without do_sample) or the model args do.
        s = self.settings
        unknown = sorted(set(gen_kwargs) - GEN_KWARGS)
        if unknown:
            raise ValueError(f"mars: task {task} sets {', '.join(unknown)}, which generate.decode does not "
                             f"have ({', '.join(sorted(GEN_KWARGS))}); change the task's generation_kwargs")
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        temperature = float(gen_kwargs.get("temperature", s.temperature))
        if gen_kwargs.get("do_sample") is False:
            temperature = 0.0
        elif gen_kwargs.get("do_sample") is True and "temperature" not in gen_kwargs:
            temperature = s.temperature or 1.0
        return until, int(gen_kwargs.get("max_gen_toks", s.max_gen_toks)), temperature, float(
            gen_kwargs.get("top_p", s.top_p))

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        s, tok = self.settings, self.tok
        # generation alone feeds masks: scoring a model without a mask row works as it is
        check_mask_row(self.path, self.config, tok, "verify=true" if s.verify else f"threshold={s.threshold:g}"
                       if s.threshold < 1 else "", "threshold=1.0 in --model_args")
        K = s.block_cache_size or (32 if s.cache == "block" else 0)
        # Requests are decoded in the harness's order, in batches of one task with one setting each, so
        # greedy answers are those of generate.py for the same prompts (a batch decodes as its rows alone),
        # and sampled ones too with the same seed: request i samples from generate.py's generator of prompt i.
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault((r.task_name, repr(self.sampling(r.task_name, r.args[1]))), []).append(i)
        answers = [""] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="mars: generating")
        truncated, touched = 0, set()
        for (task, _), members in groups.items():
            until, max_new, temperature, top_p = self.sampling(task, requests[members[0]].args[1])
            max_new = min(max_new, self.context - 1)  # a prompt keeps at least one token: no position past the context
            stats = self.stats.setdefault(task, dict(requests=0, new_tokens=0, forwards=0, seconds=0.0))
            touched.add(task)
            for start in range(0, len(members), s.batch_size):
                batch = members[start:start + s.batch_size]
                prompts = []
                for i in batch:
                    ids = self.tok_encode(requests[i].args[0]) or [self.prefix_token_id]  # never an empty prompt
                    keep = self.context - max_new  # room for the answer, as the harness's hf model does
                    truncated += len(ids) > keep
                    prompts.append(ids[-keep:] if keep > 0 else ids[-1:])
                t0 = time.perf_counter()
                opts = generate.Options(tau=s.threshold, B=s.block_size, max_new_tokens=max_new, cache=s.cache, K=K,
                                        temperature=temperature, top_p=top_p, verify=s.verify,
                                        layout=s.verify_layout, draft_min=s.draft_min, vocab_size=tok.vocab_size)
                seeded = [generate.prompt_generator(s.seed, i, self._device) for i in batch] if temperature else None
                outs, forwards = generate.decode(self.model, prompts, tok.mask_id, tok.stop_ids, opts, seeded)
                if self._device.type == "cuda":
                    torch.cuda.synchronize(self._device)
                stats["seconds"] += time.perf_counter() - t0
                stats["requests"] += len(batch)
                stats["new_tokens"] += sum(map(len, outs))
                stats["forwards"] += sum(forwards)
                for i, out in zip(batch, outs):
                    text = stop_at(tok.decode([t for t in out if t not in tok.stop_ids]), until)
                    answers[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(batch))
        bar.close()
        if truncated:
            print(f"mars: {truncated} prompts cut from the left to fit max_length={self.context} with their "
                  "max_gen_toks", file=sys.stderr)
        for task in sorted(touched):
            st = self.stats[task]
            print(f"mars: task {task}: {st['requests']} requests, {st['new_tokens']} new tokens in "
                  f"{st['forwards']} forwards = {st['new_tokens'] / max(st['forwards'], 1):.2f} tokens/forward, "
                  f"{st['new_tokens'] / max(st['seconds'], 1e-9):.1f} tokens/s (threshold {s.threshold}, "
                  f"block_size {s.block_size}, cache {s.cache}{', verify' if s.verify else ''})", file=sys.stderr)
        return answers


def main(argv: list[str] | None = None) -> None:
    # The harness's CLI with "mars" registered. argv: lm_eval's own arguments.
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
