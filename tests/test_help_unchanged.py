"""Each loop's command line is a contract with its users: the flags, their defaults, types, choices, groups and help
texts, and the --help text itself, held against the snapshots in tests/help_snapshots/ (written by
`python tests/help_snapshot.py trainer/train_NAME.py --write`, on purpose, when a flag is added or changed)."""
import json
import os
import subprocess
import sys

import pytest

from support import ROOT

LOOPS = ("train_sft", "train_distillation", "train_opd", "train_rl", "train_logit_free", "train_ppo",
         "train_pretrain", "train_dpo")


@pytest.mark.parametrize("loop", LOOPS)
def test_the_command_line_is_unchanged(loop):
    out = subprocess.run([sys.executable, os.path.join("tests", "help_snapshot.py"), f"trainer/{loop}.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    now = json.loads(out.stdout)
    with open(os.path.join(ROOT, "tests", "help_snapshots", f"{loop}.json"), encoding="utf-8") as f:
        kept = json.load(f)
    assert [flag["flags"] for flag in now["flags"]] == [flag["flags"] for flag in kept["flags"]]
    for flag, was in zip(now["flags"], kept["flags"]):
        assert flag == was, flag["flags"]
    assert now["help"] == kept["help"]
