# python -m pytest tests/test_layering.py
"""The packages import each other in one direction only, so each can be read (and tested) without the ones above it:

    common  <-  model  <-  dataset  <-  trainer
                     <-  serving   <-  trainer, eval
                                   <-  eval (the scripts: model, dataset, serving and the grader; never the
                                       training skeleton)

trainer may use eval's grader (held-out accuracy during training); nothing in eval imports trainer."""
import ast
import os

import pytest

from support import ROOT

ALLOWED = {
    "common": {"common"},
    "model": {"common", "model"},
    "dataset": {"common", "model", "dataset"},
    "serving": {"common", "model", "serving"},
    "eval": {"common", "model", "dataset", "serving", "eval"},
    "trainer": {"common", "model", "dataset", "serving", "trainer", "eval.grader"},
}


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


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_go_one_way(package):
    folder = os.path.join(ROOT, package)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".py"))
    assert files, f"{package}/ has no modules"
    wrong = {f"{package}/{f} imports {name}" for f in files
             for name in project_imports(os.path.join(folder, f)) if not allowed(name, package)}
    assert not wrong, sorted(wrong)


@pytest.mark.parametrize("module, may_import", [
    ("console", set()),
    ("distributed", {"common.errors", "trainer.console"}),
    ("guard", {"common.errors", "common.files", "trainer.distributed"}),
    ("run_state", set()),
    ("resume_checks", {"common.errors", "model.precision", "trainer.distributed", "trainer.guard"}),
    ("checkpoint", {"common.errors", "common.files", "common.seeds", "model", "model.precision", "trainer.distributed",
                    "trainer.resume_checks", "trainer.run_state", "trainer.sharding"}),
])
def test_the_pieces_below_the_run_import_nothing_of_the_loops(module, may_import):
    """trainer/console.py (bar, log line, clocks), distributed.py (the process group), guard.py (run lock, stop
    signals), run_state.py, resume_checks.py and checkpoint.py stand below the run and the scripts: none imports
    the run, the flags, a loop's logic (rollouts, divergences) or a training script."""
    assert project_imports(os.path.join(ROOT, "trainer", f"{module}.py")) <= may_import
