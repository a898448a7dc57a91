"""Issue 47 item 2: a time verdict rests on 2-3 noisy runs, so it carries the spread it rests on and says
"inconclusive" where that spread covers the goal (a sweep row whose times swung 1.5-2x under load printed
``time MISSED``, which read as a regression). Judged on made-up runs: nothing is measured."""
from fusedce.tools.bench import goals, report_sweep, sweep
from fusedce.tools.bench.goals import verdict_mark

MIB = 2 ** 20


def test_a_ratio_is_judged_on_its_interval_not_its_medians():
    # medians 1000 / 1050 = 0.95 < 1/1.10? no: 0.952 >= 0.909, but the runs swing: 900-1400 vs 1000-1100
    judged = goals.ratio_verdict([900.0, 1400.0], [1000.0, 1100.0], 1 / 1.10)
    assert judged["verdict"] == "inconclusive" and judged["met"] is None
    assert judged["low"] == 900 / 1100 and judged["high"] == 1400 / 1000 and judged["runs"] == [2, 2]
    assert goals.ratio_verdict([2000.0, 2100.0], [1000.0, 1100.0], 1.0, strict=True)["verdict"] == "met"
    assert goals.ratio_verdict([500.0, 600.0], [1000.0, 1100.0], 1.0, strict=True)["verdict"] == "MISSED"
    # the threshold itself: strict (> 1) is not met by a ratio of exactly 1 everywhere
    assert goals.ratio_verdict([1000.0], [1000.0], 1.0, strict=True)["verdict"] == "MISSED"
    text = goals.interval_text(judged)
    assert "0.82-1.40x" in text and "2 x 2 runs" in text, text


def _row(label, path, times, peak_mib):
    return {"shape": "smollm2", "tokens": 4096, "hidden": 576, "vocab": 49152, "ignore_fraction": 0.0,
            "label": label, "path": path, "status": "ok", "loss": 10.0, "peak_bytes": peak_mib * MIB,
            "time_ms": sorted(times)[len(times) // 2], "times_ms": times}


def test_the_sweeps_time_verdict_says_inconclusive_with_its_range():
    """Stock 1000-1050 ms, chunked 980-1400 ms: the medians' ratio misses 1/1.10 (1050 / 1400 = 0.75 by
    medians of the upper runs) but the interval 0.71-1.07x covers it."""
    rows = [_row("stock", "linear-torch", [1000.0, 1050.0], 800), _row("fused", "linear-fusedce-torch",
                                                                      [1400.0, 980.0], 100)]
    [entry] = sweep.summarize(rows)
    time = entry["targets"]["time"]
    assert time["verdict"] == "inconclusive" and time["met"] is None
    lines = report_sweep._targets(entry)
    line = next(text for text in lines if "time" in text)
    assert "inconclusive" in line and "0.71-1.07x" in line and "2 x 2 runs" in line, line
    assert "MISSED" not in line


def test_the_peer_goal_carries_each_peers_interval():
    chunked = {"status": "ok", "time_ms": 1000.0, "times_ms": [950.0, 1000.0, 1300.0], "peak_bytes": MIB}
    peer = {"status": "ok", "time_ms": 1100.0, "times_ms": [1050.0, 1100.0, 1150.0], "peak_bytes": 2 * MIB}
    goal = goals.versus_peers(chunked, None, {"torch LCE": peer}, {})["chunked_faster"]
    assert goal["verdict"] == "inconclusive" and goal["met"] is None
    assert "950-1300 over 3 runs" in goal["detail"] and "0.81-1.21x over 3 x 3 runs" in goal["detail"], goal
    assert "inconclusive" in verdict_mark(goal)
    clear = dict(peer, times_ms=[1400.0, 1500.0, 1600.0], time_ms=1500.0)
    assert goals.versus_peers(chunked, None, {"torch LCE": clear}, {})["chunked_faster"]["verdict"] == "met"
