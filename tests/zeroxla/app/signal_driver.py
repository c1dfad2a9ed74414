"""`zeroxla train ARGS` in this process, with a signal sent to itself at one chosen moment of
the run: the exact moments a user's Ctrl-C or a scheduler's SIGTERM can land in, made
deterministic. The test runs this file as a subprocess and checks its exit status.

    python signal_driver.py MOMENT SIGNAL COUNT -- zeroxla train arguments...

MOMENT: step      during step 2 (the step then finishes)
        logged    after the last step is logged, before the final checkpoint is saved
        save      inside the final checkpoint's save
        report    inside the report, after the final save (the end-of-run sample)
COUNT: how many signals (2: the second one must stop the job at once).
The wrappers below (on the train job's and the runner's names) are the test's only instrument;
the job's code is run unchanged.
"""

import os
import signal
import sys

import zeroxla.checkpoint
from zeroxla.app import cli
from zeroxla.app.run import runner
from zeroxla.app.run.resume import RECORD_KEY
from zeroxla.app.jobs.train import job


def _send(signum, count):
    for _ in range(count):
        os.kill(os.getpid(), signum)


def _instrument(moment, signum, count, steps):
    if moment == "step":
        real_advance = job.TrainJob.advance

        def advance(self, done):
            if done == 1:
                _send(signum, count)
            return real_advance(self, done)

        job.TrainJob.advance = advance
    elif moment == "logged":
        real_save = runner._Run.save

        def save(self):
            if self.done == steps and self.saved_at != steps:
                _send(signum, count)
            return real_save(self)

        runner._Run.save = save
    elif moment == "save":
        real_checkpoint_save = zeroxla.checkpoint.save

        def checkpoint_save(directory, state, **kwargs):
            if kwargs["metadata"][RECORD_KEY]["done"] == steps:
                _send(signum, count)
            return real_checkpoint_save(directory, state, **kwargs)

        zeroxla.checkpoint.save = checkpoint_save
    elif moment == "report":
        real_sample = job.final_sample

        def final_sample(*args, **kwargs):
            _send(signum, count)
            return real_sample(*args, **kwargs)

        job.final_sample = final_sample
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
