# Fine-tunes a Qwen2.5 checkpoint (or a tiny random model) with AR SFT or MARS (docs/method.md §1-5).
#   python train.py --init tiny --data data/demo/train.jsonl --mode mars --out runs/tiny
#   torchrun --nproc_per_node 8 train.py --init qwen2.5-0.5b --data allenai/Dolci-Instruct-SFT ...
# The method lives in two places: data.make_batch (the two streams and the block mask) and
# mars_loss below. Everything else is an ordinary SFT loop.
from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn as nn

import adapter as mask_adapter
import checkpoint
import cli
import distributed
import keep_base
from checkpoint import device_and_dtype
from data import (
    IGNORE,
    Batch,
    Examples,
    describe,
    load_examples,
    make_batch,
    micro_batches,
    step_batches,
)
from distributed import Env
from hub import resolve_checkpoint
from loss import per_seq_means, target_ce
from model import DTYPES, CausalPrefix, Config, Transformer
from tokenizer import Tokenizer


@dataclass
class Settings:
    init: str = "tiny"  # tiny (random, byte-level), qwen2.5-0.5b, qwen2.5-7b, a hub id or a checkpoint dir
    data: str = ""  # chat .jsonl/.json/.parquet file or folder, or a hub dataset id; required unless --init tiny
    mode: Literal["ar", "mars"] = "mars"  # ar: plain SFT (stage 1); mars: clean + noisy streams (stage 2)
    block_size: int = 4  # B: tokens predicted per block (docs/method.md §3); paper 4, also 8 and 16
    ar_weight: float = 1.0  # loss = loss_mask + ar_weight * loss_ar (docs/method.md §4)
    prune: bool = True  # drop dead noisy blocks (no supervised target): same loss, less compute
    max_len: int = 512  # keep the first max_len tokens (rounded down to a multiple of B)
    last_turn_only: bool = False  # supervise only the last assistant turn (the paper's code)
    batch_size: int = 16  # sequences per micro-batch, per process
    global_batch: int = 384  # sequences per optimizer step, all processes (docs/method.md §5); sets grad accumulation
    ce_chunk: int = 2048  # supervised targets per LM-head + cross-entropy chunk (bounds logits memory); 0 = all at once
    lr: float = -1.0  # peak learning rate; -1 = 5e-6 for checkpoints (docs/method.md §5), 1e-3 for tiny
    warmup: float = 0.03  # fraction of the steps spent in linear warmup, then cosine decay to 0
    weight_decay: float = 0.0  # AdamW decay of weight matrices (never norms, biases, embeddings)
    grad_clip: float = 1.0  # clip the global gradient norm to this
    epochs: int = 5  # passes over the training data (docs/method.md §5), unless max_steps is set
    max_steps: int = 0  # optimizer steps to run; 0 = as many as epochs take
    eval_data: str = ""  # held-out chat file; empty = hold out eval_fraction of --data
    eval_fraction: float = 0.01  # share of --data held out for the eval loss when no --eval-data
    eval_max: int = 1000  # at most this many held-out examples (the eval loss is a full pass)
    eval_every: int = 200  # steps between eval losses (also before step 1 and after the last); 0 = never
    save_every: int = 500  # steps between checkpoints in OUT/checkpoints; 0 = only the final model
    keep: int = 2  # keep the newest K checkpoints
    out: str = "runs/mars"  # final model, metrics.jsonl and checkpoints/ go here
    resume: bool = False  # continue the run in --out from its newest checkpoint
    mask_init: Literal["checkpoint", "mean"] = "checkpoint"  # <|mask|> row (adapter: offset): as saved, or the mean
    seed: int = 42  # data order and the tiny model's weights
    device: str = "auto"  # auto (cuda when present), cpu, cuda; torchrun gives each process its GPU
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"  # compute dtype (bfloat16 = autocast); auto: bf16 on CUDA
    compile: bool = False  # torch.compile each transformer block
    fsdp: bool = False  # shard weights, gradients and AdamW state over the processes (FSDP2; run under torchrun)
    save_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # saved weights; auto: the init's dtype
    mask_target: Literal["data", "self"] = "data"  # noisy targets: the data's tokens, or the model's own distribution
    teacher: Literal["none", "init"] = "none"  # init: the clean stream's loss is a KL to the frozen initial model
    adapter: Literal["none", "gated-lora"] = "none"  # gated-lora: frozen base, low-rank updates at mask positions
    lora_rank: int = 16  # the adapter's rank
    lora_alpha: float = 32.0  # the adapter's updates are scaled by lora_alpha / lora_rank
    mask_embed: Literal["one", "per-slot"] = "one"  # the adapter's mask offset: one vector, or one per slot (B)


def check_settings(s: Settings) -> None:
    # Everything the flags alone show to be wrong, before any file is read (a usage error, exit 2).
    for name in ("block_size", "batch_size", "global_batch", "keep", "lora_rank"):
        if getattr(s, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(s, name)} must be at least 1")
    for name in ("max_steps", "epochs", "eval_every", "save_every", "eval_max"):
        if getattr(s, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(s, name)} must be at least 0")
    if s.max_steps == 0 and s.epochs == 0:
        raise ValueError("--epochs 0 with --max-steps 0 trains nothing; give --epochs N or --max-steps N")
    if s.max_len < s.block_size:
        raise ValueError(f"--max-len {s.max_len} is shorter than one block (--block-size {s.block_size})")
    if not (s.lr == -1 or 0 <= s.lr < math.inf):
        raise ValueError(f"--lr {s.lr} must be >= 0 (or -1 for the default)")
    for name in ("ar_weight", "weight_decay"):
        if not 0 <= getattr(s, name) < math.inf:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(s, name)} must be a number >= 0")
    if s.adapter != "none" and s.mode != "mars":
        raise ValueError(f"--adapter {s.adapter} trains the mask slots: it needs --mode mars")
    if s.adapter != "none" and s.teacher != "none":
        raise ValueError("--teacher holds the clean stream, which an --adapter run never changes: drop --teacher")
    if s.mask_embed != "one" and s.adapter == "none":
        raise ValueError(f"--mask-embed {s.mask_embed} sets the gated adapter's mask vectors: "
                         "it needs --adapter gated-lora")
    if s.adapter != "none" and s.fsdp:
        raise ValueError("--adapter with --fsdp is not supported: the frozen base is small enough to replicate")
    if s.mode == "ar" and s.mask_target != "data":
        raise ValueError("--mask-target self sets the noisy stream's targets: it needs --mode mars")
    if not s.grad_clip > 0:
        raise ValueError(f"--grad-clip {s.grad_clip} must be > 0")
    for name in ("warmup", "eval_fraction"):
        if not 0 <= getattr(s, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(s, name)} must be in [0, 1)")
    device_and_dtype(s.device, s.dtype)


def parse_settings(argv: list[str] | None = None) -> Settings:
    s = cli.parse(Settings, argv, "AR SFT or MARS fine-tuning (docs/method.md §1-5).", check=check_settings)
    if s.lr < 0:  # paper lr for real checkpoints; a random tiny model needs a much larger one
        s = replace(s, lr=1e-3 if s.init == "tiny" else 1e-4 if s.adapter != "none" else 5e-6)
    if not s.data:  # a real model trained on the byte-level demo data by default would be a trap
        if s.init != "tiny":
            raise SystemExit(f"--init {s.init} needs --data: a chat .jsonl/.json/.parquet file or folder, or "
                             "a hub dataset id such as allenai/Dolci-Instruct-SFT (the paper's data)")
        s = replace(s, data="data/demo/train.jsonl")
    return s


# ---- pure helpers (imported by the tests) ----

def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    # Learning rate of optimizer step `step` (0-based): linear warmup over `warmup` steps, then
    # cosine decay from peak to 0 at `total` (docs/method.md §5: cosine, 3% warmup).
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def grad_accum_for(global_batch: int, batch_size: int, world: int) -> int:
    # Micro-batches per process per step. The global batch is fixed (the paper's 384), whatever the
    # number of processes: torchrun on 8 GPUs must not silently train with 8x the batch.
    per_round = batch_size * world
    if global_batch % per_round:
        fits = [b for b in range(batch_size, 0, -1) if global_batch % (b * world) == 0][:3]
        raise SystemExit(f"--global-batch {global_batch} is not a multiple of --batch-size {batch_size} x "
                         f"{world} processes = {per_round}; use --batch-size {' or '.join(map(str, fits))}, "
                         f"or a --global-batch that is a multiple of {per_round}")
    return global_batch // per_round


def prefetch(items: list, make, device: torch.device):
    # Yields make(item).to(device) for each item, collating the next one in a worker thread while
    # the current one runs. On CUDA the next batch goes to pinned memory, so its copy to the GPU
    # is asynchronous too; the mask is built afterwards, on the device (Batch.mask).
    pin = device.type == "cuda"

    def host(item):
        batch = make(item)
        return batch.pin_memory() if pin else batch

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(host, items[0]) if len(items) else None
        for k in range(len(items)):
            batch = pending.result()
            if k + 1 < len(items):
                pending = pool.submit(host, items[k + 1])
            yield batch.to(device)


def mars_loss(model: Transformer, batch: Batch, ar_weight: float = 1.0, chunk: int = 0, split: bool = True,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # -> (loss, loss_ar, loss_mask), scalars (docs/method.md §4). One forward over [clean | noisy]; the
    # cross-entropy at every supervised target, both streams against the data's tokens; each sequence's
    # mean per stream, then the mean over sequences. loss_ar comes from the clean columns (< L),
    # loss_mask from the noisy ones; an AR batch has no noisy columns, and its loss is loss_ar.
    # split: the clean queries, which see clean keys only and causally, run on the causal kernel and the
    # noisy ones get a masked call of their own (model.CausalPrefix); False: one call with the whole
    # (T, T) mask, the reference. The mask is built here, on the batch's device.
    if batch.noisy is None:
        mask = None  # AR: plain causal
    else:
        mask = CausalPrefix(batch.L, batch.noisy_mask()) if split else batch.mask
    h = model.hidden(batch.tokens, batch.pos, mask)  # (R, T, C)
    supervised = batch.labels != IGNORE  # (R, T)
    # The LM head only where there is a target (S of them), chunk by chunk.
    ce = torch.zeros(supervised.shape, dtype=torch.float32, device=h.device)
    ce[supervised] = target_ce(model, h[supervised], batch.labels[supervised], chunk)
    loss_ar, loss_mask = per_seq_means(ce, supervised, batch.L)
    if batch.tokens.shape[1] == batch.L:
        return loss_ar, loss_ar, loss_mask
    return loss_mask + ar_weight * loss_ar, loss_ar, loss_mask


def ensure_mask_row(model: Transformer, mask_id: int, init: str = "checkpoint") -> None:
    # The mask token reuses a spare embedding row (docs/method.md §2): Qwen2.5 has 151,936 rows for 151,665
    # tokens, so <|mask|> = 151665 already has one, which starts as it is in the checkpoint. A
    # model without a spare row grows by one (and so does an untied lm_head); a grown row has no
    # checkpoint value and starts at the mean of the others, as --mask-init mean does.
    emb = model.model.embed_tokens
    V, C = emb.weight.shape
    if mask_id >= V:
        def grow(w: torch.Tensor) -> torch.Tensor:  # (V, C) -> (mask_id + 1, C)
            extra = w.detach().mean(0, keepdim=True).expand(mask_id + 1 - V, C)
            return nn.Parameter(torch.cat([w.detach(), extra]))
        new = nn.Embedding(mask_id + 1, C, device=emb.weight.device, dtype=emb.weight.dtype)
        new.weight = grow(emb.weight)
        model.model.embed_tokens = new
        if model.lm_head is not None:
            head = nn.Linear(C, mask_id + 1, bias=False, device=emb.weight.device, dtype=emb.weight.dtype)
            head.weight = grow(model.lm_head.weight)
            model.lm_head = head
        model.config = replace(model.config, vocab_size=mask_id + 1)
    elif init == "mean":
        with torch.no_grad():
            emb.weight[mask_id] = emb.weight[:mask_id].mean(0)


def tiny_config(tok: Tokenizer) -> Config:
    # A 0.8M-parameter Qwen2 for the CPU demo, sized to the byte-level tokenizer (260 ids). On two
    # CPU cores the demo's budget is minutes, and in the same minutes this size, taking many small
    # steps, learnt the demo's tasks far better than a 3M model taking fewer.
    return Config(vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=384,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=512,
                  torch_dtype="float32", bos_token_id=tok.pad_id, eos_token_id=tok.eos_id)


def step_loss(model: Transformer, batch: Batch, s: Settings, teacher: Transformer | None = None):
    # The loss a run trains: docs/method.md §4's (mars_loss), or with --adapter, --mask-target self or
    # --teacher, the variant of it that keeps the base model's output (keep_base.py).
    if s.adapter != "none":
        return keep_base.adapter_loss(model, batch, s.ce_chunk, s.mask_target)
    if s.mask_target != "data" or teacher is not None:
        return keep_base.distilled_loss(model, batch, s.ar_weight, s.ce_chunk, s.mask_target, teacher)
    return mars_loss(model, batch, s.ar_weight, s.ce_chunk)


@torch.no_grad()
def evaluate(model: Transformer, data: Examples, s: Settings, tok: Tokenizer, env: Env,
             teacher: Transformer | None = None) -> list[float]:
    # Mean over held-out sequences of (loss, loss_ar, loss_mask), sharded over processes. Every
    # process runs the same number of forwards, as FSDP gathers weights in each: one with no batch
    # left repeats its first with weight 0.
    order = np.argsort(data.lengths, kind="stable")  # similar lengths together: little padding
    chunks = [order[i : i + s.batch_size] for i in range(0, len(order), s.batch_size)]
    mine = chunks[env.rank::env.world]
    rounds = -(-len(chunks) // env.world)
    items = [(mine[k] if k < len(mine) else chunks[0], k < len(mine)) for k in range(rounds)]

    def make(item):
        idx, _ = item
        return make_batch([data[i] for i in idx], s.block_size, tok.mask_id, tok.pad_id, s.mode, s.prune)

    sums = torch.zeros(3, device=env.device)
    for (idx, counts), batch in zip(items, prefetch(items, make, env.device)):
        with env.autocast():
            losses = step_loss(model, batch, s, teacher)
        sums += torch.stack(losses).float() * (len(idx) if counts else 0)
    distributed.sum_over_processes(sums, env)
    return (sums / len(data)).tolist()


def main(argv: list[str] | None = None) -> None:
    # Bad flags: one line and exit status 2 (parse_settings). Bad files, configs and data lines: the
    # boundary (model.py, tokenizer.py, data.py) raises ValueError or OSError naming the file, the line
    # and the fix; that is printed as one line, exit status 1. Anything else is a bug: a traceback.
    s = parse_settings(argv)
    try:
        run(s)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None


def init_path(init: str) -> Path:
    # The local directory of the --init checkpoint (an alias or hub id is downloaded on first use).
    try:
        return resolve_checkpoint(init, "--init")
    except FileNotFoundError as e:
        raise SystemExit(f"error: {e}") from e


def initial_model(s: Settings, init: Path | None, device: torch.device, dtype: torch.dtype) -> Transformer:
    # The weights --init names: the checkpoint at `init` in `dtype`, or (init None) the tiny model, seeded
    # so that every process and every call (the student, then its teacher) builds the same float32 weights.
    if init is None:
        torch.manual_seed(s.seed)
        return Transformer(tiny_config(Tokenizer.byte_level())).to(device)
    return Transformer.from_pretrained(init, device, dtype)


def build_model(s: Settings, env: Env, resume_from: Path | None) -> tuple[Transformer, Tokenizer, Transformer | None]:
    # -> (the model to train, its tokenizer, the frozen teacher or None). From the checkpoint when
    # resuming (restore() then puts back the exact float32 weights and the optimizer), else from --init.
    # A gated adapter trains on a frozen base kept in the compute dtype: no float32 master copy.
    device = env.device
    base_dtype = env.compute if s.adapter != "none" else torch.float32
    # --init, resolved once (a hub id is looked up once) and only where it is needed
    init = init_path(s.init) if s.init != "tiny" and (resume_from is None or s.teacher == "init") else None
    if resume_from is not None:  # a plain checkpoint in float32, or an adapter run on its base
        model = checkpoint.load_model(resume_from, device, base_dtype, torch.float32).train()
        tok = Tokenizer.from_pretrained(resume_from)
    else:
        model = initial_model(s, init, device, base_dtype)
        tok = Tokenizer.byte_level() if init is None else Tokenizer.from_pretrained(init)
    if resume_from is None and s.adapter != "none":
        if tok.mask_id >= model.config.vocab_size:
            raise ValueError(f"--init {s.init}: the mask id {tok.mask_id} has no embedding row (vocab "
                             f"{model.config.vocab_size}); a frozen base cannot grow one: train without --adapter")
        torch.manual_seed(s.seed)  # the adapter's random A: the same in every process and every rerun
        slots = s.block_size if s.mask_embed == "per-slot" else 1
        mask_adapter.attach(model, tok.mask_id, s.lora_rank, s.lora_alpha, slots,
                            "mean" if s.mask_init == "mean" else "zero")
    elif resume_from is None:
        ensure_mask_row(model, tok.mask_id, s.mask_init)
    teacher = None
    if s.teacher == "init":  # the frozen initial model, in the compute dtype (docs/method.md §10)
        teacher = initial_model(s, init, device, env.compute)
        ensure_mask_row(teacher, tok.mask_id, "checkpoint")  # the same vocabulary as the student
        teacher.requires_grad_(False).eval()
    if s.compile:  # in place: the module, its state_dict and its checkpoints stay the raw ones
        for block in model.model.layers:
            block.compile()
    return model, tok, teacher


def make_optimizer(model: Transformer, s: Settings, device: torch.device) -> torch.optim.Optimizer:
    # AdamW over the trained parameters; no weight decay on norms, biases and embeddings (the paper's
    # decay is 0 anyway). A gated adapter's frozen base gets no optimizer state at all.
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            matrix = p.dim() >= 2 and "embed_tokens" not in n and not n.startswith("lm_head")
            (decay if matrix else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.999),
                             eps=1e-8, fused=device.type == "cuda")


def split(s: Settings, tok: Tokenizer, env: Env) -> tuple[Examples, Examples]:
    # (train, held out). Tokenized once into a memory-mapped cache beside the data (data.load_examples):
    # by local rank 0 of each machine, while the other processes wait and then map the same files.
    def load(spec: str, flag: str) -> Examples:
        return load_examples(spec, tok, s.max_len, s.block_size, s.last_turn_only, build=env.local_rank == 0,
                             log=env.log, flag=flag)

    data = load(s.data, "--data")
    env.log(describe(data.stats, "data", s.max_len))
    if s.eval_data:
        held_out = load(s.eval_data, "--eval-data")
        env.log(describe(held_out.stats, "eval data", s.max_len))
        return data, held_out.select(np.arange(min(len(held_out), s.eval_max)))
    # a seeded split, the same in every process and on resume; none without evals
    perm = np.random.default_rng(s.seed).permutation(len(data))
    n_eval = min(s.eval_max, round(s.eval_fraction * len(data))) if s.eval_every else 0
    return data.select(np.sort(perm[n_eval:])), data.select(perm[:n_eval])


def accumulate(model: Transformer, mine: np.ndarray, make, s: Settings, env: Env, teacher) -> list[float]:
    # Forward and backward of this process's micro-batches -> (loss, loss_ar, loss_mask) of the global
    # batch, before the update. mars_loss averages over a micro-batch; scaling by its share of the global
    # batch makes the summed gradient (over micro-batches and processes) the gradient of the mean over all
    # global_batch sequences (docs/method.md §4), for any number of processes (Env.grad_factor).
    sums = torch.zeros(3, device=env.device)  # (loss, loss_ar, loss_mask) summed over sequences
    for idx, batch in zip(mine, prefetch(mine, make, env.device)):
        with env.autocast():
            loss, loss_ar, loss_mask = step_loss(model, batch, s, teacher)
        (loss * len(idx) * env.grad_factor / s.global_batch).backward()
        sums += torch.stack([loss, loss_ar, loss_mask]).detach().float() * len(idx)
    distributed.sum_gradients(model, env)  # each process's gradient already carries its 1 / global_batch share
    distributed.sum_over_processes(sums, env)
    return (sums / s.global_batch).tolist()


def update(model: Transformer, opt: torch.optim.Optimizer, s: Settings, lr: float) -> float:
    # Clip, step at this lr -> the gradient norm before clipping.
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
    grad_norm = (grad_norm.full_tensor() if s.fsdp else grad_norm).item()  # a DTensor under FSDP
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    opt.zero_grad(set_to_none=True)
    return grad_norm


def save_step(model: Transformer, opt: torch.optim.Optimizer, tok: Tokenizer, s: Settings, env: Env, step: int,
              steps_per_epoch: int, save_dtype: torch.dtype) -> None:
    # OUT/checkpoints/step-N with the optimizer state, keeping the last --keep.
    weights, opt_state = distributed.gather_state(model, opt, env, s.adapter == "none")  # every process
    if env.master:
        state = {"step": step, "epoch": step // steps_per_epoch, "batch_in_epoch": step % steps_per_epoch,
                 "global_batch": s.global_batch, "optimizer": opt_state, "torch_rng": torch.get_rng_state()}
        path = checkpoint.step_checkpoint(Path(s.out), step)
        checkpoint.save_checkpoint(path, model, tok, asdict(s), weights, save_dtype, state)
        checkpoint.keep_newest(Path(s.out), s.keep)
        env.log(f"saved {path}")


def schedule(s: Settings, n_train: int, env: Env) -> tuple[int, int, int]:
    # -> (steps per epoch, total steps, warmup steps). The global batch is the unit of data order: every
    # process computes the same step_batches and takes its own micro-batches, so N processes see exactly
    # what one process would.
    steps_per_epoch = n_train // s.global_batch
    if steps_per_epoch == 0:
        raise SystemExit(f"{n_train} training examples do not fill one global batch of "
                         f"{s.global_batch}; lower --global-batch")
    total = s.max_steps or s.epochs * steps_per_epoch
    warmup = round(s.warmup * total)
    env.log(f"global batch {s.global_batch} sequences = {s.batch_size} x "
            f"{grad_accum_for(s.global_batch, s.batch_size, env.world)} accumulation x {env.world} processes; "
            f"{steps_per_epoch} steps per epoch; {total} steps, {warmup} warmup")
    return steps_per_epoch, total, warmup


def run(s: Settings) -> None:
    env = distributed.setup(*device_and_dtype(s.device, s.dtype), s.fsdp)
    rank, world, device, master, log = env.rank, env.world, env.device, env.master, env.log
    grad_accum_for(s.global_batch, s.batch_size, world)  # a --global-batch that does not divide fails before loading
    out = Path(s.out)
    resume_from = checkpoint.resume_point(out, s.resume, env)
    log(json.dumps(asdict(s), indent=2))

    # ---- model ----
    # Every process loads the full float32 model, then --fsdp shards it (peak: one full copy per GPU).
    model, tok, teacher = build_model(s, env, resume_from)
    # Saved in the dtype the weights came in (bf16 for Qwen releases: half the size of float32,
    # and a torch_dtype that serving engines read), unless --save-dtype says otherwise.
    save_dtype = DTYPES[s.save_dtype if s.save_dtype != "auto" else model.config.torch_dtype]
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if s.fsdp:
        distributed.shard(model)
    saved_as = "the adapter alone, float32" if s.adapter != "none" else str(save_dtype).removeprefix("torch.")
    log(f"model: {n_params:,} trained parameters"
        + (f" (a gated adapter of rank {s.lora_rank} on a frozen base)" if s.adapter != "none" else "")
        + f", vocab {model.config.vocab_size}, mask id {tok.mask_id}, {device}, "
        f"compute {str(env.compute).removeprefix('torch.')}, saved as {saved_as}"
        + (f", FSDP over {world} processes" if s.fsdp else ""))

    # ---- data ----
    train, held_out = split(s, tok, env)
    log(f"{len(train)} training examples, {len(held_out)} held out for the eval loss")
    steps_per_epoch, total, warmup = schedule(s, len(train), env)

    opt = make_optimizer(model, s, device)
    step = 0 if resume_from is None else checkpoint.restore(resume_from, model, opt, asdict(s), env, total)
    if master:
        out.mkdir(parents=True, exist_ok=True)
    metrics = open(out / "metrics.jsonl", "a") if master else None

    def write(row: dict) -> None:
        if master:
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()

    def run_eval() -> None:
        loss, loss_ar, loss_mask = evaluate(model, held_out, s, tok, env, teacher)
        row = {"step": step, "eval_loss": loss, "eval_loss_ar": loss_ar}
        row |= {"eval_loss_mask": loss_mask} if s.mode == "mars" else {}
        write(row)
        log(f"eval step {step} | loss {loss:.4f} | ar {loss_ar:.4f}"
            + (f" | mask {loss_mask:.4f}" if s.mode == "mars" else ""))

    def make(idx: np.ndarray) -> Batch:
        return make_batch([train[i] for i in idx], s.block_size, tok.mask_id, tok.pad_id, s.mode, s.prune)

    # ---- loop ----
    if s.eval_every and len(held_out) and step == 0:
        run_eval()
    order, order_epoch = None, -1
    t_start, step_start = time.time(), step
    while step < total:
        epoch = step // steps_per_epoch
        if epoch != order_epoch:  # a pure function of (seed, epoch): resuming needs only `step`
            order, order_epoch = step_batches(train.lengths, s.global_batch, s.seed, epoch), epoch
        this_step = order[step % steps_per_epoch]  # (global_batch,) example indices
        t0 = time.time()

        mine = micro_batches(this_step, s.batch_size, rank, world)  # (grad_accum, batch_size)
        loss, loss_ar, loss_mask = accumulate(model, mine, make, s, env, teacher)
        lr = lr_at(step, total, warmup, s.lr)
        grad_norm = update(model, opt, s, lr)
        step += 1

        # log
        tokens = int(train.lengths[this_step].sum())  # real clean tokens, all processes
        dt = time.time() - t0
        eta = (time.time() - t_start) / (step - step_start) * (total - step)
        row = {"step": step, "loss": loss, "loss_ar": loss_ar}
        row |= {"loss_mask": loss_mask} if s.mode == "mars" else {}
        write(row | {"lr": lr, "grad_norm": grad_norm, "tokens": tokens, "epoch": epoch, "dt": dt})
        log(f"step {step}/{total} | loss {loss:.4f} | ar {loss_ar:.4f}"
            + (f" | mask {loss_mask:.4f}" if s.mode == "mars" else "")
            + f" | lr {lr:.2e} | {tokens / dt:,.0f} tok/s | eta {eta / 60:.1f} min")

        # eval, then save: a resumed run starts after both, so its rows match an unbroken run's
        if s.eval_every and len(held_out) and (step % s.eval_every == 0 or step == total):
            run_eval()
        # (the state after the last step goes to OUT itself, below)
        if s.save_every and step % s.save_every == 0 and step < total:
            save_step(model, opt, tok, s, env, step, steps_per_epoch, save_dtype)

    # ---- final model: OUT itself is a checkpoint directory (generate.py --ckpt OUT) ----
    weights, _ = distributed.gather_state(model, None, env, s.adapter == "none")
    if master:
        checkpoint.save_checkpoint(out, model, tok, asdict(s), weights, save_dtype)
        metrics.close()
        log(f"saved {out}")
    distributed.finish()


if __name__ == "__main__":
    main()
