"""The token-exact trace of a rollout and the chat rendering that builds it.

Both ways an agent runs use this layer: `run_env` and `run_chat_agent` (agent.py) and the
`ChatSession` behind the loopback server (server.py):

    messages = with_images(prompt_messages(row["prompt"]), images)   # a row's prompt as chat messages
    ids = encode(tokenizer, render(tokenizer, messages, True))      # the template renders; encoded once
    out = await sample(generate, ids, images, sampling, image_tokens)  # one engine completion (ids in/out)
    traj.add(out["token_ids"], True, out["logprobs"], out["version"])
    text = decode_reply(tokenizer, out["token_ids"])                # what the agent reads; never re-encoded
    traj.add(delta_ids(tokenizer, messages, out["token_ids"], new), False)   # the next turn appends

`Trajectory` holds the ids the engine saw and sampled, a mask of the sampled ones, their sampling logprobs and policy
versions; `delta_ids` raises `PrefixRewrite` when the template re-renders earlier turns (an Env cannot continue; a
ChatAgent starts a new segment), and `sample` raises `DropRollout` for a rollout that cannot be trained on.
"""

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable


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
    images: list[str] = field(default_factory=list)  # PNG data URIs, in the order of their pads in tokens
    turns: list[int] = field(default_factory=list)  # per token: its turn (k-th reply, prompt/observation before)
    turn_rewards: list[float] = field(default_factory=list)  # per turn: its reward (they sum to reward)
    finish_reasons: list[str] = field(default_factory=list)  # per sampled turn: why it ended (stop, length, ...)
    states: list[str] | None = None  # per turn: the state it starts from (Result.state_key, else the observation)
    parent: int | None = None        # a branch: the rollout that trains the prefix it shares (--branches)
    branch_turn: int | None = None   # ... and the turn it branched at (its tokens before are not trained here)

    def add(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None, version: int | list[int] = -1):
        self.turns += [self.turns[-1] + self.mask[-1] if self.turns else 0] * len(ids)   # after a reply: a new turn
        self.tokens += ids
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += list(logprobs) if sampled else [0.0] * len(ids)
        if not isinstance(version, list):  # a list: per token (a partial rollout can span weight updates)
            version = [version] * len(ids)
        self.versions += version if sampled else [-1] * len(ids)


Generate = Callable[..., Awaitable[dict]]   # (prompt_ids, sampling[, images]) -> dict (generator.py)


class DropRollout(Exception):
    """This rollout cannot be trained on; the loop drops it and counts `dropped/<reason>`."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


async def sample(generate: Generate, tokens: list[int], images: list[str], sampling: dict, image_tokens) -> dict:
    """One completion of `tokens`. With images the engine gets one pad per image and the
    images (vision.py's convention) and must expand them into exactly `tokens`."""
    if not images:
        out = await generate(tokens, sampling)
    else:
        out = await generate(image_tokens.engine_ids(tokens), sampling, images)
        if out["prompt_ids"] != tokens:
            raise ValueError("the engine expanded the image tokens differently from the image processor "
                             f"({len(out['prompt_ids'])} ids, expected {len(tokens)}): check the model's "
                             "preprocessor_config.json")
    if image_tokens is not None and image_tokens.vision_ids.intersection(out["token_ids"]):
        raise DropRollout("vision_token", "the policy sampled an image/vision special token")
    return out


def _image_parts(content: Any) -> int:
    return sum(1 for p in content if isinstance(p, dict) and p.get("type") in ("image", "image_url")) \
        if isinstance(content, list) else 0


def with_images(messages: list[dict], images: list) -> list[dict]:
    """Messages whose image parts show `images`: a text `<image>` marks where one goes; with
    no image part or marker at all, the images go first in the first user message."""
    if not images:
        if any(_image_parts(m["content"]) for m in messages):
            raise ValueError("the prompt has image parts but the row has no images (--image_key)")
        return messages
    out = []
    for m in messages:
        if isinstance(m["content"], str) and "<image>" in m["content"]:
            texts = m["content"].split("<image>")
            parts = [{"type": "text", "text": texts[0]}] if texts[0] else []
            for t in texts[1:]:
                parts += [{"type": "image"}] + ([{"type": "text", "text": t}] if t else [])
            m = {**m, "content": parts}
        out.append(m)
    if not any(_image_parts(m["content"]) for m in out):
        i = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
        if i is None:
            raise ValueError("a row with images needs a user message to show them in")
        text = out[i]["content"]
        text = [{"type": "text", "text": text}] if isinstance(text, str) else list(text)
        out[i] = {**out[i], "content": [{"type": "image"}] * len(images) + text}
    shown = sum(_image_parts(m["content"]) for m in out)
    if shown != len(images):
        raise ValueError(f"the prompt has {shown} image places (<image> or image parts) for {len(images)} images")
    return out


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None,
           **options) -> str:
    """The template's text (`options`: its own switches), special-token strings as placeholders (`as_text`)."""
    return tokenizer.apply_chat_template(as_text(tokenizer, messages), add_generation_prompt=add_generation_prompt,
                                         tokenize=False, tools=as_text(tokenizer, tools), **options)


@functools.lru_cache(maxsize=16)
def _specials(tokenizer) -> tuple[Any, dict[str, str], dict[str, list[int]]]:
    """(a pattern of the special-token strings, string -> placeholder, placeholder -> the string's
    ids as plain text). Placeholders: Unicode private-use characters, one per special token."""
    names = sorted({t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special},
                   key=len, reverse=True)
    holders = {name: chr(0xF0000 + i) for i, name in enumerate(names)}
    plain = {holders[n]: tokenizer(n, add_special_tokens=False, split_special_tokens=True)["input_ids"] for n in names}
    return re.compile("|".join(map(re.escape, names)) or "(?!)"), holders, plain


def as_text(tokenizer, value: Any) -> Any:
    """`value` (messages, tools, content: any nesting of lists and dicts) with each special-token
    string in it replaced by its placeholder: untrusted text never becomes a control token."""
    if isinstance(value, str):
        pattern, holders, _ = _specials(tokenizer)
        return pattern.sub(lambda m: holders[m.group()], value)
    if isinstance(value, dict):
        return {k: as_text(tokenizer, v) for k, v in value.items()}
    return [as_text(tokenizer, v) for v in value] if isinstance(value, (list, tuple)) else value


def encode(tokenizer, text: str) -> list[int]:
    """Rendered text -> ids: the template's special tokens as such, placeholders as plain text."""
    plain, ids = _specials(tokenizer)[2], []
    for i, piece in enumerate(re.split(f"([{''.join(plain)}])", text) if plain else [text]):
        ids += plain[piece] if i % 2 else _encode_text(tokenizer, piece)
    return ids


@functools.lru_cache(maxsize=4096)  # a group's rollouts all start from the same prompt text
def _encode_text(tokenizer, text: str) -> tuple[int, ...]:
    # The template already wrote every special token; add none of our own.
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_messages(prompt: Any) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        return [dict(m) for m in prompt]
    raise ValueError(f"a prompt must be a string or a list of chat messages, got {type(prompt).__name__}")


@functools.lru_cache(maxsize=16)
def end_ids(tokenizer) -> frozenset[int]:
    """The ids that end a turn, those vLLM stops on: the tokenizer's eos and every eos id of the model's
    generation_config.json (else config.json, as vLLM reads them). Gemma-it ends turns with <end_of_turn>."""
    files = [f for f in (Path(tokenizer.name_or_path) / n for n in ("generation_config.json", "config.json"))
             if f.is_file()]
    eos = json.loads(files[0].read_text()).get("eos_token_id") if files else None
    return frozenset({tokenizer.eos_token_id, *([eos] if isinstance(eos, int) else eos or [])} - {None})


def decode_reply(tokenizer, token_ids: list[int]) -> str:
    """The reply as the model wrote it, special tokens included, less a final end-of-turn."""
    if token_ids and token_ids[-1] in end_ids(tokenizer):
        token_ids = token_ids[:-1]
    return tokenizer.decode(token_ids, skip_special_tokens=False)


class PrefixRewrite(ValueError):
    """The chat template re-renders earlier turns, so the trace cannot just grow."""


def delta_ids(tokenizer, messages: list[dict], reply_ids: list[int], new: list[dict],
              tools: list[dict] | None = None, **options) -> list[int]:
    """Token ids that follow the sampled reply when the messages `new` come next.

    `messages` ends with the assistant reply, its content the sampled text. The ids are the template's
    text after the reply (its end-of-turn, if the model did not sample it), the new messages and the next
    generation prompt; the reply itself is not re-encoded. Raises PrefixRewrite if the template does not
    render the longer conversation by appending."""
    before = render(tokenizer, messages[:-1], True, tools, **options)
    closed = render(tokenizer, messages, False, tools, **options)
    reply = as_text(tokenizer, messages[-1]["content"])
    if not closed.startswith(before + reply):
        raise PrefixRewrite("the chat template renders the reply differently from how it was sampled; an Env "
                            "needs a template that only appends (a ChatAgent gets a new segment instead)")
    tail = closed[len(before) + len(reply):]            # e.g. "<|im_end|>\n"
    end = tokenizer.decode(reply_ids[-1:]) if reply_ids and reply_ids[-1] in end_ids(tokenizer) else ""
    if end and tail.startswith(end):
        tail = tail[len(end):]                           # the model sampled it already
    full = render(tokenizer, messages + new, True, tools, **options)
    if not full.startswith(closed):
        raise PrefixRewrite("the chat template re-renders earlier turns when the conversation grows; an Env "
                            "needs a template that only appends (a ChatAgent gets a new segment instead)")
    return encode(tokenizer, tail + full[len(closed):])
