"""The KV plot of a run: KV utilization and running requests over the run's steps (matplotlib, a PNG)."""

from __future__ import annotations

from pathlib import Path


def plot_kv_run(
    path: Path,
    seconds: list[float],  # time of each step's end since the run's start
    utilization: list[float],  # KV utilization after each step (filled slots / slots of referenced pages)
    running: list[int],  # requests in each step
    pages_in_use: list[int],
    num_pages: int,
    contiguous_requests: int | None = None,  # requests contiguous max_model_len reservations would fit
    title: str = "",
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or pip install -e '.[bench]')") from None
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6), constrained_layout=True)
    top.plot(seconds, [100 * u for u in utilization], label="KV utilization (filled / allocated slots)")
    top.plot(seconds, [100 * p / num_pages for p in pages_in_use], label="pool pages in use")
    top.set_ylabel("%")
    top.set_ylim(0, 105)
    top.legend(loc="lower right")
    bottom.step(seconds, running, where="post", label="running requests (paged KV)")
    if contiguous_requests is not None:
        bottom.axhline(contiguous_requests, color="tab:red", linestyle="--", label="contiguous max_model_len slots")
    bottom.set_ylabel("requests")
    bottom.set_xlabel("seconds since the first request")
    bottom.legend(loc="upper right")
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
