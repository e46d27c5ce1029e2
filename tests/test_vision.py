"""Vision-language policies: image inputs, the image-token convention, and vLLM vs transformers
on a tiny random-init Qwen2.5-VL (token-exact prompts, sampled-token logprobs, weight reload).

One engine serves the module; one event loop drives it (vLLM's async engine binds to the loop
it first runs on). CPU machines without torchvision need the shims (`use_cpu_shims`)."""

import asyncio
import base64
import io
from dataclasses import asdict
from pathlib import Path

import pytest
import safetensors.torch
import torch
from PIL import Image

import agent as agents
import trajectory
from fakes import tokens_out, trainer_logprobs
from server import ChatServer
import vision

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "agents"
PAD = 454  # checked against the tokenizer in test_tiny_vlm_is_deterministic_and_consistent


def use_cpu_shims() -> None:
    """CPU-machine shim (machines without torchvision): apply `examples/vlm_shims/sitecustomize.py`
    in this process and, through PYTHONPATH, in every process started from now on (vLLM's
    engine core and workers, Ray workers). Call it before vLLM is imported. A no-op in effect
    where torchvision works."""
    import importlib.util
    import os
    shims = Path(__file__).resolve().parents[1] / "examples" / "vlm_shims"
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(shims) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(shims), *filter(None, paths)])
    spec = importlib.util.spec_from_file_location("molt_vlm_shims", shims / "sitecustomize.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # installs its import hook here


def _img(w: int, h: int, rgb: tuple[int, int, int]) -> Image.Image:
    img = Image.new("RGB", (w, h), (255, 255, 255))
    img.paste(rgb, (w // 4, h // 4, 3 * w // 4, 3 * h // 4))  # a filled square on white
    return img


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> str:
    return vision.build_tiny_vlm(str(tmp_path_factory.mktemp("models") / "tiny-vlm"))


@pytest.fixture(scope="module")
def hf(vlm):
    from transformers import AutoModelForImageTextToText, AutoProcessor
    processor = AutoProcessor.from_pretrained(vlm, trust_remote_code=True)  # the stub video processor
    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval()
    return model, processor, processor.tokenizer


@pytest.fixture(scope="module")
def gen(vlm, loop):
    """Our Generator on the tiny VLM (its AsyncLLM is `engine` below)."""
    use_cpu_shims()  # before vLLM is imported and spawns its processes
    from generator import Generator

    async def make():  # trust_remote_code: the model folder's video processor (CPU shim)
        return Generator(vlm, max_len=512, seed=0, max_images=4, trust_remote_code=True)
    g = loop.run_until_complete(make())
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def engine(gen):
    return gen.engine


def _generate(engine, loop, prompt_ids: list[int], images: list, seed: int, max_tokens: int = 8) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=seed, detokenize=False)
    prompt = TokensPrompt(prompt_token_ids=prompt_ids, multi_modal_data={"image": images}) if images \
        else TokensPrompt(prompt_token_ids=prompt_ids)

    async def run():
        async for out in engine.generate(prompt, params, request_id=f"s{seed}-{len(prompt_ids)}-{id(images)}"):
            last = out
        return last
    out = loop.run_until_complete(run())
    comp = out.outputs[0]
    return {"prompt": list(out.prompt_token_ids), "tokens": list(comp.token_ids),
            "logprobs": [step[t].logprob for step, t in zip(comp.logprobs, comp.token_ids)]}


def _hf_logprobs(model, processor, rows: list[dict]) -> list[list[float]]:
    """Logprobs (temperature 1) of each row's sampled tokens: ONE right-padded batch forward
    over expanded ids, whose rows carry different numbers of images."""
    pad_id = processor.tokenizer.pad_token_id
    seqs = [r["prompt"] + r["tokens"] for r in rows]
    T = max(len(s) for s in seqs) - 1
    input_ids = torch.tensor([s[:-1] + [pad_id] * (T - len(s) + 1) for s in seqs])  # [B, T]
    kwargs = vision.mm_forward_kwargs(input_ids, [r["images"] for r in rows], processor, model.config.image_token_id)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=input_ids, **kwargs).logits.float(), -1)  # [B, T, V]
    return [[logp[b, len(r["prompt"]) - 1 + i, t].item() for i, t in enumerate(r["tokens"])]
            for b, r in enumerate(rows)]


def _ids(tokenizer, messages, **kw) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, **kw)["input_ids"])


def test_tiny_vlm_is_deterministic_and_consistent(vlm, hf, tmp_path):
    again = vision.build_tiny_vlm(str(tmp_path / "again"))
    for f in sorted(Path(vlm).iterdir()):
        assert f.read_bytes() == (Path(again) / f.name).read_bytes(), f.name
    model, processor, tok = hf
    cfg = model.config
    assert tok.convert_tokens_to_ids(vision.IMAGE_PAD) == cfg.image_token_id == PAD
    assert tok.convert_tokens_to_ids(vision.VISION_START) == cfg.vision_start_token_id
    assert tok.convert_tokens_to_ids(vision.VISION_END) == cfg.vision_end_token_id
    assert tok.convert_tokens_to_ids("<|video_pad|>") == cfg.video_token_id
    assert len(tok) == cfg.text_config.vocab_size
    for word in vision.COLOURS:  # one-token answers for an RL task
        assert len(tok.encode(word, add_special_tokens=False)) == 1, word


def test_load_image_forms(tmp_path):
    img = _img(56, 84, (0, 0, 255))
    path = tmp_path / "x.png"
    img.save(path)
    uri = vision.to_data_uri(img)
    assert uri.startswith("data:image/png;base64,")
    for spec in (img, str(path), uri, uri.split(",", 1)[1], path.read_bytes()):
        got = vision.load_image(spec)
        assert got.mode == "RGB" and got.size == (56, 84) and got.tobytes() == img.tobytes()
    with pytest.raises(ValueError, match="URLs are refused"):
        vision.load_image("https://example.com/cat.png")
    with pytest.raises(ValueError, match="not an image"):
        vision.load_image("no/such/file.png")
    buf = io.BytesIO()
    img.save(buf, format="JPEG")
    assert vision.load_image("data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()).size == (56, 84)
    from PIL import Image
    noisy = Image.effect_noise((64, 64), 80).convert("RGB")
    raw = vision.to_data_uri(noisy).split(",", 1)[1]   # raw base64 longer than a file name may be
    assert len(raw) > 4096 and vision.load_image(raw).tobytes() == noisy.tobytes()


def test_collapse_expand_round_trip():
    S, E = 1, 2  # vision_start / vision_end: two adjacent images are two runs
    expanded = [7, S, PAD, PAD, PAD, PAD, E, S, PAD, PAD, E, 9, 9, S, PAD, E, 3]
    collapsed = [7, S, PAD, E, S, PAD, E, 9, 9, S, PAD, E, 3]
    assert vision.collapse_image_pads(expanded, PAD) == collapsed
    assert vision.expand_image_pads(collapsed, PAD, [4, 2, 1]) == expanded
    assert vision.collapse_image_pads([5, 6], PAD) == vision.expand_image_pads([5, 6], PAD, []) == [5, 6]
    with pytest.raises(ValueError, match="3 image pads for 2 images"):
        vision.expand_image_pads(collapsed, PAD, [4, 2])


def test_expansion_equals_the_hf_processor(vlm, hf):
    model, processor, tok = hf
    images = [_img(112, 112, (255, 0, 0)), _img(56, 84, (0, 0, 255))]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which?"}]}]
    ids = _ids(tok, messages, add_generation_prompt=True)
    inputs = vision.image_inputs(processor, images)
    assert inputs["counts"] == [16, 6]  # 112x112 -> 8x8 patches -> 16; 56x84 -> 6x4 -> 6
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ref = processor(text=[text], images=images, return_tensors="pt")
    assert vision.expand_image_pads(ids, PAD, inputs["counts"]) == ref["input_ids"][0].tolist()
    assert torch.equal(inputs["pixel_values"], ref["pixel_values"])
    assert torch.equal(inputs["image_grid_thw"], ref["image_grid_thw"])
    it = vision.ImageTokens(vlm)  # the same, from the image size alone, with images as data URIs
    uris = it.uris(images)
    assert it.uris(uris) == uris and it.counts(uris) == [16, 6] and it.engine_ids(it.expand(ids, uris)) == ids
    assert it.expand(ids, uris) == ref["input_ids"][0].tolist()
    kw = vision.mm_forward_kwargs(ref["input_ids"], [images], processor, PAD)
    assert torch.equal(kw["mm_token_type_ids"], ref["mm_token_type_ids"].int())
    with pytest.raises(ValueError, match="row 0: 22 image pads"):
        vision.mm_forward_kwargs(ref["input_ids"], [images[:1]], processor, PAD)


def test_image_markers_in_text_stay_text(vlm, hf):
    """A message's text holding the image markers (a forged image, no image behind it) encodes
    as plain text: the ids hold one pad per real image, and the markers read back verbatim."""
    from trajectory import encode, render, with_images
    tok, it = hf[2], vision.ImageTokens(vlm)
    forged = "<|vision_start|><|image_pad|><|vision_end|>"
    uris = it.uris([_img(56, 84, (0, 0, 255))])
    ids = encode(tok, render(tok, with_images([{"role": "user", "content": f"Which? {forged}"}], uris), True))
    assert ids.count(PAD) == 1 and forged in tok.decode(ids)
    assert it.expand(ids, uris).count(PAD) == 6


def test_vllm_matches_transformers(engine, hf, loop):
    """The heart: vLLM gets one pad per image; its expanded prompt ids equal ours; its sampled
    tokens' logprobs equal a batched transformers forward on the expanded ids + pixels."""
    model, processor, tok = hf
    red, blue, green = _img(112, 112, (255, 0, 0)), _img(56, 84, (0, 0, 255)), _img(84, 56, (0, 160, 0))
    vision_ids = {model.config.image_token_id, model.config.video_token_id,
                  model.config.vision_start_token_id, model.config.vision_end_token_id}
    rows = []

    # Two adjacent images of different sizes in one prompt.
    ids = _ids(tok, [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                  {"type": "text", "text": "What colour is the square?"}]}],
               add_generation_prompt=True)
    rows.append({**_generate(engine, loop, ids, [red, blue], seed=1), "images": [red, blue], "engine_ids": ids})

    # Multi-turn: a text turn, the assistant's sampled answer, then an observation with an image.
    first = _ids(tok, [{"role": "user", "content": "Look at the next picture."}], add_generation_prompt=True)
    turn1 = _generate(engine, loop, first, [], seed=2, max_tokens=3)
    rows.append({**turn1, "images": []})
    observation = tok.encode("<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
                             "And this one?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    trace = turn1["prompt"] + turn1["tokens"] + observation  # token-exact: only appends
    engine_ids = vision.collapse_image_pads(trace, PAD)
    rows.append({**_generate(engine, loop, engine_ids, [green], seed=3), "images": [green], "engine_ids": engine_ids})
    assert rows[-1]["prompt"] == trace[:-len(observation)] + vision.expand_image_pads(
        observation, PAD, vision.image_inputs(processor, [green])["counts"])

    # One image, then an image-bearing observation after the sampled turn (two images, two turns).
    ids = _ids(tok, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
               add_generation_prompt=True)
    turn1 = _generate(engine, loop, ids, [red], seed=4, max_tokens=3)
    rows.append({**turn1, "images": [red], "engine_ids": ids})
    trace = turn1["prompt"] + turn1["tokens"] + observation
    engine_ids = vision.collapse_image_pads(trace, PAD)
    rows.append({**_generate(engine, loop, engine_ids, [red, blue], seed=5), "images": [red, blue],
                 "engine_ids": engine_ids})

    for r in rows:
        assert not vision_ids & set(r["tokens"]), "a sampled vision token would break the image count; change seed"
        if r["images"]:  # vLLM expanded exactly as the HF processor does
            counts = vision.image_inputs(processor, r["images"])["counts"]
            assert r["prompt"] == vision.expand_image_pads(r["engine_ids"], PAD, counts)
    ours = _hf_logprobs(model, processor, rows)
    gaps = [abs(a - b) for r, o in zip(rows, ours) for a, b in zip(r["logprobs"], o)]
    assert len(gaps) >= 20 and sum(gaps) / len(gaps) <= 1e-4 and max(gaps) < 1e-3, (sum(gaps) / len(gaps), max(gaps))


# ------------------------------------------------ the product path: agents, trainer, weight sync

TEMPERATURE = 0.7


def _uri(w, h, rgb):
    return vision.to_data_uri(_img(w, h, rgb))


class TwoPictures(agents.Env):
    """Turn 0 sees the row's image; its observation shows a second one (Result.images)."""
    max_turns = 2

    async def step(self, state):
        if state.turn == 0:
            return agents.Result(reward=0.0, observation="And this one?", images=[_uri(56, 84, (0, 0, 255))],
                                 terminated=False)
        return agents.Result(reward=float("blue" in state.action))


def _env_rollouts(gen, loop, tok, image_tokens, n: int, seed0: int = 0) -> list[dict]:
    """n two-turn rollouts (a rollout that samples a vision token is dropped, as in the loop)."""
    row = {"prompt": "What colour is the <image> square?", "images": [_uri(112, 112, (255, 0, 0))]}

    async def one(seed):
        try:
            return await agents.run_env(TwoPictures(), row, gen.generate, tok,
                                        sampling={"temperature": TEMPERATURE, "max_tokens": 3, "seed": seed},
                                        max_len=512, image_tokens=image_tokens, max_images=4)
        except trajectory.DropRollout:
            return None
    async def every():
        return await asyncio.gather(*[one(seed0 + s) for s in range(2 * n)])
    got = loop.run_until_complete(every())
    trajs = [asdict(t) for t in got if t is not None][:n]
    for i, t in enumerate(trajs):
        t.update(group=0, rollout_id=i, reward=float(i % 2))
    return trajs


def _gap(trainer, trajs) -> float:
    recomputed = trainer_logprobs(trainer, trajs)
    gaps = [abs(r[t - 1] - tr["logprobs"][t]) for tr, r in zip(trajs, recomputed)
            for t in range(1, len(tr["tokens"])) if tr["mask"][t]]
    return sum(gaps) / len(gaps)


@pytest.fixture(scope="module")
def trainer(vlm):
    from test_engine import trainer_cfg
    from trainer import Trainer
    use_cpu_shims()
    return Trainer(trainer_cfg(vlm, trust_remote_code=True))


def test_env_turns_with_images_are_token_exact_and_sync(gen, trainer, vlm, hf, loop):
    """A two-turn Env whose observation carries an image: the trace holds both images'
    expanded pads in order, the trainer (pixel inputs from the trajectory's images) gives the
    sampling logprobs, and after a train step + weight sync it still does (the tied LM head
    of vLLM's Qwen2.5-VL is re-packed after the reload: without that the gap was ~1e-2)."""
    _, _, tok = hf
    image_tokens = vision.ImageTokens(vlm)
    loop.run_until_complete(gen.update_weights(trainer.weights_blob(), trainer.version))
    trajs = _env_rollouts(gen, loop, tok, image_tokens, 6)
    assert len(trajs) >= 4
    for t in trajs:
        assert len(t["images"]) == 2 and t["tokens"].count(PAD) == 16 + 6
        assert t["info"]["turns"] == 2 and sum(t["mask"]) >= 2
        assert vision.collapse_image_pads(t["tokens"], PAD).count(PAD) == 2
    assert _gap(trainer, trajs) < 1e-4

    trainer.train_step(trajs)
    stale = _env_rollouts(gen, loop, tok, image_tokens, 4, seed0=100)
    assert _gap(trainer, stale) > 1e-3  # the engine still has the old weights
    sync = loop.run_until_complete(gen.update_weights(trainer.weights_blob(), trainer.version))
    assert sync["missing"] == []
    assert _gap(trainer, _env_rollouts(gen, loop, tok, image_tokens, 4, seed0=200)) < 1e-4


def test_freeze_vision_keeps_the_tower_out_of_the_step_and_the_sync(vlm, hf, gen, loop):
    from test_engine import trainer_cfg
    from trainer import Trainer
    _, _, tok = hf
    frozen = Trainer(trainer_cfg(vlm, trust_remote_code=True, freeze_vision=True))
    before = {k: v.clone() for k, v in frozen.full_state_dict().items()}
    # Earlier tests trained the engine's tower: give it this trainer's (as at a run's start).
    loop.run_until_complete(gen.update_weights(safetensors.torch.save(before), 0))
    trajs = _env_rollouts(gen, loop, tok, vision.ImageTokens(vlm), 4, seed0=300)
    frozen.train_step(trajs)
    after = frozen.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("model.visual."))
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("model.language_model."))
    assert not any(k.startswith("model.visual.") for k in frozen.sync_state_dict())
    loop.run_until_complete(gen.update_weights(frozen.weights_blob(), 1))  # text side only
    assert _gap(frozen, _env_rollouts(gen, loop, tok, vision.ImageTokens(vlm), 4, seed0=400)) < 1e-4


class LookTwice(agents.ChatAgent):
    """Two requests through a stock SDK: the row's picture, then a second one in a new user turn."""
    api = "openai"

    async def run(self, ctx):
        blue = _uri(56, 84, (0, 0, 255))
        if self.api == "openai":
            import openai
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            messages = list(ctx.messages)
            first = await client.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=3)
            messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                         {"role": "user", "content": [{"type": "image_url", "image_url": {"url": blue}},
                                                      {"type": "text", "text": "And this one?"}]}]
            await client.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=3)
        else:
            import anthropic
            client = anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key, max_retries=0)

            def block(uri):
                media, data = uri[len("data:"):].split(";base64,")
                return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
            red = ctx.row["images"][0]
            messages = [{"role": "user", "content": [block(red), {"type": "text", "text": "Colour?"}]}]
            first = await client.messages.create(model=ctx.model_name, messages=messages, max_tokens=3)
            text = "".join(b.text for b in first.content if b.type == "text")
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": [block(blue), {"type": "text", "text": "And this one?"}]}]
            await client.messages.create(model=ctx.model_name, messages=messages, max_tokens=3)
        return agents.Result(reward=1.0)


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_chat_agent_images_are_token_exact(api, gen, trainer, vlm, hf, loop):
    """OpenAI image_url parts and Anthropic image blocks (data URIs / base64) reach the engine as
    images; the two requests stitch into one segment holding both images, token-exact."""
    _, _, tok = hf
    loop.run_until_complete(gen.update_weights(trainer.weights_blob(), trainer.version))
    server = ChatServer()
    loop.run_until_complete(server.start())
    agent_cls = type(f"Look_{api}", (LookTwice,), {"api": api})
    row = {"prompt": "Colour?", "images": [_uri(112, 112, (255, 0, 0))]}
    trajs = []
    try:
        for seed in range(8):
            try:
                segs = loop.run_until_complete(agents.run_chat_agent(
                    agent_cls(), row, gen.generate, tok, server, max_len=512, image_tokens=vision.ImageTokens(vlm),
                    sampling={"temperature": TEMPERATURE, "max_tokens": 3, "seed": seed}))
            except trajectory.DropRollout:
                continue
            assert len(segs) == 1 and len(segs[0].images) == 2 and segs[0].tokens.count(PAD) == 16 + 6
            assert segs[0].info["requests"] == 2
            trajs.append({**asdict(segs[0]), "group": 0, "rollout_id": seed})
            if len(trajs) == 3:
                break
    finally:
        loop.run_until_complete(server.stop())
    assert len(trajs) == 3
    assert _gap(trainer, trajs) < 1e-4


# ------------------------------------------------ the whole loop

def test_loop_trains_a_vlm_from_an_image_dataset(vlm, tmp_path):
    """main.py end to end: a JSONL dataset whose rows carry image files (`<image>` in the
    prompt; one text-only row), the vision_colour agent, two FSDP2 ranks (a micro-batch without
    images gets a blank-image row, so both ranks run the sharded vision blocks), weight sync by
    broadcast; every step's engine/trainer gap stays at fp32 noise; the export is a complete
    VLM folder."""
    import json

    import main
    from transformers import AutoModelForImageTextToText
    rows = []
    for name, rgb in (("red", (220, 30, 30)), ("blue", (30, 30, 220)), ("green", (30, 170, 30))):
        path = tmp_path / f"{name}.png"
        Image.new("RGB", (56, 56), rgb).save(path)
        rows.append({"question": "What colour is the picture? <image> Answer with one word.",
                     "pictures": [str(path)], "label": name})
    rows.append({"question": "Name the colour of grass in one word.", "label": "green"})
    dataset = tmp_path / "colours.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    use_cpu_shims()
    summary = main.main(["--model", vlm, "--trust_remote_code", "--dataset", str(dataset), "--input_key", "question",
                         "--image_key", "pictures", "--agent", str(EXAMPLES / "vision_colour.py"),
                         "--max_new_tokens", "1", "--steps", "3", "--prompts_per_step", "4",
                         "--samples_per_prompt", "4", "--mini_batches", "2", "--weight_sync", "broadcast",
                         "--train_workers", "2", "--micro_batch_size", "2",
                         "--output_dir", str(out), "--export_hf", str(out / "final"), "--no_plot", "--quiet"])
    assert summary["steps"] == 3
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["mismatch_abs"] < 1e-4 for m in lines), [m["mismatch_abs"] for m in lines]
    assert (out / "final" / "preprocessor_config.json").is_file()
    AutoModelForImageTextToText.from_pretrained(out / "final")


@pytest.mark.parametrize("flags, message", [
    (["--packing"], "--packing is not supported for vision-language models"),
    (["--train_workers", "2", "--tp_size", "2"], "train with data parallelism"),
    # counted with its image expanded to 4 tokens (the rendered prompt has one pad)
    (["--agent", str(EXAMPLES / "vision_colour.py"), "--max_len", "40"], "is 42 tokens"),
])
def test_vlm_refuses_what_it_cannot_do(vlm, flags, message):
    import main
    use_cpu_shims()
    with pytest.raises(ValueError, match=message):
        main.validate(vars(main.build_parser().parse_args(["--model", vlm, "--trust_remote_code", *flags])))


def test_freeze_vision_needs_a_vlm(tiny_model):
    import main
    with pytest.raises(ValueError, match="--freeze_vision applies to vision-language models only"):
        main.validate(vars(main.build_parser().parse_args(["--model", tiny_model, "--freeze_vision"])))


def test_image_rows_are_checked_at_load(tmp_path):
    import json

    import data
    bad = [({"prompt": "x", "images": "https://example.com/a.png"}, "image URLs are refused"),
           ({"prompt": "x", "images": ["missing.png"]}, "no image file"),
           ({"prompt": "x", "images": [1]}, "must be a path, data URI or base64"),
           ({"prompt": "x", "images": [_uri(56, 56, (1, 2, 3))] * 3}, "more than --max_images_per_prompt 2")]
    for row, message in bad:
        path = tmp_path / "d.jsonl"
        path.write_text(json.dumps(row) + "\n")
        with pytest.raises(ValueError, match=message):
            data.load_rows(str(path), max_images=2)
    assert trajectory.with_images(trajectory.prompt_messages("a <image> b <image>"), ["x", "y"])[0]["content"] == [
        {"type": "text", "text": "a "}, {"type": "image"}, {"type": "text", "text": " b "}, {"type": "image"}]
    assert trajectory.with_images(trajectory.prompt_messages("plain"), ["x"])[0]["content"] == [
        {"type": "image"}, {"type": "text", "text": "plain"}]
    with pytest.raises(ValueError, match="2 image places"):
        trajectory.with_images(trajectory.prompt_messages("a <image> b <image>"), ["x"])
    with pytest.raises(ValueError, match="no images"):
        trajectory.with_images([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}], [])


def _vlm_trajectories(vlm, tok) -> list[dict]:
    """One long trajectory with an image, three short text-only ones (token-exact shapes)."""
    image_tokens = vision.ImageTokens(vlm)
    red = _uri(112, 112, (255, 0, 0))
    reply = tok.encode(" red", add_special_tokens=False) + [tok.eos_token_id]
    trajs = []
    for i, (content, images) in enumerate([([{"type": "image"}, {"type": "text", "text": "Colour?"}], [red]),
                                           ("Colour of blood?", []), ("Colour?", []), ("Sky?", [])]):
        prompt = list(tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                              tokenize=True)["input_ids"])
        prompt = image_tokens.expand(prompt, images) if images else prompt
        trajs.append({"tokens": prompt + reply, "mask": [0] * len(prompt) + [1] * len(reply),
                      "logprobs": [0.0] * len(prompt) + [-2.5] * len(reply),
                      "versions": [-1] * len(prompt) + [0] * len(reply), "images": images,
                      "reward": float(i % 2), "group": 0, "rollout_id": i})
    return trajs


def test_two_fsdp_ranks_train_a_vlm_like_one(vlm, hf, tmp_path):
    """FSDP2 shards the vision blocks too. Rank 0 gets the image row, rank 1 only text rows:
    rank 1's micro-batches get a blank-image row (else the ranks' collectives would differ);
    the update equals the single-process one."""
    from test_engine import trainer_cfg
    from test_parallel import _compare, _run_case, _sgd, _spawn
    _, _, tok = hf
    use_cpu_shims()
    trajs = _vlm_trajectories(vlm, tok)
    # SGD: AdamW would lift a near-zero gradient's 1e-9 summation-order noise to 3e-5 in a weight
    cfg = _sgd(trainer_cfg(vlm, trust_remote_code=True, lr=1e-3, mini_batches=1, micro_batch_size=1,
                           samples_per_prompt=4))
    _, ref_metrics, ref_state = _run_case(cfg, trajs)
    _spawn(2, [("vlm-dp2", {**cfg, "train_workers": 2})], trajs, tmp_path)
    _compare(torch.load(tmp_path / "vlm-dp2.pt"), ref_metrics, ref_state, "vlm-dp2")


def test_partial_rollout_with_an_image_spans_a_weight_update(gen, trainer, vlm, hf, loop):
    """Pause ("keep") mid-request, reload, resume: the image's encoder output is recomputed under
    the new weights, and each token carries the logprob of the version that sampled it. (Checked
    up to the first sampled vision token, if any: a random policy samples one now and then.)"""
    from transformers import AutoModelForImageTextToText
    _, processor, tok = hf
    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval()  # not the shared one
    image_tokens = vision.ImageTokens(vlm)
    red = _uri(112, 112, (255, 0, 0))
    prompt = list(tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                          "text": "Colour?"}]}], add_generation_prompt=True, tokenize=True)["input_ids"])
    loop.run_until_complete(gen.update_weights(trainer.weights_blob(), trainer.version))
    old_sd = {k: v.clone() for k, v in trainer.full_state_dict().items()}
    trainer.train_step(_env_rollouts(gen, loop, tok, image_tokens, 4, seed0=500))
    new_sd, old_v, new_v = trainer.full_state_dict(), trainer.version - 1, trainer.version

    async def scenario(seed):
        await gen.update_weights(safetensors.torch.save(old_sd), old_v)
        task = asyncio.create_task(gen.generate(prompt, {"temperature": TEMPERATURE, "max_tokens": 200,
                                                        "ignore_eos": True, "seed": seed}, [red]))
        await tokens_out(gen, 2)  # not a fixed sleep: on a loaded machine the prefill alone can take longer
        await gen.update_weights(trainer.weights_blob(), new_v)
        return await task
    gen.partial_rollout = True
    try:
        for seed in range(8):
            out = loop.run_until_complete(scenario(seed))
            cut = next((i for i, t in enumerate(out["token_ids"]) if t in image_tokens.vision_ids), 200)
            if {old_v, new_v} <= set(out["versions"][:cut]):
                break
        else:
            pytest.fail("no rollout spanned the update before sampling a vision token")
    finally:
        gen.partial_rollout = False
    versions = out["versions"][:cut]
    assert versions == sorted(versions)
    expanded = out["prompt_ids"]
    assert expanded == image_tokens.expand(prompt, [red])
    ids = torch.tensor([expanded + out["token_ids"][:cut]])
    kwargs = vision.mm_forward_kwargs(ids, [[red]], processor, PAD)
    for sd, v in ((old_sd, old_v), (new_sd, new_v)):
        model.load_state_dict(sd, strict=False)
        model.tie_weights()
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids, **kwargs).logits[0].float() / TEMPERATURE, -1)
        ref = lp[len(expanded) - 1:-1].gather(-1, ids[0, len(expanded):, None])[:, 0]
        mine = torch.tensor([x == v for x in versions])
        assert torch.allclose(ref[mine], torch.tensor(out["logprobs"][:cut])[mine], atol=1e-3), v
