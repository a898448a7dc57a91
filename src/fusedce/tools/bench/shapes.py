"""Named LLM shapes for synthetic scaling runs, and ``--shapes`` parsing."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

REAL = "real"  # SmolLM2-135M-Instruct hidden states on King James Bible text (see real_input.py)

# name -> (H, V)
NAMED_SHAPES = {
    "smollm2": (576, 49152),        # SmolLM2-135M (also the real input's shape)
    "qwen2.5-0.5b": (896, 151936),
    "gemma2-2b": (2304, 256000),
    "llama2-7b": (4096, 32000),
    "mistral-7b": (4096, 32768),    # v0.3 vocabulary
    "llama3-8b": (4096, 128256),
    "qwen2.5-7b": (3584, 152064),
    "gemma2-9b": (3584, 256000),
    "llama3-70b": (8192, 128256),
}
_CUSTOM = re.compile(r"^(\d+)x(\d+)$")  # "HxV", e.g. "64x1000"


@dataclass(frozen=True)
class Shape:
    """One ``--shapes`` entry: ``real``, a named shape, or a custom ``HxV``."""

    name: str
    hidden: Optional[int] = None   # None for "real": read from the model
    vocab: Optional[int] = None

    @property
    def is_real(self) -> bool:
        return self.name == REAL


def parse_shapes(text: str) -> list[Shape]:
    """Parse a comma-separated ``--shapes`` value. Raises ``ValueError`` naming the valid choices."""
    shapes = []
    for item in (part.strip().lower() for part in text.split(",")):
        if not item:
            continue
        if item == REAL:
            shapes.append(Shape(REAL))
        elif item in NAMED_SHAPES:
            shapes.append(Shape(item, *NAMED_SHAPES[item]))
        elif (match := _CUSTOM.match(item)) and int(match[1]) > 0 and int(match[2]) > 0:
            shapes.append(Shape(item, int(match[1]), int(match[2])))
        else:
            raise ValueError(f"unknown shape {item!r}: use 'real', HxV (e.g. 64x1000) or one of "
                             f"{', '.join(NAMED_SHAPES)}")
    if not shapes:
        raise ValueError("--shapes is empty")
    return shapes
