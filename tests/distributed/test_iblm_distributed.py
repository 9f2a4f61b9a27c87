"""
Distributed I-BLM: two ``gloo`` processes, each passing its own shard (of
unequal sizes, one smaller than ``batch_size``), end with identical guide
parameters equal to one process's on the concatenated shards, with the
default options (see ``_iblm_harness.py``).
"""

from functools import partial

import pyro
import pytest
import torch
import torch.distributed as dist

from pyro_vinit import init_guide_iblm
from tests.common import assert_close
from tests.distributed import _harness, _iblm_harness
from tests.distributed._iblm_harness import CASES, ERROR_CASES, GUIDE_ERROR_CASES

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available()
    or _harness.loopback_interface() is None,
    reason="needs torch.distributed with the gloo backend and a loopback network interface",
)

# float64: the statistics are summed over the ranks in another order than in one process
TOL = dict(rtol=1e-5, atol=1e-9)
F32_TOL = dict(rtol=1e-4, atol=1e-5)  # (float32: the primal form's sums in another order)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The one-process references are tiny: a second intra-op thread only makes
    them wait for each other on a shared machine (seconds instead of
    milliseconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """All cases in one spawn of two processes (starting them costs seconds)."""
    out_dir = tmp_path_factory.mktemp("iblm")
    return _harness.spawn_or_skip(_iblm_harness.run_ranks, str(out_dir), list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_ranks_hold_identical_parameters(ranks, name):
    _harness.assert_ranks_identical(ranks, name)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process_on_concatenated_shards(ranks, name):
    expected = _iblm_harness.reference(name)
    actual = ranks[0][name]["params"]
    assert actual.keys() == expected.keys()
    # and the initialization did something: every guide tensor moved from its set-up value
    case = CASES[name]
    model, guide, x, y = _iblm_harness.build(case)
    guide(x, y)
    start = _iblm_harness.snapshot(model, guide)
    for key, value in expected.items():
        if key.startswith("guide."):
            assert not torch.allclose(value, start[key]), f"{key} was not initialized"
        assert_close(actual[key], value, **TOL, msg=key)


def test_batchnorm_statistics_are_global(ranks):
    """The refreshed running statistics are those of all ranks' rows (here of the
    pool: 160 rows drawn from the 187), not of a shard."""
    params = ranks[0]["batchnorm_chunks_subsample"]["params"]
    assert params["model.net.1.running_var"].gt(0).all()
    expected = _iblm_harness.reference("batchnorm_chunks_subsample")
    for key in ("model.net.1.running_mean", "model.net.4.running_var"):
        assert_close(params[key], expected[key], **TOL)


@pytest.mark.parametrize("name", list(ERROR_CASES) + list(GUIDE_ERROR_CASES))
def test_errors_are_raised_alike_on_every_rank(ranks, name):
    """A rank's bad input makes every rank raise the same clear error (none is left
    waiting in a collective), before anything is written."""
    results = [r[name] for r in ranks]
    assert all("error" in r for r in results), results
    kinds = {r["error"] for r in results}
    assert len(kinds) == 1, kinds
    kind, message = kinds.pop()
    assert kind == "ValueError"
    if name == "mismatched_features":
        assert "differ in their data arguments" in message and "rank 1" in message
    elif name in GUIDE_ERROR_CASES:
        assert "differ in their guides (class and parameter shapes)" in message
        assert "rank 1" in message and "every rank must build the same guide" in message
    else:
        assert "failed on rank 1 of 2" in message
        assert "outside the support of the likelihood" in message
    assert all(r["unchanged"] for r in results)



@pytest.mark.parametrize("group, match", [
    (object(), "torch.distributed is not initialized"),
])
def test_bad_process_group_is_refused_when_built(group, match):
    """Outside an initialized process group (here, this test process), a
    process_group is refused at once, with what to do."""
    from pyro_vinit import IBLMGuideInitializer

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=match):
        IBLMGuideInitializer(process_group=group)
    # None, and dist.group.WORLD before init_process_group (which is None), mean one process
    assert IBLMGuideInitializer(process_group=dist.group.WORLD).process_group is None


def test_every_rank_raises_the_class_of_the_error():
    # (the class travels to the other ranks: pyro_vinit's own, a standard base, or else
    # RuntimeError)
    from pyro_vinit.initialization._distributed import _error_class
    from pyro_vinit.initialization._tracing import NoLayersError

    class UsersError(KeyError):
        pass

    assert _error_class(NoLayersError("no layers")) is NoLayersError
    assert _error_class(ValueError("bad")) is ValueError
    assert _error_class(UsersError("k")) is KeyError
    assert _error_class(OSError("disk")) is RuntimeError


@pytest.fixture
def one_rank_group(tmp_path, monkeypatch):
    """A process group of this process alone, whose I-BLM runs through the
    process-group collective (``collective_for`` picks the local one for a
    group of one rank): in process, so that the mutation tool sees its calls."""
    from pyro_vinit.initialization import _process_group, iblm
    from pyro_vinit.initialization._distributed import Shards

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", _harness.loopback_interface())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    used, local = [], _process_group.collective_for

    def collective_for(group):
        if group is None:  # the one-process reference
            return local(group)
        collective = _process_group.ProcessGroupCollective(Shards(group))
        used.append(collective)
        return collective

    monkeypatch.setattr(iblm, "collective_for", collective_for)
    try:
        yield used
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", list(CASES))
def test_process_group_of_one_rank_matches_single_process(one_rank_group, name):
    """The process-group collective on one rank holding all the rows computes
    what the local collective computes (the gathers, windows and reductions are
    then identities, up to the order of float sums)."""
    expected = _iblm_harness.reference(name)
    case = CASES[name]
    with pyro.settings.context(module_local_params=True):
        model, guide, x, y = _iblm_harness.build(case)
        init_guide_iblm(guide, (x, y), process_group=dist.group.WORLD, **case.options)
        actual = _iblm_harness.snapshot(model, guide)
    assert one_rank_group, "the process-group collective was not used"
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert_close(actual[key], value, **TOL, msg=key)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "constant_bias"])
def test_process_group_of_one_rank_solves_an_output_layer_over_positions(one_rank_group, bias,
                                                                        dtype):
    """An output layer applied at several positions (a convolution whose outputs are
    averaged over them): the process-group collective's shared-rows statistics pair
    every position with its row's target and noise, as the local collective does (and
    take a constant bias of the layer off the targets)."""
    import pyro.distributions as pdist
    import torch.nn.functional as F
    from pyro.infer.autoguide import AutoNormal

    def model(x, y=None):
        one = torch.ones((), dtype=x.dtype)
        w1 = pyro.sample("w1", pdist.Normal(0.0, one).expand([4, 2, 3]).to_event(3))
        w2 = pyro.sample("w2", pdist.Normal(0.0, one).expand([3, 4, 2]).to_event(3))
        b2 = torch.tensor([0.5, -1.0, 2.0], dtype=x.dtype) if bias else None
        logits = F.conv1d(torch.tanh(F.conv1d(x, w1)), w2, b2).mean(-1)  # (rows, 3)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", pdist.Categorical(logits=logits), obs=y)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 2, 6, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randint(3, (60,), generator=g)
    states = []
    for group in (None, dist.group.WORLD):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoNormal(model)
        init_guide_iblm(guide, (x, y), batch_size=60, process_group=group)
        states.append({k: v.detach().clone() for k, v in guide.state_dict().items()})
    assert one_rank_group, "the process-group collective was not used"
    assert states[1].keys() == states[0].keys()
    for key, value in states[0].items():
        assert value.dtype == dtype
        assert_close(states[1][key], value, **(TOL if dtype == torch.float64 else F32_TOL), msg=key)


def test_process_group_of_one_rank_reads_a_loader_up_to_max_pool_size(one_rank_group):
    # a shard given as a loader is read up to max_pool_size rows, as one process reads it
    from pyro.infer.autoguide import AutoNormal

    from pyro_vinit.testing.user_models import blobs, functional_tanh

    x, y, _, _ = blobs()
    loader = [(x[i:i + 50], y[i:i + 50]) for i in range(0, len(x), 50)]
    model = functional_tanh(1)
    states = []
    for group in (None, dist.group.WORLD):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoNormal(model)
        init_guide_iblm(guide, loader, max_pool_size=120, process_group=group)
        states.append({k: v.detach().clone() for k, v in guide.state_dict().items()})
    assert one_rank_group, "the process-group collective was not used"
    for key, value in states[0].items():
        assert_close(states[1][key], value, **F32_TOL, msg=key)


def test_a_shard_cannot_set_up_a_per_example_latents_guide(one_rank_group):
    # a per-example latent's guide is set up on all the rows, which a shard does not hold:
    # refused, saying to set it up first (a shard is never taken for the whole data, not
    # even the one of a group of one rank)
    import pyro.distributions as pdist
    import torch.nn.functional as F
    from pyro.infer.autoguide import AutoNormal

    def model(x, y=None):
        w = pyro.sample("w", pdist.Normal(0.0, 1.0).expand([2, 3]).to_event(2))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", pdist.Normal(0.0, 1.0))
            pyro.sample("obs", pdist.Normal(F.linear(x, w).sum(-1) + z, 1.0), obs=y)

    x, y = torch.randn(300, 3), torch.randn(300)
    message = ("the latent site 'z' lies in plate 'data' over the data rows (a per-example "
               "latent), so its guide must be set up on all of them, which this data does "
               "not give at once (a loader, more rows than max_pool_size, or a shard): set "
               "the guide up first, e.g. guide(x, y), then initialize it")
    with pytest.raises(ValueError) as error:
        init_guide_iblm(AutoNormal(model), (x, y), process_group=dist.group.WORLD)
    assert message in str(error.value)
    assert one_rank_group, "the process-group collective was not used"


# ------------------------------------------- the process-group collective, ranks as threads
# (no Pyro in the threads: see _harness.threaded_ranks; the whole I-BLM is above)


def _layers(*shapes, block_size=None, batch_norm=False):
    from types import SimpleNamespace

    layers = [SimpleNamespace(weight_name=f"w{i}", weight_shape=torch.Size(shape),
                              role="hidden" if i + 1 < len(shapes) else "output")
              for i, shape in enumerate(shapes)]
    likelihood = SimpleNamespace(family="normal", noise="site", noise_name="sigma")
    return SimpleNamespace(layers=layers, likelihood=likelihood, block_size=block_size,
                           batch_norm=batch_norm)


def _collective():
    from pyro_vinit.initialization._distributed import Shards
    from pyro_vinit.initialization._process_group import ProcessGroupCollective

    return ProcessGroupCollective(Shards(dist.group.WORLD))


def test_ranks_that_differ_in_structure_or_guide_are_refused_alike():
    structures = [_layers((4, 3), (2, 4)), _layers((4, 3), (2, 5))]
    guides = [torch.nn.Linear(3, 2), torch.nn.Linear(3, 4)]
    message = (
        "init_guide_iblm with a process_group: the ranks differ in the model's structure: "
        "rank 0 has {'layers': [('w0', (4, 3), 'hidden'), ('w1', (2, 4), 'output')], "
        "'likelihood': ('normal', 'site', 'sigma'), 'block_size': None, 'batch_norm': "
        "False}, rank 1 has {'layers': [('w0', (4, 3), 'hidden'), ('w1', (2, 5), "
        "'output')], 'likelihood': ('normal', 'site', 'sigma'), 'block_size': None, "
        "'batch_norm': False}; every rank must run the same model and guide")
    for rank_structures, rank_guides, expected in (
            (structures, guides[:1] * 2, message),
            (structures[:1] * 2, guides,
             "init_guide_iblm with a process_group: the ranks differ in their guides (class "
             "and parameter shapes): rank 0 has ('Linear', {'weight': (2, 3), 'bias': (2,)}), "
             "rank 1 has ('Linear', {'weight': (4, 3), 'bias': (4,)}); every rank must build "
             "the same guide (its class and options, e.g. AutoKTiedNormal's rank)")):
        def check(rank, structures, guides):
            with pytest.raises(ValueError) as error:
                _collective().check_structure(structures[rank], guides[rank])
            return str(error.value)

        run = partial(check, structures=rank_structures, guides=rank_guides)
        assert _harness.threaded_ranks(2, run) == [expected, expected]


def test_batch_norm_runs_in_the_global_chunks_with_synchronized_statistics():
    # a model with batch normalization and no subsampled plate: every rank runs the model
    # once per chunk of the global pool, on its rows of it (or, with none, on one row that
    # it keeps none of, with weight 0); with a subsampled plate: a warning, each rank alone
    import warnings

    from pyro_vinit.initialization._data import DataPool
    from pyro_vinit.initialization._distributed import ShardedPool

    counts = [5, 2]
    every = torch.arange(7.0)[:, None]

    def chunks(rank):
        collective = _collective()
        with pytest.raises(RuntimeError, match="^open_pool must be called first$"):
            assert collective.pool is None  # (raises first)
        collective.check_structure(_layers((2, 1), batch_norm=True), torch.nn.Linear(1, 1))
        start = sum(counts[:rank])
        collective._pool = ShardedPool(collective.shards,
                                       DataPool((every[start:start + counts[rank]],)), counts)
        collective._pool.finish(100)
        return [(chunk.args[0].flatten().tolist(), chunk.keep, chunk.norm_sync.weight)
                for chunk in collective.chunks(3, None)]

    first, second = _harness.threaded_ranks(2, chunks)
    assert first == [([0.0, 1.0, 2.0], 3, 1.0), ([3.0, 4.0], 2, 1.0), ([0.0], 0, 0.0)]
    assert second == [([5.0], 0, 0.0), ([5.0], 1, 1.0), ([6.0], 1, 1.0)]

    def blocks(rank):
        collective = _collective()
        collective.check_structure(_layers((2, 1), block_size=2, batch_norm=True),
                                   torch.nn.Linear(1, 1))
        return collective._sync_norms

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _harness.threaded_ranks(2, blocks) == [False, False]
    assert [str(w.message) for w in caught] == [
        "init_guide_iblm with a process_group: the model has batch normalization and a "
        "subsampled data plate: each rank normalizes its own blocks while fitting, so the "
        "result is not exactly that of one process on the concatenated shards (every rank "
        "still gets the same one)"] * 2


@pytest.mark.parametrize("differ", ["data", "options"])
def test_ranks_that_differ_in_data_layout_or_options_are_refused_alike(differ):
    from contextlib import ExitStack

    from pyro_vinit.initialization._options import IBLMOptions

    def open_pool(rank):
        x = torch.zeros(4, 3 if differ == "options" or rank == 0 else 2)
        options = IBLMOptions(batch_size=8 if differ == "data" or rank == 0 else 16)
        with pytest.raises(ValueError) as error, ExitStack() as stack:
            _collective().open_pool((x,), options, stack)
        return str(error.value)

    first, second = _harness.threaded_ranks(2, open_pool)
    assert first == second
    what = ("their data arguments (per argument: trailing shape and dtype of the rows): "
            "rank 0 has [('rows', (3,), 'torch.float32')], rank 1 has [('rows', (2,), "
            "'torch.float32')]" if differ == "data" else "their options: rank 0 has")
    assert first.startswith(f"init_guide_iblm with a process_group: the ranks differ in {what}")
    assert first.endswith("; call init_guide_iblm with the same options and a shard of the "
                          "same data on every rank")
