# pytorch/pytorch#196678's case, shared by tests/spec/test_model.py and tools/gpu_stages.py (which runs it in bf16
# on a GPU): masked attention with Qwen2.5-0.5B's heads (14 on 2, D 64) over S keys, S % 128 == 64 (832) or not
# (896), and a query row whose logsumexp is far below -88.7, where cuDNN's backward returned NaN grad_q.
import torch

R, H, HKV, D = 1, 14, 2, 64
LSE_BOUND = -88.7  # the bug's condition: query 0's logsumexp below this


def nan_case(S: int, T: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    # -> q (R, H, T, D), k, v (R, Hkv, S, D) in dtype; mask (R, 1, T, S) bool; weight (R, H, T, D) float32, the
    # loss being (attention * weight).sum(). Query 0 sees keys 0 and 1 only, and points away from both.
    g = torch.Generator().manual_seed(S)
    q = torch.randn(R, H, T, D, generator=g)
    k, v = torch.randn(R, HKV, S, D, generator=g), torch.randn(R, HKV, S, D, generator=g)
    mask = torch.rand(R, 1, T, S, generator=g) < 0.3
    mask[:, :, 0] = False
    mask[:, :, 0, :2] = True
    q[:, :, 0] = -20 * k[:, :, :2].sum(2).repeat_interleave(H // HKV, 1)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    return q, k, v, mask, torch.randn(R, H, T, D, generator=g)


def math_reference(q, k, v, mask, weight) -> tuple[list[torch.Tensor], float]:
    # The math backend on the CPU in float32, (R, H, T, S) scores: -> ([dq, dk, dv], query 0's largest logsumexp).
    G = H // HKV
    qf, kf, vf = (x.float().cpu().clone().requires_grad_() for x in (q, k, v))  # leaves of their own
    scores = (qf @ kf.repeat_interleave(G, 1).transpose(-1, -2) / D**0.5).masked_fill(~mask.cpu(), float("-inf"))
    ((torch.softmax(scores, -1) @ vf.repeat_interleave(G, 1)) * weight.cpu()).sum().backward()
    return [qf.grad, kf.grad, vf.grad], torch.logsumexp(scores, -1)[:, :, 0].max().item()
