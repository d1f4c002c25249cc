# A training run's bookkeeping, which train.py calls: the --minutes wall clock and its decisions, the lines
# that say what the run is, its data split and the key a resume checks it by, its checkpoints and its
# metrics rows. The loop reports to one Run once a step (after_step), and through it evals and saves.
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch

from mars import checkpoint, distributed
from mars.distributed import Env
from mars.examples import Examples, check_source, describe, load_examples
from mars.tokenizer import Tokenizer
from mars.train_settings import DEMO_DATA, Settings
from model import Transformer

LINES = 20  # step lines a run keeps on the screen by default (--log-every 0)


# ---- what the run is ----

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


def check_data(s: Settings) -> None:
    # The data there, before the model loads (train.py): a typo in a path costs no download or load of --init.
    # A hub dataset id is looked up when it is read.
    if s.data == DEMO_DATA and not Path(DEMO_DATA).is_file():
        raise ValueError(f"--data {DEMO_DATA} (--init tiny's default) is not here: `make demo` writes it (run from "
                         "the repository's folder), or pass --data")
    for source, flag in ((s.data, "--data"), (s.eval_data, "--eval-data")):
        if source:
            check_source(source, flag)


def split_data(s: Settings, tok: Tokenizer, env: Env, context: int) -> tuple[Examples, Examples]:
    # (train, held out). Tokenized once into a memory-mapped cache beside the data (examples.load_examples):
    # the processes of each machine tokenize a share of the rows each, local rank 0 joins the shares, and
    # every process maps the same files. context: the model's max_position_embeddings, which no example
    # may pass: decoding stops there, so positions past it would be trained and never used.
    def load(source: str, flag: str) -> Examples:
        examples = load_examples(source, tok, s.max_len, s.block_size, s.last_turn_only,
                                 part=(env.local_rank, env.local_world), log=lambda text: say(s, env, text), flag=flag)
        if len(examples) and (longest := int(examples.lengths.max())) > context:
            raise ValueError(f"{flag} {source}: examples of up to {longest} tokens (--max-len {s.max_len}), past the "
                             f"model's context, max_position_embeddings {context}, where generate.py and serve.py "
                             f"stop: lower --max-len to {context}")
        return examples

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
    else:  # rows chosen by their prompts (held_out_rows); none without evals
        held = held_out_rows(data, s.eval_fraction, s.eval_max) if s.eval_every else np.zeros(0, np.int64)
        if len(held) == len(data) and s.eval_fraction * len(data) < 1:  # a row or two, by chance: none held out
            held = np.zeros(0, np.int64)
        train, held_out = data.select(np.setdiff1d(np.arange(len(data)), held)), data.select(held)
    say(s, env, f"{len(train)} training examples, {len(held_out)} held out for the eval loss")
    if not len(train):  # not "lower --global-batch": the split took every example
        raise ValueError(f"--eval-fraction {s.eval_fraction:g} held out all {len(data)} examples of --data "
                         f"{s.data}, leaving none to train on; lower --eval-fraction or --eval-max")
    if s.eval_every and not len(held_out):  # Run then evaluates nothing: said, not left to be noticed
        where = f"--eval-data {s.eval_data} has no example" if s.eval_data else \
            f"--eval-fraction {s.eval_fraction:g} of {len(data)} examples holds none out"
        env.log(f"warning: {where}, so --eval-every {s.eval_every} runs no eval; raise --eval-fraction, give "
                "--eval-data, or pass --eval-every 0")
    return train, held_out


SPLIT = "by prompt hash"  # how held_out_rows draws the split, saved with the data key


def held_out_rows(data: Examples, fraction: float, most: int) -> np.ndarray:
    # The held-out examples: those whose prompt (the tokens before the first supervised one, all of them, as a
    # long system prompt shared by every row must not hide the user's turn) hashes into the lowest `fraction`
    # of the hash range, the `most` lowest of them. Whether a row is held out depends on its prompt alone (past
    # the cap, on the rows below it): a MARS stage on the AR stage's data holds out what that stage held out,
    # whatever its --max-len or --block-size, and rows that share a prompt are held out together (but where the
    # cap cuts through them).
    if fraction <= 0 or most <= 0:
        return np.zeros(0, np.int64)
    keys = np.empty(len(data), np.uint64)
    for i in range(len(data)):
        ids, sup = data[i]
        prompt = np.asarray(ids[:int(np.argmax(sup)) if sup.any() else len(ids)], np.int64)
        keys[i] = int.from_bytes(hashlib.blake2b(prompt.tobytes(), digest_size=8).digest(), "little")
    rows = np.flatnonzero(keys / 2.0**64 < fraction)
    return rows[np.lexsort((rows, keys[rows]))][:most]


def data_key(train: Examples, held_out: Examples) -> dict:
    # What the data order and the split follow: the examples' counts and lengths. Saved with each
    # checkpoint; a resume on other data is refused (checkpoint.restore).
    lengths = hashlib.sha256(train.lengths.astype(np.int64).tobytes() + b"|" +
                             held_out.lengths.astype(np.int64).tobytes()).hexdigest()[:16]
    return {"train": len(train), "held_out": len(held_out), "lengths": lengths, "split": SPLIT}


# ---- the wall clock (--minutes) ----

class WallClock:
    # --minutes: the seconds a run may take (docs/training.md). They count from the start of the run,
    # loading included, plus those a resumed run had spent up to its checkpoint. The loop stops after the
    # last step whose successor, with the final eval and save, would not fit.
    def __init__(self, minutes: float, spent: float = 0.0, now=time.monotonic):
        self.limit, self.spent, self.now, self.t0 = minutes * 60.0, spent, now, now()

    def elapsed(self) -> float:
        return self.spent + self.now() - self.t0

    def share(self) -> float:  # of the limit spent, for lr_at; 0 without --minutes
        return self.elapsed() / self.limit if self.limit else 0.0

    def fits(self, seconds: float) -> bool:
        return not self.limit or self.elapsed() + seconds <= self.limit

    def left(self) -> float:
        return self.limit - self.elapsed() if self.limit else math.inf


def on_the_clock(clock: WallClock, need: float, env: Env) -> tuple[float, bool]:
    # -> (the share of --minutes spent, whether one more step of `need` seconds still fits), the same in
    # every process: the mean share and "stop" if any process says so, or their learning rates and
    # their loops would part.
    votes = torch.tensor([clock.share(), float(not clock.fits(need))], dtype=torch.float64, device=env.device)
    distributed.sum_over_processes(votes, env)
    return votes[0].item() / env.world, votes[1].item() == 0


# ---- the run's files ----

def save_step(job, step: int, clock: dict) -> None:
    # OUT/checkpoints/step-N with the optimizer state, keeping the newest --keep. job: train.Job. clock:
    # the run's seconds so far and its last eval's and save's, which a resumed run's --minutes go on from.
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


def save_final(job) -> None:
    # The trained model in OUT itself, a checkpoint directory (generate.py --ckpt OUT).
    s, env = job.s, job.env
    weights, _ = distributed.gather_state(job.model, None, env, s.adapter == "none")  # every process
    if env.master:
        checkpoint.save_checkpoint(Path(s.out), job.model, job.tok, asdict(s), weights, job.save_dtype)
        env.log(f"saved {s.out}")


class Due(NamedTuple):  # what a step that just ended is due
    eval: bool  # the held-out eval loss
    save: bool  # a step checkpoint
    last: bool  # the loop ends after it (job.total, or the last step --minutes leaves room for)


class Run:
    # The bookkeeping of one training run (job: train.Job): the metrics rows, the checkpoints, and --minutes:
    # the wall clock, the seconds of the last eval and save (the run's end needs both) and the decisions,
    # the same in every process (on_the_clock). Without --minutes the clock never stops a run.
    def __init__(self, job, clock: WallClock):
        self.job, self.s, self.env, self.clock = job, job.s, job.env, clock
        self.share = 0.0  # of --minutes spent before the current step (lr_at's clock)
        self.began: float | None = None  # the seconds spent when the run's loop first began, resumes included
        self.finish = {"eval": 0.0, "save": 0.0}
        self.step_seconds = 0.0  # the last step's (its mean, if larger)
        self.evals = bool(self.s.eval_every and len(job.held_out))
        self.every = self.s.log_every or -(-job.total // LINES)  # the step lines kept on the screen
        self.metrics: checkpoint.Metrics | None = None
        self.t0 = self.t_start = 0.0  # when the current step began, and the loop's first
        self.step_start = -1
        self.resumed = False  # from a step checkpoint (start)

    def start(self, resume_from: Path | None) -> int:
        # -> the step the loop starts from. A resumed run takes back its checkpoint's state and clock; then
        # --minutes must leave room before a resumed run cuts any metrics row: loading took its time, and
        # a resumed run needs room for a step, the final eval and the two saves (after_step).
        job, s, step = self.job, self.s, 0
        self.resumed = resume_from is not None
        if resume_from is not None:
            step, kept = checkpoint.restore(resume_from, job.model, job.opt, asdict(s), self.env, job.total,
                                            data_key(job.train, job.held_out))
            self.clock.spent, self.finish = kept.get("seconds", 0.0), kept.get("finish", self.finish)
            self.step_seconds, self.began = kept.get("step", 0.0), kept.get("began")
        if s.minutes and step < job.total:
            need = self.step_seconds + self.finish["eval"] + 2 * self.finish["save"]
            self.share, room = on_the_clock(self.clock, need, self.env)
            if self.began is None:  # the run's first loop (or a checkpoint saved without --minutes)
                self.began = self.share * self.clock.limit
            if not room:
                raise ValueError(f"{resume_from or Path(s.out)}: the run spent {self.clock.elapsed() / 60:.1f} min "
                                 f"of its --minutes {s.minutes:g} and has no room for another step; raise --minutes "
                                 "to train on")
        if resume_from is not None:
            checkpoint.redo_after(resume_from, step, Path(s.out), self.env)
        return step

    def __enter__(self) -> Run:
        self.metrics = checkpoint.Metrics(Path(self.s.out), self.env, self.s.mode == "mars")
        self.t0 = self.clock.now()
        return self

    def __exit__(self, *exc) -> None:  # metrics.jsonl is closed however the run ends
        self.metrics.__exit__(*exc)

    def warm(self, warmup: float) -> float:  # the share of --warmup's time spent since the run's loop began
        return (self.share - self.began / self.clock.limit) / warmup if self.s.minutes and warmup else 0.0

    def timed(self, what: str, work: Callable, *args) -> None:  # work(*args), its seconds kept as the last `what`
        t0 = self.clock.now()
        work(*args)
        self.finish[what] = self.clock.now() - t0
        self.t0 = self.clock.now()  # the next step begins

    def after_step(self, step: int, losses: list[float], stats: dict) -> Due:
        # Step `step` (1-based) has been applied: decide what it is due, the same in every process, and write
        # its row. A step's seconds run from the end of the bookkeeping before it to here; the mean counts
        # evals and saves. --minutes stop the run unless there is room for this step's own eval and save,
        # one more step, then the final eval and the last step's two saves (its step checkpoint and the model).
        s, total, now = self.s, self.job.total, self.clock.now()
        if self.step_start < 0:
            self.t_start, self.step_start = self.t0, step - 1
        dt, mean_dt = now - self.t0, (now - self.t_start) / (step - self.step_start)
        evaluating = self.evals and step % s.eval_every == 0
        saving = bool(s.save_every and step % s.save_every == 0)
        last = step == total
        if s.minutes and not last:
            self.step_seconds = max(dt, mean_dt)
            need = (evaluating + 1) * self.finish["eval"] + (saving + 2) * self.finish["save"] + self.step_seconds
            self.share, room = on_the_clock(self.clock, need, self.env)
            last = not room
        # The last step gets a step checkpoint too, besides the model in OUT (unless --save-every 0 asks for
        # none): --resume goes on from it when --minutes stopped the run, whatever --save-every, a raised
        # --max-steps trains on from it, and a final save that fails (a full disk) loses no steps. A run that
        # resumed from such a stop writes it under --save-every 0 too: a later --resume then finds the run done,
        # not the stop's checkpoint to train again from.
        saving = saving or (last and (bool(s.save_every) or step < total or self.resumed))
        eta = max(0.0, min(mean_dt * (total - step), self.clock.left()))
        self.metrics.train(step, total, losses, stats | {"dt": dt}, eta,
                           keep=step % self.every == 0 or last or saving)
        self.t0 = self.clock.now()
        # eval, then save: a resumed run starts after both, so its rows match an unbroken run's
        return Due(eval=self.evals and (evaluating or last), save=saving, last=last)

    def eval(self, step: int, losses: Callable[[], list[float]]) -> None:  # losses(): the held-out losses
        self.timed("eval", lambda: self.metrics.eval(step, losses()))

    def save(self, step: int) -> None:
        self.timed("save", save_step, self.job, step, self.state())

    def state(self) -> dict:  # the clock, saved with each checkpoint
        return {"seconds": self.clock.elapsed(), "finish": dict(self.finish), "step": self.step_seconds,
                "began": self.began}

    def end(self, step: int) -> None:
        # The trained model in OUT; a run that --minutes stopped first says how to go on.
        if step < self.job.total:
            self.env.log(f"--minutes {self.s.minutes:g}: stopped at step {step} of {self.job.total}, "
                         f"{self.clock.elapsed() / 60:.1f} min in, where one more step and the final eval and saves "
                         f"would not fit; to train on, --resume with a larger --minutes goes on from "
                         f"{checkpoint.step_checkpoint(Path(self.s.out), step)}")
        save_final(self.job)
