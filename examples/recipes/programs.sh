#!/usr/bin/env bash
# RL-train the tiny model (CPU, no download) with a program agent (--agent_cmd, docs/programs.md): the
# two-turn running max of examples/agents/chat_openai.py as a separate process on the stock OpenAI SDK,
# streamed (examples/programs/running_max.py; .sh and .mjs are the same agent in bash and Node.js).
# The rows are written once to $MOLT_CACHE/running_max/{train,eval}.jsonl. Extra flags pass through, e.g.
#   bash examples/recipes/programs.sh --agent_cmd "node examples/programs/running_max.mjs"
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
rows=${MOLT_CACHE:-$HOME/.cache/molt}/running_max
mkdir -p "$rows"
[ -f "$rows/eval.jsonl" ] || "$PY" -c "import itertools, json, sys; sys.path[:0] = ['.']; import agent
cls = agent.load_agent('examples/agents/chat_openai.py')
for name, seed, n in (('train', 0, 5000), ('eval', 1, 64)):
    open(f'$rows/{name}.jsonl', 'w').writelines(json.dumps(r) + '\\n' for r in itertools.islice(cls.prompts(seed), n))"
exec "$PY" main.py --agent_cmd "$PY examples/programs/running_max.py" --dataset "$rows/train.jsonl" \
  --prompts_per_step 16 --samples_per_prompt 8 --max_new_tokens 3 --max_len 64 \
  --steps 60 --eval_every 20 --eval_dataset "$rows/eval.jsonl" \
  --output_dir runs/programs \
  "$@"
