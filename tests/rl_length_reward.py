"""train_rl.py with a stand-in reward that a random tiny model's completions vary on: math-verify would mark every
random completion wrong, so every group would have one reward, no advantage and no gradient, and the RL tests would
prove nothing. The reward is a pure function of the completion's text (its length mod 3, halved: 0, 0.5 or 1), so
it is the same whatever the batching, the world size or an interruption, as a verifiable reward is.

    python tests/rl_length_reward.py ARGS...       # train_rl.py's flags (the tests run it under torchrun too)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import trainer.rl.rewards as rewards  # noqa: E402
import trainer.train_rl as train_rl  # noqa: E402
from common.errors import run_script  # noqa: E402


def length_reward(texts, truths, kind, format_weight=0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rewards, correct): (len(text) mod 3) / 2, and 'correct' where it is 1."""
    rewards = torch.tensor([(len(text) % 3) / 2 for text in texts])
    return rewards, rewards == 1.0


def with_length_reward(loop_main, argv: list[str] | None) -> None:
    """Run a loop's main (train_rl's, train_ppo's) with the stand-in reward."""
    original = rewards.reward_of
    rewards.reward_of = length_reward
    try:
        loop_main(argv)
    finally:
        rewards.reward_of = original


def main(argv: list[str] | None = None) -> None:
    with_length_reward(train_rl.main, argv)


if __name__ == "__main__":
    run_script(main)
