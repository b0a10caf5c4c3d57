"""Progress output: a bar redrawn in place on a terminal; plain, occasional lines anywhere else."""

from __future__ import annotations

import io

from quantd_client._progress import ProgressBar, Reporter


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_terminal_gets_plain_lines_at_each_quarter() -> None:
    out = io.StringIO()
    bar = ProgressBar("upload m.safetensors", 4096, stream=out)
    for done in range(0, 4097, 64):
        bar.set(done)
    bar.close()
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    assert text.splitlines() == [f"upload m.safetensors: {p}%  {d}" for p, d in (
        (0, "0 B / 4.0 KiB"), (25, "1.0 KiB / 4.0 KiB"), (50, "2.0 KiB / 4.0 KiB"), (75, "3.0 KiB / 4.0 KiB"),
        (100, "4.0 KiB / 4.0 KiB"))]


def test_an_unfinished_or_unsized_run_ends_with_where_it_stopped() -> None:
    out = io.StringIO()
    bar = ProgressBar("download", None, stream=out, line_every_s=3600)
    for done in (10, 20, 30):
        bar.set(done)
    bar.close()
    assert out.getvalue().splitlines() == ["download: 10 B", "download: 30 B"]
    out = io.StringIO()
    bar = ProgressBar("job", 1.0, stream=out, units="fraction")
    bar.set(0.6)
    bar.close()
    assert out.getvalue().splitlines() == ["job: 60%"] and "\x1b" not in out.getvalue()


def test_a_terminal_gets_the_bar_redrawn_in_place() -> None:
    out = Terminal()
    bar = ProgressBar("upload", 100, stream=out)
    bar.set(100)
    bar.close()
    assert out.getvalue().startswith("\r[") and out.getvalue().endswith("\x1b[K\n")


def test_auto_progress_is_on_only_for_a_terminal() -> None:
    assert not Reporter(None, "x", 10, stream=io.StringIO()).enabled
    assert Reporter(None, "x", 10, stream=Terminal()).enabled
    assert Reporter(True, "x", 10, stream=io.StringIO()).enabled  # asked for: plain lines
