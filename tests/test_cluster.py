"""More than one node: placement, rendezvous and the real loop on a Ray cluster of several raylets.

`ray.cluster_utils.Cluster` starts several Ray nodes on this host. Each node gets its own
loopback address (127.0.0.2, 127.0.0.3; the driver's node keeps the host's address) and a
custom resource naming it, so "which node" is a real, different IP for every actor: the
trainer ranks are pinned to one node with --trainer_resources, the engine to another with
--engine_resources, --agent_cmd programs to a third with --agent_resources. Checked: the process
group's store is hosted on rank 0's node (not the driver's), a TP group shares a node, engines split
the cores of their own node, --output_dir must be visible from every trainer node, the loop trains
token-exactly across nodes (weights broadcast from the trainer's node to the engine's; the programs'
requests come from theirs to the chat server on the driver's address), a program on another node
is refused without its key and ends with its rollout, and programs no node can place are refused.

    python -m pytest -q tests/test_cluster.py
"""

import asyncio
import contextlib
import json
import signal
import sys
from pathlib import Path

import pytest

import agent as agents
import generator
import parallel
import programs
import trainer
from fakes import check_token_exact, fake
from test_programs import PROGRAMS, rows, wait_gone

TRAINER_IP, ENGINE_IP, AGENT_IP = "127.0.0.2", "127.0.0.3", "127.0.0.4"


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})   # the driver's node runs nothing
    c.add_node(num_cpus=3, resources={"trainer_node": 3}, node_ip_address=TRAINER_IP)   # room for a misplaced engine
    c.add_node(num_cpus=1, resources={"engine_node": 1}, node_ip_address=ENGINE_IP)
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)   # as under `nohup ... &`: its workers inherit SIGINT ignored
    try:
        c.add_node(num_cpus=1, resources={"agent_node": 2}, node_ip_address=AGENT_IP)   # programs ask for no CPU
    finally:
        signal.signal(signal.SIGINT, ignored)
    yield c
    c.shutdown()


class Probe:
    """Stands in for a Trainer rank: records where it runs and the rendezvous it was given."""

    weight_sync_address = trainer.Trainer.weight_sync_address

    def __init__(self, cfg, rank, world, master_addr, master_port, node=None):
        self.seen = (rank, master_addr, master_port)
        self.node = node

    def where(self):
        import ray
        return (*self.seen, ray.util.get_node_ip_address(), self.node)


def test_rendezvous_is_on_rank_0s_node(cluster, tmp_path, monkeypatch):
    import ray
    from ray.util.placement_group import remove_placement_group
    root = Path(__file__).resolve().parents[1]   # the workers import this module (Probe) and trainer.py
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": f"{root}:{root / 'tests'}"}})
    try:
        monkeypatch.setattr(parallel, "PLACEMENT_TIMEOUT_S", 2)
        with pytest.raises(ValueError, match="cannot place 4 trainer rank"):   # the trainer node has 3 CPUs
            trainer.TrainerGroup({"train_workers": 4, "trainer_resources": {"trainer_node": 0.5},
                                  "output_dir": str(tmp_path)})
        monkeypatch.setattr(parallel, "PLACEMENT_TIMEOUT_S", 60)
        driver_ip = ray.util.get_node_ip_address()
        for tp in (1, 2):   # tp 2: one STRICT_PACK group
            cfg = {"train_workers": 2, "tp_size": tp, "cp_size": 1, "trainer_resources": {"trainer_node": 0.5},
                   "output_dir": str(tmp_path / "out"), "save_every": 1, "export_hf": None}
            group = trainer.TrainerGroup(cfg, actor=Probe)
            seen = ray.get([w.where.remote() for w in group.workers])
            assert [s[0] for s in seen] == [0, 1]
            assert {s[3] for s in seen} == {TRAINER_IP}, "ranks run on the trainer node"
            assert {s[1] for s in seen} == {TRAINER_IP} != {driver_ip}, "MASTER_ADDR is rank 0's node"
            assert len({s[2] for s in seen}) == 1
            # CPU threads: both ranks share the trainer node; on several nodes the engines count as elsewhere
            assert [s[4] for s in seen] == [(2, 0, False)] * 2
            host, _ = ray.get(group.call("weight_sync_address"))
            assert host == TRAINER_IP, "the weight-broadcast store is on rank 0's node too"
            assert not list((tmp_path / "out").glob(".molt-visible-*")), "markers are removed"
            for w in group.workers:
                ray.kill(w)
            for pg in {pg.id: pg for pg, _ in group.slots}.values():   # free the node for the next layout
                remove_placement_group(pg)
    finally:
        ray.shutdown()


def test_cpu_threads_give_each_phase_the_cores_the_other_leaves():
    threads = parallel.cpu_threads   # (cores, trainer ranks, engines, overlap) -> (per rank, per engine)
    assert threads(2, 1, 1, False) == (2, 1)      # on-policy: the phases take turns; the engine leaves its feeders one
    assert threads(16, 2, 2, False) == (8, 7)     # ranks (and engines) share the node among their own kind
    assert threads(2, 1, 1, True) == (1, 1)       # async: both busy at once, never more threads than cores
    assert threads(16, 1, 1, True) == (8, 7)
    assert threads(16, 2, 2, True) == (4, 3) and threads(12, 3, 1, True) == (3, 2)   # split by their numbers
    assert threads(1, 1, 1, True) == (1, 1) and threads(3, 2, 2, True) == (1, 1)     # at least one each
    assert threads(8, 1, 0, True)[0] == 8 and threads(8, 0, 2, True)[1] == 3         # the other kind is elsewhere
    assert threads(2, 1, 1, True, train_threads=2) == (2, 1)                          # the flags override
    assert threads(2, 1, 1, False, engine_threads=2) == (2, 2)


def test_cpu_engine_env_counts_each_nodes_cores():
    env = generator.cpu_engine_env   # (nodes, i, trainers on i's node, overlap, --engine_threads, cores)
    uni = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # one rank: the worker in the engine-core process
    assert env(["a"], 0, 1, False, cores=8) == {**uni, "OMP_NUM_THREADS": "7"}   # alone, on-policy: all but one
    assert env(["a"], 0, 1, True, cores=8) == {**uni, "OMP_NUM_THREADS": "3"}    # async: beside the trainer
    assert env(["a"], 0, 1, True, 2, cores=8) == {**uni, "OMP_NUM_THREADS": "2"}  # --engine_threads
    assert env(["a"], 0, 0, False, cores=1) == {**uni, "OMP_NUM_THREADS": "1"}
    nodes = ["a", "b", "a"]   # engine 1 alone on node b (2 cores), engines 0 and 2 share a (9 cores)
    assert env(nodes, 0, 0, False, cores=9) == {**uni, "OMP_NUM_THREADS": "4", "OMP_PLACES": "{0,1,2,3}",
                                                "OMP_PROC_BIND": "true"}
    assert env(nodes, 2, 0, False, cores=9)["OMP_PLACES"] == "{4,5,6,7}"
    assert env(nodes, 1, 0, False, cores=2) == {**uni, "OMP_NUM_THREADS": "1"}
    assert [env(["a"] * 3, i, 0, False, cores=2)["OMP_PLACES"] for i in range(3)] == ["{0}", "{1}", "{0}"]
    # tensor parallel: vLLM's multiprocess executor binds its ranks within the engine's cores
    assert [env(["a", "a"], i, 0, False, cores=9, tp_size=2) for i in range(2)] == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0-3"}, {"VLLM_CPU_OMP_THREADS_BIND": "4-7"}]
    assert env(["a"], 0, 0, False, cores=8, tp_size=2) == {}


def test_a_cpu_engine_forks_its_engine_core_and_only_while_it_starts(monkeypatch):
    """vLLM spawns the engine core from a Ray actor (a second vLLM import); forked_engine_core makes
    the context vLLM's process manager asks for a fork one, and puts vLLM's own back after."""
    from vllm.v1.engine import utils as engine_utils
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")   # what vLLM forces inside a Ray actor
    spawn = engine_utils.get_mp_context
    assert spawn().get_start_method() == "spawn"
    with generator.forked_engine_core(True):
        assert engine_utils.get_mp_context().get_start_method() == "fork"
    assert engine_utils.get_mp_context is spawn
    with generator.forked_engine_core(False):   # GPU or tensor parallel: vLLM's choice
        assert engine_utils.get_mp_context is spawn


def test_trainer_actor_trains_with_the_threads_chosen(tiny_model, tmp_path):
    """Through the real trainer actor: torch's threads inside it are the ones cpu_threads chose from
    this node's cores (not Ray's OMP_NUM_THREADS=1 for an actor), on-policy and async, and the flag wins."""
    import ray
    import main
    cores = parallel.node_cores()
    ray.init(address="local", num_cpus=4, include_dashboard=False)   # not the module's Cluster, if it runs
    try:
        groups = {}
        for flags in ([], ["--async_depth", "1", "--is_level", "token"], ["--train_threads", "3"]):
            cfg = main.validate(vars(main.build_parser().parse_args(
                ["--model", tiny_model, "--output_dir", str(tmp_path / "out"), *flags])))
            groups[" ".join(flags)] = (cfg, trainer.TrainerGroup(cfg))
        for flags, (cfg, group) in groups.items():
            want = 3 if cfg["train_threads"] else parallel.cpu_threads(cores, 1, 1, cfg["async_depth"] > 0)[0]
            assert ray.get(group.workers[0].torch_threads.remote()) == want, flags
    finally:
        ray.shutdown()


def test_a_local_cpu_clusters_workers_run_on_tcmalloc_and_the_driver_does_not(monkeypatch):
    """launch.start_ray preloads tcmalloc (install.sh installs it) into the local cluster's processes, whose
    workers are the trainer ranks and engines: glibc's malloc faulted ~1M pages in per SmolLM2 train step.
    The driver's environment (and so every agent program's) is left as it was."""
    import ctypes.util
    import os
    import ray
    import faults
    import launch
    if not ctypes.util.find_library("tcmalloc_minimal"):
        pytest.skip("libtcmalloc_minimal is not installed (install.sh installs it with apt)")
    monkeypatch.setenv(faults.TAG, "tcmalloc-test")
    monkeypatch.setattr(faults, "catch_stop_signals", lambda: None)   # outside guarded(): no one would restore them
    before = os.environ.get("LD_PRELOAD")
    launch.start_ray({"ray_address": None, "train_workers": 1, "num_engines": 1, "verbose": False})
    try:
        maps = ray.get(ray.remote(num_cpus=1)(lambda: open("/proc/self/maps").read()).remote())
        assert "libtcmalloc_minimal" in maps and os.environ.get("LD_PRELOAD") == before
        assert "libtcmalloc_minimal" not in open("/proc/self/maps").read()
    finally:
        ray.shutdown()
    assert launch.tcmalloc({"ray_address": "auto"}) == {}   # another cluster's nodes may not have it


def test_output_dir_on_one_node_only_is_refused():
    facts = [{"ip": "10.0.0.1", "sees": [True]}, {"ip": "10.0.0.2", "sees": [False]}]
    trainer.check_shared_storage(facts[:1], ["/runs/a/.molt-visible-x"])
    with pytest.raises(ValueError, match=r"/runs/a .* not visible from trainer rank 1's node \(10.0.0.2\).*shared "
                                         "storage"):
        trainer.check_shared_storage(facts, ["/runs/a/.molt-visible-x"])


def test_loop_on_three_nodes_places_and_trains_token_exactly(cluster, tiny_model, tmp_path):
    """Trainer ranks on one node, the engine on another, weights broadcast between them; the rollouts are
    programs (examples/programs/running_max.py) on a third, talking to the chat server on the driver's node."""
    import main
    out, seen = tmp_path / "run", tmp_path / "seen"
    seen.mkdir()
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(8)))
    where = tmp_path / "where.sh"   # what the program sees on its node, then the program itself
    program = PROGRAMS / "running_max.py"
    where.write_text(f'{{ tr "\\0" " " < /proc/$RAY_RAYLET_PID/cmdline; echo; echo "$MOLT_RUN_ID $OPENAI_BASE_URL"; }}'
                     f" > {seen}/$$\nexec {sys.executable} {program}\n")
    # "auto": the cluster this host runs (the Cluster wrote its address where `ray start` does)
    main.main(["--model", tiny_model, "--ray_address", "auto", "--output_dir", str(out),
               "--trainer_resources", json.dumps({"trainer_node": 0.5}),
               "--engine_resources", json.dumps({"engine_node": 0.5}),
               "--agent_cmd", f"bash {where}", "--dataset", str(data), "--agent_resources", '{"agent_node": 0.5}',
               "--train_workers", "2", "--weight_sync", "broadcast", "--steps", "2", "--prompts_per_step", "2",
               "--samples_per_prompt", "2", "--max_new_tokens", "2", "--mini_batches", "1", "--quiet",
               "--no_plot", "--save_every", "2", "--program_sandbox", "off"])   # where.sh reads the host's /proc
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    assert all(m["mismatch_abs"] < 1e-4 for m in lines), "token-exact across nodes, before and after a sync"
    assert not any(k.startswith("dropped/") and v for m in lines for k, v in m.items()), lines
    assert (out / "final" / "model.safetensors").is_file() and (out / "checkpoints" / "step_000002").is_dir()
    actors = cluster.global_state.actor_table(None).values()
    where = {}
    for a in actors:
        where.setdefault(a["ActorClassName"], set()).add(a["Address"]["IPAddress"])
    assert where["Trainer"] == {TRAINER_IP} and where["Generator"] == {ENGINE_IP}, where
    programs = [f.read_text().splitlines() for f in seen.iterdir()]
    assert len(programs) == 8, "2 steps of 2 x 2 rollouts"
    driver = cluster.head_node.node_ip_address
    for node, (tag, url) in ((p[0], p[1].split()) for p in programs):
        assert f"--node_ip_address={AGENT_IP} " in node, "on the agent node"
        assert url.startswith(f"http://{driver}:") and driver != "127.0.0.1", "the server on the driver's address"
        assert len(tag) > 8, "the run's tag reached the program on its node"


PROGRAM = """import json, os, subprocess, sys, time, urllib.error, urllib.request
row = json.loads(sys.stdin.readline())
def ask(url, key):
    headers = {'Content-Type': 'application/json', **({'Authorization': 'Bearer ' + key} if key else {})}
    body = json.dumps({'messages': [{'role': 'user', 'content': row['prompt']}]}).encode()
    try:
        return json.load(urllib.request.urlopen(urllib.request.Request(url + '/chat/completions', body, headers)))
    except urllib.error.HTTPError as e:
        return e.code
url, key = os.environ['OPENAI_BASE_URL'], os.environ['OPENAI_API_KEY']
refused = [ask(url, None), ask(url, row['other_key']), ask(row['other_url'], key)]
node = open(f"/proc/{os.environ['RAY_RAYLET_PID']}/cmdline").read().replace('\\0', ' ')
child = subprocess.Popen(['sleep', '600']).pid if row.get('hang') else None   # a process of its group
open(row['report'] + '.tmp', 'w').write(json.dumps({'refused': refused, 'node': node, 'url': url,
                                                    'pids': [os.getpid(), child]}))
os.replace(row['report'] + '.tmp', row['report'])
if child:
    time.sleep(600)
print(json.dumps({'reward': float(ask(url, key)['choices'][0]['message']['content'] == '7')}))
"""


def test_a_program_on_another_node_trains_needs_its_key_and_ends_with_its_rollout(cluster, tiny_tokenizer, tmp_path):
    """A program placed by --agent_resources runs on that node and reaches the server on the driver's
    address; its requests without its key, with another rollout's key, or to another rollout's URL get a 401
    and touch no trace; its one real request is trained token-exactly. A rollout cancelled on the driver
    ends the program and its group on its node (the Ray task is cancelled: it kills the group)."""
    import ray
    from server import ChatServer
    root = Path(__file__).resolve().parents[1]   # the task's worker imports programs.py
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": str(root)}})
    loop, sampling = asyncio.new_event_loop(), {"temperature": 1.0, "max_tokens": 4}
    server = ChatServer(host=ray.util.get_node_ip_address())   # what launch.run_tagged picks for --agent_resources
    try:
        loop.run_until_complete(server.start())
        prog = tmp_path / "remote.py"
        prog.write_text(PROGRAM)
        remote = programs.program(f"{sys.executable} {prog}", 60, {"agent_node": 1}, confined=False)   # tries other URLs
        other = server.open_session(fake(tiny_tokenizer, []), tiny_tokenizer, sampling=sampling, max_len=128)
        row = {"prompt": "1?2=", "label": None, "other_key": other.key, "other_url": other.base_url,
               "report": str(tmp_path / "report.json")}
        rec = fake(tiny_tokenizer, ["7"])
        segs = loop.run_until_complete(agents.run_chat_agent(remote(), row, rec, tiny_tokenizer, server,
                                                             sampling=sampling, max_len=128))
        seen = json.loads((tmp_path / "report.json").read_text())
        assert f"--node_ip_address={AGENT_IP} " in seen["node"], "placed on the agent node"
        assert seen["url"].startswith(server.url) and not server.url.startswith("http://127."), seen["url"]
        assert seen["refused"] == [401, 401, 401]
        assert len(rec.calls) == 1 and segs[0].reward == 1.0
        check_token_exact(segs, rec.calls)
        assert other.requests == 0 and server.close_session(other.id) == []

        async def cancelled_while_it_runs(report: Path):
            run = asyncio.ensure_future(agents.run_chat_agent(remote(), {**row, "hang": True, "report": str(report)},
                                                              fake(tiny_tokenizer, []), tiny_tokenizer, server,
                                                              sampling=sampling, max_len=128))
            while not report.exists():
                assert not run.done(), run.exception()
                await asyncio.sleep(0.05)
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
        loop.run_until_complete(cancelled_while_it_runs(tmp_path / "hang.json"))
        for pid in json.loads((tmp_path / "hang.json").read_text())["pids"]:
            wait_gone(pid, 30)
    finally:
        loop.run_until_complete(server.stop())
        loop.close()
        ray.shutdown()


def test_programs_no_node_can_place_are_refused_at_start_up(cluster, tiny_model, tmp_path):
    import main
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(4)))
    with pytest.raises(ValueError, match=r'--agent_resources \{"agent_node": 3.0\}: no node of the Ray cluster'):
        main.main(["--model", tiny_model, "--ray_address", "auto", "--output_dir", str(tmp_path / "out"),
                   "--agent_cmd", "true", "--dataset", str(data), "--agent_resources", '{"agent_node": 3}'])


def test_gpu_shares_keep_trainer_and_engine_gpus_apart():
    cfg = {"train_workers": 6, "num_engines": 2, "engine_tp_size": 1, "engine_dp_size": 1}
    assert parallel.gpu_shares(cfg, 0) == (0.0, 0.0)                        # CPU cluster
    assert parallel.gpu_shares(cfg, 8) == (1.0, 1.0)                        # 6 + 2 GPUs of their own
    assert parallel.gpu_shares({**cfg, "num_engines": 1, "engine_tp_size": 2}, 8) == (1.0, 2.0)
    one = {"train_workers": 1, "num_engines": 1, "engine_tp_size": 1, "engine_dp_size": 1}
    assert parallel.gpu_shares(one, 1) == (0.5, 0.5)                        # one GPU: shared
    with pytest.raises(ValueError, match="need 10 GPUs, the Ray cluster has 8"):
        parallel.gpu_shares({**cfg, "num_engines": 4}, 8)
