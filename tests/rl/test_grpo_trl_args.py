"""examples/grpo_trl.py's arguments (issue 27 item 9: ``--prompts 1`` crashed after 30 s with
``max() arg is an empty sequence``: the batch was fixed at 2 prompts). The run itself needs TRL and the model."""
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("trl")
spec = importlib.util.spec_from_file_location("grpo_trl", Path(__file__).parents[2] / "examples" / "grpo_trl.py")
grpo_trl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grpo_trl)


def test_one_prompt_is_a_valid_run():
    args = grpo_trl.parse_args(["--prompts", "1", "--group", "2"])
    assert (args.prompts, args.group) == (1, 2)


@pytest.mark.parametrize("argv,needle", [(["--prompts", "0"], "--prompts must be >= 1"),
                                         (["--group", "1"], "--group must be >= 2"),
                                         (["--steps", "0"], "--steps must be >= 1")])
def test_bad_sizes_are_refused_before_loading_the_model(argv, needle, capsys):
    with pytest.raises(SystemExit):
        grpo_trl.parse_args(argv)
    assert needle in capsys.readouterr().err
