"""The real loop end to end: Ray + vLLM + FSDP2 trainer on the tiny model."""

import json
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

import estimators
import fakes
import logs
import main
import viewer

FLAKY_AGENT = '''
from agent import Env, Result

class Flaky(Env):
    """The default task, except that prompts starting with 1 crash the agent."""
    @classmethod
    def prompts(cls, seed):
        i = 0
        while True:
            a, b = i % 10, (i * 7 + 3) % 10
            i += 1
            if a != b:
                yield {"prompt": f"{a}?{b}=", "label": str(max(a, b))}

    async def step(self, state):
        if state.prompt.startswith("1"):
            raise RuntimeError("agent bug on prompt 1")
        # graded, so that 3 steps of a random policy already give a gradient
        return Result(reward=float(state.action == state.label) + len(state.action) / 3, info={"len": len(state.action)})
'''

SMALL = ["--prompts_per_step", "4", "--samples_per_prompt", "4", "--max_new_tokens", "3", "--quiet"]


def listening(procs) -> set[tuple]:
    """(process name, address, port) of every socket these processes listen on."""
    found = set()
    for p in procs:
        try:
            found |= {(p.name(), c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN}
        except psutil.Error:   # ended meanwhile
            pass
    return found


def test_short_run_trains_logs_and_cleans_up(tiny_model, tmp_path, monkeypatch, capfd):
    compile_off, listeners = [], set()

    async def record(engines, version):   # on CPU the engine is eager: torch.compile only cost start-up
        compile_off.append(await engines.actors[0].__ray_call__.remote(
            lambda gen: __import__("torch")._dynamo.config.disable))   # read in a thread of Ray's
        # The run is up (Ray, engine, two trainer ranks, weight sync): what does it listen on?
        listeners.update(listening([psutil.Process(), *psutil.Process().children(recursive=True)]))
    _hooks(monkeypatch, before_update=record)
    agent = tmp_path / "flaky.py"
    agent.write_text(FLAKY_AGENT)
    out = tmp_path / "run"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    summary = main.main(["--model", tiny_model, "--agent", str(agent), "--steps", "3", "--train_workers", "2",
                         "--output_dir", str(out), *SMALL, "--dump_rollouts", str(tmp_path / "dump")])
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        assert m["rollouts"] > 0 and m["staleness"] == 0.0   # sync mode is exactly on-policy:
        assert abs(m["is_weight_mean"] - 1.0) < 1e-4             # IS weights are 1
        assert m["mismatch_abs"] < 1e-4
        assert all(isinstance(v, (int, float)) and v == v for v in m.values())  # finite, no NaN
    assert sum(m.get("dropped/error", 0) for m in lines[-1:]) > 0   # crashed rollouts were counted
    assert "info/len" in lines[0]
    # The dump has what the viewer shows: each token's advantage and trainer logprob, and the dropped rollouts.
    trained = [t for trajs in _dumped(tmp_path / "dump") for t in trajs]
    assert len(trained) == sum(m["rollouts"] for m in lines)
    for t in trained:   # float32 on-policy: --old_logprobs auto is engine, so the trainer's were not measured
        assert len(t["advantages"]) == len(t["tokens"]) and "trainer_logprobs" not in t
    dropped = [t for trajs in _dumped(tmp_path / "dump", dropped=True) for t in trajs]
    assert len(dropped) == lines[-1]["dropped/error"]
    assert all(d["dropped"] == "error" and d["prompt"].startswith("1") and "agent bug" in d["detail"] for d in dropped)
    index = viewer.write(out)   # the run's rollouts in the viewer (tests/test_viewer.py checks the pages in a browser)
    pages = sorted(index.parent.glob("step_*.html"))
    assert len(pages) == 3 and "agent bug" in index.read_text()
    first = pages[0].read_text()
    assert first.count('"reward":') == len(_dumped(tmp_path / "dump")[0])
    assert first.count('"dropped":"error"') == len(_dumped(tmp_path / "dump", dropped=True)[0])
    assert summary["steps"] == 3
    assert compile_off and all(compile_off)
    # A local run listens on loopback only (Ray's GCS, raylet, agents, workers; gloo; the weight-sync store).
    assert {name for name, _, _ in listeners} >= {"gcs_server", "raylet"}, listeners
    exposed = {(n, ip, port) for n, ip, port in listeners if ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")}
    assert not exposed, f"listening beyond loopback: {exposed}"
    err = capfd.readouterr().err
    assert "weight sync listen on 127.0.0.1 only" in err, err
    assert "engine 0 KV cache: " in err and "sequences of --max_len 256 (the run keeps 16 in flight here)" in err
    # Parameters changed, and the exported folder loads.
    start = load_file(f"{tiny_model}/model.safetensors")
    final = load_file(out / "final" / "model.safetensors")
    assert any(not torch.equal(start[k], final[k]) for k in start)
    # Nothing left behind: no Ray, no vLLM engine processes.
    import ray
    assert not ray.is_initialized()
    leftovers = [p.name() for p in psutil.Process().children(recursive=True)
                 if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    assert not leftovers, leftovers


def test_every_rollout_failing_stops_with_a_clear_error(tiny_model, tmp_path):
    agent = tmp_path / "broken.py"
    agent.write_text("from agent import Env\nclass Broken(Env):\n"
                     "    @classmethod\n    def prompts(cls, seed):\n        while True: yield {'prompt': '1?2='}\n"
                     "    async def step(self, state):\n        raise KeyError('reward')\n")
    with pytest.raises(RuntimeError, match="every rollout of the first 4 groups failed"):
        main.main(["--model", tiny_model, "--agent", str(agent), "--steps", "2",
                   "--output_dir", str(tmp_path / "run"), *SMALL])


def test_filter_groups_stops_when_no_group_has_a_signal(tiny_model, tmp_path):
    """A reward that is always equal gives --filter_groups nothing to keep: the run stops after
    --max_failed_groups refills in a row, naming the cause, instead of refilling forever. (Rows
    from 40 on raise, so that an unbounded refill ends too, with another error.)"""
    agent = tmp_path / "constant.py"
    agent.write_text("import itertools\nfrom agent import Env, Result\nclass Constant(Env):\n" + ROWS +
                     "    async def step(self, state):\n"
                     "        assert state.row['index'] < 40, 'refilled past the bound'\n"
                     "        return Result(reward=1.0)\n")
    with pytest.raises(RuntimeError, match=r"the last 6 groups gave nothing to train.*--max_failed_groups 6.*"
                       r"groups filtered: 6\); the last group's 4 rewards were all 1 \(--filter_groups\)"):
        main.main(["--model", tiny_model, "--agent", str(agent), "--steps", "2", "--filter_groups",
                   "--max_failed_groups", "6", "--output_dir", str(tmp_path / "run"), *SMALL])


def test_async_partial_rollout_checkpoint_resume_and_replay(tiny_model, tmp_path):
    """Async depth 1 with partial rollout, filtering and eval; a checkpoint per step; then
    a resumed run continues where the first stopped; then the dumped batches retrain
    without an engine. Weights go by broadcast (gloo), to two engines in the first run."""
    out, dump = tmp_path / "run", tmp_path / "dump"
    common = ["--model", tiny_model, "--output_dir", str(out), *SMALL, "--export_hf", "none",
              "--weight_sync", "broadcast"]
    main.main([*common, "--steps", "2", "--async_depth", "1", "--partial_rollout", "--num_engines", "2", "--eval_every", "2",
               "--eval_prompts", "4", "--save_every", "1", "--keep_checkpoints", "1", "--dump_rollouts", str(dump)])
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    assert lines[0]["staleness"] == 0.0 and "eval/pass@1" in lines[1]
    assert all(m["mismatch_fresh_abs"] < 1e-4 for m in lines if "mismatch_fresh_abs" in m)
    ckpts = logs.complete_checkpoints(out)
    assert [c.name for c in ckpts] == ["step_000002"]  # retention kept the last one
    state = json.loads((ckpts[0] / "loop.json").read_text())
    assert state["step"] == 2 and state["version"] == 2 and state["rows_started"] >= 8
    # Depth 1 keeps a step's groups in flight past the checkpoint: the state names them (a group's id is its row).
    trained = {t["group"] for step in _dumped(dump) for t in step}
    assert len(state["rows_pending"]) == 4 and not trained & set(state["rows_pending"])

    # A checkpoint that died mid-write (no rename) is ignored.
    (out / "checkpoints" / "step_000003.tmp").mkdir()
    assert logs.complete_checkpoints(out) == ckpts

    main.main([*common, "--steps", "3", "--resume", "--save_every", "1", "--dump_rollouts", str(tmp_path / "dump2")])
    # Strictly on-policy now, step 3 starts 4 groups: the rows that were in flight, started again.
    assert {t["group"] for t in _dumped(tmp_path / "dump2")[0]} == set(state["rows_pending"])
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert lines[2]["version"] == 3 and lines[2]["staleness"] == 0.0
    assert lines[2]["mismatch_abs"] < 1e-4  # the engine got the checkpoint's weights
    state = json.loads((logs.complete_checkpoints(out)[-1] / "loop.json").read_text())
    assert state["step"] == 3 and state["rows_started"] > 8  # data position moved on, not restarted

    summary = main.main(["--model", tiny_model, "--output_dir", str(tmp_path / "replay"), *SMALL,
                         "--steps", "2", "--replay_rollouts", str(dump), "--export_hf", "none"])
    assert summary["steps"] == 2


ROWS = """
    @classmethod
    def prompts(cls, seed):
        for i in itertools.count():
            a, b = i % 10, (i * 7 + 3) % 10
            yield {"prompt": f"{a}?{b}=", "label": str(max(a, b)), "index": i}
"""


def _hooks(monkeypatch, before_update=None):
    """Observe the real loop, without changing it: flag "version N" once weights N are in the
    engines, and "group 0 finished" once group 0 is in the pool's queue of finished groups.
    `before_update(engines, version)` runs before each weight update."""
    import generator
    import loop
    fakes.FLAGS.clear()
    update, finished = generator.Engines.update_weights, loop.RolloutPool._finished

    async def update_weights(self, trainer, version):
        if before_update is not None:
            await before_update(self, version)
        out = await update(self, trainer, version)
        fakes.flag(f"version {version}").set()
        return out

    def _finished(self, task):
        finished(self, task)
        if not task.cancelled() and task.exception() is None and task.result()["group"] == 0:
            fakes.flag("group 0 finished").set()
    monkeypatch.setattr(generator.Engines, "update_weights", update_weights)
    monkeypatch.setattr(loop.RolloutPool, "_finished", _finished)


def _dumped(dump, dropped=False):
    """Each step's trained (or else dropped) trajectories, in step order (step s trains policy version s in a fresh run)."""
    return [[t for l in f.read_text().splitlines() if ("dropped" in (t := json.loads(l))) == dropped]
            for f in sorted(dump.glob("step_*.jsonl"))]


def _sampled_versions(t):
    return [v for v, m in zip(t["versions"], t["mask"]) if m]


SLOW_AGENT = """
import asyncio, itertools
import fakes
from agent import Env, Result

class SlowTool(Env):
    \"\"\"Row 0's rollouts wait in their tool call until policy 3 is in the engine, 3 versions after
    they sampled; rows after 3 * 2 (the rows steps 1-3 train) wait until row 0's group has
    finished, so that it is the first group step 4 takes.\"\"\"
""" + ROWS + """
    async def step(self, state):
        i = state.row["index"]
        if i == 0:
            await fakes.until("version 3")
        elif i > 3 * 2:
            await fakes.until("group 0 finished")
        return Result(reward=float(state.action == state.label) + len(state.action) / 3)
"""


def test_a_slow_group_is_dropped_at_consumption_when_its_tokens_are_too_stale(tiny_model, tmp_path, monkeypatch):
    """--async_depth 1 bounds staleness where it matters: a group that finishes 3 versions after
    it sampled (a slow tool; arranged by flags, not by timing) is dropped when it would be
    trained, and counted: no trained token is more than 1 version older than its policy."""
    _hooks(monkeypatch)
    agent, dump = tmp_path / "slow.py", tmp_path / "dump"
    agent.write_text(SLOW_AGENT)
    main.main(["--model", tiny_model, "--agent", str(agent), "--output_dir", str(tmp_path / "run"), "--quiet",
               "--prompts_per_step", "2", "--samples_per_prompt", "2", "--max_new_tokens", "3",
               "--steps", "5", "--async_depth", "1", "--export_hf", "none", "--no_plot", "--dump_rollouts", str(dump)])
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = _dumped(dump)
    assert len(steps) == 5
    for policy, trajs in enumerate(steps):
        assert all(policy - v <= 1 for t in trajs for v in _sampled_versions(t)), f"step {policy + 1}"
    assert [m.get("dropped/stale", 0) for m in lines] == [0, 0, 0, 2, 2]   # row 0's 2 rollouts, at step 4
    assert all(t["group"] != 0 for trajs in steps for t in trajs)
    stale = _dumped(dump, dropped=True)   # the dump keeps them, with their reason and tokens
    assert [[(t["dropped"], t["group"]) for t in trajs] for trajs in stale] == [[], [], [], [("stale", 0)] * 2, []]
    assert all(len(t["tokens"]) == len(t["mask"]) > 0 for t in stale[3])


LONG_AGENT = """
import asyncio, itertools
import fakes
from agent import Env, Result

class Long(Env):
    \"\"\"Row 0 answers its first turn only once the first weight update has begun, with a second
    turn of 200 tokens: that request is in flight at the update (the test's hook lets the update
    go on once it has tokens out). Rows started after the update (from 2 * 4) wait until row
    0's group has finished, so that it trains at the next step.\"\"\"
    max_turns = 2
""" + ROWS + """
    async def step(self, state):
        i = state.row["index"]
        if i == 0 and state.turn == 0:
            await fakes.until("updating")
            return Result(reward=0.0, observation="1", terminated=False,
                          sampling_params={"max_tokens": 200, "ignore_eos": True})
        if i >= 2 * 4:
            await fakes.until("group 0 finished")
        return Result(reward=float(state.action.count("7")))
"""


async def _update_mid_request(engines, version):
    """Before the first update: release row 0, then wait until its long request has tokens out."""
    import asyncio
    import time
    if version != 1:
        return
    fakes.flag("updating").set()
    # Run in the engine actor (a local function: shipped by value): some request has more
    # tokens out than a normal turn's 3.
    long_request_out = lambda gen: any(s.detokenizer.num_output_tokens() >= 4   # noqa: E731
                                       for s in list(gen.engine.output_processor.request_states.values()))
    deadline = time.monotonic() + 120   # a guard against a hang, not a timing condition
    while not await engines.actors[0].__ray_call__.remote(long_request_out):
        assert time.monotonic() < deadline, "row 0's long request never produced tokens"
        await asyncio.sleep(0.01)


def test_partial_rollout_trains_tokens_of_two_policy_versions(tiny_model, tmp_path, monkeypatch):
    """Async + partial rollout really happens: a request in flight at a weight update (arranged:
    the update waits for its first tokens, and it has ~196 more to go) is paused, reloaded and
    resumed, so its trajectory holds tokens of two policy versions, trained at the next step."""
    _hooks(monkeypatch, before_update=_update_mid_request)
    agent, dump = tmp_path / "long.py", tmp_path / "dump"
    agent.write_text(LONG_AGENT)
    main.main(["--model", tiny_model, "--agent", str(agent), "--output_dir", str(tmp_path / "run"), *SMALL,
               "--steps", "3", "--async_depth", "1", "--partial_rollout", "--export_hf", "none", "--no_plot",
               "--dump_rollouts", str(dump)])
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(m["staleness"] for m in lines) > 0
    steps = _dumped(dump)
    held = [_sampled_versions(t) for t in steps[1] if t["group"] == 0]
    assert len(held) == 4, "row 0's group trains at step 2"
    spans = [v for v in held if set(v) == {0, 1}]
    assert spans, "no trajectory spans the weight update"
    assert all(v == sorted(v) for v in held)  # versions only grow along a sequence
    assert not any(m.get("dropped/stale") for m in lines)


# The estimators that change what the trainer holds (a critic; a reference model) run through
# the real loop; the others differ only in their advantage function, which test_estimators checks
# in closed form and test_algorithms through the real Trainer's SGD step.
@pytest.mark.parametrize("estimator", [n for n, s in estimators.ESTIMATORS.items() if s.critic or s.teacher])
def test_estimators_with_extra_models_run_through_the_real_loop(tiny_model, tmp_path, estimator):
    spec = estimators.ESTIMATORS[estimator]
    extra = ["--kl_coef", "0.5", "--ref_model", tiny_model] if spec.teacher else []
    summary = main.main(["--model", tiny_model, "--estimator", estimator, "--steps", "2", *SMALL, *extra,
                         "--output_dir", str(tmp_path / "run"), "--export_hf", "none", "--no_plot"])
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 2 and len(lines) == 2
    assert all(isinstance(v, (int, float)) and v == v and abs(v) != float("inf") for m in lines for v in m.values())
    # the extra model is there and used: a critic's values, loss and optimizer step, or the KL to the teacher
    keys = ("value_mean", "value_loss", "critic_grad_norm") if spec.critic else ("ref_kl_k3",)
    assert all(k in m for m in lines for k in keys)


def test_resumed_rows_start_the_rows_in_flight_at_the_checkpoint_first():
    import itertools
    import loop
    rows = loop.resumed_rows(iter(range(100)), {"rows_started": 6, "rows_pending": [2, 5]})
    assert list(itertools.islice(rows, 4)) == [(2, 2), (5, 5), (6, 6), (7, 7)]
    assert next(loop.resumed_rows(range(10), {"rows_started": 3})) == (3, 3)   # a checkpoint from before
    assert next(loop.resumed_rows(range(10), {"rows_started": 0})) == (0, 0)   # a fresh run


def test_branching_rollouts_through_the_real_loop(tiny_model, tmp_path):
    """--branches 2 on the bench's two-turn Env (vLLM, Ray, the trainer): each rollout comes back as two
    rows that share their first turn's tokens, trained in one; branch_value trains on them."""
    dump = tmp_path / "dump"
    dump.mkdir()
    main.main(["--model", tiny_model, "--agent", str(Path(__file__).parent / "larger_digit.py"),
               "--estimator", "branch_value", "--branches", "2", "--steps", "2", *SMALL, "--output_dir", str(tmp_path / "run"), "--export_hf", "none",
               "--no_plot", "--dump_rollouts", str(dump)])
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["rollouts"] == 4 * 4 * 2 and m["info/turns"] == 2 for m in lines)   # each branch a rollout
    for step in _dumped(dump):
        by_id = {(t["group"], t["rollout_id"]): t for t in step}
        children = [t for t in step if t["parent"] is not None]
        assert len(children) == len(step) // 2 and all(t["branch_turn"] == 1 for t in children)
        for t in children:
            first = by_id[t["group"], t["parent"]]
            shared = t["turns"].index(1)     # turn 1 starts with the observation both were shown
            assert t["tokens"][:shared] == first["tokens"][:shared] and t["states"] == first["states"]
            assert sum(t["mask"][:shared]) == 0 < sum(first["mask"][:shared])
            assert len(t["turn_rewards"]) == 2 and t["reward"] == sum(t["turn_rewards"])


def test_context_rewrites_through_the_real_loop(tiny_model, tmp_path):
    """--context window on an episode over 3x --max_len (vLLM, Ray, the trainer): every rollout goes on in
    segments that share its id and reward, each within --max_len, its sampled tokens with their logprobs."""
    dump = tmp_path / "dump"
    dump.mkdir()
    main.main(["--model", tiny_model, "--agent", main.__file__.replace("main.py", "bench/past_window.py"),
               "--context", "window", "--context_turns", "1", "--max_len", "40", "--steps", "2", *SMALL,
               "--max_new_tokens", "2", "--output_dir", str(tmp_path / "run"), "--export_hf", "none", "--no_plot",
               "--dump_rollouts", str(dump)])
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # (a random policy's replies can hold special tokens, re-rendered as longer text: those rollouts end truncated)
    assert all(m["rollouts"] == 16 and m["segments_per_rollout"] > 1 and m["info/episode_tokens"] > 40 for m in lines)
    for step in _dumped(dump):
        rollouts = {}
        for t in step:
            rollouts.setdefault((t["group"], t["rollout_id"]), []).append(t)
            assert len(t["tokens"]) <= 40 and sum(t["mask"]) > 0
            assert all(lp == 0 for lp, m in zip(t["logprobs"], t["mask"]) if not m) and any(t["logprobs"])
        assert len(rollouts) == 16
        for segs in rollouts.values():
            assert len({t["reward"] for t in segs}) == 1 and len({json.dumps(t["info"]) for t in segs}) == 1
            assert sum(len(t["turn_rewards"]) for t in segs) == segs[0]["info"]["turns"]
            assert segs[0]["info"]["turns"] == 8 or segs[0]["info"]["truncated"] == 1
