# A minimal Qwen2 / Qwen2.5 transformer that computes the same logits as Hugging Face transformers'
# Qwen2ForCausalLM and reads and writes its safetensors checkpoints. MARS changes only its inputs
# (tokens, positions, attention mask), never the network; CausalPrefix is a general attention pattern
# (a causal prefix, then masked rows) that the two-stream training batch runs fast on.
from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mars.files import checkpoint_files, is_weight_file, open_safetensors, read_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0 means hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 32768
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = 151643
    eos_token_id: int | None = 151645

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    @classmethod
    def from_json(cls, path: str | Path) -> Config:
        return cls(**read_config(path, cls))  # checked field by field (files.py)

    def to_dict(self) -> dict:
        # What transformers' Qwen2Config expects, so that AutoModelForCausalLM loads our saves.
        d = asdict(self)
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
                "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": self.num_hidden_layers, "initializer_range": 0.02,
                "use_cache": True, **d}


# ---- RMSNorm and RoPE (docs/method.md §11) ----

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, cast back to the input dtype, THEN scale: the order matters in bf16.
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    # pos (R, T) -> cos, sin (R, 1, T, D). Angles in float32, then cast to the activation dtype. The sin's first
    # half comes negated, for apply_rope.
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=pos.device).float() / head_dim)
    freqs = pos.float()[..., None] * inv_freq  # (R, T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # "rotate half" layout, not interleaved pairs
    sin = emb.sin().to(dtype)
    return emb.cos().to(dtype)[:, None], torch.cat([-sin[..., :head_dim // 2], sin[..., head_dim // 2:]], -1)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x cos + rotate_half(x) sin, where rotate_half(x) = (-x2, x1) for the halves x1, x2 of x. With the sign in
    # the sin that rotate_half is a roll, (x2, x1): one op, not four, and the same numbers (a sign is exact).
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


# ---- attention: which SDPA call ----

@dataclass
class CausalPrefix:
    # An attention pattern in two query groups. The first n columns are an ordinary causal LM that
    # never looks past column n, so they run on SDPA's causal kernel, which skips the upper triangle
    # and, on CUDA, is flash attention. Only the other T - n queries pay for an explicit mask,
    # over all T keys. The result equals one call with the full (T, T) mask at every real row.
    n: int
    rest: torch.Tensor  # (R or 1, 1, T - n, T) bool, True = may attend


# A masked call on CUDA may use these kernels only. Not cuDNN: given a mask, SDPA picks it on H100/H200 since
# torch 2.11, and its backward returns NaN grad_q when the key length % 128 == 64 and some query row's logsumexp
# is below about -88.7 (pytorch/pytorch#196678; Qwen2.5-0.5B's MARS batches hit it). Flash takes no mask.
MASKED_CUDA = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
FEW_QUERIES = 8  # on the CPU, a masked GQA call (G > 1) of at most this many queries: attend()'s grouped layout


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           cuda: bool | None = None) -> torch.Tensor:
    # q (R, H, T, D); k, v (R, Hkv, S, D); mask bool (R or 1, 1, T, S) or None (causal, S = T).
    # Query head h reads kv head h // G, G = H / Hkv (GQA). The softmax runs in float32 inside SDPA.
    # cuda: take CUDA's path for a mask (None: when q is on CUDA); the CPU runs it too, for the tests.
    R, H, T, D = q.shape
    if mask is None and k.shape[2] != T:  # SDPA's causal mask would align the queries to key 0
        raise ValueError(f"a forward of {T} tokens over {k.shape[2]} keys (a cache) needs an explicit "
                         "mask: mask=None is plain causal over the tokens fed, with no cache")
    Hkv, G = k.shape[1], H // k.shape[1]
    cuda = q.is_cuda if cuda is None else cuda
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True, enable_gqa=G > 1)
    # A few queries (a decode step): the G query heads of a kv head become G*T query rows of it, (R, Hkv, G*T, D),
    # the mask repeated G times along the queries, so k and v are read as stored. On CUDA, whose memory-efficient
    # kernel takes no GQA broadcast, that saves a copy of the whole cache every step; on the CPU, SDPA's GQA call
    # costs several times as much for one query in bf16 (docs/benchmarks.md). Many queries (a prefill, a
    # training batch): the CPU's GQA call; on CUDA, k and v expanded to all H heads, past T = Hkv * D, where the
    # G-fold mask (G*T x S a row) would outgrow them (2 * G*Hkv x S x D a row).
    if G > 1 and T <= (Hkv * D if cuda else FEW_QUERIES):
        q, mask = q.reshape(R, Hkv, G * T, D), mask.repeat(1, 1, G, 1)
    elif G > 1 and cuda:
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # (R, H, S, D)
    with sdpa_kernel(MASKED_CUDA) if cuda else nullcontext():  # CUDA's heads match by now: no GQA broadcast
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != Hkv).reshape(R, H, T, D)


def attention_backends(device: str | torch.device) -> str:
    # One line for a run's log: the versions, and the SDPA kernels each of attend()'s calls may use.
    kind = torch.device(device).type
    if kind != "cuda":
        return f"attention: torch {torch.__version__} on {kind}, SDPA's default kernels for every call"
    b = torch.backends.cuda
    causal = [n for n, on in (("flash", b.flash_sdp_enabled()), ("efficient", b.mem_efficient_sdp_enabled()),
                              ("cudnn", b.cudnn_sdp_enabled()), ("math", b.math_sdp_enabled())) if on]
    return (f"attention: torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}; "
            f"causal SDPA: {', '.join(causal)}; masked SDPA: efficient, math (no cuDNN: pytorch/pytorch#196678)")


# ---- the network ----

def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    # x (..., in) runs as one (rows, in) matrix. Given a 3-D x, F.linear folds it into a matrix only when
    # its strides allow or a weight needs a gradient; otherwise (a frozen model's head on a slice h[:, :n]
    # of a wider h) it runs a batched product against the weight expanded per row, a copy of the whole weight.
    if x.dim() == 2:  # a matrix already (the training loss's rows): the product itself, not a view of it,
        return F.linear(x, w, b)  # which FSDP2 would warn of
    flat = x.reshape(x.numel() // x.shape[-1], x.shape[-1])
    return F.linear(flat, w, b).view(*x.shape[:-1], w.shape[0])


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, c: Config, layer: int):
        super().__init__()
        self.layer = layer  # which cache slot this layer reads and writes
        self.n_head, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = Linear(c.hidden_size, self.n_head * c.head_dim, bias=True)
        self.k_proj = Linear(c.hidden_size, self.n_kv * c.head_dim, bias=True)
        self.v_proj = Linear(c.hidden_size, self.n_kv * c.head_dim, bias=True)
        self.o_proj = Linear(self.n_head * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, cache):
        R, T, _ = x.shape
        q = self.q_proj(x).view(R, T, self.n_head, self.head_dim).transpose(1, 2)  # (R, H, T, D)
        k = self.k_proj(x).view(R, T, self.n_kv, self.head_dim).transpose(1, 2)  # (R, Hkv, T, D)
        v = self.v_proj(x).view(R, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # rotate before k enters a cache
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # (R, Hkv, S, D) views, S >= T
        if isinstance(mask, CausalPrefix):  # two query groups, two kernels; see CausalPrefix
            n = mask.n
            clean, q_noisy = (q[:, :, :n], k[:, :, :n], v[:, :, :n]), q[:, :, n:]
            if torch.compiler.is_compiling():  # inductor's backward of a block compiled for dynamic shapes takes
                # these slices for ones of the first batch's strides, and stops at the next shape (torch 2.11 to
                # 2.13): contiguous copies have strides of their own shape
                clean, q_noisy = tuple(t.contiguous() for t in clean), q_noisy.contiguous()
            y = torch.cat([attend(*clean, None), attend(q_noisy, k, v, mask.rest)], dim=2)
        else:
            y = attend(q, k, v, mask)
        return self.o_proj(y.transpose(1, 2).reshape(R, T, -1))


class MLP(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: Config, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.config = c = config
        # Module names are the checkpoint's key names, so loading is a strict load_state_dict.
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(c.vocab_size, c.hidden_size),
            layers=nn.ModuleList(Block(c, i) for i in range(c.num_hidden_layers)),
            norm=RMSNorm(c.hidden_size, c.rms_norm_eps),
        ))
        # Tied models have no lm_head parameter at all: the head IS the embedding (see head()).
        self.lm_head = None if c.tie_word_embeddings else Linear(c.hidden_size, c.vocab_size, bias=False)
        self.head_linear = linear  # (h, w) -> h w^T; mars/cpu.py swaps in a CPU decoding order, mars/quantize.py
        # a quantized head
        if self.model.embed_tokens.weight.device.type != "meta":
            self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def hidden(self, tokens: torch.Tensor, pos: torch.Tensor | None = None,
               mask: torch.Tensor | CausalPrefix | None = None, cache=None) -> torch.Tensor:
        # tokens (R, T); pos (R, T), default 0..T-1; mask bool (R or 1, 1, T, S), True = may attend,
        # or a CausalPrefix (no cache). mask=None means plain causal over the T tokens, which is only
        # right without a cache.
        # Every query row of the mask must allow at least one key (let pads see themselves), or
        # SDPA returns NaN there and the NaN reaches real rows through the next layer's values.
        R, T = tokens.shape
        if pos is None:
            pos = torch.arange(T, device=tokens.device).expand(R, T)
        x = self.model.embed_tokens(tokens)  # (R, T, C)
        cos, sin = rope_cos_sin(pos, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask, cache)
        return self.model.norm(x)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.head_linear(h, w)  # (..., V)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        return self.head(self.hidden(tokens, pos, mask, cache))  # (R, T, V)

    # ---- Hugging Face checkpoints ----

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device | None = None,
                        dtype: torch.dtype | None = None) -> Transformer:
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: checkpoint directory not found; pass a Hugging Face "
                                    "model directory with config.json and *.safetensors")
        config = Config.from_json(path / "config.json")
        dtype = dtype or DTYPES.get(config.torch_dtype, torch.float32)
        files = checkpoint_files(path)
        with torch.device("meta"):
            model = cls(config)
        expected = {k: v.shape for k, v in model.state_dict().items()}
        # Read tensor by tensor, straight to the target device and dtype, and hand them over with
        # assign=True: peak memory is one copy of the weights, never two.
        state, stored_head = {}, None
        for file, names in files.items():
            with open_safetensors(file) as f:
                for name in names:
                    if name == "lm_head.weight" and config.tie_word_embeddings:  # merges and exports store it too
                        stored_head = (file, f.get_tensor(name).to(device=device, dtype=dtype))
                        continue
                    if name not in expected:
                        raise ValueError(f"{file}: unexpected tensor '{name}' (not a Qwen2 weight, or "
                                         f"tie_word_embeddings={config.tie_word_embeddings} is wrong)")
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != tuple(expected[name]):
                        raise ValueError(f"{file}: tensor '{name}' has shape {list(shape)}, "
                                         f"config.json implies {list(expected[name])}")
                    state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
        missing = sorted(set(expected) - set(state))
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise ValueError(f"{path}: missing tensor(s) {', '.join(missing[:3])}{more}")
        if stored_head is not None and not torch.equal(stored_head[1], state["model.embed_tokens.weight"]):
            raise ValueError(f"{stored_head[0]}: tensor 'lm_head.weight' is not the embedding, but config.json says "
                             "tie_word_embeddings=true: set it to false to use the stored head")
        model.load_state_dict(state, strict=True, assign=True)
        return model

    def save_pretrained(self, path: str | Path, max_shard_size: int = 5 * 2**30, extra: dict | None = None,
                        generation: dict | None = None, dtype: torch.dtype | None = None,
                        state: dict[str, torch.Tensor] | None = None) -> None:
        # extra: more config.json keys (a caller's metadata; transformers keeps unknown keys as
        # attributes). generation: generation_config.json keys over the config's bos/eos ids, the
        # defaults transformers' generate() and vLLM read. Greedy unless the caller says otherwise.
        # dtype: cast the weights on the way out (e.g. float32 training weights saved as the bfloat16
        # of the release); None keeps theirs. state: the full state dict to write instead of this
        # module's own (a sharded model gathers it first).
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if state is None:  # no lm_head if tied; an attached adapter is saved apart (adapter.save)
            state = {k: v for k, v in self.state_dict().items() if not k.startswith("adapter.")}
        state = {k: v.detach().to(dtype or v.dtype).contiguous() for k, v in state.items()}
        dtype = next(iter(state.values())).dtype
        config = {**self.config.to_dict(), "torch_dtype": str(dtype).removeprefix("torch."), **(extra or {})}
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {"bos_token_id": self.config.bos_token_id, "eos_token_id": self.config.eos_token_id,
                      "do_sample": False, **(generation or {})}
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        shards, size = [{}], 0  # greedy: start a new shard when the next tensor would overflow
        for k, v in state.items():
            nbytes = v.numel() * v.element_size()
            if shards[-1] and size + nbytes > max_shard_size:
                shards.append({})
                size = 0
            shards[-1][k] = v
            size += nbytes
        names = ["model.safetensors"] if len(shards) == 1 else [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for name, shard in zip(names, shards):
            save_file(shard, path / name, metadata={"format": "pt"})
        if len(shards) > 1:
            total = sum(v.numel() * v.element_size() for v in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": {k: n for n, s in zip(names, shards) for k in s}}
            (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        # Weights of an earlier save in another layout would confuse a reader (a stale index beside new shards,
        # or old shards it names): they go, once the new files are written.
        stale = [path / "model.safetensors.index.json"] if len(shards) == 1 else []
        stale += [f for f in path.glob("model*.safetensors") if f.name not in names and is_weight_file(f.name)]
        for f in stale:
            f.unlink(missing_ok=True)

