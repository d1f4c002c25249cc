# Fine-tunes a Qwen2.5 checkpoint (or a tiny random model) with AR SFT or MARS (docs/method.md §1-5).
#   python train.py --init tiny --data data/demo/train.jsonl --mode mars --out runs/tiny
#   torchrun --nproc_per_node 8 train.py --init qwen2.5-0.5b --data allenai/Dolci-Instruct-SFT ...
# The method lives in two places: data.make_batch (the two streams and the block mask) and mars_loss
# below. The rest is an ordinary SFT loop: settings, model, data, optimizer, then the loop. The losses
# beyond the paper are in keep_base.py, a run's files in checkpoint.py, the processes in distributed.py.
from __future__ import annotations

import hashlib
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from data import IGNORE, Batch, Examples, describe, load_examples, make_batch, micro_batches, step_batches
from mars import checkpoint, distributed, keep_base
from mars.adapter import MaskAdapter
from mars.cli import device_and_dtype, keep_freed_memory
from mars.distributed import Env
from mars.loss import per_seq_means, target_ce
from mars.tokenizer import Tokenizer
from mars.train_settings import Settings, parse_settings
from model import DTYPES, CausalPrefix, Transformer

# ---- the loss ----


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


# ---- the loss a run trains ----

def step_loss(model: Transformer, batch: Batch, s: Settings):
    # The loss a run trains: docs/method.md §4's (mars_loss), or with --adapter or --mask-target self,
    # the variant of it that keeps the base model's output (keep_base.py).
    if s.adapter != "none":
        return keep_base.adapter_loss(model, batch, s.ce_chunk, s.mask_target)
    if s.mask_target != "data":
        return keep_base.distilled_loss(model, batch, s.ar_weight, s.ce_chunk, s.mask_target)
    return mars_loss(model, batch, s.ar_weight, s.ce_chunk)


# ---- schedule, model, data, optimizer ----

def lr_at(step: int, total: int, warmup: int, peak: float, clock: float = 0.0, warm: float = 0.0) -> float:
    # Learning rate of optimizer step `step` (0-based): linear warmup over `warmup` steps, then
    # cosine decay from peak to 0 at `total` (docs/method.md §5: cosine, 3% warmup). Under a --minutes
    # budget, clock is the budget's share spent before this step and warm the share of the warmup's time
    # spent since the loop began: warmup also ends once warm reaches 1, and the decay follows whichever of
    # the steps and the clock is further on.
    if step < warmup and warm < 1.0:
        return peak * max((step + 1) / warmup, warm)
    progress = max((step - warmup) / max(1, total - warmup), clock)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class Clock:
    # --minutes: the run's wall-clock budget (docs/training.md). The seconds count from the start of the
    # run, loading included, plus those a resumed run had spent up to its checkpoint. The loop stops
    # after the last step whose successor, with the final eval and save, would not fit.
    def __init__(self, minutes: float, spent: float = 0.0, now=time.monotonic):
        self.budget, self.spent, self.now, self.t0 = minutes * 60.0, spent, now, now()

    def elapsed(self) -> float:
        return self.spent + self.now() - self.t0

    def share(self) -> float:  # of the budget spent, for lr_at; 0 without a budget
        return self.elapsed() / self.budget if self.budget else 0.0

    def fits(self, seconds: float) -> bool:
        return not self.budget or self.elapsed() + seconds <= self.budget

    def left(self) -> float:
        return self.budget - self.elapsed() if self.budget else math.inf


class Budget:
    # --minutes in the loop: the clock, the seconds of the last eval and save (the run's end needs both),
    # and the decisions, the same in every process (on_the_clock). Without --minutes it never stops a run.
    def __init__(self, minutes: float):
        self.minutes, self.clock, self.share = minutes, Clock(minutes), 0.0  # the clock starts with the run
        self.finish = {"eval": 0.0, "save": 0.0}
        self.step_seconds, self.share0 = 0.0, 0.0  # a step's, and the share spent when the loop began

    def resume(self, kept: dict) -> None:  # a checkpoint's clock (checkpoint.restore)
        self.clock.spent, self.finish = kept.get("seconds", 0.0), kept.get("finish", self.finish)
        self.step_seconds = kept.get("step", 0.0)

    def start(self, where: Path, env: Env) -> None:
        # Before the loop, and before a resumed run cuts any metrics row: loading took its time, and a resumed
        # run (`where`: its checkpoint) needs room for a step, the final eval and the two saves (goes_on).
        if self.minutes:
            need = self.step_seconds + self.finish["eval"] + 2 * self.finish["save"]
            self.share, room = on_the_clock(self.clock, need, env)
            self.share0 = self.share
            if not room:
                raise ValueError(f"{where}: the run spent {self.clock.elapsed() / 60:.1f} min of its --minutes "
                                 f"{self.minutes:g} and has no room for another step; raise --minutes to train on")

    def warm(self, warmup: float) -> float:  # the share of --warmup's time spent since the loop began
        return (self.share - self.share0) / warmup if self.minutes and warmup else 0.0

    def timed(self, what: str, work, *args) -> None:  # work(*args), its seconds kept as the last `what`
        t0 = self.clock.now()
        work(*args)
        self.finish[what] = self.clock.now() - t0

    def goes_on(self, step_seconds: float, evaluating: bool, saving: bool, env: Env) -> bool:
        # Room for this step's own eval and save, one more step, then the final eval and the two saves of a
        # run the budget stops (its step checkpoint, to resume from, and the model)?
        if not self.minutes:
            return True
        self.step_seconds = step_seconds
        need = (evaluating + 1) * self.finish["eval"] + (saving + 2) * self.finish["save"] + step_seconds
        self.share, room = on_the_clock(self.clock, need, env)
        return room

    def state(self) -> dict:  # saved with each checkpoint
        return {"seconds": self.clock.elapsed(), "finish": dict(self.finish), "step": self.step_seconds}


@dataclass
class Job:
    # What the loop works on, built once by run.
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


def grad_accum_for(global_batch: int, batch_size: int, world: int) -> int:
    # Micro-batches per process per step. The global batch is fixed whatever the number of processes:
    # torchrun on 8 GPUs must not silently train with 8x the batch.
    per_round = batch_size * world
    if global_batch % per_round:
        fits = [b for b in range(batch_size, 0, -1) if global_batch % (b * world) == 0][:3]
        instead = f"use --batch-size {' or '.join(map(str, fits))}, or " if fits else "use "
        raise SystemExit(f"error: --global-batch {global_batch} is not a multiple of --batch-size {batch_size} x "
                         f"{world} processes = {per_round}; {instead}a --global-batch that is a multiple of "
                         f"{per_round}" + ("" if fits else f" (no batch size divides {global_batch} over {world} "
                                                           "processes)"))
    return global_batch // per_round


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


LINES = 20  # step lines a run keeps on the screen by default (--log-every 0)
FEW_STEPS = 20  # fewer optimizer steps than this, set by --epochs, get a warning


def say(s: Settings, env: Env, text: str) -> None:
    # What the run is (settings, model, data, schedule): printed by rank 0, unless --quiet.
    if not s.quiet:
        env.log(text)


def describe_model(model: Transformer, tok: Tokenizer, s: Settings, env: Env, save_dtype: torch.dtype) -> None:
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    saved_as = "the adapter alone, float32" if s.adapter != "none" else str(save_dtype).removeprefix("torch.")
    say(s, env, f"model: {n_params:,} trained parameters"
            + (f" (a gated adapter of rank {s.lora_rank} on a frozen base)" if s.adapter != "none" else "")
            + f", vocab {model.config.vocab_size}, mask id {tok.mask_id}, {env.device}, "
            f"compute {str(env.compute).removeprefix('torch.')}, saved as {saved_as}"
            + (f", FSDP over {env.world} processes" if s.fsdp else ""))


def split_data(s: Settings, tok: Tokenizer, env: Env) -> tuple[Examples, Examples]:
    # (train, held out). Tokenized once into a memory-mapped cache beside the data (data.load_examples):
    # by local rank 0 of each machine, while the other processes wait and then map the same files.
    def load(source: str, flag: str) -> Examples:
        return load_examples(source, tok, s.max_len, s.block_size, s.last_turn_only, build=env.local_rank == 0,
                             log=lambda text: say(s, env, text), flag=flag)

    data = load(s.data, "--data")
    if len(data) == 0:  # not "lower --global-batch": nothing in the files could be trained on
        raise ValueError(f"--data {s.data}: no example to train on. "
                         + describe(data.stats, "data", s.max_len).replace("\n  ", "; ")
                         + ". Each example needs an assistant reply after its prompt (docs/training.md)")
    say(s, env, describe(data.stats, "data", s.max_len))
    if s.eval_data:
        held_out = load(s.eval_data, "--eval-data")
        say(s, env, describe(held_out.stats, "eval data", s.max_len))
        train, held_out = data, held_out.select(np.arange(min(len(held_out), s.eval_max)))
    else:  # a seeded split, the same in every process and on resume; none without evals
        perm = np.random.default_rng(s.seed).permutation(len(data))
        n_eval = min(s.eval_max, round(s.eval_fraction * len(data))) if s.eval_every else 0
        train, held_out = data.select(np.sort(perm[n_eval:])), data.select(perm[:n_eval])
    say(s, env, f"{len(train)} training examples, {len(held_out)} held out for the eval loss")
    return train, held_out


def batch_maker(data: Examples, s: Settings, tok: Tokenizer):
    # -> collate(indices): the batch of those examples of `data`, collated on the host.
    def collate(indices: np.ndarray) -> Batch:
        return make_batch([data[i] for i in indices], s.block_size, tok.mask_id, tok.pad_id, s.mode, s.prune)

    return collate


def prefetch(items: list, collate, device: torch.device):
    # Yields collate(item).to(device) for each item, collating the next one in a worker thread while
    # the current one runs. On CUDA the next batch goes to pinned memory, so its copy to the GPU
    # is asynchronous too; the mask is built afterwards, on the device (Batch.mask).
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

def accumulate(model: Transformer, local: np.ndarray, collate, s: Settings, env: Env) -> list[float]:
    # Forward and backward of this process's micro-batches `local` (grad_accum, batch_size) -> (loss,
    # loss_ar, loss_mask) of the global batch, before the update. Each loss is a mean over its
    # micro-batch; scaled by the micro-batch's share of the global batch, the summed gradient (over
    # micro-batches and processes) is the gradient of the mean over all global_batch sequences, for
    # any number of processes.
    sums = torch.zeros(3, device=env.device)  # (loss, loss_ar, loss_mask) summed over sequences
    for indices, batch in zip(local, prefetch(local, collate, env.device)):
        with env.autocast():
            loss, loss_ar, loss_mask = step_loss(model, batch, s)
        (loss * len(indices) * env.grad_factor / s.global_batch).backward()
        sums += torch.stack([loss, loss_ar, loss_mask]).detach().float() * len(indices)
    distributed.sum_gradients(model, env)
    distributed.sum_over_processes(sums, env)
    return (sums / s.global_batch).tolist()


class NotFinite(ValueError):
    pass


def update(model: Transformer, opt: torch.optim.Optimizer, s: Settings, lr: float) -> float:
    # Clip, step at this lr -> the gradient norm before clipping. A norm that is not finite (a loss that
    # overflowed, or nan) stops the run before the weights take it: every process sees the same norm.
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
    grad_norm = (grad_norm.full_tensor() if s.fsdp else grad_norm).item()  # a DTensor under FSDP
    if not math.isfinite(grad_norm):
        opt.zero_grad(set_to_none=True)
        raise NotFinite(f"the gradient norm is {grad_norm} at --lr {lr:.3g}")
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    opt.zero_grad(set_to_none=True)
    if isinstance(getattr(model, "adapter", None), MaskAdapter):  # a fused step changes no tensor's version
        model.adapter.forget()
    return grad_norm


@torch.no_grad()
def evaluate(model: Transformer, data: Examples, s: Settings, tok: Tokenizer, env: Env) -> list[float]:
    # Mean over held-out sequences of (loss, loss_ar, loss_mask), sharded over processes. Every
    # process runs the same number of forwards, as FSDP gathers weights in each: one with no batch
    # left repeats its first with weight 0.
    order = np.argsort(data.lengths, kind="stable")  # similar lengths together: little padding
    chunks = [order[i : i + s.batch_size] for i in range(0, len(order), s.batch_size)]
    local = chunks[env.rank::env.world]
    rounds = -(-len(chunks) // env.world)
    items = [(local[i] if i < len(local) else chunks[0], i < len(local)) for i in range(rounds)]
    collate = batch_maker(data, s, tok)

    sums = torch.zeros(3, device=env.device)
    for (indices, counts), batch in zip(items, prefetch([indices for indices, _ in items], collate, env.device)):
        with env.autocast():
            losses = step_loss(model, batch, s)
        sums += torch.stack(losses).float() * (len(indices) if counts else 0)
    distributed.sum_over_processes(sums, env)
    return (sums / len(data)).tolist()


def data_key(train: Examples, held_out: Examples) -> dict:
    # What the data order and the split follow: the examples' counts and lengths. Saved with each
    # checkpoint; a resume on other data is refused (checkpoint.restore).
    lengths = hashlib.sha256(train.lengths.astype(np.int64).tobytes() + b"|" +
                             held_out.lengths.astype(np.int64).tobytes()).hexdigest()[:16]
    return {"train": len(train), "held_out": len(held_out), "lengths": lengths}


def save_step(job: Job, step: int, clock: dict) -> None:
    # OUT/checkpoints/step-N with the optimizer state, keeping the newest --keep. clock: the run's
    # seconds so far and its last eval's and save's, which a resumed --minutes budget goes on from.
    s, env = job.s, job.env
    weights, opt_state = distributed.gather_state(job.model, job.opt, env, s.adapter == "none")  # every process
    if env.master:
        state = {"step": step, "epoch": step // job.steps_per_epoch, "batch_in_epoch": step % job.steps_per_epoch,
                 "global_batch": s.global_batch, "optimizer": opt_state, "torch_rng": torch.get_rng_state(),
                 "clock": clock, "data": data_key(job.train, job.held_out)}
        path = checkpoint.step_checkpoint(Path(s.out), step)
        checkpoint.save_checkpoint(path, job.model, job.tok, asdict(s), weights, job.save_dtype, state)
        checkpoint.keep_newest(Path(s.out), s.keep)
        env.log(f"saved {path}")


def save_final(model: Transformer, tok: Tokenizer, s: Settings, env: Env, save_dtype: torch.dtype) -> None:
    # The trained model in OUT itself, a checkpoint directory (generate.py --ckpt OUT).
    weights, _ = distributed.gather_state(model, None, env, s.adapter == "none")  # every process
    if env.master:
        checkpoint.save_checkpoint(Path(s.out), model, tok, asdict(s), weights, save_dtype)
        env.log(f"saved {s.out}")


def on_the_clock(clock: Clock, need: float, env: Env) -> tuple[float, bool]:
    # -> (the budget's share spent, whether one more step of `need` seconds still fits), the same in
    # every process: the mean share and "stop" if any process says so, or their learning rates and
    # their loops would part.
    votes = torch.tensor([clock.share(), float(not clock.fits(need))], dtype=torch.float64, device=env.device)
    distributed.sum_over_processes(votes, env)
    return votes[0].item() / env.world, votes[1].item() == 0


def loop(job: Job, step: int, budget: Budget, metrics: checkpoint.Metrics) -> int:
    # Optimizer steps from `step` to the last (job.total, or the last that --minutes leaves room for), each
    # logged, with the held-out evals and the checkpoints on their schedule. -> the last step.
    s, env, train, held_out = job.s, job.env, job.train, job.held_out
    collate = batch_maker(train, s, job.tok)
    now = budget.clock.now

    def run_eval() -> None:
        budget.timed("eval", lambda: metrics.eval(step, evaluate(job.model, held_out, s, job.tok, env)))

    if s.eval_every and len(held_out) and step == 0:
        run_eval()
    order, order_epoch = None, -1
    t_start, step_start = now(), step
    every = s.log_every or -(-job.total // LINES)
    last = False
    while not last:
        epoch = step // job.steps_per_epoch
        if epoch != order_epoch:  # a pure function of (seed, epoch): resuming needs only `step`
            order, order_epoch = step_batches(train.lengths, s.global_batch, s.seed, epoch), epoch
        step_examples = order[step % job.steps_per_epoch]  # (global_batch,) example indices
        t0 = now()
        local = micro_batches(step_examples, s.batch_size, env.rank, env.world)  # (grad_accum, batch_size)
        losses = accumulate(job.model, local, collate, s, env)
        lr = lr_at(step, job.total, job.warmup, s.lr, budget.share, budget.warm(s.warmup))
        try:
            grad_norm = update(job.model, job.opt, s, lr)
        except NotFinite as e:
            kept = checkpoint.checkpoints(Path(s.out))
            raise ValueError(f"step {step + 1}: {e}, so the run stops before this update; "
                             + (f"its last checkpoint, {kept[-1]}, is kept: " if kept else "")
                             + "lower --lr or --grad-clip, or check the data at this step, then start again"
                             + (" with --resume" if kept else "")) from None
        step += 1
        dt, mean_dt = now() - t0, (now() - t_start) / (step - step_start)  # the mean counts evals and saves
        evaluating = bool(s.eval_every and len(held_out) and step % s.eval_every == 0)
        saving = bool(s.save_every and step % s.save_every == 0)
        last = step == job.total or not budget.goes_on(max(dt, mean_dt), evaluating, saving, env)
        stopped = last and step < job.total  # by --minutes: a step checkpoint too, so --resume can go on
        saving = (saving and not last) or stopped  # the last state goes to OUT
        stats = {"lr": lr, "grad_norm": grad_norm, "tokens": int(train.lengths[step_examples].sum()),
                 "epoch": epoch, "dt": dt}
        eta = max(0.0, min(mean_dt * (job.total - step), budget.clock.left()))
        metrics.train(step, job.total, losses, stats, eta, keep=step % every == 0 or last or saving)
        # eval, then save: a resumed run starts after both, so its rows match an unbroken run's
        if s.eval_every and len(held_out) and (evaluating or last):
            run_eval()
        if saving:
            budget.timed("save", save_step, job, step, budget.state())
    if step < job.total:
        env.log(f"--minutes {s.minutes:g}: stopped at step {step} of {job.total}, {budget.clock.elapsed() / 60:.1f} "
                f"min in, where one more step and the final eval and saves would not fit; to train on, --resume "
                f"with a larger --minutes goes on from {checkpoint.step_checkpoint(Path(s.out), step)}")
    return step


def run(s: Settings) -> None:
    budget = Budget(s.minutes)  # a --minutes budget counts from here, loading included
    env = distributed.setup(*device_and_dtype(s.device, s.dtype), s.fsdp)
    grad_accum_for(s.global_batch, s.batch_size, env.world)  # a --global-batch that does not divide: before loading
    out = Path(s.out)
    with checkpoint.one_run(out, env):  # a second run on this --out stops here, before anything loads
        resume_from = checkpoint.resume_point(out, s.resume, env)
        say(s, env, json.dumps(asdict(s), indent=2))
        if keep_freed_memory(env.device):
            say(s, env, "memory: freed blocks stay in the process for reuse (cli.keep_freed_memory)")

        # ---- model, data, optimizer ----
        model, tok = checkpoint.build_model(s, env, resume_from)
        # as it came in; a config.json dtype this code does not know ("auto") loads and saves as float32
        save_dtype = DTYPES.get(s.save_dtype if s.save_dtype != "auto" else model.config.torch_dtype, torch.float32)
        describe_model(model, tok, s, env, save_dtype)
        if s.fsdp:  # every process loaded the full float32 model (peak: one full copy per GPU)
            distributed.shard(model)
        train, held_out = split_data(s, tok, env)
        steps_per_epoch, total, warmup = schedule(s, len(train), env)
        opt = make_optimizer(model, s, env.device)
        step = 0
        if resume_from is not None:
            step, kept = checkpoint.restore(resume_from, model, opt, asdict(s), env, total,
                                            data_key(train, held_out))
            budget.resume(kept)
        budget.start(resume_from or out, env)
        if resume_from is not None:
            checkpoint.redo_after(resume_from, step, out, env)
        job = Job(s, env, model, opt, tok, train, held_out, save_dtype, steps_per_epoch, total, warmup)
        with checkpoint.Metrics(out, env, s.mode == "mars") as metrics:
            loop(job, step, budget, metrics)
            save_final(model, tok, s, env, save_dtype)
        distributed.finish()


def main(argv: list[str] | None = None) -> None:
    # Bad flags: one line and exit status 2 (parse_settings). Bad files, configs and data lines: the
    # boundary (model.py, tokenizer.py, data.py) raises ValueError or OSError naming the file, the line
    # and the fix; that is printed as one line, exit status 1. Anything else is a bug: a traceback.
    s = parse_settings(argv)
    try:
        run(s)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
