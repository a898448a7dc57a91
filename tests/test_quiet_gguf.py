"""``quiet_gguf_bars``: inside it, transformers' GGUF dequantization bar (a plain ``tqdm`` that
``disable_progress_bar()`` does not reach) prints nothing; on exit the GGUF module's ``tqdm`` is back."""
import pytest

transformers = pytest.importorskip("transformers")
gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")

from fusedce.finetune.quiet_gguf import quiet_gguf_bars  # noqa: E402


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
