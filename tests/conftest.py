# Shared test helpers for both tiers (tests/spec: the method's oracles; tests/product: everything a
# user runs around it): tiny random Qwen2 checkpoints, transformers' as the reference, and the fixtures.
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
torch.set_num_threads(2)
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def byte_level_checkpoint(path: Path, sharpen: float = 0.0, **overrides):
    """A tiny random model (seed 0) over the byte-level tokenizer (260 ids), saved with the tokenizer
    files the way the demo saves it; sharpen > 0 scales the embedding (= tied head) so that thresholds
    accept several tokens. Returns (model in eval mode, tokenizer)."""
    from model import Config, Transformer
    from tokenizer import Tokenizer

    tok = Tokenizer.byte_level()
    kw = dict(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              torch_dtype="float32", eos_token_id=tok.eos_id)
    torch.manual_seed(0)
    model = Transformer(Config(**{**kw, **overrides}))
    if sharpen:
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(sharpen)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model.eval(), tok


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
