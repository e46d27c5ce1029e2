"""Print the README's flag reference (Markdown tables, one per group) from main.build_parser().

    python docs/flags.py              # print it
    python docs/flags.py --write      # replace the block between the flags markers in README.md

tests/test_recipes.py checks that README.md holds exactly this output, so it cannot drift.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import logs  # noqa: E402
import main  # noqa: E402

BEGIN, END = "<!-- flags:begin -->", "<!-- flags:end -->"


def block() -> str:
    return f"{BEGIN}\n{logs.flags_markdown(main.build_parser(), str(main.ROOT))}{END}"


def write(readme: Path = ROOT / "README.md") -> None:
    text = readme.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    readme.write_text(head + block() + tail)


if __name__ == "__main__":
    write() if "--write" in sys.argv else print(block())
