# python -m pytest tests/test_train_rl.py
"""train_rl.py on tiny Qwen3s (CPU): groups are a prompt's G rows with seeds apart (the first as OPD's lone row),
the rewards of a micro-batch become each token's group advantage and the first step's loss is its closed form, the
metrics of the groups (reward, pass@1, pass@G, zero-variance share) are the rewards', math-verify rewards and the
format bonus, `--reward none --opd_coef 1` with G = 1 is train_opd.py's sampled-token step, bad set-ups are refused
at start-up in one line; accumulation with rollouts from a real vLLM server equals one batch. A random tiny model
never answers right, so the loop tests use tests/rl_length_reward.py's stand-in reward; the math is in
tests/test_policy_gradient.py, the skeleton's invariants (accumulation, DDP, SIGKILL, world size) in
tests/test_loop_invariants.py."""
import math

import pytest
import torch

import trainer.rl.rewards as rewards_module
import trainer.train_rl as train_rl
from common.seeds import derived_seed
from dataset.collators import IGNORE_INDEX, PromptCollator
from dataset.sources import RowDataset
from loop_helpers import assert_one_line_error, loop_args, max_weight_diff, metrics, script_exit, weights
from model import Qwen3Config, create_model, load_tokenizer, save_pretrained
from rl_length_reward import length_reward, main as train_rl_varied
from trainer.losses.policy_gradient import ADVANTAGE
from trainer.rl.rewards import GroupCollator, reward_of
from trainer.rollouts.source import row_seeds
from trainer.train_opd import main as train_opd

RL = {"max_new_tokens": 8, "num_generations": 3}


@pytest.fixture
def teacher_dir(tiny_config_path, tmp_path):
    save_pretrained(create_model(Qwen3Config.from_json(tiny_config_path), seed=123), str(tmp_path / "teacher"))
    return str(tmp_path / "teacher")


def rl_args(config, data, save_dir, **flags) -> list[str]:
    return loop_args(config, data, save_dir, **{**RL, **flags})


def test_a_group_is_one_prompt_g_times_with_seeds_apart(chat_jsonl):
    rows = [RowDataset(chat_jsonl)[i] for i in (4, 9)]
    batch = GroupCollator(PromptCollator(load_tokenizer(None), 32), 3)(rows)
    assert batch["prompt_ids"].shape[0] == 6 and [r["row_index"] for r in batch["rows"]] == [4, 4, 4, 9, 9, 9]
    assert torch.equal(batch["prompt_ids"][0], batch["prompt_ids"][2])
    assert [r["generation"] for r in batch["rows"]] == [0, 1, 2, 0, 1, 2]
    seeds = row_seeds(7, batch, 1)
    assert len(set(seeds)) == 6
    assert seeds[0] == derived_seed(7, 1, 4) and seeds[3] == derived_seed(7, 1, 9)  # the lone row's (OPD's) seed


def test_rewards_are_math_verify_verdicts_plus_the_format_bonus():
    texts = ["so \\boxed{5}", "\\boxed{4}", "five", "<think>\\boxed{5}"]
    rewards, correct = reward_of(texts, ["5"] * 4, "math", format_weight=0.25)
    assert correct.tolist() == [True, False, False, False]
    assert rewards.tolist() == [1.25, 0.25, 0.0, 0.0]    # an answer left inside an open <think> is no answer
    rewards, correct = reward_of(texts, ["5"] * 4, "none")
    assert rewards.tolist() == [0.0] * 4 and not correct.any()


def test_the_first_loss_is_the_closed_form_of_its_groups(tiny_config_path, chat_jsonl, tmp_path, monkeypatch,
                                                          one_thread):
    """On-policy rho = 1, so the loss per token is -A of its row: the logged loss of step 1 is minus the
    token-weighted mean of the rows' advantages, recomputed here from the rewards the loop was given (grpo's
    formula written out); and the step's group metrics are the rewards'."""
    seen = []
    token_values = train_rl.token_values

    def spy(advantages, labels, *rest, **settings):
        values = token_values(advantages, labels, *rest, **settings)
        seen.append((labels.clone(), values[:, ADVANTAGE].clone()))
        return values
    rewards_seen = []

    def reward_spy(texts, truths, kind, format_weight=0.0):
        rewards, correct = length_reward(texts, truths, kind, format_weight)
        rewards_seen.append(rewards)
        return rewards, correct
    monkeypatch.setattr(train_rl, "token_values", spy)
    monkeypatch.setattr(rewards_module, "reward_of", reward_spy)
    train_rl.main(rl_args(tiny_config_path, chat_jsonl, tmp_path, batch=4, max_steps=1))
    total, tokens = 0.0, 0
    for (labels, advantage), rewards in zip(seen, rewards_seen):
        groups = rewards.double().view(-1, 3)
        expected = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
        lengths = (labels != IGNORE_INDEX).sum(1)
        assert torch.allclose(advantage.double(), expected.repeat_interleave(lengths), atol=1e-6)
        total += float(-(expected * lengths).sum())
        tokens += int(lengths.sum())
    step = metrics(tmp_path)[0]
    assert step["loss"] == pytest.approx(total / tokens, abs=1e-5) and step["tokens"] == tokens
    rewards = torch.cat(rewards_seen)
    assert step["reward"] == pytest.approx(float(rewards.mean())) and step["pass@1"] == pytest.approx(
        float((rewards == 1).float().mean()))
    assert step["pass@3"] == pytest.approx(float((rewards.view(-1, 3) == 1).any(1).float().mean()))
    groups = rewards.view(-1, 3)
    assert step["zero_variance_share"] == pytest.approx(float((groups == groups[:, :1]).all(1).float().mean()))
    assert step["reward_std"] == pytest.approx(float(rewards.std(unbiased=False)), abs=1e-6)
    assert step["clip_fraction"] == 0.0 and math.isfinite(step["entropy"])


@pytest.mark.parametrize("variant", [{}, {"opd_reward": "power", "position_weight": "iw", "iw_gamma": 2.0}])
def test_reward_none_with_the_opd_term_is_the_sampled_kl_opd_step(tiny_config_path, chat_jsonl, teacher_dir,
                                                                   tmp_path, one_thread, variant):
    """--reward none --opd_coef 1 --num_generations 1 --kl_coef 0: the advantage of token t is -(log p_S - log p_T),
    on the OPD loop's per-row samples; two steps land on train_opd.py --loss sampled_kl's weights. So with PowerOPD's
    reward and IW-OPD's weights: the two loops compute one signal."""
    common = dict(batch=4, max_steps=2, max_new_tokens=8, teacher_path=teacher_dir, **variant)
    train_rl.main(loop_args(tiny_config_path, chat_jsonl, tmp_path / "rl", reward="none", opd_coef=1,
                            num_generations=1, **common))
    train_opd(loop_args(tiny_config_path, chat_jsonl, tmp_path / "opd", loss="sampled_kl", **common))
    assert max_weight_diff(weights(tmp_path / "rl"), weights(tmp_path / "opd")) <= 1e-6
    rl, opd = metrics(tmp_path / "rl"), metrics(tmp_path / "opd")
    assert [m["tokens"] for m in rl] == [m["tokens"] for m in opd]
    assert [m["reverse_kl_estimate"] for m in rl] == pytest.approx([m["reverse_kl_estimate"] for m in opd],
                                                                   abs=1e-6)


def test_later_updates_of_a_rollout_batch_are_the_clipped_surrogate_of_a_float64_definition(
        tiny_config_path, chat_jsonl, tmp_path, monkeypatch, one_thread):
    """--update_epochs 2: the step's second update trains the same rollouts again from weights the first moved,
    against log pi_old recorded before the first. Each update's gradient (read before it is applied, normalised by
    its tokens) is recomputed by autograd of the clipped surrogate written here in float64, on a float64 copy of
    the weights the update started from and the rollouts the loop trained: the first update's ratio is 1 (up to
    rounding: its log pi_old is a forward of the same weights), the second's binds the clip on some tokens."""
    from trainer.losses.policy_gradient import OLD_LOGP
    from trainer.skeleton.optimizer_step import loss_divisor
    from trainer.skeleton.run import Run
    updates, parts = [], []
    apply_update = Run.apply_update

    def spy(run, tokens, loss):
        named = dict(run.raw_model.named_parameters())
        updates.append(({k: p.detach().clone() for k, p in named.items()},
                        {k: p.grad.detach() * loss_divisor(run.args) / tokens for k, p in named.items()}))
        return apply_update(run, tokens, loss)
    import trainer.rl.updates as updates_module
    real_minibatches = updates_module.minibatches

    def recorded(*args):
        for minibatch in real_minibatches(*args):
            parts.append(minibatch)
            yield minibatch
    monkeypatch.setattr(Run, "apply_update", spy)
    monkeypatch.setattr(updates_module, "minibatches", recorded)
    monkeypatch.setattr(rewards_module, "reward_of", length_reward)
    train_rl.main(rl_args(tiny_config_path, chat_jsonl, tmp_path, batch=4, max_steps=1, update_epochs=2,
                          learning_rate=0.05, clip_eps_high=0.28))
    assert len(updates) == len(parts) == 2
    logged = metrics(tmp_path)[0]
    assert logged["updates"] == 2 and logged["first_ratio"] == pytest.approx(1.0, abs=1e-6)
    model = create_model(Qwen3Config.from_json(tiny_config_path), dtype=torch.float64)
    vocab = len(load_tokenizer(None))  # the loop's softmax: the tokenizer's tokens, not the embedding's padding
    clipped = []
    for (start, grads), minibatch in zip(updates, parts):
        model.load_state_dict({k: v.double() for k, v in start.items()}, strict=False)
        params = dict(model.named_parameters())
        loss, tokens = 0.0, 0
        for part in minibatch:
            logits = model(part.input_ids, attention_mask=part.attention_mask).logits[:, :-1]
            labels = part.labels[:, 1:]
            keep = labels != IGNORE_INDEX
            logp = torch.log_softmax(logits[keep][:, :vocab], -1).gather(1, labels[keep][:, None]).squeeze(1)
            advantage, old = part.values[:, ADVANTAGE].double(), part.values[:, OLD_LOGP].double()
            ratio = torch.exp(logp - old)
            loss = loss - torch.minimum(ratio * advantage, ratio.clamp(0.8, 1.28) * advantage).sum()
            tokens += int(keep.sum())
            clipped.append(int(((ratio < 0.8) & (advantage < 0) | (ratio > 1.28) & (advantage > 0)).sum()))
        expected = torch.autograd.grad(loss / tokens, [params[k] for k in grads])
        norm = torch.sqrt(sum((e ** 2).sum() for e in expected))
        error = torch.sqrt(sum(((g.double() - e) ** 2).sum() for g, e in zip(grads.values(), expected)))
        assert float(error / norm) < 1e-6
    assert clipped[0] == 0 and sum(clipped) > 0, clipped


def test_minibatches_cut_the_rollout_batch_into_whole_groups_in_order():
    """P prompts per rank in M minibatches of P / M consecutive prompts with all their completions, wherever the
    micro-batches cut them: each row once per epoch, in the stream's order, its tokens' values with it."""
    from trainer.rl.minibatches import Rollout, minibatches
    g = 2

    def micro_batch(first_prompt: int, prompts: int) -> Rollout:
        rows = prompts * g
        ids = torch.arange(first_prompt * g, first_prompt * g + rows)[:, None].expand(rows, 4).clone()
        labels = torch.full((rows, 4), IGNORE_INDEX)
        labels[:, 2] = 1
        labels[ids[:, 0] % 2 == 1, 3] = 1  # rows of 1 and 2 completion tokens
        tokens = (labels[:, 1:] != IGNORE_INDEX).sum(1)
        values = torch.repeat_interleave(ids[:, 0], tokens).float()[:, None].expand(-1, 4)
        return Rollout(ids, torch.ones_like(ids), labels, values)
    batch = [micro_batch(0, 3), micro_batch(3, 3)]  # 6 prompts, 12 rows
    cut = list(minibatches(batch, 2, 3, g))
    assert len(cut) == 6
    for minibatch in cut[:3]:
        rows = torch.cat([part.input_ids[:, 0] for part in minibatch])
        assert len(rows) == 4 and bool((rows[1:] == rows[:-1] + 1).all()) and int(rows[0]) % 4 == 0
        for part in minibatch:
            tokens = (part.labels[:, 1:] != IGNORE_INDEX).sum(1)
            assert torch.equal(part.values[:, 0], torch.repeat_interleave(part.input_ids[:, 0], tokens).float())
    assert [[p.input_ids[:, 0].tolist() for p in m] for m in cut[:3]] == \
        [[p.input_ids[:, 0].tolist() for p in m] for m in cut[3:]]  # the second epoch: the same minibatches
    assert list(minibatches(batch, 1, 1, g)) == [batch]  # one minibatch: the micro-batches as they are


def test_target_kl_stops_every_rank_at_the_same_update(tiny_config_path, chat_jsonl, tmp_path, monkeypatch,
                                                       one_thread):
    """--target_kl: the updates after the first minibatch whose approximate KL to pi_old passes it are skipped (the
    first minibatch's is ~0, so at least two updates run); without it, all E x M."""
    monkeypatch.setattr(rewards_module, "reward_of", length_reward)
    common = dict(batch=4, max_steps=2, update_epochs=3, num_minibatches=2, learning_rate=0.05, policy_loss="cispo")
    train_rl.main(rl_args(tiny_config_path, chat_jsonl, tmp_path / "all", **common))
    train_rl.main(rl_args(tiny_config_path, chat_jsonl, tmp_path / "kl", target_kl=1e-6, **common))
    assert [m["updates"] for m in metrics(tmp_path / "all")] == [6, 6]
    assert all(2 <= m["updates"] < 6 for m in metrics(tmp_path / "kl"))


@pytest.mark.parametrize("flags, names", [
    ({"num_generations": 1}, ["--num_generations 1"]),
    ({"opd_coef": 1}, ["--opd_coef", "--teacher_path"]),
    ({"rollout_correction": "tis"}, ["--rollout_correction tis", "--rollout_url"]),
    ({"is_cap": 0.5}, ["--is_cap"]),
    ({"clip_eps": 1.5}, ["--clip_eps"]),
    ({"clip_eps": 1.0}, ["--clip_eps", "cispo"]),
    ({"num_minibatches": 3}, ["--num_minibatches 3", "--batch_size"]),
    ({"target_kl": 0.1}, ["--target_kl", "--update_epochs"]),
    ({"update_epochs": 0}, ["--update_epochs"]),
    ({"reward": "none"}, ["--reward none"]),
    ({"position_weight": "iw"}, ["--position_weight iw", "--opd_coef"]),
    ({"power_alpha": 2.0}, ["--power_alpha", "--opd_reward power"]),
])
def test_bad_set_ups_are_refused_in_one_line(tiny_config_path, chat_jsonl, tmp_path, capsys, flags, names):
    code, stderr = script_exit(train_rl.main, rl_args(tiny_config_path, chat_jsonl, tmp_path / "out", **flags), capsys)
    assert_one_line_error(code, stderr, 2, *names)
    assert not (tmp_path / "out").exists(), "a refused run leaves nothing behind"


def test_a_row_without_a_ground_truth_is_refused_at_start_up(tiny_config_path, tmp_path, capsys):
    import json
    data = tmp_path / "no_truth.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Question {i}"}], "ground_truth": str(i)} for i in range(3)]
    del rows[2]["ground_truth"]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    code, stderr = script_exit(train_rl.main, rl_args(tiny_config_path, str(data), tmp_path / "out"), capsys)
    assert_one_line_error(code, stderr, 2, "row 2", "ground truth", "--reward none")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------------
# rollouts from a real vLLM CPU server

@pytest.mark.slow
def test_served_rollouts_accumulation_equals_one_batch(vllm_servers, chat_jsonl, tmp_path, one_thread):
    """The session's student server samples every group (seeded per row and generation, so the same whatever the
    split), its weights pushed and verified before each step's rollouts; 2 micro-batches of 2 prompts x 3 land on
    one batch of 4 x 3."""
    flags = dict(model_path=vllm_servers.student_dir, rollout_url=vllm_servers.rollout.url, max_steps=2,
                 kl_coef=0.1)
    train_rl_varied(rl_args(None, chat_jsonl, tmp_path / "big", batch=4, **flags))
    train_rl_varied(rl_args(None, chat_jsonl, tmp_path / "acc", batch=2, accumulation=2, **flags))
    big, acc = metrics(tmp_path / "big"), metrics(tmp_path / "acc")
    assert [m["tokens"] for m in big] == [m["tokens"] for m in acc]
    assert [m["reward"] for m in big] == [m["reward"] for m in acc]
    assert any(m["zero_variance_share"] < 1 for m in big), "no group had a signal"
    assert max_weight_diff(weights(tmp_path / "big"), weights(tmp_path / "acc")) <= 1e-5
    assert all(m["sync_logprob_diff"] < 1e-3 for m in big)
