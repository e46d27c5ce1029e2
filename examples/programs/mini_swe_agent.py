"""mini-swe-agent (PyPI `mini-swe-agent`) as a program agent (--agent_cmd): its own `mini` CLI, unchanged,
solves the row's task in the rollout's fresh folder; a check of that folder computes the reward.

mini-swe-agent calls the model through LiteLLM, which finds the server and this rollout's key in
OPENAI_BASE_URL / OPENAI_API_KEY by itself (set by the framework); this wrapper only names the model
for LiteLLM's OpenAI route (MSWEA_MODEL_NAME=openai/policy) and skips mini's first-run set-up and
cost lookup. A row: {"prompt": TASK, "label": {"file": NAME, "content": TEXT}}; the reward is 1 when
the folder then holds NAME with exactly TEXT (stripped). Steps are capped by MINI_STEPS (default 3).

    python main.py --model smollm2 --agent_cmd "python examples/programs/mini_swe_agent.py" \
        --dataset tasks.jsonl --max_len 4096 --max_new_tokens 64
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

row = json.loads(sys.stdin.readline())
env = {**os.environ, "MSWEA_MODEL_NAME": "openai/policy", "MSWEA_CONFIGURED": "true",
       "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_SILENT_STARTUP": "1"}
mini = shutil.which("mini") or sys.exit("mini-swe-agent is not installed: pip install mini-swe-agent")
done = subprocess.run([mini, "--agent-class", "default", "--environment-class", "local", "--yolo",
                       "--exit-immediately", "-c", "mini.yaml", "-c", f"agent.step_limit={os.environ.get('MINI_STEPS', 3)}",
                       "-c", "agent.cost_limit=0", "-o", str(Path.cwd() / ".trajectory.json"), "-t", row["prompt"]],
                      env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr)   # its console output: stderr
if row.get("task"):   # a Harbor task (--dataset examples/tasks): its tests/test.sh gives the reward
    sys.exit(done.returncode)
target = Path(row["label"]["file"])
right = target.is_file() and target.read_text().strip() == row["label"]["content"]
print(json.dumps({"reward": float(right), "info": {"mini_exit": done.returncode}}))
