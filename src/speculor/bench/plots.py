"""PNG plots of a bench run: speedup per category, τ per strategy, acceptance by depth, time split."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def draw_all(out: Path, summary: dict[str, Any], records: list[dict[str, Any]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    strategies = [s for s in summary if not s.startswith("_")]
    temps = list(summary[strategies[0]]["by_temperature"])
    paths = []
    for temp in temps:
        tag = f"T{temp}"
        rows = {s: summary[s]["by_temperature"][temp] for s in strategies}
        for name, fn in (("speedup_by_category", _speedup_by_category), ("tau", _tau),
                         ("acceptance_by_depth", _acceptance), ("time_split", _time_split)):
            fig, ax = plt.subplots(figsize=(8, 4.5))
            fn(ax, rows, records, float(temp))
            ax.set_title(f"{ax.get_title()} (T = {temp})")
            fig.tight_layout()
            path = out / f"{name}_{tag}.png"
            fig.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(fig)
            paths.append(path)
    return paths


def _speedup_by_category(ax, rows: dict, records: list[dict], temp: float) -> None:
    cats = sorted({r["category"] for r in records})
    width = 0.8 / max(len(rows), 1)
    for i, s in enumerate(rows):
        vals = [rows[s].get("speedup_by_category", {}).get(c, 0.0) for c in cats]
        ax.bar([j + i * width for j in range(len(cats))], vals, width, label=s)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=20)
    ax.set_ylabel("speedup over plain")
    ax.set_title("Speedup per category")
    _legend(ax)


def _tau(ax, rows: dict, records: list[dict], temp: float) -> None:
    names = [s for s in rows if rows[s].get("tau")]
    ax.bar(names, [rows[s]["tau"] for s in names])
    ax.set_ylabel("τ (tokens per target forward)")
    ax.set_title("τ per strategy")
    ax.tick_params(axis="x", rotation=20)


def _acceptance(ax, rows: dict, records: list[dict], temp: float) -> None:
    for s, a in rows.items():
        if a.get("acceptance_by_depth"):
            ax.plot(range(1, len(a["acceptance_by_depth"]) + 1), a["acceptance_by_depth"], marker="o", label=s)
    ax.set_xlabel("depth d")
    ax.set_ylabel("P(accepted length ≥ d)")
    ax.set_title("Acceptance by depth")
    _legend(ax)


def _time_split(ax, rows: dict, records: list[dict], temp: float) -> None:
    names = [s for s in rows if rows[s].get("time_split")]
    bottom = [0.0] * len(names)
    for key in ("prefill_s", "draft_s", "verify_s", "overhead_s"):
        vals = [rows[s]["time_split"][key] for s in names]
        ax.bar(names, vals, bottom=bottom, label=key.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("share of wall time")
    ax.set_title("Time split")
    _legend(ax)
    ax.tick_params(axis="x", rotation=20)


def _legend(ax) -> None:
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside the axes: never over a bar
