# model.py must compute transformers' Qwen2ForCausalLM logits (docs/method.md §11) and read and write its
# checkpoints (§12). Every comparison is float32 with max abs diff <= 1e-4.
import json
import os
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from cudnn_nan import LSE_BOUND, math_reference, nan_case
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import model as model_py
from conftest import hf_qwen2, tiny_model
from kvcache import KVCache
from model import CausalPrefix, Transformer, attend, attention_backends

ATOL = 1e-4
DEVICE = torch.device(os.environ.get("MARS_TEST_DEVICE", "cpu"))  # the cuda-marked tests' (tools/gpu_check.py)

CONFIGS = {
    "tied-gqa2": dict(),
    "untied-mha": dict(tie_word_embeddings=False, num_key_value_heads=4),
    "gqa7": dict(hidden_size=56, num_attention_heads=7, num_key_value_heads=1),
    "head-dim-override": dict(head_dim=12, num_attention_heads=6, num_key_value_heads=3),
    "deeper-untied": dict(num_hidden_layers=4, tie_word_embeddings=False, rope_theta=1e6),
}


def tokens(vocab: int, R: int = 2, T: int = 13, seed: int = 0) -> torch.Tensor:
    return torch.randint(vocab, (R, T), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(hf_checkpoint, name):
    hf, path = hf_checkpoint(**CONFIGS[name])
    ours = Transformer.from_pretrained(path, dtype=torch.float32)
    x = tokens(hf.config.vocab_size)
    with torch.no_grad():
        assert max_diff(ours(x), hf(x).logits) <= ATOL


def test_sharded_checkpoint_loads(hf_checkpoint):
    hf, path = hf_checkpoint(max_shard_size="20KB", tie_word_embeddings=False)
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 1
    ours = Transformer.from_pretrained(path, dtype=torch.float32)
    x = tokens(hf.config.vocab_size)
    with torch.no_grad():
        assert max_diff(ours(x), hf(x).logits) <= ATOL


def test_legacy_config_spelling(hf_checkpoint):
    # transformers 4.x writes rope_theta and torch_dtype at the top level; 5.x nests and renames them.
    hf, path = hf_checkpoint(rope_theta=5000.0)
    c = json.loads((path / "config.json").read_text())
    assert c["rope_parameters"]["rope_theta"] == 5000.0
    c["rope_theta"] = c.pop("rope_parameters")["rope_theta"]
    c["torch_dtype"] = c.pop("dtype")
    (path / "config.json").write_text(json.dumps(c))
    ours = Transformer.from_pretrained(path, dtype=torch.float32)
    assert ours.config.rope_theta == 5000.0 and ours.config.torch_dtype == "float32"
    x = tokens(hf.config.vocab_size)
    with torch.no_grad():
        assert max_diff(ours(x), hf(x).logits) <= ATOL


def test_fields_a_config_leaves_out_default_as_in_transformers(hf_checkpoint):
    # Without rope_theta and tie_word_embeddings, transformers' Qwen2Config takes 10000 and untied: so do we.
    from transformers import Qwen2ForCausalLM

    _, path = hf_checkpoint(tie_word_embeddings=False, rope_theta=10000.0)
    c = json.loads((path / "config.json").read_text())
    del c["rope_parameters"], c["tie_word_embeddings"]
    (path / "config.json").write_text(json.dumps(c))
    hf = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = Transformer.from_pretrained(path, dtype=torch.float32)
    assert (ours.config.rope_theta, ours.config.tie_word_embeddings) == (10000.0, False)
    x = tokens(hf.config.vocab_size)
    with torch.no_grad():
        assert max_diff(ours(x), hf(x).logits) <= ATOL
    # Two rope_theta that disagree, and a rope field that is no object, are named.
    (path / "config.json").write_text(json.dumps({**c, "rope_theta": 5000.0, "rope_parameters": {"rope_theta": 1e4}}))
    with pytest.raises(ValueError, match="rope_theta 5000.0 and rope_parameters.rope_theta 10000.0 disagree"):
        Transformer.from_pretrained(path)
    (path / "config.json").write_text(json.dumps({**c, "rope_scaling": ["linear", 2]}))
    with pytest.raises(ValueError, match=r"rope_scaling is \["):
        Transformer.from_pretrained(path)


def test_explicit_positions_and_left_padded_batch(hf_checkpoint):
    hf, path = hf_checkpoint(num_attention_heads=4, num_key_value_heads=1)
    ours = Transformer.from_pretrained(path, dtype=torch.float32)
    V = hf.config.vocab_size
    x = tokens(V, R=1, T=9)
    pos = torch.arange(5, 14)[None]  # an offset start: RoPE must use pos, not the index
    with torch.no_grad():
        assert max_diff(ours(x, pos=pos), hf(x, position_ids=pos).logits) <= ATOL

    # Row 1 is left-padded by 4. Its positions skip the pads; the mask hides them (pads see themselves).
    T, pad = 10, 4
    x = tokens(V, R=2, T=T, seed=1)
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, :pad] = False
    pos = (valid.cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = causal & valid[:, None, None, :] | torch.eye(T, dtype=torch.bool)
    with torch.no_grad():
        got = ours(x, pos=pos, mask=mask)
        ref = hf(x, attention_mask=valid.long(), position_ids=pos).logits
        alone = hf(x[1:, pad:]).logits
    assert max_diff(got[:, pad:][1], ref[1, pad:]) <= ATOL
    assert max_diff(got[0], ref[0]) <= ATOL
    assert max_diff(got[1, pad:], alone[0]) <= ATOL  # padding changes nothing for the real tokens


def test_cached_forward_equals_full_forward(hf_checkpoint):
    # Prefill 7 tokens, then feed the rest in chunks of 3 with explicit masks: the same logits.
    _, path = hf_checkpoint()
    model = Transformer.from_pretrained(path, dtype=torch.float32)
    x = tokens(model.config.vocab_size, R=2, T=13)
    cache = KVCache(model.config, batch_size=2, max_len=32)
    with torch.no_grad():
        full = model(x)
        outs = [model(x[:, :7], mask=None, cache=cache)]
        cache.commit(7)
        for s in range(7, 13, 3):
            T = min(3, 13 - s)
            mask = torch.ones(T, s + T, dtype=torch.bool).tril(diagonal=s)
            outs.append(model(x[:, s:s + T], pos=torch.arange(s, s + T).expand(2, T), mask=mask, cache=cache))
            cache.commit(T)
    assert max_diff(torch.cat(outs, dim=1), full) <= ATOL


# ---- attention kernels: the CUDA paths computed on CPU against the plain SDPA call ----

@pytest.mark.parametrize("H, Hkv", [(4, 2), (7, 1), (4, 4)])
@pytest.mark.parametrize("T", [6, 20])
def test_every_attention_path_equals_the_plain_gqa_call(H, Hkv, T):
    # With a mask, attend() runs the G query heads of each kv head as G*T query rows of it for a few queries (T =
    # 6: on CUDA, at most Hkv * D; on the CPU, at most FEW_QUERIES), and otherwise (T = 20) CUDA expands k and v
    # to every head (its memory-efficient kernel takes no GQA broadcast) while the CPU makes SDPA's GQA call.
    # Same numbers as that plain call: with a cache-shaped (T < S) mask, per row or shared (2-D), and with pad
    # rows that see only themselves.
    g = torch.Generator().manual_seed(H * 10 + Hkv)
    B, S, D = 2, T + 5, 8
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    mask = torch.rand(B, 1, T, S, generator=g) < 0.5
    mask[:, :, torch.arange(T), torch.arange(T)] = True  # no empty row

    def plain(mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != Hkv)

    ref = plain(mask)
    assert max_diff(attend(q, k, v, mask, cuda=True), ref) <= 1e-6
    assert max_diff(attend(q, k, v, mask), ref) <= (1e-6 if T <= model_py.FEW_QUERIES and H != Hkv else 0)
    for cuda in (True, False):
        assert max_diff(attend(q, k, v, mask[1, 0], cuda=cuda), plain(mask[1, 0])) <= 1e-6
    qc, kc, vc = q[:, :, :T], k[:, :, :T], v[:, :, :T]
    assert torch.equal(attend(qc, kc, vc, None, cuda=True), attend(qc, kc, vc, None, cuda=False))
    # a different mask really changes the output (the comparison above can fail)
    for cuda in (True, False):
        assert max_diff(attend(q, k, v, ~mask | torch.eye(T, S, dtype=torch.bool), cuda=cuda), ref) > 1e-2


class Allocations(TorchDispatchMode):
    # The byte size of each tensor the ops under it create: outputs that share no storage with an input
    # (views and in-place writes, as the cache's, create none).
    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                self.sizes.append(t.untyped_storage().nbytes())
        return out


def test_the_cuda_path_reads_the_cache_as_stored():
    # A decode step's few queries against S cached keys: no tensor of the size of k or v spread over all
    # H heads, (R, H, S, D), is made, at any S, as expanding the cache for the kernel would.
    R, H, Hkv, T, D = 2, 8, 2, 4, 16
    for S in (64, 512):
        g = torch.Generator().manual_seed(S)
        q = torch.randn(R, H, T, D, generator=g)
        k, v = torch.randn(R, Hkv, S, D, generator=g), torch.randn(R, Hkv, S, D, generator=g)
        mask = (torch.arange(S) <= S - T + torch.arange(T)[:, None]).expand(R, 1, T, S)
        with torch.no_grad(), Allocations() as made:
            y = attend(q, k, v, mask, cuda=True)
        assert made.sizes and max(made.sizes) < R * H * S * D * 4 / 2, (S, made.sizes)
        assert max_diff(y, attend(q, k, v, mask, cuda=False)) <= 1e-6


@pytest.mark.cuda
def test_a_cached_decode_step_allocates_nothing_in_proportion_to_the_cache():
    # One forward of T = 2 positions against a cache of 64, then 512 keys: what it allocates grows by
    # less than one layer's keys spread over every head would take at the longer length.
    model = tiny_model(0, hidden_size=256, num_attention_heads=4, num_key_value_heads=2).to(DEVICE)  # D 64
    c, R, T = model.config, 2, 2
    made = {}
    for S in (64, 512):
        cache = KVCache(c, R, S, DEVICE)
        cache.commit(S - T)
        pos = torch.arange(S - T, S, device=DEVICE).expand(R, T)
        mask = (torch.arange(S, device=DEVICE) <= pos[..., None])[:, None]  # (R, 1, T, S)
        with torch.no_grad(), Allocations() as counted:
            model(torch.ones(R, T, dtype=torch.long, device=DEVICE), pos, mask, cache)
        made[S] = sum(counted.sizes)
    assert made[64] > 0 and made[512] - made[64] < R * c.num_attention_heads * (512 - 64) * c.head_dim * 4, made


@contextmanager
def recorded(calls: list, label):
    calls.append(label)
    yield


def test_masked_calls_on_cuda_leave_out_cudnn_and_causal_calls_keep_every_kernel(monkeypatch):
    # pytorch/pytorch#196678: cuDNN's masked backward can return NaN. attend() on CUDA's path runs its
    # masked SDPA call under sdpa_kernel(efficient, math); the causal call and the CPU's calls under none.
    guards, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(model_py, "sdpa_kernel", lambda backends: recorded(guards, list(backends)))
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: guards.append(("sdpa", kw["attn_mask"] is not None)) or sdpa(*a, **kw))
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    attend(q, k, k, mask, cuda=True)
    assert guards == [[SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], ("sdpa", True)]
    guards.clear()
    attend(q, k, k, None, cuda=True)
    attend(q, k, k, mask, cuda=False)
    tiny_model(0).hidden(torch.ones(1, 9, dtype=torch.long), None, CausalPrefix(4, torch.ones(1, 1, 5, 9).bool()))
    assert guards == [("sdpa", False), ("sdpa", True)] + [("sdpa", False), ("sdpa", True)] * 2
    line = attention_backends("cuda")
    assert "masked SDPA: efficient, math (no cuDNN" in line and f"torch {torch.__version__}" in line
    assert attention_backends("cpu").startswith(f"attention: torch {torch.__version__} on cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("S", [832, 896])
@pytest.mark.parametrize("T", [64, 256])
def test_masked_attention_gradients_are_finite_where_cudnn_gave_nan(S, T):
    # pytorch/pytorch#196678's conditions with Qwen2.5-0.5B's heads (14 on 2, D 64): a mask, S keys with S % 128
    # == 64 (832) or not (896), and a query row whose logsumexp is far below -88.7; T queries, grouped (64) or
    # against k and v expanded (256). bf16 on CUDA, float32 on the CPU, where CUDA's path (no cuDNN) runs too.
    # Gradients must be finite and match the math backend's, in float32 on the same inputs (cudnn_nan.py builds them).
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    q, k, v, mask, weight = nan_case(S, T, dtype)
    (dq, dk, dv), lse = math_reference(q, k, v, mask, weight)
    assert lse < LSE_BOUND  # the bug's condition holds

    for cuda in (None, True) if DEVICE.type == "cpu" else (None,):
        qd, kd, vd = (x.to(DEVICE).clone().requires_grad_() for x in (q, k, v))
        (attend(qd, kd, vd, mask.to(DEVICE), cuda=cuda).float() * weight.to(DEVICE)).sum().backward()
        for got, ref in ((qd.grad, dq), (kd.grad, dk), (vd.grad, dv)):
            got = got.float().cpu()
            assert torch.isfinite(got).all(), cuda
            assert max_diff(got, ref) <= (1e-4 if dtype == torch.float32 else 5e-2) * max(1.0, ref.abs().max()), cuda


def test_causal_prefix_equals_one_masked_call(hf_checkpoint):
    # CausalPrefix(n, rest): the first n columns causal among themselves, the rest under an explicit
    # mask over all columns. The whole model must give what one call with the full mask gives.
    _, path = hf_checkpoint()
    model = Transformer.from_pretrained(path, dtype=torch.float32)
    T, n = 12, 7
    x = tokens(model.config.vocab_size, R=2, T=T, seed=3)
    g = torch.Generator().manual_seed(0)
    full = torch.ones(2, 1, T, T, dtype=torch.bool).tril()
    full[:, :, :n, n:] = False  # the prefix never sees the tail
    full[:, :, n:] &= torch.rand(2, 1, T - n, T, generator=g) < 0.6  # any pattern for the tail
    full[:, :, torch.arange(T), torch.arange(T)] = True
    pos = torch.cat([torch.arange(n), torch.arange(T - n)]).expand(2, T)  # shared positions, as MARS
    with torch.no_grad():
        ref = model(x, pos, full)
        got = model(x, pos, CausalPrefix(n, full[:, :, n:]))
    assert max_diff(got, ref) <= 1e-5


def test_save_roundtrips(tmp_path, hf_checkpoint):
    from transformers import Qwen2ForCausalLM

    for tied in (True, False):
        # ours -> transformers: the same logits; tied checkpoints carry no lm_head.weight.
        # biases and norms away from 0 and 1, so that a dropped one shows
        ours = tiny_model(1, sharpen=1.0, vocab_size=101, intermediate_size=40, tie_word_embeddings=tied)
        out = tmp_path / f"ours-{tied}"
        ours.save_pretrained(out)
        from safetensors import safe_open
        with safe_open(out / "model.safetensors", framework="pt") as f:
            assert ("lm_head.weight" in f.keys()) == (not tied)
        hf = Qwen2ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        x = tokens(101)
        with torch.no_grad():
            assert max_diff(ours(x), hf(x).logits) <= ATOL

        # ours -> ours: bit-identical, also through shards.
        out2 = tmp_path / f"ours2-{tied}"
        ours.save_pretrained(out2, max_shard_size=8_000)
        assert len(list(out2.glob("model-*.safetensors"))) > 1
        again = Transformer.from_pretrained(out2)
        assert again.config == ours.config
        for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), again.state_dict().items()):
            assert n1 == n2 and torch.equal(p1, p2)

    # transformers -> ours -> transformers.
    hf, path = hf_checkpoint(tie_word_embeddings=False)
    ours = Transformer.from_pretrained(path, dtype=torch.float32)
    ours.save_pretrained(tmp_path / "back")
    hf2 = Qwen2ForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    x = tokens(hf.config.vocab_size)
    with torch.no_grad():
        assert max_diff(hf2(x).logits, hf(x).logits) <= ATOL


@pytest.mark.parametrize("name", CONFIGS)
def test_bf16_logits_match_transformers_in_bf16(hf_checkpoint, name):
    # Both load the checkpoint in bfloat16 and run it in bfloat16. transformers' Qwen2 casts where
    # model.py does (RMSNorm: normalise in float32, cast, then scale; RoPE: angles in float32, cos
    # and sin cast to the activation dtype), so here the logits agree to the last bit. One cast
    # moved changes roundings everywhere: scaling the RMSNorm before the cast, rotating q and k in
    # float32, or casting the angles before cos/sin gives a mean abs diff of 4e-3 to 2.2e-2 on these
    # configs (each checked by editing model.py). The old bound, 10% of the largest logit, let all
    # three pass; the bounds here sit 4x below the smallest.
    from transformers import Qwen2ForCausalLM

    _, path = hf_checkpoint(**CONFIGS[name])
    ours = Transformer.from_pretrained(path, dtype=torch.bfloat16)
    hf = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    x = tokens(hf.config.vocab_size, T=32)
    pos = torch.arange(200, 232).expand(2, 32)  # far from 0: RoPE's angles matter in every pair
    with torch.no_grad():
        got, ref = ours(x, pos=pos), hf(x, position_ids=pos).logits
    assert got.dtype == ref.dtype == torch.bfloat16
    diff = (got.float() - ref.float()).abs()
    assert diff.mean().item() <= 1e-3 and diff.max().item() <= 1e-2


# ---- bad input: the message must name the file and the fix ----

def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere: checkpoint directory not found"):
        Transformer.from_pretrained(tmp_path / "nowhere")


def test_missing_config_and_weights(tmp_path, hf_checkpoint):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        Transformer.from_pretrained(tmp_path)
    _, path = hf_checkpoint()
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        Transformer.from_pretrained(path)


def test_corrupted_config_names_line(hf_checkpoint):
    _, path = hf_checkpoint()
    (path / "config.json").write_text('{\n  "hidden_size": 32,\n  "vocab_size": ,\n}')
    with pytest.raises(ValueError, match=r"config.json:3: not valid JSON"):
        Transformer.from_pretrained(path)
    (path / "config.json").write_text('{"hidden_size": 32}')
    with pytest.raises(ValueError, match=r"missing field\(s\) vocab_size"):
        Transformer.from_pretrained(path)


def test_unsupported_features_refused(hf_checkpoint):
    _, path = hf_checkpoint()
    c = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**c, "use_sliding_window": True}))
    with pytest.raises(ValueError, match="use_sliding_window=true is not supported"):
        Transformer.from_pretrained(path)
    (path / "config.json").write_text(json.dumps({**c, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(ValueError, match="rope scaling 'yarn' is not supported"):
        Transformer.from_pretrained(path)
    # another family, a quantized copy, another activation: named from config.json, not by a tensor they lack
    for change, message in (({"model_type": "qwen3"}, 'model_type "qwen3" is not supported: this code runs Qwen2'),
                            ({"quantization_config": {"quant_method": "awq"}}, r"a quantized checkpoint \(awq\)"),
                            ({"hidden_act": "gelu"}, 'hidden_act "gelu" is not supported')):
        (path / "config.json").write_text(json.dumps({**c, **change}))
        with pytest.raises(ValueError, match=message):
            Transformer.from_pretrained(path)


def test_bad_tensors_are_named(hf_checkpoint):
    from safetensors.torch import load_file, save_file

    _, path = hf_checkpoint()
    file = path / "model.safetensors"
    good = load_file(file)

    state = dict(good)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor\(s\) model.layers.1.mlp.up_proj.weight"):
        Transformer.from_pretrained(path)

    save_file({**good, "model.extra.weight": torch.zeros(2)}, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensor 'model.extra.weight'"):
        Transformer.from_pretrained(path)

    save_file({**good, "model.norm.weight": torch.ones(33)}, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \[33\], config.json implies \[32\]"):
        Transformer.from_pretrained(path)

    # An untied lm_head in a checkpoint whose config says tied.
    save_file({**good, "lm_head.weight": torch.zeros(97, 32)}, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'lm_head.weight' is not the embedding, but config.json says "
                                         "tie_word_embeddings=true"):
        Transformer.from_pretrained(path)
    # A tied checkpoint that stores its head as well (merges, exports do): it is the embedding, so it loads.
    save_file({**good, "lm_head.weight": good["model.embed_tokens.weight"].clone()}, file, metadata={"format": "pt"})
    assert torch.equal(Transformer.from_pretrained(path).head(torch.eye(32)), good["model.embed_tokens.weight"].T)


def test_a_hub_snapshot_of_links_to_blobs_loads(tmp_path, hf_checkpoint):
    # The Hugging Face cache keeps each file once under blobs/ and links it from snapshots/REV/: a shard is
    # then a link that leads out of the snapshot folder, and still the checkpoint's own file.
    _, path = hf_checkpoint(max_shard_size="20KB")
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(path.iterdir())):
        (blobs / f"blob{i}").write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(f"../../blobs/blob{i}")
    x = tokens(97)
    with torch.no_grad():
        assert torch.equal(Transformer.from_pretrained(snap)(x), Transformer.from_pretrained(path)(x))


def test_a_save_over_another_layout_leaves_only_its_own_weights(tmp_path):
    # Sharded, then one file, then sharded again into the same folder: each time the reload (ours and
    # transformers') is the last model saved, and no file of the earlier layout is left to be read instead.
    from transformers import Qwen2ForCausalLM

    out = tmp_path / "m"
    out.mkdir()
    (out / "model_ema.safetensors").write_bytes(b"not ours")  # a file of the user's: it stays
    for i, shard in enumerate((8_000, 5 * 2**30, 8_000)):
        model = tiny_model(i, vocab_size=101, intermediate_size=40, tie_word_embeddings=False)
        model.save_pretrained(out, max_shard_size=shard)
        assert (out / "model.safetensors").exists() == (shard > 8_000)
        assert (out / "model.safetensors.index.json").exists() == (shard == 8_000)
        x = tokens(101)
        with torch.no_grad():
            assert torch.equal(Transformer.from_pretrained(out)(x), model(x))
            hf = Qwen2ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
            assert max_diff(hf(x).logits, model(x)) <= ATOL
    assert (out / "model_ema.safetensors").read_bytes() == b"not ours"


def test_a_cached_forward_without_a_mask_is_refused():
    # mask=None is plain causal over the tokens fed: with cached keys SDPA would align the queries to key 0.
    model = tiny_model(0)
    cache = KVCache(model.config, 1, 16)
    x = tokens(model.config.vocab_size, R=1, T=9)
    model(x[:, :8], cache=cache)
    cache.commit(8)
    with pytest.raises(ValueError, match="a forward of 1 tokens over 9 keys \\(a cache\\) needs an explicit mask"):
        model(x[:, 8:], torch.tensor([[8]]), cache=cache)


def test_sharded_index_missing_shard(hf_checkpoint):
    _, path = hf_checkpoint(max_shard_size="20KB")
    index = path / "model.safetensors.index.json"
    saved = json.loads(index.read_text())
    first, second = sorted(set(saved["weight_map"].values()))[:2]
    moved = next(name for name, file in saved["weight_map"].items() if file == first)
    index.write_text(json.dumps({**saved, "weight_map": {**saved["weight_map"], moved: second}}))
    with pytest.raises(ValueError, match=f"names {second} for tensor '{moved}', which that shard does not hold"):
        Transformer.from_pretrained(path)  # an index of another save: named, not a bare safetensors error
    index.unlink()
    with pytest.raises(FileNotFoundError, match=rf"shards \({first}, {second}, ...\) but no model.safetensors.index"):
        Transformer.from_pretrained(path)
    index.write_text(json.dumps(saved))
    (path / first).unlink()
    with pytest.raises(FileNotFoundError, match=f"shard {first} is listed but missing"):
        Transformer.from_pretrained(path)


def test_model_safetensors_wins_over_an_index_an_earlier_save_left(hf_checkpoint):
    # transformers' save_pretrained, unsharded over a sharded save, leaves the old index (and removes its shards):
    # model.safetensors is the checkpoint, as transformers reads it.
    hf, path = hf_checkpoint(max_shard_size="20KB")
    index = (path / "model.safetensors.index.json").read_text()
    other = hf_qwen2(seed=1)
    other.save_pretrained(path)
    (path / "model.safetensors.index.json").write_text(index)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert torch.allclose(Transformer.from_pretrained(path)(ids), other(ids).logits, atol=1e-5)


def test_random_init_is_sane():
    m = tiny_model(0, spread=0, sharpen=1.0, vocab_size=50, intermediate_size=40)  # the model's own init
    assert m.lm_head is None and "lm_head.weight" not in m.state_dict()
    logits = m(torch.randint(50, (1, 5)))
    assert logits.shape == (1, 5, 50) and torch.isfinite(logits).all()
    # Near-uniform predictions at init: the loss starts near log(V).
    assert abs(torch.nn.functional.cross_entropy(logits[0], torch.arange(5)).item() - 3.91) < 0.3


def test_a_linear_on_a_slice_of_rows_runs_one_matrix_product_not_a_copy_of_the_weight():
    # The head reads h[:, :n] of a wider h. Given such a 3-D slice and a frozen weight, F.linear would
    # run a batched product against the weight expanded per row (a copy of it): model.linear flattens.
    from torch.profiler import ProfilerActivity, profile

    import model

    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g)  # requires no grad, as in a frozen model
    h = torch.randn(2, 17, 64, generator=g)
    for x in (h[:1, :16], h[:, :16], h[:, 1:10]):  # F.linear on the folded rows, bit for bit
        for dtype in (torch.float32, torch.bfloat16):
            with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
                y = model.linear(x.to(dtype), w.to(dtype))
            ops = {e.key for e in prof.key_averages()}
            assert "aten::bmm" not in ops and "aten::expand" not in ops, sorted(ops)
            assert y.shape == (*x.shape[:-1], 300)
            fresh = x.to(dtype).clone(memory_format=torch.contiguous_format)  # strides that fold
            assert torch.equal(y, torch.nn.functional.linear(fresh, w.to(dtype)))
