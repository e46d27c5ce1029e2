"""The agent contract: what a user writes, and how it becomes token-exact training data.

A user writes ordinary Python:

    class MyEnv(Env):                      # the framework runs the LLM loop
        async def step(self, state):       # state.action = the model's reply text
            return Result(reward=float(state.action == state.label))

`run_env` renders the first prompt with the model's chat template, tokenizes
it once, asks the engine for a completion as token ids, calls `step`, appends
the observation as non-trainable tokens rendered by the same template, and
repeats until the episode ends. It returns a `Trajectory`: the token ids the
engine actually saw and sampled, a mask of the policy's own tokens, their
sampling logprobs and policy versions, and the reward. The sampled text is
decoded for the agent to read; it is never encoded again.

Or the user owns the loop and talks to the policy with a stock SDK:

    class MyAgent(ChatAgent):
        async def run(self, ctx):
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
            # or anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key)
            reply = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
            return Result(reward=...)

`run_chat_agent` opens a session on a `ChatServer` (aiohttp, 127.0.0.1 only,
in the caller's event loop) that serves `POST /s/<session>/v1/chat/completions`
(OpenAI) and `POST /s/<session>/v1/messages` (Anthropic). Both decode into one
token-exact trace per session: the first request is rendered with the chat
template and tokenized once; a request that extends the previous one (its
messages, the reply as returned, new messages) appends only the new delta as
non-trainable tokens; a request that rewrites the prefix (compaction, edited
history, a template that re-renders old turns) starts a new segment. Segments
share the rollout's reward. Server rules, so they are written down once:

  - sampling is the run's (`ctx.sampling_params`): a request's temperature,
    top_p, stop, seed, ... are ignored, so every trained token keeps the run's
    logprob convention; `n` > 1 and `stream: true` are refused (400);
  - `max_tokens` (or `max_completion_tokens`) is clamped to the run's
    per-turn limit and to what is left of `max_len`; with no room left the reply
    is empty with finish_reason "length" / stop_reason "max_tokens", and
    nothing is recorded;
  - the same request body twice in a row (an SDK retry) gets the first reply
    back and is recorded once;
  - tools: a template that knows `tools` gets them (and `tool_calls`, `tool`
    messages) natively; otherwise they are described in the system message and
    calls are written as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.
    A reply with such blocks comes back as OpenAI `tool_calls` / Anthropic
    `tool_use`; Anthropic `tool_result` blocks become `tool` messages. Text only:
    image content is refused (400).

Agents are loaded from a file with `load_agent(path)`; prompts come from the
agent's `prompts(seed)` or from a `--dataset` file (`read_dataset`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import logging
import math
import re
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

log = logging.getLogger("molt")


@dataclass
class Result:
    """What an agent returns for one step (Env) or one episode (ChatAgent)."""
    reward: float
    observation: str | None = None   # text shown to the model next turn (Env)
    terminated: bool = True          # the episode is over
    truncated: bool = False          # cut short (budget, turn limit)
    info: dict = field(default_factory=dict)   # scalar diagnostics, logged as means
    score: float | None = None       # for dashboards/filtering; defaults to reward
    sampling_params: dict | None = None        # override for the next turn


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


@dataclass
class Trajectory:
    """One rollout (or one segment of it), token-exact. Lists have equal length."""
    tokens: list[int]                # prompt + every turn, exactly as the engine saw them
    mask: list[int]                  # 1 on tokens the policy sampled
    logprobs: list[float]            # sampling logprob where mask is 1, else 0
    versions: list[int]              # policy version that sampled it, -1 where mask is 0
    reward: float
    group: int = 0                   # rollouts of the same prompt share it
    rollout_id: int = 0              # segments of one rollout share it
    score: float = 0.0
    info: dict = field(default_factory=dict)

    def add(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None,
            version: int = -1):
        self.tokens += ids
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += list(logprobs) if sampled else [0.0] * len(ids)
        self.versions += [version if sampled else -1] * len(ids)

    @property
    def num_sampled(self) -> int:
        return sum(self.mask)


Generate = Callable[[list[int], dict], Awaitable[dict]]


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool,
            tools: list[dict] | None = None) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, tools=tools)


def _encode(tokenizer, text: str) -> list[int]:
    # The template already wrote every special token; add none of our own.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _messages(prompt: Any) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        return [dict(m) for m in prompt]
    raise ValueError(f"a prompt must be a string or a list of chat messages, got {type(prompt).__name__}")


def decode_reply(tokenizer, token_ids: list[int]) -> str:
    """The reply as the model wrote it, special tokens included, less a final end-of-turn."""
    if token_ids and token_ids[-1] == tokenizer.eos_token_id:
        token_ids = token_ids[:-1]
    return tokenizer.decode(token_ids, skip_special_tokens=False)


class PrefixRewrite(ValueError):
    """The chat template re-renders earlier turns, so the trace cannot just grow."""


def delta_ids(tokenizer, messages: list[dict], reply_ids: list[int], new: list[dict],
              tools: list[dict] | None = None) -> list[int]:
    """Token ids that follow the sampled reply when the messages `new` come next.

    `messages` ends with the assistant reply, its content the sampled text. The
    ids are the template's text after the reply (its end-of-turn, if the model
    did not sample it), the new messages and the next generation prompt; the
    reply itself is not re-encoded. Raises PrefixRewrite if the template does
    not render the longer conversation by appending."""
    before = _render(tokenizer, messages[:-1], True, tools)
    closed = _render(tokenizer, messages, False, tools)
    reply = messages[-1]["content"]
    if not closed.startswith(before + reply):
        raise PrefixRewrite("the chat template renders the reply differently from how it was "
                            "sampled; an Env needs a template that only appends (a ChatAgent "
                            "gets a new segment instead)")
    tail = closed[len(before) + len(reply):]            # e.g. "<|im_end|>\n"
    eos = tokenizer.eos_token
    if reply_ids and reply_ids[-1] == tokenizer.eos_token_id and eos and tail.startswith(eos):
        tail = tail[len(eos):]                           # the model sampled it already
    full = _render(tokenizer, messages + new, True, tools)
    if not full.startswith(closed):
        raise PrefixRewrite("the chat template re-renders earlier turns when the conversation "
                            "grows; an Env needs a template that only appends (a ChatAgent "
                            "gets a new segment instead)")
    return _encode(tokenizer, tail + full[len(closed):])


def observation_ids(tokenizer, messages: list[dict], reply_ids: list[int],
                    observation: str, role: str = "user") -> list[int]:
    """Token ids that follow the sampled reply when `observation` comes next."""
    return delta_ids(tokenizer, messages, reply_ids, [{"role": role, "content": observation}])


async def run_env(env: Env, row: dict, generate: Generate, tokenizer, *,
                  sampling: dict, max_len: int, max_turns: int | None = None) -> Trajectory:
    """Run one episode of `env` on `row`; returns its token-exact trajectory."""
    messages = _messages(row["prompt"])
    await env.reset(row)
    traj = Trajectory(tokens=[], mask=[], logprobs=[], versions=[], reward=0.0)
    traj.add(_encode(tokenizer, _render(tokenizer, messages, add_generation_prompt=True)), False)
    turns = max_turns or env.max_turns
    params = dict(sampling)
    observation, scores, info = None, [], {}
    for turn in range(turns):
        budget = max_len - len(traj.tokens)
        if budget <= 0:
            traj.info["truncated"] = 1.0
            break
        out = await generate(traj.tokens, {**params, "max_tokens": min(params["max_tokens"], budget)})
        traj.add(out["token_ids"], True, out["logprobs"], out["version"])
        action = decode_reply(tokenizer, out["token_ids"])
        messages.append({"role": "assistant", "content": action})
        result = await env.step(State(prompt=row["prompt"], label=row.get("label"), action=action,
                                      observation=observation, messages=messages, turn=turn,
                                      sampling_params=params, row=row,
                                      finish_reason=out["finish_reason"]))
        reward = float(result.reward)
        if not math.isfinite(reward):
            raise ValueError(f"agent returned a non-finite reward {result.reward!r}")
        traj.reward += reward
        scores.append(reward if result.score is None else float(result.score))
        info.update(result.info)
        if result.terminated or result.truncated or turn == turns - 1:
            break
        observation = result.observation or ""
        obs_ids = observation_ids(tokenizer, messages, out["token_ids"], observation)
        if len(traj.tokens) + len(obs_ids) >= max_len:
            traj.info["truncated"] = 1.0
            break
        traj.add(obs_ids, False)
        messages.append({"role": "user", "content": observation})
        params = {**params, **(result.sampling_params or {})}
    traj.score = sum(scores)
    traj.info.update({k: float(v) for k, v in info.items()})
    traj.info["turns"] = float(len(scores))
    return traj


def load_agent(path: str) -> type:
    """Load the one Env or ChatAgent subclass defined in the Python file at `path`."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--agent {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"molt_agent_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = [obj for obj in vars(module).values()
             if inspect.isclass(obj) and issubclass(obj, (Env, ChatAgent))
             and obj.__module__ == module.__name__]
    if len(found) != 1:
        names = ", ".join(c.__name__ for c in found) or "none"
        raise ValueError(f"--agent {path}: expected exactly one Env subclass (or one ChatAgent "
                         f"subclass) defined in the file, found {names}")
    return found[0]


def read_dataset(path: str, input_key: str = "prompt", label_key: str = "label") -> list[dict]:
    """Rows of a JSONL file as {"prompt", "label", ...}; errors name the line."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--dataset {path}: no such file")
    rows = []
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or input_key not in row:
            raise ValueError(f"{path}:{n}: missing field {input_key!r}")
        rows.append({**row, "prompt": row[input_key], "label": row.get(label_key)})
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows
