"""Draw docs/performance_h100.png from the H100 FA sweep tables beside cuDNN and FlashAttention-4.

No measurement happens here: the numbers are the tables of docs/hopper_fwd_configs.md, "The FA
sweep on an H100 again" (the forward after its change), and docs/performance_backward.md, "The
FA sweep's backward on an H100 again" (``flashcore-bench --preset sweep --providers
flashcore,sdpa-cudnn,fa4``, bf16 and fp16, two runs each). Each table row holds TFLOP/s "run 1 /
run 2" for FlashCore, cuDNN and FA4; the plot shows FlashCore's speed over each of the other two.
Run from the repository root: ``python docs/plot_performance.py`` (needs matplotlib).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from pathlib import Path

import matplotlib.pyplot as plt

DOCS = Path(__file__).resolve().parent
PAIR = r"(\d+) / (\d+)"
ROW = re.compile(
    rf"^\| (\d+) \| (yes|no) \| (\d+) \| {PAIR} \| {PAIR} \| {PAIR} \| [\d. /]+\| [\d. /]+\|$"
)
SOURCES = {
    "forward": ("hopper_fwd_configs.md", "## The FA sweep on an H100 again"),
    "backward": ("performance_backward.md", "### The FA sweep's backward on an H100 again"),
}
PEERS = ("cuDNN", "FlashAttention-4")


def sweep_rows(name: str) -> list[tuple]:
    """The section's rows, both dtypes' tables: (D, causal, S, flashcore (r1, r2), cuDNN (r1,
    r2), FA4 (r1, r2))."""
    path, heading = SOURCES[name]
    text = (DOCS / path).read_text()
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    rows = []
    for m in filter(None, (ROW.match(line) for line in section.splitlines())):
        v = [int(x) for x in m.groups()[3:]]
        rows.append((int(m[1]), m[2] == "yes", int(m[3]), v[0:2], v[2:4], v[4:6]))
    assert len(rows) == 48, f"{name}: {len(rows)} rows (24 a dtype expected)"
    return rows


def main() -> None:
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharey=True)
    for row_axes, name in zip(axes, SOURCES, strict=True):
        rows = sweep_rows(name)
        for peer_index, (ax, peer) in enumerate(zip(row_axes, PEERS, strict=True)):
            lines = defaultdict(lambda: defaultdict(list))
            every = []
            for d, causal, s, ours, *peers in rows:
                ratios = [a / b for a, b in zip(ours, peers[peer_index], strict=True)]
                lines[(d, causal)][s] += ratios
                every += ratios
            for (d, causal), by_s in sorted(lines.items()):
                seqs = sorted(by_s)
                median = [statistics.median(by_s[s]) for s in seqs]
                label = f"D={d}, {'causal' if causal else 'non-causal'}"
                (line,) = ax.plot(seqs, median, marker="o", label=label)
                for s in seqs:
                    ax.plot([s, s], [min(by_s[s]), max(by_s[s])], color=line.get_color(), lw=1)
            ax.axhline(1.0, color="gray", lw=1, ls="--")
            # FA4's slowest short-problem timings (a run where it read a third of its rate)
            # would flatten the rest: bars past the top are cut, the title keeps the extremes.
            ax.set_ylim(0.8, 1.7)
            ax.set_xscale("log", base=2)
            ticks = [512, 1024, 2048, 4096, 8192, 16384]
            ax.set_xticks(ticks, ["512", "1k", "2k", "4k", "8k", "16k"])
            geomean = math.exp(sum(map(math.log, every)) / len(every))
            ax.set_title(
                f"{name} vs {peer}: geomean {geomean:.3f}, {min(every):.2f} to {max(every):.2f}",
                fontsize=10,
            )
            ax.grid(alpha=0.3)
            if name == "backward":
                ax.set_xlabel("sequence length (B·S = 16384, H·D = 2048)")
        row_axes[0].set_ylabel("FlashCore speed / the other's")
    axes[0][0].legend(loc="upper right", fontsize=8)
    fig.suptitle(
        "H100 80GB, bf16 and fp16, two runs each (bars: range of the four; line: median). "
        "Above 1: FlashCore faster",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(DOCS / "performance_h100.png", dpi=100)


if __name__ == "__main__":
    main()
