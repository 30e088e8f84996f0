"""Entry point of every rank: `python -m launch.ranks.train RUN_DIR` (started by torchrun or the deepspeed launcher).

The only module that imports rank code: the collective sweep, or the training loop with the backend
that resolved.json names.
"""
from __future__ import annotations

import sys

from launch.config.resolve import Resolved
from launch.run.rundir import RunDir


def main(argv: list[str]) -> int:
    from launch.ranks.trainers.common import die_with_parent

    die_with_parent()
    from launch.torchtools.untrusted import guard

    guard()  # before anything is loaded: every torch.load of this rank weights-only
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK in the environment says the same.
    argv = [a for a in argv if not a.startswith("--local_rank")]
    if len(argv) != 1:
        print("usage: python -m launch.ranks.train RUN_DIR", file=sys.stderr)
        return 2
    resolved = Resolved.load(RunDir.open(argv[0]).resolved)
    if resolved.recipe.run.mode == "commbench":  # the collective sweep needs no trainer, whatever the backend
        from launch.ranks import commbench

        return commbench.main(argv[0])
    from launch.ranks.trainers import loop

    return loop.main(argv[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
