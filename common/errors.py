"""One convention for failures, used by every script.

A user error -- a bad flag, a missing or damaged file, a bad row, an unwritable folder -- is a `UserError`: the
script prints one line (`error: ...`, naming the file / row / column / flag and what to do) and exits with code 2.
A failure of the environment -- a server that is down, a full disk -- is a `RuntimeFailure`: one line, exit code 1.
No traceback in either case; set DISTILL_TRACEBACK=1 to see one while debugging. argparse's own complaints go the
same way (`ArgumentParser`), and a refused flag (`FlagError`), the same on every rank, is said by rank 0 only.

Exit codes (also in docs/training.md, "When things go wrong"):
    0    done
    1    runtime failure (server, disk, non-finite loss, ...)
    2    usage or data error
    75   stopped on SIGTERM / SIGUSR1 (preemption notice) after saving a resume checkpoint: rerun with --from_resume 1
    130  interrupted with Ctrl-C (SIGINT)
"""
from __future__ import annotations

import argparse
import errno
import os
import sys
import time
from collections.abc import Callable
from typing import NoReturn

EXIT_RUNTIME, EXIT_USAGE, EXIT_PREEMPTED, EXIT_INTERRUPTED = 1, 2, 75, 130
TRACEBACK_ENV = "DISTILL_TRACEBACK"
FLAG_ERROR_GRACE_S = 30  # the longest a silent rank waits for rank 0 to say a refused flag (see run_script)


class UserError(Exception):
    """Something the user can fix (flag, file, row): one line, exit code 2."""
    exit_code = EXIT_USAGE


class RuntimeFailure(Exception):
    """The environment failed (server, disk): one line, exit code 1."""
    exit_code = EXIT_RUNTIME


class Stopped(Exception):
    """A run ended early on purpose (a signal): its message is the last line printed, with its own exit code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class FlagError(UserError):
    """A refused flag or combination of flags: the same on every rank, so only rank 0 says it."""


def refuse(message: str) -> NoReturn:
    """The one way to reject a flag or a combination of flags: `error: ...` naming the flag, exit code 2."""
    raise FlagError(message)


def refuse_first(rules: list[tuple[bool, str]]) -> None:
    """Flag rules as a list of (broken, what is wrong and what to do): the first broken one is refused."""
    for broken, message in rules:
        if broken:
            refuse(message)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose own complaints (an unknown, missing, mistyped or shortened flag) are one `error: argument ...`
    line with exit code 2, like every other refused flag, instead of the whole usage text; --help shows each flag's
    default."""

    class HelpFormatter(argparse.RawDescriptionHelpFormatter):
        """The description as written (scripts put their commands there) and every flag's default, once: not
        where the help text already says what the default is, nor when there is none."""

        def _get_help_string(self, action: argparse.Action) -> str:
            text = action.help or ""
            said = "(default" in text or "default:" in text  # the help says it in its own words
            if action.default in (None, argparse.SUPPRESS) or said or not action.option_strings:
                return text
            return f"{text} (default: %(default)s)" if text else "default: %(default)s"

    def __init__(self, *args, **kwargs):
        # allow_abbrev=False: a shortened or mistyped flag (--learning_rat) is refused, never taken for another
        super().__init__(*args, formatter_class=self.HelpFormatter, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        refuse(f"{message} (--help lists the flags)")


def disk_error_message(error: OSError, what: str) -> str | None:
    """A one-line explanation of a full disk, a quota or a read-only folder while writing `what`; None otherwise."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"no space left while writing {what} ({error.strerror}): free disk space or choose another folder"
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write {what} ({error.strerror}): choose a writable folder"
    return None


def run_script(main: Callable[[], object]) -> NoReturn:
    """Run a script's main() under the failure convention and exit with its code (see the module docstring)."""
    show_traceback = os.environ.get(TRACEBACK_ENV, "") not in ("", "0")
    try:
        result = main()
        code = result if isinstance(result, int) and not isinstance(result, bool) else 0
    except Stopped as error:
        if show_traceback:
            raise
        if os.environ.get("RANK", "0") == "0":  # every rank stops; one says so
            print(error, file=sys.stderr, flush=True)
        code = error.exit_code
    except (UserError, RuntimeFailure) as error:
        if show_traceback:
            raise
        # every rank parses the same command line, so a flag is refused on all of them: rank 0 says so once. Any
        # other error is said by each rank that meets it (a file missing on one node, a server one rank can't reach)
        if not (isinstance(error, FlagError) and os.environ.get("RANK", "0") != "0"):
            print(f"error: {error}", file=sys.stderr, flush=True)
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            # torchrun stops every worker when the first one exits: a silent rank that exited before rank 0 printed
            # would leave the refusal unsaid. Rank 0 refuses the same flag, so its exit ends this wait.
            time.sleep(FLAG_ERROR_GRACE_S)
        code = error.exit_code
    except KeyboardInterrupt:
        if show_traceback:
            raise
        print("\ninterrupted", file=sys.stderr, flush=True)
        code = EXIT_INTERRUPTED
    except OSError as error:
        message = disk_error_message(error, error.filename or "a file")
        if message is None or show_traceback:
            raise
        print(f"error: {message}", file=sys.stderr, flush=True)
        code = EXIT_RUNTIME
    sys.exit(code)
