"""Write docs/flags.md, the flag reference (one Markdown table per argument group), from main.build_parser().

    python tests/flags_page.py              # print it
    python tests/flags_page.py --write      # write docs/flags.md

Regenerate it whenever a flag, its default or its help text changes, and when an estimator or a
loss is added (the help texts list them). tests/test_layout.py fails while docs/flags.md is stale.
"""

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import main  # noqa: E402

PAGE = ROOT / "docs" / "flags.md"
COMMAND = "python tests/flags_page.py --write"
HEADER = (f"# Flag reference\n\nGenerated from `main.build_parser()` by `{COMMAND}`: do not edit it by hand.\n"
          "`python main.py --help` prints the same. Bad values and unsound combinations are refused before\n"
          "anything starts (`main.validate`), with a message that names the flag.\n\n")


def page() -> str:
    """Every flag of main.py as Markdown tables, one per argument group. Defaults under the
    checkout are shown relative to it, so the page is the same anywhere."""
    parser, root = main.build_parser(), str(main.ROOT)
    lines = []
    for group in parser._action_groups:   # argparse keeps its groups only here
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        lines += [f"**{group.title}**", "", "| flag | default | meaning |", "|---|---|---|"]
        for a in actions:
            flag = ", ".join(a.option_strings)
            if a.choices:
                flag += " {" + "|".join(map(str, a.choices)) + "}"
            elif a.nargs not in (None, 0) and a.metavar:
                flag += " " + " ".join(a.metavar if isinstance(a.metavar, tuple) else [a.metavar])
            value = a.default
            if isinstance(value, str) and value.startswith(root):
                value = os.path.relpath(value, root)
            default = "" if value in (None, False, []) or value is argparse.SUPPRESS else f"`{value}`"
            help_text = (a.help or "").replace("|", "\\|").replace("\n", " ")
            flag = flag.replace("|", "\\|")   # a pipe in a table cell, even in code, must be escaped
            lines.append(f"| `{flag}` | {default} | {help_text} |")
        lines.append("")
    return HEADER + "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    PAGE.write_text(page()) if "--write" in sys.argv else print(page(), end="")
