"""Plot runs: reward, response length, KL/mismatch and step time over steps, runs overlaid.

    python plot.py runs/latest                      # -> runs/latest/metrics.png
    python plot.py runs/a runs/b -o compare.png     # several runs on one picture
"""

import argparse

import logs

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run folders (or metrics.jsonl files)")
    p.add_argument("-o", "--out", default=None, help="PNG path (default: RUN/metrics.png for one run, "
                   "compare.png for several)")
    args = p.parse_args()
    out = args.out or (f"{args.runs[0]}/metrics.png" if len(args.runs) == 1 else "compare.png")
    try:
        print(logs.plot(args.runs, out))
    except ValueError as e:
        p.error(str(e))
