"""The policy trainer: a transformers causal LM under FSDP2, one RL step at a time.

`Trainer` runs as a Ray actor (`TrainerGroup` below wraps it with `ray.remote`). Each `train_step(trajectories)`:

  1. pads the token-exact trajectories into [B, T] tensors (no re-tokenizing) and splits
     them into this rank's micro-batches (batches.py);
  2. recomputes the logprobs of the sampled tokens under the current weights (`old_logprobs`) and logs how far
     they are from the engine's sampling logprobs (the train/rollout mismatch);
  3. computes advantages with the chosen estimator (estimators.py);
  4. for each micro-batch: forward, policy loss (losses.py) normalized by the
     action tokens of the whole step, backward; then clip and step the optimizer.

The weights go to the engines through `sync.WeightSender`, checkpoints through `checkpoint.Checkpoints` (both
bases of `Trainer`). `build_tiny_model` makes the default random-init model and its offline character tokenizer.

    python -c "import trainer; trainer.build_tiny_model('/tmp/tiny')"
"""

import asyncio
import gc
import json
import math
import shutil
import time
from collections import defaultdict
from pathlib import Path

import torch

import batches
import checkpoint
import estimators
import lora
import losses
import parallel
import sync
import vision

TINY_SPECIALS = ["<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|unk|>"]
TINY_CHARS = list("0123456789?=+-*, ")
TINY_CACHE = "tiny-qwen3-chars-v2"   # the folder under $MOLT_CACHE; v1's tokenizer encoded unknown characters as eos
TINY_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tiny_model(path: str, seed: int = 0) -> str:
    """Build (once) a ~130k-parameter Qwen3 with a character tokenizer at `path`.

    The vocabulary is tiny on purpose: a random policy must hit the right answer now and then for RL
    alone to get started."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    out = Path(path)
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return str(out)
    vocab = {t: i for i, t in enumerate(TINY_SPECIALS + TINY_CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))   # never the eos: text is never control tokens
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one char, one token
    tok.decoder = decoders.Fuse()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|end|>", unk_token="<|unk|>",
                                     chat_template=TINY_TEMPLATE)
    hf_tok.add_special_tokens({"additional_special_tokens": TINY_SPECIALS[1:]})
    config = Qwen3Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=32,  # vLLM's CPU attention needs head_dim >= 32
                         max_position_embeddings=1024, tie_word_embeddings=True,
                         eos_token_id=0, pad_token_id=0, bos_token_id=None)
    tmp = out.with_name(out.name + ".tmp")
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(tmp)
    hf_tok.save_pretrained(tmp)
    tmp.rename(out)  # atomic: a half-built folder is never reused
    return str(out)


def load_model(path: str) -> torch.nn.Module:
    """A transformers causal LM, or a vision-language model (its config has a vision_config)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    vlm = hasattr(AutoConfig.from_pretrained(path), "vision_config")
    return (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_pretrained(path, dtype=torch.float32)


def dropout_fields(config) -> dict[str, float]:
    """The config's non-zero dropout probabilities and MoE router jitter (its text/vision sub-configs
    too), by name: both are noise in train() only."""
    configs = [config, *(getattr(config, k) for k in ("text_config", "vision_config") if hasattr(config, k))]
    return {k: v for c in configs for k, v in vars(c).items()
            if ("dropout" in k or "pdrop" in k or "jitter" in k) and isinstance(v, float) and v > 0}


def without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Dropout off in this in-memory model (an export keeps the checkpoint's config). The
    trainer scores in eval() and trains in train(), and the engine never drops: with dropout
    the first ratio would not be 1 and trainer and engine would disagree on every token."""
    for c in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
        for sub in (c, *(getattr(c, k) for k in ("text_config", "vision_config") if hasattr(c, k))):
            for k in dropout_fields(sub):
                setattr(sub, k, 0.0)
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):  # Dropout, Dropout1d-3d, AlphaDropout, ...
            m.p = 0.0
        for k, v in vars(m).items():  # e.g. attention modules' `attention_dropout`, Mixtral's `jitter_noise`
            if ("dropout" in k or "jitter" in k) and isinstance(v, float):
                setattr(m, k, 0.0)
    return model


class ValueModel(torch.nn.Module):
    """The critic for --estimator gae: the policy's backbone with a scalar head."""

    def __init__(self, path: str):
        from transformers import AutoModel
        super().__init__()
        self.model = AutoModel.from_pretrained(path, dtype=torch.float32)  # the decoder, no LM head
        self.head = torch.nn.Linear(self.model.config.get_text_config().hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, **kw) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, **kw).last_hidden_state  # [b, T, H]
        return self.head(hidden.float()).squeeze(-1)                      # [b, T]: V before token t+1


GAP_KEYS = ("gap_abs", "gap_k3", "gap_entropy", "gap_tokens")   # --old_logprobs engine: train_step measures these


class Trainer(sync.WeightSender, checkpoint.Checkpoints):
    """One trainer rank. `cfg` is the dict of main.py's flags.

    Models: the policy (trained), a frozen reference (only when a KL term or on-policy distillation needs one;
    `--ref_model` or the initial policy) and a critic (only for gae). All are parallelized the same way (parallel.py).

    Every rank receives the WHOLE batch: it collates it, scores (old/ref logprobs, values) only its own rows and
    all-reduces the scores, so advantages, the step's token counts and the metrics are global and identical on every
    rank; then it trains on its own share of each mini-batch (rows split by tokens across data ranks, the same number
    of micro-batches on every rank, empty ones padded with a zero-weight row so collectives never deadlock)."""

    def __init__(self, cfg: dict, rank: int = 0, world_size: int = 1, master_addr: str = "127.0.0.1",
                 master_port: int = 0, node: tuple[int, int, bool] | None = None):
        from transformers import AutoConfig, AutoTokenizer
        self.cfg = cfg
        torch.manual_seed(cfg["seed"])
        # node: (trainer ranks, engines on this rank's node, whether they overlap): on CPU the threads come from
        # its cores (parallel.cpu_threads; else Ray's OMP_NUM_THREADS=1). In-process: torch's default.
        threads = cfg.get("train_threads")
        if node is not None and not torch.cuda.is_available():
            threads = parallel.cpu_threads(parallel.node_cores(), *node, train_threads=threads)[0]
        if threads:
            torch.set_num_threads(threads)
        self.device = parallel.init_distributed(rank, world_size, master_addr, master_port or parallel.free_port())
        self.dims = parallel.ParallelDims(world_size=world_size, tp=cfg.get("tp_size", 1),
                                          cp=cfg.get("cp_size", 1), ep=cfg.get("ep_size", 1))
        config = AutoConfig.from_pretrained(cfg["model"])
        self.dims.check_model(config)
        self.vocab = config.get_text_config().vocab_size  # the LM head's rows (split tp ways under TP)
        self.mesh = self.dims.build_mesh(self.device)
        self.dtype = getattr(torch, cfg["param_dtype"])
        self.tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.image_processor = self.image_token_id = None   # a vision-language model's: images -> pixel inputs
        if hasattr(config, "vision_config"):
            self.image_processor, self.image_token_id, self.dummy_image, self.dummy_image_ids = \
                vision.trainer_parts(cfg["model"], config)
        model = without_dropout(load_model(cfg["model"]))
        lora.add_adapters(model, lora.peft_config(cfg))  # --lora_rank: only the adapters train (lora.py)
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        if cfg.get("freeze_router"):
            for gate in parallel.moe_gates(model):
                gate.weight.requires_grad_(False)
        if cfg.get("freeze_vision"):
            parallel.vision_tower(model).requires_grad_(False)
        # Frozen weights never change: the engine keeps its own copy (weight sync skips them).
        self.frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
        self.model = self._shard(model, routing_hooks=True)
        # fused: one kernel over the tensors (on CPU 3.5x faster than torch's default loop per tensor)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg["lr"],
                                           betas=(0.9, 0.99), weight_decay=cfg["weight_decay"], eps=1e-8, fused=True)
        self.estimator = estimators.ESTIMATORS[cfg["estimator"]]
        self.ref = None
        if self.estimator.teacher or (cfg["kl_coef"] > 0 and (cfg["kl_loss"] or cfg["kl_in_reward"])):
            # No routing hooks: the KL/distillation target is the reference's own distribution, with
            # its own expert choices, never the policy's sampled routing (--routing_replay).
            self.ref = (lora.BaseView(self.model) if lora.peft_config(cfg) and not cfg["ref_model"]
                        else self._shard(load_model(cfg["ref_model"] or cfg["model"])).requires_grad_(False).eval())
        self.critic = self.critic_optimizer = None
        if self.estimator.critic:
            self.critic = self._shard(without_dropout(ValueModel(cfg["critic_model"] or cfg["model"])))
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=cfg["critic_lr"] or cfg["lr"],
                                                      betas=(0.9, 0.99), weight_decay=cfg["weight_decay"], fused=True)
        # Rows of a group that begin alike share those positions in the forward (batches.layout); not
        # under CP (it splits rows) or for a VLM (its rope positions come from the image tokens).
        self.share = 0 if self.image_processor or self.dims.cp > 1 or not cfg.get("share_prefix", True) \
            else config.get_text_config().hidden_size
        self.version = 0
        gc.freeze()  # start-up objects live as long as the trainer: no full collection walks them

    def _shard(self, model: torch.nn.Module, routing_hooks: bool = False) -> torch.nn.Module:
        return parallel.parallelize(model.to(self.device), self.dims, param_dtype=self.dtype,
                                    activation_checkpointing=self.cfg.get("activation_checkpointing", False),
                                    offload=self.cfg.get("offload") == "optimizer", routing_hooks=routing_hooks)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """SUM over the data and context ranks (no-op when there is one)."""
        g = self.dims.group("dp_cp")
        if g is not None:
            x = x.to(self.device)
            torch.distributed.all_reduce(x, group=g)
        return x.cpu()

    def _inputs(self, batch: dict, mb: torch.Tensor) -> dict:
        """Model inputs of a micro-batch on this rank's device (batches.layout), a VLM's pixel inputs added."""
        real = len(mb) > 0
        idx = mb if real else torch.tensor([0])    # an empty micro-batch runs a zero-weight row
        x = batches.layout(batch, idx, self.cfg.get("packing"), self.dims.cp, self.dims.cp_rank,
                           self.cfg.get("routing_replay"), self.share)
        inp = x["inputs"]
        if self.image_processor is not None:  # whole rows (CP and packing are refused for VLMs)
            rows_images = [batch["images"][i] for i in idx.tolist()] if batch.get("images") else [[] for _ in idx]
            if self.dims.dp_shard > 1 and not any(rows_images):
                # Every rank must run the FSDP-sharded vision blocks (their collectives): add a
                # row showing a blank image; _forward drops its outputs.
                ids, n = self.dummy_image_ids, inp["input_ids"].shape[1]
                row = torch.tensor((ids + [self.pad_id] * n)[:max(n, len(ids))])[None]
                inp["input_ids"] = torch.cat([torch.nn.functional.pad(inp["input_ids"], (0, row.shape[1] - n),
                                                                      value=self.pad_id), row])
                rows_images = rows_images + [[self.dummy_image]]
            inp.update(vision.mm_forward_kwargs(inp["input_ids"], rows_images,
                                                self.image_processor, self.image_token_id))
        elif batch.get("images"):
            raise ValueError("trajectories with images, but the policy has no vision tower")
        return {**x, "idx": idx, "inputs": {k: v.to(self.device) for k, v in inp.items()},
                "targets": x["targets"].to(self.device), "own": x["own"] & real}

    def _forward(self, model, x: dict, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logprobs of the targets [b, T], entropy [b, T] or None) under `model`, on the grid."""
        b, n = x["targets"].shape
        with parallel.routing(model, replay=x["replay"] if model is self.model else None):  # the policy's only
            logits = model(**x["inputs"], logits_to_keep=x["keep"].to(self.device)).logits[:b, :n]
        logits = logits.float() / self.cfg["temperature"]                                          # [b, K, V or V/tp]
        if self.dims.tp > 1:  # vocab-parallel LM head: this rank's slice of the vocabulary
            lp, ent = parallel.vocab_parallel_logprobs(logits, x["targets"], self.vocab, self.dims.group("tp"), entropy)
        else:
            lp, ent = losses.token_logprobs(logits, x["targets"]), (losses.entropy(logits) if entropy else None)
        # Keep autograd: unpack with a differentiable scatter onto the grid.
        grid = lambda v: batches.scatter(v, x, self.device)
        return grid(lp), (grid(ent) if entropy else None)

    def _values(self, x: dict) -> torch.Tensor:
        b = x["targets"].shape[0]
        return batches.scatter(self.critic(**x["inputs"])[:b, x["keep"]], x, self.device)  # less any dummy image row

    @torch.no_grad()
    def _score(self, batch: dict) -> dict[str, torch.Tensor]:
        """Everything computed once per step before any update: old logprobs and entropy
        (policy at the version that sampled), reference logprobs, old values. Each rank
        scores its rows (and CP chunk), then one all-reduce makes them global."""
        self.model.eval()
        B = batch["mask"].shape[0]
        keys = ("old", "entropy", "ref", "values")
        out = {k: torch.zeros_like(batch["mask"]) for k in keys}
        bypass = self.cfg.get("old_logprobs") == "engine"   # exactly on-policy: the engine's are the old policy's
        if bypass and ((batch["versions"] != self.version) & (batch["mask"] > 0)).any():
            raise RuntimeError("--old_logprobs engine: some tokens were sampled by another policy version than the "
                               f"trainer's {self.version}, so their logprobs are not the old policy's")
        for mb in batches.plan(self.cfg, self.dims, torch.arange(B), batch["lengths"], batch["groups"]):
            x = self._inputs(batch, mb)
            own, i = x["own"], x["idx"]
            if not bypass:
                lp, ent = self._forward(self.model, x, entropy=True)
                out["old"][i] += lp.cpu() * own
                out["entropy"][i] += ent.cpu() * own
            if self.ref is not None:
                out["ref"][i] += self._forward(self.ref, x)[0].cpu() * own
            if self.critic is not None:
                out["values"][i] += self._values(x).cpu() * own
        scored = dict(zip(keys, self._reduce(torch.stack([out[k] for k in keys])).unbind(0)))
        return {**scored, "old": batch["rollout_logprobs"] * batch["mask"], "entropy": None} if bypass else scored

    # ---- one RL step ------------------------------------------------------------------------
    def train_step(self, trajectories: list[dict]) -> dict:
        t0 = time.perf_counter()
        cfg = self.cfg
        batch = batches.collate(trajectories, self.pad_id, self.dims.cp)
        if (c := cfg["reward_clip"]) is not None:   # each turn's too: the per-turn estimators read those
            batch.update({k: batch[k].clamp(-c, c) for k in ("rewards", "turn_rewards") if k in batch})
        mask, rewards = batch["mask"], batch["rewards"]
        B = mask.shape[0]
        n_mini = min(cfg["mini_batches"], B)  # after drops a batch can be smaller: fewer steps (metric mini_batches)
        if cfg.get("routing_replay") and "routing" not in batch:
            raise ValueError("--routing_replay: these trajectories carry no 'routing' (expert selections at sampling)")
        scored = self._score(batch)
        old, ref, old_values = scored["old"], scored["ref"], scored["values"]

        weights, is_metrics = losses.is_weights(old, batch["rollout_logprobs"], mask,
                                                level=cfg["is_level"], mode=cfg["is_mode"],
                                                low=cfg["is_band"][0], high=cfg["is_band"][1])
        # KL enters the advantage for --kl_in_reward, and is the whole signal for distillation.
        kl, kl_coef = None, 0.0
        if self.estimator.teacher:
            kl, kl_coef = old - ref, cfg["kl_coef"]             # reverse-KL log-ratio to the teacher
        elif cfg["kl_in_reward"]:
            kl, kl_coef = losses.kl(old, ref, cfg["kl_estimator"]), cfg["kl_coef"]
        advantages, returns = self.estimator(  # it gets the inputs it names, and its own settings
            rewards, mask, batch["groups"], {k: cfg[k] for k in self.estimator.settings},
            rollout_ids=batch["rollout_ids"], kl=kl, kl_coef=kl_coef,
            values=old_values if self.critic is not None else None,
            **{k: batch.get(k) for k in ("turns", "turn_rewards", "states", "nodes")})   # per-turn credit
        # A rollout counts once in a per-sequence mean however it was cut into rows (segments): its rows'
        # tokens are weighed by the whole rollout's count, and a step's sequences are its rollouts.
        _, rollout = torch.unique(torch.stack([batch["groups"], batch["rollout_ids"]], 1), dim=0, return_inverse=True)
        batch["rollout_tokens"] = torch.zeros(B).index_add_(0, rollout, mask.sum(1).float())[rollout]
        spec = losses.POLICY_LOSSES[cfg["loss"]]   # its whole-batch input: once per step, by the old policy, global
        whole = spec.batch_input and spec.batch_input(old, advantages, mask > 0, **{k: cfg[k] for k in spec.settings})

        # PPO: --ppo_epochs passes over the batch, each split into --mini_batches optimizer
        # steps; every micro-batch (on every rank) is normalized by the tokens (or rows) of
        # its whole optimizer step, and FSDP sums the gradients over data ranks.
        self.model.train()
        shuffle = torch.Generator().manual_seed(cfg["seed"] * 100_003 + self.version)
        totals, norms, updates = defaultdict(float), defaultdict(float), 0
        for _ in range(cfg["ppo_epochs"]):
            for rows in batches.mini_batches(batch["groups"], n_mini, shuffle):
                step_tokens, step_rows = mask[rows].sum().clamp(min=1), len(rollout[rows].unique())
                for mb in batches.plan(self.cfg, self.dims, rows, batch["lengths"], batch["groups"]):
                    x = self._inputs(batch, mb)
                    parts = self._micro_loss(batch, x, old, ref, advantages, weights, step_tokens, step_rows,
                                             whole, first=updates == 0)
                    if self.critic is not None:
                        parts.update(self._critic_loss(batch, x, old_values, returns, step_tokens))
                    sum(v for k, v in parts.items() if k.endswith("loss")).backward()
                    for k, v in parts.items():
                        totals[k] += float(v.detach() if torch.is_tensor(v) else v)
                norms["grad_norm"] += optimizer_step(self.model, self.optimizer, cfg["grad_clip"], self.dims)
                if self.critic is not None:
                    norms["critic_grad_norm"] += optimizer_step(self.critic, self.critic_optimizer, cfg["grad_clip"],
                                                                self.dims)
                updates += 1
        self.version += 1
        keys = sorted(totals)  # the same keys on every rank
        totals = dict(zip(keys, self._reduce(torch.tensor([totals[k] for k in keys], dtype=torch.float64)).tolist()))
        gap = [totals.pop(k) for k in GAP_KEYS] if cfg["old_logprobs"] == "engine" else None

        metrics = {k: v / updates for k, v in {**totals, **norms}.items()}
        metrics.update(optimizer_steps=updates, mini_batches=n_mini, train_s=time.perf_counter() - t0,
                       **{k: float(v) for k, v in is_metrics.items()})
        metrics.update(step_metrics(batch, scored, advantages, self.version, self.ref is not None,
                                    self.critic is not None, gap))
        if cfg.get("dump_rollouts"):  # what the rollout viewer shows per token, aligned to `tokens` (not predicted)
            rows = lambda v: [[0.0] + [round(x, 5) for x in row[:n]] for row, n in zip(v.tolist(), batch["lengths"].tolist())]
            metrics["per_token"] = {"advantages": rows(advantages * mask + 0.0)}
            if cfg["old_logprobs"] != "engine":   # there `old` is the engine's: the trainer's were not measured
                metrics["per_token"]["trainer_logprobs"] = rows(old * mask + 0.0)
        return metrics

    def _micro_loss(self, batch, x, old, ref, advantages, weights, step_tokens, step_rows, whole, first) -> dict:
        """Policy loss (+ KL loss, - entropy bonus) of one micro-batch, already normalized."""
        cfg, i = self.cfg, x["idx"]
        gap = first and cfg["old_logprobs"] == "engine"   # the weights that sampled, without a scoring pass
        lp, ent = self._forward(self.model, x, entropy=bool(cfg["entropy_coef"]) or gap)
        dev = lp.device
        m = (batch["mask"][i] * x["own"]).to(dev)
        (lo, hi), own = cfg["eps_clip"] or (None, 0.0), losses.POLICY_LOSSES[cfg["loss"]].settings
        per_token, pm = losses.policy_loss(cfg["loss"], lp, old[i].to(dev), advantages[i].to(dev), m, eps_low=lo,
                                           eps_high=hi, batch=None if whole is None else whole[i].to(dev),
                                           **{k: cfg[k] for k in own})
        agg = lambda v: aggregate(v, m, batch["rollout_tokens"][i], cfg["loss_agg"], step_tokens, step_rows)
        share = m.sum().item() / step_tokens.item()  # this micro-batch's share of the step's tokens
        parts = {"policy_loss": agg(per_token * weights[i].to(dev)), "clip_frac": float(pm["clip_frac"]) * share}
        if cfg["kl_loss"]:
            parts["kl_loss"] = cfg["kl_coef"] * agg(losses.kl(lp, ref[i].to(dev), cfg["kl_estimator"]))
        if cfg["entropy_coef"]:
            parts["entropy_loss"] = -cfg["entropy_coef"] * agg(ent)
        if gap:  # the engine/trainer gap and entropy, measured on the first mini-batch's tokens
            d = ((lp.detach() - old[i].to(dev)) * m).double()   # k3 ~ d^2 / 2: below float32's resolution at 1e-6
            parts.update(zip(GAP_KEYS, (d.abs().sum(), (torch.expm1(d) - d).sum(), (ent.detach() * m).sum(), m.sum())))
        return parts

    def _critic_loss(self, batch, x, old_values, returns, step_tokens) -> dict:
        i = x["idx"]
        m = (batch["mask"][i] * x["own"]).to(self.device)
        per_token = losses.value_loss(self._values(x), old_values[i].to(self.device), returns[i].to(self.device), m,
                                      self.cfg["value_clip"])
        return {"value_loss": losses.aggregate(per_token, m, "token_mean", num_tokens=step_tokens)}

    # ---- weights out ----------------------------------------------------------------------
    def export(self, path: str) -> str:
        """Write a save_pretrained folder (model + tokenizer) that vLLM and transformers load."""
        adapter = lora.peft_config(self.cfg)
        sd = lora.adapter_tensors(self.model) if adapter else self.full_state_dict()
        if self.dims.rank != 0:
            return path
        model = load_model(self.cfg["model"])
        if adapter:  # the adapter in peft's format at PATH/adapter; the folder's weights have it merged in
            model = lora.export(model, sd, adapter, path)
        else:
            model.load_state_dict(sd, strict=not self.tied)
        if self.tied:
            model.tie_weights()
        model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        if self.image_processor is not None:  # processor files (and any code they name) go along
            for f in Path(self.cfg["model"]).iterdir():
                if (f.is_file() and f.suffix in (".json", ".py", ".jinja") and not f.name.endswith(".index.json")
                        and not Path(path, f.name).exists()):
                    shutil.copy(f, Path(path, f.name))
        Path(path, "molt_version.json").write_text(json.dumps({"version": self.version}))
        return path

    def get_version(self) -> int:
        return self.version

    def torch_threads(self) -> int:
        return torch.get_num_threads()


def aggregate(x: torch.Tensor, m: torch.Tensor, rollout_tokens: torch.Tensor, mode: str, step_tokens, step_rollouts):
    """losses.aggregate over this rank's tokens `m` with the step's global counts. A per-sequence mean is over
    rollouts: a row's (a segment's, under CP a chunk's) tokens count against its whole rollout's token count."""
    if mode == "seq_mean_token_mean":
        x = x * (m.sum(1).clamp(min=1) / rollout_tokens.clamp(min=1).to(x.device))[:, None]
    return losses.aggregate(x, m, mode, num_tokens=step_tokens, num_seqs=step_rollouts)


def optimizer_step(model, optimizer, grad_clip: float, dims) -> float:
    """Clip, step (skipped on a non-finite norm: never poison the weights), zero grads; returns the norm."""
    norm = parallel.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], grad_clip, dims)
    if math.isfinite(norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def step_metrics(batch: dict, scored: dict, advantages: torch.Tensor, version: int, ref: bool, critic: bool,
                 gap: list | None = None) -> dict:
    """What a step says about its batch's action tokens (`scored`: Trainer._score's; `version`: after the step).
    `gap`: with --old_logprobs engine (old = sampled), the first update's sums of GAP_KEYS give the mismatch."""
    action, old, sampled = batch["mask"].bool(), scored["old"], batch["rollout_logprobs"]
    metrics = {
        "advantage_mean": advantages[action].mean().item(),
        "advantage_abs": advantages[action].abs().mean().item(),
        "action_tokens": int(action.sum()),
        "staleness": (version - 1 - batch["versions"][action]).float().mean().item(),
    }
    if gap is not None:
        n = max(gap[3], 1.0)
        metrics.update(mismatch_abs=gap[0] / n, mismatch_fresh_abs=gap[0] / n, mismatch_k3=gap[1] / n, entropy=gap[2] / n)
    else:
        metrics.update(mismatch_max=(old - sampled)[action].abs().max().item(),
                       entropy=scored["entropy"][action].mean().item())
        # Tokens sampled by exactly the trainer's pre-step weights: the numeric engine/trainer gap,
        # without the policy lag that async and partial rollout add to mismatch_abs.
        fresh = action & (batch["versions"] == version - 1)
        if fresh.any():
            metrics["mismatch_fresh_abs"] = (old - sampled)[fresh].abs().mean().item()
    if ref:
        metrics["ref_kl_k3"] = losses.kl(old, scored["ref"], "k3")[action].mean().item()
    if critic:
        metrics["value_mean"] = scored["values"][action].mean().item()
    return metrics


class TrainerGroup:
    """The trainer ranks as Ray actors forming one process group; the loop talks to the group, and every
    collective (the step, the full state dict) runs on all ranks. Every rank gets the whole batch (one
    object-store copy) and trains on its token-balanced share of it (see Trainer).

    Placement: one Ray bundle per rank (one CPU, one GPU where the cluster has GPUs, plus
    --trainer_resources), apart from the engines' bundles. The ranks of a TP x CP group talk in
    every layer, so each such group is one STRICT_PACK placement group (one node); pure data
    ranks are one PACK group. The process group's store lives on rank 0's own node: its address
    and port come from a task run in rank 0's bundle, before any rank starts."""

    def __init__(self, cfg: dict, actor: type | None = None):
        import ray
        n, group = cfg["train_workers"], cfg.get("tp_size", 1) * cfg.get("cp_size", 1)
        gpus = parallel.gpu_shares(cfg, ray.cluster_resources().get("GPU", 0))[0]  # one GPU per rank, if any
        bundle = {"CPU": 1, **({"GPU": gpus} if gpus else {}), **(cfg.get("trainer_resources") or {})}
        if group == 1:
            pg = parallel.reserve([bundle] * n, "PACK", f"{n} trainer rank(s)")
            self.slots = [(pg, r) for r in range(n)]
        else:
            pgs = [parallel.reserve([bundle] * group, "STRICT_PACK",
                                    f"trainer ranks {g * group}-{(g + 1) * group - 1} (a TP x CP group: one node)")
                   for g in range(n // group)]
            self.slots = [(pgs[r // group], r % group) for r in range(n)]
        markers = shared_markers(cfg)
        try:
            facts = ray.get([parallel.node_facts(pg, i, tuple(markers)) for pg, i in self.slots])
        finally:
            for m in markers:
                Path(m).unlink(missing_ok=True)
        check_shared_storage(facts, markers)
        self.master = (facts[0]["ip"], facts[0]["port"])    # rank 0's node hosts the store
        # Who shares each rank's node, for its CPU threads (parallel.cpu_threads).
        nodes = [ray.util.placement_group_table(pg)["bundles_to_node_id"][i] for pg, i in self.slots]
        engines = 0 if cfg.get("replay_rollouts") or not parallel.one_node() else cfg.get("num_engines", 1)
        remote = ray.remote(actor or Trainer)
        self.workers = [remote.options(num_cpus=1, num_gpus=gpus, **parallel.in_bundle(pg, i)).remote(
                        cfg, rank, n, *self.master, node=(nodes.count(nodes[rank]), engines, cfg.get("async_depth", 0) > 0))
                        for rank, (pg, i) in enumerate(self.slots)]

    def ready(self) -> list:
        return [w.get_version.remote() for w in self.workers]

    async def train_step(self, trajectories: list[dict]) -> dict:
        import ray
        ref = ray.put(trajectories)
        return (await asyncio.gather(*[w.train_step.remote(ref) for w in self.workers]))[0]

    def weights_blob(self):
        """A Ray ref to rank 0's blob (every rank joins the gather)."""
        return [w.weights_blob.remote() for w in self.workers][0]

    def call(self, method: str, *args):
        """Run `method` on every rank; returns rank 0's result ref."""
        return [getattr(w, method).remote(*args) for w in self.workers][0]


def shared_markers(cfg: dict) -> list[str]:
    """Mark the folders the trainer ranks write (checkpoints: every rank; the export: rank 0) with
    a file of this run, so each rank's node can say whether it sees the driver's folder."""
    import uuid
    if not (cfg.get("save_every") or cfg.get("resume") or cfg.get("export_hf")):
        return []
    out = Path(cfg["output_dir"]).resolve()
    export = Path(cfg["export_hf"]).resolve().parent if cfg.get("export_hf") else out
    folders = [out] + ([export] if export != out and not export.is_relative_to(out) else [])
    markers = [folder / f".molt-visible-{uuid.uuid4().hex}" for folder in folders]
    for marker in markers:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    return [str(m) for m in markers]


def check_shared_storage(facts: list[dict], markers: list[str]) -> None:
    """Every trainer rank's node must see the driver's --output_dir (and --export_hf folder):
    checkpoints are written there by every rank, the export by rank 0, and the driver reads
    them back. On several machines that takes shared storage mounted at the same path."""
    for rank, f in enumerate(facts):
        for marker, seen in zip(markers, f["sees"]):
            if not seen:
                raise ValueError(
                    f"{Path(marker).parent} (--output_dir / --export_hf) is not visible from trainer rank {rank}'s "
                    f"node ({f['ip']}): checkpoints are written by every trainer rank and the export by rank 0, "
                    "so on several machines it must be shared storage (NFS, a cloud-bucket mount) mounted at the "
                    "same path on the driver and every trainer node")
