"""`zeroxla train ARGS` in this process, with a signal sent to itself at one chosen moment of
the run: the exact moments a user's Ctrl-C or a scheduler's SIGTERM can land in, made
deterministic. The test runs this file as a subprocess and checks its exit status.

    python signal_driver.py MOMENT SIGNAL COUNT -- zeroxla train arguments...

MOMENT: step      during step 2 (the step then finishes)
        logged    after the last step is logged, before the final checkpoint is saved
        save      inside the final checkpoint's save
        report    inside the report, after the final save (the end-of-run sample)
COUNT: how many signals (2: the second one must stop the job at once).
The wrappers below (on `zeroxla.app.train.loop`'s names) are the test's only instrument; the
job's code is run unchanged.
"""

import os
import signal
import sys

from zeroxla.app import cli
from zeroxla.app.train import loop


def _send(signum, count):
    for _ in range(count):
        os.kill(os.getpid(), signum)


def _instrument(moment, signum, count, steps):
    if moment == "step":
        real_step = loop._step

        def step(r, state, k, progress):
            if k == 1:
                _send(signum, count)
            return real_step(r, state, k, progress)

        loop._step = step
    elif moment == "logged":
        real_save_final = loop.save_final

        def save_final(state, progress, save):
            _send(signum, count)
            return real_save_final(state, progress, save)

        loop.save_final = save_final
    elif moment == "save":
        real_save = loop.save_checkpoint

        def save_checkpoint(step, state, directory, *, metadata):
            if metadata["data_position"] == steps:
                _send(signum, count)
            return real_save(step, state, directory, metadata=metadata)

        loop.save_checkpoint = save_checkpoint
    elif moment == "report":
        real_sample = loop.final_sample

        def final_sample(*args, **kwargs):
            _send(signum, count)
            return real_sample(*args, **kwargs)

        loop.final_sample = final_sample
    else:
        raise SystemExit(f"unknown moment {moment!r}")


def main(argv):
    moment, signame, count, sep, *args = argv
    assert sep == "--"
    steps = int(args[args.index("--steps") + 1])
    _instrument(moment, getattr(signal, signame), int(count), steps)
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
