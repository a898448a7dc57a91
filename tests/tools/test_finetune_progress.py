"""The progress of ``fusedce finetune`` and the SmolLM2 examples. ``quiet_gguf_bars``: inside it,
transformers' GGUF dequantization bar (a plain ``tqdm`` that ``disable_progress_bar()`` does not reach)
prints nothing; on exit the GGUF module's ``tqdm`` is back. ``ticking``: a bar on a terminal is redrawn
while a long step runs, and nothing extra is written into a log."""
import time

import pytest

from fusedce.tools.finetune.ticking import ticking

transformers = pytest.importorskip("transformers")
gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")

from fusedce.tools.gguf_bars import quiet_gguf_bars  # noqa: E402


@pytest.fixture
def restore_transformers_logging():
    verbosity = transformers.logging.get_verbosity()
    enabled = transformers.utils.logging.is_progress_bar_enabled()
    yield
    transformers.logging.set_verbosity(verbosity)
    (transformers.utils.logging.enable_progress_bar if enabled else
     transformers.utils.logging.disable_progress_bar)()


def _bar_output(capfd) -> str:
    for _ in gguf_utils.tqdm(range(50), desc="Converting and de-quantizing GGUF tensors..."):
        pass
    captured = capfd.readouterr()
    return captured.out + captured.err


def test_gguf_bar_silenced_inside_and_restored_after(capfd, restore_transformers_logging):
    original = gguf_utils.tqdm
    transformers.utils.logging.disable_progress_bar()   # what the examples did before: not enough
    assert "de-quantizing" in _bar_output(capfd)
    with quiet_gguf_bars():
        assert _bar_output(capfd) == ""
        assert not transformers.utils.logging.is_progress_bar_enabled()
    assert gguf_utils.tqdm is original
    assert "de-quantizing" in _bar_output(capfd)


def test_restored_after_an_error(restore_transformers_logging):
    original = gguf_utils.tqdm
    with pytest.raises(RuntimeError):
        with quiet_gguf_bars():
            raise RuntimeError("load failed")
    assert gguf_utils.tqdm is original


class _Stream:
    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


class _Bar:
    def __init__(self, tty: bool):
        self.fp, self.refreshes = _Stream(tty), 0

    def refresh(self) -> None:
        self.refreshes += 1


def test_ticking_redraws_on_a_terminal_only():
    on_terminal, into_log = _Bar(tty=True), _Bar(tty=False)
    with ticking(on_terminal, every=0.01), ticking(into_log, every=0.01):
        deadline = time.monotonic() + 10
        while on_terminal.refreshes < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    after = on_terminal.refreshes
    time.sleep(0.05)
    assert after >= 3 and on_terminal.refreshes == after     # stopped with the block
    assert into_log.refreshes == 0
