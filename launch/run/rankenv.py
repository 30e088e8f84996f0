"""What the launcher and its ranks agree on besides argv: the environment variables the launcher sets for the ranks
to read, and the signal behind one of them. Its own module so that rank code reads the names without importing the
launcher (launch/run/launcher.py sets them, launch/ranks/trainers read them)."""
import signal

# The checkpoint run.sh chose (and checked, and told the user of) for the ranks to continue; empty: start fresh.
# Unset (a launch by hand: accelerate), rank 0 chooses itself and says so.
RESUME_PINNED = "LAYOUTLAB_RESUME"
# The signal that asks a run to save a checkpoint at its next step boundary and end: SLURM's warning before the time
# limit, which launch/slurm.sbatch passes to every node's launcher (this CLI). The launcher tells its ranks by creating
# the file STOP_REQUEST names, in a private folder of its node; the ranks agree on the step through a collective.
STOP_SIGNAL = signal.SIGUSR1
STOP_REQUEST = "LAYOUTLAB_STOP_REQUEST"
