"""Tokens/s against context depth as a PNG (matplotlib, the optional `plot` extra)."""

from __future__ import annotations

import importlib.util
import io
import re
from pathlib import Path

from lucebox.errors import InvalidArgumentError


def require_matplotlib() -> None:
    """Checked before anything is measured, so a long run never ends without its plot."""
    if importlib.util.find_spec("matplotlib") is None:
        raise InvalidArgumentError("--plot needs matplotlib, which is not installed: pip install 'lucebox[plot]'")


def png_bytes(result: dict) -> bytes:
    """The plot as PNG bytes. Two panels over a log-2 depth axis: prefill tokens/s, and decode tokens/s plain and
    speculative; markers at the median, bars from the fastest to the slowest repeat."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lucebox.benchmark.report import depth_label, machine_label

    rows = result["rows"]
    depths = [row["depth"] for row in rows]
    speculative = any(row["spec_speedup"] is not None for row in rows)
    apart = 2 ** 0.03 if speculative else 1.0  # plain and speculative bars side by side, never hiding each other
    fig, (prefill, decode) = plt.subplots(1, 2, figsize=(11, 4.8), constrained_layout=True)
    series = ((prefill, "prefill_tokens_per_s", "prefill", "tab:purple", 1.0),
              (decode, "decode_tokens_per_s", "decode, plain", "tab:blue", 1 / apart),
              (decode, "spec_decode_tokens_per_s", "decode, speculative", "tab:orange", apart))
    for ax, key, label, colour, shift in series:
        points = [row for row in rows if row[key] is not None]
        if not points:
            continue
        x = [row["depth"] * shift for row in points]
        y = [row[key] for row in points]
        spread = [[v - row[f"{key}_min"] for v, row in zip(y, points, strict=True)],
                  [row[f"{key}_max"] - v for v, row in zip(y, points, strict=True)]]
        ax.errorbar(x, y, yerr=spread, marker="o", capsize=4, color=colour, label=label)
    for ax, name in ((prefill, "prefill (from an empty cache)"), (decode, "decode")):
        labels = [depth_label(d) for d in depths]
        if ax is decode and speculative:  # the speed-up and acceptance length under each depth
            labels = [f"{text}\nx{row['spec_speedup']:.2f}, accept {row['acceptance_length']:.2f}"
                      if row["spec_speedup"] is not None else text for text, row in zip(labels, rows, strict=True)]
            name += " (under each depth: speculative speed-up, acceptance length)"
        ax.set_xscale("log", base=2)
        ax.set_xticks(depths, labels)
        ax.minorticks_off()
        ax.margins(x=0.1)
        ax.set_xlabel("context depth (tokens)")
        ax.set_ylabel("tokens/s")
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.05)
        ax.set_title(name, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower left")
    s = result["settings"]
    # a prompt file is named by its file name alone: a full path would run off the figure
    prompt = re.sub(r"file (\S+)", lambda m: "file " + Path(m.group(1)).name, s["prompt"])
    heading = (f"lucebox bench: {result['model']['name']} on {s['device']} ({machine_label(result['machine'])}), "
               f"{s['dtype']}, commit {result['commit'][:10]}\n{prompt}, {s['gen']} tokens decoded per request; "
               + (f"median of {s['repeat']} requests, bars: slowest to fastest" if s["repeat"] > 1
                  else "one request per point"))
    fig.suptitle(heading.replace("$", r"\$"), fontsize=10)  # a name's $...$ is text, not mathtext to parse
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    return png.getvalue()
