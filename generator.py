"""The rollout engines: vLLM, token ids in, token ids + sampling logprobs out.

`Generator` wraps one `vllm.v1.engine.async_llm.AsyncLLM`. It runs as a Ray actor (`start_engines` below wraps it with
`ray.remote`), serves many concurrent requests, and takes new weights from the trainer without restarting:

    ids, logprobs  <- generate(prompt_ids, sampling)        # token-exact
    update_weights(blob, version)                           # pause, reload, resume

Prompts go in as `TokensPrompt` ids and completions come back as ids with the logprob of each sampled token, so
nothing is ever re-tokenized. For a vision-language model the prompt also carries its images (one pad token per image;
vLLM expands it and returns the expanded ids: vision.py). Logprobs are vLLM's "processed" logprobs, log_softmax(logits
/ temperature), the same convention the trainer uses (`losses.token_logprobs`).

New weights come from the trainer by either path of `--weight_sync` (sync.py; the
engine's worker extension `sync.WeightReceiver` reloads them in place).

`Engines` is what the loop and the agents talk to: several `Generator` actors behind one client, sticky sessions (a
rollout's turns go to one engine, so its prefix cache is reused), least-loaded routing, one weight update for all.

Run the engine alone:  python -c "import generator; generator.smoke('MODEL_DIR')"
"""

import asyncio
import contextlib
import gc
import itertools
import multiprocessing
import os
import time
import traceback
from unittest import mock

import ray
import torch

import lora
import parallel

# --spec_decode, lossless: the target model verifies every draft token, and the logprobs are its own. ngram drafts
# from n-grams of the prompt (no extra weights); mtp is the checkpoint's own multi-token-prediction head.
SPEC_DECODE = {"ngram": {"prompt_lookup_max": 3, "prompt_lookup_min": 1}, "mtp": {}}

# Keys of the sampling dict an agent or the loop may set per request.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "seed", "ignore_eos",
                 "stop", "top_logprobs")


class Generator:
    """One vLLM engine. Methods are async so Ray runs it as an async actor."""

    def __init__(self, model: str, *, dtype: str = "float32", max_len: int = 512,
                 seed: int = 0, gpu_memory_utilization: float = 0.5,
                 prefix_caching: bool = True, enforce_eager: bool = True,
                 partial_rollout: bool = False, tp_size: int = 1, dp_size: int = 1,
                 expert_parallel: bool = False, spec_decode: str | None = None, spec_tokens: int = 3,
                 max_images: int = 8, trust_remote_code: bool = False, max_seqs: int = 1024, kv_seqs: int = 0,
                 kv_gb: float | None = None, cpu_slot: tuple[list[str], int] | None = None,
                 adapter: dict | None = None):
        self.threads = None  # the engine core's OpenMP threads on CPU (said at start-up)
        if cpu_slot is not None:  # our cores and threads, counted on our node, before vLLM starts
            os.environ.update(cpu_engine_env(*cpu_slot, tp_size=tp_size))
            self.threads = int(os.environ.get("OMP_NUM_THREADS", 0)) or None
            if enforce_eager:  # vLLM's sampler compiles a one-line count on the first request: 2.5 s of set-up
                # Read as the default when torch loads _dynamo, for every thread and the engine core; a
                # config assignment (if it is loaded already) holds only in this thread and a fork of it.
                os.environ["TORCH_COMPILE_DISABLE"] = "1"
                torch._dynamo.config.disable = True
        from transformers import AutoConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        vlm = hasattr(config, "vision_config")
        self.kv = {}  # --kv_cache_gb, or on CPU (vLLM-CPU's own default: a share of the machine) sized here
        if kv_gb or not torch.cuda.is_available() and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            import psutil
            here = cpu_slot[0].count(cpu_slot[0][cpu_slot[1]]) if cpu_slot else 1  # engines on this node
            self.kv = kv_cache_bytes(config.get_text_config(), dtype, max_len, min(kv_seqs or max_seqs, max_seqs),
                                     psutil.virtual_memory().available // here, kv_gb)

        args = AsyncEngineArgs(
            model=model, dtype=dtype, max_model_len=max_len, seed=seed,
            enforce_eager=enforce_eager, enable_prefix_caching=prefix_caching,
            gpu_memory_utilization=gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            worker_extension_cls="sync.WeightReceiver",
            tensor_parallel_size=tp_size, data_parallel_size=dp_size,
            # Workers as local processes on the actor's node, with the GPUs Ray gave this actor: inside
            # a placement group vLLM would otherwise pick its Ray executor and ask for GPUs again.
            distributed_executor_backend="mp" if tp_size > 1 else None,
            enable_expert_parallel=expert_parallel,
            max_num_seqs=max_seqs, max_num_batched_tokens=max(8192, max_len),
            **({"kv_cache_memory_bytes": self.kv["bytes"]} if self.kv else {}),
            disable_log_stats=True,   # vLLM's per-step stats and Prometheus loggers: nothing here reads them
            speculative_config=spec_decode and {"method": spec_decode, "num_speculative_tokens": spec_tokens,
                                                **SPEC_DECODE[spec_decode]},
            trust_remote_code=trust_remote_code,
            # LoRA: one adapter slot, swapped in place at each update (lora.py)
            **({"enable_lora": True, "max_loras": 1,
                "max_lora_rank": next(k for k in lora.ENGINE_RANKS if k >= adapter["r"])} if adapter else {}),
            # Images per request (all turns of a trajectory); no video input.
            **({"limit_mm_per_prompt": {"image": max_images, "video": 0}} if vlm else {}),
        )
        # A Ray actor's vLLM spawns its engine core: a fresh interpreter importing vLLM again (~11 s,
        # no pages shared). On CPU with one rank we fork it, as vLLM does outside Ray.
        with forked_engine_core(cpu_slot is not None and tp_size == 1):
            self.engine = AsyncLLM.from_engine_args(args)
        # A full collection walks vLLM's and torch's ~10^6 start-up objects: a 0.5 s stall of every
        # request in flight, every few hundred rollouts. They live as long as the engine.
        gc.freeze()
        self.partial_rollout = partial_rollout
        self.adapter = adapter     # LoRA: the adapter's peft config; from the first update every request names it
        self.lora_request = None
        self.version = 0          # policy version of the weights now loaded
        self._ids = itertools.count()
        self.busy_s = 0.0         # wall time with at least one request running
        self._running = 0
        self._busy_since = 0.0
        self._requests: dict[str, asyncio.Future] = {}  # generate_batch's requests in flight

    async def generate_batch(self, requests: list[tuple]):
        """Many `generate` calls in one Ray call (one per request costs the driver ~1 ms: 0.5 s
        of a 512-rollout step). `requests` are (request id, prompt_ids, sampling, images); yields
        lists of (request id, result, error text) as requests finish; `cancel(ids)` stops some.

        Requests with the same prompt and sampling (a group's first turn) become one vLLM request
        for n samples: one prefill instead of n, each sample with its own tokens, logprobs and
        versions (async default task: 0.27-0.37 s/step against 0.42-0.45 unmerged, the engine
        actor's CPU halved). Not with a seed, images or greedy sampling."""
        self._check_adapter()
        same: dict[tuple, tuple] = {}
        for rid, prompt, sampling, images in requests:
            key = ((rid,) if images or "seed" in sampling or sampling.get("temperature", 1.0) < 1e-5  # vLLM: greedy is n=1
                   else (tuple(prompt), repr(sorted(sampling.items()))))
            same.setdefault(key, (prompt, sampling, images, []))[3].append(rid)
        tasks = {asyncio.ensure_future(self._generate(p, s, im, len(rids))): rids for p, s, im, rids in same.values()}
        self._requests.update({rid: task for task, rids in tasks.items() for rid in rids})
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                out = []
                for task in done:
                    for k, rid in enumerate(tasks[task]):
                        self._requests.pop(rid, None)
                        if task.cancelled():
                            out.append((rid, None, "cancelled"))
                        elif task.exception() is not None:
                            out.append((rid, None, "".join(traceback.format_exception(task.exception()))))
                        else:
                            out.append((rid, task.result()[k], None))
                yield out
        finally:
            for task in pending:
                task.cancel()

    def cancel(self, request_ids: list[str]):
        for rid in request_ids:
            task = self._requests.pop(rid, None)
            if task is not None and task not in self._requests.values():  # no other sample wants it
                task.cancel()  # vLLM aborts a cancelled generate

    async def generate(self, prompt_ids: list[int], sampling: dict, images: list | None = None) -> dict:
        """Sample one completion (`_generate` says what comes back)."""
        self._check_adapter()
        return (await self._generate(prompt_ids, sampling, images, 1))[0]

    def _check_adapter(self):
        if self.adapter and self.lora_request is None:   # it would stay on the base, its tokens labelled later versions
            raise RuntimeError("a LoRA engine's request before its first adapter is loaded (launch loads it first)")

    async def _generate(self, prompt_ids: list[int], sampling: dict, images: list | None, n: int) -> list[dict]:
        """Sample n completions of one prompt. Each has token_ids, logprobs and versions (one per token: the policy
        version that sampled it), version (of the first token), finish_reason and stop_reason (the stop string that
        ended it, else None).

        `stop` strings end generation at the first sampled token that completes one;
        that token is the last of token_ids (vLLM keeps it and drops any after it).
        `top_logprobs: k` adds, per token, the k likeliest [token id, logprob] pairs.

        With `images` (PIL images, in prompt order) `prompt_ids` carry one image pad
        token per image and vLLM expands each into the image's patch tokens: the result
        then also has `prompt_ids`, the expanded ids the model saw (vision.py)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        unknown = set(sampling) - set(SAMPLING_KEYS)
        if unknown:
            raise ValueError(f"unknown sampling keys {sorted(unknown)}; allowed: {SAMPLING_KEYS}")
        sampling = dict(sampling)
        k = sampling.pop("top_logprobs", 0) or 0
        # Stop strings need vLLM's detokenizer (text is decoded for matching only; ids stay as sampled).
        # skip_clone: these params are built for this one request and never shared, so vLLM's
        # per-request deep copy is not needed (it showed in a profile; no step-time change measured).
        params = SamplingParams(**sampling, n=n, logprobs=k, detokenize=bool(sampling.get("stop")),
                                skip_special_tokens=False, output_kind=RequestOutputKind.FINAL_ONLY,
                                skip_clone=True)
        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
        if images:
            import vision
            prompt["multi_modal_data"] = {"image": [vision.load_image(i) for i in images]}
        results = [{"token_ids": [], "logprobs": [], "versions": [], "finish_reason": None, "stop_reason": None,
                    **({"top_logprobs": []} if k else {})} for _ in range(n)]
        with self._busy():
            async for out in self.engine.generate(prompt, params, request_id=f"r{next(self._ids)}",
                                                  lora_request=self.lora_request):
                for comp in out.outputs:
                    r, new = results[comp.index], list(comp.token_ids)
                    r["token_ids"] += new
                    r["logprobs"] += [step[tok].logprob for step, tok in zip(comp.logprobs, new)]
                    # With partial rollout a request can outlive a weight update: vLLM's engine core
                    # labels every step with the weights it ran (update_weight_version), as spans.
                    r["versions"] += [int(_VERSION.get(v.version, v.version)) for v in comp.weight_versions or ()
                                      for _ in range(v.start, v.end)]
                    if k:  # the k likeliest (the sampled token may be extra)
                        r["top_logprobs"] += [sorted(([t, lp.logprob] for t, lp in step.items()),
                                                     key=lambda x: -x[1])[:k] for step in comp.logprobs]
                    r["finish_reason"] = comp.finish_reason
                    r["stop_reason"] = comp.stop_reason if isinstance(comp.stop_reason, str) else None
                    if images:
                        r["prompt_ids"] = list(out.prompt_token_ids)
        for r in results:
            if len(r["versions"]) != len(r["token_ids"]):
                raise RuntimeError(f"vLLM's weight-version spans cover {len(r['versions'])} of "
                                   f"{len(r['token_ids'])} sampled tokens")
            r["version"] = r["versions"][0] if r["versions"] else self.version
        return results

    async def join_weight_sync(self, host: str, port: int, first_rank: int, world: int):
        """Join the trainer's broadcast group (`--weight_sync broadcast`); blocks until all joined."""
        await self.engine.collective_rpc("molt_join_weight_sync", args=(host, port, first_rank, world))

    async def update_weights(self, blob: bytes | None, version: int) -> dict:
        """Load new weights into the running engine: from `blob` (safetensors bytes), or, when `blob` is None, from
        the trainer's broadcast. Returns the seconds taken and the engine parameters the update did not cover
        (`missing`, per worker). Without partial rollout, in-flight requests finish on the old weights first (pause
        mode "wait"): every request has one version. With it, they are frozen ("keep"), their KV recomputed under the
        new weights on resume, and their later tokens carry the new version."""
        t0 = time.perf_counter()
        await self.engine.pause_generation(mode="keep" if self.partial_rollout else "wait", clear_cache=True)
        try:
            missing = await (self.engine.collective_rpc("molt_receive_weights", args=(self.adapter,)) if blob is None
                             else self.engine.collective_rpc("molt_load_weights", args=(blob, self.adapter)))
            await self.engine.reset_prefix_cache()  # no KV from old weights survives
            await self.engine.update_weight_version(str(version))   # labels the steps from here on
            if self.adapter:  # the slot holds an adapter now (the path is never read: lora.load_into_engine)
                from vllm.lora.request import LoRARequest
                self.lora_request = LoRARequest("molt", lora.ADAPTER_ID, "in-memory")
            self.version = version
        finally:
            await self.engine.resume_generation()
        return {"seconds": time.perf_counter() - t0, "missing": sorted({n for names in missing for n in names})}

    def get_version(self) -> int:
        return self.version

    async def warm_up(self) -> int:
        """One short request at start-up: a fresh engine's first forward (seconds) is not a rollout's --agent_timeout."""
        await self._generate([0, 1, 2], {"max_tokens": 2, "temperature": 1.0}, None, 1)   # a LoRA engine's too
        return self.version

    def facts(self) -> tuple[int | None, dict]:
        """For the start-up lines: OpenMP threads on CPU (else None), the KV cache sized here ({} if vLLM's)."""
        return self.threads, self.kv

    def take_busy_seconds(self) -> float:
        """Seconds with requests in flight since the last call (for idle metrics)."""
        now = time.perf_counter()
        busy = self.busy_s + (now - self._busy_since if self._running else 0.0)
        self.busy_s, self._busy_since = 0.0, now
        return busy

    @contextlib.contextmanager
    def _busy(self):
        """Around each request: busy_s counts the wall time with at least one request running."""
        if self._running == 0:
            self._busy_since = time.perf_counter()
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            if self._running == 0:
                self.busy_s += time.perf_counter() - self._busy_since

    def shutdown(self):
        self.engine.shutdown()
        # vLLM's __del__ shuts down a second time; at interpreter exit that fails
        # noisily because module globals are gone. Once is enough.
        self.engine.shutdown = lambda *args, **kwargs: None


def forked_engine_core(fork: bool):
    """While in effect, vLLM forks its engine-core process (as it does outside Ray) instead of spawning it."""
    import vllm.v1.engine.utils as engine_utils
    fork_context = lambda: multiprocessing.get_context("fork")
    return mock.patch.object(engine_utils, "get_mp_context", fork_context) if fork else contextlib.nullcontext()


_VERSION = {"default": 0}   # vLLM's label of the weights an engine started with; ours are str(version)


class EngineError(RuntimeError):
    """A request failed inside an engine (the engine's traceback is the message)."""


BATCH_WINDOW_S = 0.002  # requests that arrive this close together travel in one Ray call


class Engines:
    """The vLLM engine actors behind one client. A rollout gets a sticky `session()`: all its turns go to one engine,
    so its prefix cache is reused; new sessions go to the engine with the fewest tokens in flight. Requests to one
    engine within BATCH_WINDOW_S go as one streaming Ray call (`Generator.generate_batch`), each answered as soon as
    it finishes. Weight updates reach all, through Ray (`broadcast=False`) or the trainer's broadcast group (`connect`
    first)."""

    def __init__(self, actors: list, check_weight_sync: bool = False, broadcast: bool = False,
                 workers_per_engine: int = 1):
        self.actors, self.check, self.broadcast = actors, check_weight_sync, broadcast
        self.workers_per_engine = workers_per_engine
        self.load = [0] * len(actors)  # prompt + max new tokens of requests in flight
        self._ids = itertools.count()
        self._queued: dict[tuple, list] = {}       # (event loop, engine) -> requests not sent yet
        self._waiting: dict[str, asyncio.Future] = {}
        self._streams: set[asyncio.Task] = set()
        self._version: int | None = None           # the engines' policy version, once asked

    def session(self):
        chosen: list[int] = []

        async def generate(prompt_ids: list[int], sampling: dict, images: list | None = None) -> dict:
            if not chosen:
                chosen.append(self.load.index(min(self.load)))
            i, cost = chosen[0], len(prompt_ids) + sampling.get("max_tokens", 0)
            self.load[i] += cost
            loop, rid = asyncio.get_running_loop(), f"q{next(self._ids)}"
            request = (rid, prompt_ids, sampling, images)
            queue = self._queued.setdefault((loop, i), [])
            if not queue:
                loop.call_later(BATCH_WINDOW_S, self._send, loop, i)
            queue.append(request)
            self._waiting[rid] = future = loop.create_future()
            try:
                return await future
            except asyncio.CancelledError:  # a rollout timed out or was cancelled: stop the request
                self._waiting.pop(rid, None)
                unsent = self._queued.get((loop, i), [])
                if request in unsent:
                    unsent.remove(request)
                else:
                    self.actors[i].cancel.remote([rid])
                raise
            finally:
                self.load[i] -= cost
        return generate

    def _send(self, loop, i: int):
        batch = self._queued.pop((loop, i), [])
        if batch:
            task = loop.create_task(self._stream(i, batch))
            self._streams.add(task)
            task.add_done_callback(self._streams.discard)

    async def _stream(self, i: int, batch: list[tuple]):
        try:
            async for ref in self.actors[i].generate_batch.options(num_returns="streaming").remote(batch):
                for rid, result, error in await ref:
                    future = self._waiting.pop(rid, None)
                    if future is not None and not future.done():
                        future.set_result(result) if error is None else future.set_exception(EngineError(error))
        except Exception as e:  # the engine actor died: every request of the batch fails with it
            error = e
        else:
            error = EngineError("the engine ended a batch without answering every request")
        for rid, *_ in batch:
            future = self._waiting.pop(rid, None)
            if future is not None and not future.done():
                future.set_exception(error)

    async def version(self) -> int:
        """The engines' policy version: asked once, then known from `update_weights` (not a Ray call per group)."""
        if self._version is None:
            self._version = await self.actors[0].get_version.remote()
        return self._version

    async def connect(self, trainer):
        """Form the broadcast group: the trainer's rank 0 and every engine worker."""
        if not self.broadcast:
            return
        host, port = await trainer.call("weight_sync_address")
        world = 1 + len(self.actors) * self.workers_per_engine
        await all_or_first_error([trainer.call("join_weight_sync", host, port, world),
                                  *[a.join_weight_sync.remote(host, port, 1 + i * self.workers_per_engine, world)
                                    for i, a in enumerate(self.actors)]])

    async def update_weights(self, trainer, version: int) -> float:
        """Load the trainer's (a `TrainerGroup`'s) weights into every engine; returns seconds."""
        if self.broadcast:  # every trainer rank gathers; rank 0 sends
            results = (await all_or_first_error([trainer.call("broadcast_weights"),
                                                 *[a.update_weights.remote(None, version) for a in self.actors]]))[1:]
        else:
            blob = trainer.weights_blob()  # a Ray ref: fetched once per node
            results = await all_or_first_error([a.update_weights.remote(blob, version) for a in self.actors])
        missing = sorted({n for r in results for n in r["missing"]})
        if missing and self.check:
            raise RuntimeError(f"--check_weight_sync: the weight update did not cover {len(missing)} engine "
                               f"parameters: {', '.join(missing[:20])}")
        self._version = version
        return max(r["seconds"] for r in results)

    async def busy_seconds(self) -> float:
        busy = await asyncio.gather(*[a.take_busy_seconds.remote() for a in self.actors])
        return sum(busy) / len(busy)

    def shutdown(self):
        ray.get([a.shutdown.remote() for a in self.actors])

    @staticmethod
    def is_engine_error(e: Exception) -> bool:
        return isinstance(e, (ray.exceptions.RayError, EngineError))


async def all_or_first_error(jobs: list) -> list:
    """Await every job (Ray refs, coroutines); the first failure raises at once. The peers of a
    broadcast whose trainer or engine died would otherwise wait out the group's timeout."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for task in tasks:
        if task.done() and task.exception() is not None:
            for other in tasks:
                other.cancel()
            raise task.exception()
    return [task.result() for task in tasks]


def start_engines(cfg: dict) -> Engines:
    """--num_engines Generator actors, one Ray bundle each (one CPU, and its --engine_tp_size x
    --engine_dp_size GPUs on one node where the cluster has GPUs, plus --engine_resources), in
    a placement group of their own: engine GPUs are never the trainer's. On CPU each engine's
    threads and cores come from its node's (cpu_engine_env)."""
    n, gpus = cfg["num_engines"], parallel.gpu_shares(cfg, ray.cluster_resources().get("GPU", 0))[1]
    bundle = {"CPU": 1, **({"GPU": gpus} if gpus else {}), **(cfg.get("engine_resources") or {})}
    pg = parallel.reserve([bundle] * n, "PACK", f"{n} engine(s)")
    # Which node holds each engine, from the placement itself: a task asking each node (a worker
    # to start and torch to import, ~4 s before the first engine could start) is not needed.
    nodes = [ray.util.placement_group_table(pg)["bundles_to_node_id"][i] for i in range(n)]
    trainers_here = 0 if cfg.get("replay_rollouts") or not parallel.one_node() else cfg["train_workers"]
    eager = cfg.get("enforce_eager")
    eager = not gpus if eager is None else eager  # CUDA graphs on GPU; on CPU compiling only slows start-up
    remote = ray.remote(Generator)
    actors = [remote.options(num_cpus=1, num_gpus=gpus, max_concurrency=10_000, **parallel.in_bundle(pg, i)).remote(
        cfg["model"], dtype=cfg["engine_dtype"] or cfg["param_dtype"], max_len=cfg["max_len"],
        seed=cfg["seed"] + i, gpu_memory_utilization=cfg["gpu_memory_utilization"],
        partial_rollout=cfg["partial_rollout"], prefix_caching=cfg["prefix_caching"], enforce_eager=eager,
        tp_size=cfg["engine_tp_size"], dp_size=cfg["engine_dp_size"], expert_parallel=cfg["engine_ep"],
        spec_decode=cfg["spec_decode"], spec_tokens=cfg["spec_tokens"],
        max_images=cfg["max_images_per_prompt"], trust_remote_code=cfg["trust_remote_code"],
        max_seqs=cfg["engine_max_seqs"], kv_seqs=-(-cfg.get("rollout_in_flight", 0) * cfg["samples_per_prompt"] // n),
        kv_gb=cfg.get("kv_cache_gb"),
        cpu_slot=None if gpus else (nodes, i, trainers_here, cfg["async_depth"] > 0, cfg.get("engine_threads")),
        adapter=lora.peft_config(cfg)) for i in range(n)]
    return Engines(actors, cfg["check_weight_sync"], broadcast=cfg["weight_sync"] == "broadcast",
                   workers_per_engine=cfg["engine_tp_size"] * cfg["engine_dp_size"])


def kv_cache_bytes(text, dtype: str, max_len: int, seqs: int, available: int, gb: float | None = None) -> dict:
    """An engine's KV cache: `gb` (--kv_cache_gb) if given, else the KV of the `seqs` full-length
    sequences the run keeps in flight on it, within half of this engine's share of the free
    memory, and never under one sequence (vLLM refuses to start below it). `text`: the model's
    text config (one without num_key_value_heads has one KV head per attention head)."""
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    one = max_len * 2 * text.num_hidden_layers * kv_heads * head_dim * (4 if dtype == "float32" else 2)
    size = int(gb * 2**30) if gb else max(one, min(seqs * one, available // 2))
    return {"bytes": size, "sequences": size // one, "wanted": seqs, "capped": not gb and size < seqs * one}


def cpu_engine_env(nodes: list[str], i: int, trainers: int, overlap: bool, threads: int | None = None,
                   cores: int | None = None, tp_size: int = 1) -> dict:
    """The environment of CPU engine `i`: `nodes` says where each engine runs, `trainers` the ranks
    on engine i's node, `overlap` whether they train while it generates, `threads` --engine_threads,
    `cores` engine i's node's (counted there). The count is parallel.cpu_threads'; engines sharing a
    node bind to cores of their own ("lo-hi", round-robin past the cores); one alone is not bound.

    One rank runs in vLLM's engine-core process (uni executor) with our OpenMP threads: vLLM's
    multiprocess executor busy-waits between worker and scheduler (sched_yield 1 s per message),
    taking cores from everything else (0.9 -> 0.65 s per default step on 2 cores). With tensor
    parallelism vLLM binds each rank itself (VLLM_CPU_OMP_THREADS_BIND; "auto": all cores less one per rank)."""
    cores = cores or parallel.node_cores()
    peers = [j for j, m in enumerate(nodes) if m == nodes[i]]
    share = parallel.cpu_threads(cores, trainers, len(peers), overlap, engine_threads=threads)[1]
    lo = peers.index(i) * share % cores
    if tp_size > 1:
        return {} if len(peers) == 1 else {"VLLM_CPU_OMP_THREADS_BIND": f"{lo}-{min(lo + share, cores) - 1}"}
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(share)}
    if len(peers) > 1:
        env.update(OMP_PLACES="{" + ",".join(str(c % cores) for c in range(lo, lo + share)) + "}", OMP_PROC_BIND="true")
    return env


def smoke(model: str):
    """Start an engine on MODEL and sample once (a quick installation check)."""
    async def go():
        gen = Generator(model)
        out = await gen.generate([0, 1, 2], {"max_tokens": 8, "temperature": 1.0})
        print(out)
        gen.shutdown()
    asyncio.run(go())
