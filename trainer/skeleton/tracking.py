"""Experiment tracking: swanlab on rank 0, or a stand-in that does nothing, so the loop has no `if use_swanlab`.

The logged config is what the run actually used: the flags, with `dtype` as trained (--dtype auto resolved:
bfloat16 on CUDA, float32 elsewhere), the device and the world size, and no None placeholders (swanlab shows None
as `{}`; here it is "none"). See docs/training.md, "swanlab", for the versions whose local dashboard shows every
series."""
from __future__ import annotations

import argparse
import os

from model.precision import resolve_precision


class NullTracker:
    """Stands in for swanlab when it is off, so the loop has no `if use_swanlab` clutter."""

    def log(self, metrics: dict, step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class SwanlabTracker:
    def __init__(self):
        import swanlab
        self.swanlab = swanlab

    def log(self, metrics: dict, step: int) -> None:
        self.swanlab.log(metrics, step=step)

    def finish(self) -> None:
        self.swanlab.finish()


def tracker_config(args: argparse.Namespace, effective: dict | None = None) -> dict:
    """The config swanlab records: every flag, overridden by the effective settings (device, world_size, dtype),
    None written as "none". Without `effective` they are derived from the flags and the torchrun environment."""
    derived = {"device": args.device, "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    derived.update(effective or {})
    derived.setdefault("dtype", resolve_precision(derived["device"], args.dtype).name)
    config = {**vars(args), **derived}
    config["requested_dtype"] = args.dtype
    return {key: "none" if value is None else value for key, value in config.items()}


def init_tracker(args: argparse.Namespace, state, is_main: bool, effective: dict | None = None):
    """swanlab on rank 0 with the run's effective settings as its config; a resumed run continues the same run id.
    `effective`: {"device": ..., "world_size": ..., "dtype": ...} as the run resolved them (see tracker_config)."""
    if not (args.use_swanlab and is_main) or args.swanlab_mode == "disabled":
        return NullTracker()
    import swanlab
    mode = {"cloud": "online"}.get(args.swanlab_mode, args.swanlab_mode)
    run = swanlab.init(project=args.swanlab_project, name=args.save_weight, mode=mode,
                       config=tracker_config(args, effective), log_dir=os.path.join(args.save_dir, "swanlog"),
                       id=state.swanlab_run_id, resume="allow" if state.swanlab_run_id else None)
    state.swanlab_run_id = run.id
    return SwanlabTracker()
