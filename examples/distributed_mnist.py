"""
Data-parallel SVI with ``torch.distributed``: a Bayesian MLP on MNIST digits
(:func:`pyro_vinit.data.load_mnist`, the ``[mnist]`` extra; without it,
scikit-learn's digits), one process per device.

The pattern of Pyro's ``examples/svi_lightning.py`` and ``svi_horovod.py``,
with this library's guide, initializer and handlers:

1. every rank builds the same model and guide from one seed, and the guide
   gets all its parameters up front: I-BLM
   (:func:`~pyro_vinit.initialization.init_guide_iblm`) sets them, each rank
   passing its own shard of the training set and the process group, so that
   every rank ends with the initialization of the whole training set;
2. the training configuration is :func:`~pyro_vinit.fit`'s
   (:func:`~pyro_vinit.fit_config`: Adam at 3e-3 after a 50-step linear
   warm-up, the KL term weighted by
   0.01, I-BLM's stds capped at 0.1 × the prior's); the ELBO is a module,
   ``config.elbo()(model, guide)`` (Pyro's ``ELBOModule``), run inside a
   :class:`~pyro_vinit.poutine.KLAnnealingMessenger` and
   :func:`~pyro_vinit.poutine.local_reparam` by
   :class:`~pyro_vinit.poutine.HandledELBO`, wrapped in
   :class:`~torch.nn.parallel.DistributedDataParallel` and trained with
   :class:`torch.optim.Adam`; fit's moving average of the parameters
   (:class:`~pyro_vinit.ParamAverage`, the same on every rank) is written
   into them at the end;
3. every global minibatch of ``--batch-size`` points is split into one
   equal shard per rank. The likelihood is scaled to the full training set
   (``BayesianClassifier(num_data=N)``: a ``pyro.plate("data", N,
   subsample=...)`` over each shard), so that DDP's average of the ranks'
   gradients is the gradient of the full-batch ELBO estimate;
4. one seed for the data, the split into batches and the parameters,
   ``seed + rank`` for each rank's noise; the KL weight follows the global
   step on every rank;
5. rank 0 reports the test metrics (:mod:`pyro_vinit.metrics`).

See ``docs/scaling_out.rst`` for the derivation and the measurements.

Usage::

    python examples/distributed_mnist.py --quick                  # one process
    torchrun --standalone --nproc_per_node 2 examples/distributed_mnist.py --quick
    # one node with 8 GPUs; on several nodes, torchrun's --nnodes/--rdzv options
    torchrun --standalone --nproc_per_node 8 examples/distributed_mnist.py --backend nccl

With ``--backend nccl`` each process uses the GPU ``cuda:$LOCAL_RANK``
(torchrun sets ``LOCAL_RANK``); with ``gloo`` (the default) the CPU.
"""

import argparse
import inspect
import os
import time

import pyro
import torch
import torch.distributed as dist
from pyro.infer import Predictive
from pyro.infer.autoguide import init_to_sample
from torch.nn.parallel import DistributedDataParallel

import pyro_vinit.data
from pyro_vinit import AutoKTiedNormal, FitConfig, ParamAverage, fit_config, init_guide_iblm
from pyro_vinit.metrics import classification_metrics
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.poutine import HandledELBO, KLAnnealingMessenger, LocalReparamMessenger
from pyro_vinit.schedules import LinearWarmup

from _outputs import save_results


def setup_distributed(backend):
    """``(rank, world_size, device)``; joins the process group when started
    by torchrun (which sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", 1)) == 1:
        return 0, 1, device
    dist.init_process_group(backend)  # address, port, rank and size from torchrun's env
    return dist.get_rank(), dist.get_world_size(), device


def load_data(args, dtype, device, rank=0):
    """MNIST if ``pyro_vinit.data.load_mnist`` exists and its extra is
    installed, else digits (``--data auto``); flattened images."""
    data = None
    load_mnist = getattr(pyro_vinit.data, "load_mnist", None)
    if args.data in ("auto", "mnist"):
        if load_mnist is None:
            reason = "this pyro_vinit has no data.load_mnist"
        else:
            accepted = inspect.signature(load_mnist).parameters
            kwargs = {k: v for k, v in (("dtype", dtype), ("device", device)) if k in accepted}
            try:
                data = load_mnist(**kwargs)
            except ImportError as e:
                reason = f"load_mnist needs an extra that is not installed ({e})"
            except OSError as e:  # e.g. the MNIST files are not on this machine
                reason = f"load_mnist could not read the data ({e})"
        if data is None:
            if args.data == "mnist":
                raise RuntimeError(f"--data mnist: {reason}; use --data digits or auto")
            if rank == 0:
                print(f"falling back to scikit-learn's digits: {reason}")
    name = "mnist" if data is not None else "digits"
    if data is None:
        data = pyro_vinit.data.load_digits(dtype=dtype, device=device)
    x_train, y_train, x_test, y_test = (t.to(device) for t in data)
    x_train, x_test = x_train.flatten(1).to(dtype), x_test.flatten(1).to(dtype)
    if args.max_train:
        x_train, y_train = x_train[: args.max_train], y_train[: args.max_train]
        x_test, y_test = x_test[: args.max_train], y_test[: args.max_train]
    return name, (x_train, y_train, x_test, y_test)


def initialize(guide, x_train, y_train, rank, world_size, args):
    """I-BLM on the training set, the same result on every rank: each rank
    passes its shard and the process group, and the initializer combines the
    ranks' statistics (one process: the whole training set)."""
    group = dist.group.WORLD if world_size > 1 else None
    init_guide_iblm(guide, (x_train[rank::world_size], y_train[rank::world_size]),
                    batch_size=args.iblm_batch_size, max_scale_ratio=args.max_scale_ratio,
                    process_group=group)
    return "iblm, sharded" if world_size > 1 else "iblm"


@torch.no_grad()
def replica_difference(guide, world_size):
    """The largest difference between any rank's guide parameters and rank 0's
    (0.0: DDP kept the replicas identical)."""
    flat = torch.cat([v.reshape(-1) for v in guide.state_dict().values()])
    if world_size == 1:
        return 0.0
    first = flat.clone()
    dist.broadcast(first, src=0)
    diff = (flat - first).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


@torch.no_grad()
def test_metrics(model, guide, x_test, y_test, num_samples):
    predictive = Predictive(model, guide=guide, num_samples=num_samples, return_sites=["_RETURN"])
    metrics = classification_metrics(y_test, logits=predictive(x_test)["_RETURN"])
    metrics["accuracy"] = 1.0 - metrics["error_rate"]
    return metrics


def train(args, loss_fn, x_train, y_train, rank, world_size, device):
    """DDP training on each rank's shard of every global batch; the curve of
    the ranks' mean loss per training point."""
    if world_size > 1:
        ddp = DistributedDataParallel(
            loss_fn, device_ids=[device] if device.type == "cuda" else None,
            # every guide parameter is used at every step, nothing to search for
            find_unused_parameters=False)
    else:
        ddp = loss_fn
    optim = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    # fit's warm-up: the learning rate rises linearly over the first warmup_steps steps
    warmup = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda done: min(1.0, (done + 1) / max(1, args.warmup_steps)))
    # fit's moving average of the parameters (the same on every rank), written at the end;
    # with module_local_params they are the loss module's, not the param store's
    average = ParamAverage(args.average, module=loss_fn)
    shard = args.batch_size // world_size
    # The same global batches on every rank (one generator, one seed), each rank its slice.
    batches = torch.Generator().manual_seed(args.seed)
    pyro.set_rng_seed(args.seed + rank)  # each rank its own weight noise
    n, perm, start = len(x_train), None, 0
    curve, running, begin = [], [], time.perf_counter()
    for step in range(args.steps):
        if perm is None or start + args.batch_size > n:  # a new epoch, the tail dropped
            perm, start = torch.randperm(n, generator=batches).to(device), 0
        idx = perm[start + rank * shard : start + (rank + 1) * shard]
        start += args.batch_size
        optim.zero_grad()
        loss = ddp(x_train[idx], y_train[idx])
        loss.backward()
        optim.step()
        warmup.step()
        average.update()
        loss_fn.annealing.step()  # on every rank: λ follows the global step
        running.append(loss.detach())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            mean = torch.stack(running).mean()
            if world_size > 1:
                dist.all_reduce(mean)
                mean /= world_size
            curve.append({"step": step + 1, "kl_weight": loss_fn.annealing.scale,
                          "loss": mean.item() / n, "seconds": time.perf_counter() - begin})
            running = []
            if rank == 0:
                print(f"step {step + 1}: loss {curve[-1]['loss']:.4f} per training point, "
                      f"KL weight {curve[-1]['kl_weight']:.2f}")
    average.write()
    return curve


def plot(args, curve):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.plot([c["step"] for c in curve], [c["loss"] for c in curve], marker=".")
    ax.set_xlabel("global step")
    ax.set_ylabel("annealed loss / training point")
    ax.set_yscale("log")
    fig.tight_layout()
    path = os.path.join(args.out_dir, "learning_curve.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def main(args):
    rank, world_size, device = setup_distributed(args.backend)
    if args.batch_size % world_size:
        raise ValueError(f"--batch-size {args.batch_size} is the global batch: it must split "
                         f"into {world_size} equal shards, one per process")
    torch.set_num_threads(args.threads)
    # Parameters live in the modules, not Pyro's global store, as Pyro advises for ELBOModule.
    pyro.settings.set(module_local_params=True)
    pyro.set_rng_seed(args.seed)  # the same model and guide on every rank
    dtype = getattr(torch, args.dtype)
    data_name, (x_train, y_train, x_test, y_test) = load_data(args, dtype, device, rank)

    sizes = (x_train.shape[1],) + tuple(args.hidden) + (int(y_train.max()) + 1,)
    net = bayesianize(mlp(sizes), prior_scale=args.prior_scale).to(device=device, dtype=dtype)
    model = BayesianClassifier(net, num_data=len(x_train))
    guide = AutoKTiedNormal(model, rank=args.rank, init_scale=args.init_scale,
                            init_loc_fn=init_to_sample)
    begin = time.perf_counter()
    init = initialize(guide, x_train, y_train, rank, world_size, args)
    init_seconds = time.perf_counter() - begin
    init_difference = replica_difference(guide, world_size)  # 0.0: every rank starts alike
    if rank == 0:
        after_init = test_metrics(model, guide, x_test, y_test, args.num_samples)
        print(f"{data_name}, {world_size} process(es), {init} ({init_seconds:.2f} s): "
              f"test accuracy {after_init['accuracy']:.4f}, MNLL {after_init['mnll']:.4f}")

    # fit's configuration (the learning rate is args.lr, used by train's torch.optim.Adam)
    config = fit_config(guide, lr=args.lr, kl_weight=args.kl_weight)
    assert isinstance(config.weight_noise(), LocalReparamMessenger)  # fit's LRT
    kl = LinearWarmup(args.kl_warmup, end=config.kl_weight) if args.kl_warmup else config.kl_weight
    loss_fn = HandledELBO(config.elbo()(model, guide), KLAnnealingMessenger(kl),
                          config.weight_noise)
    curve = train(args, loss_fn, x_train, y_train, rank, world_size, device)
    difference = replica_difference(guide, world_size)

    if rank == 0:
        final = test_metrics(model, guide, x_test, y_test, args.num_samples)
        print(f"after {args.steps} steps ({curve[-1]['seconds']:.1f} s): test accuracy "
              f"{final['accuracy']:.4f}, MNLL {final['mnll']:.4f}, ECE {final['ece']:.4f}")
        if world_size > 1:
            print(f"largest parameter difference between the ranks: {init_difference} after "
                  f"initialization, {difference} after training")
        results = {"config": vars(args), "data": data_name, "world_size": world_size,
                   "init": init, "init_seconds": init_seconds, "after_init": after_init,
                   "final": final, "curve": curve,
                   "replica_max_difference": {"init": init_difference, "final": difference}}
        save_results(args.out_dir, results, lambda: plot(args, curve))
    if world_size > 1:
        dist.destroy_process_group()


FIT = FitConfig()  # fit's defaults, which the flags start from


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"],
                        help="gloo: CPU processes; nccl: one GPU per process (cuda:LOCAL_RANK)")
    parser.add_argument("--data", choices=["auto", "mnist", "digits"], default="auto",
                        help="auto: MNIST if available, else digits")
    parser.add_argument("--max-train", type=int, default=0,
                        help="use only the first N training (and test) points (0: all)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--hidden", type=int, nargs="+", default=[100])
    parser.add_argument("--rank", type=int, default=2, help="k of the k-tied guide")
    parser.add_argument("--init-scale", type=float, default=1e-2)
    parser.add_argument("--prior-scale", type=float, default=None,
                        help="N(0, s²) priors (default: bayesianize's N(0, 1/D_in))")
    parser.add_argument("--iblm-batch-size", type=int, default=FIT.iblm_batch_size)
    parser.add_argument("--max-scale-ratio", type=float, default=FIT.max_scale_ratio,
                        help="I-BLM's stds at most this times the prior's")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=128,
                        help="the global minibatch, split evenly across the processes")
    parser.add_argument("--lr", type=float, default=FIT.lr)
    parser.add_argument("--warmup-steps", type=int, default=FIT.warmup_steps,
                        help="steps of the learning rate's linear warm-up (0: none)")
    parser.add_argument("--kl-weight", type=float, default=FIT.kl_weight,
                        help="the weight of the KL term (1: the full ELBO)")
    parser.add_argument("--average", type=float, default=FIT.average,
                        help="decay of the parameters' moving average, written at the end "
                             "(0: the last step's)")
    parser.add_argument("--kl-warmup", type=int, default=0,
                        help="global steps of a linear KL warm-up to --kl-weight (0: none)")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--num-samples", type=int, default=100,
                        help="posterior samples of the test metrics")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--out-dir", default="results/distributed_mnist")
    parser.add_argument("--quick", action="store_true", help="smoke run (seconds)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.log_every, args.num_samples = 40, 10, 16
        args.max_train = args.max_train or 2000
        args.iblm_batch_size = 256
    return args


if __name__ == "__main__":
    main(parse_args())
