"""The layout promises that keep the project readable whole (light: no engine, no Ray).

    python -m pytest -q tests/test_layout.py

docs/flags.md equals what docs/flags.py generates from argparse; README.md stays short enough to
read in ten minutes (details live in docs/)."""

import importlib.util
from pathlib import Path

import main

ROOT = Path(__file__).resolve().parents[1]
README_BYTES = 20_000


def _flags_script():
    spec = importlib.util.spec_from_file_location("docs_flags", ROOT / "docs" / "flags.py")
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
