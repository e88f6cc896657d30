"""How long train.py takes to refuse a mistake, and how much memory it uses doing so.

Each command below is one a newcomer types by mistake; each is refused before torch is
imported (harness/cli.early_checks), so it costs the interpreter and argparse, not torch's
seconds and 800 MB. The last row times `import torch` alone: what every refusal paid when the
checks came after it. Each command runs --repeats times in its own process; the best wall time
counts (the others waited for a busy machine), with its CPU time (user + system: the part a
busy machine does not stretch) and peak memory (the child's max RSS, os.wait4).

    python benchmarks/bench_refusal.py              # a few seconds
"""

import argparse
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MISTAKES = [["--dataset", "oxford_pet"],  # a misspelled name: its nearest match
            ["--dataset", "toyworld", "--protocol", "fewshoot"],  # a choice
            ["--dataset", "toyworld", "--epochs", "0"],  # a number
            ["--dataset", "toyworld", "--seeds", "one"],  # a type
            ["--dataset", "oxford_pets", "--root"],  # `--root $DATA` with $DATA unset
            ["--dataset", "toyworld", "--resume"]]  # --resume without its folder


def measure(command: list) -> tuple:
    """(exit status, wall seconds, CPU seconds, peak MB) of one child process."""
    started = time.perf_counter()
    child = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)  # the child's own usage, not all children's
    wall = time.perf_counter() - started
    cpu = usage.ru_utime + usage.ru_stime
    return os.waitstatus_to_exitcode(status), wall, cpu, usage.ru_maxrss / 1024  # KB -> MB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per command; the best counts")
    args = parser.parse_args()
    rows = [(" ".join(argv), [sys.executable, "train.py", *argv]) for argv in MISTAKES]
    rows.append(("(import torch alone)", [sys.executable, "-c", "import torch"]))
    print(f"{'command':<48} {'exit':>4} {'wall s':>7} {'CPU s':>6} {'peak MB':>8}")
    for name, command in rows:
        runs = [measure(command) for _ in range(args.repeats)]
        status, wall, cpu, peak = min(runs, key=lambda run: run[1])
        print(f"{name:<48} {status:>4} {wall:>7.2f} {cpu:>6.2f} {peak:>8.0f}")


if __name__ == "__main__":
    main()
