"""pytest-xdist's `--dist loadfile` scheduling, less its deadlock after a worker dies.

When a worker dies (an abort in native code, or pytest-timeout ending a hung test), pytest-xdist
3.8.0 starts a replacement and puts the dead worker's whole workload back on the queue, the files
it had finished included (pytest-dev/pytest-xdist#1378, open). A finished file handed out again
is an empty work unit: the worker it goes to gets no test, so it never reports one, and since a
worker is only given more work when it reports a test, the run ends with both workers idle,
waiting for work that never comes, until CI's cut. And a worker runs a test only once it holds
the next one (or the order to stop): a replacement given a file of one test waits the same way
(pytest-dev/pytest-xdist#1327). Here a dead worker's finished files stay finished, and a worker
left with fewer than two tests to run is given more, or the order to stop when none is left.

A pytest plugin (tests/conftest.py's `pytest_plugins`) through pytest-xdist's own hook,
`pytest_xdist_make_scheduler`; without a dead worker the order files are handed out in is
pytest-xdist's.
"""

import pytest
from xdist.scheduler import LoadFileScheduling


class LoadFileSurvivingACrash(LoadFileScheduling):
    """`--dist loadfile` that goes on after a worker dies (the module docstring says how)."""

    def remove_node(self, node):
        """Forgets the files `node` finished before its workload goes back on the queue; returns
        the test it died in (None at a normal shutdown), as pytest-xdist's does."""
        workload = self.assigned_work.get(node, {})
        for scope in [scope for scope, tests in workload.items() if all(tests.values())]:
            del workload[scope]
        return super().remove_node(node)

    def _reschedule(self, node):
        """pytest-xdist's, then more files while `node` holds fewer than two tests, and the order
        to stop once the queue is empty (which pytest-xdist's gives on entry only)."""
        super()._reschedule(node)
        if node.shutting_down:
            return
        while self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
            self._assign_work_unit(node)
        if not self.workqueue:
            node.shutdown()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """LoadFileSurvivingACrash for `--dist loadfile`; pytest-xdist's own for the others."""
    if config.getvalue("dist") == "loadfile":
        return LoadFileSurvivingACrash(config, log)
    return None
