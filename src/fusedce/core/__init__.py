"""What every op family shares, below them: the loss options (``options/``), result types (``core/types.py``),
tensor checks (``core/validation.py``), the reference row formulas (``core/row_math.py``), reductions
(``core/reduction.py``), the row view of logits (``rows.py``), autocast and DTensor handling (``core/autocast.py``,
``core/dtensor.py``), the autograd checks (``core/autograd_checks.py``) and the one entrance every public op goes
through (``entrance.py``)."""
