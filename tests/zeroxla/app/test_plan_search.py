"""`zeroxla plan --max-seq-len`'s report searches its settings at once (`max_seq_len_report`'s
workers): each setting's answer is the one a search of that setting alone finds, compile by
compile, in one thread (`plan_memory` and the doubling bisection `largest_fitting`)."""

import re

import pytest

import zeroxla
from zeroxla import models
from zeroxla.analysis.planner import largest_fitting, plan_memory, sweep_settings
from zeroxla.app.jobs.plan import PlanSettings, max_seq_len_report

CHUNK = 16          # the config's own mlp_chunk: the sweep tries it, None and 4096 (untiled at
                    # T <= 4096)


def _config():
    return models.LlamaConfig.tiny().replace(mlp_chunk=CHUNK)


def _answers(report: str) -> dict[str, int]:
    """{setting label: T} from the report's lines."""
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"^  (remat=\S.*?)\s+T = (\d+)", report, re.MULTILINE)}


@pytest.fixture(scope="module")
def alone():
    """`alone(setting, t)`: the peak bytes of that setting's own `plan_memory` at T = t, compiled
    in this thread, once per module (the device memory does not enter the peak): both tests'
    references compile T = 64 under remat=full."""
    config, mesh, peaks = _config(), zeroxla.make_mesh(1, 8), {}

    def peak(setting, t):
        if (setting, t) not in peaks:
            peaks[setting, t] = plan_memory(config, mesh, seq_len=t, device_memory=0,
                                            remat=setting.remat, fields=dict(setting.fields)).peak
        return peaks[setting, t]
    return peak


@pytest.mark.slow    # six planner compiles (7 s); the search itself is test_planner's, daily
def test_settings_searched_at_once_answer_as_each_compiled_alone(alone):
    """Three settings (mlp_chunk 16, None, 4096) two at a time, one length each
    (--search-limit = --granularity): each answer is the length if that setting's own compile,
    in this thread, fits (the memory is set between the tiled and the untiled peak), else 0;
    every setting reports the length, and None and 4096 (both untiled at T = 64: one program,
    tests/zeroxla/analysis/test_planner.py) compile it once between them."""
    config, mesh = _config(), zeroxla.make_mesh(1, 8)
    settings, _ = sweep_settings(config, ("full",))
    peaks = [alone(s, 64) for s in settings]
    assert peaks[0] != peaks[1]                         # tiled MLP at T = 64 vs untiled
    plan = PlanSettings(model="tiny", remat=("full",), granularity=64, search_limit=64,
                        device_memory=(peaks[0] + peaks[1]) // 2)
    said = []
    report = max_seq_len_report(config, mesh, plan, "bfloat16", say=said.append, workers=2)
    want = {s.label: 64 if p <= plan.device_memory else 0 for s, p in zip(settings, peaks)}
    assert _answers(report) == want and set(want.values()) == {0, 64}, report
    assert sum("T=64 peak" in line for line in said) == 3, said
    assert sum("T=64 peak" in line and "compiled in" in line for line in said) == 2, said
    assert said[-1].startswith("  2 compiles, 2 setting(s) at a time"), said
    assert said[-1].endswith("(1 of the 3 lengths tried built a program another setting "
                             "compiled: not compiled again)"), said


@pytest.mark.slow
def test_the_report_finds_what_the_bisection_finds_for_every_setting(alone):
    """Six settings (remat full / offload x mlp_chunk 16 / None / 4096) searched two at a time over
    T <= 256 in steps of 16, against the doubling bisection of each setting's `plan_memory`
    alone: the same T for every setting, and a memory that cuts inside the range."""
    config, mesh = _config(), zeroxla.make_mesh(1, 8)
    plan = PlanSettings(model="tiny", remat=("full", "offload"), granularity=16,
                        search_limit=256, device_memory=3_000_000)
    settings, _ = sweep_settings(config, plan.remat)
    want = {s.label: largest_fitting(lambda t, s=s: alone(s, t) <= plan.device_memory,
                                     granularity=16, limit=256) for s in settings}
    assert all(0 < t < 256 for t in want.values()), want
    report = max_seq_len_report(config, mesh, plan, "bfloat16", workers=2)
    assert _answers(report) == want, report
