"""Schedule pictures: a hand-checked text table and a PNG file."""

from zeroxla.pipeline import GPipeSchedule, TrainSchedule, ZBH1Schedule, schedule_table
from zeroxla.pipeline.timeline import plot_timeline, render_png, render_text


def test_render_text_1f1b_two_by_two():
    # 1F1B: stage s runs F(m) at step 2m + s and B(m) at 2m + 2S - 1 - s; S = 2, M = 2.
    assert render_text(schedule_table(TrainSchedule, 2, 2)) == (
        "TrainSchedule  micro_batches=2  stages=2  bubble=0.333\n"
        "step     0  1  2  3  4  5\n"
        "stage 0  F0 .  F1 B0 .  B1\n"
        "stage 1  .  F0 B0 F1 B1 .\n")


def test_render_text_gpipe_two_by_two():
    assert render_text(schedule_table(GPipeSchedule, 2, 2)) == (
        "GPipeSchedule  micro_batches=2  stages=2  bubble=0.333\n"
        "step     0  1  2  3  4  5\n"
        "stage 0  F0 F1 .  .  B0 B1\n"
        "stage 1  .  F0 F1 B0 B1 .\n")


def test_render_text_aligns_wide_cells():
    lines = render_text(schedule_table(TrainSchedule, 12, 3)).splitlines()
    header, rows = lines[1], lines[2:]
    assert len(rows) == 3 and "F11" in rows[0] and "B10" in rows[2]
    # Every row's cells start at the header's columns.
    starts = [i for i in range(len(header)) if header[i] != " " and header[i - 1] == " "]
    for row in rows:
        assert all(row[i] != " " for i in starts if i < len(row))


def test_render_png(tmp_path):
    path = tmp_path / "timeline.png"
    render_png(schedule_table(TrainSchedule, 8, 4), path)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


def test_plot_timeline_draws_on_given_axes():
    from matplotlib.figure import Figure

    ax = Figure().add_subplot()
    table = schedule_table(TrainSchedule, 4, 2)
    assert plot_timeline(table, ax) is ax
    assert len(ax.patches) == 2 * 4 * 2                       # one cell per pass
    assert "bubble=0.200" in ax.get_title()
    assert plot_timeline(table).figure is not None            # makes its own figure


def test_render_text_zb_h1_two_by_two():
    # ZB-H1: 1F1B's F and B steps, each weight-gradient pass W in the stage's next free step.
    assert render_text(schedule_table(ZBH1Schedule, 2, 2)) == (
        "ZBH1Schedule  micro_batches=2  stages=2  bubble=0.143\n"
        "step     0  1  2  3  4  5  6\n"
        "stage 0  F0 .  F1 B0 W0 B1 W1\n"
        "stage 1  .  F0 B0 F1 B1 W0 W1\n")


def test_plot_timeline_draws_weight_passes_in_their_own_colour():
    from matplotlib.figure import Figure

    ax = plot_timeline(schedule_table(ZBH1Schedule, 4, 2), Figure().add_subplot())
    assert len(ax.patches) == 3 * 4 * 2                       # F, B and W of every micro-batch
    colours = {p.get_facecolor() for p in ax.patches}
    assert len(colours) == 3
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["forward", "backward (input gradient)", "weight gradient"]
