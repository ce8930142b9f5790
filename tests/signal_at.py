"""Run the ``hpcdl`` command line with a real SIGUSR1 raised in one rank at a chosen moment.

    mpiexec -n 2 python tests/signal_at.py RANK WHEN train --recipe ... --out ...

(``SIGNAL_AT`` below: the command prefix for tests.)

A test aid, so that a test can name the step a run stops at: the signal and everything that
handles it are the real ones, only the moment is chosen (production code has no hook for it).
RANK is the MPI world rank that raises it; WHEN is

- ``step=K``: in an after-step hook of step K, i.e. after that step's agreement, when the
  other ranks have not seen it: every rank must stop at step K + 1 (the next agreement);
- ``after-train``: when ``Trainer.train`` has returned (the run's last agreement is over).
"""
import os
import signal
import sys

#: ``[*SIGNAL_AT, RANK, WHEN, "train", ...]`` in place of ``[python, -m, hpcdl.cli.main, ...]``
SIGNAL_AT = [sys.executable, os.path.abspath(__file__)]


def _raise_on(rank: int) -> None:
    from mpi4py import MPI

    if MPI.COMM_WORLD.rank == rank:
        os.kill(os.getpid(), signal.SIGUSR1)


def signal_after_step(step: int, rank: int):
    """An after-step hook (``trainer.after_step_hooks``): world rank ``rank`` sends itself
    SIGUSR1 after step ``step``'s agreement, in the window before the step ends."""
    def hook(trainer) -> None:
        if trainer.step == step:
            _raise_on(rank)
    return hook


def _patch(rank: int, when: str) -> None:
    from hpcdl.train.trainer import Trainer

    if when.startswith("step="):
        hook = signal_after_step(int(when.removeprefix("step=")), rank)
        build = Trainer.__init__

        def init(self, *args, **kwargs):
            build(self, *args, **kwargs)
            self.after_step_hooks.append(hook)

        Trainer.__init__ = init
    elif when == "after-train":
        train = Trainer.train

        def train_then_signal(self):
            summary = train(self)
            _raise_on(rank)
            return summary

        Trainer.train = train_then_signal
    else:
        raise SystemExit(f"signal_at.py: WHEN is step=K or after-train, not {when!r}")


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # import hpcdl as ``python -m hpcdl.cli.main`` would, not tests/
    rank, when, *argv = sys.argv[1:]
    _patch(int(rank), when)
    sys.argv = ["hpcdl", *argv]
    from hpcdl.cli.main import cli

    cli()
