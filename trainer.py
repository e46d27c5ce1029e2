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


class Trainer:
    """One trainer rank. `cfg` is the dict of main.py's flags."""

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
        model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.model = parallel.apply_fsdp(model.to(self.device), self.mesh, param_dtype=self.dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg["lr"], betas=(0.9, 0.99),
                                           weight_decay=cfg["weight_decay"], eps=1e-8)
        self.version = 0
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    # ---- logprobs -------------------------------------------------------------------------
    def _logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor,
                  with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.model(input_ids=input_ids.to(self.device)).logits.float()  # [b, T, V]
        lp = losses.token_logprobs(logits, targets.to(self.device), self.cfg["temperature"])
        ent = losses.entropy(logits / self.cfg["temperature"]) if with_entropy else None
        return lp, ent

    def _micro_batches(self, B: int) -> list[slice]:
        size = self.cfg["micro_batch_size"]
        return [slice(i, min(i + size, B)) for i in range(0, B, size)]

    @torch.no_grad()
    def compute_logprobs(self, trajectories: list[dict]) -> list[list[float]]:
        """Trainer logprobs of each trajectory's tokens (position t scores token t+1)."""
        batch = collate(trajectories, self.pad_id)
        out = []
        for mb in self._micro_batches(len(trajectories)):
            lp, _ = self._logprobs(batch["input_ids"][mb], batch["targets"][mb])
            out += lp.cpu().tolist()
        return [row[:len(t["tokens"]) - 1] for row, t in zip(out, trajectories)]

    # ---- one RL step ------------------------------------------------------------------------
    def train_step(self, trajectories: list[dict]) -> dict:
        t0 = time.perf_counter()
        cfg = self.cfg
        batch = collate(trajectories, self.pad_id)
        mask = batch["mask"]
        B = mask.shape[0]
        mbs = self._micro_batches(B)

        # Old logprobs under the weights that the engine also has (version v).
        self.model.eval()
        old, ent = torch.zeros_like(mask), torch.zeros_like(mask)
        with torch.no_grad():
            for mb in mbs:
                lp, e = self._logprobs(batch["input_ids"][mb], batch["targets"][mb], with_entropy=True)
                old[mb], ent[mb] = lp.cpu(), e.cpu()
        weights, is_metrics = losses.is_weights(old, batch["rollout_logprobs"], mask,
                                                level=cfg["is_level"], mode=cfg["is_mode"],
                                                low=cfg["is_band"][0], high=cfg["is_band"][1])
        advantages, _ = estimators.ESTIMATORS[cfg["estimator"]](
            batch["rewards"], mask, batch["groups"], rollout_ids=batch["rollout_ids"],
            gamma=cfg["gamma"], lam=cfg["lam"])

        # PPO: --ppo_epochs passes over the batch, each split into --mini_batches optimizer
        # steps; each micro-batch is normalized by the action tokens of its optimizer step.
        self.model.train()
        shuffle = torch.Generator().manual_seed(cfg["seed"] * 100_003 + self.version)
        totals = {"loss": 0.0, "clip_frac": 0.0, "grad_norm": 0.0}
        updates = 0
        for _ in range(cfg["ppo_epochs"]):
            order = torch.randperm(B, generator=shuffle) if cfg["mini_batches"] > 1 else torch.arange(B)
            for rows in order.chunk(cfg["mini_batches"]):
                num_tokens = mask[rows].sum().clamp(min=1)
                for mb in rows.split(cfg["micro_batch_size"]):
                    lp, _ = self._logprobs(batch["input_ids"][mb], batch["targets"][mb])
                    m = mask[mb].to(lp.device)
                    per_token, pm = losses.policy_loss(
                        cfg["loss"], lp, old[mb].to(lp.device), advantages[mb].to(lp.device), m,
                        eps_low=cfg["eps_clip"][0], eps_high=cfg["eps_clip"][1], dual_clip=cfg["dual_clip"])
                    per_token = per_token * weights[mb].to(lp.device)
                    loss = losses.aggregate(per_token, m, "token_mean", num_tokens=num_tokens)
                    loss.backward()
                    totals["loss"] += loss.item()
                    totals["clip_frac"] += float(pm["clip_frac"]) * m.sum().item() / num_tokens.item()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg["grad_clip"])
                grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
                if math.isfinite(grad_norm):  # a NaN/inf gradient skips the update, never poisons it
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                totals["grad_norm"] += grad_norm
                updates += 1
        self.version += 1
        num_tokens = mask.sum()

        action = mask.bool()
        metrics = {
            **{k: v / updates for k, v in totals.items()},
            "optimizer_steps": updates,
            "entropy": ent[action].mean().item(),
            "advantage_abs": advantages[action].abs().mean().item(),
            "action_tokens": int(num_tokens.item()),
            "staleness": (self.version - 1 - batch["versions"][action]).float().mean().item(),
            "train_s": time.perf_counter() - t0,
        }
        metrics.update({k: float(v) for k, v in is_metrics.items()})
        metrics["mismatch_max"] = (old - batch["rollout_logprobs"])[action].abs().max().item()
        return metrics

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
