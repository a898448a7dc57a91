"""The bench's command line and picture: ``fusedce bench --help`` names every path ``--paths`` accepts,
the busy-machine warning reports the worst load sampled through the run, one color per path in every
panel, and value axes whose tick labels cannot run together (ms, MiB and the rest: test_bench_words.py)."""
import threading
import time

import pytest

from fusedce.tools import cli
from fusedce.tools.bench import colors, command, machine, paths, plot_axes, sweep


def test_help_lists_every_registered_path(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert set(paths.PATHS) == {name for names in command.PATH_NAMES.values() for name in names}
    for name in paths.PATHS:
        assert f" {name}," in text or f" {name}." in text or f" {name};" in text, name


def _sequence(values):
    """A fake load reader: the given values in turn, then the last one forever."""
    it = iter(values)
    last = [values[-1]]

    def read():
        try:
            last[0] = next(it)
        except StopIteration:
            pass
        return last[0]
    return read


def test_load_sampler_keeps_the_worst_load_of_the_run():
    loads = [0.5, 7.25, 11.0, 3.0, 2.2]     # a busy middle and a quiet end, as the run that hid it
    with machine.LoadSampler(interval=0.01, read=_sequence(loads)) as sampler:
        deadline = time.monotonic() + 10
        while len(sampler.samples) < len(loads) and time.monotonic() < deadline:
            time.sleep(0.01)
    summary = sampler.summary()
    assert sampler.samples[:len(loads)] == loads
    assert summary["load_average_1min_max"] == 11.0
    assert summary["load_samples"] == len(sampler.samples) >= len(loads) + 1   # + the sample at exit
    assert summary["load_sample_interval_s"] == 0.01
    assert not any(t.name == "fusedce-load-sampler" for t in threading.enumerate())
    warning = machine.busy_warning({"cpu_cores": 2, "load_average_1min": 2.2, **summary})
    assert warning is not None and "up to 11.0" in warning and "2 cores" in warning


def test_load_sampler_without_load_and_quiet_machine():
    with machine.LoadSampler(interval=0.01, read=lambda: None) as sampler:
        time.sleep(0.05)
    assert sampler.summary()["load_average_1min_max"] is None
    assert machine.busy_warning({"cpu_cores": 2, "load_average_1min": 3.0}) is not None   # old JSON
    assert machine.busy_warning({"cpu_cores": 2, "load_average_1min": 3.0,
                                 "load_average_1min_max": 1.5}) is None


def test_one_color_per_path_in_every_panel():
    # every registered path has its own group's color, and the sweep's paths the same as the top panels'
    for name in paths.PATHS:
        assert colors.path_color(name) != colors.OTHER, name
    assert colors.path_color("linear-fusedce-torch-tiled") != colors.path_color("linear-fusedce-torch")
    sweep_colors = {label: colors.path_color(path) for path, label in sweep.LABELS}
    assert len(set(sweep_colors.values())) == len(sweep_colors)
    legend = colors.legend_text()
    for color, _text, _names in colors.GROUPS:
        assert color.removeprefix("tab:") in legend


def test_value_axis_ticks_are_few_and_separated():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 2))
    ax.barh([0, 1], [80_000, 163_000])
    plot_axes.value_axis(ax)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    plt.close(fig)
    assert 2 <= len(labels) <= plot_axes.MAX_TICKS + 1
    assert any("," in label for label in labels), labels
