#!/usr/bin/env bash
# A program agent (--agent_cmd) in bash with curl: the running max of examples/programs/running_max.py,
# one turn (is the reply max(a, b)?). No SDK: the server's URL and this rollout's key come in
# OPENAI_BASE_URL / OPENAI_API_KEY, the row as JSON on stdin, the reward goes out on stdout's last line.
set -euo pipefail
read -r row
string='("([^"\\]|\\.)*")'                          # a JSON string, kept encoded
[[ $row =~ \"prompt\":\ *$string ]] && prompt=${BASH_REMATCH[1]}
[[ $row =~ \"first\":\ *$string ]] && first=${BASH_REMATCH[1]}
reply=$(curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" -H "Authorization: Bearer $OPENAI_API_KEY" \
  -H "Content-Type: application/json" \
  -d "{\"model\": \"policy\", \"max_tokens\": 4, \"messages\": [{\"role\": \"user\", \"content\": $prompt}]}")
[[ $reply =~ \"content\":\ *$string ]] && said=${BASH_REMATCH[1]}
[[ $reply =~ \"finish_reason\":\ *\"stop\" && $said == "$first" ]] && reward=1 || reward=0
echo "{\"reward\": $reward}"
