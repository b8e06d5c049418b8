"""Held-out evaluation of continued pretraining: the next-token loss over every token of a held-out corpus, packed
as the training's rows, and its perplexity exp(loss) -- the numbers of one process on every world size."""
from __future__ import annotations

import itertools
import math

import torch

from dataset.make_demo_data import ensure_demo_corpus
from dataset.packed_documents import PackedRows
from dataset.text_stream import TextStream
from model.tokenizer import QwenTokenizer
from trainer.evaluation.heldout import HeldoutEvaluator
from trainer.losses.chunked import document_hidden
from trainer.losses.fused_linear import fused_cross_entropy
from trainer.skeleton.distributed import DistInfo
from trainer.skeleton.window_metrics import all_reduce_sum


class PerplexityEvaluator(HeldoutEvaluator):
    """`--eval_interval` for train_pretrain.py: the first --eval_rows rows of the held-out corpus (--eval_data_path,
    default the demo's held-out text, dataset/make_demo_data.py), packed with the training's --max_length and
    separator, read once. Evaluated when HeldoutEvaluator's `due` says: before training, every --eval_interval
    steps, at the last. Rank r evaluates batches r, r + W, ... of the batches one process would use and the sums
    are all-reduced; with --fsdp 1 (every rank in each forward) every rank evaluates them all, nothing reduced."""

    def __init__(self, args, tokenizer: QwenTokenizer, separator: int, info: DistInfo, start_step: int):
        self.args, self.info, self.vocab_size = args, info, len(tokenizer)
        self.lockstep = bool(args.fsdp) and info.enabled
        self.batches = self.load_batches(tokenizer, separator) if args.eval_interval else []
        # a resumed run's checkpoint step was already evaluated (if due) by the run that wrote it
        self.evaluated_step = start_step if start_step > 0 else -1

    def load_batches(self, tokenizer: QwenTokenizer, separator: int) -> list[PackedRows]:
        """This rank's share of the held-out rows, in batches of --batch_size (all of them in lockstep or alone)."""
        args = self.args
        path = args.eval_data_path or ensure_demo_corpus()["corpus_val"]
        text = TextStream(path, tokenizer, args.max_length, epochs=1, separator=separator)
        rows = list(itertools.islice(text, args.eval_rows))
        batches = [PackedRows.cat(rows[start:start + args.batch_size]) for start in range(0, len(rows), args.batch_size)]
        return batches if self.lockstep else batches[self.info.rank::self.info.world_size]

    @torch.no_grad()
    def evaluate(self, step: int, student, autocast, teacher_autocast=None) -> dict[str, float]:
        """eval/loss (nats per held-out token), eval/perplexity, eval/tokens; the same on every rank."""
        self.evaluated_step = step
        was_training = student.training
        student.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.info.device)
        for batch in self.batches:
            with autocast():
                hidden, targets = document_hidden(student, batch.input_ids.to(self.info.device),
                                                  batch.documents.to(self.info.device),
                                                  batch.labels.to(self.info.device))
                loss_sum, tokens = fused_cross_entropy(hidden, student.lm_head.weight, targets,
                                                       chunk_size=self.args.loss_chunk_size,
                                                       vocab_size=self.vocab_size)
            sums += torch.stack([loss_sum.double(), torch.as_tensor(tokens, dtype=torch.float64,
                                                                    device=self.info.device)])
        student.train(was_training)
        if not self.lockstep:
            sums = all_reduce_sum(sums, self.info)
        loss_sum, tokens = sums.tolist()
        loss = loss_sum / max(tokens, 1.0)
        return {"eval/loss": loss, "eval/perplexity": math.exp(loss), "eval/tokens": tokens}
