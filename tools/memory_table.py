# The training-memory table in the README: an ESTIMATE per GPU for Qwen2.5-0.5B and 7B on 1 and 8
# GPUs, with and without --fsdp, until it is measured on GPUs (tools/gpu_check.py measures 0.5B
# shapes on one). What it adds up:
#   - states: float32 weights, float32 gradients and AdamW's two float32 moments, 16 bytes per
#     parameter; FSDP divides them by the number of GPUs, a plain replica does not;
#   - FSDP's transient bf16 gather (mars/distributed.py, precision): the largest unit unsharded at once
#     (the root: embeddings, and the untied head of 7B, which stays gathered through the step), plus a
#     block and the next one;
#   - activations: the bytes autograd saves, measured here on the CPU on ONE layer of the real shapes
#     (random weights, bf16 autocast, the split attention of training, a MARS sequence at prompt
#     fraction 0.4 with pruning) as the growth between two lengths, times the number of layers and
#     the micro-batch's columns; the embeddings' and the final norm's few bytes per token are left out;
#   - logits: one --ce-chunk of targets: float32 logits and their gradient plus the bf16 matmul output.
# Not counted: the CUDA context and allocator fragmentation (add a few GB), NCCL buffers.
#   python -m tools.memory_table --batch-size 16 --seq-len 512
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from data import make_batch
from mars import cli
from model import CausalPrefix, Config, Transformer
from tools.bench_train import Settings as BenchSettings
from tools.bench_train import chat_batch

SHAPES = {  # docs/method.md §12
    "Qwen2.5-0.5B": Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                           num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen2.5-7B": Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
}


@dataclass
class Settings:
    batch_size: int = 16  # sequences per micro-batch per GPU (train.py's default)
    seq_len: int = 512  # tokens per sequence (the paper's max_len)
    ce_chunk: int = 2048  # train.py's --ce-chunk
    measure_len: int = 128  # sequence length of the one-layer measurement (activations scale linearly)


def saved_bytes(model: Transformer, seq_len: int) -> tuple[int, int, int]:
    # -> (bytes autograd saves in one forward, columns, clean columns) for a one-sequence MARS batch.
    bs = BenchSettings(batch_size=1, seq_len=seq_len, prompt_frac=0.4)
    batch = make_batch(chat_batch(bs, 500), 4, 511, 510, "mars", True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    mask = CausalPrefix(batch.L, batch.noisy_mask())  # the training path: causal kernel + masked call
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.hidden(batch.tokens, batch.pos, mask)
    del h
    return sum(sizes.values()), batch.tokens.shape[1], batch.L


def layer_activation_bytes_per_token(c: Config, s: Settings) -> tuple[float, float]:
    # -> (bytes per column, columns per clean column) for one layer in a MARS batch: the slope
    # between two lengths, so that what does not grow with the batch (the bf16 copies of the
    # weights that autocast keeps for the backward) is left out.
    one = replace(c, num_hidden_layers=1, vocab_size=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Transformer(one)
    b1, t1, _ = saved_bytes(model, s.measure_len)
    b2, t2, l2 = saved_bytes(model, 2 * s.measure_len)
    return (b2 - b1) / (t2 - t1), t2 / l2


def main(argv: list[str] | None = None) -> None:
    s = cli.parse(Settings, argv, "Estimated training memory per GPU (README table).")
    GB = 1e9
    print(f"ESTIMATE, per GPU, micro-batch {s.batch_size} x {s.seq_len} (MARS, prompt fraction 0.4, pruned), "
          f"bf16 autocast, float32 master weights and AdamW, --ce-chunk {s.ce_chunk}\n")
    print("| model | GPUs | --fsdp | states | gathered | activations | logits chunk | total |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for name, c in SHAPES.items():
        with torch.device("meta"):
            P = sum(p.numel() for p in Transformer(c).parameters())
            block = sum(p.numel() for p in Transformer(replace(c, num_hidden_layers=1)).model.layers[0].parameters())
        root = P - c.num_hidden_layers * block
        per_token, columns = layer_activation_bytes_per_token(c, s)
        act = per_token * columns * s.seq_len * s.batch_size * c.num_hidden_layers
        logits = s.ce_chunk * c.vocab_size * (4 + 4 + 2)
        for gpus in (1, 8):
            for fsdp in ((False, True) if gpus > 1 else (False,)):
                states = 16 * P / (gpus if fsdp else 1)
                gathered = 2 * (root + 2 * block) if fsdp else 0
                total = states + gathered + act + logits
                print(f"| {name} ({P / 1e9:.2f}B) | {gpus} | {'yes' if fsdp else 'no'} | {states / GB:.1f} GB | "
                      f"{gathered / GB:.1f} GB | {act / GB:.1f} GB | {logits / GB:.1f} GB | {total / GB:.1f} GB |")


if __name__ == "__main__":
    main()
