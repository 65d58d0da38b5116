"""The fake engine as a single-pass classifier: vLLM's `/classify` shape, labels scored by hash.

A single-pass replica answers in one forward pass: no decoding, no stream. The fake one takes a
running slot for a prefill of the input, then returns, for each input, a probability per label
(softmax over hash-derived logits, so the same text always gets the same answer) and the most
likely label. The default labels are the kind of decisions an agent hands to such a model.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_LABELS = ("urgent", "lookup", "chat")


class ClassifyRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str] = Field(min_length=1)


def inputs_of(request: ClassifyRequest) -> list[str]:
    return [request.input] if isinstance(request.input, str) else list(request.input)


def probabilities(text: str, labels: tuple[str, ...]) -> list[float]:
    logits = [
        3 * int.from_bytes(hashlib.sha256(f"{label}\x1f{text}".encode()).digest()[:4], "big") / 2**32
        for label in labels
    ]
    peak = max(logits)
    weights = [math.exp(x - peak) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def classification(index: int, text: str, labels: tuple[str, ...]) -> dict[str, Any]:
    probs = probabilities(text, labels)
    best = max(range(len(labels)), key=lambda i: probs[i])
    return {"index": index, "label": labels[best], "probs": probs, "num_classes": len(labels)}
