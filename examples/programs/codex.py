"""Codex CLI (npm `@openai/codex`, pinned in package.json) as a program agent (--agent_cmd): `codex exec`, unchanged,
does the row's task in the rollout's folder; a check of the folder is the reward (rows as in mini_swe_agent.py).

Only Codex's configuration is written ($HOME/.codex/config.toml; HOME is the rollout's folder): a Responses provider
at OPENAI_BASE_URL with this rollout's key, a one-line system prompt, extra tools, skills and context blocks off (the
first request: 1,108 tokens on SmolLM2's template), its own sandbox and approvals off (the rollout's sandbox wraps it).

    python main.py --model smollm2 --agent_cmd "python $PWD/examples/programs/codex.py" \
        --dataset tasks.jsonl --max_len 8192
"""

import json
import os
import subprocess
import sys
from pathlib import Path

row = json.loads(sys.stdin.readline())
codex = Path(__file__).resolve().parent / "node_modules" / ".bin" / "codex"
codex.is_file() or sys.exit("Codex CLI is not installed: run `bash install.sh` (its npm install)")
home = Path.home() / ".codex"
home.mkdir(exist_ok=True)
(home / "instructions.md").write_text("You are a coding agent. Run shell commands to do the task.\n")
(home / "config.toml").write_text(f"""model = "policy"
model_provider = "molt"
model_instructions_file = {json.dumps(str(home / "instructions.md"))}
web_search = "disabled"
include_permissions_instructions = false
include_environment_context = false
skills.include_instructions = false
features = {{ multi_agent = false, goals = false, view_image = false, apps = false, plugins = false }}
[model_providers.molt]
name = "molt"
base_url = {json.dumps(os.environ["OPENAI_BASE_URL"])}
wire_api = "responses"
env_key = "OPENAI_API_KEY"
""")
done = subprocess.run([codex, "exec", "--strict-config", "--skip-git-repo-check", "--ephemeral", "--color", "never",
                       "--dangerously-bypass-approvals-and-sandbox", row["prompt"]],
                      stdin=subprocess.DEVNULL, stdout=sys.stderr)   # its console output: stderr
if row.get("task"):   # a Harbor task (--dataset examples/tasks): its tests/test.sh gives the reward
    sys.exit(done.returncode)
target = Path(row["label"]["file"])
right = target.is_file() and target.read_text().strip() == row["label"]["content"]
print(json.dumps({"reward": float(right), "info": {"codex_exit": done.returncode}}))
