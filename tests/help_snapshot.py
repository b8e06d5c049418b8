"""A training script's flags as data: run as `python tests/help_snapshot.py trainer/train_sft.py`, it runs the script
with --help and, instead of printing the help, prints a JSON snapshot of the parser -- every flag with its group,
default, type, choices and help text, and the --help text itself at a fixed width -- with the repository root and
the machine's default device written as placeholders, so the snapshot is the same on any checkout and machine.
tests/test_help_unchanged.py holds each loop's snapshot against the one kept in tests/help_snapshots/.

    python tests/help_snapshot.py trainer/train_sft.py --write   # (re)write tests/help_snapshots/train_sft.json
"""
import argparse
import json
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SNAPSHOTS = os.path.join(ROOT, "tests", "help_snapshots")


def placeholders(value):
    """The repository root and this machine's default device as placeholders (the rest as it is)."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text.replace(ROOT, "<ROOT>")


def snapshot(parser: argparse.ArgumentParser) -> dict:
    groups = {id(action): group.title for group in parser._action_groups for action in group._group_actions}
    flags = []
    for action in parser._actions:
        default = action.default
        if action.dest == "device":  # "cuda" where torch sees a GPU, else "cpu"
            default = "<cuda if available, else cpu>"
        flags.append({"flags": action.option_strings, "dest": action.dest, "group": groups.get(id(action)),
                      "default": placeholders(default), "type": getattr(action.type, "__name__", None),
                      "choices": None if action.choices is None else list(action.choices),
                      "help": placeholders(action.help or "")})
    os.environ["COLUMNS"] = "120"
    help_text = placeholders(parser.format_help()).replace("default: cuda)", "default: cpu)")
    return {"flags": flags, "help": help_text.splitlines()}


def main() -> None:
    script, write = sys.argv[1], "--write" in sys.argv[2:]

    def capture(parser, *args, **kwargs):
        text = json.dumps(snapshot(parser), indent=1) + "\n"
        if write:
            name = os.path.splitext(os.path.basename(script))[0]
            with open(os.path.join(SNAPSHOTS, f"{name}.json"), "w", encoding="utf-8") as f:
                f.write(text)
        else:
            sys.stdout.write(text)
        sys.exit(0)

    argparse.ArgumentParser.print_help = capture  # what --help calls, before it exits
    sys.argv = [script, "--help"]
    runpy.run_path(os.path.join(ROOT, script), run_name="__main__")


if __name__ == "__main__":
    main()
