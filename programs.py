"""Agents as programs and MCP tools. `python main.py --agent_cmd "CMD ARGS"` runs each rollout as a process
(`Program`, docs/programs.md) that gets the server's URLs and the rollout's key in OPENAI_*/ANTHROPIC_* variables, the
row as JSON on stdin, and prints its reward as a JSON object on the last line of stdout. `--mcp_server CMD`: the tools
of MCP servers, their calls run by a built-in ChatAgent (`MCPAgent`). `agent_class(cfg)` is the run's agent.
"""

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import math
import os
import shlex
import shutil
import signal
import tempfile
from pathlib import Path

import sandbox
import tasks
from agent import ChatAgent, ChatContext, Result, load_agent
from trajectory import DropRollout


MAX_OUTPUT = 16 * 2**20   # bytes a program may write (stdout and stderr together) before it is killed as a flood
TAIL = 2000               # bytes of stderr shown when a program's rollout is dropped


def program(cmd: str, timeout: float, resources: dict | None = None, confined: bool = True, env: list = ()) -> type:
    """A `Program` class running `cmd` (split as a shell would; run without a shell) within `timeout` seconds, here or
    on a node with `resources`, `confined` in a sandbox with the variables `env` names ("NAME=VALUE", or "NAME": its
    value here). ValueError: an empty command, one whose executable is not found (here), a sandbox that cannot start
    here, an unset NAME."""
    argv = [os.path.abspath(a) if os.path.isfile(a) else a for a in shlex.split(cmd)]   # it runs in its own folder
    if not argv:
        raise ValueError("--agent_cmd is empty: give the command that runs one rollout")
    if shutil.which(argv[0]) is None and not resources:   # on other nodes the path is theirs
        raise ValueError(f"--agent_cmd {cmd!r}: {argv[0]!r} is not an executable file here or on PATH")
    if missing := [e for e in env if "=" not in e and e not in os.environ]:
        raise ValueError(f"--program_env {missing[0]}: not set here (give NAME=VALUE)")
    if confined and not resources:
        check_sandbox()
    amounts = dict(resources or {})   # Ray's options asking for exactly these: no CPU or GPU unless named
    options = {"num_cpus": amounts.pop("CPU", 0), "num_gpus": amounts.pop("GPU", 0), "resources": amounts}
    env = dict(e.partition("=")[::2] if "=" in e else (e, os.environ[e]) for e in env)
    return type("Program", (Program,), {"argv": argv, "timeout": timeout, "resources": resources, "options": options,
                                        "confined": confined, "env": env})


class _Output:
    """One of a program's pipes read to its end: its last TAIL bytes, its last non-empty line, and how many of
    its lines were JSON objects with a "reward" key (a line is parsed only when it names "reward")."""

    def __init__(self):
        self.tail, self.line, self.last, self.rewards = b"", b"", b"", 0

    async def read(self, stream, total: list[int]):
        while chunk := await stream.read(2**16):
            total[0] += len(chunk)
            if total[0] > MAX_OUTPUT:
                raise DropRollout("flood", f"wrote over {MAX_OUTPUT // 2**20} MiB of output: killed")
            self.tail = (self.tail + chunk)[-TAIL:]
            *lines, self.line = (self.line + chunk).split(b"\n")
            self.line = self.line[-2**20:]   # a longer reward line is not one
            self.take(lines)
        self.take([self.line])

    def take(self, lines: list[bytes]):
        self.rewards += sum(_reward_object(line) is not None for line in lines)
        self.last = next((line for line in reversed(lines) if line.strip()), self.last)


def _reward_object(line: bytes) -> dict | None:
    with contextlib.suppress(ValueError, RecursionError):   # not JSON, or nested too deep: no reward
        found = json.loads(line) if b'"reward"' in line else None
        return found if isinstance(found, dict) and "reward" in found else None
    return None


async def _process(command: list[str], env: dict, cwd: str, data: bytes, timeout: float, what: str) -> tuple:
    """Run `command` in its own group with `data` on stdin, both pipes read (bounded) within `timeout`, then the whole
    group killed (and with it, a sandbox). -> (stdout, stderr, (reason, what) of a drop or None)."""
    out, err, total, failed = _Output(), _Output(), [0], None
    proc = await asyncio.create_subprocess_exec(*command, cwd=cwd, env=env, start_new_session=True,
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        async def feed():
            with contextlib.suppress(ConnectionError):   # a program need not read its row
                proc.stdin.write(data)
                await proc.stdin.drain()
                proc.stdin.close()
        await asyncio.wait_for(asyncio.gather(feed(), out.read(proc.stdout, total),
                                              err.read(proc.stderr, total), proc.wait()), timeout)
    except (asyncio.TimeoutError, DropRollout) as e:   # the caller drops the rollout, with the stderr's tail
        failed = (e.reason, str(e)) if isinstance(e, DropRollout) else ("timeout", f"{what} ran past {timeout:g}s: killed")
    finally:   # the whole group, whatever it left running (a Ray task's too: ray.cancel raises in it)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc._transport.close()   # its pipes too: a flood's unread, paused pipe would keep wait() from returning
        await proc.wait()
    return out, err, failed or (proc.returncode and ("exit", f"{what} exited with {proc.returncode}")) or None


async def run_process(argv: list[str], row: dict, env: dict, timeout: float, confined: bool = True) -> tuple:
    """A `Program`'s process, here or in a Ray task, in a fresh temporary folder: `confined` in a sandbox of its own
    (sandbox.py: `env` and an allow-list) or with `env` over this process's environment (with the run's tag,
    faults.TAG); the row on stdin. A row's Harbor task (tasks.py): its files in the workspace, mounted at its WORKDIR,
    then its verifier. -> (stdout, stderr, (reason, what) of a drop or None, the verifier's reward or None)."""
    task = tasks.Task.load(row["task"]) if row.get("task") else None
    with sandbox.folder() as folder:   # its name says whose: a killed driver's go at the next start-up
        work, logs = Path(folder, "work"), Path(folder, "logs")
        work.mkdir()
        if task:
            task.prepare(work)
            env, timeout = {**task.env, **env}, min(task.timeouts["agent"] or timeout, timeout)   # within --agent_timeout
        hide = (str(task.path.parent),) if task else ()   # not its tests, nor any task's solution
        async with contextlib.AsyncExitStack() as stack:
            command, full = await stack.enter_async_context(sandbox.confine(
                argv, env, folder, timeout, str(work), task and task.workdir, hide=hide)) if confined else (
                argv, {**os.environ, **env})
            out, err, failed = await _process(command, full, str(work), json.dumps(row, default=str).encode() + b"\n",
                                              timeout, "it")
        if not task or failed:
            return out, err, failed, None
        shutil.copytree(task.path / "tests", Path(folder, "tests"))
        (logs / "verifier").mkdir(parents=True)
        (logs / "agent").mkdir()
        mounts = ((str(Path(folder, "tests")), "/tests", False), (str(logs), "/logs", True))
        seconds = task.timeouts["verifier"] or timeout
        async with sandbox.confine(["bash", "/tests/test.sh"], {**task.env, **task.verifier_env}, folder, seconds,
                                   str(work), task.workdir, mounts) as (command, full):
            _, verr, vfailed = await _process(command, full, str(work), b"", seconds, "its task's tests/test.sh")
        found = tasks.reward(logs / "verifier")
        if found is None:   # the verifier's failure, its stderr shown
            return out, verr, vfailed or ("no_reward", "its task's tests/test.sh wrote no /logs/verifier/reward.txt "
                                          "or reward.json"), None
        return out, err, None, found


def check_sandbox():
    """Run `true` in a sandbox (program(), and on agent nodes): ValueError naming why one cannot be made here."""
    try:   # on a thread of its own: the caller may be in an event loop
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            _, err, failed, _ = pool.submit(asyncio.run, run_process(["true"], {}, {}, 30)).result()
    except (sandbox.SandboxError, OSError) as e:   # no bwrap, or none that runs
        raise ValueError(f"--program_sandbox on: {e}") from None
    if failed:
        raise ValueError(f"--program_sandbox on: a sandbox cannot be made here ({err.tail.decode(errors='replace')}"
                         f"{failed[1]}); --program_sandbox off runs programs unconfined")


def _in_task(*args):   # ray.cancel raises KeyboardInterrupt through SIGINT's handler: none in a worker that
    signal.signal(signal.SIGINT, signal.default_int_handler)   # inherited SIGINT ignored (`nohup ray start ... &`)
    return asyncio.run(run_process(*args))


@functools.cache
def _process_task():   # one Ray function for the job, not one per rollout: each ray.remote exports one to the GCS
    import ray
    return ray.remote(max_retries=0)(_in_task)


class Program(ChatAgent):
    """A rollout run by a program (`--agent_cmd`; the contract is docs/programs.md), here or on a node with `resources`
    (`run_process`): the server's URLs and this rollout's key in OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL,
    ANTHROPIC_API_KEY; the dataset row as JSON on stdin; the reward as a JSON object {"reward": R, "info": {...}} on
    the last line of stdout. It inherits the run's tag (faults.TAG), so the reaper ends it with the run. Any failure
    drops the rollout (DropRollout) with the stderr's tail."""
    argv: list[str] = []
    timeout: float = 300.0
    resources: dict | None = None       # and `options`, Ray's for a task on a node with them (`program`)
    confined: bool = True               # in a sandbox of its own (--program_sandbox)
    env: dict = {}                      # what --program_env passes
    err: _Output | None = None          # this rollout's stderr, once its process ended
    grace: float = 5.0                  # it times out by itself; then its group is killed, its stderr read

    async def run(self, ctx: ChatContext) -> Result:
        args = (self.argv, ctx.row, {**self.env, "OPENAI_BASE_URL": ctx.base_url, "OPENAI_API_KEY": ctx.api_key,
                "ANTHROPIC_BASE_URL": ctx.anthropic_base_url, "ANTHROPIC_API_KEY": ctx.api_key}, self.timeout, self.confined)
        out, self.err, failed, verdict = await (self.on_node(args) if self.resources else run_process(*args))
        if failed:
            raise self.drop(*failed)
        if verdict is not None:   # a Harbor task's: its verifier's reward, whatever the program printed
            return Result(reward=verdict)
        found = _reward_object(out.last)
        if found is None:
            raise self.drop("no_reward", "printed no reward: the last line of stdout must be a JSON object "
                            'like {"reward": 1.0}' + (" (a reward line came earlier)" if out.rewards else ""))
        if out.rewards > 1:
            raise self.drop("bad_reward", f"printed {out.rewards} reward lines: print exactly one, last")
        reward, info = found["reward"], found.get("info", {})
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise self.drop("bad_reward", f"printed the reward {reward!r}: it must be a finite number")
        if not isinstance(info, dict) or not all(isinstance(v, (int, float)) for v in info.values()):
            raise self.drop("bad_reward", "printed an info that is not an object of numbers")
        return Result(reward=float(reward), info=info)

    async def on_node(self, args: tuple) -> tuple:   # `run_process(*args)` as a Ray task on a node with `resources`
        import ray
        task = _process_task().options(**self.options).remote(*args)
        try:
            return await task
        except ray.exceptions.RayError as e:   # this rollout's, not the engine's: a node, worker or memory failure
            cause = getattr(e, "cause", None) or e   # a RayTaskError's: what run_process raised (OSError: not started)
            raise self.drop("exit" if isinstance(cause, OSError) else "node",
                            f"its Ray task failed: {type(cause).__name__}: {cause}") from None
        finally:   # dropped or cancelled here: stop it there (not force: its group is killed first)
            ray.cancel(task)

    @classmethod
    async def check_node(cls) -> None:   # at start-up (loop.train), as each of its rollouts would fail
        import ray
        if not cls.resources:
            return
        node = f"the node --agent_resources {json.dumps(cls.resources)} placed a check on"
        if await ray.remote(shutil.which).options(**cls.options).remote(cls.argv[0]) is None:
            raise ValueError(f"--agent_cmd {shlex.join(cls.argv)}: {cls.argv[0]!r} is not an executable file on PATH "
                             f"of {node}")
        try:   # the sandbox too, as program() checks it here
            cls.confined and await ray.remote(check_sandbox).options(**cls.options).remote()
        except ray.exceptions.RayTaskError as e:
            raise ValueError(f"{e.cause} (on {node})") from None

    def failed(self, e: Exception) -> DropRollout:   # run_chat_agent's (no segment), with the stderr's tail
        return self.drop(getattr(e, "reason", "error"), str(e))

    def drop(self, reason: str, what: str) -> DropRollout:
        """The rollout's drop: the stderr's tail, then (last: what the loop logs once per kind) what happened."""
        tail = self.err.tail.decode(errors="replace").strip() if self.err else ""
        return DropRollout(reason, (f"{tail}\n" if tail else "") + f"--agent_cmd {shlex.join(self.argv)}: {what}"
                           + (" (its stderr's tail above)" if tail else ""))


# ---------------------------------------------------------------- tools from MCP servers (--mcp_server)

def _leaf(e: BaseException) -> BaseException:   # what an MCP client's (anyio's) task groups wrapped in groups of one
    return _leaf(e.exceptions[0]) if isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1 else e


def _mcp_error(argv: list[str], err, e: BaseException | str) -> DropRollout:
    err.seek(0)
    tail = err.read()[-TAIL:].decode(errors="replace").strip()
    what = e if isinstance(e, str) else getattr(e, "message", None) or str(e) or type(e).__name__
    return DropRollout("mcp_server", (f"{tail}\n" if tail else "") + f"--mcp_server {shlex.join(argv)}: {what}")


async def mcp_tools(servers: list[list[str]], stack: contextlib.AsyncExitStack, timeout: float | None = None) -> dict:
    """Start each MCP server on `stack` (which ends it; stdio, its own process group, the run's environment and so
    its tag, a fresh folder), list its tools: {name: (argv, stderr file, client, OpenAI tool schema)}; DropRollout."""
    import mcp
    from mcp.client.stdio import stdio_client
    tools, cwd = {}, stack.enter_context(tempfile.TemporaryDirectory(prefix="molt-mcp-"))   # removed after the servers
    for argv in servers:
        err = stack.enter_context(tempfile.TemporaryFile())
        named = [os.path.abspath(a) if os.path.isfile(a) else a for a in argv]   # the files it names, from here
        params = mcp.StdioServerParameters(command=named[0], args=named[1:], env=dict(os.environ), cwd=cwd)
        try:
            async with asyncio.timeout(timeout):
                client = await stack.enter_async_context(mcp.Client(stdio_client(params, errlog=err)))
                listed = (page := await client.list_tools()).tools
                while page.next_cursor:
                    listed += (page := await client.list_tools(cursor=page.next_cursor)).tools
        except Exception as e:
            e = _leaf(e)
            raise _mcp_error(argv, err, f"did not start within {timeout:g}s" if isinstance(e, TimeoutError) else e) from None
        for t in listed:
            if t.name in tools:
                raise ValueError(f"--mcp_server: two servers have a tool named {t.name!r} ({shlex.join(argv)})")
            tools[t.name] = (argv, err, client, {"type": "function", "function": {
                "name": t.name, "description": t.description or "", "parameters": t.input_schema}})
    return tools


def check_mcp_servers(servers: list[list[str]], timeout: float) -> None:
    """Start each server once and list its tools (main.validate, before Ray): ValueError naming one that fails."""
    async def listing():
        async with contextlib.AsyncExitStack() as stack:
            await mcp_tools(servers, stack, timeout)
    try:
        asyncio.run(listing())
    except Exception as e:
        raise ValueError(str(_leaf(e))) from None


async def call_mcp_tool(tools: dict, name: str, arguments: str) -> tuple[str, bool]:
    """Run one tool call: its result as text (the tool message's content), and whether it is an error. A tool that
    raises or a call the server refuses is an error the model reads (MCP's isError); a server gone drops the rollout."""
    if name not in tools:
        return f"Unknown tool: {name}", True
    argv, err, client, _ = tools[name]
    try:
        result = await client.call_tool(name, json.loads(arguments))
    except Exception as e:
        if getattr(e, "code", -32000) == -32000:   # mcp_types.CONNECTION_CLOSED, or not an MCP error
            raise _mcp_error(argv, err, _leaf(e)) from None
        return f"Error: {e.message}", True
    return "\n".join(getattr(b, "text", None) or f"[{b.type}]" for b in result.content), result.is_error


class MCPAgent(ChatAgent):
    """The agent of --mcp_server (docs/programs.md, "Tools from MCP servers"): each rollout starts its own servers,
    offers their tools (`tools=`), runs the model's calls on them and sends the results back as `tool` messages,
    until a reply calls no tool or `max_turns` requests were made. Subclass it (--agent) for your own `reward`."""
    servers: list[list[str]] = []
    max_turns: int = 8

    async def reward(self, answer: str | None, ctx: ChatContext) -> float:
        """The final reply's (None: cut off, or calling tools at the turn limit): a reasoning-gym row's scorer, or its label."""
        import data
        return 0.0 if answer is None else data.score_reasoning_gym(ctx.row, answer) if "entry" in ctx.row else float(
            answer.strip() == str(ctx.label).strip())

    async def run(self, ctx: ChatContext) -> Result:
        import openai
        calls = errors = 0
        try:
            async with contextlib.AsyncExitStack() as stack:
                tools = await mcp_tools(self.servers, stack)
                client = await stack.enter_async_context(openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key))
                messages = list(ctx.messages)
                for _ in range(self.max_turns):
                    choice = (await client.chat.completions.create(
                        model=ctx.model_name, messages=messages, tools=[t[3] for t in tools.values()])).choices[0]
                    messages.append(choice.message.model_dump(exclude_none=True))
                    for call in choice.message.tool_calls or []:
                        text, failed = await call_mcp_tool(tools, call.function.name, call.function.arguments)
                        messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
                        calls, errors = calls + 1, errors + failed
                    if not choice.message.tool_calls:
                        break
        except BaseExceptionGroup as group:
            raise _leaf(group) from None
        answer = choice.message.content if choice.finish_reason == "stop" else None
        return Result(reward=await self.reward(answer, ctx), info={"tool_calls": calls, "tool_errors": errors})


def agent_class(cfg: dict) -> type:
    """The run's agent: a `Program` subclass running --agent_cmd, the class defined in --agent, or an `MCPAgent` (or
    the --agent subclass of it) with the servers of --mcp_server (each split as a shell would)."""
    if not cfg.get("mcp_server"):
        return (program(cfg["agent_cmd"], cfg["agent_timeout"], cfg.get("agent_resources"),
                        cfg.get("program_sandbox", "on") == "on", cfg.get("program_env", []))
                if cfg.get("agent_cmd") is not None else load_agent(cfg["agent"]))
    base = load_agent(cfg["agent"]) if cfg["agent"] else MCPAgent
    if not issubclass(base, MCPAgent):
        raise ValueError(f"--mcp_server with --agent: {base.__name__} must subclass programs.MCPAgent (it runs the tools)")
    if not all(servers := [shlex.split(c) for c in cfg["mcp_server"]]):
        raise ValueError("--mcp_server is empty: give the command that starts an MCP server on stdio")
    return type(base.__name__, (base,), {"servers": servers, "max_turns": cfg["max_turns"] or base.max_turns})
