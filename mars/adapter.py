# The gated mask adapter (docs/method.md §10): low-rank updates on every linear layer of a frozen
# Qwen2, switched on only at <|mask|> positions, plus a learnt offset of the mask's embedding.
#
# Why it keeps the base model's output exactly: a clean (non-mask) token never attends to a mask
# (the MARS attention rule), and at a clean position every linear layer computes its base output
# untouched. So every clean position, and every logit that greedy decoding and --verify read at
# one, is the base model's, bit for bit. Only the mask slots, the drafts, change.
#
# model.py stays a plain Qwen2: the adapter is its own module, attached with forward hooks. The
# embedding's hook records which positions hold the mask; each linear layer's hook adds its update
# there and nowhere else.
#
# On disk an adapter run is adapter.safetensors + mars_adapter.json (rank, alpha, mask id and the
# base checkpoint it belongs to) + the tokenizer files, and no config.json: a tool that cannot gate
# finds no model there, and PEFT's adapter_config.json is absent, so nothing loads it as a plain LoRA.
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from mars.files import open_safetensors, read_json
from model import Transformer

CONFIG = "mars_adapter.json"
WEIGHTS = "adapter.safetensors"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHARED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # linears of a layer that read one input


class MaskAdapter(nn.Module):
    def __init__(self, model: Transformer, mask_id: int, rank: int = 16, alpha: float = 32.0,
                 embed_init: str = "zero"):
        super().__init__()
        self.mask_id, self.rank, self.alpha = mask_id, rank, alpha
        self.scale = alpha / rank
        self.names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.split(".")[-1] in TARGETS]
        modules = dict(model.named_modules())
        # LoRA's initialisation: A random, B zero, so a fresh adapter changes nothing.
        self.A = nn.ParameterDict({key(n): nn.Parameter(torch.randn(rank, modules[n].in_features) / rank**0.5)
                                   for n in self.names})
        self.B = nn.ParameterDict({key(n): nn.Parameter(torch.zeros(modules[n].out_features, rank))
                                   for n in self.names})
        # (C,), added to the mask's embedding. "mean": the mask starts at the mean embedding row
        # instead of the checkpoint's spare row, which is far from every real token.
        E = model.model.embed_tokens.weight.detach()
        start = torch.zeros(E.shape[1], device=E.device)
        if embed_init == "mean":  # accumulated in float32, without a float32 copy of the whole table
            start = E[:mask_id].mean(0, dtype=torch.float32) - E[mask_id].float()
        self.embed = nn.Parameter(start)
        self.gate: torch.Tensor | None = None  # (R, T, 1) bool: mask positions of the current forward
        self.at: torch.Tensor | None = None  # (n,) their flat indices in R x T: the only rows updates touch
        self.any = False  # whether the current forward has a mask at all (clean forwards skip the work)
        self.dense = False  # whether most of its positions are masks (see on_embed)
        self.gated_scale: torch.Tensor | None = None  # (R T, 1) decoding's scale at the masks, 0 elsewhere
        # The linears that read one input share its gather and one A matmul: the first of them to run
        # computes every member's update and leaves the others theirs, with the input they are for.
        self.group = {n: readers_of_input(n, self.names) for n in self.names}
        self.pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (its input, its update)
        self.outs = {n: modules[n].out_features for n in self.names}
        self.sizes = {n: [self.outs[m] for m in self.group[n]] for n in self.names}  # a group's outs, by its first
        self.groups = list({tuple(g): list(g) for g in self.group.values()}.values())  # each group once
        self.kept: dict[object, tuple] = {}  # group -> (stacked A, block-diagonal B), float32: see stacked
        self.versions: tuple = ()  # the weights' versions when `kept` was filled
        self.weights = list(self.parameters())  # the same objects for good: loads and .to() fill them in place
        # Decoding's update of one linear, in place, when set: (name, its input, its output) -> the output, or
        # None where it does not apply; a faster kernel for the same sums (mars/cpu.py, use_lowrank_kernel).
        self.lowrank = None

    def forget(self) -> None:
        # Decoding's float32 copies (`kept`) are stale: the weights changed in a way their versions may not
        # show (a fused optimizer step leaves them as they were; so does .to()).
        self.kept.clear()
        self.versions = ()

    def _apply(self, *args, **kwargs):  # .to(), .cuda(), .float(): the weights' storage is replaced
        out = super()._apply(*args, **kwargs)
        if hasattr(self, "kept"):
            self.forget()
        return out

    def on_embed(self, module, args, out):
        self.pending.clear()
        self.gate = (args[0] == self.mask_id)[..., None]
        decoding = not torch.is_grad_enabled()
        if decoding and torch.compiler.is_compiling():
            # A compiled decode step's shapes depend on no count of the masks (a count is also a wait for
            # the device): the updates run on every row, zero off the masks (see below).
            self.at, self.any, self.dense = None, True, True
        else:
            self.at = self.gate.view(-1).nonzero()[:, 0]
            self.any = len(self.at) > 0
            # Mostly masks (a decode step: a few tokens, then masks): the updates run on every row, which
            # costs less than a gather of the mask rows and a scatter back (on the 0.5B at batch 1, 106 ms a
            # forward of 13 positions against 113). Decoding then scales the low-rank inputs by the gate, so
            # each update is zero off the masks and is added into the output in place; under autograd a
            # select keeps the base's rows. Mostly clean (a prompt): the mask rows alone.
            self.dense = 2 * len(self.at) >= self.gate.numel()
        if not self.any:
            return out
        if decoding:
            if not torch.compiler.is_compiling():  # a compiled step's caller has checked (ready)
                self.check_versions()
            if self.dense or self.lowrank is not None:  # the gate folds into the low-rank inputs (lowrank's too)
                self.gated_scale = self.gate.view(-1, 1) * self.scale  # (R T, 1) float32: scale at masks, 0 elsewhere
        return torch.where(self.gate, out + self.embed.to(out.dtype), out)

    def check_versions(self) -> None:
        # A weight changed in place (a load)? Then `kept` is stale. Once a forward, eagerly.
        versions = tuple(p._version for p in self.weights)
        if versions != self.versions:
            self.kept.clear()
            self.versions = versions

    def ready(self) -> None:
        # Before a compiled decode step (mars/compiled.py): `kept` checked and made for every group, eagerly.
        # The step reads them and makes none: a copy made inside it would be one of its outputs, which on CUDA
        # the next replay of its graph overwrites; and a check of the versions there breaks the graph.
        self.check_versions()
        for group in self.groups:
            self.stacked(group)

    def updates(self, names: list[str], x: torch.Tensor) -> list[torch.Tensor]:
        # scale * B A x for each of the linears `names` that read x (R, T, in): one gather and one matmul
        # with their A's stacked, then each one's B. Training: in x's dtype, at every row when dense (a select
        # then keeps the base's rows), at the mask rows when not. Decoding: in float32, with the B's as one
        # block-diagonal matmul (see stacked), at every row when dense (zero off the masks, the gate folded
        # into the low-rank input), at the mask rows when not. -> [(n, out_i)]
        x = x.reshape(-1, x.shape[-1])
        x = x if self.dense else x[self.at]  # (n, in)
        if not torch.is_grad_enabled():
            A, B = self.stacked(names)
            u = F.linear(x.float(), A) * (self.gated_scale if self.dense else self.scale)
            return F.linear(u, B).split_with_sizes(self.sizes[names[0]], -1)
        A = torch.cat([self.A[key(n)] for n in names]) if len(names) > 1 else self.A[key(names[0])]
        u = F.linear(x, A.to(x.dtype)) * self.scale  # (n, rank * len(names))
        return [F.linear(part, self.B[key(n)].to(x.dtype)) for part, n in zip(u.split(self.rank, -1), names)]

    def stacked(self, names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        # (A's stacked (k rank, in), B's on the diagonal (sum of outs, k rank)) in float32, for the k linears
        # `names`, for decoding. These products are small (a few rows, rank r): in bf16 each one costs a
        # fixed 20-50 us on a CPU, in float32 a few (docs/real-model.md, arm 8), and one matmul with the
        # block-diagonal B costs less than k small ones (its zeros add exact zeros). Kept between forwards
        # until a weight changes (check_versions, once a forward); never made in a compiled step (ready).
        kept = self.kept.get(names[0])
        if kept is None:
            A = torch.cat([self.A[key(n)].detach().float() for n in names])
            B = torch.block_diag(*[self.B[key(n)].detach().float() for n in names])
            kept = (A, B)
            if not torch.compiler.is_compiling():
                self.kept[names[0]] = kept
                if A.is_cuda:  # a CUDA graph reads them where they lie, as the weights: no copy in each replay
                    for t in kept:
                        torch._dynamo.mark_static_address(t, guard=False)
        return kept

    def on_linear(self, name: str):
        def hook(module, args, out):
            # The update is added at the mask rows alone: every other row of out is the base's, untouched,
            # and a forward with few masks pays for few.
            if not self.any:
                return out
            if self.lowrank is not None and not torch.is_grad_enabled() \
                    and (done := self.lowrank(name, args[0], out)) is not None:
                return done
            x, delta = self.pending.pop(name, (None, None))
            if x is not args[0]:  # the first of its group to run (or alone)
                group = self.group[name]
                deltas = self.updates(group, args[0])
                delta = deltas[group.index(name)]
                self.pending.update({n: (args[0], d) for n, d in zip(group, deltas) if n != name})
            flat = out.reshape(-1, out.shape[-1])
            if not torch.is_grad_enabled():  # decoding: delta is float32, added in place
                if self.dense:  # its rows off the masks are exact zeros: clean rows stay the base's
                    return flat.add_(delta).view(out.shape)
                return flat.index_add_(0, self.at, delta.to(out.dtype)).view(out.shape)
            delta = delta.to(out.dtype)
            if self.dense:
                return torch.where(self.gate.view(-1, 1), flat + delta, flat).view(out.shape)
            return flat.index_add(0, self.at, delta).view(out.shape)

        return hook


def readers_of_input(name: str, names: list[str]) -> list[str]:
    # The adapted linears of name's layer that read the same input as it (name among them), in SHARED's order.
    prefix, last = name.rsplit(".", 1)
    shared = next((g for g in SHARED if last in g), (last,))
    return [f"{prefix}.{m}" for m in shared if f"{prefix}.{m}" in names]


def key(name: str) -> str:
    return name.replace(".", "/")  # ParameterDict keys cannot hold dots


def attach(model: Transformer, mask_id: int, rank: int = 16, alpha: float = 32.0,
           embed_init: str = "zero") -> MaskAdapter:
    # Freezes the model, gives it an adapter (model.adapter, so .to() and .eval() reach it) and the hooks.
    for p in model.parameters():
        p.requires_grad_(False)
    device = model.model.embed_tokens.weight.device
    adapter = MaskAdapter(model, mask_id, rank, alpha, embed_init).to(device)
    modules = dict(model.named_modules())
    modules["model.embed_tokens"].register_forward_hook(adapter.on_embed)
    for n in adapter.names:
        modules[n].register_forward_hook(adapter.on_linear(n))
    model.adapter = adapter
    return adapter


def is_adapter(path: str | Path) -> bool:
    return (Path(path) / CONFIG).is_file()


def save(adapter: MaskAdapter, path: Path, base: str) -> None:
    # adapter.safetensors (float32) and mars_adapter.json, written to `path`, config last.
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu().contiguous() for k, v in adapter.state_dict().items()}
    save_file(state, path / (WEIGHTS + ".tmp"), metadata={"format": "pt"})
    os.replace(path / (WEIGHTS + ".tmp"), path / WEIGHTS)
    config = {"type": "gated-lora", "base": base, "rank": adapter.rank, "alpha": adapter.alpha,
              "mask_id": adapter.mask_id, "targets": list(TARGETS)}
    (path / (CONFIG + ".tmp")).write_text(json.dumps(config, indent=2) + "\n")
    os.replace(path / (CONFIG + ".tmp"), path / CONFIG)


def read_config(path: str | Path) -> dict:
    file = Path(path) / CONFIG
    fix = "save the run again with train.py"
    config = read_json(file, fix)
    if config.get("type") != "gated-lora":
        raise ValueError(f"{file}: type {config.get('type')!r} is not 'gated-lora'; {fix}")
    missing = [k for k in ("base", "rank", "alpha", "mask_id") if k not in config]
    if missing:
        raise ValueError(f"{file}: missing {', '.join(missing)}; {fix}")
    for key, kind, least in (("rank", int, 1), ("alpha", (int, float), 0), ("mask_id", int, 0)):
        value = config[key]
        if not isinstance(value, kind) or isinstance(value, bool) or value < least:
            raise ValueError(f"{file}: {key} {value!r} must be a number of at least {least}; {fix}")
    if config.get("slots", 1) != 1:  # one learnt offset per mask slot (docs/method.md §16)
        raise ValueError(f"{file}: slots {config['slots']!r}: this adapter has a mask vector per slot, which this "
                         "code no longer reads; retrain it with one mask vector (train.py --adapter gated-lora)")
    return config


def base_path(path: str | Path) -> str:
    # The base checkpoint an adapter run points to: as written (a directory, an alias or a hub id),
    # or, for a relative directory, relative to the adapter's folder.
    base = read_config(path)["base"]
    near = Path(path) / base
    return str(near) if not Path(base).is_absolute() and near.is_dir() else base


def load(model: Transformer, path: str | Path, dtype: torch.dtype | None = None) -> MaskAdapter:
    # Attaches the adapter saved in `path` to its base model (already loaded), in `dtype` (default:
    # the model's; training keeps float32 adapter weights on a bf16 base).
    config = read_config(path)
    if config["mask_id"] >= model.config.vocab_size:
        raise ValueError(f"{Path(path) / CONFIG}: mask_id {config['mask_id']} has no embedding row in the base model "
                         f"{config['base']} ({model.config.vocab_size} ids); set \"base\" to the checkpoint the "
                         "adapter was trained on")
    adapter = attach(model, config["mask_id"], config["rank"], config["alpha"])
    file = Path(path) / WEIGHTS
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing; {path} holds {CONFIG} but not its weights")
    with open_safetensors(file) as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    embed = state.get("embed")
    if embed is not None and embed.dim() == 2 and len(embed) == 1:  # written as one row per slot: (1, C)
        state["embed"] = embed[0]
    expected = {k: tuple(v.shape) for k, v in adapter.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state.items()}
    differ = sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
    if differ:  # one line, not one per tensor (a 0.5B's adapter has 337)
        k = differ[0]
        if k not in found:
            what = f"has no {k}"
        elif k not in expected:
            what = f"has {k}, which this base has no place for"
        else:
            what = f"holds {k} as {list(found[k])}, where rank {config['rank']} on this base needs {list(expected[k])}"
        raise ValueError(f"{file}: does not fit the base model {config['base']}: it {what} ({len(differ)} tensors "
                         f"differ); set \"base\" in {Path(path) / CONFIG} to the checkpoint the adapter was trained on")
    adapter.load_state_dict(state)
    adapter.to(dtype or model.model.embed_tokens.weight.dtype)
    return adapter
