"""The seeds' GPT-2-vs-LLaMA experiment at full size: validation curves and the summary table.

Reads seeds-experiment-evals.json (beside this file: the curves measured on one NVIDIA H200,
copied unedited from the run's data), writes val_loss.png beside it and prints the table of
results.md (best evaluation, its step, and the evaluations at steps 250 and 5000):

    python docs/results/seeds-full-size/plot.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
# JSON key -> (label, colour); seed 1337 solid, seed 7 dashed
ARMS = {
    "gpt2-shakespeare": ("GPT-2 style, pre-LN", "tab:blue"),
    "llama-shakespeare": ("LLaMA style", "tab:orange"),
    "gpt2-shakespeare-postln": ("GPT-2 style, post-LN", "tab:green"),
    "nanogpt-train.py": ("nanoGPT train.py", "black"),
}
CLAIM = {"GPT-2 style": 1.47, "LLaMA style": 1.42}  # the documents' "final loss", 5000 steps


def runs(path: Path = HERE / "seeds-experiment-evals.json") -> list[dict]:
    out = []
    for key, curve in json.loads(path.read_text()).items():
        arm, seed = key.rsplit("_seed", 1)
        points = {r["step"]: r["val_loss"] for r in curve}
        best = min(points, key=points.get)
        out.append(dict(key=key, arm=arm, seed=int(seed), points=points, best=points[best],
                        best_step=best))  # fmt: skip
    return out


def ordered(rs: list[dict]) -> list[dict]:
    """By arm as in ARMS, seed 1337 first."""
    return sorted(rs, key=lambda r: (list(ARMS).index(r["arm"]), r["seed"] != 1337))


def table(rs: list[dict]) -> str:
    lines = [
        "| arm | seed | best val loss | at step | val at step 250 | val at step 5000 |",
        "|---|---|---|---|---|---|",
    ]
    for r in ordered(rs):
        p = r["points"]
        lines.append(
            f"| {ARMS[r['arm']][0]} | {r['seed']} | {r['best']:.3f} | {r['best_step']} | "
            f"{p[250]:.3f} | {p[5000]:.3f} |"
        )
    return "\n".join(lines)


def plot(rs: list[dict], png: Path = HERE / "val_loss.png") -> None:
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=100)
    for r in ordered(rs):
        label, colour = ARMS[r["arm"]]
        steps = [s for s in sorted(r["points"]) if s > 0]  # nanoGPT's step 0 is 4.28: off scale
        ax.plot(steps, [r["points"][s] for s in steps], "-" if r["seed"] == 1337 else "--",
                color=colour, lw=1.5, marker="o", ms=2.5, label=f"{label}, seed {r['seed']}")  # fmt: skip
        ax.plot([r["best_step"]], [r["best"]], "*", color=colour, ms=10)
    for what, loss in CLAIM.items():
        ax.axhline(loss, color="grey", lw=0.9, ls=":")
        ax.annotate(f"documents: {what} {loss}", (5000, loss), xytext=(-4, 3),
                    textcoords="offset points", ha="right", fontsize=8, color="dimgrey")  # fmt: skip
    ax.set_xlim(0, 5100)
    ax.set_ylim(1.35, 2.2)
    ax.set_xlabel("step (batch 64 x 256 tokens)")
    ax.set_ylabel("validation loss (nats/char, 200 batches)")
    ax.set_title("GPT-2 vs LLaMA style at 10M parameters, tiny Shakespeare, one H200 (* = best)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2, loc="upper center")
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


if __name__ == "__main__":
    rs = runs()
    plot(rs)
    print(table(rs))
