"""Draw docs/performance_h100.png from the FA sweep tables in docs/performance.md.

No measurement happens here: the numbers are the two H100 runs of the section "FA sweep, two runs
(H100)" (``flashcore-bench --preset sweep``, FlashCore against SDPA, which picks cuDNN there).
Run from the repository root: ``python docs/plot_performance.py`` (needs matplotlib).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path

import matplotlib.pyplot as plt

DOCS = Path(__file__).resolve().parent
ROW = re.compile(
    r"^\| (\d+) \| (yes|no) \| (\d+) \| (bf16|fp16) \| [\d /]+\| [\d /]+\| ([\d.]+) / ([\d.]+) \|$"
)


def sweep_tables(text: str) -> dict[str, list[tuple]]:
    """The forward and backward tables of the FA sweep section: rows of
    (D, causal, S, dtype, ratio run 1, ratio run 2)."""
    section = text.split("## FA sweep, two runs (H100)", 1)[1].split("\n## ", 1)[0]
    forward, backward = section.split("Backward:", 1)
    # The current backward table only (the one before the Hopper backward follows it).
    backward = backward.split("The backward before it", 1)[0]
    tables = {}
    for name, part in (("forward", forward), ("backward", backward)):
        rows = [ROW.match(line) for line in part.splitlines()]
        tables[name] = [
            (int(m[1]), m[2] == "yes", int(m[3]), m[4], float(m[5]), float(m[6])) for m in rows if m
        ]
    return tables


def main() -> None:
    tables = sweep_tables((DOCS / "performance.md").read_text())
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, (name, rows) in zip(axes, tables.items(), strict=True):
        assert len(rows) == 48, f"{name}: {len(rows)} rows"
        lines = defaultdict(list)
        for d, causal, s, dtype, r1, r2 in rows:
            lines[(d, causal)].append((s, dtype, r1, r2))
        for (d, causal), points in sorted(lines.items()):
            seqs = sorted({p[0] for p in points})
            # Every point: both dtypes, both runs; the line joins their medians.
            ratios = {s: sorted(r for p in points if p[0] == s for r in p[2:]) for s in seqs}
            median = [(v[1] + v[2]) / 2 for v in (ratios[s] for s in seqs)]
            label = f"D={d}, {'causal' if causal else 'non-causal'}"
            (line,) = ax.plot(seqs, median, marker="o", label=label)
            for s in seqs:
                ax.plot([s, s], [ratios[s][0], ratios[s][-1]], color=line.get_color(), lw=1)
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks([512, 1024, 2048, 4096, 8192, 16384], ["512", "1k", "2k", "4k", "8k", "16k"])
        ax.set_xlabel("sequence length (B·S = 16384, H·D = 2048)")
        every = [r for row in rows for r in row[4:]]
        geomean = math.exp(sum(map(math.log, every)) / len(every))
        ax.set_title(f"{name}: geomean {geomean:.3f}, {min(every):.2f} to {max(every):.2f}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("FlashCore speed / SDPA (cuDNN) speed")
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(
        "H100 80GB, fp16 and bf16, two runs (bars: range; line: median). Above 1: FlashCore faster",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(DOCS / "performance_h100.png", dpi=110)


if __name__ == "__main__":
    main()
