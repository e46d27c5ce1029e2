"""The rollout viewer (viewer.py) on a known dump, checked in a real browser: headless Debian
chromium renders the pages (their JS included) and the tests read the resulting DOM."""

import json
import math
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

import viewer


@pytest.fixture(scope="module")
def chromium(tmp_path_factory) -> str:
    """The browser; installed here as .ci/run does when it is missing (root with apt-get), else the tests skip."""
    exe = shutil.which("chromium")
    if exe is None and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium",
                       shell=True, capture_output=True, timeout=900)
        exe = shutil.which("chromium")
    if exe is None:
        pytest.skip("chromium is not installed and `apt-get install -y chromium` could not install it")
    return exe


def browse(chromium: str, page: Path, fragment: str = "", *flags: str) -> str:
    """The page's DOM after its scripts ran (or `flags`' output, e.g. --screenshot)."""
    profile = page.parent / ".chromium-profile"
    done = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--user-data-dir={profile}", *(flags or ["--dump-dom"]), page.as_uri() + fragment],
                          capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


class Dom(HTMLParser):
    """Elements as (tag, attributes, text inside), in document order; enough to check spans and rows."""

    def __init__(self, text: str):
        super().__init__()
        self.elements, self.open = [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        el = {"tag": tag, **{k: (v if v is not None else "") for k, v in attrs}, "text": ""}
        self.elements.append(el)
        if tag not in ("img", "input", "br", "meta", "circle"):
            self.open.append(el)

    def handle_endtag(self, tag):
        while self.open and self.open.pop()["tag"] != tag:
            pass

    def handle_data(self, data):
        for el in self.open:
            el["text"] += data

    def find(self, tag, cls=None, **attrs):
        return [e for e in self.elements if e["tag"] == tag and (cls is None or cls in e.get("class", "").split())
                and all(e.get(k.replace("_", "-")) == v for k, v in attrs.items())]


def traj(tok, prompt: str, turns: list, reward: float, group: int, rollout_id: int, **extra) -> dict:
    """A dumped trajectory: the prompt rendered, then (sampled text, observation text or None) turns; every
    sampled token gets its own made-up advantage, sampling and trainer logprob and version."""
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    t = {"tokens": list(ids), "mask": [0] * len(ids), "logprobs": [0.0] * len(ids), "versions": [-1] * len(ids),
         "advantages": [0.0] * len(ids), "trainer_logprobs": [0.0] * len(ids), "reward": reward, "group": group,
         "rollout_id": rollout_id, "score": reward, "info": {"tries": 1.0}, "images": []}
    for n, (sampled, observation) in enumerate(turns):
        for c in tok(sampled, add_special_tokens=False)["input_ids"]:
            k = len(t["tokens"])
            t["tokens"].append(c)
            t["mask"].append(1)
            t["logprobs"].append(round(-0.3 * (k % 5) - 0.1, 3))
            t["trainer_logprobs"].append(round(t["logprobs"][-1] + 0.01 * (k % 3 - 1), 3))
            t["advantages"].append(round((reward - 0.5) * (1 + 0.1 * k), 3))
            t["versions"].append(n)
        for c in tok(observation or "", add_special_tokens=False)["input_ids"]:
            t["tokens"].append(c)
            for f, v in (("mask", 0), ("logprobs", 0.0), ("versions", -1), ("advantages", 0.0), ("trainer_logprobs", 0.0)):
                t[f].append(v)
    return {**t, **extra}


@pytest.fixture(scope="module")
def run(tiny_model, tiny_tokenizer, tmp_path_factory) -> Path:
    """A run folder as main.py leaves it with --dump_rollouts: 2 steps, a dropped rollout at each,
    per-turn rewards and a branch at step 2 (the optional fields another feature adds)."""
    tok, run = tiny_tokenizer, tmp_path_factory.mktemp("viewer") / "run"
    (run / "dump").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": tiny_model, "dump_rollouts": str(run / "dump")}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": r, "response_len": 3 - s,
                                                           "entropy": 1.0 / s, "mismatch_k3": 1e-6}) + "\n"
                                               for s, r in ((1, 0.5), (2, 0.75))))
    step1 = [traj(tok, "3?7=", [("7", None)], 1.0, 0, 0), traj(tok, "3?7=", [("37", None)], 0.0, 0, 1),
             {"dropped": "error", "group": 1, "prompt": "1?2=", "detail": "Traceback ...\nRuntimeError: agent bug"}]
    two_turns = traj(tok, "4?9=", [("5", "<|end|><|user|>9?<|end|><|assistant|>"), ("9", None)], 1.0, 0, 0,
                     turn_rewards=[0.0, 1.0], finish_reasons=["stop", "length"])
    branch = traj(tok, "4?9=", [("5", "<|end|><|user|>9?<|end|><|assistant|>"), ("98", None)], 0.0, 0, 1,
                  turn_rewards=[0.0, 0.0], parent=0, branch_turn=1)   # its turn 2 starts as its parent's
    for t in (two_turns, branch):   # each token's turn: the k-th reply and the prompt/observation before it
        t["turns"] = [0]
        for m, before in zip(t["mask"][1:], t["mask"]):
            t["turns"].append(t["turns"][-1] + (before and not m))
    step2 = [two_turns, branch, traj(tok, "3?7=", [("7", None)], 1.0, 1, 2),
             {**traj(tok, "2?2=", [("2", None)], 1.0, 2, 3), "dropped": "stale"}]
    for name, trajs in (("step_000000.jsonl", step1), ("step_000001.jsonl", step2)):
        (run / "dump" / name).write_text("".join(json.dumps(t) + "\n" for t in trajs))
    viewer.main([str(run)])
    return run


def test_pages_are_self_contained(run):
    pages = sorted((run / "viewer").glob("*.html"))
    assert [p.name for p in pages] == ["index.html", "step_000000.html", "step_000001.html"]
    for p in pages:   # no network: no external script, style, image or font
        assert not re.search(r"""(src|href)=["']?(https?:)?//""", p.read_text()), p.name
        assert "<script src" not in p.read_text() and "<link" not in p.read_text()


def _rgba(style: str) -> tuple:
    m = re.search(r"rgba\((\d+),(\d+),(\d+),([\d.]+)\)", style.replace(" ", ""))
    return tuple(int(x) for x in m.groups()[:3]) + (float(m.group(4)),)


def _expected(channel: str, t: dict, j: int, page: list[dict]) -> tuple:
    """The colour a sampled token should have, from the dump alone (the JS must agree)."""
    sampled = [(r, i) for r in page if "dropped" not in r for i, m in enumerate(r["mask"]) if m]
    if channel == "advantage":
        s = max(abs(r["advantages"][i]) for r, i in sampled)
        x = t["advantages"][j]
        return ((0, 150, 0) if x > 0 else (210, 0, 0)) + (abs(x) / s,)
    if channel == "logprob":
        return (230, 120, 0, 1 - math.exp(t["logprobs"][j]))
    if channel == "mismatch":
        s = max(0.05, max(abs(r["trainer_logprobs"][i] - r["logprobs"][i]) for r, i in sampled))
        x = t["trainer_logprobs"][j] - t["logprobs"][j]
        return ((0, 150, 0) if x > 0 else (210, 0, 0)) + (abs(x) / s,)
    versions = [r["versions"][i] for r, i in sampled]
    return (60, 90, 220, (max(versions) - t["versions"][j]) / max(1, max(versions) - min(versions)))


@pytest.mark.parametrize("channel", ["advantage", "logprob", "mismatch", "version"])
def test_every_sampled_token_is_a_span_with_its_id_text_values_and_colour(chromium, run, tiny_tokenizer, channel):
    dump = [json.loads(l) for l in (run / "dump" / "step_000001.jsonl").read_text().splitlines()]
    dom = Dom(browse(chromium, run / "viewer" / "step_000001.html", f"#open=all&channel={channel}"))
    assert dom.find("span", id="legend")[0]["data-channel"] == channel
    spans_of = {}   # rollout index -> its token spans, in order
    for el in dom.elements:
        if el["tag"] == "details" and "rollout" in el.get("class", ""):
            current = spans_of.setdefault(int(el["data-i"]), [])
        elif el["tag"] == "span" and el.get("class") in ("s", "p") and "data-j" in el:
            current.append(el)
    assert sorted(spans_of) == list(range(len(dump)))
    for i, t in enumerate(dump):
        start = 0 if i != 1 else len(dump[0]["tokens"]) - 1  # the branch shows its tokens after the shared prefix
        spans = spans_of[i]
        assert [int(s["data-j"]) for s in spans] == list(range(start, len(t["tokens"])))
        assert [int(s["data-id"]) for s in spans] == t["tokens"][start:]
        assert [s["class"] for s in spans] == ["s" if m else "p" for m in t["mask"][start:]]
        for s in spans:
            j = int(s["data-j"])
            text = tiny_tokenizer.decode([t["tokens"][j]])
            assert s["text"] == text and f'"{text}"' in s["title"]
            if s["class"] == "p":
                assert "style" not in s   # prompt and observation tokens are plain
                continue
            assert f"advantage {t['advantages'][j]:+.3f}" in s["title"] and f"version {t['versions'][j]}" in s["title"]
            got, want = _rgba(s["style"]), _expected(channel, t, j, dump)
            assert got[:3] == want[:3] and abs(got[3] - want[3]) < 2e-3, (channel, i, j, got, want)


def test_turns_rewards_branches_and_dropped_rollouts_are_shown(chromium, run):
    dom = Dom(browse(chromium, run / "viewer" / "step_000001.html", "#open=all"))
    labels = [b["data-turn"] for b in dom.find("div", "blk") if b["class"] == "blk sampled"]
    assert labels[:2] == ["turn 1 · reward 0.000 · stop", "turn 2 · reward +1.000 · length"]   # each turn its own
    assert labels[2] == "turn 2 · reward 0.000"   # the branch: only its own turn, under its parent
    rollouts = dom.find("details", "rollout")
    assert [int(d["data-i"]) for d in rollouts] == [0, 1, 2, 3]
    assert "branch" in rollouts[1]["class"] and "branch of #0" in rollouts[1]["text"]
    assert "dropped" in rollouts[3]["class"] and "dropped: stale" in rollouts[3]["text"]
    first = Dom(browse(chromium, run / "viewer" / "step_000000.html", "#open=2"))
    dropped = first.find("details", "dropped")[0]
    assert "dropped: error" in dropped["text"] and "RuntimeError: agent bug" in dropped["text"] and "1?2=" in dropped["text"]


@pytest.mark.parametrize("fragment, shown", [("#min=0.5", [0, 2]), ("#max=0.5", [1]), ("#q=4?9", [0, 1]),
                                             ("#q=3?7&min=0.5", [2]), ("", [0, 1, 2, 3])])
def test_filters_by_reward_and_prompt(chromium, run, fragment, shown):
    dom = Dom(browse(chromium, run / "viewer" / "step_000001.html", fragment))
    assert [int(d["data-i"]) for d in dom.find("details", "rollout") if "hidden" not in d] == shown
    assert dom.find("span", id="shown")[0]["text"] == f"{len(shown)} of 4 shown"


def test_index_shows_curves_distribution_best_worst_comparison_and_dropped(chromium, run):
    dom = Dom(browse(chromium, run / "viewer" / "index.html"))
    assert {s["data-metric"] for s in dom.find("svg")} == {"reward_mean", "response_len", "entropy", "mismatch_k3",
                                                            "reward of each rollout, per step"}
    dots = sorted((float(c["cy"]), int(c["data-n"])) for c in dom.find("circle"))   # a dot per step and reward bin
    assert dots[0][0] == dots[1][0] < dots[2][0] == dots[3][0]   # reward 1 above reward 0 (SVG y grows down)
    assert [n for _, n in dots] == [1, 2, 1, 1]   # reward 1: 1 rollout at step 1, 2 at step 2; reward 0: 1 and 1
    def links(td):   # the rollout links in a cell: the anchors up to the next cell
        after = dom.elements[dom.elements.index(td) + 1:]
        return [a["href"] for a in after[:next(k for k, e in enumerate(after) if e["tag"] == "td")]]
    best, worst = dom.find("td", "best"), dom.find("td", "worst")
    assert links(best[1]) == [f"step_000001.html#open={i}" for i in (0, 2, 1)]   # by reward, ties in dump order
    assert links(worst[0]) == [f"step_000000.html#open={i}" for i in (1, 0)]
    assert worst[0]["text"] == "#1 (+0) #0 (+1)"
    reasons = [r["text"] for r in dom.find("tr", "dropped")]
    assert len(reasons) == 2 and "error" in reasons[0] and "agent bug" in reasons[0] and "stale" in reasons[1]
    rows = dom.find("tr", "cmp")
    assert len(rows) == 1 and "3?7=" in rows[0]["data-prompt"]   # the prompt both steps have
    assert rows[0]["text"].count("+1") == 2 and "+0" in rows[0]["text"]   # step 1: rewards 1 and 0; step 2: 1
    hidden = Dom(browse(chromium, run / "viewer" / "index.html", "#q=nowhere")).find("tr", "cmp")
    assert "hidden" in hidden[0]


def test_screenshot(chromium, run, tmp_path):
    shot = tmp_path / "shot.png"
    browse(chromium, run / "viewer" / "step_000001.html", "#open=0,1", f"--screenshot={shot}", "--window-size=1000,700")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_a_run_without_dumps_is_refused_and_an_old_dump_says_what_is_missing(tiny_model, tiny_tokenizer, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model": tiny_model}))
    with pytest.raises(ValueError, match="no step_.*jsonl dumps.*--dump_rollouts"):
        viewer.write(tmp_path)
    (tmp_path / "dump").mkdir()
    old = {k: v for k, v in traj(tiny_tokenizer, "1?2=", [("2", None)], 1.0, 0, 0).items()
           if k not in ("advantages", "trainer_logprobs")}   # dumped before these fields existed
    (tmp_path / "dump" / "step_000000.jsonl").write_text(json.dumps(old) + "\n")
    page = (viewer.write(tmp_path).parent / "step_000000.html").read_text()
    assert '"missing":["advantages","trainer_logprobs"]' in page


HOSTILE = {"rollouts": [{"dropped": "error", "group": 0, "prompt": "<!--<script>a & b > c",
                         "detail": "</script><script>alert(1)</script>\u2028\u2029"}],
           "step": 1, "texts": {}, "prev": False, "next": False, "missing": []}


def test_data_blob_holds_no_markup_and_round_trips():
    """Model text with `<!--<script` (the HTML script-data escaped state) and `</script>` cannot end or
    extend the data's script element: the blob holds no `<`, `>` or `&` and is the same JSON (issue 46 item 11d)."""
    blob = viewer.page("t", "", HOSTILE).split("<script type='application/json' id='data'>", 1)[1].split("</script>")[0]
    assert not set(blob) & set("<>&\u2028\u2029"), blob
    assert json.loads(blob) == HOSTILE


def test_markup_in_model_text_is_shown_as_text(chromium, tmp_path):
    """The browser's viewer.js reads the same data back (textContent, JSON.parse) and shows the text as text."""
    (tmp_path / "step.html").write_text(viewer.page("t", "<div id='step'></div>", HOSTILE))
    dropped = Dom(browse(chromium, tmp_path / "step.html", "#open=0")).find("details", "dropped")
    assert len(dropped) == 1 and "<!--<script>a & b > c" in dropped[0]["text"], dropped
    assert "</script><script>alert(1)</script>" in dropped[0]["text"], dropped


def test_a_rollouts_segments_show_as_one_tree(chromium, tiny_model, tiny_tokenizer, tmp_path):
    tok, run = tiny_tokenizer, tmp_path / "run"
    (run / "dump").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": tiny_model}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 1.0}) + "\n")
    rows = [traj(tok, "1", [("1", None)], 1.0, 0, 0), traj(tok, "2", [("2", None)], 0.0, 0, 1),
            traj(tok, "1", [("3", None)], 1.0, 0, 0), traj(tok, "1", [("4", None)], 1.0, 0, 0)]   # #0's segments 2, 3
    (run / "dump" / "step_000000.jsonl").write_text("".join(json.dumps(t) + "\n" for t in rows))
    viewer.main([str(run)])
    rollouts = Dom(browse(chromium, run / "viewer" / "step_000000.html", "#open=all")).find("details", "rollout")
    assert [int(d["data-i"]) for d in rollouts] == [0, 2, 3, 1]
    assert ["branch" in d["class"] for d in rollouts] == [False, True, True, False]
    assert [("segment 1 of 3" in rollouts[0]["text"]), "segment 2 of 3" in rollouts[1]["text"],
            "segment 3 of 3" in rollouts[2]["text"], "segment" in rollouts[3]["text"]] == [True, True, True, False]
