"""What a run has done and keeps across a resume, besides the weights and the optimizer: where it stands in the data
(epoch, step, samples), its tracker id, fp16's skipped steps, the rollouts sampled ahead for coming steps, and what a
loop keeps of its own (a self-teacher's EMA).
Checkpoints save it (trainer/skeleton/checkpoint.py); the run alone updates it (the data position as its stream
yields windows; the rollouts sampled ahead, a copy of the rollout queue's, at every save)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunState:
    epoch: int = 0
    step: int = 0                    # optimizer steps done
    samples_in_epoch: int = 0        # global samples consumed in the current epoch (a multiple of the global batch)
    swanlab_run_id: str | None = None
    skipped_steps: int = 0           # --dtype float16: steps the GradScaler skipped (their gradients overflowed)
    elapsed_s: float = 0.0           # wall seconds of the run up to its last save, over all its processes
    # served rollouts sampled for coming steps from weights older than these (--max_staleness; this rank's, and
    # after a resume every rank's): step -> {"version", "rows": {sample key: (token ids, their log-probabilities)}}
    # (trainer/rollouts/queue.py's sample_key; with --tools a conversation's, trainer/rollouts/tool_turns.py)
    rollouts: dict[int, dict] = field(default_factory=dict)
    # a loop's own state, by name, taken from rank 0 at every save (Run.keep_state: the same on every rank)
    kept: dict[str, object] = field(default_factory=dict)


def merge_rollouts(per_rank: list[dict[int, dict]], from_step: int) -> dict[int, dict]:
    """Every rank's kept rollouts -> one record for the checkpoint: the steps from `from_step` on that every rank
    has (a step one rank lost with a failed server is dropped whole, and sampled again on resume)."""
    steps = set.intersection(*(set(kept) for kept in per_rank)) if per_rank else set()
    merged = {}
    for s in sorted(x for x in steps if x >= from_step):
        rows = {}
        for kept in per_rank:
            rows.update(kept[s]["rows"])
        merged[s] = {"version": per_rank[0][s]["version"], "rows": rows}
    return merged
