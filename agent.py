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

Or the agent is a program in any language (`--agent_cmd`), or its tools come from MCP servers (`--mcp_server`):
ChatAgents of programs.py (docs/programs.md), whose `agent_class(cfg)` is the run's agent (or the one class of an
--agent file: `load_agent(path)`). Prompts come from the agent's `prompts(seed)` or from a `--dataset` file (data.py).
"""

import asyncio
import copy
import importlib.util
import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterator

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

    async def summarize(traj: Trajectory, messages: list, request: list, params: dict) -> list | None:
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
            rewritten = result.context   # a policy's rewrite: before the next turn would overflow
            request = delta_ids(tokenizer, messages, out["token_ids"], [{"role": "user", "content": SUMMARY_REQUEST}]) \
                if context == "summarize" else []   # summarize keeps room after that turn for it and a full summary
            if rewritten is None and context != "none" and len(traj.tokens) + len(obs_ids) + params["max_tokens"] * (
                    1 + bool(request)) + len(request) > max_len:
                rewritten = (await summarize(traj, messages, request, params) if request
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
    grace: float = 0.0   # seconds past --agent_timeout its rollout gets to end by itself (a program's: 5)

    async def run(self, ctx: ChatContext) -> Result:
        raise NotImplementedError

    def failed(self, e: Exception) -> Exception:
        """What `run_chat_agent` raises for a `run` whose requests left no segment (a program adds its stderr)."""
        return e


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
        raise agent.failed(e)
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
    limit = cfg["agent_timeout"] + (agent_cls.grace if issubclass(agent_cls, ChatAgent) else 0.0)
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
