"""The benchmarks' shared output (benchmarks/report.py): what a run leaves besides its printed table."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import report  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def test_save_writes_the_results_as_json_and_the_figure_as_png(tmp_path):
    fig, (sizes, bars) = report.figure("a benchmark", 2)
    report.draw_sizes(sizes, "cp", {"offload on": {1024: 0.002, 1 << 20: 0.003},
                                    "offload=off": {1024: 0.002, 1 << 20: 0.02}})
    report.draw_bars(bars, "steps", {"create": {"offloadfs": 3.3, "smbnetfs": 3.4}, "rm -rf": {"offloadfs": 1.5}},
                     "seconds", log=True)
    report.save(tmp_path / "out", "bench", {"rows": [1, 2]}, fig)
    record = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert record["benchmark"] == "bench"
    assert record["results"] == {"rows": [1, 2]}
    assert record["measured"].endswith("+00:00")
    assert record["commit"]  # this checkout's
    assert (tmp_path / "out" / "bench.png").read_bytes().startswith(PNG)


def test_progress_inside_progress_is_one_display(capsys):
    with report.progress("outer", total=2) as outer:
        with report.progress("inner", total=1) as inner:
            inner.done("one")
        outer.done()
        outer.say("a line above the bar")
        outer.done()
    assert report._live is None
    assert capsys.readouterr().out == ""  # stdout keeps only the tables


def test_sizes_are_labelled_in_binary_units():
    assert [report.size_label(n) for n in (512, 1024, 16 << 20, 1 << 30)] == ["512 B", "1 KiB", "16 MiB", "1 GiB"]
