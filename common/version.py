"""Which code made a result: the repository's commit, so that a number can name it and a reader (or a script that
would reuse the result) can tell whether the code has changed since."""
from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL_CHANGES = " with local changes"


def code_commit() -> str:
    """The short commit of HEAD, + LOCAL_CHANGES when a tracked file differs from it; "unknown" outside a git
    checkout (an installed copy, no git)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + (LOCAL_CHANGES if dirty else "")


def is_exact(commit: str) -> bool:
    """Whether `commit` names the code exactly: a commit without local changes."""
    return commit != "unknown" and not commit.endswith(LOCAL_CHANGES)


# What no result depends on: a result made at an earlier commit still stands when only these changed since
NOT_CODE = (":(exclude)docs", ":(exclude)*.md", ":(exclude)tests")


def same_code(earlier: str, now: str, root: str = ROOT, unused: tuple[str, ...] = ()) -> bool:
    """Whether the code at commit `now` computes what the code at `earlier` did: the same exact commit, or two
    exact commits between which only documentation and tests changed (NOT_CODE), or folders the result's code
    does not use (`unused`: git pathspecs, ":(exclude)benchmarks")."""
    if not (is_exact(earlier) and is_exact(now)):
        return False
    if earlier == now:
        return True
    try:
        diff = subprocess.run(["git", "diff", "--quiet", earlier, now, "--", ".", *NOT_CODE, *unused], cwd=root,
                              capture_output=True)
    except OSError:
        return False
    return diff.returncode == 0  # 1: something else changed; 128: a commit unknown here
