"""Our loop against a plain sequential RL trainer on the same machine, one run.

The plain trainer is what a person writes first: each step, one batched `transformers.generate` of the step's prompts
(sampling, with the sampled tokens' logprobs), the agent's reward, then a fixed training step of its own, as TRL's
GRPOTrainer trains at its defaults (`plain_step`: group-normalized rewards, one forward and backward over the step's
padded batch with logits only for the replies, token-level loss, the old logprobs from that same forward since each
batch is used once; no KL), with the same peft adapter when --lora_rank is given (no Ray, no vLLM, no weight sync), at
torch's default threads (every core), as a user runs it; `--plain_1thread` adds it at one thread. Ours is `main.py`
with the same flags: Ray + vLLM + the FSDP2 trainer actor. Both use the same prompts, lengths, samples and optimizer
settings; the ratios compare them, and only the ratios mean anything across machines.

    python bench/vs_plain.py                       # default task, tiny model, 32 x 16
    python bench/vs_plain.py --workload smollm2    # SmolLM2-135M fp32, chain_sum, 8 x 4
    python bench/vs_plain.py --workload smollm2_auto   # the same at --param_dtype auto (bf16 here)
    python bench/vs_plain.py --steps 8 --warmup 2 --ours sync --plain_once
    python bench/vs_plain.py --ours async --extra=--train_threads=2   # another thread split
    python bench/vs_plain.py --lora 16 --ours sync   # also ours and plain with a rank-16 adapter: LoRA ratios

Ours runs twice: on-policy (main.py's default, generation then training, like the plain loop) and async
(`--async_depth 1 --partial_rollout`: the next step's rollouts generate while this one trains). Prints s/step (median
after warm-up) with its phases, set-up time before step 1, the peak memory (PSS summed over the run's processes:
shared pages counted once) with each kind of process's part of it at that peak, and the CPU seconds each kind of
process spends per step after warm-up: their sum over the machine's cores is a floor under the step time that no
overlap can go below.
"""

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORKLOADS = {
    "default": [],  # main.py's defaults: tiny model, max_digit, 32 x 16, 3 new tokens, 4 mini-batches
    "smollm2": ["--model", "smollm2", "--agent", "examples/recipes/smollm2_agent.py",
                "--dataset", "reasoning-gym:chain_sum:min_terms=2,max_terms=2,max_digits=1",
                "--prompts_per_step", "8", "--samples_per_prompt", "4", "--max_new_tokens", "24",
                "--max_len", "256", "--temperature", "0.7", "--lr", "1e-5", "--mini_batches", "2",
                "--param_dtype", "float32"],
}
WORKLOADS["smollm2_auto"] = [*WORKLOADS["smollm2"][:-1], "auto"]  # bf16 where the CPU has native bf16 (plain too)
COMMON = ["--quiet", "--export_hf", "none", "--no_plot"]

KINDS = (("engine core", "VLLM::EngineCore"), ("engine actor", "ray::Generator"), ("trainer", "ray::Trainer"),
         ("ray", "ray"))  # by command line; everything else is "driver"


class Processes:
    """Watches this process and all its descendants (Ray, engines, ranks): every 0.1 s the CPU time each kind used
    (`cpu()`: seconds so far, by kind; a process that ended keeps what it used), every 2 s their summed PSS (a shared
    page counts once, split among its sharers: RSS would count Ray's shared-memory object store and shared libraries
    in every process), its peak and what each kind held at that peak. The watcher runs in the driver beside ours: it
    reads command lines and PSS (smaps_rollup, milliseconds for a large process) only every 2 s, so that it takes
    little of the driver's CPU."""

    def __init__(self):
        import psutil
        self.me, self.peak, self.parts, self.stop = psutil.Process(), 0, {}, threading.Event()
        self.used: dict[int, tuple[str, float]] = {}   # pid -> (kind, CPU seconds at the last look)
        self.kinds: dict[int, str] = {}
        self.on_tick = lambda: None
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self):
        import psutil
        for tick in range(1 << 62):
            if self.stop.wait(0.1):
                return
            parts: dict[str, int] = {}
            for p in [self.me, *self.me.children(recursive=True)]:
                try:
                    if p.pid not in self.kinds or tick % 20 == 0:   # a Ray worker renames itself
                        cmd = " ".join(p.cmdline())
                        kind = next((k for k, mark in KINDS if mark in cmd), "driver") if p != self.me else "driver"
                        if kind == "engine actor" and self.kinds.get(p.ppid()) == "engine actor":
                            kind = "engine core"  # forked by the actor (generator.py): its command line
                        self.kinds[p.pid] = kind
                    kind, t = self.kinds[p.pid], p.cpu_times()
                    if tick % 20 == 0:
                        parts[kind] = parts.get(kind, 0) + p.memory_full_info().pss
                except psutil.Error:
                    continue
                self.used[p.pid] = (kind, t.user + t.system)
            if sum(parts.values()) > self.peak:
                self.peak, self.parts = sum(parts.values()), parts
            self.on_tick()

    def cpu(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for kind, seconds in list(self.used.values()):
            out[kind] = out.get(kind, 0.0) + seconds
        return out

    def done(self) -> tuple[float, dict]:
        self.stop.set()
        return self.peak / 2**30, {k: round(v / 2**30, 2) for k, v in sorted(self.parts.items())}


def cpu_per_step(first: dict, last: dict, steps: int) -> dict[str, float]:
    """CPU seconds per step by kind of process between two `Processes.cpu()` looks."""
    return {k: round((last.get(k, 0.0) - first.get(k, 0.0)) / max(steps, 1), 3) for k in sorted(last)}


def plain(argv: list[str], steps: int, warmup: int, threads: int | None = None) -> dict:
    """The plain loop: HF generate -> reward -> plain_step, all in this process, at torch's
    default threads (or `threads`)."""
    import torch
    import agent as agents
    import data
    import main
    import lora
    import trainer
    import trajectory

    mem = Processes()
    t0 = time.perf_counter()
    cfg = main.validate(vars(main.build_parser().parse_args(argv)))
    if threads:
        torch.set_num_threads(threads)
    model = trainer.without_dropout(trainer.load_model(cfg["model"])).to(getattr(torch, cfg["param_dtype"]))
    if lora.peft_config(cfg):
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(**lora.peft_config(cfg)))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg["lr"],
                                  betas=(0.9, 0.99), weight_decay=cfg["weight_decay"])
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    env_cls = agents.load_agent(cfg["agent"])
    rows = data.prompt_source(cfg, env_cls)
    P, S, T, pad = cfg["prompts_per_step"], cfg["samples_per_prompt"], cfg["temperature"], tok.pad_token_id
    setup = time.perf_counter() - t0
    times, cpu = [], {}
    for step in range(steps):
        if step == warmup:
            cpu["first"] = mem.cpu()
        t_gen = time.perf_counter()
        batch = [next(rows) for _ in range(P)]
        prompts = [tok.apply_chat_template(trajectory.prompt_messages(r["prompt"]), add_generation_prompt=True,
                                           tokenize=True)["input_ids"] for r in batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts]).repeat_interleave(S, 0)
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]).repeat_interleave(S, 0)
        model.eval()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=T,
                                         top_k=0, top_p=1.0, max_new_tokens=cfg["max_new_tokens"],
                                         output_logits=True, return_dict_in_generate=True, pad_token_id=pad)
        logp = torch.stack(out.logits, 1).float().div(T).log_softmax(-1)              # [B, n, V]
        new = out.sequences[:, width:]                                                 # [B, n]
        lps = logp.gather(-1, new[..., None])[..., 0]
        trajs = []
        for i in range(len(new)):
            row, prompt = batch[i // S], prompts[i // S]
            reply = new[i].tolist()
            n = reply.index(tok.eos_token_id) + 1 if tok.eos_token_id in reply else len(reply)
            action = trajectory.decode_reply(tok, reply[:n])
            state = agents.State(prompt=row["prompt"], label=row.get("label"), action=action, observation=None,
                                 messages=[], turn=0, sampling_params={}, row=row,
                                 finish_reason="stop" if tok.eos_token_id in reply else "length")
            reward = asyncio.run(env_cls().step(state)).reward
            trajs.append({"prompt": prompt, "reply": reply[:n], "reward": float(reward)})
        gen_s = time.perf_counter() - t_gen
        plain_step(model, optimizer, trajs, S, T, pad, cfg["grad_clip"])
        times.append({"step_s": time.perf_counter() - t_gen, "gen_s": gen_s, "train_s": time.perf_counter() - t_gen - gen_s,
                      "reward": sum(t["reward"] for t in trajs) / len(trajs)})
    last = mem.cpu()
    peak, parts = mem.done()
    return {"setup_s": setup, "steps": times, "peak_gib": peak, "memory": parts,
            "cpu_per_step": cpu_per_step(cpu.get("first", {}), last, steps - warmup)}


def plain_step(model, optimizer, trajs: list[dict], group: int, temperature: float, pad: int, clip: float):
    """The baseline's fixed training step (TRL GRPOTrainer's defaults): advantages (r - group mean) / group std,
    one forward and backward over the whole batch (prompts left-padded, replies right-padded), logits only for
    the reply columns (logits_to_keep), ratio exp(lp - lp.detach()) (the old policy is this forward's own),
    loss = -(ratio * A) over all the step's sampled tokens, clip, AdamW."""
    import torch
    wp, wc = (max(len(t[k]) for t in trajs) for k in ("prompt", "reply"))
    ids = torch.tensor([[pad] * (wp - len(t["prompt"])) + t["prompt"] + t["reply"] + [pad] * (wc - len(t["reply"]))
                        for t in trajs])                                                         # [B, wp + wc]
    attn = torch.tensor([[0] * (wp - len(t["prompt"])) + [1] * (len(t["prompt"]) + len(t["reply"]))
                         + [0] * (wc - len(t["reply"])) for t in trajs])
    mask = attn[:, wp:].float()                                                                  # [B, wc]
    r = torch.tensor([t["reward"] for t in trajs]).view(-1, group)                              # [P, S]
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1, 1)         # [B, 1]
    model.train()
    logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=wc + 1).logits[:, :-1]    # [B, wc, V]
    lp = (logits.float() / temperature).log_softmax(-1).gather(-1, ids[:, wp:, None])[..., 0]   # [B, wc]
    loss = -(torch.exp(lp - lp.detach()) * adv * mask).sum() / mask.sum().clamp(min=1)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def ours(argv: list[str], steps: int, warmup: int, out: Path) -> dict:
    import main
    mem, cpu = Processes(), {}

    def look():  # CPU so far when the warm-up's last step and the run's last step are logged
        path = out / "metrics.jsonl"
        done = path.read_text().count("\n") if path.is_file() else 0
        if done >= warmup and "first" not in cpu:
            cpu["first"] = mem.cpu()
        if done >= steps and "last" not in cpu:
            cpu["last"] = mem.cpu()
    mem.on_tick = look
    summary = main.main([*argv, "--steps", str(steps), "--output_dir", str(out)])
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    peak, parts = mem.done()
    return {"setup_s": summary["setup_s"], "peak_gib": peak, "memory": parts,
            "cpu_per_step": cpu_per_step(cpu.get("first", {}), cpu.get("last", mem.cpu()), steps - warmup),
            "steps": [{"step_s": m["step_s"], "gen_s": m["wait_rollouts_s"], "train_s": m["train_s"],
                       "sync_s": m.get("weight_sync_s", 0.0), "reward": m["reward_mean"]} for m in lines]}


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def sync_share(argv: list[str], rank: int) -> float:
    """The data an adapter sync sends against a full one: parameters counted on a meta-device model."""
    import main, lora, torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = main.validate(vars(main.build_parser().parse_args([*argv, "--lora_rank", str(rank)])))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg["model"]))
    full = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in lora.add_adapters(model, lora.peft_config(cfg)).parameters() if p.requires_grad) / full


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="default")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
    ap.add_argument("--ours", choices=["sync", "async", "both"], default="both")
    ap.add_argument("--plain_once", action="store_true", help="skip the second plain run (drift check)")
    ap.add_argument("--plain_1thread", action="store_true", help="also run plain at one torch thread")
    ap.add_argument("--lora", type=int, default=0, help="also run plain and ours with an adapter of this rank")
    ap.add_argument("--extra", default="", help="more main.py flags for ours, e.g. '--train_threads 2'")
    ap.add_argument("--part", help=argparse.SUPPRESS)  # one run in a fresh process, its JSON to this file
    args = ap.parse_args()
    argv = [*WORKLOADS[args.workload], *COMMON]
    goal_step, goal_memory = {"default": (1.0, 3.0)}.get(args.workload, (0.8, 2.0))  # issue "Speed at defaults"
    tmp = Path(tempfile.mkdtemp(prefix="bench_vs_plain_"))
    if args.part:
        name, file = args.part.split(":", 1)
        extra = ["--async_depth", "1", "--partial_rollout"] if name == "ours async" else []
        argv += ["--lora_rank", str(args.lora)] if name.endswith("lora") else []
        r = (plain(argv, args.steps, args.warmup, 1 if name == "plain 1 thread" else None) if name.startswith("plain")
             else ours([*argv, *extra, *shlex.split(args.extra)], args.steps, args.warmup, tmp / "run"))
        Path(file).write_text(json.dumps(r))
        sys.exit(0)
    # plain runs first and again last: this machine's speed drifts (+-40% within a session), and
    # the ratios take plain's mean of the two; a large gap between them is printed as a warning
    names = (["plain"] + (["plain 1 thread"] if args.plain_1thread else [])
             + (["ours"] if args.ours != "async" else []) + (["ours async"] if args.ours != "sync" else [])
             + (["plain lora", "ours lora"] if args.lora else []) + ([] if args.plain_once else ["plain again"]))
    runs = {}
    for name in names:  # each in a process of its own: no memory or threads left over from the one before
        file = tmp / f"{name.replace(' ', '_')}.json"
        subprocess.run([sys.executable, __file__, "--workload", args.workload, "--steps", str(args.steps),
                        "--warmup", str(args.warmup), f"--extra={args.extra}", "--lora", str(args.lora),
                        "--part", f"{name.removesuffix(' again')}:{file}"], check=True)
        runs[name] = json.loads(file.read_text())
    if "plain again" in runs:
        again = runs.pop("plain again")
        first, second = (med(r["steps"][args.warmup:], "step_s") for r in (runs["plain"], again))
        print(f"plain s/step before ours {first:.3f}, after {second:.3f}"
              + (" (the machine's speed drifted: compare ratios with care)" if abs(first / second - 1) > 0.15 else ""))
        p, w = runs["plain"], args.warmup
        p["steps"] = p["steps"][:w] + [{k: (a[k] + b[k]) / 2 for k in a}
                                       for a, b in zip(p["steps"][w:], again["steps"][w:])]
        p["cpu_per_step"] = {k: (v + again["cpu_per_step"].get(k, v)) / 2 for k, v in p["cpu_per_step"].items()}
    print(f"workload {args.workload}: {' '.join(WORKLOADS[args.workload]) or 'main.py defaults'}"
          + (f"; ours with {args.extra}" if args.extra else "") + f"; {args.steps} steps, medians of the last "
          f"{args.steps - args.warmup}")
    print(f"{'':14} {'s/step':>8} {'generate':>9} {'train':>7} {'sync':>6} {'setup s':>8} {'peak GiB':>9} {'reward':>7}")
    b = runs["plain"]
    sb = b["steps"][args.warmup:]
    for name, r in runs.items():
        s = r["steps"][args.warmup:]
        print(f"{name:14} {med(s, 'step_s'):8.3f} {med(s, 'gen_s'):9.3f} {med(s, 'train_s'):7.3f} "
              f"{med(s, 'sync_s') if 'sync_s' in s[0] else 0.0:6.3f} {r['setup_s']:8.1f} {r['peak_gib']:9.2f} "
              f"{statistics.mean(x['reward'] for x in s):7.3f}")
    print("(generate: ours = the trainer waiting for rollouts; reward: mean of the steps after warm-up)")
    for name, r in runs.items():
        print(f"{name} peak memory by process (GiB): {r['memory']}")
    cores = len(os.sched_getaffinity(0))
    for name, r in runs.items():   # the floor CPU time puts under a step, whatever the overlap
        total = sum(r["cpu_per_step"].values())
        print(f"{name} CPU s/step by process: {r['cpu_per_step']}, total {total:.3f}: on {cores} cores a step "
              f"takes at least {total / cores:.3f} s = {total / cores / med(sb, 'step_s'):.2f} x plain's step")
    if args.lora:   # the goals of issue 36: LoRA against full fine-tuning, and against plain with the same adapter
        full, low, pl = (runs[k]["steps"][args.warmup:] for k in ("ours", "ours lora", "plain lora"))
        print(f"ours lora / plain lora: step {med(low, 'step_s') / med(pl, 'step_s'):.2f} (goal <= 0.8), train "
              f"{med(low, 'train_s') / med(pl, 'train_s'):.2f}; ours lora / ours: sync data "
              f"{sync_share(argv, args.lora):.3f} (goal <= 0.1), seconds {med(low, 'sync_s') / med(full, 'sync_s'):.3f}, "
              f"peak memory {runs['ours lora']['peak_gib'] / runs['ours']['peak_gib']:.2f} (goal <= 0.7), train "
              f"{med(low, 'train_s') / med(full, 'train_s'):.2f}")
    for name, a in runs.items():
        if name != "plain":   # the goals are for our full fine-tuning
            sa, goal = a["steps"][args.warmup:], f" (goal <= {goal_step})" if name in ("ours", "ours async") else ""
            print(f"{name} / plain: step {med(sa, 'step_s') / med(sb, 'step_s'):.2f}{goal}, "
                  f"generation {med(sa, 'gen_s') / med(sb, 'gen_s'):.2f}, train {med(sa, 'train_s') / med(sb, 'train_s'):.2f}, "
                  f"set-up {a['setup_s'] / max(b['setup_s'], 1e-9):.1f}, "
                  f"peak memory {a['peak_gib'] / b['peak_gib']:.2f}" + (f" (goal <= {goal_memory})" if goal else ""))
