"""The agent contract: what a user writes, and how it becomes token-exact training data.

A user writes ordinary Python:

    class MyEnv(Env):                      # the framework runs the LLM loop
        async def step(self, state):       # state.action = the model's reply text
            return Result(reward=float(state.action == state.label))

`run_env` renders the first prompt with the model's chat template, tokenizes it once, asks the engine for a
completion as token ids, calls `step`, appends the observation as non-trainable tokens rendered by the same
template, and repeats until the episode ends. It returns a `Trajectory` (trajectory.py, with the rendering and
encoding both agent runners and the server share): the token ids the engine actually saw and sampled, a mask of
the policy's own tokens, their sampling logprobs and policy versions, and the reward. The sampled text is
decoded for the agent to read; it is never encoded again.

Or the user owns the loop and talks to the policy with a stock SDK:

    class MyAgent(ChatAgent):
        async def run(self, ctx):
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
            # or anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key)
            reply = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
            return Result(reward=...)

`run_chat_agent` opens a session on a `ChatServer` (server.py: the loopback OpenAI/Anthropic HTTP server and its
token-exact trace) and runs the agent; all requests of one `run` are one rollout, cut into segments where the
conversation rewrites its prefix, and the segments share the rollout's reward.

Or the agent is a program in any language (`--agent_cmd`, `Program`; docs/programs.md): each rollout runs it as
a process that gets the server's URLs and the rollout's key in OPENAI_*/ANTHROPIC_* variables, the row as JSON on
stdin, and prints its reward as a JSON object on the last line of stdout.
Or its tools come from MCP servers (`--mcp_server`, `MCPAgent`): a built-in ChatAgent runs their calls.

Agents are loaded with `agent_class(cfg)` (a `Program`, or the one class of `load_agent(path)`); prompts come from
the agent's `prompts(seed)` or from a `--dataset` file (data.py).
"""

import asyncio
import concurrent.futures
import contextlib
import copy
import functools
import importlib.util
import inspect
import json
import math
import os
import shlex
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterator

import sandbox
import tasks
import vision
from trajectory import (DropRollout, Generate, Trajectory, decode_reply, delta_ids, encode, prompt_messages, render,
                        sample, with_images)

if TYPE_CHECKING:
    from server import ChatServer


@dataclass
class Result:
    """What an agent returns for one step (Env) or one episode (ChatAgent)."""
    reward: float
    observation: str | None = None   # text shown to the model next turn (Env)
    terminated: bool = True          # the episode is over
    truncated: bool = False          # cut short (budget, turn limit)
    info: dict = field(default_factory=dict)   # scalar diagnostics, logged as means
    score: float | None = None       # for dashboards/filtering; defaults to reward
    sampling_params: dict | None = None        # next turn: max_tokens, stop_token_ids, seed (not temperature/top_p/top_k)
    images: list | None = None       # shown with the observation next turn (Env; VLMs): paths, data URIs, PIL
    state_key: str | None = None     # the state reached, for --estimator gigpo (default: the observation)
    context: list[dict] | None = None  # Env: the conversation rewritten; the observation follows it in a new segment


@dataclass
class State:
    """What `Env.step` sees."""
    prompt: Any                      # the dataset row's prompt (text or messages)
    label: Any                       # the dataset row's label (anything)
    action: str                      # the model's reply this turn, decoded
    observation: str | None          # the last observation shown (None on turn 0)
    messages: list[dict]             # the conversation so far, reply included
    turn: int
    sampling_params: dict
    row: dict                        # the whole dataset row
    finish_reason: str = "stop"      # "stop" (the model ended its turn) or "length" (cut off)


class _Agent:
    @classmethod
    def prompts(cls, seed: int) -> Iterator[dict]:
        """Built-in prompt source: rows {"prompt", "label"} (a finite one is an epoch, asked again with seed + 1)."""
        raise ValueError(f"{cls.__name__} has no built-in prompts: pass --dataset FILE.jsonl")


class Env(_Agent):
    """Subclass and implement `step`. One instance per rollout."""
    max_turns: int = 1

    async def reset(self, row: dict) -> None:
        """Called once before the first turn."""

    async def step(self, state: State) -> Result:
        raise NotImplementedError

    def fork(self) -> "Env":
        """A copy that continues independently from this state (--branches); override if deepcopy cannot."""
        return copy.deepcopy(self)


BRANCH_GRACE = 1.0   # seconds a branch point's deadline keeps before its caller's, to hand back what finished
Call = Callable[..., Awaitable[Any]]        # (fn, *args) -> what fn(*args) returns, run where agent code runs


SUMMARY_REQUEST = ("Your context is full. Write a summary of what you still need from this conversation: it replaces "
                   "the conversation, and the task goes on after it.")


def rewrite_context(policy: str, keep: int, messages: list[dict], prompt: int) -> list[dict]:
    """--context window / drop_tool_output: the row's first `prompt` messages, then the last `keep` replies and the
    observations between them, or every reply with a placeholder for each observation (`messages` ends with a reply)."""
    head, rest = messages[:prompt], messages[prompt:]
    if policy == "window":
        return head + rest[-(2 * keep - 1):]
    return head + [m if m["role"] == "assistant" else {**m, "content": "[output dropped]"} for m in rest]


async def run_env(env: Env, row: dict, generate: Generate, tokenizer, *,
                  sampling: dict, max_len: int, max_turns: int | None = None,
                  image_tokens=None, max_images: int | None = None, call: Call | None = None,
                  branch_turns: tuple = (), branches: int = 1, deadline: float | None = None,
                  context: str = "none", context_turns: int = 2) -> Trajectory | list[Trajectory]:
    """Run one episode of `env` on `row`; returns its token-exact trajectory. For a vision-language model
    `image_tokens` (vision.ImageTokens) places the row's images (row["images"]) and the observations'
    (Result.images); a trajectory shows at most `max_images` (the engine's per-request limit): an observation
    over it ends the episode. `call(fn, *args)` runs the env's own code (reset, step): the loop passes one that
    runs it on an agent thread (faults.AgentThreads), so a blocking step cannot freeze the loop.
    `branches` M > 1: forks (`Env.fork`) before each of `branch_turns` into M continuations; returns the leaves,
    shared tokens trained in the first (the others' `parent`), failed ones left out (info["branches_dropped"]), and so
    are those still running at `deadline` (the loop's clock; a nested branch point's is BRANCH_GRACE s earlier).
    A rewrite (`Result.context`, or the `context` policy before an overflow) ends the segment, the next starts from the
    rewritten messages: returns the segments then (`_share_reward`); a "summarize" summary is a turn (reward 0)."""
    call = call or _call_here
    images = image_tokens.uris(row.get("images")) if image_tokens else _no_images(row.get("images"))
    messages = with_images(prompt_messages(row["prompt"]), images)
    await call(env.reset, row)
    traj = Trajectory(tokens=[], mask=[], logprobs=[], versions=[], reward=0.0, images=images, states=[""])
    prompt = encode(tokenizer, render(tokenizer, messages, add_generation_prompt=True))
    traj.add(image_tokens.expand(prompt, images) if images else prompt, False)
    turns, first_messages, sealed = max_turns or env.max_turns, len(messages), []
    if len(traj.tokens) >= max_len:   # no room for a reply: not a row to train
        raise DropRollout("prompt_too_long", f"the prompt is {len(traj.tokens)} tokens, no room for a reply "
                          f"within --max_len {max_len}")

    async def reply(traj: Trajectory, params: dict, budget: int) -> dict:
        out = await sample(generate, traj.tokens, traj.images, {**params, "max_tokens": min(params["max_tokens"], budget)},
                           image_tokens)
        traj.add(out["token_ids"], True, out["logprobs"], out.get("versions", out["version"]))
        traj.finish_reasons.append(out["finish_reason"])
        traj.info["episode_tokens"] = traj.info.get("episode_tokens", len(prompt)) + len(out["token_ids"])
        return out

    async def summarize(traj: Trajectory, messages: list, out: dict, params: dict) -> list | None:
        request = delta_ids(tokenizer, messages, out["token_ids"], [{"role": "user", "content": SUMMARY_REQUEST}])
        if len(traj.tokens) + len(request) >= max_len:
            return None
        traj.add(request, False)
        traj.states.append("summary")
        out = await reply(traj, params, max_len - len(traj.tokens))
        traj.turn_rewards.append(0.0)
        return messages[:first_messages] + [{"role": "assistant", "content": decode_reply(tokenizer, out["token_ids"])}]

    async def play(env: Env, traj: Trajectory, messages: list, params: dict, observation, first: int, until) -> list:
        for turn in range(first, turns):
            if turn in branch_turns and turn > first and branches > 1:
                return await fork([(env, traj, messages, params, observation)] + [
                    (env.fork(), *copy.deepcopy((traj, messages, params, observation))) for _ in range(branches - 1)],
                    turn, len(traj.tokens), until)
            budget = max_len - len(traj.tokens)
            if budget <= 0:
                traj.info["truncated"] = 1.0
                break
            out = await reply(traj, params, budget)
            action = decode_reply(tokenizer, out["token_ids"])
            messages.append({"role": "assistant", "content": action})
            result = await call(env.step, State(prompt=row["prompt"], label=row.get("label"), action=action,
                                                observation=observation, messages=messages, turn=turn,
                                                sampling_params=params, row=row, finish_reason=out["finish_reason"]))
            reward = float(result.reward)
            if not math.isfinite(reward):
                raise ValueError(f"agent returned a non-finite reward {result.reward!r}")
            traj.reward += reward
            traj.turn_rewards.append(reward)
            traj.score += reward if result.score is None else float(result.score)
            traj.info.update({k: float(v) for k, v in result.info.items()})
            if result.terminated or result.truncated or turn == turns - 1:
                break
            observation = result.observation or ""
            new_images = image_tokens.uris(result.images) if image_tokens else _no_images(result.images)
            content = with_images([{"role": "user", "content": observation}], new_images)[0]["content"]
            obs_ids = delta_ids(tokenizer, messages, out["token_ids"], [{"role": "user", "content": content}])
            obs_ids = image_tokens.expand(obs_ids, new_images) if new_images else obs_ids
            traj.info["episode_tokens"] += len(obs_ids)
            rewritten = result.context   # a policy's rewrite: before the next turn would overflow (summarize: its own too)
            if rewritten is None and context != "none" and (
                    len(traj.tokens) + len(obs_ids) + params["max_tokens"] * (1 + (context == "summarize")) > max_len):
                rewritten = (await summarize(traj, messages, out, params) if context == "summarize"
                             else rewrite_context(context, context_turns, messages, first_messages))
            if rewritten is not None:   # the next turn starts a segment from the rewritten messages
                if branches > 1 or traj.images or new_images:
                    raise ValueError("a context rewrite (Result.context or --context) works without --branches and images")
                messages = list(rewritten)
                new = encode(tokenizer, render(tokenizer, messages + [{"role": "user", "content": content}], True))
                traj.info["rewrite_dropped_tokens"] = traj.info.get("rewrite_dropped_tokens", 0.0) + max(
                    len(traj.tokens) + len(obs_ids) - len(new), 0)
                obs_ids = new
            if ((0 if rewritten is not None else len(traj.tokens)) + len(obs_ids) >= max_len  # whole observations only
                    or (max_images is not None and len(traj.images) + len(new_images) > max_images)):
                traj.info["truncated"] = 1.0
                break
            if rewritten is not None:
                sealed.append(traj)
                traj = Trajectory(tokens=[], mask=[], logprobs=[], versions=[], reward=0.0, info=traj.info, states=[])
            traj.add(obs_ids, False)
            traj.images += new_images
            traj.states.append(observation if result.state_key is None else str(result.state_key))
            messages.append({"role": "user", "content": content})
            params = {**params, **_override(params, result.sampling_params)}
        traj.info["turns"] = float(sum(len(t.turn_rewards) for t in sealed + [traj]))
        if context == "none" and not sealed:   # reported where rewrites can cut the episode
            traj.info.pop("episode_tokens", None)
        return sealed + [traj]

    async def fork(episodes: list, turn: int, shared: int, until: float | None) -> list[Trajectory]:
        tasks = [asyncio.ensure_future(play(*e, turn, until and until - BRANCH_GRACE)) for e in episodes]
        _, late = await asyncio.wait(tasks, timeout=until and max(until - asyncio.get_running_loop().time(), 0.0))
        for t in late:   # a hanging branch: left out, the others kept
            t.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        done = [DropRollout("timeout", "ran past --agent_timeout") if t in late else t.exception() or t.result()
                for t in tasks]
        failed = [e for e in done if isinstance(e, BaseException)]
        if len(failed) == len(done):
            raise failed[0]
        leaves = [t for d in done if not isinstance(d, BaseException) for t in d]
        for t in leaves:
            t.info["branches_dropped"] = t.info.get("branches_dropped", 0.0) + len(failed)
        for t in leaves[1:]:      # the shared prefix is trained once, in the first leaf
            t.mask[:shared], t.logprobs[:shared], t.versions[:shared] = [0] * shared, [0.0] * shared, [-1] * shared
            if t.parent is None:
                t.parent, t.branch_turn = leaves[0], turn
        return leaves

    leaves = await play(env, traj, messages, dict(sampling), None, 0, deadline and deadline - BRANCH_GRACE)
    if branches <= 1:
        return leaves[0] if len(leaves) == 1 else _share_reward(leaves)
    for i, t in enumerate(leaves):   # local ids (a parent comes before its branches); the pool offsets them
        t.rollout_id, t.parent = i, t.parent and t.parent.rollout_id
    return leaves


def _share_reward(segments: list[Trajectory]) -> list[Trajectory]:
    """The credit rule (docs/algorithms.md): every segment carries the rollout's reward and score, and a segment's last
    turn also the rewards of the segments after it, so each turn's reward-to-go is the whole rollout's."""
    later = 0.0
    for seg in reversed(segments):
        own = sum(seg.turn_rewards)
        seg.turn_rewards[-1] += later
        later += own
    score = sum(seg.score for seg in segments)
    for seg in segments:
        seg.reward, seg.score = later, score
    return segments


# What an Env's Result.sampling_params may set for its next turn, and the values each takes.
OVERRIDES: dict[str, Callable[[Any], bool]] = {
    "max_tokens": lambda v: type(v) is int and v > 0,
    "stop_token_ids": lambda v: isinstance(v, list) and all(type(t) is int and t >= 0 for t in v),
    "seed": lambda v: v is None or type(v) is int,
    "ignore_eos": lambda v: isinstance(v, bool),
    "stop": lambda v: isinstance(v, list) and all(isinstance(s, str) and s for s in v),
}


def _override(params: dict, new: dict | None) -> dict:
    """An Env's sampling override for its next turn, checked here: a bad one drops the rollout
    (`dropped/sampling_params`) before the engine sees it. The trainer scores every token with the run's
    --temperature and the full softmax, so temperature/top_p/top_k may only repeat the run's values."""
    new, run = {} if new is None else new, {"top_p": 1.0, "top_k": -1, **params}
    bad = {k: v for k, v in new.items() if not (OVERRIDES[k](v) if k in OVERRIDES else k in run and v == run[k])} \
        if isinstance(new, dict) else new
    if bad:
        raise DropRollout("sampling_params", f"Result.sampling_params {bad!r} refused: a dict that may set "
                          f"{', '.join(OVERRIDES)} (max_tokens a positive int, stop a list of strings), not the "
                          "sampling distribution (set --temperature / --top_p for the whole run)")
    return new


async def _call_here(fn: Callable, *args) -> Any:
    """Run agent code in this event loop (tests; the loop runs it on agent threads)."""
    return await fn(*args)


def _no_images(images: Any) -> list:
    if images:
        raise ValueError("this rollout has images but the model has no vision tower: use a vision-language "
                         "model (e.g. Qwen2.5-VL) or drop the images")
    return []


# ---------------------------------------------------------------- ChatAgent: the user owns the loop

@dataclass
class ChatContext:
    """What `ChatAgent.run` gets: where to send requests, and the dataset row."""
    base_url: str            # OpenAI SDK: http://127.0.0.1:PORT/s/<session>/v1
    anthropic_base_url: str  # Anthropic SDK (it appends /v1/messages): http://127.0.0.1:PORT/s/<session>
    api_key: str             # this rollout's key: the server refuses requests without it (401)
    model_name: str          # echoed back; the policy answers whatever model is named
    prompt: Any              # the dataset row's prompt (text or messages)
    messages: list[dict]     # the prompt as chat messages
    label: Any
    row: dict
    sampling_params: dict    # what the server samples with (request temperature etc. are ignored)


class ChatAgent(_Agent):
    """Subclass and implement `run`: talk to `ctx.base_url` with any SDK, return a Result.
    One instance per rollout; all requests of one `run` are one rollout."""

    async def run(self, ctx: ChatContext) -> Result:
        raise NotImplementedError


async def run_chat_agent(agent: ChatAgent, row: dict, generate: Generate, tokenizer, server: "ChatServer", *,
                         sampling: dict, max_len: int, image_tokens=None,
                         call: Call | None = None) -> list[Trajectory]:
    """Run one `agent.run` on `row` through a fresh session of `server` (started, in this
    event loop). Returns the rollout's segments, each carrying its reward, score and info.
    A row's images appear in `ctx.messages` as OpenAI `image_url` parts with data URIs."""
    session = server.open_session(generate, tokenizer, sampling=sampling, max_len=max_len, image_tokens=image_tokens)
    images = image_tokens.uris(row.get("images")) if image_tokens else _no_images(row.get("images"))
    messages, shown = with_images(prompt_messages(row["prompt"]), images), iter(images)
    messages = [{**m, "content": [{"type": "image_url", "image_url": {"url": next(shown)}}
                                  if p.get("type") in ("image", "image_url") else p for p in m["content"]]}
                if isinstance(m["content"], list) else m for m in messages]
    ctx = ChatContext(base_url=session.base_url, anthropic_base_url=session.anthropic_base_url,
                      api_key=session.key, model_name=server.model_name, prompt=row["prompt"],
                      messages=messages, label=row.get("label"), row=row, sampling_params=dict(sampling))
    try:
        result = await (call or _call_here)(agent.run, ctx)
    except Exception:
        if session.error is None:
            raise
    finally:
        segments = server.close_session(session.id)
    if session.error is not None:   # the engine failed under the agent: raise that, not the SDK's 500
        raise session.error
    if not isinstance(result, Result):
        raise ValueError(f"{type(agent).__name__}.run returned {type(result).__name__}, not a Result")
    reward = float(result.reward)
    if not math.isfinite(reward):
        raise ValueError(f"agent returned a non-finite reward {result.reward!r}")
    if not segments:
        e = DropRollout("prompt_too_long", f"{type(agent).__name__}'s requests left no room for a reply within "
                        f"--max_len {max_len}") if session.truncated else ValueError(
            f"{type(agent).__name__} made no model request: call the API at ctx.base_url (OpenAI) or "
            f"ctx.anthropic_base_url (Anthropic){''.join(f'; the server answered {r}' for r in session.refused[-3:])}")
        raise agent.drop(getattr(e, "reason", "error"), str(e)) if isinstance(agent, Program) else e   # its stderr too
    info = {k: float(v) for k, v in result.info.items()}
    info.update(segments=float(len(segments)), requests=float(session.requests))
    if session.truncated:
        info["truncated"] = 1.0
    for seg in segments:   # a ChatAgent's reward sits on the last turn of each segment
        seg.reward, seg.info, seg.turn_rewards = reward, dict(info), [0.0] * seg.turns[-1] + [reward]
        seg.score = reward if result.score is None else float(result.score)
    return segments


async def run_agent(cfg: dict, agent_cls: type, row: dict, generate, tokenizer, server, sampling: dict,
                    call=None, branch: bool = False) -> list:
    """One rollout of either agent form, within --agent_timeout; returns its segments (or, with `branch`
    and --branches, an Env's branches). `call` runs the agent's own code (an agent thread's `call`; None: in
    this loop)."""
    images = vision.image_tokens(cfg["model"])  # None for a text model
    if issubclass(agent_cls, ChatAgent):
        run = run_chat_agent(agent_cls(), row, generate, tokenizer, server, sampling=sampling,
                             max_len=cfg["max_len"], image_tokens=images, call=call)
    else:
        run = run_env(agent_cls(), row, generate, tokenizer, sampling=sampling, max_len=cfg["max_len"],
                      max_turns=cfg["max_turns"], image_tokens=images, max_images=cfg["max_images_per_prompt"],
                      call=call, branch_turns=cfg.get("branch_turns") or (1,),
                      branches=cfg.get("branches", 1) if branch else 1, context=cfg.get("context", "none"),
                      context_turns=cfg.get("context_turns", 2),
                      deadline=asyncio.get_running_loop().time() + cfg["agent_timeout"])
    # a program times out by itself, then its process group is killed and its stderr shown: a grace for that
    limit = cfg["agent_timeout"] + 5.0 * issubclass(agent_cls, Program)
    try:
        async with asyncio.timeout(limit) as deadline:
            result = await run
    except TimeoutError:
        if deadline.expired():   # ours; a TimeoutError the agent's own code raised is its error
            raise DropRollout("timeout", f"rollout exceeded --agent_timeout {cfg['agent_timeout']}s") from None
        raise
    return result if isinstance(result, list) else [result]


def load_agent(path: str) -> type:
    """Load the one Env or ChatAgent subclass defined in the Python file at `path`."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--agent {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"molt_agent_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = [obj for obj in vars(module).values()
             if inspect.isclass(obj) and issubclass(obj, (Env, ChatAgent)) and obj.__module__ == module.__name__]
    if len(found) != 1:
        raise ValueError(f"--agent {path}: expected exactly one Env subclass (or one ChatAgent subclass) defined "
                         f"in the file, found {', '.join(c.__name__ for c in found) or 'none'}")
    return found[0]


def agent_class(cfg: dict) -> type:
    """The run's agent: a `Program` subclass running --agent_cmd, the class defined in --agent, or an `MCPAgent` (or
    the --agent subclass of it) with the servers of --mcp_server (each split as a shell would)."""
    if not cfg.get("mcp_server"):
        return (program(cfg["agent_cmd"], cfg["agent_timeout"], cfg.get("agent_resources"),
                        cfg.get("program_sandbox", "on") == "on", cfg.get("program_env", []))
                if cfg.get("agent_cmd") is not None else load_agent(cfg["agent"]))
    base = load_agent(cfg["agent"]) if cfg["agent"] else MCPAgent
    if not issubclass(base, MCPAgent):
        raise ValueError(f"--mcp_server with --agent: {base.__name__} must subclass agent.MCPAgent (it runs the tools)")
    if not all(servers := [shlex.split(c) for c in cfg["mcp_server"]]):
        raise ValueError("--mcp_server is empty: give the command that starts an MCP server on stdio")
    return type(base.__name__, (base,), {"servers": servers, "max_turns": cfg["max_turns"] or base.max_turns})


# ---------------------------------------------------------------- agents as programs (--agent_cmd)

MAX_OUTPUT = 16 * 2**20   # bytes a program may write (stdout and stderr together) before it is killed as a flood
TAIL = 2000               # bytes of stderr shown when a program's rollout is dropped


def program(cmd: str, timeout: float, resources: dict | None = None, confined: bool = True, env: list = ()) -> type:
    """A `Program` class running `cmd` (split as a shell would; run without a shell) within `timeout` seconds, here or
    on a node with `resources`, `confined` in a sandbox with the variables `env` names ("NAME=VALUE", or "NAME": its
    value here). ValueError: an empty command, one whose executable is not found (here), a sandbox that cannot start
    here, an unset NAME."""
    argv = [os.path.abspath(a) if os.path.isfile(a) else a for a in shlex.split(cmd)]   # it runs in its own folder
    if not argv:
        raise ValueError("--agent_cmd is empty: give the command that runs one rollout")
    if shutil.which(argv[0]) is None and not resources:   # on other nodes the path is theirs
        raise ValueError(f"--agent_cmd {cmd!r}: {argv[0]!r} is not an executable file here or on PATH")
    if missing := [e for e in env if "=" not in e and e not in os.environ]:
        raise ValueError(f"--program_env {missing[0]}: not set here (give NAME=VALUE)")
    if confined and not resources:
        check_sandbox()
    amounts = dict(resources or {})   # Ray's options asking for exactly these: no CPU or GPU unless named
    options = {"num_cpus": amounts.pop("CPU", 0), "num_gpus": amounts.pop("GPU", 0), "resources": amounts}
    env = dict(e.partition("=")[::2] if "=" in e else (e, os.environ[e]) for e in env)
    return type("Program", (Program,), {"argv": argv, "timeout": timeout, "resources": resources, "options": options,
                                        "confined": confined, "env": env})


class _Output:
    """One of a program's pipes read to its end: its last TAIL bytes, its last non-empty line, and how many of
    its lines were JSON objects with a "reward" key (a line is parsed only when it names "reward")."""

    def __init__(self):
        self.tail, self.line, self.last, self.rewards = b"", b"", b"", 0

    async def read(self, stream, total: list[int]):
        while chunk := await stream.read(2**16):
            total[0] += len(chunk)
            if total[0] > MAX_OUTPUT:
                raise DropRollout("flood", f"wrote over {MAX_OUTPUT // 2**20} MiB of output: killed")
            self.tail = (self.tail + chunk)[-TAIL:]
            *lines, self.line = (self.line + chunk).split(b"\n")
            self.line = self.line[-2**20:]   # a longer reward line is not one
            self.take(lines)
        self.take([self.line])

    def take(self, lines: list[bytes]):
        self.rewards += sum(_reward_object(line) is not None for line in lines)
        self.last = next((line for line in reversed(lines) if line.strip()), self.last)


def _reward_object(line: bytes) -> dict | None:
    with contextlib.suppress(ValueError, RecursionError):   # not JSON, or nested too deep: no reward
        found = json.loads(line) if b'"reward"' in line else None
        return found if isinstance(found, dict) and "reward" in found else None
    return None


async def _process(command: list[str], env: dict, cwd: str, data: bytes, timeout: float, what: str) -> tuple:
    """Run `command` in its own group with `data` on stdin, both pipes read (bounded) within `timeout`, then the whole
    group killed (and with it, a sandbox). -> (stdout, stderr, (reason, what) of a drop or None)."""
    out, err, total, failed = _Output(), _Output(), [0], None
    proc = await asyncio.create_subprocess_exec(*command, cwd=cwd, env=env, start_new_session=True,
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        async def feed():
            with contextlib.suppress(ConnectionError):   # a program need not read its row
                proc.stdin.write(data)
                await proc.stdin.drain()
                proc.stdin.close()
        await asyncio.wait_for(asyncio.gather(feed(), out.read(proc.stdout, total),
                                              err.read(proc.stderr, total), proc.wait()), timeout)
    except (asyncio.TimeoutError, DropRollout) as e:   # the caller drops the rollout, with the stderr's tail
        failed = (e.reason, str(e)) if isinstance(e, DropRollout) else ("timeout", f"{what} ran past {timeout:g}s: killed")
    finally:   # the whole group, whatever it left running (a Ray task's too: ray.cancel raises in it)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc._transport.close()   # its pipes too: a flood's unread, paused pipe would keep wait() from returning
        await proc.wait()
    return out, err, failed or (proc.returncode and ("exit", f"{what} exited with {proc.returncode}")) or None


async def run_process(argv: list[str], row: dict, env: dict, timeout: float, confined: bool = True) -> tuple:
    """A `Program`'s process, here or in a Ray task, in a fresh temporary folder: `confined` in a sandbox of its own
    (sandbox.py: `env` and an allow-list) or with `env` over this process's environment (with the run's tag,
    faults.TAG); the row on stdin. A row's Harbor task (tasks.py): its files in the workspace, mounted at its WORKDIR,
    then its verifier. -> (stdout, stderr, (reason, what) of a drop or None, the verifier's reward or None)."""
    task = tasks.Task.load(row["task"]) if row.get("task") else None
    with sandbox.folder() as folder:   # its name says whose: a killed driver's go at the next start-up
        work, logs = Path(folder, "work"), Path(folder, "logs")
        work.mkdir()
        if task:
            task.prepare(work)
            env, timeout = {**task.env, **env}, min(task.timeouts["agent"] or timeout, timeout)   # within --agent_timeout
        hide = (str(task.path.parent),) if task else ()   # not its tests, nor any task's solution
        async with contextlib.AsyncExitStack() as stack:
            command, full = await stack.enter_async_context(sandbox.confine(
                argv, env, folder, timeout, str(work), task and task.workdir, hide=hide)) if confined else (
                argv, {**os.environ, **env})
            out, err, failed = await _process(command, full, str(work), json.dumps(row, default=str).encode() + b"\n",
                                              timeout, "it")
        if not task or failed:
            return out, err, failed, None
        shutil.copytree(task.path / "tests", Path(folder, "tests"))
        (logs / "verifier").mkdir(parents=True)
        (logs / "agent").mkdir()
        mounts = ((str(Path(folder, "tests")), "/tests", False), (str(logs), "/logs", True))
        seconds = task.timeouts["verifier"] or timeout
        async with sandbox.confine(["bash", "/tests/test.sh"], {**task.env, **task.verifier_env}, folder, seconds,
                                   str(work), task.workdir, mounts) as (command, full):
            _, verr, vfailed = await _process(command, full, str(work), b"", seconds, "its task's tests/test.sh")
        found = tasks.reward(logs / "verifier")
        if found is None:   # the verifier's failure, its stderr shown
            return out, verr, vfailed or ("no_reward", "its task's tests/test.sh wrote no /logs/verifier/reward.txt "
                                          "or reward.json"), None
        return out, err, None, found


def check_sandbox():
    """Run `true` in a sandbox (program(), and on agent nodes): ValueError naming why one cannot be made here."""
    try:   # on a thread of its own: the caller may be in an event loop
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            _, err, failed, _ = pool.submit(asyncio.run, run_process(["true"], {}, {}, 30)).result()
    except (sandbox.SandboxError, OSError) as e:   # no bwrap, or none that runs
        raise ValueError(f"--program_sandbox on: {e}") from None
    if failed:
        raise ValueError(f"--program_sandbox on: a sandbox cannot be made here ({err.tail.decode(errors='replace')}"
                         f"{failed[1]}); --program_sandbox off runs programs unconfined")


@functools.cache
def _process_task():   # one Ray function for the job, not one per rollout: each ray.remote exports one to the GCS
    import ray
    return ray.remote(max_retries=0)(lambda *args: asyncio.run(run_process(*args)))


class Program(ChatAgent):
    """A rollout run by a program (`--agent_cmd`; the contract is docs/programs.md), here or on a node with `resources`
    (`run_process`): the server's URLs and this rollout's key in OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL,
    ANTHROPIC_API_KEY; the dataset row as JSON on stdin; the reward as a JSON object {"reward": R, "info": {...}} on
    the last line of stdout. It inherits the run's tag (faults.TAG), so the reaper ends it with the run. Any failure
    drops the rollout (DropRollout) with the stderr's tail."""
    argv: list[str] = []
    timeout: float = 300.0
    resources: dict | None = None       # and `options`, Ray's for a task on a node with them (`program`)
    confined: bool = True               # in a sandbox of its own (--program_sandbox)
    env: dict = {}                      # what --program_env passes
    err: _Output | None = None          # this rollout's stderr, once its process ended

    async def run(self, ctx: ChatContext) -> Result:
        args = (self.argv, ctx.row, {**self.env, "OPENAI_BASE_URL": ctx.base_url, "OPENAI_API_KEY": ctx.api_key,
                "ANTHROPIC_BASE_URL": ctx.anthropic_base_url, "ANTHROPIC_API_KEY": ctx.api_key}, self.timeout, self.confined)
        out, self.err, failed, verdict = await (self.on_node(args) if self.resources else run_process(*args))
        if failed:
            raise self.drop(*failed)
        if verdict is not None:   # a Harbor task's: its verifier's reward, whatever the program printed
            return Result(reward=verdict)
        found = _reward_object(out.last)
        if found is None:
            raise self.drop("no_reward", "printed no reward: the last line of stdout must be a JSON object "
                            'like {"reward": 1.0}' + (" (a reward line came earlier)" if out.rewards else ""))
        if out.rewards > 1:
            raise self.drop("bad_reward", f"printed {out.rewards} reward lines: print exactly one, last")
        reward, info = found["reward"], found.get("info", {})
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise self.drop("bad_reward", f"printed the reward {reward!r}: it must be a finite number")
        if not isinstance(info, dict) or not all(isinstance(v, (int, float)) for v in info.values()):
            raise self.drop("bad_reward", "printed an info that is not an object of numbers")
        return Result(reward=float(reward), info=info)

    async def on_node(self, args: tuple) -> tuple:   # `run_process(*args)` as a Ray task on a node with `resources`
        import ray
        task = _process_task().options(**self.options).remote(*args)
        try:
            return await task
        except ray.exceptions.RayError as e:   # this rollout's, not the engine's: a node, worker or memory failure
            cause = getattr(e, "cause", None) or e   # a RayTaskError's: what run_process raised (OSError: not started)
            raise self.drop("exit" if isinstance(cause, OSError) else "node",
                            f"its Ray task failed: {type(cause).__name__}: {cause}") from None
        finally:   # dropped or cancelled here: stop it there (not force: its group is killed first)
            ray.cancel(task)

    @classmethod
    async def check_node(cls) -> None:   # at start-up (loop.train), as each of its rollouts would fail
        import ray
        if not cls.resources:
            return
        node = f"the node --agent_resources {json.dumps(cls.resources)} placed a check on"
        if await ray.remote(shutil.which).options(**cls.options).remote(cls.argv[0]) is None:
            raise ValueError(f"--agent_cmd {shlex.join(cls.argv)}: {cls.argv[0]!r} is not an executable file on PATH "
                             f"of {node}")
        try:   # the sandbox too, as program() checks it here
            cls.confined and await ray.remote(check_sandbox).options(**cls.options).remote()
        except ray.exceptions.RayTaskError as e:
            raise ValueError(f"{e.cause} (on {node})") from None

    def drop(self, reason: str, what: str) -> DropRollout:
        """The rollout's drop: the stderr's tail, then (last: what the loop logs once per kind) what happened."""
        tail = self.err.tail.decode(errors="replace").strip() if self.err else ""
        return DropRollout(reason, (f"{tail}\n" if tail else "") + f"--agent_cmd {shlex.join(self.argv)}: {what}"
                           + (" (its stderr's tail above)" if tail else ""))


# ---------------------------------------------------------------- tools from MCP servers (--mcp_server)

def _leaf(e: BaseException) -> BaseException:   # what an MCP client's (anyio's) task groups wrapped in groups of one
    return _leaf(e.exceptions[0]) if isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1 else e


def _mcp_error(argv: list[str], err, e: BaseException | str) -> DropRollout:
    err.seek(0)
    tail = err.read()[-TAIL:].decode(errors="replace").strip()
    what = e if isinstance(e, str) else getattr(e, "message", None) or str(e) or type(e).__name__
    return DropRollout("mcp_server", (f"{tail}\n" if tail else "") + f"--mcp_server {shlex.join(argv)}: {what}")


async def mcp_tools(servers: list[list[str]], stack: contextlib.AsyncExitStack, timeout: float | None = None) -> dict:
    """Start each MCP server on `stack` (which ends it; stdio, its own process group, the run's environment and so
    its tag, a fresh folder), list its tools: {name: (argv, stderr file, client, OpenAI tool schema)}; DropRollout."""
    import mcp
    from mcp.client.stdio import stdio_client
    tools, cwd = {}, stack.enter_context(tempfile.TemporaryDirectory(prefix="molt-mcp-"))   # removed after the servers
    for argv in servers:
        err = stack.enter_context(tempfile.TemporaryFile())
        named = [os.path.abspath(a) if os.path.isfile(a) else a for a in argv]   # the files it names, from here
        params = mcp.StdioServerParameters(command=named[0], args=named[1:], env=dict(os.environ), cwd=cwd)
        try:
            async with asyncio.timeout(timeout):
                client = await stack.enter_async_context(mcp.Client(stdio_client(params, errlog=err)))
                listed = (page := await client.list_tools()).tools
                while page.next_cursor:
                    listed += (page := await client.list_tools(cursor=page.next_cursor)).tools
        except Exception as e:
            e = _leaf(e)
            raise _mcp_error(argv, err, f"did not start within {timeout:g}s" if isinstance(e, TimeoutError) else e) from None
        for t in listed:
            if t.name in tools:
                raise ValueError(f"--mcp_server: two servers have a tool named {t.name!r} ({shlex.join(argv)})")
            tools[t.name] = (argv, err, client, {"type": "function", "function": {
                "name": t.name, "description": t.description or "", "parameters": t.input_schema}})
    return tools


def check_mcp_servers(servers: list[list[str]], timeout: float) -> None:
    """Start each server once and list its tools (main.validate, before Ray): ValueError naming one that fails."""
    async def listing():
        async with contextlib.AsyncExitStack() as stack:
            await mcp_tools(servers, stack, timeout)
    try:
        asyncio.run(listing())
    except Exception as e:
        raise ValueError(str(_leaf(e))) from None


async def call_mcp_tool(tools: dict, name: str, arguments: str) -> tuple[str, bool]:
    """Run one tool call: its result as text (the tool message's content), and whether it is an error. A tool that
    raises or a call the server refuses is an error the model reads (MCP's isError); a server gone drops the rollout."""
    if name not in tools:
        return f"Unknown tool: {name}", True
    argv, err, client, _ = tools[name]
    try:
        result = await client.call_tool(name, json.loads(arguments))
    except Exception as e:
        if getattr(e, "code", -32000) == -32000:   # mcp_types.CONNECTION_CLOSED, or not an MCP error
            raise _mcp_error(argv, err, _leaf(e)) from None
        return f"Error: {e.message}", True
    return "\n".join(getattr(b, "text", None) or f"[{b.type}]" for b in result.content), result.is_error


class MCPAgent(ChatAgent):
    """The agent of --mcp_server (docs/programs.md, "Tools from MCP servers"): each rollout starts its own servers,
    offers their tools (`tools=`), runs the model's calls on them and sends the results back as `tool` messages,
    until a reply calls no tool or `max_turns` requests were made. Subclass it (--agent) for your own `reward`."""
    servers: list[list[str]] = []
    max_turns: int = 8

    async def reward(self, answer: str | None, ctx: ChatContext) -> float:
        """The final reply's (None: cut off, or calling tools at the turn limit): a reasoning-gym row's scorer, or its label."""
        import data
        return 0.0 if answer is None else data.score_reasoning_gym(ctx.row, answer) if "entry" in ctx.row else float(
            answer.strip() == str(ctx.label).strip())

    async def run(self, ctx: ChatContext) -> Result:
        import openai
        calls = errors = 0
        try:
            async with contextlib.AsyncExitStack() as stack:
                tools = await mcp_tools(self.servers, stack)
                client = await stack.enter_async_context(openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key))
                messages = list(ctx.messages)
                for _ in range(self.max_turns):
                    choice = (await client.chat.completions.create(
                        model=ctx.model_name, messages=messages, tools=[t[3] for t in tools.values()])).choices[0]
                    messages.append(choice.message.model_dump(exclude_none=True))
                    for call in choice.message.tool_calls or []:
                        text, failed = await call_mcp_tool(tools, call.function.name, call.function.arguments)
                        messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
                        calls, errors = calls + 1, errors + failed
                    if not choice.message.tool_calls:
                        break
        except BaseExceptionGroup as group:
            raise _leaf(group) from None
        answer = choice.message.content if choice.finish_reason == "stop" else None
        return Result(reward=await self.reward(answer, ctx), info={"tool_calls": calls, "tool_errors": errors})
