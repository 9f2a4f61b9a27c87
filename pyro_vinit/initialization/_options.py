"""The options of I-BLM, checked in one place."""

from dataclasses import dataclass
from typing import Any, Optional, Tuple, Type, Union

_CHOICES = {
    "hidden_columns": ("cyclic", "random"),
    "hidden_batches": ("local", "random"),
    "propagate": ("mean", "sample"),
    "solver": ("auto", "primal", "dual"),
}


@dataclass(frozen=True)
class IBLMOptions:
    """The options of :func:`~pyro_vinit.initialization.init_guide_iblm`
    (documented there), checked when created."""

    batch_size: int = 128
    output_rows: Optional[int] = 4096
    alpha: float = 0.001
    center_targets: Optional[bool] = None
    alternate_hidden_signs: Optional[bool] = None
    hidden_target_scale: Optional[float] = 1.0
    hidden_columns: str = "cyclic"
    hidden_batches: str = "local"
    propagate: str = "mean"
    noise_scale: Optional[float] = None
    estimate_noise: Optional[bool] = None
    strict: bool = False
    solver: str = "auto"
    jitter: float = 1e-6
    max_scale_ratio: Optional[float] = None
    max_pool_size: int = 10_000
    chunk_rows: int = 4096
    max_chunk_elements: int = 2**22
    input_rank: Optional[int] = 64
    kl_weight: float = 1.0
    standardize_hidden: Optional[bool] = None

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_pool_size", "chunk_rows", "max_chunk_elements"):
            _check_positive(name, getattr(self, name), int)
        for name in ("alpha", "jitter", "kl_weight"):
            _check_positive(name, getattr(self, name))
        for name in ("output_rows", "input_rank"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name), int)
        for name in ("noise_scale", "hidden_target_scale", "max_scale_ratio"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        for name in ("center_targets", "alternate_hidden_signs", "estimate_noise",
                     "standardize_hidden"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(
                    f"IBLMGuideInitializer: {name} must be None, True or False, got "
                    f"{getattr(self, name)!r}"
                )
        if not isinstance(self.strict, bool):
            raise ValueError(f"IBLMGuideInitializer: strict must be a bool, got {self.strict!r}")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"IBLMGuideInitializer: {name} must be one of {choices}, got "
                    f"{getattr(self, name)!r}"
                )
        if self.noise_scale is not None and self.estimate_noise:
            raise ValueError(
                "IBLMGuideInitializer: pass either noise_scale (a fixed regression noise) or "
                "estimate_noise=True, not both"
            )

    def center(self, classification: bool) -> bool:
        """Whether hidden targets are centered (default: for classification)."""
        return classification if self.center_targets is None else self.center_targets

    def standardize(self, classification: bool) -> bool:
        """Whether hidden units are standardized (default: for classification)."""
        return classification if self.standardize_hidden is None else self.standardize_hidden

    def alternate(self, classification: bool) -> bool:
        """Whether hidden signs alternate (default: for regression)."""
        if self.alternate_hidden_signs is None:
            return not classification
        return self.alternate_hidden_signs


def _check_positive(
    name: str, value: Any, kind: Union[Type[Any], Tuple[Type[Any], ...]] = (int, float),
    who: str = "IBLMGuideInitializer", zero: bool = False,
) -> None:
    """Refuses ``value`` unless it is a positive ``kind`` (or zero, where ``zero``;
    not a bool, not nan)."""
    if (isinstance(value, bool) or not isinstance(value, kind)
            or not (value >= 0 if zero else value > 0)):
        what = "non-negative" if zero else "positive"
        raise ValueError(f"{who}: {name} must be {what}, got {value!r}")
