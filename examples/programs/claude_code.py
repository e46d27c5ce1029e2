"""Claude Code (npm `@anthropic-ai/claude-code`, pinned in package.json) as a program agent (--agent_cmd): `claude -p`,
unchanged, does the row's task in the rollout's folder; a check of the folder is the reward (rows: mini_swe_agent.py's).

Claude Code finds the server and key in ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY; this wrapper sets a one-line system
prompt, the Bash tool alone, permission prompts off (the rollout's sandbox wraps it), any model name (the server echoes
it), no updates, telemetry, attribution or deferred-tool placeholder (the first request: 1,409 tokens on SmolLM2's).

    python main.py --model smollm2 --agent_cmd "python $PWD/examples/programs/claude_code.py" \
        --dataset tasks.jsonl --max_len 8192
"""

import json
import os
import subprocess
import sys
from pathlib import Path

row = json.loads(sys.stdin.readline())
claude = Path(__file__).resolve().parent / "node_modules" / ".bin" / "claude"
claude.is_file() or sys.exit("Claude Code is not installed: run `bash install.sh` (its npm install)")
env = {**os.environ, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
       "CLAUDE_CODE_ATTRIBUTION_HEADER": "0", "ENABLE_TOOL_SEARCH": "false"}
done = subprocess.run([claude, "-p", row["prompt"], "--model", "policy", "--tools", "Bash", "--dangerously-skip-permissions",
                       "--system-prompt", "You are a coding agent. Run shell commands to do the task.",
                       "--no-session-persistence", "--settings", json.dumps({"attribution": {"commit": "", "pr": ""}})],
                      env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr)   # its console output: stderr
if row.get("task"):   # a Harbor task (--dataset examples/tasks): its tests/test.sh gives the reward
    sys.exit(done.returncode)
target = Path(row["label"]["file"])
right = target.is_file() and target.read_text().strip() == row["label"]["content"]
print(json.dumps({"reward": float(right), "info": {"claude_exit": done.returncode}}))
