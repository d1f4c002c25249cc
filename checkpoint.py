# From a --ckpt flag to a model on a device: resolve (a directory, an alias or a hub id), check, load
# (a plain checkpoint, or a gated adapter run on its base), and the settings the checkpoint was
# trained with. Every entry point (generate.py, serve.py, eval.py, train.py, the tools) loads here.
from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

import adapter
from files import checkpoint_files, read_json, read_settings
from hub import resolve_checkpoint
from model import DTYPES, Config, Transformer

DEFAULT_CKPT = "runs/demo/mars"  # where `make demo` leaves its MARS checkpoint
DEFAULT_BLOCK_SIZE = 4  # B for a checkpoint that does not say what it was trained with


def device_and_dtype(device: str, dtype: str) -> tuple[str, torch.dtype]:
    # "auto": cuda when available, and bfloat16 on cuda, float32 on cpu. The device stays a string:
    # it is printed and saved with the settings.
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise ValueError(f"--device {device}: choose auto, cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here; use --device cpu")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    return device, DTYPES[("bfloat16" if device.startswith("cuda") else "float32") if dtype == "auto" else dtype]


def check_checkpoint(ckpt: str) -> tuple[Path, Config]:
    # A directory, an alias or a hub id (downloaded on first use) -> (local directory, its config).
    # Reads config.json and the safetensors headers only; the weights load later. A gated adapter run
    # (adapter.py) is its own directory, with the config of the base it points to.
    if ckpt == DEFAULT_CKPT and not Path(ckpt).is_dir():
        raise FileNotFoundError(f"no checkpoint at {ckpt}: run `make demo` (or `make quickstart`) "
                                "first, or pass --ckpt DIR")
    path = resolve_checkpoint(ckpt)
    if adapter.is_adapter(path):
        base, _ = check_checkpoint(adapter.base_path(path))
        return path, Config.from_json(base / "config.json")
    config = Config.from_json(path / "config.json")
    checkpoint_files(path)
    return path, config


def load_model(path: str | Path, device: str | torch.device | None = None,
               dtype: torch.dtype | None = None) -> Transformer:
    # The model of a checked directory (check_checkpoint), in eval mode: a plain checkpoint, or a gated
    # adapter run attached to its base, so that every tool gates it and none applies it to every token.
    if adapter.is_adapter(path):
        base, _ = check_checkpoint(adapter.base_path(path))
        model = Transformer.from_pretrained(base, device=device, dtype=dtype)
        adapter.load(model, path)
        return model.eval()
    return Transformer.from_pretrained(path, device=device, dtype=dtype).eval()


def trained_block_size(ckpt: str | Path, flag: int = 0) -> int:
    # B for decoding: the flag when given, else the block size the checkpoint was trained with (train.py
    # writes it into settings.json), else 4. A flag that disagrees with the checkpoint wins, with a warning.
    trained = read_settings(ckpt).get("block_size")
    trained = trained if type(trained) is int and trained >= 1 else None
    if flag and trained and flag != trained:
        print(f"warning: block size {flag} differs from the {trained} that {ckpt} was trained with (its "
              f"settings.json); its mask slots learnt {trained} tokens ahead", file=sys.stderr)
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
