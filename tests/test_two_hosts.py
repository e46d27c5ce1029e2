"""Two hosts for real: the engine's Ray node runs in a network namespace of its own.

test_cluster.py's nodes share one network stack, so something bound to 127.0.0.1 on one
"node" is still reachable from another. Here the second node lives in a Linux network
namespace made by the test (a veth pair: the host keeps its address, the namespace gets
10.77.0.2 with a route back), so it reaches the head only over the veth, as a second machine
would over its network. The driver and the trainer ranks run on the host, the engine in the
namespace; the run must place them so, broadcast weights across, and stay token-exact.
Skipped where network namespaces cannot be made (not root, no `ip`, a container without
CAP_NET_ADMIN).

    python -m pytest -q tests/test_two_hosts.py
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

NS_IP, HOST_VETH_IP = "10.77.0.2", "10.77.0.1"


def sh(*cmd, ns=None):
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def namespace():
    tag = uuid.uuid4().hex[:6]
    ns, host_if, ns_if = f"molt-{tag}", f"vh{tag}", f"vn{tag}"
    try:
        sh("ip", "netns", "add", ns)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"no network namespaces here: {e}")
    try:
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        sh("ip", "link", "set", ns_if, "netns", ns)
        sh("ip", "addr", "add", f"{HOST_VETH_IP}/24", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "link", "set", "lo", "up", ns=ns)
        sh("ip", "addr", "add", f"{NS_IP}/24", "dev", ns_if, ns=ns)
        sh("ip", "link", "set", ns_if, "up", ns=ns)
        sh("ip", "route", "add", "default", "via", HOST_VETH_IP, ns=ns)   # the host's own address, over the veth
        yield ns, ns_if
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _ray_node(args: list[str], ns=None, env=None) -> subprocess.Popen:
    """`ray start --block` in its own process group (stopping the group stops the node)."""
    cmd = (["ip", "netns", "exec", ns] if ns else []) + [sys.executable, "-m", "ray.scripts.scripts", "start",
                                                        "--block", "--disable-usage-stats"] + args
    return subprocess.Popen(cmd, env={**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def _stop(procs):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + 20
        while time.time() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.2)


def test_loop_across_a_network_namespace(namespace, tiny_model, tmp_path, monkeypatch):
    import ray
    import main
    import parallel
    ns, ns_if = namespace
    host_ip, port = ray.util.get_node_ip_address(), parallel.free_port()
    address = f"{host_ip}:{port}"
    head = _ray_node(["--head", f"--node-ip-address={host_ip}", f"--port={port}", "--num-cpus=3",
                      "--resources", json.dumps({"trainer_node": 3}), "--include-dashboard=false"])
    # The namespace shares the host's name: gloo would resolve it to the host's address, which
    # is not an interface there; a real second machine resolves its own. Name the interface.
    worker = None
    try:
        deadline = time.time() + 60
        while subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "status", f"--address={address}"],
                             capture_output=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"}).returncode:
            assert head.poll() is None and time.time() < deadline, head.stderr.read().decode()[-2000:]
            time.sleep(1)
        worker = _ray_node([f"--address={address}", f"--node-ip-address={NS_IP}", "--num-cpus=1",
                            "--resources", json.dumps({"engine_node": 1})], ns=ns, env={"GLOO_SOCKET_IFNAME": ns_if})
        monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
        out = tmp_path / "run"
        main.main(["--model", tiny_model, "--ray_address", address, "--output_dir", str(out),
                   "--trainer_resources", json.dumps({"trainer_node": 0.5}),
                   "--engine_resources", json.dumps({"engine_node": 0.5}),
                   "--train_workers", "2", "--weight_sync", "broadcast", "--steps", "2", "--prompts_per_step", "2",
                   "--samples_per_prompt", "2", "--max_new_tokens", "2", "--mini_batches", "1", "--quiet",
                   "--no_plot"])
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in lines] == [1, 2]
        assert all(m["mismatch_abs"] < 1e-4 for m in lines), "token-exact across hosts, before and after a sync"
        ray.init(address=address, logging_level="ERROR")
        try:
            where = {}
            for a in ray._private.state.state.actor_table(None).values():   # the run's actors, dead now
                where.setdefault(a["ActorClassName"], set()).add(a["Address"]["IPAddress"])
        finally:
            ray.shutdown()
        assert where["Trainer"] == {host_ip} and where["Generator"] == {NS_IP}, where
    finally:
        _stop([p for p in (worker, head) if p is not None])
