"""Where training metrics go: JSONL, TensorBoard event files, W&B when configured, a PNG at the end.

Only process 0 writes; every other process gets a writer that does nothing. A resumed run first
drops what was recorded after the checkpoint it resumes from (those steps run again), so
``metrics.jsonl`` holds each step once and TensorBoard hides the superseded points.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from typing import IO, Any

import jax

log = logging.getLogger(__name__)

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class ChipPeak:
    """Nominal figures of one JAX device (a TPU v2/v3 device is one core, later TPUs one chip)."""

    hbm_bytes: int
    flops: float  # dense bfloat16 FLOP/s
    hbm_bandwidth: float  # bytes/s


# Device kind prefix -> its figures; the longest matching prefix wins. XLA keeps a little HBM for
# itself (e.g. 15.48 GiB usable of a v3 core's 16).
CHIP_PEAKS = {
    "TPU v2": ChipPeak(8 * GiB, 22.5e12, 350e9),
    "TPU v3": ChipPeak(16 * GiB, 61.5e12, 450e9),
    "TPU v4": ChipPeak(32 * GiB, 275e12, 1.2e12),
    "TPU v5 lite": ChipPeak(16 * GiB, 197e12, 819e9),
    "TPU v5e": ChipPeak(16 * GiB, 197e12, 819e9),
    "TPU v5p": ChipPeak(95 * GiB, 459e12, 2.765e12),
    "TPU v5": ChipPeak(95 * GiB, 459e12, 2.765e12),
    "TPU v6 lite": ChipPeak(32 * GiB, 918e12, 1.64e12),
    "TPU v6e": ChipPeak(32 * GiB, 918e12, 1.64e12),
    "NVIDIA A100-SXM4-40GB": ChipPeak(40 * GiB, 312e12, 1.555e12),
    "NVIDIA A100": ChipPeak(80 * GiB, 312e12, 2.039e12),
    "NVIDIA H100": ChipPeak(80 * GiB, 989e12, 3.35e12),
    "NVIDIA H200": ChipPeak(141 * 10**9, 989e12, 4.8e12),
}


def chip_peak(device_kind: str) -> ChipPeak | None:
    """The figures of the longest prefix of ``device_kind`` in :data:`CHIP_PEAKS` (None: unknown chip)."""
    matches = [name for name in CHIP_PEAKS if device_kind.startswith(name)]
    return CHIP_PEAKS[max(matches, key=len)] if matches else None


def peak_flops_per_device(override: float | None = None) -> float | None:
    """The device's peak FLOP/s: ``override`` if given, else from the table, else None (unknown)."""
    if override:
        return override
    peak = chip_peak(jax.devices()[0].device_kind)
    return peak.flops if peak else None


@dataclasses.dataclass
class GradientNoiseScale:
    """The gradient-noise statistics of McCandlish et al., "An Empirical Model of Large-Batch
    Training" (appendix A.1), as ``device_train.py`` logged them, with B_big = ``accum_steps``
    micro-batches and B_small = one (docs/train.md says what each estimates).

    :meth:`update` takes one step's ``norm_big``, the norm of a replica's gradient averaged over its
    micro-batches, and ``norm_micro``, the mean norm of one micro-batch's gradient (both averaged
    over the replicas), and returns the step's ``noise/*`` values. The averages are kept in
    checkpoints (:meth:`state`), so a resumed run continues them.
    """

    accum_steps: int
    alpha: float  # train.noise_scale_alpha: the weight of each new step in the moving averages
    g_avg: float | None = None
    s_avg: float | None = None

    def update(self, norm_big: float, norm_micro: float) -> dict[str, float]:
        ga = self.accum_steps
        small, big = norm_micro**2, norm_big**2
        g_noise = (ga * big - small) / (ga - 1)  # the true gradient's squared norm, |G|^2
        s_noise = (small - big) / (1 - 1 / ga)  # the trace of a micro-batch gradient's covariance
        stats = {"noise/G_noise": g_noise, "noise/S_noise": s_noise}
        # device_train.py's guard: the large gradients of early training would take long to wash
        # out of the averages.
        if big < 2:
            a = self.alpha
            self.g_avg = g_noise if self.g_avg is None else (1 - a) * self.g_avg + a * g_noise
            self.s_avg = s_noise if self.s_avg is None else (1 - a) * self.s_avg + a * s_noise
            stats["noise/G_noise_avg"] = self.g_avg
            stats["noise/S_noise_avg"] = self.s_avg
            stats["noise/B_simple"] = self.s_avg / self.g_avg if self.g_avg else math.nan
        return stats

    def state(self) -> dict[str, float | None]:
        return {"G_noise_avg": self.g_avg, "S_noise_avg": self.s_avg}

    def restore(self, state: Mapping[str, Any] | None) -> None:
        """Continue the averages a checkpoint recorded (none recorded: they start afresh)."""
        if state:
            self.g_avg, self.s_avg = state.get("G_noise_avg"), state.get("S_noise_avg")


def drop_records_from(path: str, first_dropped: int) -> int:
    """Rewrite the JSONL file ``path`` without rows of step >= ``first_dropped``, nor a torn last line.

    Returns how many lines were dropped. The file is replaced atomically (a temporary file, renamed).
    """
    if not os.path.exists(path):
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
                step = int(row["step"])
            except (ValueError, KeyError, TypeError):  # a line cut short by a crash mid-write
                dropped += 1
                continue
            if step >= first_dropped:
                dropped += 1
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


class MetricsWriter:
    """``drop_from_step``: the first step this run records again; older runs' rows from there on are
    removed from ``metrics.jsonl`` and purged from TensorBoard's view."""

    def __init__(
        self,
        run_dir: str,
        *,
        wandb_project: str | None = None,
        run_name: str = "",
        config: dict | None = None,
        drop_from_step: int | None = None,
    ):
        self.enabled = jax.process_index() == 0
        self.run_dir = run_dir
        self.history: list[dict] = []
        self._jsonl: IO[str] | None = None
        self._tb: Any = None  # tensorboardX.SummaryWriter
        self._wandb: Any = None
        if not self.enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        jsonl = os.path.join(run_dir, "metrics.jsonl")
        if drop_from_step is not None:
            dropped = drop_records_from(jsonl, drop_from_step)
            if dropped:
                log.info(
                    "dropped %d metrics rows of steps >= %d from %s: those steps run again",
                    dropped,
                    drop_from_step,
                    jsonl,
                )
        self._jsonl = open(jsonl, "a")
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=drop_from_step)
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise RuntimeError(
                    f"train.wandb_project={wandb_project!r} is set but wandb is not installed: "
                    "pip install wandb, or set train.wandb_project=null"
                ) from None
            self._wandb = wandb.init(project=wandb_project, name=run_name or None, config=config, resume="allow")

    def write(self, step: int, values: Mapping[str, float]) -> None:
        if self._jsonl is None:  # not process 0
            return
        row = {"step": int(step), "time": time.time(), **{k: float(v) for k, v in values.items()}}
        self.history.append(row)
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        for key, value in values.items():
            if value is not None and math.isfinite(float(value)):
                self._tb.add_scalar(key, float(value), int(step))
        if self._wandb is not None:
            self._wandb.log(dict(values), step=int(step))

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is None:
            return
        self._jsonl.close()
        self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def plot(self, path: str | None = None) -> str | None:
        """Training and validation loss curves of the whole run (read back from metrics.jsonl)."""
        if not self.enabled:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = [json.loads(line) for line in open(os.path.join(self.run_dir, "metrics.jsonl"))]
        path = path or os.path.join(self.run_dir, "loss.png")
        fig, ax = plt.subplots(figsize=(8, 4.5))
        train = [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]
        if train:
            ax.plot(*zip(*train), label="train", linewidth=1)
        for key in sorted({k for r in rows for k in r if k.startswith("val/loss_")}):
            points = [(r["step"], r[key]) for r in rows if key in r]
            ax.plot(*zip(*points), marker="o", label=key.removeprefix("val/loss_"))
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(os.path.basename(os.path.normpath(self.run_dir)))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # nothing recorded yet (e.g. --stop-after 0): no legend
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path
