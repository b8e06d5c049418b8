"""Where an on-policy loop's samples come from, behind one object with a visible lifecycle: the student itself
(the built-in engine: KV cache, eval mode, no grad) or a rollout server (vLLM) holding the student's weights --
pushed and verified before the rollouts they sample, and with --max_staleness S sampled S steps ahead in the
background (trainer/rollouts/queue.py) -- and, for micro-batches that are not on-policy, the rows' own completions.

    rollouts = Rollouts(run, tokenizer, server, on_policy)    # every save keeps the rollouts sampled ahead
    evaluator = HeldoutEvaluator(args, tokenizer, info, run.step, rollouts.decoder, ...)  # one decode step for both
    for epoch, window, coming in run.windows_ahead(args.max_staleness):
        rollouts.before_step(run.step, epoch, window, coming, clock)  # served: drain, push + verify, sample ahead
        for batch in window:
            input_ids, attention_mask, labels = rollouts.sequences(batch, run.step, epoch, on_policy, clock)
        rollouts.add_to(run.metrics)                          # sync agreement, staleness, wait_s, server_idle_s
        if run.end_step(metrics, shown, evaluator, rollouts.before_save): break  # saved: the rollouts sampled ahead too
    run.finish(rollouts.close)                                # the weights written for the server are removed

Each row samples with its own seed (seed, epoch, row): a row's sample depends neither on its batch-mates nor on the
world size or accumulation, and a resumed run draws exactly what the killed one would have.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch

from common.errors import refuse_first
from common.seeds import derived_seed
from dataset.collators import IGNORE_INDEX, build_sequences
from model import Decoder, generate
from model.generate import Speculative
from serving.engine import CompletionServer, completions_output, probe_token_ids
from serving.weight_sync import WeightSync
from trainer.rollouts.queue import RolloutQueue
from dataset.tool_conversation import ToolResponder, roll_out, served_turns
from trainer.rollouts.tool_turns import (add_turn_stats, conversation_sequences, kept_conversation, kept_sample,
                                        prompt_rows, sample_conversations)
from trainer.skeleton.distributed import is_main_process, print0
from trainer.skeleton.loading import sft_collator
from trainer.skeleton.run import Run
from trainer.skeleton.window_metrics import WindowMetrics

Sequences = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # input_ids, attention_mask, labels (completion only)
Sample = tuple[list[int], list[float]]  # a served row's token ids and log-probabilities (with tools: kept_sample's)


class Rollouts:
    def __init__(self, run: Run, tokenizer, server: CompletionServer | None, on_policy: Callable[[int, int], bool],
                 speculative: Speculative | None = None, responder: ToolResponder | None = None):
        """The rollouts of `run`'s student (`run.raw_model`, unwrapped: it samples, or the server gets its weights,
        under the run's autocast and compute dtype; every request to the server inside the run's failure protocol,
        Run.fail_together), which every save of the run keeps (the ones sampled ahead, resumed from its checkpoint).
        `on_policy(epoch, step)`: whether optimizer step `step` samples (the loop's coin, the same on every rank).
        `decoder`: the built-in engine's decode step (--decode: compiled by default on CUDA), which the loop's
        held-out evaluation shares (one compiled step, one held cache). `speculative`: speculative KD's teacher in
        the built-in engine (OPD's --skd_topk), the share of tokens it replaced logged (`skd_replaced_share`).
        `responder`: the answers to the student's tool calls (--tools): multi-turn rollouts, in the built-in engine
        or on the server (trainer/rollouts/tool_turns.py), labels on the student's own tokens only."""
        args = run.args
        self.args, self.tokenizer, self.server, self.speculative = args, tokenizer, server, speculative
        self.responder = responder
        self.decoder = Decoder(compiled=args.decode == "compiled")
        self.on_policy, self.student, self.autocast = on_policy, run.raw_model, run.autocast
        self.fail_together = run.fail_together
        self.device = str(next(self.student.parameters()).device)
        self.data_collator = sft_collator(args, tokenizer)  # steps that are not on-policy: the rows' completions
        self.stats = WindowMetrics(self.device)  # this step's numbers, until the loop takes them (`add_to`)
        self.weight_sync = self.queue = None
        if server is not None:
            self.weight_sync = WeightSync(server, rollout_weights_path(args), probe_token_ids(tokenizer),
                                          run.precision.compute, active=is_main_process(), say=print0)
            sample = served_sampler(server, args, tokenizer, self.student.config.vocab_size, responder)
            self.queue = RolloutQueue(sample, run.state.rollouts, args.max_staleness, overlap=bool(args.overlap))
        run.keep_rollouts(self.kept)  # every save keeps the rollouts sampled ahead for coming steps

    def before_step(self, step: int, epoch: int, window: list[dict], coming: list, clock) -> None:
        """Served rollouts, before optimizer step `step` (the count done): the steps whose rollouts come from the
        current weights (this one with --max_staleness 0, the one S ahead otherwise); once the server is done with
        older weights, it gets these, verified, and starts sampling. Every --sync_interval steps a push. Nothing to
        do for the built-in engine."""
        jobs = [] if self.queue is None else self.queue.due(step, [(step, epoch, window), *coming], self.on_policy)
        if not jobs:
            return
        with clock("drain"), self.fail_together():  # the rollouts in flight, sampled from older weights, finish
            self.queue.wait()
        if self.weight_sync.due(step, self.args.sync_interval):
            with clock("sync"), self.fail_together():    # rank 0 writes them, the server loads them
                self.weight_sync.push(self.student, step)  # --fsdp 1: gathered tensor by tensor
            with clock("verify"), self.fail_together():  # its log-probs of a probe == ours, or the run stops
                agreement = self.weight_sync.verify(self.student, self.autocast)
                self.stats.total("sync_logprob_diff", agreement["max"])  # bf16: the mean decides (docs/serving.md)
                self.stats.total("sync_logprob_mean", agreement["mean"])
                self.stats.rank_mean("weight_pushes", 1)  # per window: the console line shows the pushes
        self.queue.start(jobs, self.weight_sync.synced_step)  # the weights it holds; failures: where waited for

    def sequences(self, batch: dict, step: int, epoch: int, on_policy: bool, clock) -> Sequences:
        """Steps 1-2 of a micro-batch of optimizer step `step`: its rows' samples (the queue's, waited for when they
        are not there yet, or the built-in engine's), or off-policy the rows' own completions -> input_ids,
        attention_mask and labels on the completion through its first EOS (with tools: on every token the student
        sampled)."""
        with clock("gen"), self.fail_together(self.server is not None):
            if on_policy and self.queue is not None:
                samples, version = self.queue.take(step, batch)
                # steps the rollouts lag, per optimizer step: averaged over the window's micro-batches and ranks
                self.stats.ratio("staleness", step - version, 1)
                sequences = served_sequences(batch, samples, self.tokenizer, self.device, self.responder is not None)
            elif on_policy and self.responder is not None:
                sequences = sample_conversations(self.student, batch, row_seeds(self.args.seed, batch, epoch),
                                                 self.responder, self.args.max_new_tokens, self.args.max_turns,
                                                 self.device, self.autocast, self.decoder,
                                                 self.tokenizer.pad_token_id, sampling_settings(self.args,
                                                                                                self.tokenizer))
            elif on_policy:
                return sample_completions(self.student, self.args, self.tokenizer, batch, epoch, self.device,
                                          self.autocast, self.decoder, self.speculative, self.stats)
            else:
                data = {k: v.to(self.device) for k, v in self.data_collator(batch["rows"]).items()}
                return data["input_ids"], data["attention_mask"], data["labels"]
        if self.responder is not None:
            add_turn_stats(self.stats, sequences[2])
        return sequences

    def sampler(self, batch: dict, step: int, labels: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """Served rollouts of `batch` at optimizer step `step` (after `sequences`): the log-probability the server
        drew each labelled token with, in completion_hidden's order (row by row: through each row's first EOS, with
        tools each conversation's sampled tokens, `labels`' positions), and the step whose weights the server held.
        None for the built-in engine, whose sampler is the trained student itself."""
        if self.queue is None:
            return None
        samples, version = self.queue.take(step, batch)
        if self.responder is not None:
            logprobs = [x for sample in samples for x in kept_conversation(sample).logprobs]
        else:
            counts = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1).tolist()
            logprobs = [x for (_, row), n in zip(samples, counts) for x in row[:n]]
        return torch.tensor(logprobs, dtype=torch.float32, device=labels.device), version

    def add_to(self, metrics: WindowMetrics) -> None:
        """This step's numbers into the loop's window `metrics`: the weight sync's agreement and pushes, the
        rollouts' staleness, the seconds the trainer waited for rollouts and the server sat idle between its jobs
        (served only)."""
        metrics.merge(self.stats)
        if self.queue is not None:
            self.queue.add_to(metrics)

    def kept(self) -> dict[int, dict]:
        """The rollouts sampled ahead for coming steps, which a checkpoint keeps (Run.keep_rollouts)."""
        return {} if self.queue is None else self.queue.kept_now()

    def before_save(self) -> None:
        """The checkpoint keeps the rollouts sampled ahead (token ids and log-probs; a resume needs them): the job
        in flight finishes first."""
        if self.queue is not None:
            with self.fail_together():
                self.queue.wait()

    def close(self) -> None:
        """The weights written for the server are removed (a resumed run pushes its own before it samples)."""
        if self.weight_sync is not None and is_main_process():
            self.weight_sync.remove_file()


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """How the student samples its completions (the built-in engine and a rollout server alike)."""
    g = parser.add_argument_group("the student's sampling")
    g.add_argument("--max_new_tokens", type=int, default=64, help="sampled completion length budget")
    g.add_argument("--gen_temperature", type=float, default=1.0, help="sampling temperature of the student")
    g.add_argument("--top_k", type=int, default=0, help="sampling top-k (0 = off)")
    g.add_argument("--top_p", type=float, default=1.0, help="sampling nucleus mass (1 = off)")


def validate_sampling_args(args: argparse.Namespace) -> None:
    a = args
    refuse_first([
        (a.max_new_tokens < 1, f"--max_new_tokens must be >= 1, got {a.max_new_tokens}"),
        (a.max_prompt_length + a.max_new_tokens > a.max_length,
         f"--max_prompt_length ({a.max_prompt_length}) + --max_new_tokens ({a.max_new_tokens}) must be <= "
         f"--max_length ({a.max_length}): raise --max_length or lower one of the budgets"),
        (a.gen_temperature <= 0, f"--gen_temperature must be > 0, got {a.gen_temperature}"),
        (not 0.0 < a.top_p <= 1.0, f"--top_p must be in (0, 1], got {a.top_p}"),
        (a.top_k < 0, f"--top_k must be >= 0, got {a.top_k}"),
    ])


def rollout_weights_path(args: argparse.Namespace) -> str:
    """Where rank 0 writes the weights for the rollout server."""
    folder = args.sync_dir or os.path.join(args.save_dir, f"{args.save_weight}_rollout_weights")
    return os.path.join(folder, "model.safetensors")


def row_seeds(seed: int, batch: dict, epoch: int) -> list[int]:
    """One seed per row, (seed, epoch, row): a row's sample depends neither on its batch-mates nor on the world size
    or accumulation, and a resumed run draws exactly what the killed one would have. A group's rows (the RL loop's
    GroupCollator: `generation` g) draw with (seed, epoch, row, g), the first of them as a lone row does."""
    return [derived_seed(seed, epoch, row["row_index"], *((row["generation"],) if row.get("generation") else ()))
            for row in batch["rows"]]


def sampling_settings(args: argparse.Namespace, tokenizer) -> dict:
    return dict(do_sample=True, temperature=args.gen_temperature, top_k=args.top_k, top_p=args.top_p,
                eos_token_id=tokenizer.eos_token_id, vocab_size=len(tokenizer))


def sample_completions(student, args: argparse.Namespace, tokenizer, batch: dict, epoch: int, device: str,
                       autocast, decoder: Decoder | None = None, speculative: Speculative | None = None,
                       stats: WindowMetrics | None = None) -> Sequences:
    """Steps 1-2 on-policy with the built-in engine (KV cache, eval mode, no grad; `decoder`'s decode step, eager by
    default; a `speculative` teacher replacing the student's proposals outside its top-K, their share of the
    completion tokens into `stats`) -> input_ids, attention_mask and labels on the completion through its first
    EOS."""
    prompt_ids = batch["prompt_ids"].to(device)
    prompt_mask = batch["prompt_attention_mask"].to(device)
    was_training = student.training
    student.eval()
    generators = [torch.Generator(device).manual_seed(seed) for seed in row_seeds(args.seed, batch, epoch)]
    with autocast():
        out = generate(student, prompt_ids, prompt_mask, args.max_new_tokens, generator=generators,
                       pad_token_id=tokenizer.pad_token_id, decoder=decoder, speculative=speculative,
                       **sampling_settings(args, tokenizer))
    student.train(was_training)
    if speculative is not None:
        stats.ratio("skd_replaced_share", out.replaced.sum(), out.completion_mask.sum())
    return build_sequences(prompt_ids, prompt_mask, out.completion_ids, out.completion_mask)


def served_sampler(server: CompletionServer, args: argparse.Namespace, tokenizer, model_vocab_size: int,
                   responder: ToolResponder | None = None) -> Callable[[dict, int], list[Sample]]:
    """Step 1 on the rollout server, for the rollout queue: (batch, epoch) -> each row's completion token ids and
    their sampled log-probabilities, from the weights the server holds (requests and the tools' answers only: it
    runs in the queue's background thread). With a `responder` (--tools) each row's conversation, turn by turn on
    the server, as `kept_sample` keeps it."""
    settings = dict(model_vocab_size=model_vocab_size, **sampling_settings(args, tokenizer))

    def sample(batch: dict, epoch: int) -> list[Sample]:
        seeds = row_seeds(args.seed, batch, epoch)
        if responder is None:
            return server.sample_tokens(batch["prompt_ids"], batch["prompt_attention_mask"], args.max_new_tokens,
                                        seeds=seeds, **settings)
        sample_turn = served_turns(server, prompt_rows(batch), seeds, args.max_new_tokens, **settings)
        conversations = roll_out(len(seeds), sample_turn, responder, args.max_new_tokens, args.max_turns,
                                 tokenizer.eos_token_id)
        return [kept_sample(conversation) for conversation in conversations]
    return sample


def served_sequences(batch: dict, samples: list[Sample], tokenizer, device: str, tools: bool = False) -> Sequences:
    """Step 2 for served rollouts: the rows' samples (`served_sampler`'s) -> input_ids, attention_mask and labels:
    on each completion through its first EOS, or with `tools` on each conversation's sampled tokens (all its turns:
    a conversation is not cut at an EOS)."""
    if tools:
        conversations = [kept_conversation(sample) for sample in samples]
        return conversation_sequences(prompt_rows(batch), conversations, tokenizer.pad_token_id, device)
    prompt_ids = batch["prompt_ids"].to(device)
    prompt_mask = batch["prompt_attention_mask"].to(device)
    out = completions_output(prompt_ids, [ids for ids, _ in samples], tokenizer.eos_token_id, tokenizer.pad_token_id)
    return build_sequences(prompt_ids, prompt_mask, out.completion_ids, out.completion_mask)
