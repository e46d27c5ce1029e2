"""The layout promises that keep the project readable whole (light: no engine, no Ray).

    python -m pytest -q tests/test_layout.py

docs/flags.md equals what tests/flags_page.py generates from argparse; README.md stays short enough to
read in ten minutes (details live in docs/); no code outside tests/ uses a top-level module's
private (`_x`) names from another file, and the top-level modules' imports form no circle (what
two modules share gets a module of its own, as trajectory.py is for agent.py and server.py)."""

import ast
import importlib.util
from pathlib import Path

import main

ROOT = Path(__file__).resolve().parents[1]
README_BYTES = 20_000


def _flags_script():
    spec = importlib.util.spec_from_file_location("docs_flags", ROOT / "tests" / "flags_page.py")
    flags = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flags)
    return flags


def test_flag_reference_is_generated(monkeypatch):
    # conftest points --output_dir's default at a temporary folder; the page shows the real default
    monkeypatch.setattr(main, "build_parser", getattr(main.build_parser, "unpatched", main.build_parser))
    flags = _flags_script()
    stale = f"docs/flags.md is stale (a flag, a default, a help text or an estimator/loss list changed): run `{flags.COMMAND}`"
    assert flags.PAGE.exists(), stale
    assert flags.PAGE.read_text() == flags.page(), stale


def test_readme_reads_in_ten_minutes():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_BYTES, (f"README.md is {size} bytes, over {README_BYTES}: move the detail to a docs/ page "
                                  "and link it from the README's list")


MODULES = {p.stem for p in ROOT.glob("*.py")}
CODE = sorted([*ROOT.glob("*.py"), *ROOT.glob("bench/**/*.py"), *ROOT.glob("examples/**/*.py"),
               *ROOT.glob("docs/**/*.py")])   # tests/ may reach into the module each one tests


def _uses(path: Path) -> tuple[set[str], list[str]]:
    """The top-level modules `path` imports (anywhere in the file, TYPE_CHECKING included) and
    the private names of theirs it uses: `from m import _x`, `m._x`, getattr/setattr(m, "_x")."""
    tree = ast.parse(path.read_text(), str(path))
    imported, private, alias = set(), [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES:
                    imported.add(a.name)
                    alias[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in MODULES:
            imported.add(node.module)
            private += [f"line {node.lineno}: from {node.module} import {a.name}"
                        for a in node.names if a.name.startswith("_")]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in alias
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            private.append(f"line {node.lineno}: {alias[node.value.id]}.{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
              and len(node.args) > 1 and isinstance(node.args[0], ast.Name) and node.args[0].id in alias
              and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_")):
            private.append(f"line {node.lineno}: {node.func.id}({alias[node.args[0].id]}, {node.args[1].value!r})")
    return imported - {path.stem}, private


def test_no_module_uses_another_modules_private_names():
    found = [f"{p.relative_to(ROOT)} {use}" for p in CODE for use in _uses(p)[1]]
    assert not found, ("private (_x) names used from another module; make the shared part public, in a module "
                       "of its own if two modules share it:\n" + "\n".join(found))


def test_top_level_imports_form_no_circle():
    graph = {m: _uses(ROOT / f"{m}.py")[0] for m in MODULES}
    done, path = set(), []

    def visit(m):
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        path.append(m)
        for n in sorted(graph[m]):
            if circle := visit(n):
                return circle
        path.pop()
        done.add(m)

    for m in sorted(MODULES):
        circle = visit(m)
        assert circle is None, ("top-level modules import each other in a circle: " + " -> ".join(circle)
                                + "; move what they share into a module both import")
