"""Terminal tasks in Harbor's format, run without an image: `--dataset DIR` (a folder of task folders) with
`--agent_cmd`. A task folder holds instruction.md (the rollout's prompt), task.toml ([agent] and [verifier]
timeout_sec, [verifier] env), environment/ (its Dockerfile's WORKDIR, COPY and ENV are followed: the files are
copied into the rollout's workspace, which the sandbox mounts at WORKDIR), tests/test.sh and solution/solve.sh.
After the program ends, the task's tests/ are copied to /tests and `bash /tests/test.sh` runs in a sandbox on the
same workspace; the reward is what it writes to /logs/verifier/reward.txt (or reward.json's "reward").
A task whose Dockerfile needs an image build (RUN, or anything but FROM/WORKDIR/COPY/ENV/LABEL) is refused at
start-up with the line that needs it. docs/programs.md, "Terminal tasks".
"""

import json
import shutil
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath


def is_folder(path: Path) -> bool:
    return path.is_dir() and any((p / "task.toml").is_file() for p in path.iterdir())


@dataclass
class Task:
    path: Path
    workdir: str = "/app"
    copies: list = field(default_factory=list)   # (source in environment/, destination)
    env: dict = field(default_factory=dict)   # its Dockerfile's ENV (the verifier's: + [verifier] env)
    verifier_env: dict = field(default_factory=dict)
    timeouts: dict = field(default_factory=dict)   # [agent] and [verifier] timeout_sec

    @classmethod
    def load(cls, path: str) -> "Task":
        """The task at `path`, checked: ValueError naming what is missing or what needs an image build."""
        task = cls(Path(path))
        for need in ("instruction.md", "task.toml", "tests/test.sh"):
            if not (task.path / need).is_file():
                raise ValueError(f"{task.path.name}: no {need}")
        config = tomllib.loads((task.path / "task.toml").read_text())
        task.timeouts = {k: float(config.get(k, {}).get("timeout_sec", 0)) for k in ("agent", "verifier")}
        task.verifier_env = {k: str(v) for k, v in config.get("verifier", {}).get("env", {}).items()}
        docker = task.path / "environment" / "Dockerfile"
        for n, line in enumerate(docker.read_text().splitlines() if docker.is_file() else [], 1):
            op, *args = line.split() or ["#"]
            if op.upper() == "WORKDIR":
                task.workdir = str(PurePosixPath(task.workdir, args[0]))
            elif op.upper() == "COPY" and len(args) == 2 and not args[0].startswith("--"):
                task.copies.append((args[0], args[1] if args[1].startswith("/") else f"{task.workdir}/{args[1]}"))
            elif op.upper() == "ENV" and args:
                name, _, value = args[0].partition("=")
                task.env[name] = value or " ".join(args[1:])
            elif not (op.startswith("#") or op.upper() in ("FROM", "LABEL")):
                raise ValueError(f"{task.path.name}: environment/Dockerfile line {n} ({op}) needs an image build, "
                                 "which this runner has not (FROM, WORKDIR, COPY, ENV and LABEL are followed)")
        if outside := [d for _, d in task.copies if not PurePosixPath(d).is_relative_to(task.workdir)]:
            raise ValueError(f"{task.path.name}: environment/Dockerfile copies to {outside[0]}, outside its WORKDIR "
                             f"{task.workdir} (the only place a rollout's files go)")
        return task

    def prepare(self, work: Path):
        """Copy its COPY sources into `work`, the folder the sandbox mounts at WORKDIR."""
        for source, dest in self.copies:
            src, inside = self.path / "environment" / source, PurePosixPath(dest).relative_to(self.workdir)
            target = work / inside if not dest.endswith("/") or src.is_dir() else work / inside / src.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(src, target, dirs_exist_ok=True) if src.is_dir() else shutil.copy(src, target)


def rows(path: Path):
    """data.load_rows's reader for a folder of tasks: (where, row) with the instruction as the prompt."""
    found, refused = [], []
    for folder in sorted(p for p in path.iterdir() if (p / "task.toml").is_file()):
        try:
            found.append(Task.load(str(folder.resolve())))
        except (ValueError, OSError, tomllib.TOMLDecodeError) as e:
            refused.append(str(e))
    if refused:
        raise ValueError(f"--dataset {path}: {len(refused)} of {len(found) + len(refused)} tasks cannot run here:\n  "
                         + "\n  ".join(refused) + (f"\nthese could: {', '.join(t.path.name for t in found)}"
                                                    if found else ""))
    yield from ((str(t.path), {"prompt": (t.path / "instruction.md").read_text(), "task": str(t.path)}) for t in found)


def reward(logs: Path) -> float | None:
    """What the verifier wrote: reward.txt's number, or reward.json's "reward"; None if neither."""
    text, data = logs / "reward.txt", logs / "reward.json"
    try:
        return float(text.read_text()) if text.is_file() else float(json.loads(data.read_text())["reward"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
