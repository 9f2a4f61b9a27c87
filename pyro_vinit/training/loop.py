"""
:func:`fit`: I-BLM, then SVI with the recipe that keeps I-BLM's head start
(see the "Training" method page).
"""

import inspect
import math
import os
import warnings
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    List,
    Mapping,
    Optional,
    Set,
    Tuple,
    Union,
    cast,
)

import pyro
import torch
from pyro.infer import SVI
from pyro.infer.autoguide import AutoGuide, AutoGuideList
from pyro.optim import PyroOptim
from torch import nn

from pyro_vinit.guides.site_params import _supported_names, is_supported
from pyro_vinit.initialization import init_guide_iblm, init_guide_pretrained
from pyro_vinit.initialization._rollback import (
    GuideRollback,
    restored_on_error,
    rng_state,
    set_rng_state,
)
from pyro_vinit.initialization.pretrained import _model_values
from pyro_vinit.training._checks import (
    _check_batch_norm_particles,
    _check_guide,
    _check_guide_model,
    _check_model,
    _check_one_row_batches,
    _check_validation,
    _check_weight_noise,
)
from pyro_vinit.training._inductor import compile_pays
from pyro_vinit.training._support import (
    Batch,
    Data,
    _Batches,
    _check_batch,
    _check_checkpoint,
    _check_checkpoint_path,
    _evaluate,
    _load,
    _mean_field_list,
    _save,
    _set_up,
    _train_mode,
    warn_if_worse,
)
from pyro_vinit.training.averaging import _check_decay
from pyro_vinit.training.batch_norm import update_batch_norm
from pyro_vinit.training.captured import CapturedSVI
from pyro_vinit.training.config import (
    FitConfig,
    FitHistory,
    _check_positive,
    _chosen_weight_noise,
    fit_config,
    is_initialized,
)

__all__ = ["fit"]

#: The fewest steps of one call for which ``capture=None`` takes the captured step,
#: by device type (None: never): above the break-even of the tracing step against the
#: time the replayed step saves, measured on the race's problems at 77-144 steps on a
#: CPU (one fake tensor mode for the trace: 156-255 before) and 57 on an H100 with the
#: CUDA-graph replay (benchmarks/bench_fit_capture.py, docs/methods/training.rst).
_CAPTURE_MIN_STEPS: Dict[str, Optional[int]] = {"cpu": 200, "cuda": 100}


def _use_capture(capture: Optional[bool], steps: int, device: torch.device) -> bool:
    """Whether this call takes captured steps: as asked, or where the run is long
    enough to pay for the tracing."""
    if capture is not None:
        return capture
    if device.type == "cuda" and not torch.cuda.is_available():
        return False
    threshold = _CAPTURE_MIN_STEPS.get(device.type)
    return threshold is not None and steps >= threshold


#: fit's initializers, by ``init``; their data and guide are fit's, the rest
#: ``init_options``.
_INITIALIZERS: Dict[str, Callable[..., Any]] = {
    "iblm": init_guide_iblm, "pretrained": init_guide_pretrained}


def _check_init_options(init: Optional[str], options: Optional[Mapping[str, Any]]) -> None:
    # the names checked as the initializer would check them, before anything changes
    # (and also where the guide is initialized already, and the options go unused)
    if options is None or init is None:
        return
    if not isinstance(options, Mapping):
        raise TypeError(f"fit: init_options must be a dict of keyword options, got "
                        f"{type(options).__name__}")
    initializer = _INITIALIZERS[init]
    # (fit trains in one process: I-BLM's process group is not among its options)
    known = [n for n in inspect.signature(initializer).parameters
             if n not in ("guide", "data", "process_group")]
    unknown = sorted(set(options) - set(known), key=str)
    if unknown:
        raise TypeError(f"fit: init_options {unknown} are not options of "
                        f"{initializer.__name__} (init={init!r}); its options: "
                        f"{', '.join(known)}")


def _not_finite(modules: List[nn.Module]) -> Set[str]:
    """The names of the param store's parameters (and under ``module_local_params``
    the modules') that hold NaN or inf."""
    stored = dict(pyro.get_param_store().named_parameters())
    seen = {id(p) for p in stored.values()}
    params = [*stored.items(), *((name, p) for m in modules
                                 for name, p in m.named_parameters() if id(p) not in seen)]
    return {name for name, p in params if not bool(torch.isfinite(p).all())}


def _raise_if_diverged(step: int, modules: List[nn.Module], before: Set[str],
                       lr: Optional[float], given_lr: bool, error: ValueError) -> None:
    # A step that failed (Pyro's validation of a distribution's NaN argument, deep inside
    # the model) on parameters that this call's earlier steps made NaN or inf (not those
    # that were so before it, ``before``): training diverged.
    try:
        names = sorted(_not_finite(modules) - before)
    except Exception:  # (e.g. a device that fails every op now: the error as it is)
        return
    if not names:
        return
    whose = "" if given_lr else "fit's default "
    remedy = ("lower the optimizer's learning rate" if lr is None else
              f"lower the learning rate ({whose}lr={lr:g}), e.g. lr={lr / 10:g}")
    raise ValueError(
        f"fit: training diverged: step {step} failed on parameters that hold NaN or inf "
        f"({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}), which this call's "
        f"earlier steps made; {remedy}, or check the data's scale. The parameters are left "
        "as they are") from error


# ---- fit -----------------------------------------------------------------------------



def _dropout(model: Callable[..., Any]) -> List[str]:
    """The names of the model's dropout modules that drop (in train mode)."""
    return [name or type(m).__name__ for name, m in (
        model.named_modules() if isinstance(model, torch.nn.Module) else ())
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]

def fit(
    model: Callable[..., Any],
    guide: Callable[..., Any],
    data: Data,
    *,
    steps: Optional[int] = None,
    epochs: Optional[float] = None,
    batch_size: int = 128,
    optim: Optional[PyroOptim] = None,
    lr: Optional[float] = None,
    kl_weight: Optional[float] = None,
    num_particles: Optional[int] = None,
    init: Optional[str] = "iblm",
    init_options: Optional[Dict[str, Any]] = None,
    validation: Optional[Batch] = None,
    eval_every: Optional[int] = None,
    num_samples: int = 32,
    progress: bool = True,
    checkpoint: Optional[Union[str, "os.PathLike[str]"]] = None,
    checkpoint_every: Optional[int] = None,
    capture: Union[bool, str, None] = None,
    average: Optional[float] = None,
    weight_noise: Optional[Callable[[], ContextManager[Any]]] = None,
) -> FitHistory:
    r"""
    Trains a Bayesian neural network ``model(x, y)`` and its ``guide`` on
    ``data``: initializes the guide with I-BLM unless it is initialized
    already (see :func:`is_initialized`), then runs SVI with the configuration
    of :func:`fit_config`, the recipe that keeps I-BLM's head start.

    Usage::

        model = BayesianClassifier(bayesianize(mlp((64, 100, 10))), num_data=len(x))
        guide = AutoKTiedNormal(model, rank=2)
        history = fit(model, guide, (x, y), steps=400, progress=False)
        history = fit(model, guide, (x, y), steps=100, progress=False)  # continues

    The model must condition on ``y`` through an observed site whose
    likelihood is scaled to the full data set (``num_data=`` of
    :class:`~pyro_vinit.nn.BayesianClassifier`, or a subsampled
    ``pyro.plate``). Everything about ``data``, the model's first batch and
    the options is checked before any parameter changes.

    :param model: The Pyro model, called as ``model(x, y)``; an ``nn.Module``
        in eval mode trains in train mode and is returned in eval mode.
    :param guide: Its guide (AutoKTiedNormal, AutoMeanFieldNormal,
        AutoRadialNormal, Pyro's AutoNormal, AutoDiagonalNormal or
        AutoLowRankMultivariateNormal for I-BLM and ``init="pretrained"``, or for
        I-BLM an AutoGuideList of them and others; with ``init=None`` any).
    :param data: An ``(x, y)`` pair of tensors, shuffled into minibatches of
        ``batch_size`` each epoch, or a re-iterable of ``(x, y)`` batches
        (e.g. a :class:`~torch.utils.data.DataLoader`), read pass after pass.
    :param int steps: Number of SVI steps (with ``checkpoint``, the total
        including the steps already in it); default 1000 unless ``epochs``.
    :param float epochs: Alternatively, passes over the data.
    :param int batch_size: Minibatch size for an ``(x, y)`` pair (an epoch's
        last row alone joins the batch before it: BatchNorm cannot train on
        one row; a loader's batch of one row is refused for a model with
        BatchNorm in train mode).
    :param optim: A Pyro optimizer instead of :meth:`FitConfig.optimizer`
        (pass the same one to a second call to keep Adam's moments).
    :param float lr: Learning rate of the default optimizer.
    :param float kl_weight: KL weight instead of 0.01, or 0.3 where the model
        learns its likelihood's noise scale (see :func:`fit_config`).
    :param int num_particles: Particles of the ELBO.
    :param init: How a guide not yet initialized is started: ``"iblm"``
        (:func:`~pyro_vinit.init_guide_iblm`; a model that keeps a trained
        network's weights is warned about), ``"pretrained"``
        (:func:`~pyro_vinit.init_guide_pretrained`, from the weights that
        ``bayesianize(net, keep_weights=True)`` keeps) or None (the guide's own
        initial values).
    :param dict init_options: Keyword options of the initializer (for
        I-BLM over fit's, :meth:`FitConfig.iblm_options`), their names checked
        first; refused with ``init=None``, unused (with a warning) for a guide
        initialized already.
    :param tuple validation: An ``(x, y)`` pair evaluated before the first
        step, every ``eval_every`` steps and after the last one; a last MNLL
        above the first, or the best, by over a tenth of its size (and 0.05
        nats) is warned about (training made the model worse).
    :param int eval_every: Steps between evaluations (default a tenth of the run);
        refused without ``validation``.
    :param int num_samples: Guide draws of the Monte Carlo predictive.
    :param bool progress: Show a tqdm progress bar with the loss.
    :param checkpoint: A file to which the guide's and model's parameters,
        the optimizer's state, the RNG states and the step are saved every
        ``checkpoint_every`` steps and at the end; if it exists, training
        resumes from it (bit-identically for an ``(x, y)`` pair, unless the
        step is compiled: inductor's float rounding is its own, and on CUDA
        the order of its draws). Refused under
        ``module_local_params=True``, whose parameters the store lacks.
    :type checkpoint: str or os.PathLike
    :param int checkpoint_every: Steps between checkpoints (default: only at the end);
        refused without ``checkpoint``.
    :param capture: Take the steps through :class:`CapturedSVI` (the
        step traced once and replayed: the same losses under the same seed,
        uncompiled);
        None (default) does where it pays for its tracing: for a call of 200
        steps or more on a CPU, 100 on CUDA; it also compiles the traced step
        with inductor where the captured steps left are projected to save
        twice the compile's cost (tens of seconds, repaid over tens of
        thousands of steps; see the "Training" method page). Batches of
        another shape than the first (an epoch's last, partial batch) take the
        eager step. ``"compile"``: captured and compiled
        (``CapturedSVI(compile=True)``; on a CPU or CUDA, where its draws may
        come in another order than the eager step's), however short the run;
        True: captured, never compiled.
    :type capture: bool or str
    :param float average: The decay of the moving average of the parameters
        (:class:`ParamAverage`) instead of 0.99: validation evaluates the
        average, and it is written into the parameters after the last step;
        0 keeps the last step's values. Under
        ``pyro.settings.set(module_local_params=True)`` the model's and guide's
        module parameters are averaged.
    :param callable weight_noise: The weight-noise handler instead of
        fit's (see :func:`fit_config`): a callable that returns a fresh one,
        entered at each step (e.g. ``lambda: weight_noise(config=...)``
        leaving a shared weight's site out), or ``contextlib.nullcontext``
        for none. The guide and the model are run on the first batch under
        it before anything changes (the guide left as it was).
    :return: A :class:`FitHistory`.
    :raises ValueError: Also where training diverges: a step that fails on
        parameters that earlier steps made NaN or inf is named, with a remedy.
    """
    # (a model in eval mode, e.g. set for predicting between two calls, trains in train
    # mode and is returned in eval mode)
    with _train_mode(model):
        # ---- every check first: nothing is modified until they pass --------------------
        if steps is not None and epochs is not None:
            raise ValueError("fit: pass steps or epochs, not both")
        _check_positive("batch_size", batch_size, int)
        _check_positive("num_samples", num_samples, int)
        for name, value, kind in (("steps", steps, int), ("epochs", epochs, (int, float)),
                                  ("eval_every", eval_every, int),
                                  ("checkpoint_every", checkpoint_every, int)):
            if value is not None:
                _check_positive(name, value, kind)
        if lr is not None:
            _check_positive("lr", lr)
        if kl_weight is not None:
            _check_positive("kl_weight", kl_weight)
        if num_particles is not None:
            _check_positive("num_particles", num_particles, int)
        if average is not None:
            _check_decay(average, "fit: average")
        if capture is not None and not isinstance(capture, bool) and capture != "compile":
            raise TypeError(f"fit: capture must be True, False or None (automatic), or 'compile', "
                            f"got {capture!r}")
        if init not in ("iblm", "pretrained", None):
            raise ValueError(f"fit: init must be 'iblm', 'pretrained' or None, got {init!r}")
        # an option that another one makes idle is refused, not ignored
        idle: Tuple[Tuple[str, bool, str], ...] = (
            ("init_options", bool(init_options) and init is None,
             "init='iblm' or 'pretrained' (the initializer's options)"),
            ("eval_every", eval_every is not None and validation is None,
             "validation=(x_val, y_val)"),
            ("checkpoint_every", checkpoint_every is not None and checkpoint is None,
             "checkpoint=path"))
        for name, unused, needs in idle:
            if unused:
                raise ValueError(f"fit: {name} is used only with {needs}, which this call does "
                                 "not pass")
        _check_init_options(init, init_options)
        if optim is not None and not isinstance(optim, PyroOptim):
            raise TypeError(
                f"fit: optim must be a Pyro optimizer (e.g. pyro.optim.Adam({{'lr': 1e-3}})), "
                f"got {type(optim).__name__}"
            )
        if optim is not None and lr is not None:
            raise ValueError("fit: pass lr or optim, not both (lr sets the default optimizer's)")
        if not callable(model) or not callable(guide):
            raise TypeError("fit: model and guide must be callables (a Pyro model and its guide)")
        modules = [m for m in (model, guide) if isinstance(m, nn.Module)]
        local = bool(pyro.settings.get("module_local_params")) and bool(modules)
        if checkpoint is not None and local:
            raise ValueError(
                "fit: a checkpoint holds the param store's parameters, and under pyro.settings."
                "set(module_local_params=True) the model's and guide's are their modules' own: "
                "it would resume from fresh ones. Save and load the guide's state_dict around "
                "fit instead (the Saving page), or train with module_local_params=False")
        if num_particles is not None and num_particles > 1:
            _check_batch_norm_particles(model)
        batches = _Batches(data, batch_size)
        num_data = batches.num_data
        _check_one_row_batches(model, batches.one_row)
        if validation is not None:
            validation = _check_batch(validation, "validation")
        if capture == "compile" and batches.first[0].device.type not in ("cpu", "cuda"):
            raise ValueError(f"fit: capture='compile' is measured on the CPU and CUDA only; the "
                             f"data is on {batches.first[0].device}: pass capture=True or None "
                             "there")
        learned_noise, likelihoods = _check_model(
            model, batches.first, num_data, batches.pair[1] if batches.pair is not None else None,
            batches.dataset_rows)
        _check_guide(guide, batches.first, likelihoods)
        _check_guide_model(model, guide, batches.first)
        _check_weight_noise(model, guide, batches.first, _chosen_weight_noise(guide, weight_noise))
        chunk = max(1, min(num_data, 4096))  # validation rows per model call
        if validation is not None:
            _check_validation(model, validation, chunk)
        initialized = is_initialized(guide)
        who = {"iblm": "I-BLM", "pretrained": "init_guide_pretrained"}.get(init or "", "")
        if init is not None and not initialized and not isinstance(guide, AutoGuide):
            raise TypeError(
                f"fit: {who} initializes autoguides, not a {type(guide).__name__}; pass init=None "
                "to train this guide from its own initial values"
            )
        if (init is not None and not initialized and not isinstance(guide, AutoGuideList)
                and not is_supported(guide)):
            raise TypeError(
                f"fit: {who} cannot initialize a guide of class {type(guide).__name__} (it reads "
                f"and writes the per-site posteriors of {', '.join(_supported_names())}); pass "
                "init=None to train this guide from its own initial values"
            )
        kept = _model_values(model)  # a trained network's weights, bayesianize(keep_weights=True)
        if init == "pretrained" and not initialized and isinstance(guide, AutoGuideList):
            raise TypeError(
                "fit: init='pretrained' starts one guide, not an AutoGuideList: call "
                "init_guide_pretrained(member, data) on each member over the layers, then "
                "fit(..., init=None)")
        if (init == "pretrained" and not initialized and not kept
                and "weights" not in (init_options or {})):
            raise ValueError(
                "fit: init='pretrained' starts the guide from a trained network's weights, and "
                "the model keeps none: convert the trained network with bayesianize(net, "
                "keep_weights=True), or pass init_options={'weights': {...}}, the trained "
                "values by the model's sample site names (e.g. 'net.0.weight')")
        if initialized and init is not None and init_options:
            warnings.warn(
                f"fit: init_options are not used: the {type(guide).__name__} is initialized "
                "already (see is_initialized), and fit continues training it", UserWarning,
                stacklevel=2)
        path = os.fspath(checkpoint) if checkpoint is not None else None
        if path is not None:
            _check_checkpoint_path(path)
        resumed = _load(path) if path is not None and os.path.exists(path) else None
        if steps is None:
            steps = (max(1, round(epochs * batches.batches_per_epoch)) if epochs is not None
                     else 1000)
        done = 0 if resumed is None else int(resumed["step"])

        # ---- initialize, or restore --------------------------------------------------------
        before = rng_state()  # (a failed initialization leaves the generators here too)
        batches.start()
        history = FitHistory()
        defaults = FitConfig()
        with restored_on_error(before):  # (a failed start or resume: as it was)
            if resumed is not None:
                with GuideRollback(cast(nn.Module, guide)):
                    _set_up(guide, batches.first)  # the checkpoint then overwrites its values
                    _check_checkpoint(path, resumed, model)  # before anything is overwritten
                if done >= steps:
                    warnings.warn(f"fit: the checkpoint {path!r} is at step {done}, at or past "
                                  f"steps={steps}: nothing is trained", UserWarning, stacklevel=2)
                device = batches.first[0].device  # the checkpoint was loaded onto the CPU
                store_state = resumed["param_store"]
                # into the tensors set up (those the model's and guide's modules hold: a module's
                # state_dict, the moving average and the optimizer see the values), else afresh
                store = pyro.get_param_store()
                held = dict(store.named_parameters())
                fresh = {}
                with torch.no_grad():
                    for name, value in store_state["params"].items():
                        same = name in held and held[name].shape == value.shape
                        if same and held[name].dtype == value.dtype:
                            held[name].copy_(value)
                        else:
                            fresh[name] = value.to(device)
                store.set_state({"params": fresh, "constraints": store_state["constraints"]})
                if isinstance(model, nn.Module) and resumed["model"] is not None:
                    model.load_state_dict(resumed["model"])
                history.loss = list(resumed["loss"])
                history.validation = list(resumed["validation"])
            elif init is not None and not initialized:
                set_up = cast(AutoGuide, guide).prototype_trace is not None
                init_data = batches.pair if batches.pair is not None else batches.loader
                if init == "iblm":
                    options = {**defaults.iblm_options(num_data), **(init_options or {})}
                    init_guide_iblm(cast(AutoGuide, guide), cast(Any, init_data), **options)
                    if kept:
                        how = ("call init_guide_pretrained(member, data) on each member over the "
                               "layers before fit" if isinstance(guide, AutoGuideList) else
                               "pass init='pretrained'")
                        warnings.warn(
                            "fit: the model keeps a trained network's weights (bayesianize(..., "
                            f"keep_weights=True)), which I-BLM does not start from: {how} to start "
                            "the guide from them", UserWarning, stacklevel=2)
                else:
                    init_guide_pretrained(cast(AutoGuide, guide), cast(Any, init_data),
                                          **(init_options or {}))
                if set_up:
                    warnings.warn(
                        f"fit: the {type(guide).__name__} was set up (e.g. by a call guide(x, "
                        "y)) but not initialized or trained: every scale was still its "
                        f"init_scale, so fit started it with {who}, replacing its set-up values; "
                        "pass init=None to train from them", UserWarning, stacklevel=2)
                history.initialized = True
            elif not initialized:  # init=None: Pyro's own initial values, set up here
                guide(*batches.first)
            else:  # e.g. parameters loaded into the param store: set up, taking their values
                if isinstance(guide, AutoGuide) and guide.prototype_trace is None:
                    warnings.warn(
                        "fit: the param store already holds parameters of a "
                        f"{type(guide).__name__} (loaded, or left by an earlier guide of this "
                        "class), so its initialization is skipped and training continues from "
                        "them; call pyro.clear_param_store() first to start afresh",
                        UserWarning, stacklevel=2)
                _set_up(guide, batches.first)
        config = fit_config(guide, lr=lr, kl_weight=kl_weight, num_particles=num_particles,
                            learned_noise=learned_noise, average=average,
                            weight_noise=weight_noise)
        history.config = config
        history.own_optim = optim is not None
        default_lr = config.lr if optim is None else None  # (for a diverged run's message)
        optim = optim if optim is not None else config.optimizer()
        # under module_local_params the modules hold their parameters, not the param store
        averager = config.averager(nn.ModuleList(modules) if local else None)
        if resumed is not None:
            optim.set_state(resumed["optim"])
            if resumed.get("average") is not None:
                averager.set_state(resumed["average"])
                averager.decay = config.average  # this call's decay, the saved averages and count
            batches.set_state(resumed["batches"])
            set_rng_state(resumed["rng"])
        elbo = config.elbo()
        svi = SVI(model, guide, optim, elbo)
        captured: Optional[CapturedSVI] = None
        # capture=None compiles a step whose graph, once traced, projects a saving over the
        # captured steps left (not the partial batches') that repays the compile twice, by
        # its device's cost model (_inductor.compile_pays)
        may_compile = capture is None
        if capture == "compile" or _use_capture(cast(Optional[bool], capture), steps - done,
                                                batches.first[0].device):
            captured = CapturedSVI(model, guide, optim, elbo, compile=capture == "compile")
        shape = (batches.first[0].shape, batches.first[1].shape)
        every = eval_every or max(1, steps // 10)

        # ---- train ---------------------------------------------------------------------------
        from tqdm.auto import tqdm  # type: ignore[import-untyped]  # a dependency of Pyro

        # every evaluation leaves the generator as it found it: training is the same with or
        # without validation, whatever eval_every, and a call resumed from its checkpoint to
        # train further continues as the uninterrupted one
        if validation is not None and done == 0:
            rng = rng_state()
            history.validation.append({"step": 0, **_evaluate(model, guide, *validation,
                                                                num_samples, chunk)})
            set_rng_state(rng)
        norm_data = batches.pair if batches.pair is not None else batches.loader
        with warnings.catch_warnings():
            if _mean_field_list(guide):
                # Pyro checks the mean-field restriction by the sites' order (sufficient,
                # not necessary), which a guide list's members, each drawing its sites
                # independently, need not keep
                warnings.filterwarnings("ignore", "Failed to verify mean field restriction",
                                        UserWarning)
            bar = tqdm(total=steps, initial=done, disable=not progress, desc="fit")
            stale = _not_finite(modules)  # (a step failing on these is no divergence of this call)
            try:
                for step in range(done + 1, steps + 1):
                    xb, yb = next(batches)
                    # a batch of another shape (an epoch's last) would cost a trace of its own
                    same = (xb.shape, yb.shape) == shape
                    stepper = captured if captured is not None and same else svi
                    try:
                        with config.handlers():
                            loss = stepper.step(xb, yb)
                    except ValueError as error:
                        _raise_if_diverged(step, modules, stale, default_lr, lr is not None, error)
                        raise
                    if not math.isfinite(loss):
                        warnings.warn(f"fit: the loss is {loss} at step {step}", RuntimeWarning,
                                      stacklevel=2)
                    history.loss.append(float(loss))
                    averager.update()
                    if may_compile and captured is not None and captured.num_traces:
                        may_compile = False  # decided once, on the first graph
                        graphs = captured._graphs()
                        left = (steps - step) * batches.full_batches // batches.batches_per_epoch
                        if graphs and compile_pays(graphs[0], left):
                            captured._compile_from_next_step()
                            bar.set_postfix_str("compiling the step")
                    bar.update(1)
                    if step % 10 == 0 or step == steps:
                        bar.set_postfix(loss=f"{loss / num_data:.4g}")
                    scheduled = validation is not None and step % every == 0
                    if step == steps or scheduled:
                        # the average evaluated (and the running statistics computed for it) before
                        # the checkpoint: a resumed call that trains no further returns the same
                        rng = rng_state()
                        with averager.swapped():
                            # eval mode predicts with running statistics: recompute them for the
                            # average (they lag behind while SVI trains); a model without
                            # BatchNorm layers is left alone
                            update_batch_norm(model, guide, cast(Any, norm_data), batch_size=chunk)
                            if validation is not None:
                                history.validation.append({"step": step, **_evaluate(
                                    model, guide, *validation, num_samples, chunk)})
                        set_rng_state(rng)
                    if path is not None and ((checkpoint_every and step % checkpoint_every == 0)
                                             or step == steps):
                        # the parameters as trained and the average's state: a resumed call
                        # continues as this one would have
                        _save(path, step, optim, model, batches, history, averager)
            finally:
                bar.close()
        averager.write()  # what fit returns (a resumed call that trains no further: the saved one)
        # a step that fell back (CapturedSVI warned why) ran eagerly from then on
        history.captured = captured is not None and captured.fallback_reason is None
        history.compiled = (captured is not None and captured.compile and captured.num_traces > 0
                            and captured.compile_failure is None)
        warn_if_worse(history.validation, config.kl_weight, _dropout(model))
        return history
