"""`zeroxla.analysis.schedule` reads what a scheduled GPU program overlaps. The module below is
written by hand in XLA:GPU's printed form (an all-gather pair with a cuBLAS GEMM between its
start and done, a reduce-scatter wrapped in async-start / async-done with nothing between, a
synchronous all-reduce); the expected counts are read off it by eye."""

from zeroxla.analysis.schedule import async_pairs, summary, sync_collectives

SCHEDULED = """\
HloModule m, is_scheduled=true, num_partitions=2

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%rs_body (p: f32[8]) -> f32[4] {
  %p = f32[8]{0} parameter(0)
  ROOT %rs = f32[4]{0} reduce-scatter(f32[8]{0} %p), channel_id=2, replica_groups={{0,1}}, dimensions={0}, to_apply=%add
}

ENTRY %main (x: f32[4], w: f32[8,8]) -> (f32[8], f32[4]) {
  %x = f32[4]{0} parameter(0)
  %w = f32[8,8]{1,0} parameter(1)
  %ag = (f32[4]{0}, f32[8]{0}) all-gather-start(f32[4]{0} %x), channel_id=1, replica_groups={{0,1}}, dimensions={0}
  %mm = f32[8,8]{1,0} custom-call(f32[8,8]{1,0} %w, f32[8,8]{1,0} %w), custom_call_target="__cublas$gemm"
  %agd = f32[8]{0} all-gather-done((f32[4]{0}, f32[8]{0}) %ag)
  %rss = ((f32[8]{0}), f32[4]{0}) async-start(f32[8]{0} %agd), calls=%rs_body
  %rsd = f32[4]{0} async-done(((f32[8]{0}), f32[4]{0}) %rss)
  %ar = f32[4]{0} all-reduce(f32[4]{0} %rsd), channel_id=3, replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (f32[8]{0}, f32[4]{0}) tuple(f32[8]{0} %agd, f32[4]{0} %ar)
}
"""


def test_pairs_and_what_runs_between_them():
    pairs = async_pairs(SCHEDULED)
    assert [(p.kind, p.start, p.done, p.compute_between, p.matmuls_between) for p in pairs] == [
        ("all-gather", "ag", "agd", 1, 1), ("reduce-scatter", "rss", "rsd", 0, 0)]


def test_summary_counts_async_overlapped_and_sync_collectives_by_kind():
    got = summary(async_pairs(SCHEDULED), sync_collectives(SCHEDULED))
    assert got["all-gather"] == {"async": 1, "overlapping_a_matmul": 1, "nothing_between": 0,
                                 "done_not_in_computation": 0, "sync": 0}
    assert got["reduce-scatter"]["nothing_between"] == 1
    assert got["all-reduce"] == {"async": 0, "overlapping_a_matmul": 0, "nothing_between": 0,
                                 "done_not_in_computation": 0, "sync": 1}


def test_a_start_whose_done_is_not_in_its_computation_is_counted_as_such():
    cut = "\n".join(line for line in SCHEDULED.splitlines() if "%agd = " not in line)
    cut = cut.replace("f32[8]{0} %agd", "f32[8]{0} %x").replace(
        "tuple(f32[8]{0} %x", "tuple(f32[8]{0} %x")
    pairs = async_pairs(cut)
    assert pairs[0].done is None and pairs[0].matmuls_between == 1
