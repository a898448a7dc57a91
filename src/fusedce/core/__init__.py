"""What every op family shares, below them: loss options, result types, tensor checks, the reference row
formulas, reductions, autocast and DTensor handling, and the one entrance of every public op (``entrance.py``)."""
