"""Print the fault suite's ledgers as the table in docs/reliability.md, and
draw a soak's samples.

    python -m tests.faults.report LEDGERS.jsonl
    python -m tests.faults.report --plot SOAK.csv OUT.png   (needs matplotlib: make soak)
"""

from __future__ import annotations

import csv
import json
import sys


def table(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    out = [
        "| scenario | mode | faults injected | messages | done | dead | lost "
        "| duplicates at the receiver (why) | effect rows |",
        "|---|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        why = ", ".join(f"{n} {k}" for k, n in sorted(r["explained"].items())) or "-"
        if r.get("unexplained"):
            why += f"; **{len(r['unexplained'])} unexplained**"
        out.append(
            f"| {r['scenario']} | {r.get('mode', '')} | {r['faults'] or 'none (control)'} "
            f"| {r['messages']} | {r['done']} | {r['dead']} | {r['lost']} "
            f"| {r['duplicates']} ({why}) | {r['effects']} |"
        )
    return "\n".join(out)


def plot(samples: str, image: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(samples, encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    t = [float(r["t"]) / 60 for r in rows]
    series = [
        ("rss_mb", "worker RSS (MB, both workers' process groups)"),
        ("connections", "connections to the outbox's database"),
        ("oldest_waiting_s", "oldest undelivered message (s)"),
    ]
    fig, axes = plt.subplots(len(series), 1, sharex=True, figsize=(8, 6.5))
    for ax, (key, label) in zip(axes, series):
        ax.plot(t, [float(r[key]) for r in rows], linewidth=1)
        ax.set_title(label, fontsize=9, loc="left")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes")
    fig.suptitle("outbox-relay soak: steady load, faults at random", fontsize=10)
    fig.tight_layout()
    fig.savefig(image, dpi=100)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plot"]:
        plot(sys.argv[2], sys.argv[3])
    else:
        print(table(sys.argv[1]))
