# python -m pytest tests/test_layering.py
"""The packages import each other in one direction only, so each can be read (and tested) without the ones above it:

    common  <-  model  <-  dataset  <-  trainer
                     <-  serving   <-  trainer, eval
                                   <-  eval (the scripts: model, dataset, serving and the grader; never the
                                       training skeleton)
            <-  tools (the tools a rollout may call)  <-  serving, trainer, eval

trainer may use eval's grader (held-out accuracy during training); nothing in eval imports trainer."""
import ast
import os

import pytest

from support import ROOT

ALLOWED = {
    "common": {"common"},
    "tools": {"common", "tools"},
    "model": {"common", "model"},
    "dataset": {"common", "model", "dataset"},
    "serving": {"common", "model", "tools", "serving"},
    "eval": {"common", "model", "dataset", "serving", "tools", "eval"},
    "trainer": {"common", "model", "dataset", "serving", "tools", "trainer", "eval.grader"},
}
# A data-making script that samples and grades with eval's own functions rather than a second copy of them; nothing
# imports it, so the layer it lives in stays readable without eval.
SCRIPTS_ABOVE_THEIR_LAYER = {"dataset/make_dpo_pairs.py": {"eval.eval_math"}}
# A module above its layer that others do import: the demo data's products task lists the calculator's own schema
# and writes its own answers, and the loops, eval and the benchmarks import the demo data. Sound while whatever
# imports it may import these itself, or is a script above its layer that nothing imports
# (test_a_module_above_its_layer_is_imported_only_where_its_imports_are_allowed).
MODULES_ABOVE_THEIR_LAYER = {"dataset/make_demo_data.py": {"tools.calculator"}}


def project_imports(path: str) -> set[str]:
    """The project modules a file imports (dotted names), at any depth of the file."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {name for name in names if name.split(".")[0] in ALLOWED}


def allowed(name: str, package: str) -> bool:
    return any(name == rule or name.startswith(rule + ".") or name.split(".")[0] == rule
               for rule in ALLOWED[package] if "." not in rule) or name in ALLOWED[package]


def python_files(folder: str) -> list[str]:
    """Every module under `folder`, subfolders included, relative to it."""
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, files in os.walk(folder)
                  for f in files if f.endswith(".py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_go_one_way(package):
    folder = os.path.join(ROOT, package)
    files = python_files(folder)
    assert files, f"{package}/ has no modules"
    wrong = {f"{package}/{f} imports {name}" for f in files
             for name in project_imports(os.path.join(folder, f)) if not allowed(name, package)
             and name not in SCRIPTS_ABOVE_THEIR_LAYER.get(f"{package}/{f}", set())
             and name not in MODULES_ABOVE_THEIR_LAYER.get(f"{package}/{f}", set())}
    assert not wrong, sorted(wrong)


# trainer/'s rooms (docs/architecture.md, "trainer/, room by room") and the rooms each may import; the loops,
# trainer/train_*.py, stand above them all and may import any
ROOMS = {
    "skeleton": {"skeleton"},                     # the run every loop shares: data, step, checkpoints, logs
    "losses": {"losses"},                         # closed forms and the chunked drivers: functions of tensors
    "rollouts": {"skeleton", "rollouts"},         # where an on-policy loop's samples come from; the servers
    "teachers": {"skeleton", "losses", "rollouts.servers", "teachers"},  # the teachers behind one object
    "evaluation": {"skeleton", "losses", "teachers", "evaluation"},      # held-out accuracy and divergences
    "rl": {"skeleton", "losses", "rl"},           # the RL loop's own helpers
    "logit_free": {"skeleton", "losses", "logit_free"},  # the logit-free loop's own helpers
    "config": {"skeleton", "rollouts", "teachers", "logit_free", "losses", "rl", "config"},  # each loop's flags
}


def room_allows(name: str, rules: set[str]) -> bool:
    """`name` (trainer.ROOM.module) is within one of `rules` (a room, or room.module)."""
    inner = name.split(".", 1)[1] if name.startswith("trainer.") else ""
    return any(inner == rule or inner.startswith(rule + ".") for rule in rules)


def test_every_trainer_module_is_in_a_room_that_imports_downwards():
    """Walks every subfolder of trainer/: a module outside the known rooms (and not a loop at the top) fails, as
    does an import of a room its own may not import."""
    folder = os.path.join(ROOT, "trainer")
    unclassified, wrong = [], []
    for f in python_files(folder):
        parts = f.split(os.sep)
        if len(parts) == 1:
            if not (f.startswith("train_") or f == "__init__.py"):
                unclassified.append(f"trainer/{f}: at the top only the loops, trainer/train_*.py")
            continue
        if len(parts) > 2 or parts[0] not in ROOMS:
            unclassified.append(f"trainer/{f}: in no room of {sorted(ROOMS)}")
            continue
        wrong += [f"trainer/{f} imports {name}" for name in project_imports(os.path.join(folder, f))
                  if name.startswith("trainer.") and not room_allows(name, ROOMS[parts[0]])]
    assert not unclassified, unclassified
    assert not wrong, sorted(wrong)


@pytest.mark.parametrize("module, may_import", [
    ("console", set()),
    ("distributed", {"common.errors", "trainer.skeleton.console"}),
    ("guard", {"common.errors", "common.files", "trainer.skeleton.distributed"}),
    ("run_state", set()),
    ("resume_checks", {"common.errors", "model.precision", "trainer.skeleton.distributed", "trainer.skeleton.guard"}),
    ("checkpoint", {"common.errors", "common.files", "common.seeds", "model", "model.checkpoint_io", "model.lora",
                    "model.precision", "trainer.skeleton.distributed", "trainer.skeleton.resume_checks",
                    "trainer.skeleton.run_state", "trainer.skeleton.sharding"}),
])
def test_the_pieces_below_the_run_import_nothing_of_the_loops(module, may_import):
    """trainer/skeleton/console.py (bar, log line, clocks), distributed.py (the process group), guard.py (run lock,
    stop signals), run_state.py, resume_checks.py and checkpoint.py stand below the run and the scripts: none imports
    the run, the flags, a loop's logic (rollouts, divergences) or a training script."""
    assert project_imports(os.path.join(ROOT, "trainer", "skeleton", f"{module}.py")) <= may_import


def test_a_module_above_its_layer_is_imported_only_where_its_imports_are_allowed():
    """What lets MODULES_ABOVE_THEIR_LAYER import upwards: importing one brings no module into a layer that may not
    import it directly."""
    wrong = []
    for path, reaches in MODULES_ABOVE_THEIR_LAYER.items():
        module = path.removesuffix(".py").replace("/", ".")
        for package in ALLOWED:
            for f in python_files(os.path.join(ROOT, package)):
                if f"{package}/{f}" in SCRIPTS_ABOVE_THEIR_LAYER:
                    continue  # nothing imports it: the chain ends there
                if module in project_imports(os.path.join(ROOT, package, f)):
                    wrong += [f"{package}/{f} imports {module}, which imports {name}" for name in sorted(reaches)
                              if not allowed(name, package)]
    assert not wrong, wrong


def test_no_module_imports_a_script_above_its_layer():
    """What lets SCRIPTS_ABOVE_THEIR_LAYER import upwards: no module of any package imports them."""
    scripts = {path.removesuffix(".py").replace("/", ".") for path in SCRIPTS_ABOVE_THEIR_LAYER}
    importers = [f"{package}/{f}" for package in ALLOWED for f in python_files(os.path.join(ROOT, package))
                 if project_imports(os.path.join(ROOT, package, f)) & scripts]
    assert not importers, importers
