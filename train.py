# Fine-tunes a Qwen2.5 checkpoint (or a tiny random model) with AR SFT or MARS (docs/method.md §1-5).
#   python train.py --init tiny --data data/demo/train.jsonl --mode mars --out runs/tiny
#   torchrun --nproc_per_node 8 train.py --init qwen2.5-0.5b --data allenai/Dolci-Instruct-SFT ...
# The method lives in three places: data.make_batch (the two streams), data.mars_mask (the block mask) and mars_loss
# below. The rest is an ordinary SFT loop: the schedule, model, data, optimizer, then the loop. What the
# variants beyond the paper change in the loss is in mars/keep_base.py, the run's bookkeeping (wall clock,
# checkpoints, metrics) in mars/run.py, the processes in mars/distributed.py.
from __future__ import annotations

import json
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from data import IGNORE, Batch, make_batch, micro_batches, step_batches
from mars import checkpoint, distributed
from mars.distributed import Env
from mars.run import Run, WallClock, check_data, describe_model, say, split_data
from mars.train_settings import Settings, check_global_batch, parse_settings
from model import DTYPES, CausalPrefix, Transformer, attention_backends

if TYPE_CHECKING:
    from mars.examples import Examples
    from mars.keep_base import Variant
    from mars.tokenizer import Tokenizer

# ---- the loss (docs/method.md §4) ----


def chunked(fn: Callable[..., torch.Tensor], chunk: int, *xs: torch.Tensor) -> torch.Tensor:
    # fn(*xs) over `chunk` rows of xs at a time, with the values and gradients of one call. Under
    # autograd each piece runs under activation checkpointing, so one piece's (chunk, V) logits exist
    # at a time, in the forward and again in the backward, which recomputes them. chunk <= 0: one
    # call, its logits kept for the backward (the reference).
    if chunk <= 0:
        return fn(*xs)
    pieces = [tuple(x[i : i + chunk] for x in xs) for i in range(0, len(xs[0]), chunk)]
    if not torch.is_grad_enabled():  # evaluation: no backward, nothing to recompute
        return torch.cat([fn(*p) for p in pieces])
    return torch.cat([torch.utils.checkpoint.checkpoint(fn, *p, use_reentrant=False) for p in pieces])


def head_ce(model: Transformer, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # h (S, C) hidden states at S supervised targets, y (S,) their tokens -> (S,) float32 cross-entropy.
    # Eager, .float() is a float32 copy of the (S, V) logits; compiled (--compile), the upcast fuses into
    # the logsumexp and the backward's softmax, and no float32 (S, V) tensor exists.
    return F.cross_entropy(model.head(h).float(), y, reduction="none")


def compile_blocks(model: Transformer, backend: str = "inductor") -> None:
    # --compile: each block, in place (the module, its state_dict and checkpoints stay the raw ones), for dynamic
    # shapes: a run's micro-batches differ in rows and length, and a graph is made once, not once a shape.
    for block in model.model.layers:
        block.compile(dynamic=True, backend=backend)


def per_seq_means(ce: torch.Tensor, supervised: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    # (R, T) losses and targets -> (loss_ar, loss_mask): each sequence's mean over its own targets in the
    # clean columns (< L) and in the noisy ones, then the mean over the R sequences. An AR batch has no
    # noisy columns: its loss_mask is 0.
    per_seq_ar = ce[:, :L].sum(1) / supervised[:, :L].sum(1).clamp(min=1)  # (R,)
    per_seq_mask = ce[:, L:].sum(1) / supervised[:, L:].sum(1).clamp(min=1)  # (R,)
    return per_seq_ar.mean(), per_seq_mask.mean()


def mars_loss(model: Transformer, batch: Batch, ar_weight: float = 1.0, chunk: int = 0, split: bool = True,
              variant: Variant | None = None, head: Callable[..., torch.Tensor] = head_ce,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # -> (loss, loss_ar, loss_mask), scalars (docs/method.md §4). One forward over [clean | noisy]; the
    # cross-entropy at every supervised target, both streams against the data's tokens; each sequence's
    # mean per stream, then the mean over sequences. loss_ar comes from the clean columns (< L),
    # loss_mask from the noisy ones; an AR batch has no noisy columns, and its loss is loss_ar.
    # split: the clean queries, which see clean keys only and causally, run on the causal kernel and the
    # noisy ones get a masked call of their own (model.CausalPrefix); False: one call with the whole
    # (T, T) mask, the reference. The mask is built here, on the batch's device.
    # variant (beyond the paper, §10; loss_variant): a frozen clean stream (the gated adapter) runs the
    # variant's forward, and its loss_ar is reported, never trained; self-distilled noisy columns take their
    # targets and cross-entropy from it. The chunks, the per-sequence means and the sum stay this function's.
    # head: head_ce, or head_ce compiled (--compile), the same values.
    L, T = batch.L, batch.tokens.shape[1]
    frozen = variant is not None and variant.frozen_clean
    if frozen:
        h_clean, h_noisy = variant.hidden(model, batch)  # (R, L, C), (R, T - L, C)
    else:
        mask = None if batch.noisy is None else CausalPrefix(L, batch.noisy_mask()) if split else batch.mask
        h = model.hidden(batch.tokens, batch.pos, mask)  # (R, T, C); an AR batch: plain causal
        h_clean, h_noisy = h[:, :L], h[:, L:]
    supervised = batch.labels != IGNORE  # (R, T)
    # The LM head only where there is a target (S of them), chunk by chunk.
    ce = torch.zeros(supervised.shape, dtype=torch.float32, device=h_clean.device)
    data_ce = partial(head, model)
    if variant is None:  # every target is the data's next token: one pass over all S
        ce[supervised] = chunked(data_ce, chunk, h[supervised], batch.labels[supervised])
    else:
        clean, noisy = supervised[:, :L], supervised[:, L:]
        ce[:, :L][clean] = chunked(data_ce, chunk, h_clean[clean], batch.labels[:, :L][clean])
        if L < T:
            fn, y = data_ce, batch.labels[:, L:]  # (R, T - L) tokens
            if variant.self_targets:  # (R, T - L, C) states whose distributions are the targets
                fn, y = variant.noisy_targets(model, h_clean, batch)
            ce[:, L:][noisy] = chunked(fn, chunk, h_noisy[noisy], y[noisy])
    loss_ar, loss_mask = per_seq_means(ce, supervised, L)
    if frozen:  # the base's own loss_ar: nothing of it trains
        return loss_mask, loss_ar.detach(), loss_mask
    if T == L:  # AR: the clean stream alone, whatever ar_weight says
        return loss_ar, loss_ar, loss_mask
    return loss_mask + ar_weight * loss_ar, loss_ar, loss_mask


def loss_variant(mask_target: str = "data", adapter: str = "none") -> Variant | None:
    # None: the paper's loss. --mask-target self or --adapter gated-lora: what keep_base.py changes in it.
    if mask_target == "data" and adapter == "none":
        return None
    from mars.keep_base import Variant

    return Variant(self_targets=mask_target == "self", frozen_clean=adapter != "none")


# ---- the schedule (docs/method.md §5) ----

def lr_at(step: int, total: int, warmup: int, peak: float, clock: float = 0.0, warm: float = 0.0) -> float:
    # Learning rate of optimizer step `step` (0-based): linear warmup over `warmup` steps, then
    # cosine decay from peak to 0 at `total` (docs/method.md §5: cosine, 3% warmup). Under --minutes,
    # clock is the share of the minutes spent before this step and warm the share of the warmup's time
    # spent since the loop began: warmup also ends once warm reaches 1, and the decay follows whichever of
    # the steps and the clock is further on.
    if step < warmup and warm < 1.0:
        return peak * max((step + 1) / warmup, warm)
    progress = max((step - warmup) / max(1, total - warmup), clock)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def grad_accum_for(global_batch: int, batch_size: int, world: int) -> int:
    # Micro-batches per process per step. The global batch is fixed whatever the number of processes:
    # torchrun on 8 GPUs must not silently train with 8x the batch (check_global_batch: a usage error).
    check_global_batch(global_batch, batch_size, world)
    return global_batch // (batch_size * world)


FEW_STEPS = 20  # fewer optimizer steps than this, set by --epochs, get a warning


def schedule(s: Settings, n_train: int, env: Env) -> tuple[int, int, int]:
    # -> (steps per epoch, total steps, warmup steps). The global batch is the unit of data order: every
    # process computes the same step_batches and takes its own micro-batches, so any number of processes
    # sees exactly what one process would.
    steps_per_epoch = n_train // s.global_batch
    if steps_per_epoch == 0:
        raise SystemExit(f"error: {n_train} training examples do not fill one global batch of "
                         f"{s.global_batch}; lower --global-batch")
    total = s.max_steps or s.epochs * steps_per_epoch
    warmup = round(s.warmup * total)
    if not s.max_steps and total < FEW_STEPS:  # a small data set at the default global batch of 384
        env.log(f"warning: {n_train} examples make {steps_per_epoch} steps per epoch of --global-batch "
                f"{s.global_batch}, {total} optimizer steps in all: lower --global-batch for more steps")
    say(s, env, f"global batch {s.global_batch} sequences = {s.batch_size} x "
            f"{grad_accum_for(s.global_batch, s.batch_size, env.world)} accumulation x {env.world} processes; "
            f"{steps_per_epoch} steps per epoch; {total} steps, {warmup} warmup"
            + (f"; or --minutes {s.minutes:g}, whichever ends first" if s.minutes else ""))
    return steps_per_epoch, total, warmup


# ---- model, data, optimizer ----

@dataclass
class Job:
    # What the loop works on, built once by fine_tune.
    s: Settings
    env: Env
    model: Transformer
    opt: torch.optim.Optimizer
    tok: Tokenizer
    train: Examples
    held_out: Examples
    save_dtype: torch.dtype
    steps_per_epoch: int
    total: int
    warmup: int
    variant: Variant | None  # loss_variant of the flags
    head: Callable[..., torch.Tensor]  # mars_loss's head: head_ce, compiled under --compile


def batch_maker(data: Examples, s: Settings, tok: Tokenizer):
    # -> collate(indices): the batch of those examples of `data`, collated on the host.
    def collate(indices: np.ndarray) -> Batch:
        return make_batch([data[i] for i in indices], s.block_size, tok.mask_id, tok.pad_id, s.mode, s.prune)

    return collate


def prefetch(items: list, collate, device: torch.device):
    # Yields collate(item).to(device) for each item, collating the next one in a worker thread while
    # the current one runs. On CUDA the next batch goes to pinned memory, so its copy to the GPU
    # is asynchronous too; the mask is built afterwards, on the device (Batch.noisy_mask; Batch.mask unsplit).
    pin = device.type == "cuda"

    def host(item):
        batch = collate(item)
        return batch.pin_memory() if pin else batch

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(host, items[0]) if len(items) else None
        for i in range(len(items)):
            batch = pending.result()
            if i + 1 < len(items):
                pending = pool.submit(host, items[i + 1])
            yield batch.to(device)


def make_optimizer(model: Transformer, s: Settings, device: torch.device) -> torch.optim.Optimizer:
    # AdamW over the trained parameters; no weight decay on norms, biases and embeddings. A gated
    # adapter's frozen base gets no optimizer state at all.
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            matrix = p.dim() >= 2 and "embed_tokens" not in name and not name.startswith("lm_head")
            (decay if matrix else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.999),
                             eps=1e-8, fused=device.type == "cuda")


# ---- the loop ----

def accumulate(model: Transformer, local: np.ndarray, collate, s: Settings, env: Env,
               variant: Variant | None, head: Callable[..., torch.Tensor] = head_ce) -> list[float]:
    # Forward and backward of this process's micro-batches `local` (grad_accum, batch_size) -> (loss,
    # loss_ar, loss_mask) of the global batch, before the update. Each loss is a mean over its
    # micro-batch; scaled by the micro-batch's share of the global batch, the summed gradient (over
    # micro-batches and processes) is the gradient of the mean over all global_batch sequences, for
    # any number of processes.
    sums = torch.zeros(3, device=env.device)  # (loss, loss_ar, loss_mask) summed over sequences
    for indices, batch in zip(local, prefetch(local, collate, env.device)):
        with env.autocast():
            loss, loss_ar, loss_mask = mars_loss(model, batch, s.ar_weight, s.ce_chunk, variant=variant, head=head)
        (loss * len(indices) * env.grad_factor / s.global_batch).backward()
        sums += torch.stack([loss, loss_ar, loss_mask]).detach().float() * len(indices)
    distributed.sum_gradients(model, env)
    distributed.sum_over_processes(sums, env)
    return (sums / s.global_batch).tolist()


def update(model: Transformer, opt: torch.optim.Optimizer, s: Settings, lr: float, step: int = 0) -> float:
    # Clip, step at this lr -> the gradient norm before clipping. A norm that is not finite (a loss that
    # overflowed, or nan) stops the run before the weights take it: every process sees the same norm.
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
    grad_norm = (grad_norm.full_tensor() if s.fsdp else grad_norm).item()  # a DTensor under FSDP
    if not math.isfinite(grad_norm):
        kept = checkpoint.checkpoints(Path(s.out))
        raise ValueError(f"step {step + 1}: the gradient norm is {grad_norm} at --lr {lr:.3g}, so the run stops "
                         "before this update; " + (f"its last checkpoint, {kept[-1]}, is kept: " if kept else "")
                         + "lower --lr or --grad-clip, or check the data at this step, then start again"
                         + (" with --resume" if kept else "") + ". On CUDA the attention kernel can cause it too: "
                         "cuDNN's SDPA gives NaN gradients with a mask (pytorch/pytorch#196678), which model.py "
                         "keeps off cuDNN; the run's 'attention:' line names the kernels each call may use")
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    opt.zero_grad(set_to_none=True)
    if getattr(model, "adapter", None) is not None:  # a fused step changes no tensor's version
        model.adapter.forget()
    return grad_norm


@torch.no_grad()
def evaluate(model: Transformer, data: Examples, s: Settings, tok: Tokenizer, env: Env,
             variant: Variant | None = None, head: Callable[..., torch.Tensor] = head_ce) -> list[float]:
    # Mean over held-out sequences of (loss, loss_ar, loss_mask), sharded over processes. Every
    # process runs the same number of forwards, as FSDP gathers weights in each: one with no batch
    # left repeats the first chunk with weight 0.
    order = np.argsort(data.lengths, kind="stable")  # similar lengths together: little padding
    chunks = [order[i : i + s.batch_size] for i in range(0, len(order), s.batch_size)]
    local = chunks[env.rank::env.world]
    rounds = -(-len(chunks) // env.world)
    items = [(local[i] if i < len(local) else chunks[0], i < len(local)) for i in range(rounds)]
    collate = batch_maker(data, s, tok)

    sums = torch.zeros(3, device=env.device)
    for (indices, counts), batch in zip(items, prefetch([indices for indices, _ in items], collate, env.device)):
        with env.autocast():
            losses = mars_loss(model, batch, s.ar_weight, s.ce_chunk, variant=variant, head=head)
        sums += torch.stack(losses).float() * (len(indices) if counts else 0)
    distributed.sum_over_processes(sums, env)
    return (sums / len(data)).tolist()


def loop(job: Job, step: int, run: Run) -> int:
    # Optimizer steps from `step` to the last (job.total, or the last that --minutes leaves room for), each
    # logged, with the held-out evals and the checkpoints on their schedule (run.after_step). -> the last step.
    s, env, model = job.s, job.env, job.model
    collate = batch_maker(job.train, s, job.tok)

    def held_out_losses() -> list[float]:
        return evaluate(model, job.held_out, s, job.tok, env, job.variant, job.head)

    if step == 0 and run.evals:  # the eval loss before step 1 too
        run.eval(step, held_out_losses)
    order, order_epoch = None, -1
    while True:
        epoch = step // job.steps_per_epoch
        if epoch != order_epoch:  # a pure function of (seed, epoch): resuming needs only `step`
            order, order_epoch = step_batches(job.train.lengths, s.global_batch, s.seed, epoch), epoch
        step_examples = order[step % job.steps_per_epoch]  # (global_batch,) example indices
        local = micro_batches(step_examples, s.batch_size, env.rank, env.world)  # (grad_accum, batch_size)
        losses = accumulate(model, local, collate, s, env, job.variant, job.head)
        lr = lr_at(step, job.total, job.warmup, s.lr, run.share, run.warm(s.warmup))
        grad_norm = update(model, job.opt, s, lr, step)
        step += 1
        tokens = int(job.train.lengths[step_examples].sum())
        due = run.after_step(step, losses, {"lr": lr, "grad_norm": grad_norm, "tokens": tokens, "epoch": epoch})
        if due.eval:
            run.eval(step, held_out_losses)
        if due.save:
            run.save(step)
        if due.last:
            return step


def fine_tune(s: Settings) -> None:
    from mars.cli import device_and_dtype, keep_freed_memory  # the flags' device; a CPU allocator setting

    clock = WallClock(s.minutes)  # --minutes count from here, loading included
    env = distributed.setup(*device_and_dtype(s.device, s.dtype), s.fsdp)
    out = Path(s.out)
    with checkpoint.one_run(out, env):  # a second run on this --out stops here, before anything loads
        resume_from = checkpoint.resume_point(out, s.resume, env)
        say(s, env, json.dumps(asdict(s), indent=2))
        say(s, env, attention_backends(env.device))
        if s.lr == 0:
            env.log("warning: --lr 0: the weights never change (a run that measures the losses only)")
        if keep_freed_memory(env.device):
            say(s, env, "memory: freed blocks stay in the process for reuse (cli.keep_freed_memory)")

        check_data(s)  # a typo found before --init loads (or downloads)
        model, tok = checkpoint.build_model(s, env, resume_from)
        # as it came in; a config.json dtype this code does not know ("auto") loads and saves as float32
        save_dtype = DTYPES.get(s.save_dtype if s.save_dtype != "auto" else model.config.torch_dtype, torch.float32)
        describe_model(model, tok, s, env, save_dtype)
        if s.compile:  # before sharding, FSDP2's order (mars/distributed.shard)
            compile_blocks(model)
        if s.fsdp:  # every process loaded the full float32 model (peak: one full copy per GPU)
            distributed.shard(model, env.compute)
        train, held_out = split_data(s, tok, env, model.config.max_position_embeddings)
        steps_per_epoch, total, warmup = schedule(s, len(train), env)
        opt = make_optimizer(model, s, env.device)
        job = Job(s=s, env=env, model=model, opt=opt, tok=tok, train=train, held_out=held_out, save_dtype=save_dtype,
                  steps_per_epoch=steps_per_epoch, total=total, warmup=warmup,
                  variant=loss_variant(s.mask_target, s.adapter),
                  # the chunks' row counts vary: dynamic
                  head=torch.compile(head_ce, dynamic=True) if s.compile else head_ce)
        run = Run(job, clock)
        step = run.start(resume_from)  # 0, or the resumed checkpoint's step once every check has passed
        with run:  # metrics.jsonl
            run.end(loop(job, step, run) if step < total else step)  # the final model in OUT
        distributed.finish()


def main(argv: list[str] | None = None) -> None:
    # Bad flags: one line and exit status 2 (parse_settings). Bad files, configs and data lines: the boundary
    # (model.py, mars/files.py, mars/tokenizer.py, mars/examples.py) raises ValueError or OSError naming the file,
    # the line and the fix; that is printed as one line, exit status 1. Ctrl-C: where --resume goes on from,
    # status 130. Anything else is a bug: a traceback.
    s = parse_settings(argv)
    try:
        fine_tune(s)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:  # Ctrl-C: where the run can go on from, not a traceback
        found = checkpoint.checkpoints(Path(s.out))
        if os.environ.get("RANK", "0") == "0":  # one line from a torchrun, not one a process
            print(f"\ninterrupted: --resume goes on from {found[-1]}" if found else
                  "\ninterrupted before the first step checkpoint: --resume starts the run again", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
