"""The policy trainer: a transformers causal LM under FSDP2, one RL step at a time.

`Trainer` runs as a Ray actor (loop.py wraps it with `ray.remote`). Each
`train_step(trajectories)`:

  1. pads the token-exact trajectories into [B, T] tensors (no re-tokenizing);
  2. recomputes the logprobs of the sampled tokens under the current weights
     (`old_logprobs`) and logs how far they are from the engine's sampling
     logprobs (the train/rollout mismatch);
  3. computes advantages with the chosen estimator (estimators.py);
  4. for each micro-batch: forward, policy loss (losses.py) normalized by the
     action tokens of the whole step, backward; then clip and step the optimizer.

`weights_blob()` returns the full state dict as safetensors bytes for the
generator. `build_tiny_model` makes the default random-init model and its
offline character tokenizer.

    python -c "import trainer; trainer.build_tiny_model('/tmp/tiny')"
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path

import safetensors.torch
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import estimators
import losses
import parallel

TINY_SPECIALS = ["<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
TINY_CHARS = list("0123456789?=+-*, ")
TINY_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tiny_model(path: str, seed: int = 0) -> str:
    """Build (once) a ~130k-parameter Qwen3 with a character tokenizer at `path`.

    The vocabulary is tiny on purpose: a random policy must hit the right
    answer now and then for RL alone to get started."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out = Path(path)
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return str(out)
    vocab = {t: i for i, t in enumerate(TINY_SPECIALS + TINY_CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|end|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one char, one token
    tok.decoder = decoders.Fuse()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|end|>",
                                     chat_template=TINY_TEMPLATE)
    hf_tok.add_special_tokens({"additional_special_tokens": TINY_SPECIALS[1:]})
    config = Qwen3Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=32,  # vLLM's CPU attention needs head_dim >= 32
                         max_position_embeddings=1024, tie_word_embeddings=True,
                         eos_token_id=0, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    hf_tok.save_pretrained(tmp)
    tmp.rename(out)  # atomic: a half-built folder is never reused
    return str(out)


def needs_reference(cfg: dict) -> bool:
    """A frozen reference model is loaded only when something uses it."""
    return cfg["estimator"] == "on_policy_distill" or (cfg["kl_coef"] > 0 and (cfg["kl_loss"] or cfg["kl_in_reward"]))


def collate(trajectories: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad trajectories; every [B, T] tensor is aligned to *predicted*
    tokens: position t holds token t+1 and what is known about it."""
    T = max(len(t["tokens"]) for t in trajectories)

    def pad(key, value, dtype):
        return torch.tensor([t[key] + [value] * (T - len(t[key])) for t in trajectories], dtype=dtype)

    tokens = pad("tokens", pad_id, torch.long)                # [B, T]
    return {
        "input_ids": tokens[:, :-1],                          # [B, T-1]
        "targets": tokens[:, 1:],                             # [B, T-1]
        "mask": pad("mask", 0, torch.float32)[:, 1:],         # [B, T-1] 1 = sampled by the policy
        "rollout_logprobs": pad("logprobs", 0.0, torch.float32)[:, 1:],
        "versions": pad("versions", -1, torch.long)[:, 1:],
        "rewards": torch.tensor([t["reward"] for t in trajectories], dtype=torch.float32),
        "groups": torch.tensor([t["group"] for t in trajectories], dtype=torch.long),
        "rollout_ids": torch.tensor([t["rollout_id"] for t in trajectories], dtype=torch.long),
    }


class ValueModel(torch.nn.Module):
    """The critic for --estimator gae: the policy's backbone with a scalar head."""

    def __init__(self, path: str):
        from transformers import AutoModel
        super().__init__()
        self.model = AutoModel.from_pretrained(path, dtype=torch.float32)  # the decoder, no LM head
        self.head = torch.nn.Linear(self.model.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids).last_hidden_state  # [b, T, H]
        return self.head(hidden.float()).squeeze(-1)                 # [b, T]: V before token t+1


class Trainer:
    """One trainer rank. `cfg` is the dict of main.py's flags.

    Models: the policy (trained), a frozen reference (only when a KL term or
    on-policy distillation needs one; `--ref_model` or the initial policy) and
    a critic (only for gae). All are FSDP2-sharded the same way."""

    def __init__(self, cfg: dict, rank: int = 0, world_size: int = 1,
                 master_addr: str = "127.0.0.1", master_port: int = 0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        torch.manual_seed(cfg["seed"])
        if cfg.get("train_threads"):
            torch.set_num_threads(cfg["train_threads"])
        self.device = parallel.init_distributed(rank, world_size, master_addr,
                                                master_port or parallel.free_port())
        self.dims = parallel.ParallelDims(world_size=world_size)
        self.mesh = self.dims.build_mesh(self.device)
        self.dtype = getattr(torch, cfg["param_dtype"])
        self.tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.model = self._shard(model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg["lr"], betas=(0.9, 0.99),
                                           weight_decay=cfg["weight_decay"], eps=1e-8)
        self.ref = None
        if needs_reference(cfg):
            self.ref = self._shard(AutoModelForCausalLM.from_pretrained(cfg["ref_model"] or cfg["model"],
                                                                        dtype=torch.float32))
            self.ref.requires_grad_(False).eval()
        self.critic = self.critic_optimizer = None
        if cfg["estimator"] == "gae":
            self.critic = self._shard(ValueModel(cfg["critic_model"] or cfg["model"]))
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=cfg["critic_lr"] or cfg["lr"],
                                                      betas=(0.9, 0.99), weight_decay=cfg["weight_decay"])
        self.version = 0

    def _shard(self, model: torch.nn.Module) -> torch.nn.Module:
        return parallel.apply_fsdp(model.to(self.device), self.mesh, param_dtype=self.dtype)

    # ---- logprobs -------------------------------------------------------------------------
    def _forward(self, model, input_ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs of targets [b, T], logits / temperature [b, T, V]) under `model`."""
        logits = model(input_ids=input_ids.to(self.device)).logits.float() / self.cfg["temperature"]
        return losses.token_logprobs(logits, targets.to(self.device)), logits

    @torch.no_grad()
    def compute_logprobs(self, trajectories: list[dict]) -> list[list[float]]:
        """Trainer logprobs of each trajectory's tokens (position t scores token t+1)."""
        batch = collate(trajectories, self.pad_id)
        out = []
        for mb in torch.arange(len(trajectories)).split(self.cfg["micro_batch_size"]):
            out += self._forward(self.model, batch["input_ids"][mb], batch["targets"][mb])[0].cpu().tolist()
        return [row[:len(t["tokens"]) - 1] for row, t in zip(out, trajectories)]

    @torch.no_grad()
    def _score(self, batch: dict) -> dict[str, torch.Tensor]:
        """Everything computed once per step before any update: old logprobs and entropy
        (policy at the version that sampled), reference logprobs, old values."""
        self.model.eval()
        B = batch["mask"].shape[0]
        out = {k: torch.zeros_like(batch["mask"]) for k in ("old", "entropy", "ref", "values")}
        for mb in torch.arange(B).split(self.cfg["micro_batch_size"]):
            ids, tgt = batch["input_ids"][mb], batch["targets"][mb]
            lp, logits = self._forward(self.model, ids, tgt)
            out["old"][mb], out["entropy"][mb] = lp.cpu(), losses.entropy(logits).cpu()
            if self.ref is not None:
                out["ref"][mb] = self._forward(self.ref, ids, tgt)[0].cpu()
            if self.critic is not None:
                out["values"][mb] = self.critic(ids.to(self.device)).cpu()
        return out

    # ---- one RL step ------------------------------------------------------------------------
    def train_step(self, trajectories: list[dict]) -> dict:
        t0 = time.perf_counter()
        cfg = self.cfg
        batch = collate(trajectories, self.pad_id)
        mask, rewards = batch["mask"], batch["rewards"]
        if cfg["reward_clip"] is not None:
            rewards = rewards.clamp(-cfg["reward_clip"], cfg["reward_clip"])
        B = mask.shape[0]
        scored = self._score(batch)
        old, ref, old_values = scored["old"], scored["ref"], scored["values"]

        weights, is_metrics = losses.is_weights(old, batch["rollout_logprobs"], mask,
                                                level=cfg["is_level"], mode=cfg["is_mode"],
                                                low=cfg["is_band"][0], high=cfg["is_band"][1])
        # KL enters the advantage for --kl_in_reward, and is the whole signal for distillation.
        kl, kl_coef = None, 0.0
        if cfg["estimator"] == "on_policy_distill":
            kl, kl_coef = old - ref, cfg["kl_coef"]             # reverse-KL log-ratio to the teacher
        elif cfg["kl_in_reward"]:
            kl, kl_coef = losses.kl(old, ref, cfg["kl_estimator"]), cfg["kl_coef"]
        advantages, returns = estimators.ESTIMATORS[cfg["estimator"]](
            rewards, mask, batch["groups"], rollout_ids=batch["rollout_ids"], kl=kl, kl_coef=kl_coef,
            values=old_values if self.critic is not None else None, gamma=cfg["gamma"], lam=cfg["lam"])

        # PPO: --ppo_epochs passes over the batch, each split into --mini_batches optimizer
        # steps; every micro-batch is normalized by the tokens (or rows) of its optimizer step.
        self.model.train()
        shuffle = torch.Generator().manual_seed(cfg["seed"] * 100_003 + self.version)
        totals: dict[str, float] = {}
        updates = 0
        for _ in range(cfg["ppo_epochs"]):
            order = torch.randperm(B, generator=shuffle) if cfg["mini_batches"] > 1 else torch.arange(B)
            for rows in order.chunk(cfg["mini_batches"]):
                step_tokens, step_rows = mask[rows].sum().clamp(min=1), len(rows)
                for mb in rows.split(cfg["micro_batch_size"]):
                    parts = self._micro_loss(batch, mb, old, ref, advantages, weights, step_tokens, step_rows)
                    if self.critic is not None:
                        parts.update(self._critic_loss(batch, mb, old_values, returns, step_tokens))
                    sum(v for k, v in parts.items() if k.endswith("loss")).backward()
                    for k, v in parts.items():
                        totals[k] = totals.get(k, 0.0) + float(v)
                totals["grad_norm"] = totals.get("grad_norm", 0.0) + self._step(self.model, self.optimizer)
                if self.critic is not None:
                    totals["critic_grad_norm"] = (totals.get("critic_grad_norm", 0.0)
                                                  + self._step(self.critic, self.critic_optimizer))
                updates += 1
        self.version += 1

        action = mask.bool()
        metrics = {k: v / updates for k, v in totals.items()}
        metrics.update({
            "optimizer_steps": updates,
            "entropy": scored["entropy"][action].mean().item(),
            "advantage_mean": advantages[action].mean().item(),
            "advantage_abs": advantages[action].abs().mean().item(),
            "action_tokens": int(action.sum()),
            "staleness": (self.version - 1 - batch["versions"][action]).float().mean().item(),
            "mismatch_max": (old - batch["rollout_logprobs"])[action].abs().max().item(),
            "train_s": time.perf_counter() - t0,
            **{k: float(v) for k, v in is_metrics.items()},
        })
        if self.ref is not None:
            metrics["ref_kl_k3"] = losses.kl(old, ref, "k3")[action].mean().item()
        if self.critic is not None:
            metrics["value_mean"] = old_values[action].mean().item()
        return metrics

    def _micro_loss(self, batch, mb, old, ref, advantages, weights, step_tokens, step_rows) -> dict:
        """Policy loss (+ KL loss, - entropy bonus) of one micro-batch, already normalized."""
        cfg = self.cfg
        lp, logits = self._forward(self.model, batch["input_ids"][mb], batch["targets"][mb])
        dev = lp.device
        m = batch["mask"][mb].to(dev)
        per_token, pm = losses.policy_loss(cfg["loss"], lp, old[mb].to(dev), advantages[mb].to(dev), m,
                                           eps_low=cfg["eps_clip"][0], eps_high=cfg["eps_clip"][1],
                                           dual_clip=cfg["dual_clip"])
        agg = lambda x: losses.aggregate(x, m, cfg["loss_agg"], num_tokens=step_tokens, num_seqs=step_rows)
        share = m.sum().item() / step_tokens.item()  # this micro-batch's share of the step's tokens
        parts = {"policy_loss": agg(per_token * weights[mb].to(dev)),
                 "clip_frac": float(pm["clip_frac"]) * share}
        if cfg["kl_loss"]:
            parts["kl_loss"] = cfg["kl_coef"] * agg(losses.kl(lp, ref[mb].to(dev), cfg["kl_estimator"]))
        if cfg["entropy_coef"]:
            parts["entropy_loss"] = -cfg["entropy_coef"] * agg(losses.entropy(logits))
        return parts

    def _critic_loss(self, batch, mb, old_values, returns, step_tokens) -> dict:
        m = batch["mask"][mb].to(self.device)
        values = self.critic(batch["input_ids"][mb].to(self.device))
        per_token = losses.value_loss(values, old_values[mb].to(self.device), returns[mb].to(self.device), m,
                                      self.cfg["value_clip"])
        return {"value_loss": losses.aggregate(per_token, m, "token_mean", num_tokens=step_tokens)}

    def _step(self, model, optimizer) -> float:
        """Clip, step (skipped on a non-finite norm: never poison the weights), zero grads."""
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg["grad_clip"])
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if math.isfinite(norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    # ---- weights out ----------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                       cpu_offload=True))
        if self.tied:
            sd.pop("lm_head.weight", None)  # the engine ties it to the embedding itself
        return sd

    def weights_blob(self) -> bytes:
        """Full weights as safetensors bytes, in the checkpoint names vLLM loads."""
        return safetensors.torch.save({k: v.contiguous() for k, v in self.full_state_dict().items()})

    def export(self, path: str) -> str:
        """Write a save_pretrained folder (model + tokenizer) that vLLM and transformers load."""
        from transformers import AutoModelForCausalLM
        sd = self.full_state_dict()
        model = AutoModelForCausalLM.from_pretrained(self.cfg["model"], dtype=torch.float32)
        model.load_state_dict(sd, strict=not self.tied)
        if self.tied:
            model.tie_weights()
        model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        Path(path, "molt_version.json").write_text(json.dumps({"version": self.version}))
        return path

    def get_version(self) -> int:
        return self.version


class TrainerGroup:
    """The trainer ranks as Ray actors forming one process group; the loop talks
    to the group, and every collective (the step, the full state dict) runs on
    all ranks. Rows are split across data-parallel ranks balanced by tokens."""

    def __init__(self, cfg: dict):
        import ray
        n = cfg["train_workers"]
        addr, port = ray.util.get_node_ip_address(), parallel.free_port()
        self.workers = [ray.remote(Trainer).options(num_cpus=0).remote(cfg, rank, n, addr, port)
                        for rank in range(n)]

    def ready(self) -> list:
        return [w.get_version.remote() for w in self.workers]

    async def train_step(self, trajectories: list[dict]) -> dict:
        parts = split_balanced(trajectories, len(self.workers))
        results = await asyncio.gather(*[w.train_step.remote(p) for w, p in zip(self.workers, parts)])
        return results[0]

    def weights_blob(self):
        """A Ray ref to rank 0's blob (every rank joins the gather)."""
        return [w.weights_blob.remote() for w in self.workers][0]

    def call(self, method: str, *args):
        """Run `method` on every rank; returns rank 0's result ref."""
        return [getattr(w, method).remote(*args) for w in self.workers][0]


def split_balanced(trajectories: list[dict], n: int) -> list[list[dict]]:
    """Greedy split into n parts of near-equal token count (longest first)."""
    parts: list[list[dict]] = [[] for _ in range(n)]
    loads = [0] * n
    for t in sorted(trajectories, key=lambda t: -len(t["tokens"])):
        i = loads.index(min(loads))
        parts[i].append(t)
        loads[i] += len(t["tokens"])
    return parts
