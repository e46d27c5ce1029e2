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

Agents are loaded from a file with `load_agent(path)`; prompts come from the
agent's `prompts(seed)` or from a `--dataset` file (data.py).
"""

import copy
import importlib.util
import inspect
import asyncio
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterator

import vision
from trajectory import (Generate, Trajectory, decode_reply, delta_ids, encode, prompt_messages, render, sample,
                        with_images)

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
        """Built-in prompt source: an endless iterator of rows {"prompt", "label"}."""
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


Call = Callable[..., Awaitable[Any]]        # (fn, *args) -> what fn(*args) returns, run where agent code runs


async def run_env(env: Env, row: dict, generate: Generate, tokenizer, *,
                  sampling: dict, max_len: int, max_turns: int | None = None,
                  image_tokens=None, max_images: int | None = None, call: Call | None = None,
                  branch_turns: tuple = (), branches: int = 1) -> Trajectory | list[Trajectory]:
    """Run one episode of `env` on `row`; returns its token-exact trajectory. For a vision-language model
    `image_tokens` (vision.ImageTokens) places the row's images (row["images"]) and the observations'
    (Result.images); a trajectory shows at most `max_images` (the engine's per-request limit): an observation
    over it ends the episode. `call(fn, *args)` runs the env's own code (reset, step): the loop passes one that
    runs it on an agent thread (faults.AgentThreads), so a blocking step cannot freeze the loop.
    `branches` M > 1: forks (`Env.fork`) before each of `branch_turns` into M continuations; returns the leaves,
    shared tokens trained in the first (the others' `parent`), failed ones left out (info["branches_dropped"])."""
    call = call or _call_here
    images = image_tokens.uris(row.get("images")) if image_tokens else _no_images(row.get("images"))
    messages = with_images(prompt_messages(row["prompt"]), images)
    await call(env.reset, row)
    traj = Trajectory(tokens=[], mask=[], logprobs=[], versions=[], reward=0.0, images=images, states=[""])
    prompt = encode(tokenizer, render(tokenizer, messages, add_generation_prompt=True))
    traj.add(image_tokens.expand(prompt, images) if images else prompt, False)
    turns = max_turns or env.max_turns

    async def play(env: Env, traj: Trajectory, messages: list, params: dict, observation, first: int) -> list:
        for turn in range(first, turns):
            if turn in branch_turns and turn > first and branches > 1:
                return await fork([(env, traj, messages, params, observation)] + [
                    (env.fork(), *copy.deepcopy((traj, messages, params, observation))) for _ in range(branches - 1)],
                    turn, len(traj.tokens))
            budget = max_len - len(traj.tokens)
            if budget <= 0:
                traj.info["truncated"] = 1.0
                break
            out = await sample(generate, traj.tokens, traj.images,
                               {**params, "max_tokens": min(params["max_tokens"], budget)}, image_tokens)
            traj.add(out["token_ids"], True, out["logprobs"], out.get("versions", out["version"]))
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
            if (len(traj.tokens) + len(obs_ids) >= max_len  # whole observations only: never half an image
                    or (max_images is not None and len(traj.images) + len(new_images) > max_images)):
                traj.info["truncated"] = 1.0
                break
            traj.add(obs_ids, False)
            traj.images += new_images
            traj.states.append(observation if result.state_key is None else str(result.state_key))
            messages.append({"role": "user", "content": content})
            params = {**params, **_override(params, result.sampling_params)}
        traj.info["turns"] = float(len(traj.turn_rewards))
        return [traj]

    async def fork(episodes: list, turn: int, shared: int) -> list[Trajectory]:
        done = await asyncio.gather(*[play(*e, turn) for e in episodes], return_exceptions=True)
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

    leaves = await play(env, traj, messages, dict(sampling), None, 0)
    if branches <= 1:
        return leaves[0]
    for i, t in enumerate(leaves):   # local ids (a parent comes before its branches); the pool offsets them
        t.rollout_id, t.parent = i, t.parent and t.parent.rollout_id
    return leaves


def _override(params: dict, new: dict | None) -> dict:
    """An Env's sampling override for its next turn. The trainer scores every token with the
    run's --temperature and the full softmax, so keys that change the sampling distribution
    are refused; max_tokens, stop_token_ids, seed, ignore_eos are free."""
    changed = sorted(k for k in ("temperature", "top_p", "top_k") if k in (new or {})
                     and new[k] != params.get(k, {"top_p": 1.0, "top_k": -1}.get(k)))
    if changed:
        raise ValueError(f"Result.sampling_params may not change {changed}: the trainer scores tokens with "
                         "the run's --temperature and the full distribution, so the IS weights and the "
                         "policy gradient would be wrong; set --temperature / --top_p for the whole run")
    return new or {}


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
    api_key: str             # any string works; SDKs insist on one
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
                      api_key=server.api_key, model_name=server.model_name, prompt=row["prompt"],
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
        raise ValueError(f"{type(agent).__name__} made no model request"
                         + (" that fit in max_len" if session.truncated else "")
                         + ": call the API at ctx.base_url (OpenAI) or ctx.anthropic_base_url (Anthropic)")
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
                      branches=cfg.get("branches", 1) if branch else 1)
    result = await asyncio.wait_for(run, timeout=cfg["agent_timeout"])
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
        names = ", ".join(c.__name__ for c in found) or "none"
        raise ValueError(f"--agent {path}: expected exactly one Env subclass (or one ChatAgent "
                         f"subclass) defined in the file, found {names}")
    return found[0]
