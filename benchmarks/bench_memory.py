"""
Optimizer-state size per guide family: the floats ``pyro.optim.Adam`` holds
after one SVI step (its two moment estimates for every live parameter), and
the variational parameters themselves, for a Bayesian MLP 784-400-400-10.

AutoKTiedNormal's point is to halve the variational parameters of a
mean-field guide; this checks that the optimizer holds only the live ones
(no orphaned full-size scales) so the saving reaches memory.

Usage::

    python -m benchmarks.bench_memory            # full size (a few seconds)
    python -m benchmarks.bench_memory --quick    # small network, no files
"""

import pyro
import torch
from pyro.infer import SVI, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal

from benchmarks.harness import make_parser, parse_args, result_stem, write_json
from pyro_vinit import AutoKTiedNormal, AutoRadialNormal
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp

GUIDES = {
    "AutoNormal": AutoNormal,
    "AutoKTiedNormal(k=1)": lambda m: AutoKTiedNormal(m, rank=1),
    "AutoKTiedNormal(k=2)": lambda m: AutoKTiedNormal(m, rank=2),
    "AutoKTiedNormal(k=3)": lambda m: AutoKTiedNormal(m, rank=3),
    "AutoRadialNormal": AutoRadialNormal,
}


def measure(sizes, make_guide):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = BayesianClassifier(bayesianize(mlp(sizes)), num_data=1000)
    guide = make_guide(model)
    x, y = torch.randn(32, sizes[0]), torch.randint(0, sizes[-1], (32,))
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), TraceMeanField_ELBO())
    svi.step(x, y)
    state = sum(
        t.numel()
        for optim in svi.optim.optim_objs.values()
        for per_param in optim.state.values()
        for t in per_param.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    params = sum(p.numel() for p in guide.parameters())
    return {"variational_params": params, "optimizer_state_floats": state}


def main(args):
    sizes = tuple(args.sizes)
    rows = {name: measure(sizes, make) for name, make in GUIDES.items()}
    base = rows["AutoNormal"]
    print(f"\nMLP {'-'.join(map(str, sizes))}, pyro.optim.Adam after one step\n")
    print("| guide | variational params | ÷ AutoNormal | Adam state floats | ÷ AutoNormal |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['variational_params']:,} | "
              f"{r['variational_params'] / base['variational_params']:.3f} | "
              f"{r['optimizer_state_floats']:,} | "
              f"{r['optimizer_state_floats'] / base['optimizer_state_floats']:.3f} |")
    if args.quick:
        return
    write_json(result_stem(args, "bench_memory") + ".json", {"sizes": sizes, "rows": rows})


if __name__ == "__main__":
    parser = make_parser(__doc__, threads=False, tag=False, quick_help="small network, no files")
    parser.add_argument("--sizes", type=int, nargs="+", default=[784, 400, 400, 10])
    main(parse_args(parser, quick={"sizes": [20, 16, 16, 3]}))
