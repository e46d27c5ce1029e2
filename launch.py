"""Start-up and shutdown around the loop: Ray, the engines and the trainer, then loop.train,
then export, plot and summary. `run` is what main.py calls once the flags are checked.

    start_ray -> start_engines + TrainerGroup (concurrently; wait_ready) -> connect weight sync
    -> resume from the last complete checkpoint (--resume) -> loop.train -> export -> summary

Every process of a run carries its tag (faults.py), so none outlives it however it ends.
"""

import asyncio
import gc
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from unittest import mock

import psutil
import ray

import evaluation
import faults
import logs
import loop
import programs
from generator import start_engines
from trainer import TrainerGroup

log = logging.getLogger("molt")
ROOT = str(Path(__file__).resolve().parent)


def start_ray(cfg: dict) -> None:
    """Start a private local Ray, or join a running cluster (--ray_address auto|HEAD:6379).

    Every Ray worker, on any node, imports this code from the same absolute path (PYTHONPATH
    below): on several machines the project and its Python environment must sit at the same
    path on every node (shared storage, or the same checkout and install.sh on each)."""
    paths = [ROOT, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]  # absolute: workers run elsewhere
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(str(Path(p).resolve()) for p in paths if p)),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
           "VLLM_CONFIGURE_LOGGING": os.environ.get("VLLM_CONFIGURE_LOGGING", "1"),
           faults.TAG: os.environ[faults.TAG]}  # on a cluster, the actors' tag comes only from here
    if cfg["ray_address"] is None:
        # A private local cluster, on loopback only (Ray's mode for a laptop, node ip 127.0.0.1; its GCS,
        # raylet, agents and workers otherwise listen on every interface): so its auth can stay off.
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # Its processes inherit the driver's environment: a runtime_env would cost each worker ~1 s
        # (its own worker pool, set up by Ray's runtime-env agent), on set-up's critical path.
        os.environ.update(env)
        # Each trainer rank and engine reserves one CPU in its placement bundle; a small machine
        # declares that many (they share its cores) so that every layout fits.
        local = {"num_cpus": max(os.cpu_count() or 1, cfg["train_workers"] + (cfg["num_engines"] or 0))}
    else:
        local = {"runtime_env": {"env_vars": env}}
    # gloo's pairs (trainer ranks, weight sync) listen where the hostname resolves: in a local run's processes
    # (they inherit the environment at ray.init), the loopback interface instead
    loopback = [n for n, addrs in psutil.net_if_addrs().items() if any(a.address == "127.0.0.1" for a in addrs)]
    gloo = {} if cfg["ray_address"] or "GLOO_SOCKET_IFNAME" in os.environ else {"GLOO_SOCKET_IFNAME": loopback[0]}
    with mock.patch.object(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", cfg["ray_address"] is not None), \
            mock.patch.dict(os.environ, {**gloo, **tcmalloc(cfg)}):
        # "local": a new local cluster, never one found in /tmp/ray/ray_current_cluster (a stale file
        # there made ray.init retry a dead GCS for minutes, deaf to Ctrl-C and SIGTERM)
        ray.init(address=cfg["ray_address"] or "local", include_dashboard=False, logging_level=logging.WARNING,
                 log_to_driver=cfg["verbose"], **local)
    faults.catch_stop_signals()  # ray.init sets a SIGTERM handler of its own (sys.exit): ours again
    at = f"GCS at {ray.get_runtime_context().gcs_address}, authentication {os.environ.get('RAY_AUTH_MODE', 'on')}"
    print(f"ray: a local cluster ({at}): Ray, trainer ranks, engines and weight sync listen on 127.0.0.1 only"
          if cfg["ray_address"] is None else f"ray: joined {cfg['ray_address']} ({at}): Ray listens on every "
          f"interface, this node as {ray.util.get_node_ip_address()}", file=sys.stderr)


def tcmalloc(cfg: dict) -> dict:
    """LD_PRELOAD of tcmalloc (install.sh) for a local CPU cluster's processes, where installed. glibc's malloc
    maps every freed block over 32 MB back to the OS, so each SmolLM2 train step faulted in ~1M fresh pages:
    3.5 s a step with tcmalloc, 6-8 s without (docs/performance.md). Not the driver's, nor the agents'."""
    import ctypes.util
    import torch
    lib = None if cfg["ray_address"] or torch.cuda.is_available() else ctypes.util.find_library("tcmalloc_minimal")
    return {"LD_PRELOAD": " ".join(filter(None, [os.environ.get("LD_PRELOAD"), lib]))} if lib else {}


def run(cfg: dict) -> dict:
    """`run_tagged`, guarded (faults.guarded): SIGINT/SIGTERM raise `faults.Stopped`, and no
    process of the run or interrupted checkpoint outlives it, however it ends."""
    return faults.guarded(Path(cfg["output_dir"]), lambda: run_tagged(cfg))


def run_tagged(cfg: dict) -> dict:
    """Set up Ray, the engine and the trainer, run the loop, export, summarize."""
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    out = Path(cfg["output_dir"])
    if cfg["overwrite"]:
        logs.clear_records(cfg)
    out.mkdir(parents=True, exist_ok=True)
    if not cfg["eval_only"]:  # an eval of a finished run must not replace the run's config
        (out / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
    agent_cls = programs.agent_class(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    start = {"step": 0, "version": 0, "rows_started": 0}
    resume_from = logs.complete_checkpoints(out)[-1] if cfg["resume"] and logs.complete_checkpoints(out) else None
    start_ray(cfg)
    try:
        if cfg["agent_resources"] or cfg["server_host"]:   # programs elsewhere reach this node's Ray address
            if not any(n["Alive"] and all(n["Resources"].get(k, 0) >= v for k, v in cfg["agent_resources"].items())
                       for n in ray.nodes()):   # else its tasks would wait forever
                raise ValueError(f"--agent_resources {json.dumps(cfg['agent_resources'])}: no node of the Ray cluster "
                                 f"has them all (`ray start --resources`); it has {ray.cluster_resources()}")
            cfg["server_host"] = cfg["server_host"] or ray.util.get_node_ip_address()
        engines = None if cfg["replay_rollouts"] else start_engines(cfg)
        trainer = TrainerGroup(cfg)
        wait_ready(cfg, [*trainer.ready()] + ([a.warm_up.remote() for a in engines.actors] if engines else []))
        say_threads(cfg, trainer, engines)
        if engines is not None:
            asyncio.run(engines.connect(trainer))
        if resume_from is not None:
            start = json.loads((resume_from / "loop.json").read_text())
            ray.get(trainer.call("load_checkpoint", str(resume_from / "trainer")))
            logs.keep_metrics(out / "metrics.jsonl", start["step"])
            log.warning("resumed from %s (step %d)", resume_from, start["step"])
        if engines is not None and (resume_from is not None or cfg["lora_rank"]):
            # the checkpoint's weights; a LoRA engine's first adapter (every request names it)
            asyncio.run(engines.update_weights(trainer, start["version"]))
        setup_s = time.perf_counter() - t0

        if cfg["eval_only"]:
            scores = asyncio.run(evaluation.evaluate(cfg, engines, agent_cls, tokenizer,
                                                     evaluation.eval_rows(cfg, agent_cls)))
            print(json.dumps(scores))
            return scores
        metrics_file = logs.Sinks(cfg, append=resume_from is not None)  # metrics.jsonl + --logger backends
        bar = logs.progress(cfg, cfg["steps"], done=start["step"])

        def on_step(m: dict):
            metrics_file.log(m)
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward_mean']:.3f}", s_per_step=f"{m['step_s']:.2f}",
                            tok_per_s=f"{m['tokens_per_s']:.0f}", mismatch=f"{m.get('mismatch_k3', 0.0):.1e}")

        gc.freeze()  # start-up objects stay: a full collection would stall the rollouts
        try:
            history = asyncio.run(loop.train(cfg, engines, trainer, agent_cls, tokenizer, on_step, start))
        finally:  # a stopped run's records are closed too (W&B/MLflow runs finished, not left open)
            bar.close()
            metrics_file.close()
        faults.set_phase("export")
        final = ray.get(trainer.call("export", cfg["export_hf"])) if cfg["export_hf"] else None
        if engines is not None:
            engines.shutdown()
    except faults.RunFailed as e:
        e.log = out / "error.log"
        e.log.write_text(traceback.format_exc())
        raise
    finally:
        ray.shutdown()
    if history and not cfg.get("no_plot"):
        logs.plot([out], out / "metrics.png")
    summary = logs.summarize(history, setup_s, time.perf_counter() - t0, out, final)
    print(summary["text"], file=sys.stderr if cfg["quiet"] else sys.stdout)
    return summary


def say_threads(cfg: dict, trainer, engines) -> None:
    """Say on stderr the threads each trainer rank and CPU engine computes with (parallel.cpu_threads),
    and each engine's KV cache (generator.kv_cache_bytes)."""
    ranks = ray.get([w.torch_threads.remote() for w in trainer.workers])
    facts = ray.get([a.facts.remote() for a in engines.actors]) if engines else []
    cpu_engines = [t for t, _ in facts if t]
    how = ("async: trainer and engines compute at once, on shares of the cores" if cfg["async_depth"]
           else "on-policy: each phase takes the cores while the other waits")
    print(f"threads: trainer rank(s) {ranks} (torch)" + (f", engine(s) {cpu_engines} (OpenMP)" if cpu_engines else "")
          + f"; {how}; override with --train_threads / --engine_threads", file=sys.stderr)
    for i, (_, kv) in enumerate(facts):
        if kv:
            print(f"engine {i} KV cache: {kv['bytes'] / 2**30:.2f} GiB, {kv['sequences']} sequences of --max_len "
                  f"{cfg['max_len']} (the run keeps {kv['wanted']} in flight here"
                  + ("; capped at half the free memory" if kv["capped"] else "") + "); set it with --kv_cache_gb",
                  file=sys.stderr)


def wait_ready(cfg: dict, refs: list):
    """Wait for the actors' start-up (engines: ~15 s each on CPU) behind a progress bar."""
    with logs.progress(cfg, len(refs), "starting trainer ranks and engines", "actor") as bar:
        while refs:
            ready, refs = ray.wait(refs, num_returns=1)
            ray.get(ready)  # raises the actor's start-up error, if any
            bar.update(1)
