"""Logit-free on-policy distillation: chunk audits of the student's completions by a teacher that returns text only.

A third-party reimplementation of OmniOPD (arXiv 2606.01476). The paper's abstract gives the method's four parts:

* peak-entropy chunk audits: the student's completion is audited where the student was most uncertain;
* teacher Monte Carlo continuations: the teacher continues the completion from each audited chunk's start N times;
* a bounded weight estimated from those teacher samples replaces the log-ratio log p_S(y) - log p_T(y) of white-box
  reverse-KL OPD (`sampled_token_kl_loss` in trainer/losses/closed_forms.py), which a text-only teacher cannot give and
  which grows without bound as the teacher's probability of a sampled token falls;
* a KL anchor to the base model on the positions no chunk audits.

Everything else here is this reimplementation's reading, stated once:

* Scheduler (`choose_chunks`): the exact full-vocabulary entropy of softmax(logits / gen_temperature) -- the
  untruncated distribution the token was sampled from -- at every completion position; up to MAX_CHUNKS = 10
  non-overlapping chunks of CHUNK_LEN = 50 tokens, taken greedily from the highest entropy at a chunk's FIRST token
  down; a chunk that would run past the completion is skipped; equal entropies go to the later position; a
  completion shorter than CHUNK_LEN gets no audit.
* Agreement (trainer/logit_free/agreement.py's `similarity`, `agreement`): each continuation is cut to the student
  chunk's character length, then k = sum over the N continuations of phi(student chunk, continuation), phi in [0, 1]: by
  default 1 - Levenshtein(a, b) / max(len a, len b) on characters (rapidfuzz), each string capped at TEXT_CAP = 4,000
  characters, two empty strings 1.0; or ROUGE-1 F on whitespace tokens.
* Weight (`posterior_weight`): the Dirichlet-Multinomial (here Beta-Binomial) posterior mean
  pi_hat = (k + alpha * pi_bar) / (N + alpha), the prior mean pi_bar = exp(mean over the chunk of log p_S(y_t)) at
  temperature 1 (the student's geometric-mean token probability on the chunk), alpha = ALPHA = 1. pi_hat is in
  [0, 1] and a constant (no gradient flows through it).
* Loss, as a SUM over completion tokens (the skeleton divides by the window's completion tokens over all ranks):
      - sum_{audited chunks c} pi_hat_c * sum_{t in c} log p_S(y_t)            (`audit_loss_sum`, `chunked_audit_loss`)
      + beta * sum_{unaudited t} KL(p_ref || p_S)                              (the anchor, see below)
  at temperature 1. The anchor is trainer/losses/divergences.py's `Divergence("jsd", beta=0.0)` (forward KL with the
  frozen starting model as its "teacher") called on the labels `anchor_labels` returns: audited positions IGNORE_INDEX.
  Its token count is then the unaudited positions only; the loop's normaliser stays every completion token.

How a loop uses it, one micro-batch (flattened form throughout: `completion_hidden` gives (N, H) hidden states and
(N,) targets, row-major over rows, each row's completion positions in order; every (N,) tensor here is in that
order, and `completion_lengths` splits it into rows):

    targets, entropy, logprob = audit_stats(model, autocast, input_ids, attention_mask, labels, vocab_size,
                                            gen_temperature, chunk_size)       # no gradient, evaluation mode
    lengths = completion_lengths(labels)
    chunks = plan_audits(entropy, logprob, lengths, CHUNK_LEN, MAX_CHUNKS)
    ... per chunk: the student's text of its tokens, the teacher's N continuations of prompt + completion[:anchor]
    pi_hats = [posterior_weight(agreement(text, continuations), N, chunk.pi_bar) for ...]
    weights, audited = position_weights(lengths, chunks, pi_hats)
    hidden, targets = completion_hidden(model, input_ids, attention_mask, labels)   # the training forward
    loss = chunked_audit_loss(hidden, head, targets, weights, chunk_size, vocab_size)
    anchor = divergence_sums(Divergence("jsd", beta=0.0), hidden, head, anchor_labels(targets, audited),
                             ref_hidden, ref_head, chunk_size, vocab_size)
    loss = loss + beta * anchor.loss;  tokens = targets.numel()
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dataset.collators import IGNORE_INDEX
from trainer.losses.chunked import checked_vocab_size, completion_hidden
from trainer.losses.fused_linear import ChunkLoss, add_at_labels, fused_linear_loss

MAX_CHUNKS = 10     # M: audited chunks per completion, at most
CHUNK_LEN = 50      # C: tokens per chunk
ALPHA = 1.0         # the prior's weight, in pseudo-continuations


@dataclass(frozen=True)
class Chunk:
    """One audited chunk: completion tokens [anchor, anchor + length) of row `row` (offsets into that row's
    completion, not into input_ids), and the student's geometric-mean probability of them, pi_bar (the prior mean)."""
    row: int
    anchor: int
    length: int
    pi_bar: float


# ----------------------------------------------------------------------------- the student's numbers

def completion_lengths(labels: torch.Tensor) -> list[int]:
    """Each row's number of completion positions, as `completion_hidden` returns them: the labels in columns 1: that
    are not IGNORE_INDEX (position t predicts labels[t + 1], so column 0 is never a target). Their sum is N."""
    return (labels[:, 1:] != IGNORE_INDEX).sum(dim=1).tolist()


@torch.no_grad()
def position_stats(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   gen_temperature: float, chunk_size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """The scheduler's and the prior's numbers at the N completion positions, without gradients, in fp32.

    hidden (N, H) and labels (N,) as `completion_hidden` returns them; weight (V_pad, H) the lm_head, of which only
    rows [:vocab_size] count (the rest is padding). Returns (entropy (N,), logprob (N,)), fp32:
    entropy[t] = H(softmax(logits_t / gen_temperature)), the distribution y_t was sampled from (untruncated: top-k /
    top-p are not modelled), and logprob[t] = log softmax(logits_t)[labels[t]] at temperature 1.
    The logits are computed `chunk_size` positions at a time (never (N, V) at once), in fp32 with autocast off: the
    student's fp32 master head is used as is; a lower-precision head is upcast once.
    """
    if hidden.dim() != 2 or labels.dim() != 1 or hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"need hidden (N, H) and labels (N,), got {tuple(hidden.shape)} and {tuple(labels.shape)}")
    if weight.shape[0] < vocab_size:
        raise ValueError(f"vocab_size {vocab_size} exceeds the lm_head's {weight.shape[0]} rows")
    if not gen_temperature > 0:
        raise ValueError(f"gen_temperature must be > 0, got {gen_temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if labels.numel() and not bool(((labels >= 0) & (labels < vocab_size)).all()):
        raise ValueError(f"labels must be token ids in [0, {vocab_size}): pass completion_hidden's targets")
    n = hidden.shape[0]
    entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)
    logprob = torch.empty(n, dtype=torch.float32, device=hidden.device)
    head = weight.detach()[:vocab_size].float()
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            logits = hidden[start:end].detach().float() @ head.T
            log_p = F.log_softmax(logits, dim=-1)
            logprob[start:end] = log_p.gather(-1, labels[start:end, None]).squeeze(-1)
            log_q = log_p if gen_temperature == 1.0 else F.log_softmax(logits / gen_temperature, dim=-1)
            q = log_q.exp()
            # 0 * log 0 = 0: a probability that underflows to 0 adds nothing, not NaN
            entropy[start:end] = -torch.where(q > 0, q * log_q, torch.zeros_like(q)).sum(-1)
    return entropy, logprob


@torch.no_grad()
def audit_stats(model: torch.nn.Module, autocast: Callable[[], AbstractContextManager], input_ids: torch.Tensor,
                attention_mask: torch.Tensor, labels: torch.Tensor, vocab_size: int, gen_temperature: float,
                chunk_size: int = 512) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The audit's numbers for a micro-batch: the student's forward (`autocast`: its context) without gradients,
    then `position_stats` -> (targets (N,), entropy (N,), logprob (N,)). The forward runs in evaluation mode, as the
    completions were sampled -- LoRA's dropout would otherwise perturb the entropy and pi_bar of the policy that
    sampled them -- and leaves the model in the mode it found."""
    training = model.training
    model.eval()
    try:
        with autocast():
            hidden, targets = completion_hidden(model, input_ids, attention_mask, labels)
            entropy, logprob = position_stats(hidden, model.lm_head.weight, targets, vocab_size, gen_temperature,
                                              chunk_size)
    finally:
        model.train(training)
    return targets, entropy, logprob


# ----------------------------------------------------------------------------- the scheduler

def choose_chunks(entropy: Sequence[float] | torch.Tensor, chunk_len: int = CHUNK_LEN,
                  max_chunks: int = MAX_CHUNKS, allowed: Sequence[bool] | torch.Tensor | None = None) -> list[int]:
    """The peak-entropy scheduler on one completion: the anchors (0-based offsets into it), increasing.

    Candidates are the starts s with s + chunk_len <= len(entropy) (a chunk never runs past the completion, so a
    completion shorter than chunk_len gets none) and allowed[s] (default: all), ranked by entropy[s] (the chunk's
    first token), higher first, equal entropies the later s first. Going down that ranking, a start is taken when its
    chunk overlaps none taken so far (|s - s'| >= chunk_len), until max_chunks are taken or the candidates run out.
    """
    if chunk_len < 1:
        raise ValueError(f"chunk_len must be >= 1, got {chunk_len}")
    if max_chunks < 0:
        raise ValueError(f"max_chunks must be >= 0, got {max_chunks}")
    values = entropy.tolist() if isinstance(entropy, torch.Tensor) else [float(v) for v in entropy]
    if any(math.isnan(v) for v in values):
        raise ValueError("entropy has NaN: the scheduler cannot rank it")
    last = len(values) - chunk_len
    if last < 0 or max_chunks == 0:
        return []
    allowed = [True] * len(values) if allowed is None else [bool(a) for a in allowed]
    ranking = sorted((s for s in range(last + 1) if allowed[s]), key=lambda s: (values[s], s), reverse=True)
    taken: list[int] = []
    for s in ranking:
        if all(abs(s - t) >= chunk_len for t in taken):
            taken.append(s)
            if len(taken) == max_chunks:
                break
    return sorted(taken)


def plan_audits(entropy: torch.Tensor, logprob: torch.Tensor, lengths: Sequence[int], chunk_len: int = CHUNK_LEN,
                max_chunks: int = MAX_CHUNKS, allowed: torch.Tensor | None = None) -> list[Chunk]:
    """`choose_chunks` on every row of a micro-batch: entropy and logprob (N,) from `position_stats`, lengths from
    `completion_lengths`, `allowed` (N,) the positions that may be anchors (`anchors_outside_thinking`; default
    all). Returns the chunks row by row, anchors increasing within a row, each with its prior mean
    pi_bar = exp(mean of logprob over the chunk's tokens) (temperature 1, a constant)."""
    if sum(lengths) != entropy.numel() or entropy.shape != logprob.shape:
        raise ValueError(f"lengths sum to {sum(lengths)}, entropy has {entropy.numel()} positions and logprob "
                         f"{logprob.numel()}: pass completion_lengths(labels) of the same batch")
    entropy_rows = entropy.detach().float().cpu().split(list(lengths))
    logprob_rows = logprob.detach().double().cpu().split(list(lengths))
    allowed_rows = (None,) * len(lengths) if allowed is None else allowed.cpu().split(list(lengths))
    chunks = []
    for row, (row_entropy, row_logprob) in enumerate(zip(entropy_rows, logprob_rows)):
        for anchor in choose_chunks(row_entropy, chunk_len, max_chunks, allowed_rows[row]):
            pi_bar = math.exp(float(row_logprob[anchor:anchor + chunk_len].mean()))
            chunks.append(Chunk(row, anchor, chunk_len, pi_bar))
    return chunks


def anchors_outside_thinking(targets: torch.Tensor, lengths: Sequence[int], think_open: int | None,
                             think_close: int | None) -> torch.Tensor:
    """(N,) bool: whether a chunk may start at each completion position, i.e. whether the completion before it
    (what the teacher is asked to continue) does not end inside a thinking block -- a `<think>` token with no
    `</think>` after it. Such a partial cannot be handed to a teacher (dataset/continuations.py's
    ContinuationRequest: the template would put an empty thinking block in front of it); a student may also write a
    stray `<think>` mid-answer, after which every position is inside. `targets` (N,) row after row, as
    `completion_hidden` returns them; ids None (a tokenizer without thinking tokens): everything allowed."""
    allowed = torch.ones(targets.shape[0], dtype=torch.bool)
    if think_open is None or think_close is None:
        return allowed
    position = 0
    for length in lengths:
        inside = False
        for t, token in enumerate(targets[position:position + length].tolist()):
            allowed[position + t] = not inside  # the partial is the row's tokens before t
            inside = True if token == think_open else False if token == think_close else inside
        position += length
    return allowed


# ----------------------------------------------------------------------------- the weight

def posterior_weight(k: float, n: int, pi_bar: float, alpha: float = ALPHA) -> float:
    """pi_hat = (k + alpha * pi_bar) / (n + alpha): the posterior mean of the chance that the teacher agrees with the
    chunk after n continuations of total agreement k, under a Beta prior of mean pi_bar (the student's own
    geometric-mean token probability) and weight alpha. In [0, 1] for k in [0, n] and pi_bar in [0, 1]; increasing in
    k; pi_bar when n = 0; tends to k / n as n grows."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 0.0 <= k <= n:
        raise ValueError(f"k must be in [0, n={n}], got {k}")
    if not 0.0 <= pi_bar <= 1.0:
        raise ValueError(f"pi_bar must be in [0, 1], got {pi_bar}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    return min(1.0, (k + alpha * pi_bar) / (n + alpha))  # min: rounding only


CHUNK_WEIGHTS = ("posterior", "advantage", "centred")


def chunk_weights(pi_hats: Sequence[float], chunks: Sequence[Chunk], kind: str) -> list[float]:
    """The weight of each audited chunk's log-probability in the loss, from its pi_hat:
    posterior  pi_hat itself, in [0, 1] (the reading of the paper's abstract): every audited chunk is pushed up, the
               ones the teacher agrees with most the hardest;
    advantage  pi_hat - pi_bar, in [-1, 1]: the chunk's own prior mean (the student's geometric-mean token probability
               on it) as the baseline, so a chunk is pushed up where the teacher agrees with it more than the student
               expected and down where less; per chunk, so accumulation and world size leave it unchanged;
    centred    pi_hat - the mean pi_hat of the micro-batch's audited chunks on this rank, in [-1, 1] (a baseline over
               the audited chunks of one micro-batch: with accumulation or several ranks not the unaccumulated
               batch's baseline, as a group's in GRPO never spans micro-batches)."""
    if kind == "posterior":
        return list(pi_hats)
    if kind == "advantage":
        return [pi_hat - chunk.pi_bar for pi_hat, chunk in zip(pi_hats, chunks, strict=True)]
    if kind == "centred":
        mean = sum(pi_hats) / len(pi_hats) if pi_hats else 0.0
        return [pi_hat - mean for pi_hat in pi_hats]
    raise ValueError(f"chunk weight {kind!r} is not one of {CHUNK_WEIGHTS}")


def position_weights(lengths: Sequence[int], chunks: Sequence[Chunk], pi_hats: Sequence[float],
                     device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weights (N,) float32, audited (N,) bool) in `completion_hidden`'s flattened order (row-major over rows,
    each row's completion positions in order; lengths from `completion_lengths`): the chunk's weight (`chunk_weights`,
    in [-1, 1]) at every position of its chunk, 0 elsewhere; audited True exactly on the chunks' positions. Chunks of a
    row must lie within it and not overlap."""
    if len(chunks) != len(pi_hats):
        raise ValueError(f"{len(chunks)} chunks but {len(pi_hats)} weights")
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + int(length))
    weights = torch.zeros(offsets[-1], dtype=torch.float32)
    audited = torch.zeros(offsets[-1], dtype=torch.bool)
    for chunk, pi_hat in zip(chunks, pi_hats):
        if not 0 <= chunk.row < len(lengths):
            raise ValueError(f"chunk row {chunk.row} is not one of the {len(lengths)} rows")
        if chunk.anchor < 0 or chunk.length < 1 or chunk.anchor + chunk.length > lengths[chunk.row]:
            raise ValueError(f"chunk {chunk} runs outside its row's {lengths[chunk.row]} completion positions")
        if not -1.0 <= pi_hat <= 1.0:
            raise ValueError(f"a chunk's weight must be in [-1, 1], got {pi_hat}")
        start = offsets[chunk.row] + chunk.anchor
        end = start + chunk.length
        if bool(audited[start:end].any()):
            raise ValueError(f"chunk {chunk} overlaps another chunk of its row")
        audited[start:end] = True
        weights[start:end] = pi_hat
    return weights.to(device), audited.to(device)


# ----------------------------------------------------------------------------- the loss

def audit_loss_sum(logprob: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """-sum_t weights[t] * logprob[t]: the audited chunks' term of the loss, from the student's log-probabilities of
    its sampled tokens (with gradient) and the weights of `position_weights` (constants: detached here). Positions of
    weight 0 contribute exactly 0, whatever their logprob (even -inf)."""
    if logprob.shape != weights.shape:
        raise ValueError(f"logprob {tuple(logprob.shape)} and weights {tuple(weights.shape)} differ")
    w = weights.detach().to(device=logprob.device, dtype=logprob.dtype)
    counted = w != 0
    return -torch.where(counted, w * logprob, torch.zeros((), dtype=logprob.dtype, device=logprob.device)).sum()


def chunked_audit_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                       chunk_size: int = 512, vocab_size: int | None = None) -> torch.Tensor:
    """`audit_loss_sum` from the completion hidden states (N, H), the lm_head (V_pad, H), the targets (N,) and the
    weights (N,), at temperature 1, through the fused linear-loss driver (trainer/losses/fused_linear.py: no (N, V)
    logits, the gradient w (p - onehot(y)) computed with the loss). Only the positions of non-zero weight are
    projected (the others contribute exactly 0 to the loss and its gradient), so the head's cost is that of the
    audited tokens. Returns the loss sum (fp32 scalar); the normaliser is every completion token, not this term's."""
    if not (hidden.shape[0] == labels.shape[0] == weights.shape[0]):
        raise ValueError(f"hidden {tuple(hidden.shape)}, labels {tuple(labels.shape)} and weights "
                         f"{tuple(weights.shape)} must have the same N")
    keep = weights.detach().to(hidden.device) != 0
    weights = weights.detach().to(device=hidden.device, dtype=torch.float32)
    vocab_size = checked_vocab_size(weight, None, chunk_size, vocab_size)
    loss_sum, _, _ = fused_linear_loss(AUDIT, hidden[keep], weight, labels[keep], vocab_size, chunk_size,
                                       values=weights[keep])
    return loss_sum


def _audit_chunk(logits: torch.Tensor, _teacher, _spares, labels: torch.Tensor, weights: torch.Tensor):
    """-w log p(y) per position and its gradient w (p - onehot(y)), in the logits' buffer."""
    log_p = torch.log_softmax(logits, dim=-1, out=logits)
    w = weights.to(log_p.dtype)
    per_row = -w * log_p.gather(1, labels.clamp_min(0)[:, None]).squeeze(1)
    return per_row, add_at_labels(log_p.exp_().mul_(w[:, None]), labels, -w), ()


AUDIT = ChunkLoss(_audit_chunk)


def anchor_labels(labels: torch.Tensor, audited: torch.Tensor) -> torch.Tensor:
    """The KL anchor's labels: `labels` with the audited positions set to IGNORE_INDEX (any shape; in the flattened
    form, the (N,) targets of `completion_hidden` and `position_weights`' audited mask). Passed to
    `divergence_sums(Divergence("jsd", beta=0.0), ...)` with the reference model as the teacher, they give
    sum over the unaudited positions of KL(p_ref || p_S)."""
    if labels.shape != audited.shape:
        raise ValueError(f"labels {tuple(labels.shape)} and audited {tuple(audited.shape)} differ")
    return labels.masked_fill(audited.to(device=labels.device, dtype=torch.bool), IGNORE_INDEX)
