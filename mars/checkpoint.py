# A run's files, in one place. Reading: from a --ckpt flag to a model on a device (resolve a directory,
# an alias or a hub id; check; load a plain checkpoint, or a gated adapter run on its base) and the
# settings it was trained with; every entry point (generate.py, serve.py, eval.py, train.py, the tools)
# loads here. Writing (train.py): the lock that keeps one run to a folder, the final model and the step
# checkpoints, which are listed, deleted and resumed from here too, and the run's metrics.jsonl.
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn

from mars import adapter, cpu
from mars.distributed import Env, load_model_state, load_optimizer_state
from mars.files import checkpoint_files, is_weight_file, normal_modes, read_json, read_settings, write_atomic, writing
from mars.hub import ALIASES, HUB_ID, looks_local, resolve_checkpoint
from mars.layout import MAX_BLOCK_SIZE
from mars.tokenizer import Tokenizer
from mars.train_settings import Settings
from model import Config, Transformer

DEFAULT_CKPT = "runs/demo/mars"  # where `make demo` leaves its MARS checkpoint
DEFAULT_BLOCK_SIZE = 4  # B for a checkpoint that does not say what it was trained with
CALIBRATION = "calibration.json"  # the map of calibrated thresholds, a removed feature (docs/method.md §16)


def check_checkpoint(ckpt: str) -> tuple[Path, Config]:
    # A directory, an alias or a hub id (downloaded on first use) -> (local directory, its config).
    # Reads config.json and the safetensors headers only; the weights load later. A gated adapter run
    # (adapter.py) is its own directory, with the config of the base it points to.
    if ckpt == DEFAULT_CKPT and not Path(ckpt).is_dir():
        raise FileNotFoundError(f"no checkpoint at {ckpt}: run `make demo` first, or pass --ckpt DIR "
                                "(`make quickstart` leaves its model in runs/quickstart/mars)")
    path = resolve_checkpoint(ckpt)
    check_finished(path, "--ckpt")
    if adapter.is_adapter(path):
        base, config = check_checkpoint(str(adapter_base(path)))
        return path, config
    config = Config.from_json(path / "config.json")
    checkpoint_files(path)
    return path, config


def check_finished(path: Path, flag: str) -> None:
    # A run's folder before its final save (killed, or still training) holds step checkpoints, not a model.
    if path.is_dir() and not (path / "config.json").is_file() and not adapter.is_adapter(path) and \
            (found := checkpoints(path)):
        if flag == "--init" and adapter.is_adapter(found[-1]):  # no step of it is a model to start from
            raise FileNotFoundError(f"--init {path}: an adapter run with no final save yet (killed, or still "
                                    f"running), and an adapter run is no --init: finish it with python train.py "
                                    f"--out {path} --resume, or start a new adapter from its base")
        raise FileNotFoundError(f"{flag} {path}: a training run with no final model yet (killed, or still running); "
                                f"pass its newest checkpoint, {flag} {found[-1]}, or finish the run first: python "
                                f"train.py --out {path} --resume")


def adapter_base(path: Path) -> Path:
    # The local directory of the plain checkpoint that the adapter run in `path` was trained on. train.py
    # trains an adapter on a plain checkpoint only, so the chain is one link long: a base that is itself
    # an adapter run (this one, or another in a cycle) is refused here rather than followed.
    config = Path(path) / adapter.CONFIG
    spec = adapter.base_path(path)
    try:
        base = resolve_checkpoint(spec, f"{config}: its \"base\"", f"set \"base\" in {config} to its directory")
    except FileNotFoundError as e:
        if spec.lower() in ALIASES or HUB_ID.fullmatch(spec) and not looks_local(spec):
            raise
        raise FileNotFoundError(f"{e}. If the base checkpoint moved, set \"base\" in {config} to its folder") from None
    if adapter.is_adapter(base):
        which = "this adapter run itself" if base.resolve() == Path(path).resolve() else "an adapter run"
        raise ValueError(f"{Path(path) / adapter.CONFIG}: its base {base} is {which}, not a plain checkpoint; "
                         "set \"base\" to the checkpoint the adapter was trained on")
    return base


def load_model(path: str | Path, device: str | torch.device | None = None,
               dtype: torch.dtype | None = None, adapter_dtype: torch.dtype | None = None,
               decoding: bool = True, quantize: str = "none") -> Transformer:
    # The model of a checked directory (check_checkpoint), in eval mode: a plain checkpoint, or a gated
    # adapter run attached to its base, so that every tool gates it and none applies it to every token.
    # adapter_dtype: the adapter's weights (default: the base's dtype; training keeps them float32).
    # decoding: a float32 model on the CPU runs a decode step's few rows in the faster order of mars/cpu.py,
    # and a bf16 gated adapter on a CPU with AVX-512 BF16 gets its updates from mars/cpu_kernels.cpp
    # (generate, serve, eval and the tools); training passes False and keeps model.py's plain linears.
    # quantize: one of quantize.KINDS swaps in weight-only quantized linears and head (mars/quantize.py).
    # A checkpoint saved with a calibration map loads as any other: the map is not read, and the note says
    # so, since whoever fitted it would expect --threshold to follow it.
    if (Path(path) / CALIBRATION).is_file():
        print(f"note: {Path(path) / CALIBRATION} is ignored: calibrated thresholds were removed "
              "(docs/method.md §16)", file=sys.stderr)
    if adapter.is_adapter(path):
        base, _ = check_checkpoint(str(adapter_base(Path(path))))
        model = Transformer.from_pretrained(base, device=device, dtype=dtype)
        adapter.load(model, path, adapter_dtype)
    else:
        model = Transformer.from_pretrained(path, device=device, dtype=dtype)
    w = model.model.embed_tokens.weight
    if quantize != "none":
        from mars import quantize as quantization

        kind = quantization.int4_kernel_for(w.device, w.dtype, quantization.GROUP_SIZE)[0] \
            if quantize == "int4" else quantize  # int4: mars/cpu_kernels.cpp where it runs, fast in float32 too
        if w.device.type == "cpu" and w.dtype == torch.float32 and kind != "int4":
            print(f"note: --quantize {quantize} with float32 activations: torch's CPU kernels are fast in bfloat16 "
                  "(--dtype bfloat16); in float32 they can be slower than no --quantize", file=sys.stderr)
        quantization.quantize(model, quantize)
    elif decoding and w.device.type == "cpu" and w.dtype == torch.float32:
        cpu.use_few_rows(model)
    if decoding:
        cpu.use_lowrank_kernel(model)  # a bf16 gated adapter run on a CPU with AVX-512 BF16
    return model.eval()


def trained_block_size(ckpt: str | Path, flag: int = 0) -> int:
    # B for decoding: the flag when given, else the block size the checkpoint was trained with (train.py
    # writes it into settings.json), else 4. A flag that disagrees with the checkpoint wins, with a warning.
    trained = read_settings(ckpt).get("block_size")
    trained = trained if type(trained) is int and trained >= 1 else None
    if flag and trained and flag != trained:
        print(f"warning: block size {flag} differs from the {trained} that {ckpt} was trained with (its "
              f"settings.json); its mask slots learnt {trained} tokens ahead", file=sys.stderr)
    if not flag and trained and trained > MAX_BLOCK_SIZE:
        raise ValueError(f"{ckpt}: trained with block size {trained} (its settings.json), more than the "
                         f"{MAX_BLOCK_SIZE} the decoding scripts take; pass --block-size {MAX_BLOCK_SIZE} or less")
    return flag or trained or DEFAULT_BLOCK_SIZE


def mars_trained(ckpt: str | Path) -> bool:
    # Trained by train.py --mode mars (its settings.json), a gated adapter run (trained on the mask slots
    # alone), or a MARS checkpoint saved elsewhere (the published ones say so with pard_token in config.json).
    if read_settings(ckpt).get("mode") == "mars" or adapter.is_adapter(ckpt):
        return True
    try:
        return read_json(Path(ckpt) / "config.json", "").get("pard_token") is not None
    except (OSError, ValueError):
        return False


def warn_untrained_masks(ckpt: str | Path, tau: float) -> bool:
    # Mask slots that never learnt anything are accepted below tau 1 as confident garbage.
    if tau < 1.0 and not mars_trained(ckpt):
        print(f"warning: {ckpt} was not MARS-trained (no settings.json with mode mars), so its mask slots are "
              f"untrained and tau {tau} < 1 will emit wrong tokens; use --threshold 1.0 or --verify",
              file=sys.stderr)
        return True
    return False


def check_mask_row(ckpt: str | Path, config: Config, tok: Tokenizer, why: str,
                   ar: str = "generate.py --threshold 1") -> None:
    # A model whose embedding has no row for <|mask|> (a fine-tune resized to its tokenizer's ids) decodes
    # AR alone; every other rule feeds masks. why: the flags that would feed them, "" for none; ar: how to ask
    # for AR decoding instead.
    if why and tok.mask_id >= config.vocab_size:
        raise ValueError(f"{ckpt}: the mask id {tok.mask_id} has no embedding row (vocab_size {config.vocab_size} "
                         f"in its config.json), and {why} feeds <|mask|>: decode it as AR ({ar}), or train it with "
                         "train.py, which adds the row")


# ---- writing a run: the lock, the final model, step checkpoints, resuming ----

LOCK = "train.lock"


@contextmanager
def one_run(out: Path, env: Env) -> Iterator[None]:
    # One training run to a folder: rank 0 creates OUT and holds an exclusive flock on OUT/train.lock,
    # which records its PID, until the run ends. The kernel drops a flock when its process dies, however
    # it dies, so a killed run's lock file is taken over by the next run. However the run ends, the lock
    # file goes, and so does OUT (and the folders above it) where the run created it and left it empty.
    # A save a kill cut short left its temporary folder: the lock says no run writes it now, so it goes.
    if not env.master:
        yield
        return
    created = [p for p in (out, *out.parents) if not p.exists()]
    with locked(out / LOCK) as f:
        try:
            with writing(out / LOCK):
                f.truncate(0)
                f.write(f"{os.getpid()}\n")
                f.flush()
            for partial in (*out.glob(".tmp-final"), *(out / "checkpoints").glob(".tmp-step-*"),
                            *(out / "checkpoints").glob(".deleting-step-*")):
                env.log(f"removing {partial}: a save or delete that a killed run left unfinished")
                shutil.rmtree(partial, ignore_errors=True)
            yield
        finally:
            (out / LOCK).unlink(missing_ok=True)  # still locked: a run that opened this file sees it gone
            for folder in created:  # deepest first; one that holds anything stays
                try:
                    folder.rmdir()
                except OSError:
                    break


@contextmanager
def locked(file: Path) -> Iterator:
    # `file`, opened and flocked, or SystemExit naming the PID it holds. A run that ends deletes its lock
    # file while it still holds it: a run that opened that file before and locks it after finds the path
    # gone or another file there (another inode), and starts again on a new file, or two runs would each
    # hold a lock of their own.
    while True:
        try:
            file.parent.mkdir(parents=True, exist_ok=True)  # an ending run may have removed an empty OUT
            f = open(file, "a+")
        except OSError as e:  # read-only, a file on the way, no permission
            raise ValueError(f"--out {file.parent}: cannot write there ({e.strerror}: {e.filename}); choose another "
                             "--out") from None
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                pid = f.read().strip() or "unknown"
                raise SystemExit(f"error: {file.parent} is in use by another training run (PID {pid}, in {file}): "
                                 "wait for it to end, or choose another --out") from None
            try:
                same = os.stat(file).st_ino == os.fstat(f.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if same:
                yield f
                return


WEIGHTS = ("model.safetensors", "model.safetensors.index.json", adapter.WEIGHTS)
STALE = (*WEIGHTS, adapter.CONFIG, CALIBRATION)  # what a new save into a folder replaces or drops


def save_checkpoint(path: Path, model: Transformer, tok: Tokenizer, settings: dict, weights: dict,
                    dtype: torch.dtype, state: dict | None = None) -> None:
    # A Hugging Face directory (config.json, safetensors in `dtype`, tokenizer files) plus the run's
    # settings.json and, for resuming, train_state.pt. weights: the full float32 state dict (gathered
    # first under FSDP). When dtype is not float32, train_state.pt also keeps the float32 weights: a
    # resumed run continues from the exact master weights. Written to a temporary directory, then
    # renamed: a killed save never leaves a half checkpoint behind, and a failed one removes its
    # partial files. With state=None (the final model) the files are written to a folder inside `path` (the
    # run's --out, which may be a mount point of its own) and moved one by one into it, weights before
    # config.json.
    if state is None:
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / ".tmp-final"
    else:
        tmp = path.parent / f".tmp-{path.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_files(tmp, model, tok, settings, weights, dtype, state)
    except BaseException as e:  # Ctrl-C too: no partial folder stays behind
        full = isinstance(e, Exception) and disk_full(e, tmp.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:  # a step checkpoint is written before the oldest goes: --keep K needs room for K + 1
            fewer = "keep fewer checkpoints (--keep), " if settings.get("keep", 1) > 1 else ""
            saved = checkpoints(path.parent.parent if state is not None else path)
            then = f"; --resume then goes on from {saved[-1].name}" if saved else ""
            raise OSError(f"no space left on {tmp.parent} to save {path.name} (the partial {tmp.name} is "
                          f"removed): free some space, {fewer}or choose another --out{then}") from e
        raise
    normal_modes(tmp)
    if state is not None:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        return
    last = ("config.json", adapter.CONFIG)  # the file that makes it a checkpoint goes in last
    for marker in last:  # and an earlier save's goes first: a move cut short leaves no model that looks whole
        (path / marker).unlink(missing_ok=True)
    files = sorted(tmp.iterdir(), key=lambda file: file.name in last)
    written = {file.name for file in files}
    for file in files:
        if file.name in last:  # an earlier save's weights in another layout, or files fitted to them, would
            for old in path.iterdir():  # sit beside these weights: they go before the checkpoint is whole again
                if old.name not in written and (old.name in STALE or is_weight_file(old.name)):
                    old.unlink()
        os.replace(file, path / file.name)
    tmp.rmdir()


def disk_full(e: BaseException, folder: Path) -> bool:
    # A full disk is an OSError from Python, a SafetensorError from safetensors (which removes its partial file
    # first, so the disk can look roomy again; its message keeps the OS's error) and a RuntimeError from
    # torch.save: the errno, the OS's message in the error or one it chains, or the free space (read before
    # the partial files go) names it whatever the writer.
    while e is not None:
        if getattr(e, "errno", None) == errno.ENOSPC or "os error 28" in str(e) or "No space left" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return shutil.disk_usage(folder).free < 2**20


def write_files(tmp: Path, model: Transformer, tok: Tokenizer, settings: dict, weights: dict,
                dtype: torch.dtype, state: dict | None) -> None:
    # Every file of the checkpoint, into the temporary directory `tmp` (save_checkpoint).
    if settings["adapter"] != "none":  # the adapter alone, its base named, and no float32 base copy
        adapter.save(model.adapter, tmp, base_pointer(settings["init"]))
        dtype = torch.float32
    else:
        save_model(tmp, model, tok, settings["mode"] == "mars", weights, dtype)
    tok.save_pretrained(tmp)
    (tmp / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")
    if state is not None:
        torch.save(state if dtype == torch.float32 else {**state, "model": weights}, tmp / "train_state.pt")


def same_base(path: Path, init: str) -> bool:
    # Whether --init names the base the adapter run in `path` was trained on: the same hub id (an alias is its
    # id), or the same folder.
    then, now = (ALIASES.get(x.lower(), x) for x in (adapter.base_path(path), base_pointer(init)))
    return then == now or (Path(then).is_dir() and Path(now).is_dir() and os.path.samefile(then, now))


def base_pointer(init: str) -> str:
    # What an adapter run records as its base: an alias or hub id as given, a directory as an absolute path.
    return str(Path(init).resolve()) if init != "tiny" and Path(init).is_dir() else init


def save_model(tmp: Path, model: Transformer, tok: Tokenizer, mars: bool, weights: dict, dtype: torch.dtype) -> None:
    # A MARS model names its mask id in config.json as pard_token, where vLLM's parallel drafting
    # looks for it; generation stops at both of the decoder's stop tokens.
    model.save_pretrained(tmp, extra={"pard_token": tok.mask_id} if mars else None,
                          generation={"eos_token_id": [tok.eos_id, tok.pad_id], "pad_token_id": tok.pad_id},
                          dtype=dtype, state=weights)


def step_checkpoint(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:06d}"


def checkpoints(out: Path) -> list[Path]:
    # Complete checkpoints, oldest first (by step: past step 999,999 the names outgrow their zero padding). A
    # step-* directory only ever appears whole (renamed from .tmp-step-*) and leaves by a rename to
    # .deleting-step-* before its files go, so a killed save or delete leaves nothing that looks real; the file
    # test skips anything else a user put there.
    def complete(folder: Path) -> bool:
        return (folder / "train_state.pt").is_file() and any((folder / w).is_file() for w in WEIGHTS)

    found = [folder for folder in (out / "checkpoints").glob("step-*")
             if re.fullmatch(r"step-[0-9]+", folder.name) and complete(folder)]
    return sorted(found, key=lambda folder: int(folder.name[5:]))


def delete_checkpoint(path: Path) -> None:
    # Rename first, then delete: a kill mid-way leaves a .deleting-* folder that nothing lists.
    trash = path.with_name(f".deleting-{path.name}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash)


def keep_newest(out: Path, keep: int) -> None:
    for old in checkpoints(out)[:-keep]:
        delete_checkpoint(old)


def has_model(out: Path, since: Path | None = None) -> bool:
    # A whole model in `out`: its config goes in last (save_checkpoint), so a save cut short has none. since: a
    # file the model must be newer than (a step checkpoint's train_state.pt: the run's final save comes after it,
    # and a model an earlier stop of the run saved does not).
    configs = [c for c in (out / "config.json", out / adapter.CONFIG) if c.is_file()]
    return bool(configs) and (since is None or max(c.stat().st_mtime_ns for c in configs) >= since.stat().st_mtime_ns)


def resume_point(out: Path, resume: bool, env: Env) -> Path | None:
    # The checkpoint a run in `out` continues from, or None for a fresh start. --resume on a folder with
    # no complete checkpoint (a run killed before its first save) starts fresh, saying so, and sets the
    # old metrics aside; without --resume, a folder that already holds a run is refused.
    metrics = out / "metrics.jsonl"
    found = checkpoints(out)
    if resume and found:
        readable(found)
        return found[-1]
    if resume and has_model(out):
        further = ("An adapter trains on only from a step checkpoint: start a new adapter run with another --out"
                   if adapter.is_adapter(out) else
                   f"To train that model further, start a run with --init {out} and another --out")
        raise SystemExit(f"error: {out} holds a finished model and no step checkpoint to resume from: --resume would "
                         f"train again from --init and replace it. {further}")
    if resume:
        env.log(f"--resume: no complete checkpoint in {out / 'checkpoints'}; starting fresh")
        if env.master and metrics.exists():
            aside = next(p for i in range(1, 10**6) if not (p := out / f"metrics.jsonl.stale-{i}").exists())
            os.replace(metrics, aside)
            env.log(f"the old metrics are set aside as {aside}")
    elif metrics.exists():
        raise SystemExit(f"error: {out} already holds a run (metrics.jsonl): pass --resume to continue it, "
                         "or choose another --out")
    elif model := next((f for f in ("config.json", *WEIGHTS, adapter.CONFIG) if (out / f).is_file()), None):
        raise SystemExit(f"error: {out} holds a model ({model}) and no run of this code: the run's saves would "
                         "overwrite it (a base given as --init, say); choose another --out")
    return None


def readable(found: list[Path]) -> None:
    # The newest checkpoint's files open (the saves are renamed into place whole, but a disk can still
    # fail): else say which one, and which the run would go on from without it.
    from safetensors import safe_open

    newest = found[-1]
    try:
        torch.load(newest / "train_state.pt", map_location="cpu", weights_only=True, mmap=True)
        is_adapter = (newest / adapter.WEIGHTS).is_file()
        weights = [newest / adapter.WEIGHTS] if is_adapter else list(checkpoint_files(newest))
        for w in weights:  # each safetensors file, the shards of a sharded one (never its JSON index)
            with safe_open(w, framework="pt"):
                pass
        for name in ("settings.json", adapter.CONFIG if is_adapter else "config.json", "tokenizer.json"):
            read_json(newest / name, "")  # each there, and a JSON object
    except Exception as e:  # noqa: BLE001 - torch and safetensors raise several kinds for a damaged file
        then = f"--resume goes on from {found[-2].name}" if len(found) > 1 else "--resume starts fresh"
        raise SystemExit(f"error: {newest}: this checkpoint cannot be read ({type(e).__name__}: {str(e)[:200]}); a "
                         f"damaged disk or copy. Delete it and {then}") from None


# The settings that say what a run trains (its objective, its model's shape, its examples): a resume that
# changed one would carry on another run's optimizer state and schedule, so it is refused. The rest (the
# learning rate, the budget, the logging) may change, with a warning.
FIXED_ON_RESUME = ("mode", "block_size", "ar_weight", "last_turn_only", "max_len", "mask_target", "adapter",
                   "lora_rank", "lora_alpha")
# Settings of removed features (docs/method.md §16) that changed what a run trains, with the value that is
# what every run trains now: a checkpoint saved with that value resumes, one saved with another cannot. A
# removed setting that never changed the training (calibrate: a map fitted after it) is not read.
REMOVED_ON_RESUME = {"teacher": "none", "mask_embed": "one"}


def restore(path: Path, model: Transformer, opt: torch.optim.Optimizer, settings: dict, env: Env,
            total: int, data: dict) -> tuple[int, dict]:
    # Everything a resumed run takes from its checkpoint besides the weights it loaded: the float32
    # master weights (of a checkpoint saved in bf16), the optimizer, the RNG, the settings check and the
    # data check (`data`: run.data_key of the data now). -> (the step to continue from, the run's clock
    # at it, for --minutes: run.Run.state). A checkpoint at the last step whose run has no whole model in
    # OUT saved after it (its final save failed) returns that step: the run then saves the model and ends. The
    # metrics rows after the checkpoint go only once the run is sure to go on (redo_after).
    # memory-mapped: a process reads only the pages it uses (its shard, under FSDP)
    saved = read_json(path / "settings.json", "the run's flags as a JSON object: copy them from another checkpoint "
                      "of the run, or delete this one to go on from the one before")
    if removed := [k for k, now in REMOVED_ON_RESUME.items() if saved.get(k, now) != now]:
        then = ", ".join(f"--{k.replace('_', '-')} {saved[k]}" for k in removed)
        raise ValueError(f"{path}: trained with {then}, which this code no longer has (docs/method.md §16); "
                         "resume it with the code that trained it, or start the run again in another --out")
    if fixed := [k for k in FIXED_ON_RESUME if k in saved and saved[k] != settings.get(k)]:
        flags = [f"--{k.replace('_', '-')}" for k in fixed]
        then = ", ".join(f"{flag} {saved[k]}" for flag, k in zip(flags, fixed))
        now = ", ".join(f"{flag} {settings.get(k)}" for flag, k in zip(flags, fixed))
        raise ValueError(f"{path}: trained with {then}, resumed with {now}, which changes what the run trains; "
                         "resume with the run's own flags, or train the new ones in another --out")
    if settings.get("adapter", "none") != "none" and adapter.is_adapter(path) and not same_base(path, settings["init"]):
        then = adapter.base_path(path)
        raise ValueError(f"{path}: an adapter on the frozen base {then}, resumed with --init {settings['init']}, "
                         f"which its saves would name as its base; resume with --init {then}")
    state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=True, mmap=True)
    if "model" in state:  # the float32 weights of a run saved in another dtype; under FSDP, each process's shard
        load_model_state(model, state["model"])
    if state["global_batch"] != settings["global_batch"]:
        raise SystemExit(f"error: {path}: saved with global batch {state['global_batch']}, now "
                         f"{settings['global_batch']}; resume with the same --global-batch")
    load_optimizer_state(model, opt, state["optimizer"])
    torch.set_rng_state(state["torch_rng"].cpu())
    step = state["step"]
    here = ("resume", "device", "compile", "out", "fsdp")  # how and where this run goes on, not what it trains
    changed = [k for k, v in settings.items() if saved.get(k) != v and k not in here]
    if changed:
        env.log("warning: flags that differ from the checkpoint's: "
                + ", ".join(f"--{k.replace('_', '-')} {saved.get(k)} -> {settings[k]}" for k in changed))
    then = state.get("data")
    if then is not None and {**then, "split": data["split"]} != data:  # the split and the order follow the
        # examples: they would change. The flags the held-out split follows besides the files (run.split_data);
        # --eval-every by being 0 or not, --eval-data and --eval-max always; --eval-fraction only where there is
        # a split of --data (with evals on)
        split = (bool(saved.get("eval_every", 1)) or bool(settings.get("eval_every", 1))) and not (
            saved.get("eval_data") or settings.get("eval_data"))
        moved = [f"--{k.replace('_', '-')}" for k in ("eval_data", "eval_fraction", "eval_max")
                 if (split or k in ("eval_data", "eval_max")) and k in saved and saved[k] != settings.get(k)]
        moved += ["--eval-every"] * (bool(saved.get("eval_every", 1)) != bool(settings.get("eval_every", 1)))
        if split and not moved and then.get("split", "by --seed") != data["split"]:
            raise ValueError(f"{path}: saved by an earlier version of this code, whose held-out split was drawn "
                             f"{then.get('split', 'by --seed')}, not {data['split']}: resume with that version, or "
                             f"train on from this checkpoint's model in another --out (--init {path})")
        cause = f"{', '.join(moved)} changed, which the held-out split follows," if moved else "the data changed"
        raise ValueError(f"{path}: {cause} since this checkpoint ({then['train']} training and "
                         f"{then['held_out']} held-out examples then, {data['train']} and {data['held_out']} now, "
                         f"lengths {'alike' if then['lengths'] == data['lengths'] else 'different'}); resume "
                         "with the data and the flags it was trained with, or train the new ones in another --out")
    if step > total or (step == total and has_model(path.parent.parent, since=path / "train_state.pt")):
        reached = f"{step} of {total}" if step == total else f"{step}, past the {total} these flags give"
        raise ValueError(f"{path}: the run already reached step {reached}; raise --max-steps or --epochs to train on")
    return step, state.get("clock", {})


def redo_after(path: Path, step: int, out: Path, env: Env) -> None:
    # A resumed run, once every check has passed, is about to redo the steps after its checkpoint `path`:
    # their metrics rows go, so that its rows match an unbroken run's.
    metrics = out / "metrics.jsonl"
    if env.master:
        lines = metrics.read_bytes().splitlines() if metrics.exists() else []
        rows = []
        for i, line in enumerate(lines, 1):
            try:
                row = json.loads(line)  # UTF-8 bytes; a bad byte is a ValueError too
            except ValueError as e:
                if i < len(lines):
                    raise ValueError(f"{metrics}:{i}: not a JSON row ({e}); fix or delete that line, then "
                                     "--resume again") from None
                env.log(f"warning: {metrics}:{i}: the last row was cut short (a kill or a full disk); dropped")
                continue
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError(f"{metrics}:{i}: not a metrics row (a JSON object with an integer step); fix or "
                                 "delete that line, then --resume again")
            rows.append(row)
        with writing(metrics):
            write_atomic(metrics, "".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step))
    env.log(f"resumed from {path} at step {step}")


# ---- the model a run starts from ----

def ensure_mask_row(model: Transformer, mask_id: int, init: str = "checkpoint") -> None:
    # The mask token reuses a spare embedding row (docs/method.md §2), which starts as the checkpoint
    # has it, or with init "mean" at the mean of the rows before it. A model without a spare row grows
    # by one (and so does an untied lm_head); the grown row has no checkpoint value and starts at the mean.
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
    # A 0.8M-parameter Qwen2 for the CPU demo, sized to the byte-level tokenizer (260 ids); why this
    # size: docs/training.md.
    return Config(vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=384,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=512,
                  torch_dtype="float32", bos_token_id=tok.pad_id, eos_token_id=tok.eos_id)


def initial_model(s: Settings, init: Path | None, device: torch.device, dtype: torch.dtype) -> Transformer:
    # The weights --init names: the checkpoint at `init` in `dtype`, or (init None) the tiny model, seeded
    # so that every process builds the same float32 weights.
    if init is None:
        torch.manual_seed(s.seed)
        return Transformer(tiny_config(Tokenizer.byte_level())).to(device)
    return Transformer.from_pretrained(init, device, dtype)


def attach_adapter(model: Transformer, tok: Tokenizer, s: Settings) -> None:
    # A fresh gated adapter (adapter.py) on the frozen model, seeded: the same random A in every process
    # and every rerun.
    if tok.mask_id >= model.config.vocab_size:
        raise ValueError(f"--init {s.init}: the mask id {tok.mask_id} has no embedding row (vocab "
                         f"{model.config.vocab_size}); a frozen base cannot grow one: train without --adapter")
    torch.manual_seed(s.seed)
    adapter.attach(model, tok.mask_id, s.lora_rank, s.lora_alpha, "mean" if s.mask_init == "mean" else "zero")


def build_model(s: Settings, env: Env, resume_from: Path | None) -> tuple[Transformer, Tokenizer]:
    # -> (the model to train, its tokenizer). From the checkpoint when resuming (checkpoint.restore then
    # puts back the exact float32 weights and the optimizer), else from --init. A gated adapter trains on
    # a frozen base kept in the compute dtype: no float32 master copy.
    base_dtype = env.compute if s.adapter != "none" else torch.float32
    # --init, resolved (a hub id is downloaded on first use) only where it is needed
    init = resolve_checkpoint(s.init, "--init") if s.init != "tiny" and resume_from is None else None
    if init is not None:
        check_finished(init, "--init")
    if init is not None and adapter.is_adapter(init):
        base = adapter.base_path(init)
        raise ValueError(f"--init {s.init}: an adapter run ({adapter.CONFIG}), not a model to start from: a new "
                         f"adapter starts from its base, --init {base}; the run itself trains on with the flags it "
                         f"was started with and --resume (--init {base} --out {s.init})")
    if resume_from is not None:
        model = load_model(resume_from, env.device, base_dtype, torch.float32, decoding=False).train()
        tok = Tokenizer.from_pretrained(resume_from)
    else:
        model = initial_model(s, init, env.device, base_dtype)
        tok = Tokenizer.byte_level() if init is None else Tokenizer.from_pretrained(init)
        if s.adapter != "none":
            attach_adapter(model, tok, s)
        else:
            ensure_mask_row(model, tok.mask_id, s.mask_init)
    return model, tok


# ---- the metrics a run writes ----

PROGRESS_SECONDS = 30.0  # off a terminal, the longest a run goes without printing a line


class Metrics:
    # OUT/metrics.jsonl: one JSON row per step and per eval, which rank 0 alone writes and prints. Every
    # row goes to the file; on the screen a step's line is kept when `keep` says so, and on a terminal
    # the other steps' lines are drawn in place, one line that the next step or kept line overwrites.
    # Off a terminal (a pipe, `tee`, nohup, CI) nothing is drawn in place, so a step's line is also kept
    # once PROGRESS_SECONDS have passed since the last line printed: a long stage never looks hung.
    def __init__(self, out: Path, env: Env, mars: bool, now: Callable[[], float] = time.monotonic):
        self.file = open(out / "metrics.jsonl", "a") if env.master else None
        self.log, self.n_losses = env.log, 3 if mars else 2  # (loss, loss_ar, loss_mask) or (loss, loss_ar)
        self.live = env.master and sys.stdout.isatty()
        self.now, self.printed = now, now()

    def losses(self, losses: list[float], prefix: str) -> tuple[dict, str]:
        row = {prefix + k: v for k, v in zip(("loss", "loss_ar", "loss_mask")[: self.n_losses], losses)}
        return row, " | ".join(f"{k} {v:.4f}" for k, v in zip(("loss", "ar", "mask")[: self.n_losses], losses))

    def write(self, row: dict, line: str, keep: bool = True) -> None:
        if self.file is not None:
            with writing(self.file.name):
                self.file.write(json.dumps(row) + "\n")
                self.file.flush()
        if self.live:  # "\r\x1b[K": back to the line's start and clear it, over the line drawn in place
            print("\r\x1b[K" + line, end="\n" if keep else "", flush=True)
        elif keep or self.now() - self.printed >= PROGRESS_SECONDS:
            self.log(line, flush=True)  # a pipe holds what is printed until its buffer fills
            self.printed = self.now()

    def eval(self, step: int, losses: list[float]) -> None:
        row, text = self.losses(losses, "eval_")
        self.write({"step": step} | row, f"eval step {step} | {text}")

    def train(self, step: int, total: int, losses: list[float], stats: dict, eta: float, keep: bool) -> None:
        # stats: lr, grad_norm, tokens (real clean tokens, all processes), epoch, dt (seconds)
        row, text = self.losses(losses, "")
        self.write({"step": step} | row | stats, f"step {step}/{total} | {text} | lr {stats['lr']:.2e} | "
                   f"{stats['tokens'] / stats['dt']:,.0f} tok/s | eta {eta / 60:.1f} min", keep)

    def __enter__(self) -> "Metrics":
        return self

    def __exit__(self, *exc) -> None:  # closed however the run ends
        if self.file is not None:
            try:
                self.file.close()
            except OSError:  # a row a full disk refused flushes again here: the write's own error says what to do
                if exc[0] is None:
                    raise
