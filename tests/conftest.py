# Shared test helpers for both tiers (tests/spec: the method's oracles; tests/product: everything a
# user runs around it): tiny random Qwen2 checkpoints, transformers' as the reference, and the fixtures.
import random
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
torch.set_num_threads(2)
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@contextmanager
def child(argv: list[str], **kw):
    # A subprocess that a test drives; killed on the way out, whatever the test did, so a failed
    # or interrupted test leaves no process behind.
    proc = subprocess.Popen(argv, **kw)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


# Every model of ours that a test builds comes from tiny_model: 2 layers, width 32, 4 query heads
# on 2 kv heads, float32; a test passes only what it needs to differ (the vocabulary, tying, ...).
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=512, torch_dtype="float32")


def tiny_model(seed: int = 0, spread: float = 0.3, sharpen: float = 3.0, norm_spread: float = 0.1,
               **config):
    """A random Qwen2 (torch seed `seed`) in eval mode. spread > 0 redraws every weight and bias as
    spread * N(0, 1) and every norm as 1 + norm_spread * N(0, 1), so logits differ sharply between
    contexts (a position that sees one token too many changes its loss far beyond atol); spread=0 keeps
    the model's own init, near-uniform predictions, as a fresh run starts. sharpen then scales the
    embedding (= the tied head): at 3 the confidences spread over (0, 1), so thresholds between 0.3 and
    0.9 accept ragged runs of tokens."""
    from model import Config, Transformer

    torch.manual_seed(seed)
    model = Transformer(Config(**{**TINY, **config})).eval()
    with torch.no_grad():
        if spread:
            for name, p in model.named_parameters():
                noise = torch.randn_like(p)
                p.copy_(1 + norm_spread * noise if name.endswith("norm.weight") else spread * noise)
        if sharpen != 1:
            model.model.embed_tokens.weight.mul_(sharpen)
    return model


# The loss tests' model: norms spread as far as the weights, the head not sharpened, 100 ids (the
# mask is 99). Large random weights make logits differ sharply between contexts: a mask that lets a
# position see one token too many changes its loss far beyond atol.
LOSS_MODEL = dict(norm_spread=0.3, sharpen=1.0, vocab_size=100)


def random_examples(B: int, seed: int, n: int = 5) -> list[tuple[np.ndarray, np.ndarray]]:
    # Different lengths (so the batch has right padding), a prompt, then answer spans with
    # unsupervised user turns between them (multi-turn); lengths are multiples of B.
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = max(4, B * rng.randint(2, 24 // B + 2))
        length += -length % B
        sup, p = [False] * length, rng.randint(1, length - 2)
        while p < length:
            span = rng.randint(1, 2 * B)
            sup[p : p + span] = [True] * len(sup[p : p + span])
            p += span + rng.choice([0, rng.randint(1, 2 * B)])
        out.append((np.array([rng.randrange(0, 90) for _ in range(length)]), np.array(sup)))
    return out


def tiny_checkpoint(path: Path, seed: int = 0, **kw):
    """tiny_model over the byte-level tokenizer (260 ids, its end of turn as eos), saved in `path` with
    the tokenizer files, the way the demo saves its model. Returns (model, tokenizer)."""
    from mars.tokenizer import Tokenizer

    tok = Tokenizer.byte_level()
    model = tiny_model(seed, **{"vocab_size": tok.vocab_size, "eos_token_id": tok.eos_id, **kw})
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


def tiny_run_dir(root: Path, chats: int, system: bool = True) -> Path:
    """root/init, a tiny_checkpoint near a fresh run's start (spread 0), and root/train.jsonl, `chats`
    short chats ("add 3 4" -> "3+4=7"), with a system turn or without: the data the training tests run on."""
    import json
    import random

    tiny_checkpoint(root / "init", spread=0, sharpen=1.0, max_position_embeddings=256)
    rng, rows = random.Random(0), []
    for _ in range(chats):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        msgs = ([{"role": "system", "content": "calc"}] if system else []) + [
            {"role": "user", "content": f"add {a} {b}"}, {"role": "assistant", "content": f"{a}+{b}={a + b}"}]
        rows.append(json.dumps({"messages": msgs}) + "\n")
    (root / "train.jsonl").write_text("".join(rows))
    return root


def hf_qwen2(seed: int = 0, **overrides):
    """A random transformers Qwen2ForCausalLM in float32, with every weight, bias and norm randomised
    so that a wrong cast order, a missing bias or a (1 + w) norm shows up in the logits."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    kw = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
              tie_word_embeddings=True, max_position_embeddings=256)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**kw)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Writes a random transformers model to a directory; returns (hf_model, directory)."""
    def make(seed: int = 0, max_shard_size=None, **overrides):
        model = hf_qwen2(seed, **overrides)
        path = tmp_path / f"hf-{seed}-{len(list(tmp_path.iterdir()))}"
        kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(path, **kw)
        return model, path
    return make
