"""Parallel layout of the trainer: process group, DeviceMesh and FSDP2.

`ParallelDims` validates the degrees once and builds the `DeviceMesh`;
`apply_fsdp` shards a transformers causal LM with `fully_shard`, one unit per
decoder block and then the root, as torchtitan does. On CPU the process group
is gloo, on GPU nccl; the code path is the same.

    dims = ParallelDims(world_size=2); mesh = dims.build_mesh("cpu")
    model = apply_fsdp(model, mesh, param_dtype=torch.float32)
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


@dataclass
class ParallelDims:
    """Degrees of parallelism of the trainer; dp_shard is what is left over."""
    world_size: int = 1
    dp_shard: int = -1   # -1: infer from world_size

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        if self.dp_shard == -1:
            self.dp_shard = self.world_size
        if self.dp_shard != self.world_size:
            raise ValueError(f"dp_shard ({self.dp_shard}) must equal the world size "
                             f"({self.world_size}) when no other parallelism is used")

    def build_mesh(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=("dp_shard",))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int) -> str:
    """Join the trainer's process group; returns the device type ("cpu" or "cuda")."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
                          RANK=str(rank), WORLD_SIZE=str(world_size))
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                rank=rank, world_size=world_size)
    return device_type


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """fully_shard each decoder block, then the root (parameters stay sharded
    between steps; gradients are reduced in fp32)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
