"""Continued pretraining on raw text: the next-token loss on every token of a corpus streamed from disk.

    python trainer/train_pretrain.py                              # CPU demo: tiny Qwen3 from scratch, demo corpus
    python trainer/train_pretrain.py --model_path Qwen3-0.6B-Base --data_path corpus/ --device cuda \
        --batch_size 8 --accumulation_steps 8 --max_length 4096 --max_steps 2000 --learning_rate 2e-5
    torchrun --nproc_per_node 4 trainer/train_pretrain.py --model_path Qwen3-0.6B-Base --data_path corpus/ ...
    ... --from_resume 1                                           # after a preemption: the next unseen token on

The corpus (a .parquet / .jsonl file with a `text` column, or a folder of them) is read a record batch at a time,
tokenised on the fly and packed (dataset/text_stream.py): documents end to end, each followed by `<|endoftext|>`,
cut into rows of --max_length, a document attending to itself only with its positions restarting at 0
(model/qwen3.py's `documents`). Per optimizer step: for each micro-batch of the window, run the model over its rows
to the final hidden states and sum the cross entropy of every next token of every document through the lm_head
chunk by chunk; the skeleton divides by the window's tokens on all ranks, clips and steps. Every checkpoint keeps the
corpus's position (trainer/skeleton/corpus_stream.py): a resume reads on from the first token not yet trained.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.errors import run_script
from dataset.make_demo_data import ensure_demo_corpus
from model.tokenizer import load_tokenizer
from trainer.config import pretrain as config
from trainer.evaluation.perplexity import PerplexityEvaluator
from trainer.losses.chunked import document_hidden
from trainer.losses.fused_linear import fused_cross_entropy
from trainer.skeleton import Run, build_student, init_distributed_mode, train_noting_stop_signals
from trainer.skeleton.corpus_stream import CorpusStream, document_separator


def main(argv: list[str] | None = None) -> None:
    train_noting_stop_signals(train, config.parse_args(argv))  # a stop signal from here on: the step ends, saved


def train(args: argparse.Namespace) -> None:
    info = init_distributed_mode(args.device, args.dist_timeout)  # first: each rank builds its model on its own device
    tokenizer_dir = args.tokenizer_path or args.model_path
    tokenizer = load_tokenizer(tokenizer_dir)
    separator = document_separator(tokenizer)
    corpus = CorpusStream(args.data_path or ensure_demo_corpus()["corpus_train"], tokenizer, separator, args, info)
    model = build_student(args, info.device, tokenizer)
    run = Run(args, info, model, corpus, None, tokenizer_dir, config.RESUMABLE)
    corpus.start_at(run.state.kept.get("corpus"))  # a resumed run: from the first token it has not trained on
    run.keep_state("corpus", corpus.position)       # every save keeps where the corpus stands
    evaluator = PerplexityEvaluator(args, tokenizer, separator, info, run.step)  # held-out text's loss

    run.evaluate_when_due(evaluator)  # step 0: the baseline later evaluations compare against
    for _, window in run.windows():  # the corpus's windows from its position on
        for i, batch in enumerate(window):
            batch = {k: v.to(run.device) for k, v in batch.items()}
            with run.micro_step(i, len(window)):  # DDP: gradients sync on the window's last micro-batch
                with run.autocast():
                    hidden, targets = document_hidden(run.model, batch["input_ids"], batch["documents"],
                                                      batch["labels"])  # every next token of every document
                    loss_sum, num_tokens = fused_cross_entropy(hidden, run.head, targets, args.loss_chunk_size,
                                                               len(tokenizer))
                run.backward(loss_sum, num_tokens)
        metrics = run.optimizer_step()  # exact normalisation over the window and all ranks, clip, AdamW
        metrics["perplexity"] = math.exp(metrics["loss"])  # the window's, per token: pretraining's usual number
        if run.end_step(metrics, show=("perplexity",), evaluator=evaluator):  # log; save, evaluate when due
            break  # --epochs / --max_steps reached, or SIGTERM / SIGUSR1 / Ctrl-C
    run.finish()


if __name__ == "__main__":
    run_script(main)
