"""The data the initializers read: model arguments, as one tuple or a loader."""

import math
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from typing_extensions import TypeGuard

from pyro_vinit._warn import warn_at_caller
from pyro_vinit.initialization._rollback import generators_kept

Data = Union[Tuple[Any, ...], Iterable[Sequence[Any]]]


def _aligned(args: Sequence[Any]) -> Tuple[int, List[bool]]:
    """Number of rows, and which arguments are tensors indexed by the data rows
    (those whose leading dim equals the first tensor argument's)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0]
    if not tensors:
        arrays = any(hasattr(a, "__array__") and not isinstance(a, torch.Tensor) for a in args)
        raise ValueError(
            "the data must contain at least one tensor argument whose leading dim indexes "
            "the data rows, e.g. (x_train, y_train)"
            + ("; convert arrays with torch.as_tensor" if arrays else "")
        )
    n = tensors[0].shape[0]
    return n, [isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == n for a in args]


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of a floating-point ``tensor`` is finite: read off
    its sum (finite only if every element is, as NaN and inf propagate), which
    is one pass and no intermediate; elementwise only if the sum is not
    (an element is not finite, or the sum overflows)."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _check_finite(args: Sequence[Any]) -> None:
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and not all_finite(a):
            raise ValueError(
                f"data argument {i} (shape {tuple(a.shape)}) contains NaN or inf; clean or "
                "impute the data before initializing the guide"
            )


def is_args_tuple(data: Data) -> TypeGuard[Tuple[Any, ...]]:
    """Whether ``data`` is one tuple of model arguments (not an iterable of them)."""
    return isinstance(data, tuple) and not (
        data and all(isinstance(b, (tuple, list)) for b in data)
    )


class DataPool:
    """
    Up to ``max_rows`` rows of the data, held as model arguments, from which
    the initializers draw minibatches and forward chunks.

    ``data`` is either one tuple of model arguments (``model(*data)``) or
    any other iterable (a list, a generator, a
    :class:`~torch.utils.data.DataLoader`) of such tuples, whose batches are
    concatenated along the leading dim until ``max_rows`` rows are collected
    or it is exhausted. Tensor arguments whose leading dim is the number of
    rows are sliced; other arguments are passed unchanged.
    """


    def __init__(self, data: Optional[Data], max_rows: Optional[int] = None):
        if data is None:
            raise ValueError("this initializer needs data: pass (x, y) or a DataLoader")
        if isinstance(data, torch.Tensor):  # (iterated, its rows would be the batches)
            raise TypeError(
                f"the data is one tensor of shape {tuple(data.shape)}: pass the model's "
                "arguments as one tuple, e.g. (x, y), or a DataLoader of such tuples")
        #: Whether the pool is the data as given, every row in order (one tuple of
        #: arguments, not subsampled): what a per-example latent's guide is set up on
        self.whole = False
        if is_args_tuple(data):
            if not data:
                raise ValueError("the data is empty: pass a tuple of model arguments, e.g. (x, y)")
            args = data
            n, aligned = _aligned(args)
            self.whole = max_rows is None or n <= max_rows
            if max_rows is not None and n > max_rows:
                keep = torch.randperm(n, device=_device(args))[:max_rows]
                args = tuple(a[keep] if al else a for a, al in zip(args, aligned))
                n = max_rows
        else:
            with generators_kept(data):  # (reading a loader draws nothing)
                args, n, aligned = self._collect(data, max_rows)
        if n == 0:
            raise ValueError("the data is empty: there are no rows to initialize from")
        _check_finite(args)
        self.args, self.num_rows, self._aligned = args, n, aligned

    @staticmethod
    def _collect(
        batches: Iterable[Sequence[Any]], max_rows: Optional[int]
    ) -> Tuple[Tuple[Any, ...], int, List[bool]]:
        first: Optional[Tuple[Tuple[Any, ...], List[bool]]] = None
        parts: List[Tuple[Any, ...]] = []
        n = 0
        for batch in batches:
            if not isinstance(batch, (tuple, list)):
                raise TypeError(
                    "each batch of the data iterable must be a tuple of model arguments, "
                    f"got {type(batch).__name__}"
                    + (" (a list of tensors is read as an iterable of batches: pass one "
                       "batch as a tuple, e.g. (x, y))"
                       if isinstance(batch, torch.Tensor) and isinstance(batches, list) else "")
                )
            rows, aligned = _aligned(batch)
            if first is None:
                first = (tuple(batch), aligned)
            check_like_first(len(parts), batch, first[0])
            _check_finite(batch)
            parts.append(tuple(batch))
            n += rows
            if max_rows is not None and n >= max_rows:
                break
        if first is None:
            raise ValueError("the data is empty: the iterable yielded no batch")
        template, aligned = first
        args = tuple(
            torch.cat([p[i] for p in parts])[:max_rows] if al else a
            for i, (a, al) in enumerate(zip(template, aligned))
        )
        return args, min(n, max_rows) if max_rows is not None else n, aligned

    def select(self, rows: Union[torch.Tensor, slice]) -> Tuple[Any, ...]:
        """The model arguments of the given rows (an index tensor or a slice)."""
        return tuple(a[rows] if al else a for a, al in zip(self.args, self._aligned))

    def chunks(self, rows_per_chunk: int) -> Iterator[Tuple[Any, ...]]:
        """The model arguments of consecutive chunks covering all rows."""
        for start in range(0, self.num_rows, rows_per_chunk):
            yield tuple(
                a[start : start + rows_per_chunk] if al else a
                for a, al in zip(self.args, self._aligned)
            )

    @property
    def device(self) -> torch.device:
        return _device(self.args)

    def rows_of(self, args: Sequence[Any]) -> int:
        """The number of rows in ``args``, a chunk or selection of the pool's."""
        for a, al in zip(args, self._aligned):
            if al:
                rows: int = a.shape[0]
                return rows
        return 0

    def features(self) -> Optional[torch.Tensor]:
        """The first floating-point tensor argument indexed by the rows (the
        model's input, as a rule), or None."""
        for a, al in zip(self.args, self._aligned):
            if al and a.is_floating_point():
                features: torch.Tensor = a
                return features
        return None

    def iterate(
        self, chunk_rows: int, block_size: Optional[int]
    ) -> Iterator[Tuple[Tuple[Any, ...], Optional[torch.Tensor], int]]:
        """
        ``(args, plate_rows, keep)`` covering every row once, in order:
        chunks of ``chunk_rows``; for a model with a subsampled data plate,
        each chunk walked in blocks of its ``subsample_size`` (``plate_rows``:
        the block's row indices in the chunk, the last block wrapped around,
        of which the first ``keep`` are new).
        """
        for args in self.chunks(chunk_rows):
            n = self.rows_of(args)
            if block_size is None:
                yield args, None, n
                continue
            for start in range(0, n, block_size):
                rows = torch.arange(start, start + block_size, device=self.device) % n
                yield args, rows, min(block_size, n - start)

    def batch_indices(self, num_batches: int, batch_size: int) -> torch.Tensor:
        """
        Row indices ``(num_batches, batch_size)`` of consecutive minibatches of a
        stream of random permutations of the rows (the "next batch in D" of
        Algorithm 1), so that every batch is distinct whenever there are more
        rows than ``batch_size``.
        """
        total = num_batches * batch_size
        device = _device(self.args)
        perms = [torch.randperm(self.num_rows, device=device)
                 for _ in range(math.ceil(total / self.num_rows))]
        return torch.cat(perms)[:total].reshape(num_batches, batch_size)

    def effective_batch_size(self, batch_size: int, who: str) -> int:
        """``batch_size``, or the number of rows if that is smaller (with one warning)."""
        if batch_size > self.num_rows:
            warn_at_caller(
                f"{who}: batch_size={batch_size} is larger than the {self.num_rows} rows of "
                f"data; using batches of {self.num_rows}",
                UserWarning,
            )
            return self.num_rows
        return batch_size


def _device(args: Sequence[Any]) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def describe(args: Sequence[Any], names: Optional[Sequence[str]] = None) -> str:
    """The arguments' shapes and dtypes, for messages: ``(200, 4) torch.float64, ...``,
    each after its name where ``names`` are given (``x (200, 4) torch.float64``)."""
    shown = [f"{tuple(a.shape)} {a.dtype}" if isinstance(a, torch.Tensor) else type(a).__name__
             for a in args]
    if names is not None:
        shown = [f"{name} {text}" for name, text in zip(names, shown)]
    return ", ".join(shown)


def check_like_first(index: int, batch: Sequence[Any], first: Sequence[Any],
                     names: Optional[Sequence[str]] = None, prefix: str = "") -> None:
    """Refuses batch ``index`` of a data iterable unless its arguments are shaped as
    the first batch's, but for their rows (they are concatenated along the rows);
    ``names`` the arguments' (else their positions), ``prefix`` begins the message."""
    if len(batch) != len(first):
        raise ValueError(f"{prefix}batch {index} of the data has {len(batch)} arguments, "
                         f"batch 0 has {len(first)}")
    for i, (a, b) in enumerate(zip(batch, first)):
        if (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and (a.shape[1:] != b.shape[1:] or a.dtype != b.dtype)):
            what = names[i] if names is not None else f"argument {i}"
            raise ValueError(
                f"{prefix}batch {index} of the data has {what} of shape {describe([a])}, "
                f"batch 0 of shape {describe([b])}: every batch must have the shapes and "
                "dtypes of the first, but for the number of rows")
