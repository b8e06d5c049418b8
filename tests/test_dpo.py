# python -m pytest tests/test_dpo.py
"""trainer/losses/preference.py and trainer/train_dpo.py's reference against TRL 1.16.0's DPO
(trl/trainer/dpo_trainer.py, class DPOTrainer, _compute_loss at lines 1285-1612).

Pinned: TRL's formulas, written out below in float64 from its source (not imported, not built from ours):
    log-probs    the fused head's per-token log-probabilities of the labels, 0 where the next label is -100, summed
                 over the sequence; the batch is [chosen, rejected] (chunk(2))
    sigmoid      -logsigmoid(beta * (chosen_logratios - rejected_logratios))
    ipo          (chosen_logratios / n_w - rejected_logratios / n_l - 1 / (2 beta))^2, n = completion_mask.sum(1)
    sft          -mean of the chosen answers' per-token log-probabilities over the batch's chosen tokens, added
                 with its loss_weights entry (TRL 1.16's RPO: loss_type ["sigmoid", "sft"], weights [1, alpha])
    loss         sum over loss types of weight * per_sequence_loss.mean()
    rewards      beta * logratios (detached); accuracies chosen_rewards > rejected_rewards; margins their difference
Ours on the same numbers: loss, rewards and the gradients with respect to the hidden states and the head, to 1e-6
relative. The RPO term: TRL's token mean over the batch's chosen tokens equals ours (each answer's mean, averaged
over pairs) for a batch of one pair; a batch of several with different lengths differs (docs/training.md, "DPO").

Then TRL's own _compute_loss (tests/trl_dpo_probe.py) in a separate venv when there is one, on the tiny Qwen3's
hidden states of a real pair batch; the precomputed reference against the recomputed one, bit for bit; and with a
LoRA student the reference is the student's own base (the storage probe).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dataset.collators import IGNORE_INDEX, PairCollator, SFTCollator
from loop_helpers import env_one_thread, loop_args
from model import Qwen3Config, create_model, load_tokenizer
from support import ROOT, TINY_CONFIG
from test_rl_reference import PROBE as GRPO_PROBE, TRL_PYTHON, TRL_VENV_HELP, trl_version
from trainer.losses.chunked import completion_rows
from trainer.losses.preference import fused_pair_loss
from trainer.skeleton.distributed import DistInfo
from trainer.teachers.pair_reference import batch_logps, precompute

pytestmark = pytest.mark.usefixtures("one_thread")

PROBE = GRPO_PROBE.with_name("trl_dpo_probe.py")
BETA = 0.1


# ----------------------------------------------------------------------------- TRL 1.16.0's formulas, pinned

def trl_loss(per_token_logps: torch.Tensor, completion_mask: torch.Tensor, ref_logps: torch.Tensor, loss_type: str,
             beta: float, sft_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_compute_loss from the fused head's per-token log-probabilities (2P, T - 1), the unshifted completion mask
    (2P, T) and the reference's summed log-probabilities (P, 2) -> (loss, chosen rewards, rejected rewards)."""
    logps = per_token_logps.sum(dim=1)
    chosen_logps, rejected_logps = logps.chunk(2, dim=0)
    chosen_logratios, rejected_logratios = chosen_logps - ref_logps[:, 0], rejected_logps - ref_logps[:, 1]
    if loss_type == "sigmoid":
        per_sequence = -F.logsigmoid(beta * (chosen_logratios - rejected_logratios))
    else:
        chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
        delta = (chosen_logratios / chosen_mask.sum(dim=1).clamp(min=1.0)
                 - rejected_logratios / rejected_mask.sum(dim=1).clamp(min=1.0))
        per_sequence = (delta - 1 / (2 * beta)) ** 2
    loss = per_sequence.mean()
    if sft_weight:
        chosen_shift_mask, _ = completion_mask[:, 1:].chunk(2, dim=0)
        chosen_per_token, _ = per_token_logps.chunk(2, dim=0)
        loss = loss + sft_weight * -chosen_per_token[chosen_shift_mask.bool()].mean()
    return loss, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def fused_head_logps(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The fused LM head's per-token log-probabilities (trl/trainer/utils.py, add_fused_lm_head): position t scores
    labels[t + 1], 0 where that is -100."""
    logits = hidden[:, :-1] @ head.T
    shifted = labels[:, 1:]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logp.masked_fill(shifted == IGNORE_INDEX, 0.0)


# ----------------------------------------------------------------------------- a batch

def random_batch(pairs: int, vocab: int = 48, hidden_size: int = 8, seed: int = 0) -> dict:
    """2P right-padded sequences (the P chosen first) of different prompt and answer lengths, float64 hidden states
    at every position and a head; the reference's summed log-probabilities."""
    g = torch.Generator().manual_seed(seed)
    width = 12
    labels = torch.full((2 * pairs, width), IGNORE_INDEX)
    for row in range(2 * pairs):
        prompt = 2 + row % 3
        answer = 1 + (5 * row + 3) % (width - prompt)
        labels[row, prompt:prompt + answer] = torch.randint(vocab, (answer,), generator=g)
    return {"labels": labels, "hidden": torch.randn(2 * pairs, width, hidden_size, generator=g, dtype=torch.float64),
            "head": torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64),
            "ref_logps": -10 * torch.rand(pairs, 2, generator=g, dtype=torch.float64)}


def ours(batch: dict, loss_type: str, rpo_alpha: float = 0.0, chunk_size: int = 5):
    """Our mean pair loss, its gradients w.r.t. every position's hidden state and the head, and the rewards."""
    hidden, head = batch["hidden"].clone().requires_grad_(True), batch["head"].clone().requires_grad_(True)
    labels = batch["labels"]
    keep = labels[:, 1:] != IGNORE_INDEX  # completion_hidden's positions and labels
    pairs = fused_pair_loss(hidden[:, :-1][keep], head, labels[:, 1:][keep], completion_rows(labels),
                            batch["ref_logps"], chunk_size, len(head), loss_type, BETA, rpo_alpha)
    loss = pairs.loss / pairs.pairs
    loss.backward()
    return loss.detach(), hidden.grad, head.grad, pairs


def reference(batch: dict, loss_type: str, sft_weight: float = 0.0):
    hidden, head = batch["hidden"].clone().requires_grad_(True), batch["head"].clone().requires_grad_(True)
    labels = batch["labels"]
    loss, chosen, rejected = trl_loss(fused_head_logps(hidden, head, labels), (labels != IGNORE_INDEX).long(),
                                      batch["ref_logps"], loss_type, BETA, sft_weight)
    loss.backward()
    return loss.detach(), hidden.grad, head.grad, chosen, rejected


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("pairs, rpo_alpha", [(3, 0.0), (1, 0.5)], ids=["3pairs", "1pair-rpo"])
def test_the_pair_losses_are_trls(loss_type, pairs, rpo_alpha):
    """Loss, rewards, margin, accuracy and the gradients w.r.t. hidden states and head against TRL's formulas (the
    RPO term on one pair, where TRL's token mean over the batch is each answer's own mean)."""
    batch = random_batch(pairs)
    loss, grad_hidden, grad_head, sums = ours(batch, loss_type, rpo_alpha)
    expected, expected_hidden, expected_head, chosen, rejected = reference(batch, loss_type, rpo_alpha)
    assert relative(loss, expected) < 1e-6
    assert relative(grad_hidden, expected_hidden) < 1e-6 and relative(grad_head, expected_head) < 1e-6
    assert float(sums.reward_chosen) == pytest.approx(float(chosen.sum()), rel=1e-6)
    assert float(sums.reward_rejected) == pytest.approx(float(rejected.sum()), rel=1e-6)
    assert int(sums.correct) == int((chosen > rejected).sum())


def test_the_rpo_term_is_each_chosen_answers_mean_nll_averaged_over_pairs():
    """With several pairs of different lengths ours is the RPO paper's per-answer mean (TRL's token mean differs)."""
    batch = random_batch(3)
    loss, *_ = ours(batch, "sigmoid", 0.5)
    plain, *_ = ours(batch, "sigmoid", 0.0)
    labels = batch["labels"]
    per_token = fused_head_logps(batch["hidden"], batch["head"], labels)[:3]
    counts = (labels[:3, 1:] != IGNORE_INDEX).sum(1)
    assert float(loss - plain) == pytest.approx(float(0.5 * (-per_token.sum(1) / counts).mean()), rel=1e-9)
    assert float(loss - plain) != pytest.approx(float(0.5 * -per_token[labels[:3, 1:] != IGNORE_INDEX].mean()),
                                                rel=1e-6)


def test_the_gradient_does_not_depend_on_the_chunking():
    """Chunks of the completion positions that cut answers (1, 3) against one chunk holding them all."""
    batch = random_batch(3)
    whole = ours(batch, "sigmoid", chunk_size=64)
    for chunk in (1, 3):
        cut = ours(batch, "sigmoid", chunk_size=chunk)
        assert relative(cut[1], whole[1]) < 1e-12 and relative(cut[2], whole[2]) < 1e-12


# ----------------------------------------------------------------------------- the tiny Qwen3 and real pairs

PAIRS = [({"role": "user", "content": f"What is {a} + {b}?"}, f"{a + b}", f"It is {a + b + 1}, I think. " * (i + 1))
         for i, (a, b) in enumerate([(2, 3), (40, 12), (7, 8), (19, 19), (5, 60)])]


def pair_rows() -> list[dict]:
    return [{"prompt": [prompt], "chosen": [{"role": "assistant", "content": chosen}],
             "rejected": [{"role": "assistant", "content": rejected}], "row_index": i}
            for i, (prompt, chosen, rejected) in enumerate(PAIRS)]


@pytest.fixture(scope="module")
def tiny():
    """Two tiny Qwen3s (the student, seed 0; the reference, seed 1) with the real vocabulary, and the collator."""
    config = Qwen3Config.from_dict(TINY_CONFIG)
    tokenizer = load_tokenizer()
    collator = PairCollator(SFTCollator(tokenizer, max_length=64, max_prompt_length=32, enable_thinking=False))
    return (create_model(config, seed=0).double().eval(), create_model(config, seed=1).double().eval(), collator,
            len(tokenizer))


@pytest.mark.slow
def test_real_trl_matches_ours(tiny, tmp_path):
    """TRL 1.16.0's _compute_loss (tests/trl_dpo_probe.py) on the tiny Qwen3's hidden states of a real batch of 3
    pairs: sigmoid and IPO, the reference precomputed or a second model; and the RPO term on one pair."""
    version = trl_version()
    if version != "1.16.0":
        pytest.skip(f"needs TRL 1.16.0 in {TRL_PYTHON} (found: {version}); create it with: {TRL_VENV_HELP}")
    student, ref_model, collator, vocab = tiny
    batch = collator(pair_rows()[:3])
    with torch.no_grad():
        hidden = student(batch["input_ids"], return_hidden=True).hidden_states
        ref_hidden = ref_model(batch["input_ids"], return_hidden=True).hidden_states
    # the heads' rows of the tokenizer's tokens: ours normalises over those (the padding rows are no tokens), TRL's
    # over every row it is given
    head, ref_head = student.lm_head.weight.detach()[:vocab], ref_model.lm_head.weight.detach()[:vocab]
    labels = batch["labels"]
    ref_logps = batch_logps(ref_model, contextlib.nullcontext, batch, 16, vocab)[:, :2]
    cases = [{"name": f"{loss}_{'precompute' if precompute else 'ref_model'}", "loss_type": [loss],
              "loss_weights": None, "precompute": precompute, "rpo": 0.0}
             for loss in ("sigmoid", "ipo") for precompute in (True, False)]
    cases.append({"name": "sigmoid_rpo", "loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5],
                  "precompute": True, "rpo": 0.5})
    data = {"hidden": hidden, "head": head, "ref_hidden": ref_hidden, "ref_head": ref_head, "ref_logps": ref_logps,
            "input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            "completion_mask": (labels != IGNORE_INDEX).long(), "beta": BETA, "cases": cases}
    rpo = collator(pair_rows()[3:4])  # the RPO term on one pair: TRL's token mean is the answer's mean
    with torch.no_grad():
        rpo_hidden = student(rpo["input_ids"], return_hidden=True).hidden_states
    rpo_ref = batch_logps(ref_model, contextlib.nullcontext, rpo, 16, vocab)[:, :2]
    # the reference model's case: TRL scores its hidden states and head; ours (batch_logps) the same numbers
    assert torch.allclose(ref_logps, fused_head_logps(ref_hidden, ref_head, labels).sum(1).view(2, -1).T, rtol=1e-12)
    results = {}
    for name, part in (("batch", data), ("rpo", {**data, "hidden": rpo_hidden, "ref_logps": rpo_ref,
                                                 "input_ids": rpo["input_ids"],
                                                 "attention_mask": rpo["attention_mask"],
                                                 "completion_mask": (rpo["labels"] != IGNORE_INDEX).long(),
                                                 "cases": cases[-1:]})):
        torch.save(part, tmp_path / f"{name}.pt")
        done = subprocess.run([str(TRL_PYTHON), str(PROBE), str(tmp_path / f"{name}.pt"), str(tmp_path / "out.pt")],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
        assert done.returncode == 0, done.stderr[-4000:]
        results.update(torch.load(tmp_path / "out.pt"))
    for case in cases:
        trl = results[case["name"]]
        one = case["rpo"] > 0
        part = {"hidden": rpo_hidden if one else hidden, "head": head, "labels": rpo["labels"] if one else labels,
                "ref_logps": rpo_ref if one else ref_logps}
        loss, grad_hidden, grad_head, sums = ours(part, case["loss_type"][0], case["rpo"], chunk_size=16)
        pairs = sums.pairs
        diffs = {"loss": relative(loss, trl["loss"]), "grad_hidden": relative(grad_hidden, trl["grad_hidden"]),
                 "grad_head": relative(grad_head, trl["grad_head"]),
                 "chosen": abs(float(sums.reward_chosen) / pairs - trl["rewards/chosen"]),
                 "rejected": abs(float(sums.reward_rejected) / pairs - trl["rewards/rejected"]),
                 "margin": abs(float(sums.reward_chosen - sums.reward_rejected) / pairs - trl["rewards/margins"]),
                 "accuracy": abs(float(sums.correct) / pairs - trl["rewards/accuracies"])}
        print(case["name"], {k: f"{v:.2e}" for k, v in diffs.items()})
        assert all(value < 1e-6 for value in diffs.values()), (case["name"], diffs)


# ----------------------------------------------------------------------------- the reference

def test_the_precomputed_reference_equals_the_recomputed_one_bit_for_bit(tiny):
    """precompute's table (fixed batches of --batch_size pairs in file order) against each batch computed again,
    bit for bit; against a training micro-batch of other pairs (other padding) to rounding; the token counts
    exact."""
    _, ref_model, collator, vocab = tiny
    rows = pair_rows()
    run = SimpleNamespace(args=Namespace(batch_size=2, fsdp=0), dist=DistInfo(), device="cpu")
    table = precompute(ref_model, contextlib.nullcontext, rows, collator, run, 7, vocab)
    for start in range(0, len(rows), 2):
        again = batch_logps(ref_model, contextlib.nullcontext, collator(rows[start:start + 2]), 7, vocab)
        assert torch.equal(table[start:start + 2], again)
    mixed = [rows[4], rows[0], rows[2]]
    live = batch_logps(ref_model, contextlib.nullcontext, collator(mixed), 3, vocab)
    assert torch.equal(live[:, 2:], table[[4, 0, 2], 2:])
    assert torch.allclose(live[:, :2], table[[4, 0, 2], :2], rtol=1e-12, atol=0)


@pytest.mark.slow
def test_a_lora_students_reference_is_its_own_base_and_a_precomputed_one_is_freed(tiny_config_path, tmp_path):
    """The storage probe (tests/storage_probe.py) at the first optimizer step: a LoRA student's reference holds
    under 1.1 copies of the base, with or without --precompute_ref; a full student's live reference is a second
    copy (about 2), freed once its numbers are precomputed (about 1)."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({k: v for k, v in row.items() if k != "row_index"}) + "\n"
                            for row in pair_rows()))
    copies = {}
    for name, flags in (("lora", {"lora_rank": 4, "lora_alpha": 8}),
                        ("lora_precomputed", {"lora_rank": 4, "lora_alpha": 8, "precompute_ref": 1}),
                        ("full", {}), ("full_precomputed", {"precompute_ref": 1})):
        out = tmp_path / f"{name}.json"
        args = loop_args(tiny_config_path, str(data), tmp_path / name, max_steps=1, **flags)
        result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "storage_probe.py"), str(out),
                                 os.path.join(ROOT, "trainer", "train_dpo.py"), *args], env=env_one_thread(),
                                capture_output=True, text=True, timeout=400)
        assert result.returncode == 0, result.stderr[-3000:]
        probe = json.loads(out.read_text())
        copies[name] = probe["weights_bytes"] / probe["base_bytes"]
    assert copies["lora"] < 1.1 and copies["lora_precomputed"] < 1.1, copies
    assert copies["full"] > 1.9 and copies["full_precomputed"] < 1.1, copies


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.parametrize("precompute", [0, 1])
def test_two_sharded_ranks_train_and_evaluate_as_one_process(precompute, tiny_config_path, tmp_path):
    """--fsdp 1 on 2 gloo ranks against one process (the same global batch of pairs), the reference live (a sharded
    frozen model) or precomputed (every rank in lockstep): the same weights, step losses and held-out pair
    losses."""
    from loop_helpers import max_weight_diff, metrics, run_command, torchrun_command, weights
    from support import write_pairs_jsonl
    from trainer.train_dpo import main as train_dpo
    pairs = write_pairs_jsonl(tmp_path / "pairs.jsonl", 8)
    held_out = write_pairs_jsonl(tmp_path / "held_out.jsonl", 4, seed=1)
    extra = dict(max_steps=2, eval_interval=2, eval_rows=4, eval_data_path=held_out, eval_max_new_tokens=4,
                 precompute_ref=precompute, rpo_alpha=0.5)
    train_dpo(loop_args(tiny_config_path, pairs, tmp_path / "one", batch=2, accumulation=2, **extra))
    script = os.path.join(ROOT, "trainer", "train_dpo.py")
    run_command(torchrun_command(script, loop_args(tiny_config_path, pairs, tmp_path / "two", batch=2, fsdp=1,
                                                   **extra)))
    assert max_weight_diff(weights(tmp_path / "one"), weights(tmp_path / "two")) <= 1e-5
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    for key in ("loss", "pair_accuracy", "eval/pair_loss"):
        assert [m[key] for m in one if key in m] == pytest.approx([m[key] for m in two if key in m], abs=1e-5), key
    assert [m["step"] for m in two if "eval/pair_loss" in m] == [0, 2]


@pytest.mark.slow
def test_bf16_autocast_trains_as_fp32_to_bf16s_rounding(tiny_config_path, tmp_path):
    """--dtype bfloat16 on the CPU (fp32 masters under autocast, the CUDA recipe): two steps whose losses are fp32's
    within bf16's rounding, the reference's numbers in the same autocast."""
    from loop_helpers import metrics
    from support import write_pairs_jsonl
    from trainer.train_dpo import main as train_dpo
    pairs = write_pairs_jsonl(tmp_path / "pairs.jsonl", 8)
    for dtype in ("float32", "bfloat16"):
        train_dpo(loop_args(tiny_config_path, pairs, tmp_path / dtype, batch=4, max_steps=2, dtype=dtype))
    fp32, bf16 = ([m["loss"] for m in metrics(tmp_path / d)] for d in ("float32", "bfloat16"))
    assert len(bf16) == 2 and bf16 == pytest.approx(fp32, rel=2e-2)
