"""Experiment tracking: swanlab on rank 0, or a stand-in that does nothing, so the loop has no `if use_swanlab`."""
from __future__ import annotations

import argparse
import os


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


def init_tracker(args: argparse.Namespace, state, is_main: bool):
    """swanlab on rank 0 with the run's flags as its config; a resumed run continues the same run id."""
    if not (args.use_swanlab and is_main) or args.swanlab_mode == "disabled":
        return NullTracker()
    import swanlab
    mode = {"cloud": "online"}.get(args.swanlab_mode, args.swanlab_mode)
    run = swanlab.init(project=args.swanlab_project, name=args.save_weight, mode=mode, config=vars(args),
                       log_dir=os.path.join(args.save_dir, "swanlog"), id=state.swanlab_run_id,
                       resume="allow" if state.swanlab_run_id else None)
    state.swanlab_run_id = run.id
    return SwanlabTracker()
