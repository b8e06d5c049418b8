"""DPO's frozen reference (trainer/train_dpo.py): its summed log-probabilities of each pair's chosen and rejected
answers, from a forward per micro-batch or, with --precompute_ref 1, from a table computed once before training.

The reference is `load_reference`'s (trainer/teachers/frozen.py): --reference_path, else the student's starting
point -- a LoRA student's own base with its adapters switched off, no second copy of the weights.

--precompute_ref 1: one pass over the training pairs and the held-out ones, in fixed batches of --batch_size pairs
in file order (pairs 0..b-1, b..2b-1, ...), so that a pair's numbers depend on its batch of the file only, never on
the ranks, the data order or an interruption: batch k is computed by rank k mod W and the table is summed over the
ranks (every entry comes from one rank, the others add exact zeros); with --fsdp 1 every rank computes every batch,
since a sharded model's forward needs them all. A table row: the chosen answer's summed log-probability, the
rejected one's, and their token counts (float64). The tables live in memory and go into every resume file
(Run.keep_state): a resumed run reads them back and loads no reference at all; a run killed before its first save
left no resume file, so nothing half-computed is ever trusted, and it computes them again. A reference model that
is not the student's own base is then freed.
"""
from __future__ import annotations

import argparse
import gc

import torch

from common.errors import RuntimeFailure
from dataset.collators import IGNORE_INDEX, PairCollator
from trainer.losses.chunked import completion_rows
from trainer.losses.preference import answer_logps, as_pairs
from trainer.skeleton.distributed import print0
from trainer.skeleton.run import Run
from trainer.skeleton.sharding import reshard_root
from trainer.skeleton.window_metrics import all_reduce_sum
from trainer.teachers.frozen import frozen_hidden, load_reference

KEPT = "reference_logps"  # the tables' name in the resume file


@torch.no_grad()
def batch_logps(model, autocast, batch: dict, chunk_size: int, vocab_size: int) -> torch.Tensor:
    """A frozen model's numbers for a PairCollator batch of P pairs: (P, 4), per pair its chosen and rejected
    answers' summed log-probabilities and token counts (float64). `autocast`: its forward context
    (Run.teacher_autocast)."""
    hidden = frozen_hidden(model, autocast, batch["input_ids"], batch["attention_mask"], batch["labels"])
    targets = batch["labels"][:, 1:]  # completion_hidden's labels, in its order: row by row
    with autocast():
        sums, counts = answer_logps(hidden, model.lm_head.weight, targets[targets != IGNORE_INDEX],
                                    completion_rows(batch["labels"]), len(batch["labels"]), chunk_size, vocab_size)
    reshard_root(model)  # no backward follows: a sharded model's gathered head is freed here
    return torch.cat([as_pairs(sums), as_pairs(counts)], dim=1)


def precompute(model, autocast, rows: list[dict], collator: PairCollator, run: Run, chunk_size: int,
               vocab_size: int) -> torch.Tensor:
    """The table (len(rows), 4) of `batch_logps` over `rows` in fixed batches of --batch_size (module docstring),
    on the CPU (where a resume file holds it)."""
    args, info = run.args, run.dist
    table = torch.zeros(len(rows), 4, dtype=torch.float64, device=run.device)
    starts = range(0, len(rows), args.batch_size)
    lockstep = bool(args.fsdp) and info.enabled
    for start in starts if lockstep else starts[info.rank::info.world_size]:
        batch = {k: v.to(run.device) for k, v in collator(rows[start:start + args.batch_size]).items()}
        table[start:start + len(batch["row_index"])] = batch_logps(model, autocast, batch, chunk_size, vocab_size)
    return (table if lockstep else all_reduce_sum(table, info)).cpu()


class PairReference:
    """The reference's numbers for a micro-batch (`logps`), live or from the precomputed tables, one per named set
    of rows ("train": the training pairs by row_index, "eval": the held-out ones)."""

    def __init__(self, args: argparse.Namespace, tokenizer, run: Run, student: torch.nn.Module,
                 sets: dict[str, list[dict]], collator: PairCollator):
        self.chunk_size, self.vocab_size, self.autocast = args.loss_chunk_size, len(tokenizer), run.teacher_autocast
        self.tables = run.state.kept.get(KEPT) if args.precompute_ref else None
        self.model = None if self.tables is not None else load_reference(args, tokenizer, run.device, student)
        if args.precompute_ref:
            if self.tables is None:
                print0(f"precomputing the reference's log-probabilities of {sum(map(len, sets.values())):,} pairs "
                       f"(--precompute_ref 1)")
                self.tables = {name: precompute(self.model, self.autocast, rows, collator, run, self.chunk_size,
                                                self.vocab_size) for name, rows in sets.items()}
            else:
                print0("the reference's log-probabilities: the resume file's (--precompute_ref 1)")
            self.model = None  # freed (a LoRA student's base stays: it is the student's)
            gc.collect()
            run.keep_state(KEPT, lambda: self.tables)

    def logps(self, batch: dict, name: str) -> torch.Tensor:
        """(P, 2): each pair's chosen and rejected answers' summed log-probabilities under the reference."""
        if self.tables is None:
            return batch_logps(self.model, self.autocast, batch, self.chunk_size, self.vocab_size)[:, :2]
        found = self.tables[name][batch["row_index"].cpu()].to(batch["labels"].device)
        counts = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1).to(found)
        if not torch.equal(as_pairs(counts), found[:, 2:]):  # a table of other pairs (or rendered otherwise)
            raise RuntimeFailure(f"the precomputed reference's token counts differ from this batch's (rows "
                                 f"{batch['row_index'].tolist()}): the pairs were rendered differently")
        return found[:, :2]
