#!/usr/bin/env python3
"""Tables of bench-rsocket-guest.sh: the figures of kernel TCP, rsocket and sandirect measured
in interleaved rounds (medians), the median of the per-round ratios, and the "runs it?" table.

usage: bench-rsocket-table.py RAW RUNS
RAW lines:  ROUND VARIANT FIGURE VALUE   or   ROUND VARIANT path PATH RDMA_PACKETS
RUNS lines: PROGRAM|VARIANT|yes/no|detail
"""
import statistics
import sys
from collections import defaultdict

VARIANTS = ["tcp", "rsocket", "sandirect"]
# figure: (label, unit, higher is better)
FIGURES = {
    "rtt64": ("ping-pong 64 B RTT", "us", False),
    "stream65536": ("stream 64 KiB writes", "MB/s", True),
    "stream1048576": ("stream 1 MiB writes", "MB/s", True),
    "iperf3": ("iperf3 1 stream", "Mbit/s", True),
    "redis-set": ("redis-benchmark SET -c 4", "req/s", True),
    "cpu-rtt64": ("CPU per round trip", "us", False),
    "cpu-stream65536": ("CPU per 64 KiB write", "us", False),
    "cpu-stream1048576": ("CPU per 1 MiB write", "us", False),
}
GOAL = 1.5


def main(raw_path, runs_path):
    values = defaultdict(dict)  # (figure) -> {(round, variant): value}
    paths = defaultdict(list)  # variant -> [(path, packets)]
    for line in open(raw_path):
        fields = line.split()
        if len(fields) == 5 and fields[2] == "path":
            paths[fields[1]].append((fields[3], fields[4]))
        elif len(fields) == 4:
            values[fields[2]][(fields[0], fields[1])] = float(fields[3])

    def cell(number):
        if number is None:
            return "n/a"
        return f"{number:.1f}" if number < 1000 else f"{number:.0f}"

    def speed_ratio(figure, a, b):
        """Median over rounds of a's speed over b's (> 1: a is faster, uses less CPU)."""
        higher_is_better = FIGURES[figure][2]
        rounds = {r for (r, _) in values[figure]}
        ratios = []
        for r in rounds:
            x, y = values[figure].get((r, a)), values[figure].get((r, b))
            if x and y:
                ratios.append(x / y if higher_is_better else y / x)
        return statistics.median(ratios) if ratios else None

    def judged(ratio):
        if ratio is None:
            return "n/a"
        verdict = "goal met" if ratio >= GOAL else ("ahead" if ratio >= 1.0 else "BEHIND")
        return f"{ratio:.2f} ({verdict})"

    header = f"{'figure (median)':<27} {'unit':>6} {'TCP':>9} {'rsocket':>9} {'sandirect':>9}   {'sandirect/rsocket':>19} {'sandirect/TCP':>19}"
    print()
    print(header)
    print("-" * len(header))
    for figure, (label, unit, _) in FIGURES.items():
        if figure not in values:
            continue
        medians = []
        for variant in VARIANTS:
            seen = [v for (r, var), v in values[figure].items() if var == variant]
            medians.append(statistics.median(seen) if seen else None)
        over_rsocket = judged(speed_ratio(figure, "sandirect", "rsocket"))
        over_tcp = judged(speed_ratio(figure, "sandirect", "tcp"))
        print(
            f"{label:<27} {unit:>6} {cell(medians[0]):>9} {cell(medians[1]):>9} {cell(medians[2]):>9}   {over_rsocket:>19} {over_tcp:>19}"
        )
    rounds = len({r for figure in values.values() for (r, _) in figure})
    print(
        f"\nratios: median over {rounds} rounds of the per-round speed ratio (> 1: sandirect faster or"
        f" cheaper; goal {GOAL}); n/a: the system could not run the program (see below)."
    )
    for variant in VARIANTS:
        if paths[variant]:
            seen_paths = sorted({p for p, _ in paths[variant]})
            packets = [int(n) for _, n in paths[variant] if n.isdigit()]
            median_packets = int(statistics.median(packets)) if packets else "n/a"
            print(
                f"  {variant}: sockets-pair path seen by the client {'/'.join(seen_paths)}, "
                f"RDMA packets per pair (median) {median_packets}"
            )

    runs = defaultdict(dict)
    order = []
    for line in open(runs_path):
        program, variant, verdict, detail = line.rstrip("\n").split("|", 3)
        if program not in order:
            order.append(program)
        runs[program][variant] = (verdict, detail)
    print(f"\n{'runs it?':<20} {'rsocket':>8} {'sandirect':>10}")
    for program in order:
        cells = [runs[program].get(v, ("-", ""))[0] for v in VARIANTS[1:]]
        print(f"{program:<20} {cells[0]:>8} {cells[1]:>10}")
    print("(yes: ran with RDMA traffic; TCP: ran, on kernel TCP only; no: failed or hung)")
    print()
    for program in order:
        for variant in VARIANTS[1:]:
            verdict, detail = runs[program].get(variant, ("-", ""))
            print(f"  {program} / {variant}: {verdict}: {detail}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
