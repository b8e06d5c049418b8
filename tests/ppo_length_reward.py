"""train_ppo.py with tests/rl_length_reward.py's stand-in reward (a random tiny model never answers right).

    python tests/ppo_length_reward.py ARGS...
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import trainer.train_ppo as train_ppo  # noqa: E402
from common.errors import run_script  # noqa: E402
from rl_length_reward import with_length_reward  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    with_length_reward(train_ppo.main, argv)


if __name__ == "__main__":
    run_script(main)
