"""The bench's words (issue 27 item 9): every table explains each of its columns under it (status,
Δloss as an absolute error, which way a ratio points), ratios point one way (stock / path) everywhere,
time is in ms in every table and panel, a path has one name in every table and in ``bench.png``, the
time method states the warm-up the harness really runs, the real input's loss block keeps its labels off
its numbers, and ``bench.png`` has the distillation and accuracy panels and the busy-machine warning.

Everything renders a synthetic result built with the bench's own row builders (``command._jobs``,
``sweep.jobs``, ``distill.jobs``), so that each row carries the labels the bench would give it; nothing
is measured but the one tiny in-process timing of the warm-up test."""
import dataclasses
import re
from argparse import Namespace

import pytest
import torch
from rich.console import Console
from rich.table import Table

from fusedce.tools.bench import command, distill, distill_soft, harness, paths, report, rl_precision, \
    shapes, sweep
from fusedce.tools.bench.inputs import Inputs
from fusedce.tools.bench.names import path_name
from versions import needs_torch_lce, needs_trl

MIB = 2 ** 20
CHUNKED = "linear-fusedce-torch"   # the path of the complaint's three names


def _main_rows() -> list[dict]:
    args = Namespace(device="cpu", repeats=1, warmup=0, interpret_rows=32)
    source = {"64x1000": {"kind": "synthetic", "hidden": 64, "vocab": 1000, "tokens": 256, "seed": 0}}
    jobs = command._jobs(shapes.parse_shapes("64x1000"), ["float32"], paths.plan("cpu"), source, args)
    rows = []
    for i, (row, _spec, _env) in enumerate(jobs):
        timed = row["mode"] == "timed"
        row.update(status="ok", loss=6.9 + 1e-7 * i, loss_ref=6.9, loss_abs_err=1e-7 * (i + 1),
                   grad_max_abs_err=1e-8, grad_rel_err=1e-6 * (i + 1), inputs={"rows": 256 if timed else 32})
        if timed:   # one linear row past 10 s: the old picture switched that panel to seconds
            row.update(time_ms=57282.0 if row["path"] == "linear-torch" else 841.0 + i, peak_bytes=(i + 1) * MIB,
                       floor_gbps=1.5)
            if row["path"] == "linear-torch":   # the three GEMMs' time, measured in the stock path's worker
                row.update(gemm_floor_ms=28641.0)
        rows.append(row)
    rows[-1].update(status="error", reason="RuntimeError: synthetic failure")
    return rows


def _sweep_section() -> dict:
    rows = []
    for row, _spec, _env in sweep.jobs(1, sweep.SHAPES[:1], (0.0,)):
        stock = row["path"] == "linear-torch"
        row.update(status="ok", peak_bytes=(400 if stock else 100) * MIB, time_ms=20_000.0 if stock else 10_000.0,
                   loss=10.0)
        rows.append(row)
    return {"method": {**sweep.METHOD, "time": sweep.METHOD["time"].format(repeats=1)}, "results": rows,
            "summary": sweep.summarize(rows), "wall_seconds": 100.0}


def _distill_rows(module, names) -> list[dict]:
    prepared = {"source_file": "-", "tokens": 8, "reference_file": "-"}
    rows = []
    for row, _spec, _env in module.jobs(prepared, "cpu", names=names):
        stock = row["baseline"]
        row.update(status="ok", loss=0.5, loss_rel_err=1e-7, grad_rel_err=1e-6,
                   time_ms=200.0 if stock else 100.0, peak_bytes=(400 if stock else 100) * MIB,
                   peak_over_floor=4.0 if stock else 1.0,
                   method={"time": "median of 2 fwd+bwd (the first is the peak-memory run), time.perf_counter"})
        rows.append(row)
    return rows


def _distillation() -> dict:
    meta = {"beta": 0.5, "temperature": 1.0, "tokens": 8, "scored_tokens": 6, "hidden_size": 64, "vocab_size": 1000,
            "teacher": "t", "student": "s", "target": "q"}
    section = distill.summarize({"input": meta, "reference_loss": 0.5},
                                _distill_rows(distill, ["distill-stock", "distill-fusedce-chunked"]), 3.0)
    section["soft_ce"] = distill_soft.summarize(
        {"input": meta, "reference_loss": 0.5},
        _distill_rows(distill_soft, ["softce-stock", "softce-fusedce-chunked"]), 2.0)
    return section


def _rl() -> dict:
    rows = [{"path": name, "label": text, "what": text, "status": "ok", "log_probs_max_abs_err": 1e-3,
             "entropy_max_abs_err": None if name == "torch-lce" else 2e-3, "fwd_bwd_s": 12.5,
             "time_ms": 12_500.0, "peak_bytes": 10 * MIB} for name, text in rl_precision.PATHS.items()]
    return {"status": "ok", "results": rows, "placements_changed": {"fusedce": 0}, "placements": 12, "row": 3,
            "input": {"tokens": 8, "scored_tokens": 6, "hidden_size": 64, "vocab_size": 1000, "dtype": "bfloat16",
                      "reference_rows": 6, "threads": 2},
            "method": {"error": "max |x - x64| over the reference rows", "time": "one fwd+bwd after 1 warm-up",
                       "memory": "peak beyond the inputs", "placements": "batch sizes"}}


def synthetic_report(busy: bool) -> dict:
    args = Namespace(device="cpu", repeats=1, warmup=0)
    rows = _main_rows()
    load = {"load_average_1min": 9.0 if busy else 0.5, "load_average_1min_max": 9.0 if busy else 0.5,
            "load_average_1min_mean": 6.0 if busy else 0.5, "load_samples": 3, "load_sample_interval_s": 5.0}
    return {
        "device": "cpu", "wall_seconds": 300.0,
        "machine": {"name": "test CPU (2 cores)", "cpu": "test CPU", "cpu_cores": 2, "peak_gbps": None, **load},
        "methods": command._methods(rows, paths.plan("cpu"), args),
        "inputs": {"real": {"tokens": 256, "scored_tokens": 200, "hidden_size": 64, "vocab_size": 1000,
                            "loss_rtol": 1e-3, "model_loss": 2.5, "reproduced_loss": 2.5, "loss_rel_diff": 1e-8,
                            "recheck": [{"op": "linear_cross_entropy", "what": "torch F.linear_cross_entropy (fp32)",
                                         "loss": 2.5, "rel_diff": 1e-7}]}},
        "results": rows,
        "goals": [{"shape": "64x1000", "dtype": "float32",
                   "goals": {"g": {"want": "fusedce chunked faster", "met": True, "detail": "1 ms"}}}],
        "sweep": _sweep_section(), "distillation": _distillation(), "rl_precision": _rl(), "failures": [],
    }


def _printed(report_dict: dict, monkeypatch) -> tuple[list[Table], str]:
    """Every rich Table the bench prints for ``report_dict`` (main, goals, sweep, distillation, RL), and
    the whole text."""
    tables = []
    original = Console.print

    def keep(self, *objects, **kwargs):
        tables.extend(o for o in objects if isinstance(o, Table))
        return original(self, *objects, **kwargs)
    monkeypatch.setattr(Console, "print", keep)
    console = Console(record=True, width=400)
    report.print_report(report_dict, console)   # every table, the distillation and RL ones included
    return tables, console.export_text()


def _headers(table: Table) -> list[str]:
    return [" ".join(str(column.header).split()) for column in table.columns]


def _cells(table: Table, header: str) -> list[str]:
    return [str(cell) for cell in table.columns[_headers(table).index(header)]._cells]


def _legend(table: Table) -> dict:
    """``{header: meaning}`` from the ``"header: meaning"`` lines of a table's caption."""
    out = {}
    for line in str(table.caption or "").splitlines():
        head, sep, meaning = line.partition(": ")
        if sep:
            out[head.strip()] = meaning
    return out


def test_every_column_of_every_table_is_explained_under_it(monkeypatch):
    tables, _text = _printed(synthetic_report(busy=False), monkeypatch)
    assert len(tables) >= 6     # main (2 ops), goals, sweep, GKD, soft CE, RL
    for table in tables:
        legend = _legend(table)
        missing = [h for h in _headers(table) if h not in legend]
        assert not missing, (str(table.title).splitlines()[0], missing)


def test_every_table_has_a_status_column_defined(monkeypatch):
    tables, _text = _printed(synthetic_report(busy=False), monkeypatch)
    measured = [t for t in tables if "path" in _headers(t)]
    assert measured and all("status" in _headers(t) for t in measured)
    for table in measured:
        assert {"ok", "error", "unavailable"} <= set(re.findall(r"\w+", _legend(table).get("status", "")))


def test_delta_loss_is_said_to_be_absolute(monkeypatch):
    tables, _text = _printed(synthetic_report(busy=False), monkeypatch)
    deltas = [(t, h) for t in tables for h in _headers(t) if h.startswith("Δloss")]
    assert deltas
    for table, header in deltas:
        assert "absolute" in _legend(table).get(header, ""), header


def test_ratios_point_one_way_stock_over_path(monkeypatch):
    # the fusedce chunked rows are twice as fast and four times leaner than stock in the sweep and both
    # distillation tables: each ratio reads 2x / 4x, in columns named stock/path, explained as a speed-up
    data = synthetic_report(busy=False)
    tables, _text = _printed(data, monkeypatch)
    ratio_tables = [t for t in tables if any("stock" in h and h != "stock" for h in _headers(t))]
    sections = (data["sweep"]["results"], data["distillation"]["results"], data["distillation"]["soft_ce"]["results"])
    assert len(ratio_tables) == len(sections)      # sweep, GKD, soft CE, in that order
    for table, rows in reversed(list(zip(ratio_tables, sections))):   # the distillation tables first
        headers = _headers(table)
        assert "vs stock" not in headers and {"stock/path time", "stock/path memory"} <= set(headers), headers
        fused = next(i for i, r in enumerate(rows) if r["path"] in (CHUNKED, "distill-fusedce-chunked",
                                                                     "softce-fusedce-chunked"))
        assert _cells(table, "stock/path time")[fused].startswith("2.0")
        assert _cells(table, "stock/path memory")[fused].startswith("4.0")
        assert "> 1 means the path" in _legend(table)["stock/path time"]


def test_one_time_unit_in_every_table_and_panel(monkeypatch, tmp_path):
    tables, _text = _printed(synthetic_report(busy=False), monkeypatch)
    for table in tables:
        for h in _headers(table):
            assert not re.search(r"(^|\s)s$", h) and "(s)" not in h, h   # no column in seconds
    fig = _figure(synthetic_report(busy=False), monkeypatch, tmp_path)
    time_axes = [ax.get_xlabel() for ax in fig.axes if "time" in ax.get_xlabel()]
    assert len(time_axes) >= 3 and all("(ms)" in label for label in time_axes), time_axes


def test_one_name_per_path_in_tables_and_picture(monkeypatch, tmp_path):
    data = synthetic_report(busy=False)
    tables, _text = _printed(data, monkeypatch)
    main = next(t for t in tables if "linear_cross_entropy: LM head" in str(t.title))
    linear = [r for r in data["results"] if r["op"] == "linear_cross_entropy"]
    in_main = _cells(main, "path")[[r["path"] for r in linear].index(CHUNKED)]
    swept = next(t for t in tables if str(t.title).startswith("memory sweep"))
    in_sweep = _cells(swept, "path")[[r["path"] for r in data["sweep"]["results"]].index(CHUNKED)]
    assert in_main == in_sweep, (in_main, in_sweep)
    fig = _figure(data, monkeypatch, tmp_path)
    ticks = {t.get_text() for ax in fig.axes for t in ax.get_yticklabels()}
    legends = {t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()}
    assert any(re.match(re.escape(in_main) + r"\s+(fp32|float32)\b", t) for t in ticks), (in_main, ticks)
    assert in_main in legends, (in_main, legends)
    # the distillation tables' fusedce chunked row carries the same words (the op is in their titles)
    gkd = next(t for t in tables if str(t.title).startswith("distillation (GKD"))
    assert any(in_main.startswith(name) for name in _cells(gkd, "path") if name.startswith("fusedce")), in_main


def test_time_method_states_the_warm_up_really_run():
    # timed on CPU with --warmup 0: the peak-memory run is a full untimed fwd+bwd before the timing
    calls = []
    base = paths.PATHS["torch"]

    def forward(inputs):
        calls.append(inputs.logits.shape[0])
        return base.forward(inputs)
    path = dataclasses.replace(base, forward=forward)
    gen = torch.Generator().manual_seed(0)
    inputs = Inputs(target=torch.randint(0, 50, (64,), generator=gen),
                    logits=torch.randn(64, 50, generator=gen).requires_grad_(True))
    repeats = 2
    result = harness.measure(path, inputs, "cpu", "timed", repeats=repeats, warmup=0)
    full = calls.count(64)
    said = re.search(r"after (\d+)\b", result["method"]["time"])
    assert said, result["method"]["time"]
    assert int(said.group(1)) == full - repeats == 1, (result["method"]["time"], calls)
    # and the table's legend prints that method, not its own
    assert command._methods([], paths.plan("cpu", ["torch"]), Namespace(device="cpu", repeats=repeats, warmup=0)
                            )["time"]["cross_entropy"] == result["method"]["time"]


def test_loss_block_labels_never_run_into_numbers(monkeypatch):
    _tables, text = _printed(synthetic_report(busy=False), monkeypatch)
    start = text.index("SmolLM2-135M loss on this batch")
    block = text[start:].splitlines()[1:4]
    assert len(block) == 3, block
    for line in block:
        assert re.fullmatch(r"  \S.*\S {2,}\d+\.\d{6}( {2}\(\d\.\de[+-]\d\d\))?\s*", line), line


def _figure(data: dict, monkeypatch, tmp_path):
    """The matplotlib figure ``report.write_png`` saves (caught at ``savefig``)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    caught = []
    original = Figure.savefig

    def keep(self, *args, **kwargs):
        caught.append(self)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", keep)
    report.write_png(data, tmp_path)
    assert (tmp_path / "bench.png").stat().st_size > 0 and len(caught) == 1
    return caught[0]


def _all_text(fig) -> str:
    return "\n".join([fig._suptitle.get_text() if fig._suptitle else ""] + [t.get_text() for t in fig.texts])


@pytest.mark.parametrize("busy", [True, False])
def test_picture_shows_distillation_accuracy_and_the_busy_warning(monkeypatch, tmp_path, busy):
    fig = _figure(synthetic_report(busy=busy), monkeypatch, tmp_path)
    titles = [ax.get_title() for ax in fig.axes]
    assert any(t.startswith("distillation") and "ms" in t for t in titles), titles
    assert any(t.startswith("distillation") and "MiB" in t for t in titles), titles
    accuracy = [ax for ax in fig.axes if ax.get_title().startswith("accuracy vs float64")]
    assert len(accuracy) == 2 and all(ax.get_xscale() == "log" for ax in accuracy), titles
    assert any("RL precision" in t for t in titles), titles
    assert ("machine was busy" in _all_text(fig)) == busy


def test_the_pictures_color_legend_names_only_the_paths_it_draws(monkeypatch, tmp_path):
    """The color sentence in the title lists the colors of the report's paths, not every path the bench
    knows (a run without the RL table said "brown: fp32 head copy")."""
    report = synthetic_report(busy=False)
    report.pop("rl_precision", None)
    fig = _figure(report, monkeypatch, tmp_path)
    title = fig._suptitle.get_text()
    assert "fp32 head copy" not in title and "gray: stock" in title, title


@needs_trl
@needs_torch_lce
def test_every_fact_a_peer_row_adds_is_explained():
    """The facts printed under the main table (``extra``: TRL's log-prob check, what torch's ``"auto"``
    options resolved to) each get a legend line (before: bare ``fp64_rows=179``)."""
    from fusedce.tools.bench import legend, peers
    from fusedce.tools.bench.inputs import Inputs
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, 50, (24,), generator=g)
    target[::3] = -100
    inputs = Inputs(target=target, hidden=torch.randn(24, 8, generator=g).requires_grad_(),
                    weight=torch.randn(50, 8, generator=g).requires_grad_())
    keys = list(peers.trl_log_probs_check(inputs)) + list(peers.torch_lce_resolved(inputs))
    assert keys and all(key in legend.EXTRA for key in keys), set(keys) - set(legend.EXTRA)


def test_the_linear_table_divides_every_time_by_the_gemm_floor(monkeypatch):
    """Issue 32: "x GEMMs" = the row's ms / the three products' ms of the same shape and dtype (here 2x for
    stock), only in the linear table (the cross-entropy on logits has no such floor)."""
    tables, _ = _printed(synthetic_report(busy=False), monkeypatch)
    linear = [t for t in tables if "linear_cross_entropy: LM head" in str(t.title)]
    plain = [t for t in tables if "cross_entropy on the logits" in str(t.title)]
    assert linear and plain and all("x GEMMs" not in _headers(t) for t in plain)
    table = linear[0]
    ratios = dict(zip(_cells(table, "path"), _cells(table, "x GEMMs")))
    times = dict(zip(_cells(table, "path"), _cells(table, "ms")))
    assert ratios[path_name("linear-torch")] == "2.00x"
    chunked = path_name(CHUNKED)
    assert ratios[chunked] == f"{float(times[chunked]) / 28641.0:.2f}x"


def test_the_wall_time_is_the_last_line_after_every_table(monkeypatch):
    """``bench wall time`` closes the output: printed after the distillation and RL tables, not between."""
    tables, text = _printed(synthetic_report(busy=False), monkeypatch)
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines[-1].startswith("bench wall time 300 s"), lines[-3:]
    titles = " ".join(str(t.title) for t in tables)
    assert "distillation" in titles and text.index("distillation") < text.index("bench wall time")


AVX2_ONLY = {"amx": False, "avx512_bf16": False, "bf16_gemm_mode": False, "avx2": True, "avx512f": False}


def test_every_table_header_names_the_cpus_bf16_capabilities(monkeypatch):
    """Issue 47 item 3: the bf16 rows, ``x GEMMs`` and the RL-precision figures depend on AMX / AVX512-BF16
    and on whether the bf16 GEMM mode engages; every table's title says which (and bench.json holds them)."""
    data = synthetic_report(busy=False)
    data["machine"]["cpu_bf16"] = AVX2_ONLY
    tables, _text = _printed(data, monkeypatch)
    assert len(tables) >= 6
    for table in tables:
        assert "AVX2 only (no AMX, no AVX512-BF16); bf16 GEMM mode off" in str(table.title), table.title
    amx = dict(AVX2_ONLY, amx=True, avx512_bf16=True, bf16_gemm_mode=True, avx512f=True)
    from fusedce.tools.bench.machine import capabilities_text
    assert capabilities_text({"cpu_bf16": amx}).startswith("AMX + AVX512-BF16; bf16 GEMM mode on")


def test_the_saved_machine_holds_the_capabilities_and_the_cores():
    from fusedce.core.bf16_products import cpu_bf16_capabilities
    from fusedce.tools.bench import machine
    described = machine.describe("cpu")
    facts = {k: v for k, v in cpu_bf16_capabilities().items() if k != "cpu"}
    assert described["cpu_bf16"].items() >= facts.items() and described["cpu_cores"] >= 1
    assert {"amx", "avx512_bf16", "bf16_gemm_mode"} <= set(described["cpu_bf16"])


def test_gbps_only_where_it_means_something(monkeypatch):
    """Issue 47 item 8: GB/s over the byte floor says nothing for the compute-bound LM head on a CPU; it is
    shown for the memory-bound cross_entropy table, and for every op on a GPU."""
    data = synthetic_report(busy=False)
    tables, _text = _printed(data, monkeypatch)
    linear = next(t for t in tables if "linear_cross_entropy: LM head" in str(t.title))
    plain = next(t for t in tables if "cross_entropy on the logits" in str(t.title))
    assert "GB/s" not in _headers(linear) and "GB/s" in _headers(plain)
    data["device"] = "cuda"
    data["machine"].update(gpu="NVIDIA H100 80GB HBM3", peak_gbps=3350)
    linear_gpu = report.table(data, "64x1000", "linear_cross_entropy")
    assert "GB/s" in _headers(linear_gpu)


def test_the_pictures_title_stays_above_the_panels(monkeypatch, tmp_path):
    """Issue 47 item 8: the busy-machine warning (the title's last line) overlapped the top panels' titles."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    fig = _figure(synthetic_report(busy=True), monkeypatch, tmp_path)
    canvas = FigureCanvasAgg(fig)   # the closed figure's canvas is a bare one: draw it as savefig did
    canvas.draw()
    renderer = canvas.get_renderer()
    top = fig._suptitle.get_window_extent(renderer)
    for ax in fig.axes:   # at least half a title line (9 pt) of room between the two: they touched
        panel = ax.title.get_window_extent(renderer)
        assert (top.y0 - panel.y1) * 72 / fig.dpi >= 4.5, (ax.get_title(), panel, top)


def test_the_sweeps_time_panel_is_on_a_log_axis(monkeypatch, tmp_path):
    """One 210 s row flattened every other bar of the sweep's time panel (linear axis)."""
    fig = _figure(synthetic_report(busy=False), monkeypatch, tmp_path)
    [time_panel] = [ax for ax in fig.axes if ax.get_title().startswith("memory sweep") and "time" in ax.get_title()]
    assert time_panel.get_xscale() == "log"
