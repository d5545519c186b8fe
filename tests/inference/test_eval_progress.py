"""dmoe-eval draws its progress bar only on a terminal: stderr redirected into a log gets none."""
import io

from megatron_dmoe.inference.evaluate import _progress


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _drawn(stderr, monkeypatch, enabled=True):
    monkeypatch.setattr("sys.stderr", stderr)
    assert list(_progress(range(3), 3, enabled)) == [0, 1, 2]
    return stderr.getvalue()


def test_progress_bar_only_on_a_terminal(monkeypatch):
    assert "evaluating" in _drawn(_Terminal(), monkeypatch)
    assert _drawn(io.StringIO(), monkeypatch) == ""  # a log file: no bar
    assert _drawn(_Terminal(), monkeypatch, enabled=False) == ""  # --no-progress
