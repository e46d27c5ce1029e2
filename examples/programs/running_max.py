"""A program agent (--agent_cmd) on the stock OpenAI SDK, streamed: examples/agents/chat_openai.py's
two-turn running max as a separate process. The SDK finds the server and this rollout's key in
OPENAI_BASE_URL / OPENAI_API_KEY by itself; the row comes as JSON on stdin; the reward goes out as
a JSON object on the last line of stdout (docs/programs.md).

    bash examples/recipes/programs.sh      # writes the rows, then trains this program
"""

import json
import sys

import openai


def ask(client, messages) -> tuple[str, str]:
    """(the reply's text, its finish reason), streamed."""
    text, finish = "", None
    for chunk in client.chat.completions.create(model="policy", messages=messages, max_tokens=4, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


row = json.loads(sys.stdin.readline())
client = openai.OpenAI(max_retries=0)
messages = [{"role": "user", "content": row["prompt"]}]
first, _ = ask(client, messages)
messages += [{"role": "assistant", "content": first}, {"role": "user", "content": row["label"]["follow_up"]}]
final, finish = ask(client, messages)
print(json.dumps({"reward": float(final == row["label"]["answer"] and finish == "stop"),
                  "info": {"first_right": float(first == row["label"]["first"])}}))
