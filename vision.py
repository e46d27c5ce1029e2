"""Vision-language policies: the one image-token convention, image inputs, and a tiny offline Qwen2.5-VL.

The convention (docs/vision.md): the engine gets ONE `<|image_pad|>` per image (between `<|vision_start|>` and
`<|vision_end|>`) and the images beside the ids; vLLM expands each pad to the image's patch-group count. Trajectories
and the trainer hold the EXPANDED ids (what vLLM returns and the HF processor produces), and the trainer gets pixel
inputs from the same images (`mm_forward_kwargs`). `collapse_image_pads` turns stored ids back into engine ids for the
next turn: vLLM would silently expand already-expanded pads again, so never skip it.

    python -c "import vision; vision.build_tiny_vlm('/tmp/tiny-vlm')"   # the tiny model
    python -m pytest -q tests/test_vision.py                            # vLLM vs transformers

CPU machines without torchvision need two shims (`VIDEO_STUB`, `examples/vlm_shims/sitecustomize.py`);
both do nothing where torchvision works.
"""

import base64
import functools
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any, Union

import torch
from PIL import Image

ImageSpec = Union[Image.Image, str, bytes]

# Qwen2-VL's special tokens (a subset), appended after the byte-level BPE vocabulary.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_PAD, VISION_START, VISION_END = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"
TEXT_VOCAB = 448  # byte alphabet (256) + merges: small, so a random policy finds answers by chance

# Qwen2.5-VL's chat template, shortened (no default system prompt, no "Picture N:" labels):
# each image content part becomes <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

COLOURS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple"]
SHAPES = ["square", "circle", "triangle", "cross"]
# The BPE training text: digits, colour/shape words and the chat roles, so that those
# words (with and without a leading space) end up as single tokens.
CORPUS = [
    *(f"{c} {s}. The {s} is {c}. A {c} one. {c.capitalize()}" for c in COLOURS for s in SHAPES),
    *(f"{i} {i}{j} {i}+{j}={i + j}" for i in range(10) for j in range(10)),
    "user assistant system What colour is the square? Which shape is it? Answer with one word.",
    "How many? Left right top bottom. yes no",
] * 4

# Image sizes: 56x56 (min) -> grid [1, 4, 4] -> 4 tokens; 112x112 (max) -> grid [1, 8, 8] -> 16 tokens.
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112

# CPU-machine shim, written into the model folder and registered with `auto_map` (load with
# `trust_remote_code=True`): every Qwen-VL processor also loads a video processor, which needs
# torchvision. Where torchvision imports it IS the real one; elsewhere it loads and refuses videos.
VIDEO_STUB = '''"""CPU-machine shim: the real Qwen2-VL video processor where torchvision works, else a stub."""
try:
    import torchvision  # noqa: F401
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor as VideoProcessor
except Exception:  # no (working) torchvision: images still work, videos do not
    import transformers
    from transformers.video_processing_utils import BaseVideoProcessor, VideoProcessorMixin

    # ProcessorMixin checks the video processor's class by the name
    # `transformers.VideoProcessorMixin`, which transformers exports only with torchvision.
    if not hasattr(transformers, "VideoProcessorMixin"):
        setattr(transformers, "VideoProcessorMixin", VideoProcessorMixin)

    class VideoProcessor(BaseVideoProcessor):
        patch_size, temporal_patch_size, merge_size = 14, 2, 2

        def preprocess(self, videos, **kwargs):
            raise NotImplementedError("video input needs torchvision (this is the CPU-machine stub)")
'''


def build_tiny_vlm(path: str, seed: int = 0) -> str:
    """Build (once) a ~0.6M-parameter random-init Qwen2.5-VL with an offline byte-level BPE tokenizer and
    PIL image processor at `path` (the same `seed` gives the same bytes). transformers and vLLM load it offline
    (`AutoProcessor` and vLLM with `trust_remote_code=True`, for the video processor shim)."""
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    out = Path(path)
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return str(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = PreTrainedTokenizerFast(tokenizer_object=_train_bpe(), eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})  # already in the vocab: ids unchanged
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    ends = dict(bos_token_id=None, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,  # head_dim 32: vLLM-CPU's smallest
                         max_position_embeddings=1024, **ends,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [4, 6, 6]}),  # sums to head_dim / 2
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[1], out_hidden_size=128),
        # Processors find these tokens by string; the model by id: they must agree.
        image_token_id=ids[IMAGE_PAD], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True, **ends,
    )
    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(tmp)
    # The PIL class by name: the same pixels on machines with and without torchvision.
    pre = json.loads((tmp / "preprocessor_config.json").read_text())
    pre["image_processor_type"] = "Qwen2VLImageProcessorPil"
    (tmp / "cpu_video_processor.py").write_text(VIDEO_STUB)
    video = {"video_processor_type": "Qwen2VLVideoProcessor",
             "auto_map": {"AutoVideoProcessor": "cpu_video_processor.VideoProcessor"},
             "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
             "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}}
    for name, fields in (("preprocessor_config.json", pre), ("video_preprocessor_config.json", video)):
        (tmp / name).write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    (tmp / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}) + "\n")
    tmp.rename(out)  # atomic: a half-built folder is never reused
    return str(out)


def _train_bpe():
    """A byte-level BPE with TEXT_VOCAB tokens trained on CORPUS, the SPECIALS appended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TEXT_VOCAB, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_special_tokens(SPECIALS)  # ids TEXT_VOCAB.. in SPECIALS order
    return tok


def load_image(spec: ImageSpec) -> Image.Image:
    """An RGB PIL image from a PIL image, a local path, a `data:image/...;base64,` URI or raw base64.
    URLs are refused: runs are offline and a rollout must not depend on the network."""
    if isinstance(spec, Image.Image):
        return spec.convert("RGB")
    if isinstance(spec, bytes):
        return Image.open(io.BytesIO(spec)).convert("RGB")
    if not isinstance(spec, str):
        raise TypeError(f"an image is a PIL image, a path, a data URI or base64, not {type(spec).__name__}")
    if spec.startswith(("http://", "https://")):
        raise ValueError(f"image URLs are refused (runs are offline): download {spec[:80]!r} first "
                         "and pass a local path or a data URI")
    if spec.startswith("data:"):
        header, _, payload = spec.partition(",")
        if not header.startswith("data:image/") or not header.endswith(";base64"):
            raise ValueError(f"only base64 image data URIs are supported, got {header[:40]!r}")
        return Image.open(io.BytesIO(base64.b64decode(payload))).convert("RGB")
    if os.path.isfile(spec):  # False (no OSError) for raw base64 longer than a file name may be
        return Image.open(spec).convert("RGB")
    try:
        raw = base64.b64decode(spec, validate=True)
    except ValueError:
        raise ValueError(f"not an image file, data URI or base64: {spec[:80]!r}") from None
    return Image.open(io.BytesIO(raw)).convert("RGB")


def to_data_uri(image: ImageSpec) -> str:
    """A PNG data URI (lossless, JSON-friendly: rollout dumps and chat messages carry it)."""
    buf = io.BytesIO()
    load_image(image).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def collapse_image_pads(ids: list[int], pad_id: int) -> list[int]:
    """Expanded (trainer) ids -> engine ids: each run of image pads becomes one pad. The template closes every
    image with <|vision_end|> and opens the next with <|vision_start|>, so two images never form one run."""
    return [t for i, t in enumerate(ids) if t != pad_id or i == 0 or ids[i - 1] != pad_id]


def expand_image_pads(ids: list[int], pad_id: int, counts: list[int]) -> list[int]:
    """Engine ids -> expanded ids: the i-th pad becomes counts[i] pads (what vLLM and the HF
    processor do; `ImageTokens.expand`, for the ids a trajectory records)."""
    if sum(t == pad_id for t in ids) != len(counts):
        raise ValueError(f"{sum(t == pad_id for t in ids)} image pads for {len(counts)} images")
    it = iter(counts)
    return [p for t in ids for p in ([t] * next(it) if t == pad_id else [t])]


@functools.lru_cache(maxsize=None)
def image_tokens(model: str) -> "ImageTokens | None":
    """The rollout side's ImageTokens of a vision-language model folder (loaded once); None for a text model."""
    from transformers import AutoConfig
    return ImageTokens(model) if hasattr(AutoConfig.from_pretrained(model), "vision_config") else None


class ImageTokens:
    """The convention bound to one model folder (its image processor and pad id), as the
    rollout side uses it: images travel as PNG data URIs (`uris`), trajectories hold expanded
    ids (`expand`), the engine gets one pad per image (`engine_ids`)."""

    def __init__(self, model: str):
        from transformers import AutoConfig, AutoImageProcessor
        config = AutoConfig.from_pretrained(model)
        self.pad_id: int = config.image_token_id
        # Tokens only the template writes: a rollout that samples one cannot be trained on
        # (its pads would no longer match its images), so it is dropped.
        self.vision_ids = {getattr(config, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                         "vision_end_token_id") if getattr(config, k, None) is not None}
        self.image_processor = AutoImageProcessor.from_pretrained(model)

    def uris(self, images: list[ImageSpec] | None) -> list[str]:
        """Each image as a PNG data URI (data URIs pass through untouched)."""
        return [i if isinstance(i, str) and i.startswith("data:image/") else to_data_uri(i) for i in images or []]

    def counts(self, images: list[ImageSpec]) -> list[int]:
        """Expanded pads per image, from its size alone (no pixel processing)."""
        merge = self.image_processor.merge_size
        return [self.image_processor.get_number_of_image_patches(img.height, img.width) // merge ** 2
                for img in map(load_image, images)]

    def expand(self, ids: list[int], images: list[ImageSpec]) -> list[int]:
        return expand_image_pads(ids, self.pad_id, self.counts(images))

    def engine_ids(self, ids: list[int]) -> list[int]:
        return collapse_image_pads(ids, self.pad_id)


def image_inputs(processor, images: list[ImageSpec]) -> dict[str, Any]:
    """Pixel inputs of `images` (in order) for transformers: pixel_values [patches, C*T*P*P],
    image_grid_thw [n, 3] and counts (expanded pads per image). `processor` is the
    AutoProcessor or its image processor; both vLLM and the trainer use the model folder's."""
    image_processor = getattr(processor, "image_processor", processor)
    out = image_processor(images=[load_image(i) for i in images], return_tensors="pt")
    grid = out["image_grid_thw"]                                                  # [n, 3] (t, h, w) patches
    counts = (grid.prod(-1) // image_processor.merge_size ** 2).tolist()          # 2x2 patches -> 1 token
    return {"pixel_values": out["pixel_values"], "image_grid_thw": grid, "counts": counts}


def trainer_parts(model: str, config) -> tuple:
    """A VLM trainer's image processor and image token id, and a blank image with its expanded ids (the row a
    rank adds when its micro-batch has no image: every rank must run the FSDP-sharded vision blocks)."""
    from transformers import AutoImageProcessor
    processor = AutoImageProcessor.from_pretrained(model)
    blank = to_data_uri(Image.new("RGB", (56, 56)))
    count = image_inputs(processor, [blank])["counts"][0]
    return (processor, config.image_token_id, blank,
            [config.vision_start_token_id] + [config.image_token_id] * count + [config.vision_end_token_id])


def mm_forward_kwargs(input_ids: torch.Tensor, images: list[list[ImageSpec]], processor,
                      image_token_id: int) -> dict[str, torch.Tensor]:
    """Extra forward kwargs of a [B, T] batch of expanded ids whose row b shows images[b] (possibly none).
    Qwen2.5-VL's forward takes pixel_values and image_grid_thw flat over the batch (row 0's images, then row 1's,
    ...) and places them by the pads in input_ids, so a row must hold all its pads (no CP chunks, no packing).
    mm_token_type_ids (1 on image pads) makes it compute the 3D (M-RoPE) positions that vLLM uses; without it text
    after an image gets 1D positions. Right padding needs no attention mask (causal)."""
    flat = [img for row in images for img in row]
    kwargs: dict[str, torch.Tensor] = {"mm_token_type_ids": (input_ids == image_token_id).int()}  # [B, T]
    if not flat:
        return kwargs
    inputs = image_inputs(processor, flat)
    it = iter(inputs["counts"])
    for b, row in enumerate(images):
        want, have = sum(next(it) for _ in row), int((input_ids[b] == image_token_id).sum())
        if want != have:
            raise ValueError(f"row {b}: {have} image pads in the ids, {want} for its {len(row)} image(s)")
    return {**kwargs, "pixel_values": inputs["pixel_values"],             # [sum patches, 1176]
            "image_grid_thw": inputs["image_grid_thw"]}                   # [sum images, 3]
