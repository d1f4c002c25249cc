# What one training process is, and everything that crosses processes: torchrun's ranks, FSDP2
# sharding, the full state gathered for a checkpoint and scattered back on resume, and the sums over
# processes. A plain `python train.py` is one process; every function here is then a plain local step.
from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from model import Transformer

# How long a process waits in a collective for the others. Rank 0 writes every checkpoint alone while the others
# wait in their next collective, and 7B's checkpoint is about 106 GB to write (float32 weights and AdamW moments,
# 91 GB, and the bf16 model): torch's default of 10 minutes would end a run at a save on a slow disk.
COLLECTIVE_TIMEOUT = timedelta(minutes=60)


@dataclass
class Env:
    # Where and how this process trains. torchrun sets RANK / WORLD_SIZE / LOCAL_RANK.
    rank: int
    world: int
    local_rank: int
    device: torch.device
    compute: torch.dtype  # float32, or bfloat16 under autocast
    fsdp: bool = False  # weights, gradients and AdamW state sharded over the processes
    local_world: int = 1  # processes on this machine (they share the data's token cache)

    @property
    def master(self) -> bool:  # only rank 0 prints and writes
        return self.rank == 0

    @property
    def grad_factor(self) -> int:
        # FSDP averages the gradients over the processes as it reduce-scatters them; sum_gradients sums.
        # A loss multiplied by this factor gives a summed gradient either way.
        return self.world if self.fsdp else 1

    def autocast(self):
        # The compute dtype as autocast; the weights and AdamW state stay float32 either way, since at
        # lr 5e-6 a bf16 weight would not move at all.
        if self.compute == torch.bfloat16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def log(self, *args, **kwargs) -> None:  # flushed: a log piped to a file shows each line as it comes
        if self.master:
            print(*args, **{"flush": True, **kwargs})


def setup(device: str, compute: torch.dtype, fsdp: bool) -> Env:
    # device: a resolved name (cli.device_and_dtype); under torchrun each process takes its own GPU.
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if world > 1 and device.startswith("cuda:"):  # every process would take that one GPU
        raise SystemExit(f"--device {device} under torchrun: each process takes its own GPU (LOCAL_RANK); "
                         "pass --device cuda, and choose the GPUs with CUDA_VISIBLE_DEVICES")
    # Plain "cuda" names no GPU, which set_device refuses: a process takes the one its LOCAL_RANK gives (0
    # without torchrun, the first that CUDA_VISIBLE_DEVICES shows).
    here = torch.device("cuda", local_rank) if device == "cuda" else torch.device(device)
    if here.type == "cuda":
        torch.cuda.set_device(here)
    if fsdp and "RANK" not in os.environ:
        raise SystemExit("--fsdp shards over processes: launch with torchrun, e.g. "
                         "torchrun --standalone --nproc_per_node 8 train.py --fsdp ...")
    if world > 1 or fsdp:
        dist.init_process_group("nccl" if here.type == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT)
    return Env(rank, world, local_rank, here, compute, fsdp, local_world)


def finish() -> None:
    # Every process waits for rank 0's last save, then leaves the process group.
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def precision(compute: torch.dtype):
    # FSDP2's MixedPrecisionPolicy for the compute dtype. bf16: the weights are all-gathered in bf16 (half
    # the bytes; autocast would cast them to bf16 for each matmul anyway), so the embeddings and the
    # residual stream are bf16 too, and the gradients are reduce-scattered in float32 onto the float32
    # master shards. float32: no cast at all.
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if compute == torch.bfloat16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard(model: Transformer, compute: torch.dtype = torch.float32) -> None:
    # FSDP2: each block, then the root (embeddings, final norm, head), becomes one all-gather unit.
    # Weights stay float32 (the master copy) and sharded between uses; precision(compute) says what
    # crosses processes. The losses call hidden() and head() rather than forward(), so both get FSDP's
    # hooks. Under --compile the blocks were compiled already (train.compile_blocks): compile, then
    # fully_shard, torchtitan's order (parallelize_llama); FSDP's hooks run eagerly (dynamo-disabled).
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    policy = precision(compute)
    for block in model.model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    register_fsdp_forward_method(model, "hidden")
    register_fsdp_forward_method(model, "head")


def sum_gradients(model: Transformer, env: Env) -> None:
    # Without FSDP each process holds its own gradients: their sum over processes, in place.
    if env.world > 1 and not env.fsdp:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)


def sum_over_processes(t: torch.Tensor, env: Env) -> None:
    if env.world > 1:
        dist.all_reduce(t)


def gather_state(model: Transformer, opt: torch.optim.Optimizer | None, env: Env,
                 with_weights: bool = True) -> tuple[dict, dict | None]:
    # -> (weights, optimizer state) as full, unsharded state dicts on the CPU, keyed by parameter name,
    # so a checkpoint resumes with or without FSDP. Every process must call it (FSDP gathers); only
    # rank 0 gets them under FSDP, the others get empty dicts. with_weights=False: no weights (a gated
    # adapter's run saves the adapter from its module and never the frozen base).
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    if env.fsdp:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=options) if with_weights else {}
    else:
        options = StateDictOptions(full_state_dict=True)
        weights = {k: v.detach().cpu() for k, v in model.state_dict().items()} if with_weights else {}
    return weights, None if opt is None else get_optimizer_state_dict(model, opt, options=options)


def load_optimizer_state(model: Transformer, opt: torch.optim.Optimizer, state: dict) -> None:
    # The inverse of gather_state's optimizer state: under FSDP each process keeps its own shard. How this
    # run's optimizer steps (fused on CUDA, and where that puts its step counts) stays this run's: a loaded
    # group would bring the flags of the device the checkpoint was saved on.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    mine = {k: opt.defaults[k] for k in ("fused", "foreach", "capturable") if k in opt.defaults}
    if "param_groups" in state:
        state = {**state, "param_groups": [{**saved, **mine} for saved in state["param_groups"]]}
    set_optimizer_state_dict(model, opt, state, options=StateDictOptions(full_state_dict=True))


def load_model_state(model: Transformer, weights: dict) -> None:
    # Full (unsharded) float32 weights into the model. Sharded (FSDP): each process keeps its own shard. Not
    # sharded: straight from the (memory-mapped) checkpoint into the parameters, with no copy of them between.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(weights)
