"""How the engine picks the next token: ``SamplingParams`` (validated on construction) and
``sample``.

``temperature = 0`` means greedy (argmax); a positive temperature samples from
``softmax(logits / temperature)``. Negative, NaN or infinite temperatures and fewer than one new
token are errors, never silently greedy or a token anyway.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch
from torch import Tensor


@dataclasses.dataclass
class SamplingParams:
    """How a request samples.

    Attributes:
        max_new_tokens: tokens to generate at most (an integer >= 1).
        temperature: softmax temperature, a finite number >= 0; 0 is greedy (argmax).
        stop_token_ids: a tuple or list of token ids (integers >= 0); generation ends after
            sampling any of them (it is kept in the output).
    The engine copies the parameters when a request is added, so changing them afterwards
    affects only requests added later.
    Raises:
        TypeError: a field of the wrong kind (a float ``max_new_tokens``, a string temperature).
        ValueError: ``max_new_tokens < 1``, a negative or non-finite temperature, a negative
            stop token id.

    >>> SamplingParams(max_new_tokens=4).temperature
    0.0
    >>> SamplingParams(max_new_tokens=0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: SamplingParams: max_new_tokens is below 1; expected an integer >= 1 ..., got 0. ...
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        self.validate()

    def validate(self, where: str = "SamplingParams") -> None:
        """Raise unless every field holds a valid value (``where`` names the caller in the
        message); the engine calls it again when a request is added, in case a field changed."""
        check_positive_int(where, "max_new_tokens", self.max_new_tokens,
                           unit=" (tokens to generate)", fix=" Ask for at least one new token.")
        t = self.temperature
        if not isinstance(t, numbers.Real) or isinstance(t, bool):
            raise TypeError(f"{where}: temperature has type {type(t).__name__}; expected a "
                            f"finite number >= 0 (0 = greedy), got {t!r}. Pass a float.")
        if not (math.isfinite(t) and t >= 0):
            raise ValueError(f"{where}: temperature is not a finite number >= 0; expected >= 0 "
                             f"(0 = greedy), got {t}. Pass 0 for greedy decoding or a positive "
                             "temperature.")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, (tuple, list)):
            raise TypeError(f"{where}: stop_token_ids has type {type(stops).__name__}; expected "
                            f"a tuple or list of integer token ids >= 0, got {stops!r}. Pass () "
                            "for no stop tokens.")
        bad = next((i for i in stops if not (is_integer(i) and i >= 0)), None)
        if bad is not None:
            kind = ValueError if is_integer(bad) else TypeError
            raise kind(f"{where}: stop_token_ids holds {bad!r}; expected integer token ids >= 0, "
                       f"got {tuple(self.stop_token_ids)!r}. Pass token ids of the model's "
                       "vocabulary.")


def is_integer(x) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_positive_int(where: str, name: str, value, *, unit: str = "", fix: str = "") -> None:
    """Raise unless ``value`` is an integer >= 1.

    Raises:
        TypeError: not an integer (a bool is not one), naming ``where`` and ``name``.
        ValueError: below 1.
    """
    if not is_integer(value):
        raise TypeError(f"{where}: {name} has type {type(value).__name__}; expected an integer "
                        f">= 1{unit}, got {value!r}. Pass an int.")
    if value < 1:
        raise ValueError(f"{where}: {name} is below 1; expected an integer >= 1{unit}, got "
                         f"{value}.{fix}")


def sample(logits: Tensor, temperatures: Tensor, generator: torch.Generator) -> Tensor:
    """Next token per row: argmax where ``temperature == 0``, else a softmax sample.

    Args:
        logits: [b, vocab] float. temperatures: [b] float, finite and >= 0 (``SamplingParams``
            checks them). generator: for sampling.
    Returns:
        [b] int64 token ids.

    >>> logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    >>> sample(logits, torch.zeros(2), torch.Generator().manual_seed(0)).tolist()
    [1, 0]
    """
    greedy = logits.argmax(dim=-1)
    if not bool((temperatures > 0).any()):
        return greedy
    probs = torch.softmax(logits.float() / temperatures.clamp_min(1e-5)[:, None], dim=-1)
    sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return torch.where(temperatures > 0, sampled, greedy)


__all__ = ["SamplingParams", "sample"]
