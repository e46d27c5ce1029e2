"""Vision task for a tiny random-init VLM: name the colour of the picture in one word.

Single turn. Each prompt shows one 56x56 image filled with one of four colours (4 image
tokens on the tiny Qwen2.5-VL) and asks for its colour; every colour word is one token of
`vision.build_tiny_vlm`'s tokenizer. Reward 1 when the reply starts with the right colour,
0.1 when it starts with another colour word (the format is learned first: a random policy
over ~450 tokens names some colour ~1% of the time, the right one ~0.2%), else 0.

Measured with a plain-PyTorch prototype of the same set-up (32 prompts x 16 samples, one generated token,
group-normalised advantages, AdamW lr 1e-3, clip 1.0): the 10-step mean reached 0.8 accuracy in 62-124 steps over 4
seeds. Without the 0.1 partial credit one of two seeds stalled at ~0.7 with one colour never named; a square on a
white background (instead of a filled picture) stalled at ~0.5 for one of two seeds.

    PYTHONPATH=examples/vlm_shims python main.py --agent examples/agents/vision_colour.py --model tiny-vlm --max_new_tokens 1
    bash examples/recipes/tiny_vlm_colour.sh        # the same, 60 steps

(`examples/vlm_shims` is the CPU-machine shim for machines without torchvision.)
"""

import random

from PIL import Image

import vision
from agent import Env, Result

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 30, 220), "yellow": (230, 210, 20)}
QUESTION = "What colour is the picture? Answer with one word."


class VisionColour(Env):
    @classmethod
    def prompts(cls, seed):
        rng = random.Random(seed)
        pictures = {name: vision.to_data_uri(Image.new("RGB", (56, 56), rgb)) for name, rgb in COLOURS.items()}
        while True:
            name = rng.choice(list(COLOURS))
            yield {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                   "images": [pictures[name]], "label": name}

    async def step(self, state):
        reply = state.action.strip().lower()
        if reply.startswith(state.label):
            return Result(reward=1.0)
        return Result(reward=0.1 if reply.startswith(tuple(COLOURS)) else 0.0)
