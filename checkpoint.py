"""Trainer checkpoints with torch.distributed.checkpoint (DCP), independent of the layout.

`Checkpoints` is a base of `trainer.Trainer`. MoE experts are stored one entry per expert
(`split_experts`) and DTensors reshard on load, so a run resumes under other --train_workers /
--tp_size / --ep_size. The loop's own records around them are in loop.py and logs.py.

    python -m pytest -q tests/test_parallel.py -k checkpoint
"""

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import parallel


class Checkpoints:
    """Uses Trainer's model, optimizer, critic, critic_optimizer, dims and version."""

    def checkpoint_state(self) -> tuple[dict, dict]:
        """(what DCP saves/loads, the state dicts it views). MoE experts appear one entry per
        expert (`split_experts`), views of this rank's rows, so a load fills them in place."""
        dicts = {"model": get_state_dict(self.model, self.optimizer, options=self.model_options())}
        if self.critic is not None:
            dicts["critic"] = get_state_dict(self.critic, self.critic_optimizer)
        state = {"version": torch.tensor(self.version)}
        for name, (msd, osd) in dicts.items():   # keys: model, optim, critic, critic_optim
            state[name] = split_experts(msd, self.dims)
            state[OPTIM_KEY[name]] = split_experts(osd, self.dims)
        return state, dicts

    def model_options(self):
        """With LoRA the policy's base never changes: only the adapter (and its optimizer) is saved and loaded."""
        return StateDictOptions(ignore_frozen_params=True, strict=False) if self.cfg.get("lora_rank") else None

    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, critic (+ its optimizer) and version; every rank writes its own shards (all call it)."""
        dcp.save(self.checkpoint_state()[0], checkpoint_id=path)

    def load_checkpoint(self, path: str) -> int:
        state, dicts = self.checkpoint_state()
        dcp.load(state, checkpoint_id=path)
        for name, module, optimizer in (("model", self.model, self.optimizer),
                                        ("critic", self.critic, self.critic_optimizer)):
            if name in dicts:  # the views were filled in place; param_groups come from the checkpoint
                msd, osd = dicts[name]
                groups = state[OPTIM_KEY[name]]["param_groups"]
                set_state_dict(module, optimizer, model_state_dict=msd, options=self.model_options() if name == "model" else None,
                               optim_state_dict={"state": osd["state"], "param_groups": groups})
        self.version = int(state["version"])
        return self.version


OPTIM_KEY = {"model": "optim", "critic": "critic_optim"}
EXPERT_PARAMS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")  # fused [E, ...] (transformers 5)


def split_experts(sd: dict, dims: parallel.ParallelDims) -> dict:
    """A model or optimizer state dict with each fused expert tensor replaced by one entry per
    expert, named by its global id ("...mlp.experts.down_proj[3]"): the same keys and shapes
    whatever --ep_size / --train_workers split the experts, so DCP reloads them under any layout
    (the other weights are DTensors, which DCP reshards). Entries are views of the local rows."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    def split(key: str, v: torch.Tensor) -> dict:
        # This rank's rows by their global ids. FSDP shards dim 0 (whole experts; torch.chunk sizes);
        # under EP the tensor is this EP rank's E/ep block.
        first = dims.ep_mesh["ep"].get_local_rank() * v.shape[0] if dims.ep > 1 else 0
        if isinstance(v, DTensor):
            if not all(p == Shard(0) or isinstance(p, Replicate) for p in v.placements):
                raise ValueError(f"expert weights sharded as {v.placements}: checkpoints expect whole experts per rank")
            _, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
            first, v = first + offset[0], v.to_local()
        return {f"{key}[{first + j}]": v[j] for j in range(v.shape[0])}

    if "state" in sd and "param_groups" in sd:  # an optimizer state dict: split each state tensor alike
        state = {}
        for key, st in sd["state"].items():
            if not key.endswith(EXPERT_PARAMS):
                state[key] = st
                continue
            parts = {n: split(key, t) if torch.is_tensor(t) and t.dim() > 0 else t for n, t in st.items()}
            ids = next(p for p in parts.values() if isinstance(p, dict))
            for e in ids:   # scalar entries ("step") are shared by the experts of one tensor
                state[e] = {n: p[e] if isinstance(p, dict) else p for n, p in parts.items()}
        return {"state": state, "param_groups": sd["param_groups"]}
    return {name: t for key, v in sd.items()
            for name, t in (split(key, v) if key.endswith(EXPERT_PARAMS) else {key: v}).items()}
