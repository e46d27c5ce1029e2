"""Parallel layout of the trainer: process group, DeviceMesh, TP, EP, CP, FSDP2, routing replay.

`ParallelDims` validates the degrees once and builds the `DeviceMesh` (dims "dp_shard", "cp", "tp"; "dp_cp" flattened
for FSDP; a second view "efsdp" x "ep" x "tp" of the same ranks for MoE experts). `parallelize` applies, in
torchtitan's order: TP plans -> EP experts -> activation checkpointing -> `fully_shard` per decoder block, then the
root. On CPU the process group is gloo, on GPU nccl; the code path is the same.

Placement on a Ray cluster (`reserve`, `in_bundle`, `node_facts`, `gpu_shares`): the trainer ranks and the engines
live in placement groups of their own; `node_facts` asks a trainer bundle's node for its IP, a free port and what it
sees of --output_dir (trainer.TrainerGroup); an engine counts its node's cores itself (generator.cpu_engine_env).
`cpu_threads` says how many threads each trainer rank and each CPU engine computes with, from the cores of its node.

Under TP the LM head is vocab-parallel: `vocab_parallel_logprobs` scores each rank's slice of
the vocabulary, so the full [B, T, V] logits never exist on one rank.

Gradient reduction is a SUM over data ranks (divide factor 1): every micro-batch loss is already divided by the tokens
of the whole optimizer step across all ranks, so summing gives exactly the single-process gradient.

    dims = ParallelDims(world_size=4, tp=2); dims.build_mesh("cpu")
    model = parallelize(model, dims, param_dtype=torch.float32)

Tested by tests/test_parallel.py (every layout against one process) and tests/test_cluster.py.
"""

import contextlib
import ipaddress
import os
import socket
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


@dataclass
class ParallelDims:
    """Degrees of parallelism of the trainer (each >= 1: main.validate); dp_shard is what is left over.

    EP borrows its ranks from dp_shard * cp (experts are split ep ways and the
    expert weights are FSDP-sharded over the remaining dp_shard * cp / ep ranks)."""
    world_size: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp_shard: int = field(init=False)
    mesh: DeviceMesh | None = field(default=None, repr=False)
    dp_cp_mesh: DeviceMesh | None = field(default=None, repr=False)
    ep_mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.world_size % (self.tp * self.cp):
            raise ValueError(f"--train_workers {self.world_size} is not divisible by --tp_size {self.tp} x "
                             f"--cp_size {self.cp}: data-parallel ranks would be fractional")
        self.dp_shard = self.world_size // (self.tp * self.cp)
        if (self.dp_shard * self.cp) % self.ep:
            raise ValueError(f"--ep_size {self.ep} must divide the data/context ranks dp_shard x cp = "
                             f"{self.dp_shard * self.cp} (EP borrows them; TP ranks are not used for EP)")
        if self.ep > 1 and self.tp > 1:
            raise ValueError("--ep_size > 1 with --tp_size > 1 is not supported: shard experts with EP over the "
                             "data ranks and use TP only for dense models")

    def check_model(self, config) -> None:
        """Model-dependent checks (head counts, experts) with the message a user needs."""
        config = config.get_text_config()  # a VLM's language model (a text model's own config)
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        experts = getattr(config, "num_experts", 0) or 0
        if self.tp > 1 and (heads % self.tp or kv % self.tp):
            raise ValueError(f"--tp_size {self.tp} must divide the attention heads ({heads}) and key/value heads ({kv})")
        if self.tp > 1 and not experts and config.intermediate_size % self.tp:
            raise ValueError(f"--tp_size {self.tp} must divide the MLP size ({config.intermediate_size})")
        if self.cp > 1 and (heads % self.cp or kv % self.cp):
            raise ValueError(f"--cp_size {self.cp} (all-to-all over heads) must divide the attention heads ({heads}) "
                             f"and key/value heads ({kv})")
        if self.ep > 1 and not experts:
            raise ValueError(f"--ep_size {self.ep} needs a mixture-of-experts model; this one has no experts")
        if self.ep > 1 and experts % self.ep:
            raise ValueError(f"--ep_size {self.ep} must divide the number of experts ({experts})")

    # ---- mesh and coordinates -----------------------------------------------------------
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build the mesh once (all ranks call this). Rank r = ((dp * cp) + c) * tp + t."""
        self.mesh = init_device_mesh(device_type, (self.dp_shard, self.cp, self.tp),
                                     mesh_dim_names=("dp_shard", "cp", "tp"))
        self.dp_cp_mesh = self.mesh["dp_shard", "cp"]._flatten("dp_cp")
        if self.ep > 1:
            ranks = torch.arange(self.world_size).view(self.dp_shard * self.cp // self.ep, self.ep, self.tp)
            self.ep_mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("efsdp", "ep", "tp"))
        return self.mesh

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def dp_rank(self) -> int:
        """Which share of the rows this rank trains on."""
        return self.rank // (self.cp * self.tp)

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp) % self.cp

    def group(self, name: str):
        """Process group of a named dim ("dp_cp", "cp", "tp", "ep"); None when the dim has size 1."""
        if name == "ep":
            return self.ep_mesh["ep"].get_group() if self.ep > 1 else None
        size = {"dp_cp": self.dp_shard * self.cp, "cp": self.cp, "tp": self.tp, "dp_shard": self.dp_shard}[name]
        if size == 1:
            return None
        return (self.dp_cp_mesh if name == "dp_cp" else self.mesh[name]).get_group()


def free_port() -> int:
    """A TCP port free on every address of this host (a store's server listens on all of them)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def tcp_store(host: str, port: int, world: int, is_master: bool, timeout) -> dist.TCPStore:
    """torch's TCPStore at host:port. Its server listens on every address of the host, unless given
    a socket: a loopback `host` (a local run) gets one bound there, so a local run exposes nothing."""
    local = is_master and ipaddress.ip_address(host).is_loopback
    return dist.TCPStore(host, port, world, is_master=is_master, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=socket.create_server((host, port)).detach() if local else None)


# ---- placement on a Ray cluster ---------------------------------------------------------------
PLACEMENT_TIMEOUT_S = 600  # a cluster that cannot hold the run says so at start-up instead of waiting forever


def reserve(bundles: list[dict], strategy: str, what: str):
    """A Ray placement group of `bundles` (STRICT_PACK: all on one node; PACK: as few nodes as
    possible), waited for. A cluster that cannot hold it is one ValueError naming what was asked."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    pg = placement_group(bundles, strategy=strategy)
    if not pg.wait(PLACEMENT_TIMEOUT_S):
        remove_placement_group(pg)
        raise ValueError(f"the Ray cluster cannot place {what}: {len(bundles)} bundle(s) of {bundles[0]} "
                         f"({strategy}) did not fit in {PLACEMENT_TIMEOUT_S}s; free now: {ray.available_resources()}")
    return pg


def gpu_shares(cfg: dict, gpus: float) -> tuple[float, float]:
    """GPUs per trainer rank and per engine bundle. Trainer and engine GPUs are separate where the
    cluster has enough (--train_workers + --num_engines x engine TP x DP); a one-GPU machine runs
    one rank and one engine on the same GPU, half each (vLLM takes --gpu_memory_utilization of it)."""
    if not gpus:
        return 0.0, 0.0
    per_engine = cfg.get("engine_tp_size", 1) * cfg.get("engine_dp_size", 1)
    engines = 0 if cfg.get("replay_rollouts") else cfg.get("num_engines", 1)
    need = cfg["train_workers"] + engines * per_engine
    if need <= gpus:
        return 1.0, float(per_engine)
    if cfg["train_workers"] == 1 and engines * per_engine == 1:
        return 0.5, 0.5
    raise ValueError(f"{cfg['train_workers']} trainer rank(s) + {engines} engine(s) x {per_engine} GPU(s) need {need} "
                     f"GPUs, the Ray cluster has {gpus:g}: add GPUs or lower --train_workers / --num_engines "
                     "(only one rank and one one-GPU engine share a GPU)")


def node_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's cpuset counts)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def one_node() -> bool:
    """Whether the Ray cluster is one machine: then every trainer rank and engine shares its cores.
    On several nodes each kind counts only its own peers on its node (they are placed apart)."""
    import ray
    return sum(bool(n["Alive"]) for n in ray.nodes()) == 1


def cpu_threads(cores: int, trainers: int, engines: int, overlap: bool,
                train_threads: int | None = None, engine_threads: int | None = None) -> tuple[int, int]:
    """(torch threads of each trainer rank, OpenMP threads of each engine) on a CPU node of
    `cores` cores that holds `trainers` trainer ranks and `engines` engines.

    On-policy (`overlap` False) the phases take turns: the engines sleep while the trainer trains and the trainer
    waits while they generate, so the ranks share every core of the node, and the engines every core but one: the
    driver and the engines' Ray actors, which feed them requests, are busy in that same phase (beside them a second
    OpenMP thread of the default task's engine spins, 60% more engine CPU, and gains nothing). Async (`overlap`) both
    compute at once: the cores are split between the kinds in proportion to their numbers, at least one each, the
    engines' part again less one core, so busy threads never outnumber the cores (OpenMP threads spin after each
    parallel region: two processes with two threads each on two cores wait for each other's preempted threads).
    `--train_threads` and `--engine_threads` override either number. Counts, never timings: the same on every machine
    with these cores."""
    def share(n: int, among: int) -> int:
        return max(1, n // max(among, 1))
    train_cores = cores
    if overlap and trainers and engines and cores > 1:
        train_cores = min(cores - 1, max(1, round(cores * trainers / (trainers + engines))))
    engine_cores = (cores - train_cores if train_cores < cores else cores) - 1   # one for the feeders
    return train_threads or share(train_cores, trainers), engine_threads or share(engine_cores, engines)


def in_bundle(pg, index: int) -> dict:
    """Ray .options() that put an actor or task into bundle `index` of placement group `pg`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)}


def _node_facts(paths: list[str]) -> dict:
    import ray
    return {"ip": ray.util.get_node_ip_address(), "port": free_port(), "sees": [os.path.exists(p) for p in paths]}


def node_facts(pg, index: int, paths: tuple[str, ...] = ()):
    """A Ray ref to facts about the node that holds bundle `index`, from a task run there: its IP,
    a port free there, and whether each of `paths` exists there."""
    import ray
    return ray.remote(_node_facts).options(num_cpus=0, **in_bundle(pg, index)).remote(list(paths))


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int) -> str:
    """Join the trainer's process group; returns the device type ("cpu" or "cuda")."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
                          RANK=str(rank), WORLD_SIZE=str(world_size))
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        store = tcp_store(master_addr, master_port, world_size, rank == 0, dist.constants.default_pg_timeout)
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=store,
                                rank=rank, world_size=world_size)
    return device_type


# ---- tensor parallelism ---------------------------------------------------------------------
def apply_tp(model: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron plan for Qwen3 / Qwen3-MoE blocks: q/k/v and gate/up column-wise, o and down
    row-wise (attention heads and MLP columns split tp ways; outputs replicated). MoE experts
    stay whole (use EP for them). The LM head is vocab-parallel: each rank computes the logits of
    its 1/tp of the vocabulary and `vocab_parallel_logprobs` scores them, so no rank ever holds
    the full [B, T, V] logits; a tied input embedding is split the same way (row-wise, dim 0)."""
    for block in text_layers(model):
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel()}
        if hasattr(block.mlp, "gate_proj"):  # dense MLP
            plan.update({"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                         "mlp.down_proj": RowwiseParallel()})
        parallelize_module(block, tp_mesh, plan)
        for norm in (block.self_attn.q_norm, block.self_attn.k_norm):   # per-head norms see only my heads
            norm.forward = types.MethodType(_tp_head_norm, norm)
            norm.tp_group = tp_mesh.get_group()
    if not hasattr(model, "lm_head"):  # the critic: a backbone and a scalar head
        return
    embed = model.get_input_embeddings()
    tied = model.lm_head.weight is embed.weight
    plan = {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=True)}  # [b, T, V/tp] logits
    if tied:  # one weight [V, H], Shard(0) in both roles
        name = next(n for n, m in model.named_modules() if m is embed)
        plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    parallelize_module(model, tp_mesh, plan)
    if tied:
        model.lm_head.weight = embed.weight   # distributing each module separately untied them


class _ReduceSum(torch.autograd.Function):
    """all_reduce(SUM) forward; identity backward: the sum feeds a loss that every rank of the
    group computes alike, so each rank's share gets that loss's gradient once."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab: int, group,
                            entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(logits)[targets] [b, n] (and the entropy [b, n]) from this TP rank's vocabulary
    slice `logits` [b, n, V/tp] (torch.chunk order, as Shard(-1) splits it). Max, sum of exp and
    the target's logit are all-reduced over `group`: [b, n] tensors, never [b, n, V]."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    z = logits.float()
    start, v = rank * -(-vocab // size), z.shape[-1]
    top = z.detach().amax(-1, keepdim=True)                       # [b, n, 1] (shift: no gradient)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    # Every reduced sum is a function of this rank's logits only, and everything after the sums is
    # computed alike on every rank: that is what makes _ReduceSum's identity backward exact.
    z = z - top
    total = _ReduceSum.apply(z.exp().sum(-1), group)             # [b, n] sum of exp over the vocabulary
    local = targets - start
    mine = (local >= 0) & (local < v)                             # the target is in my slice
    picked = z.gather(-1, local.clamp(0, max(v - 1, 0))[..., None]).squeeze(-1) * mine
    lp = _ReduceSum.apply(picked, group) - total.log()            # [b, n]
    ent = None
    if entropy:  # H = log Z - sum(exp(z) z) / Z
        ent = total.log() - _ReduceSum.apply((z.exp() * z).sum(-1), group) / total
    return lp, ent


class _SumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over a group (a replicated weight used on
    a different shard of the activations on each rank)."""

    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def _tp_head_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen3RMSNorm.forward with the weight's gradient summed over the TP ranks' heads."""
    dtype = hidden_states.dtype
    h = hidden_states.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return _SumGrad.apply(self.weight, self.tp_group) * h.to(dtype)


# ---- expert parallelism ---------------------------------------------------------------------
class EPExperts(torch.nn.Module):
    """This rank's E/ep experts (fused weights, as transformers 5 stores them) with token
    dispatch by all_to_all_single over the EP group (uneven splits; autograd form)."""

    def __init__(self, experts: torch.nn.Module, ep_rank: int, ep: int, group):
        super().__init__()
        self.num_experts, self.ep, self.group = experts.num_experts, ep, group
        self.local = experts.num_experts // ep
        lo = ep_rank * self.local
        self.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.data[lo:lo + self.local].clone())  # [e, 2I, H]
        self.down_proj = torch.nn.Parameter(experts.down_proj.data[lo:lo + self.local].clone())        # [e, H, I]
        self.act_fn = experts.act_fn

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        N, k = top_k_index.shape
        expert = top_k_index.reshape(-1)                                      # [N*k]
        order = torch.argsort(expert, stable=True)                            # grouped by expert = by owner rank
        token = torch.arange(N, device=hidden.device).repeat_interleave(k)[order]
        counts = torch.bincount(expert, minlength=self.num_experts)           # [E] tokens I send per expert
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)         # [ep * e] tokens I get per (src, expert)
        send = counts.view(self.ep, self.local).sum(1).tolist()
        recv = recv_counts.view(self.ep, self.local).sum(1).tolist()
        x = all_to_all_single_autograd(hidden[token], recv, send, self.group)  # [M, H] by (src rank, expert)
        local_expert = torch.arange(self.local, device=hidden.device).repeat(self.ep).repeat_interleave(
            recv_counts.view(-1))                                             # [M]
        y = torch.zeros_like(x)
        for e in range(self.local):
            rows = (local_expert == e).nonzero().squeeze(1)
            gate, up = torch.nn.functional.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = y.index_add(0, rows, torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e]))
        y = all_to_all_single_autograd(y, send, recv, self.group)             # [N*k, H] back in `order`
        w = top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden).index_add(0, token, (y * w).to(hidden.dtype))


# ---- context parallelism (Ulysses) ----------------------------------------------------------
_CP_GROUP = None


def _seq_to_heads(x: torch.Tensor, cp: int) -> torch.Tensor:
    """[b, h, t, d] (my sequence chunk, all heads) -> [b, h/cp, cp*t, d] (all positions, my heads)."""
    b, h, t, d = x.shape
    x = x.reshape(b, cp, h // cp, t, d).transpose(0, 1).contiguous()       # [cp(dst), b, h/cp, t, d]
    x = all_to_all_single_autograd(x, None, None, _CP_GROUP)              # [cp(src chunk), b, h/cp, t, d]
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d)


def _heads_to_seq(x: torch.Tensor, cp: int) -> torch.Tensor:
    """Inverse of _seq_to_heads: [b, h/cp, cp*t, d] -> [b, h, t, d]."""
    b, hl, T, d = x.shape
    x = x.reshape(b, hl, cp, T // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # [cp(dst chunk), b, h/cp, t, d]
    x = all_to_all_single_autograd(x, None, None, _CP_GROUP)                 # [cp(src heads), b, h/cp, t, d]
    return x.transpose(0, 1).reshape(b, hl * cp, T // cp, d)


def ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function for CP: all-to-all to whole sequences of a head subset,
    causal sdpa, all-to-all back. Rows are right-padded, so causal alone is the right mask."""
    cp = dist.get_world_size(_CP_GROUP)
    q, k, v = (_seq_to_heads(t, cp) for t in (query, key, value))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                                           enable_gqa=k.shape[1] != q.shape[1])
    return _heads_to_seq(out, cp).transpose(1, 2).contiguous(), None   # [b, t, h, d]


def apply_cp(model: torch.nn.Module, dims: ParallelDims) -> None:
    global _CP_GROUP
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    _CP_GROUP = dims.group("cp")
    AttentionInterface.register("molt_ulysses", ulysses_attention)
    AttentionMaskInterface.register("molt_ulysses", sdpa_mask)
    model.set_attn_implementation("molt_ulysses")


# ---- MoE: routing replay, frozen router ------------------------------------------------------
def moe_gates(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router of each MoE block, in layer order (empty for dense models)."""
    return [b.mlp.gate for b in text_layers(model) if hasattr(b.mlp, "gate") and hasattr(b.mlp, "experts")]


def _gate_hook(gate, args, output):
    """Record this gate's selection, or replace it by the recorded one. The router's logits are recomputed either way,
    so the replayed scores (softmax at the replayed experts) still train the router."""
    logits, scores, indices = output
    if getattr(gate, "replay", None) is not None:
        indices = gate.replay.to(indices.device)                               # [n, k]
        scores = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
        if gate.norm_topk_prob:
            scores = scores / scores.sum(-1, keepdim=True)
        scores = scores.to(logits.dtype)
    if getattr(gate, "record", None) is not None:
        gate.record.append(indices.detach().cpu())
    return logits, scores, indices


def install_routing_hooks(model: torch.nn.Module) -> None:
    for gate in moe_gates(model):
        gate.replay, gate.record = None, None
        gate.register_forward_hook(_gate_hook)


@contextlib.contextmanager
def routing(model: torch.nn.Module, replay: torch.Tensor | None = None, record: list | None = None):
    """replay: [n_tokens, layers, k] expert ids in the order the model flattens its input
    (batch-major); record: a list that receives the same shape. Needs install_routing_hooks."""
    gates = moe_gates(model)
    logs = [[] for _ in gates]
    for i, gate in enumerate(gates):
        gate.replay = None if replay is None else replay[:, i]
        gate.record = logs[i] if record is not None else None
    try:
        yield
    finally:
        for gate in gates:
            gate.replay = gate.record = None
        if record is not None and gates:
            record.append(torch.stack([torch.cat(l) for l in logs], 1))   # [n_tokens, layers, k]


# ---- FSDP2 and the whole recipe -------------------------------------------------------------
def parallelize(model: torch.nn.Module, dims: ParallelDims, *, param_dtype: torch.dtype,
                activation_checkpointing: bool = False, offload: bool = False,
                routing_hooks: bool = False) -> torch.nn.Module:
    """TP -> EP -> CP attention -> activation checkpointing -> fully_shard per block, then root.
    Routers are their own FSDP unit in fp32; expert weights are sharded over "efsdp"."""
    if dims.tp > 1:
        apply_tp(model, dims.mesh["tp"])
    if dims.ep > 1 and hasattr(text_layers(model)[0].mlp, "experts"):
        ep_rank = dims.ep_mesh["ep"].get_local_rank()
        for block in text_layers(model):
            block.mlp.experts = EPExperts(block.mlp.experts, ep_rank, dims.ep, dims.group("ep"))
    if dims.cp > 1:
        apply_cp(model, dims)
    if routing_hooks:
        install_routing_hooks(model)
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # pin_memory needs an accelerator: CPUOffloadPolicy() fails on a CPU-only machine.
    extra = {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())} if offload else {}
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    mesh = dims.dp_cp_mesh
    tower = vision_tower(model)   # a VLM's vision tower: one unit per block as well
    units = [fully_shard(b, mesh=mesh, mp_policy=mp, **extra) for b in tower.blocks] if tower is not None else []
    for block in text_layers(model):
        if hasattr(block.mlp, "gate") and hasattr(block.mlp, "experts"):   # a MoE block's router: in fp32
            units.append(fully_shard(block.mlp.gate, mesh=mesh, mp_policy=fp32, **extra))
        if isinstance(getattr(block.mlp, "experts", None), EPExperts):
            units.append(fully_shard(block.mlp.experts, mesh=dims.ep_mesh["efsdp"], mp_policy=mp, **extra))
            for p in block.mlp.experts.parameters():
                p._molt_ep = True              # its norm is summed over the EP group too
        units.append(fully_shard(block, mesh=mesh, mp_policy=mp, **extra))
    units.append(fully_shard(model, mesh=mesh, mp_policy=mp, **extra))
    for unit in units:
        unit.set_gradient_divide_factor(1.0)   # SUM over data ranks: losses are globally normalized
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return model


def text_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder blocks of a causal LM, or of a vision-language model's language model."""
    return getattr(model.model, "language_model", model.model).layers


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """A VLM's vision encoder with its projector (Qwen-VL `model.visual`); None for a text model."""
    return getattr(model.model, "visual", None)


def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float, dims: ParallelDims) -> float:
    """Global L2 norm of the gradients of every layout (FSDP/TP DTensors on different meshes,
    EP experts split over the EP group), then clip in place. Same collectives on every rank."""
    sums: dict[tuple, torch.Tensor] = {}
    for p in params:
        if p.grad is None:
            continue
        g, groups = p.grad, []
        if isinstance(g, DTensor):  # sum the squares over the dims where g is split
            groups = [g.device_mesh.get_group(i) for i, pl in enumerate(g.placements) if not isinstance(pl, Replicate)]
            g = g.to_local()
        sq = g.detach().float().pow(2).sum()
        if getattr(p, "_molt_ep", False):
            groups.append(dims.group("ep"))
        key = tuple(id(x) for x in groups)
        sums.setdefault(key, [groups, torch.zeros((), device=sq.device)])[1].add_(sq)
    total = torch.zeros(())
    for groups, sq in sums.values():
        for grp in groups:
            dist.all_reduce(sq, group=grp)
        total += sq.cpu()
    norm = float(total.sqrt())
    if norm > max_norm and norm == norm and norm != float("inf"):
        for p in params:
            if p.grad is not None:
                p.grad.mul_(max_norm / (norm + 1e-6))
    return norm
