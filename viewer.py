"""The rollout viewer: a run's dumped rollouts as self-contained HTML pages, token by token.

    python main.py --dump_rollouts runs/latest/dump ...   # a run that dumps its batches
    python viewer.py runs/latest                          # -> runs/latest/viewer/index.html
    python viewer.py runs/latest --out /tmp/v --tokenizer PATH

It reads what the run wrote: metrics.jsonl, config.json and the --dump_rollouts folder (each line a trained trajectory
with its per-token advantages and trainer logprobs, or a dropped rollout with its reason). index.html shows the metric
curves, each step's reward distribution, best and worst rollouts, the first and last step's rollouts of one prompt
side by side, and the dropped rollouts; step_NNNNNN.html shows one step's rollouts as conversations whose sampled
tokens are coloured by advantage, sampling logprob, train/sample mismatch or policy version (hover: the values). A
page carries its data as JSON and fills a rollout in when it is opened, so large steps stay fast. No network: the CSS
and JS (assets/viewer.css, assets/viewer.js) are inlined. Optional fields, shown when present: `turn_rewards` and
`finish_reasons` (per turn), `turns` (each token's turn), `parent` (the rollout id a branch continues) and
`branch_turn` (where; else the shared token prefix).
"""

import argparse
import html
import json
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CURVES = ["reward_mean", "eval/reward_mean", "response_len", "entropy", "ref_kl_k3", "mismatch_k3"]
SHOWN = 3  # best and worst rollouts per step on the index


def dump_folder(run: Path, cfg: dict) -> Path:
    """Where the run dumped its rollouts: --dump_rollouts as given (or relative to the run), else RUN_DIR/dump."""
    given = cfg.get("dump_rollouts")
    for folder in ([Path(given), run / given] if given else []) + [run / "dump", run]:
        if any(folder.glob("step_*.jsonl")):
            return folder
    raise ValueError(f"{run}: no step_*.jsonl dumps (run with --dump_rollouts {run / 'dump'})")


def load_tokenizer(run: Path, cfg: dict, name: str | None):
    from transformers import AutoTokenizer
    for path in [name] if name else [run / "final", cfg.get("export_hf"), cfg.get("model")]:
        if path and (Path(path).is_dir() or name):
            return AutoTokenizer.from_pretrained(path)
    raise ValueError(f"{run}: no tokenizer found (no final/, and config.json's export_hf and model are not folders): "
                     "pass --tokenizer")


def prompt_text(t: dict, texts: dict[int, str]) -> str:
    """The prompt: the tokens before the first sampled one (a dropped rollout without tokens: its row's prompt)."""
    if "tokens" not in t:
        return t["prompt"] if isinstance(t.get("prompt"), str) else json.dumps(t.get("prompt"))
    first = t["mask"].index(1) if 1 in t["mask"] else len(t["mask"])
    return "".join(texts[i] for i in t["tokens"][:first])


def sampled_text(t: dict, texts: dict[int, str]) -> str:
    return "".join(texts[i] for i, m in zip(t["tokens"], t["mask"]) if m)


def page(title: str, body: str, data: dict | None = None) -> str:
    """A self-contained page: inline CSS and JS, the step's data as JSON with no markup (`<>&` as \\u escapes)."""
    css, js = ((ROOT / "assets" / f).read_text() for f in ("viewer.css", "viewer.js"))
    blob = json.dumps(data, separators=(",", ":")).translate({ord(c): f"\\u{ord(c):04x}" for c in "<>&\u2028\u2029"})
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{css}</style></head><body>{body}<script type='application/json' id='data'>{blob}</script>"
            f"<script>{js}</script></body></html>")


def svg_curve(points: list[tuple[float, float]], label: str, w: int = 300, h: int = 120, dots: bool = False) -> str:
    """A small inline SVG plot of (x, y) points: a line, or dots (one per step and y bin, sized by its count)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    sx = lambda x: 30 + (w - 40) * ((x - x0) / (x1 - x0) if x1 > x0 else 0.5)
    sy = lambda y: h - 20 - (h - 40) * ((y - y0) / (y1 - y0) if y1 > y0 else 0.5)
    if dots:  # a 512-rollout step is a few dozen circles, not 512
        bins = Counter((x, round(40 * (y - y0) / ((y1 - y0) or 1))) for x, y in points)
        most = max(bins.values())
        marks = "".join(f"<circle cx='{sx(x):.1f}' cy='{sy(y0 + b * (y1 - y0) / 40):.1f}' r='{1.5 + 3 * (n / most) ** 0.5:.1f}' "
                        f"data-n='{n}'><title>step {x:g}: {n} rollout(s)</title></circle>" for (x, b), n in bins.items())
    else:
        marks = f"<polyline points='{' '.join(f'{sx(x):.1f},{sy(y):.1f}' for x, y in points)}'/>"
    return (f"<figure class='curve'><svg width='{w}' height='{h}' data-metric='{html.escape(label)}'>{marks}"
            f"<text x='2' y='14'>{y1:.4g}</text><text x='2' y='{h - 22}'>{y0:.4g}</text>"
            f"<text x='30' y='{h - 4}'>step {x0:g}</text><text x='{w - 60}' y='{h - 4}'>{x1:g}</text></svg>"
            f"<figcaption>{html.escape(label)}</figcaption></figure>")


def rollout_link(step_file: str, i: int, t: dict) -> str:
    return f"<a href='{step_file}#open={i}' data-reward='{t['reward']}'>#{i} ({t['reward']:+.3g})</a>"


def index_body(run: Path, metrics: list[dict], steps: list[tuple[int, list[dict]]], texts: dict[int, str]) -> str:
    curves = "".join(svg_curve([(m["step"], m[k]) for m in metrics if k in m], k)
                     for k in CURVES if any(k in m for m in metrics))
    rewards = [(s + 1, t["reward"]) for s, trajs in steps for t in trajs if "dropped" not in t]
    dist = svg_curve(rewards, "reward of each rollout, per step", w=620, h=160, dots=True) if rewards else ""
    rows, dropped = [], []
    for s, trajs in steps:
        f = f"step_{s:06d}.html"
        kept = sorted(((i, t) for i, t in enumerate(trajs) if "dropped" not in t), key=lambda it: -it[1]["reward"])
        rewards = [t["reward"] for _, t in kept]
        rows.append(f"<tr><td><a href='{f}'>{s + 1}</a></td><td>{len(kept)}</td>"
                    + (f"<td>{sum(rewards) / len(rewards):.3g}</td><td>{min(rewards):.3g}</td><td>{max(rewards):.3g}</td>"
                       if kept else "<td></td>" * 3)
                    + f"<td class='best'>{' '.join(rollout_link(f, i, t) for i, t in kept[:SHOWN])}</td>"
                    + f"<td class='worst'>{' '.join(rollout_link(f, i, t) for i, t in kept[::-1][:SHOWN])}</td>"
                    + f"<td>{len(trajs) - len(kept)}</td></tr>")
        dropped += [f"<tr class='dropped'><td><a href='{f}#open={i}'>{s + 1}</a></td><td>{html.escape(t['dropped'])}</td>"
                    f"<td>{t.get('group', '')}</td><td>{html.escape(prompt_text(t, texts)[-120:])}</td>"
                    f"<td>{html.escape(((t.get('detail') or '').strip().splitlines() or [''])[-1])}</td></tr>"
                    for i, t in enumerate(trajs) if "dropped" in t]
    return (f"<h1>{html.escape(run.resolve().name)}: rollouts</h1><section class='curves'>{curves}{dist}</section>"
            "<h2>Steps</h2><table><tr><th>step</th><th>rollouts</th><th>reward mean</th><th>min</th><th>max</th>"
            f"<th>best</th><th>worst</th><th>dropped</th></tr>{''.join(rows)}</table>"
            + compare(steps, texts)
            + "<h2>Dropped rollouts</h2>" + (f"<table id='dropped'><tr><th>step</th><th>reason</th><th>group</th>"
                                            f"<th>prompt</th><th>detail</th></tr>{''.join(dropped)}</table>"
                                            if dropped else "<p>none</p>"))


def compare(steps: list[tuple[int, list[dict]]], texts: dict[int, str]) -> str:
    """Each prompt of both the first and the last dumped step: its rollouts at both, side by side."""
    (s0, first), (s1, last) = steps[0], steps[-1]
    by_prompt = lambda trajs: {prompt_text(t, texts): t["group"] for t in trajs if "dropped" not in t}
    a, b = by_prompt(first), by_prompt(last)
    common = [p for p in a if p in b] or ([next(iter(a))] if a and b else [])
    cell = lambda s, trajs, g: "".join(
        f"<div class='cmp-r'><a href='step_{s:06d}.html#open={i}'>{t['reward']:+.3g}</a> "
        f"<span>{html.escape(sampled_text(t, texts))}</span></div>"
        for i, t in enumerate(trajs) if "dropped" not in t and t["group"] == g)
    rows = "".join(f"<tr class='cmp' data-prompt='{html.escape(p)}'><td><pre>{html.escape(p[-300:])}</pre></td>"
                   f"<td>{cell(s0, first, a[p])}</td><td>{cell(s1, last, b.get(p, next(iter(b))))}</td></tr>"
                   for p in common[:50])
    note = "" if common and common[0] in b else "<p>No prompt is in both steps: their first groups.</p>"
    return (f"<h2>First and last step (step {s0 + 1} and {s1 + 1})</h2>{note}<input id='prompt-filter' "
            f"placeholder='filter by prompt'><table id='compare'><tr><th>prompt</th><th>step {s0 + 1}</th>"
            f"<th>step {s1 + 1}</th></tr>{rows}</table>")


def write(run: str | Path, out: str | Path | None = None, tokenizer: str | None = None) -> Path:
    """Write the viewer's pages for the run in `run`; returns the index page."""
    run = Path(run)
    cfg = json.loads((run / "config.json").read_text()) if (run / "config.json").is_file() else {}
    jsonl = lambda f: [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.is_file() else []
    metrics = jsonl(run / "metrics.jsonl")
    steps = [(int(f.stem[5:]), jsonl(f)) for f in sorted(dump_folder(run, cfg).glob("step_*.jsonl"))]
    tok = load_tokenizer(run, cfg, tokenizer)
    ids = {i for _, trajs in steps for t in trajs for i in t.get("tokens", ())}
    texts = {i: tok.decode([i]) for i in ids}
    out = Path(out) if out else run / "viewer"
    out.mkdir(parents=True, exist_ok=True)
    for k, (s, trajs) in enumerate(steps):
        for t in trajs:
            t.pop("routing", None)  # the experts each token used: not shown, and large
        data = {"step": s + 1, "texts": {i: texts[i] for t in trajs for i in t.get("tokens", ())},
                "rollouts": trajs, "prev": k > 0 and f"step_{steps[k - 1][0]:06d}.html",
                "next": k + 1 < len(steps) and f"step_{steps[k + 1][0]:06d}.html",
                "missing": [f for f in ("advantages", "trainer_logprobs")
                            if any(f not in t for t in trajs if "dropped" not in t)]}
        (out / f"step_{s:06d}.html").write_text(page(f"step {s + 1}", "<div id='step'></div>", data))
    index = out / "index.html"
    index.write_text(page(f"{run.resolve().name}: rollouts", index_body(run, metrics, steps, texts)))
    return index


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", help="the run's --output_dir (metrics.jsonl, config.json, the dumped rollouts)")
    p.add_argument("--out", default=None, help="where the pages go (default RUN/viewer)")
    p.add_argument("--tokenizer", default=None,
                   help="to decode token ids (default: RUN/final, else the run's --export_hf or --model)")
    args = p.parse_args(argv)
    index = write(args.run, args.out, args.tokenizer)
    print(f"wrote {index} (open it in a browser; no network needed)")


if __name__ == "__main__":
    main()
