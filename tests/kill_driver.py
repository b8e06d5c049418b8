"""Run a training script and SIGKILL it at a chosen instant:

    python tests/kill_driver.py SCRIPT export|resume|rollout|backward N ARGS...

export: during the N-th HF export, with half of its model.safetensors written; resume: during the N-th resume-file
write, with half of it written; rollout: as the N-th batch of served rollouts is requested (OPD's rollout queue
samples it in its background thread); backward: during the N-th micro-batch's backward. A real SIGKILL at an instant
a timer could not hit reliably: the state on disk is what a kill there leaves (temporaries and all), and nothing gets
to clean up."""
import os
import runpy
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import model.checkpoint_io as checkpoint_io  # noqa: E402

script, what, kill_at, args = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
calls = 0


def die_half_written(f) -> None:
    f.flush()
    f.truncate(f.tell() // 2)
    os.kill(os.getpid(), signal.SIGKILL)


def save_file(state, path, dtype):
    global calls
    calls += 1
    real_save_file(state, path, dtype)
    if calls == kill_at:
        with open(path, "r+b") as f:
            f.seek(0, os.SEEK_END)
            die_half_written(f)


def torch_save(obj, f, *rest, **kwargs):
    global calls
    calls += 1
    real_torch_save(obj, f, *rest, **kwargs)
    if calls == kill_at:
        die_half_written(f)


def killed_at_call(real):
    def call(*args, **kwargs):
        global calls
        calls += 1
        if calls == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    return call


if what == "export":
    real_save_file, checkpoint_io.save_file = checkpoint_io.save_file, save_file
elif what == "resume":
    real_torch_save, torch.save = torch.save, torch_save
elif what == "rollout":
    from serving.engine import CompletionServer
    CompletionServer.sample_tokens = killed_at_call(CompletionServer.sample_tokens)
else:
    from trainer.skeleton.run import Run
    Run.backward = killed_at_call(Run.backward)
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
