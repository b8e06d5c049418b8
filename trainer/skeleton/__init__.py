"""The skeleton every loop runs on, as the loops import it: the process group, the student and the rows, the run
(its data stream, optimizer step, checkpoints, logs and stop signals) and the phase clock."""
from trainer.skeleton.console import PhaseClock
from trainer.skeleton.distributed import init_distributed_mode, print0
from trainer.skeleton.guard import train_noting_stop_signals
from trainer.skeleton.loading import build_student, load_pair_data, load_prompt_data, load_sft_data
from trainer.skeleton.run import Run

__all__ = ["PhaseClock", "Run", "build_student", "init_distributed_mode", "load_pair_data", "load_prompt_data",
           "load_sft_data", "print0", "train_noting_stop_signals"]
