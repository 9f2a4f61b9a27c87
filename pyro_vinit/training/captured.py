"""
:class:`CapturedSVI`: ``SVI`` whose loss and gradients are traced once per
input signature into a graph of aten operations and replayed.
"""

import contextlib
import math
from collections import OrderedDict
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    Hashable,
    Iterator,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
    cast,
)

import pyro
import torch
from pyro import poutine
from pyro.infer import SVI
from pyro.infer.elbo import ELBO
from pyro.infer.util import is_validation_enabled
from pyro.optim import PyroOptim
from pyro.poutine.messenger import Messenger

from pyro_vinit._pyro_compat import active_messengers, traceable_elbos
from pyro_vinit._warn import warn_at_caller
from pyro_vinit.poutine import KLAnnealingMessenger
from pyro_vinit.training._cuda_graph import CudaGraphReplay, off_device
from pyro_vinit.training._inductor import held_write, inductor_compile
from pyro_vinit.training._signature import messenger_state
from pyro_vinit.training._trace import reuse_dead_buffers, trace_graph

__all__ = ["CapturedSVI"]

# (name, is observed) of each sample site, in the order the step visits them, and
# the names of the param sites (a guide's first call visits each twice, creating it)
Structure = Tuple[Tuple[Tuple[str, bool], ...], FrozenSet[str]]


class _SiteRecorder(Messenger):
    """Records the sample and param sites one step visits (model and guide)."""

    def __init__(self) -> None:
        super().__init__()
        self.samples: List[Tuple[str, bool]] = []
        self.params: Set[str] = set()

    def _postprocess_message(self, msg: Any) -> None:
        if msg["type"] == "sample":
            self.samples.append((msg["name"], bool(msg.get("is_observed"))))
        elif msg["type"] == "param":
            self.params.add(msg["name"])

    @property
    def structure(self) -> Structure:
        return tuple(self.samples), frozenset(self.params)


@contextlib.contextmanager
def _no_validation() -> Iterator[None]:
    """Pyro's and PyTorch's validation off, also for distributions built while it
    was on (e.g. a cached prior, whose ``_validate_args`` is its own)."""
    base = torch.distributions.Distribution
    check = base.__dict__["_validate_sample"]
    base._validate_sample = lambda self, value: None  # type: ignore[method-assign]
    try:
        with pyro.validation_enabled(False):
            yield
    finally:
        base._validate_sample = check  # type: ignore[method-assign]


class _Capture:
    """One traced step: what replays it (the graph, inductor's code or a CUDA graph
    of either), the parameters it reads, in order, and the traced graph where it is
    replayed uncompiled."""

    def __init__(self, graph: Callable[..., Any], params: List[torch.Tensor],
                 uncompiled: Optional[torch.fx.GraphModule] = None) -> None:
        self.graph = graph
        self.params = params
        self.uncompiled = uncompiled
        #: the buffers, their values and the generators' states before the first replay
        self.before: Optional[Tuple[List[torch.Tensor], List[torch.Tensor], torch.Tensor,
                                    Optional[List[torch.Tensor]]]] = None


def _describe(error: BaseException) -> str:
    message = str(error).splitlines()
    text = f"{type(error).__name__}: {message[0] if message else ''}"
    context = error.__context__
    if context is not None:  # e.g. the capture's end, raising after its cause
        said = _describe(context)
        if said != text:  # (the same error raised again: said once)
            text += f", after {said}"
    return text


class CapturedSVI(SVI):
    r"""
    :class:`~pyro.infer.SVI` whose step is traced once and replayed: the
    ELBO's loss and the gradients of the parameters, as ``loss.backward()``
    computes them, become one graph of aten operations
    (``torch.fx.experimental.proxy_tensor.make_fx``) per input signature
    (the shapes, strides, dtypes and devices of the tensor arguments, the other
    arguments, and the effect handlers around the step with their settings,
    compared by value: a handler entered afresh at each step with the same
    strategy, schedule or config function keeps its graph, and a changed
    setting, such as the KL weight of a
    :class:`~pyro_vinit.poutine.KLAnnealingMessenger` schedule during its
    warm-up, is a new signature); the optimizer then runs as in ``SVI``.

    Usage::

        model = BayesianClassifier(bayesianize(mlp((64, 100, 10))), num_data=1000)
        guide = AutoKTiedNormal(model, rank=2)
        svi = CapturedSVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), TraceMeanField_ELBO())
        for _ in range(5):
            with local_reparam():
                loss = svi.step(x, y)

    The first step of each signature runs eagerly (with Pyro's validation,
    when on) and records the sites it visits; the second traces, checks
    that it visits the same sites, and replays the graph. The random draws
    are operations of the graph, drawn afresh at each replay from PyTorch's
    generator: the same draws, loss and gradients as the eager step under
    the same seed. A replayed step runs no validation: with Pyro's on, a
    loss that is not finite (e.g. a batch holding NaN) raises before the
    optimizer moves anything. Where the step cannot be captured (a model
    whose sites differ between its first two steps, a branch on a tensor's
    value, an ELBO other than :class:`~pyro.infer.Trace_ELBO` or
    :class:`~pyro.infer.TraceMeanField_ELBO`, more than ``max_signatures``
    signatures, or four times as many seen), it warns once and runs every
    later step as ``SVI`` does.
    On CUDA the graph is replayed as a CUDA graph: one launch a step, the
    gradients handed to the optimizer are the graph's static outputs.

    Python code of the model runs only while tracing: a model that changes
    its structure later without a sign in its inputs or its handlers'
    floats (e.g. a Python random choice, an attribute read as a constant:
    a flag that drops a site, ``module.eval()`` turning dropout off) is
    replayed with its traced structure; make a new ``CapturedSVI`` then.
    Tensors the step updates in place (e.g. BatchNorm's running statistics, the
    buffers of ``model`` and ``guide`` when they are ``nn.Module`` s) are
    restored after tracing, so each step updates them once. The graph reads the
    parameter tensors the traced step found; where the param store holds others
    at a later step (its state loaded, a parameter deleted and made again),
    every signature is recorded and traced afresh, as ``SVI`` would step the new
    ones.

    :param model: The Pyro model.
    :param guide: Its guide.
    :param ~pyro.optim.PyroOptim optim: A Pyro optimizer.
    :param ~pyro.infer.ELBO loss: ``Trace_ELBO`` or ``TraceMeanField_ELBO``
        (another ELBO falls back to ``SVI``'s step).
    :param int max_signatures: Graphs kept; one more signature falls back.
    :param bool cuda_graph: Replay each graph as one CUDA graph (its
        operators launched at once, data copied into static inputs). The
        default, None, does so where the parameters and tensor arguments
        all live on one CUDA device and warns once where the step cannot be
        captured (e.g. a random draw on the CPU); True raises an error
        instead (a step that cannot be traced at all still falls back to
        ``SVI``'s, as above); False replays operator by operator.
    :param bool compile: Compile each graph with inductor
        (``torch._inductor``, its random draws left to PyTorch's generator)
        and call the compiled code instead of the replay: on the CPU the
        eager step's draws and values; on a CUDA device replayed as a CUDA
        graph (as ``cuda_graph`` says), where inductor may order independent
        draws its own way: the same distribution and the same run for a
        seed, not the eager step's values. A compile takes
        seconds to tens of seconds: it pays in runs of many thousands of
        steps (see the "Performance" page). Where inductor fails, or the step
        writes to a tensor it does not make (BatchNorm's running statistics),
        it warns once and replays uncompiled.
    """

    def __init__(
        self,
        model: Callable[..., Any],
        guide: Callable[..., Any],
        optim: PyroOptim,
        loss: ELBO,
        *,
        max_signatures: int = 8,
        cuda_graph: Optional[bool] = None,
        compile: bool = False,
    ) -> None:
        if not isinstance(loss, ELBO):
            raise TypeError(
                f"CapturedSVI: loss must be a Pyro ELBO (e.g. TraceMeanField_ELBO()), got "
                f"{type(loss).__name__}"
            )
        if isinstance(max_signatures, bool) or not isinstance(max_signatures, int) \
                or max_signatures < 1:
            raise ValueError(f"CapturedSVI: max_signatures must be an int >= 1, got "
                             f"{max_signatures!r}")
        if cuda_graph is not None and not isinstance(cuda_graph, bool):  # 0 == False
            raise ValueError(f"CapturedSVI: cuda_graph must be None, True or False, got "
                             f"{cuda_graph!r}")
        if not isinstance(compile, bool):
            raise ValueError(f"CapturedSVI: compile must be True or False, got {compile!r}")
        super().__init__(model, guide, optim, loss)  # type: ignore[no-untyped-call]
        self.max_signatures = max_signatures
        self.cuda_graph = cuda_graph
        self.compile = compile
        #: Why a graph was replayed uncompiled with ``compile=True``, or None.
        self.compile_failure: Optional[str] = None
        self._compile_chosen = False  # by fit, for a long run: not asked for by the user
        self._elbo = loss
        self._captures: OrderedDict[Hashable, _Capture] = OrderedDict()
        self._eager_sites: Dict[Hashable, Structure] = {}
        self._eager_params: Dict[Hashable, List[torch.Tensor]] = {}
        # the param store's names of those tensors, by signature: checked at each step
        self._store_params: Dict[Hashable, List[Tuple[str, torch.Tensor]]] = {}
        #: Why stepping fell back to ``SVI``'s eager step, or None.
        self.fallback_reason: Optional[str] = None

    @property
    def num_traces(self) -> int:
        """The number of graphs held (one per signature seen twice)."""
        return len(self._captures)

    def _compile_from_next_step(self) -> None:
        """
        Compiles each graph from its next step on (fit's choice for a long
        run): the held graphs are traced again from their first steps' records.
        A step that inductor's copy would get wrong (:func:`held_write`) stays
        replayed without a warning; a failed compile warns once, as with
        ``compile=True``.
        """
        self.compile = True
        self._compile_chosen = True
        self._captures.clear()

    def _graphs(self) -> List[torch.fx.GraphModule]:
        """The held graphs replayed uncompiled (operator by operator, or as a CUDA
        graph)."""
        return [c.uncompiled for c in self._captures.values() if c.uncompiled is not None]

    def _fall_back(self, reason: str) -> None:
        self.fallback_reason = reason
        self._forget()  # the graphs and the records of first steps: never read again
        warn_at_caller(f"CapturedSVI: {reason}; every later step runs eagerly, as SVI.step",
                       RuntimeWarning)

    def _signature(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[Hashable]:
        parts: List[Hashable] = []
        for value in [*args, *(kwargs[k] for k in sorted(kwargs))]:
            if isinstance(value, torch.Tensor):
                # strides too: the graph's views are traced for the first tensor's layout
                parts.append(("tensor", tuple(value.shape), value.stride(), value.dtype,
                              value.device, value.requires_grad))
            else:
                try:
                    hash(value)
                except TypeError:
                    return None
                parts.append(("value", type(value), value))
        handlers = tuple(messenger_state(m) for m in active_messengers())
        return (tuple(parts), tuple(sorted(kwargs)), handlers)

    def _eager_step(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> float:
        return float(super().step(*args, **kwargs))  # type: ignore[no-untyped-call]

    def step(self, *args: Any, **kwargs: Any) -> float:
        """
        Takes one SVI step: the loss and gradients (eager, traced or
        replayed), then the optimizer.

        :return: The loss estimate, as ``SVI.step`` returns it.
        """
        if self.fallback_reason is not None:
            return self._eager_step(args, kwargs)
        if self.cuda_graph:  # before anything runs: the data must be on one CUDA device
            tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
            if tensors:
                self._graph_device([], tensors)
        if self.compile:  # before anything runs: the data must be where inductor compiles
            self._check_compilable([a for a in [*args, *kwargs.values()]
                                    if isinstance(a, torch.Tensor)])
        key = self._signature(args, kwargs)
        if key is None:
            self._fall_back("an argument that is neither a tensor nor hashable")
            return self._eager_step(args, kwargs)
        if key in self._eager_params and self._replaced(key):
            self._forget()  # a loaded param store: the graphs read tensors SVI no longer steps
        capture = self._captures.get(key)
        if capture is None and key not in self._eager_sites:
            if len(self._eager_sites) >= 4 * self.max_signatures:
                # signatures that never repeat: every step eager, each one's record kept
                scheduled = any(
                    isinstance(m, KLAnnealingMessenger) and m.schedule is not None
                    and m.iteration > 0 and m.schedule(m.iteration - 1) != m.scale
                    for m in active_messengers())
                cause = ("a KLAnnealingMessenger schedule: its KL weight, a constant of "
                         "the graph, changes at each step; make CapturedSVI after the "
                         "schedule's warm-up, or raise max_signatures above its length"
                         if scheduled else
                         "a handler setting compared by identity, e.g. a tensor scale or "
                         "mask, made afresh at each step: make it once")
                self._fall_back(f"more than {4 * self.max_signatures} input signatures "
                                f"(4 x max_signatures) seen, most never again ({cause})")
                return self._eager_step(args, kwargs)
            recorder = _SiteRecorder()
            with poutine.trace(param_only=True) as found, recorder:
                loss = self._eager_step(args, kwargs)
            self._eager_sites[key] = recorder.structure
            params: Dict[int, torch.Tensor] = {}
            held = dict(pyro.get_param_store().named_parameters())
            stored: List[Tuple[str, torch.Tensor]] = []
            for name, site in found.trace.nodes.items():
                value: Any = site["value"]
                param = cast(torch.Tensor, value.unconstrained())
                params.setdefault(id(param), param)
                if held.get(name) is param:
                    stored.append((name, param))
            self._eager_params[key] = list(params.values())
            self._store_params[key] = stored
            return float(loss)
        if capture is None:
            if len(self._captures) >= self.max_signatures:
                self._fall_back(f"more than max_signatures={self.max_signatures} input "
                                "signatures (shapes, handlers' settings)")
                return self._eager_step(args, kwargs)
            capture = self._trace(key, args, kwargs)
            if capture is None:
                return self._eager_step(args, kwargs)
        self._captures.move_to_end(key)
        tensors = [a for a in [*args, *(kwargs[k] for k in sorted(kwargs))]
                   if isinstance(a, torch.Tensor)]
        try:
            with torch.no_grad():  # the graph computes the gradients itself: nothing to record
                loss, grads = capture.graph(capture.params, tensors)
        except Exception as error:  # e.g. an operator whose traced backward cannot run
            if capture.before is None:
                raise
            self._restore(*capture.before)  # (the optimizer has not run: only buffers moved)
            del self._captures[key]
            self._fall_back(f"the traced step failed on its first replay ({_describe(error)})")
            return self._eager_step(args, kwargs)
        capture.before = None  # (replayed once: a later failure is the step's own)
        if is_validation_enabled() and not math.isfinite(float(loss)):
            # the eager step's validation would have refused it (SVI raises there)
            raise ValueError(
                f"CapturedSVI: the loss of this step is {float(loss)}, and the parameters "
                "were not updated: a batch with NaN or inf in it, or values outside the "
                "model's support (the replayed step runs no validation; SVI names the site)")
        used = []
        for param, grad in zip(capture.params, grads):
            if grad is not None:
                param.grad = grad
                used.append(param)
        self.optim(used)
        for param in used:
            param.grad = None
        return float(loss)

    def _replaced(self, key: Hashable) -> bool:
        """Whether the param store holds other tensors under the names of those that
        ``key``'s first step found (its state loaded since)."""
        held = dict(pyro.get_param_store().named_parameters())
        return any(held.get(name) is not param for name, param in self._store_params[key])

    def _forget(self) -> None:
        """Drops every graph and first-step record: each signature starts afresh."""
        self._captures.clear()
        self._eager_sites.clear()
        self._eager_params.clear()
        self._store_params.clear()

    def _trace(self, key: Hashable, args: Sequence[Any],
               kwargs: Dict[str, Any]) -> Optional[_Capture]:
        names = sorted(kwargs)
        positional = len(args)
        recorder = _SiteRecorder()
        differentiable_loss = getattr(self._elbo, "differentiable_loss", None)
        if differentiable_loss is None:
            self._fall_back(f"{type(self._elbo).__name__} has no differentiable_loss")
            return None

        def loss_and_grads(params: List[torch.Tensor], tensors: List[torch.Tensor]) -> Any:
            it = iter(tensors)
            values = [next(it) if isinstance(a, torch.Tensor) else a
                      for a in [*args, *(kwargs[k] for k in names)]]
            call_args, call_kwargs = values[:positional], dict(zip(names, values[positional:]))
            with recorder:
                loss = differentiable_loss(self.model, self.guide, *call_args, **call_kwargs)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            return loss.detach(), list(grads)

        params = self._eager_params[key]
        tensors = [a for a in [*args, *(kwargs[k] for k in names)] if isinstance(a, torch.Tensor)]
        if self.compile:
            self._check_compilable(params)
        device = self._graph_device(params, tensors)
        buffers = self._buffers()
        saved = [b.detach().clone() for b in buffers]
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if any(
            t.is_cuda for t in [*params, *tensors]) else None
        try:
            with _no_validation(), traceable_elbos():
                graph = trace_graph(loss_and_grads, params, tensors)
        except Exception as error:  # data-dependent Python, an ELBO that reads scalars, ...
            self._restore(buffers, saved, cpu_rng, cuda_rng)
            self._fall_back(f"the step could not be traced ({_describe(error)})")
            return None
        self._restore(buffers, saved, cpu_rng, cuda_rng)
        if recorder.structure != self._eager_sites[key]:
            self._fall_back("the model's or guide's sites changed from one step to the next")
            return None
        compiled = None
        if self.compile and self.compile_failure is None:
            reason = held_write(graph, self._buffer_names())
            # fit's own choice is not refused aloud for a graph inductor would get wrong
            quiet = self._compile_chosen and reason is not None
            if reason is None:
                try:
                    compiled = inductor_compile(graph, params, tensors)
                except Exception as error:  # no C++ compiler, an operator it cannot lower...
                    reason = f"inductor failed: {_describe(error)}"
                finally:
                    self._restore(buffers, saved, cpu_rng, cuda_rng)
            if reason is not None:
                self.compile_failure = reason
                asked, remedy = (("fit: the step of this long run",
                                  " (pass capture=True to skip the attempt)")
                                 if self._compile_chosen
                                 else ("CapturedSVI(compile=True): the step", ""))
                if not quiet:
                    warn_at_caller(f"{asked} is not compiled ({reason}); this and every later "
                                   f"signature is replayed uncompiled{remedy}", RuntimeWarning)
        replay: Callable[..., Any] = graph
        if compiled is not None:
            replay = compiled
        else:
            reuse_dead_buffers(graph)
        if device is not None:
            try:
                replay = self._capture_cuda_graph(graph, replay, params, tensors, device)
            finally:
                self._restore(buffers, saved, cpu_rng, cuda_rng)  # the warm-up run's updates
        capture = _Capture(replay, params, graph if compiled is None else None)
        capture.before = (buffers, [b.detach().clone() for b in buffers],
                          torch.get_rng_state(), cuda_rng and torch.cuda.get_rng_state_all())
        self._captures[key] = capture
        return capture

    @staticmethod
    def _check_compilable(tensors: List[torch.Tensor]) -> None:
        found = sorted({str(t.device) for t in tensors if t.device.type not in ("cpu", "cuda")})
        if found:
            raise ValueError(
                f"CapturedSVI(compile=True): the step's parameters and tensor arguments must "
                f"be on the CPU or a CUDA device (where the compiled step is measured), found "
                f"on {found}; leave compile=False on this device")

    def _graph_device(self, params: List[torch.Tensor],
                      tensors: List[torch.Tensor]) -> Optional[torch.device]:
        """The CUDA device to replay on as a CUDA graph, or None."""
        if self.cuda_graph is False:
            return None
        devices = {t.device for t in [*params, *tensors]}
        if len(devices) == 1 and next(iter(devices)).type == "cuda":
            return devices.pop()
        found = sorted(str(d) for d in devices)
        if self.cuda_graph:
            raise ValueError(
                f"CapturedSVI(cuda_graph=True): the step's parameters and tensor arguments "
                f"must all be on one CUDA device, found on {found}; move the model and data "
                "there, or leave cuda_graph=None")
        if len(devices) > 1 and any(d.type == "cuda" for d in devices):
            how = "runs as inductor's compiled code" if self.compile else \
                "is replayed operator by operator"
            warn_at_caller(f"CapturedSVI: the step's parameters and tensor arguments are on "
                           f"{found}, not one CUDA device: it {how}, not as a CUDA graph",
                           RuntimeWarning)
        return None

    def _capture_cuda_graph(self, graph: torch.fx.GraphModule, replay: Callable[..., Any],
                            params: List[torch.Tensor], tensors: List[torch.Tensor],
                            device: torch.device) -> Callable[..., Any]:
        """``replay`` (``graph`` itself, or inductor's compile of it) as a CUDA
        graph, or (with one warning) ``replay`` itself."""
        reason = off_device(graph, device)
        if reason is None:
            try:
                return CudaGraphReplay(replay, params, tensors, device)
            except Exception as error:  # an operator that cannot be captured
                reason = _describe(error)
        if self.cuda_graph:
            raise RuntimeError(f"CapturedSVI(cuda_graph=True): the step cannot be replayed as "
                               f"a CUDA graph ({reason})")
        how = ("inductor's compiled step runs" if replay is not graph
               else "the step is replayed operator by operator")
        warn_at_caller(f"CapturedSVI: {how}, not as a CUDA graph ({reason})", RuntimeWarning)
        return replay

    def _buffer_names(self) -> Dict[int, str]:
        """The names of the buffers of ``model`` and ``guide`` (``nn.Module`` s),
        by ``id``."""
        names: Dict[int, str] = {}
        for owner in (self.model, self.guide):
            if isinstance(owner, torch.nn.Module):
                for name, buffer in owner.named_buffers():
                    names.setdefault(id(buffer), name)
        return names

    def _buffers(self) -> List[torch.Tensor]:
        found: Dict[int, torch.Tensor] = {}
        for owner in (self.model, self.guide):
            if isinstance(owner, torch.nn.Module):
                for buffer in owner.buffers():
                    found.setdefault(id(buffer), buffer)
        return list(found.values())

    @staticmethod
    def _restore(buffers: List[torch.Tensor], saved: List[torch.Tensor],
                 cpu_rng: torch.Tensor, cuda_rng: Optional[List[torch.Tensor]]) -> None:
        with torch.no_grad():
            for buffer, value in zip(buffers, saved):
                buffer.copy_(value)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
