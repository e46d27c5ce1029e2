// A program agent (--agent_cmd) in Node.js on the `openai` npm package (install.sh installs it here):
// the two-turn running max of examples/programs/running_max.py. The SDK reads OPENAI_BASE_URL and
// OPENAI_API_KEY by itself; the row comes as JSON on stdin; the reward goes out on stdout's last line.
import OpenAI from "openai";

let input = "";
for await (const chunk of process.stdin) input += chunk;
const row = JSON.parse(input);
const client = new OpenAI({ maxRetries: 0 });

async function ask(messages) {
  const stream = await client.chat.completions.create({ model: "policy", messages, max_tokens: 4, stream: true });
  let text = "", finish = null;
  for await (const chunk of stream) {
    text += chunk.choices[0]?.delta?.content ?? "";
    finish = chunk.choices[0]?.finish_reason ?? finish;
  }
  return [text, finish];
}

const messages = [{ role: "user", content: row.prompt }];
const [first] = await ask(messages);
messages.push({ role: "assistant", content: first }, { role: "user", content: row.label.follow_up });
const [final, finish] = await ask(messages);
console.log(JSON.stringify({ reward: Number(final === row.label.answer && finish === "stop"),
                             info: { first_right: Number(first === row.label.first) } }));
