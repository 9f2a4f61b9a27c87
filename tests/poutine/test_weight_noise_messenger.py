"""What LocalReparamMessenger and FlipoutMessenger share: the report of the
sites they could not treat, vectorized particles, torch.compile."""

import contextlib
import re
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal
from pyro.nn import PyroModule, PyroSample
from pyro.optim import Adam
from torch import nn

from pyro_vinit import AutoKTiedNormal
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.poutine import LocalReparamMessenger, flipout, local_reparam

HANDLERS = [local_reparam, flipout]


def _named_sites(message: str) -> set:
    return set(re.findall(r"^  '([^']+)':", message, flags=re.M))


_ATTENTION = {"net.self_attn.in_proj_weight", "net.self_attn.out_proj.weight"}


class _Encoder(PyroModule):
    # A bayesianized nn.TransformerEncoderLayer: its feed-forward layers and the
    # attention's output projection are nn.Linear, so latent, and the attention's input
    # projection is made latent by hand; both projections are used inside
    # F.multi_head_attention_forward, never by a layer call the handlers see.
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0,
                                           batch_first=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "bayesianize: the parameters")
            self.net = bayesianize(layer)
        self.net.self_attn.in_proj_weight = PyroSample(
            dist.Normal(0.0, 0.3).expand([24, 8]).to_event(2)
        )

    def forward(self, x, y=None):
        h = self.net(x).mean((-2, -1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(h, 1.0), obs=y)
        return h


@pytest.mark.parametrize("guide_class", [AutoNormal, AutoDiagonalNormal, AutoKTiedNormal])
@pytest.mark.parametrize("handler", HANDLERS)
def test_transformer_names_unreached_weight(handler, guide_class):
    x, y = torch.randn(4, 5, 8), torch.randn(4)
    model = _Encoder()
    guide = guide_class(model)
    svi = SVI(model, guide, Adam({"lr": 0.01}), Trace_ELBO())
    with pytest.raises(ValueError) as error:
        with handler(strict=True):
            svi.step(x, y)
    message = str(error.value)
    # the model's name, never the guide's internal sites (*_unconstrained, *_latent)
    assert _named_sites(message) == _ATTENTION
    assert "never reached a layer call" in message
    assert "unconstrained" not in message and "_latent" not in message

    # Without strict: one warning naming it, once per handler.
    step = handler(svi.step)
    with pytest.warns(UserWarning) as record:
        step(x, y)
    ours = [str(w.message) for w in record if "latent site(s)" in str(w.message)]
    assert len(ours) == 1 and _named_sites(ours[0]) == _ATTENTION
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(x, y)


@pytest.mark.parametrize("handler", HANDLERS)
def test_one_report_lists_untreated_and_unreached(handler):
    x = torch.randn(3, 4)

    def model():
        normal = dist.Normal(torch.zeros(2, 4), 1.0).to_event(2)
        h = F.linear(x, pyro.sample("treated", normal))
        g = F.linear(x, pyro.sample("repeated", dist.Normal(torch.zeros(1, 4), 1.0)
                                    .to_event(2)).expand(2, 4))
        scale = pyro.sample("elementwise", normal)  # 2-d, never in a layer
        bias = pyro.sample("bias", dist.Normal(torch.zeros(2), 1.0).to_event(1))  # 1-d
        return (h + g) * scale.sum(-1) + bias

    with pytest.raises(ValueError) as error:
        with handler(strict=True):
            model()
    message = str(error.value)
    assert _named_sites(message) == {"repeated", "elementwise"}
    assert "'repeated': its value is transformed (by expand)" in message
    assert "'elementwise': it never reached a layer call" in message
    with pytest.warns(UserWarning, match="2 latent site"):
        with handler():
            model()


_TOKENS = {
    # layout: (the layer call on x of shape (batch 6, tokens 4, features 3), the rows and
    # later dims the report names, or None: exact, unreported)
    "batch first": (lambda x, w: F.linear(x, w).mean(1), None),
    "tokens as rows": (lambda x, w: F.linear(x.reshape(-1, 3), w).unflatten(-2, (6, 4)).mean(-2),
                       "noise for 24 rows, the data plates observe 6 examples"),
    "tokens first": (lambda x, w: F.linear(x.transpose(0, 1), w).mean(0),
                     "noise for 4 rows (their input's dims (4, 6) left of its features), "
                     "the data plates observe 6 examples"),
    "a product": (lambda x, w: (x.reshape(-1, 3) @ w.T).reshape(6, 4, 2).mean(1),
                  "noise for 24 rows, the data plates observe 6 examples"),
}


def _token_model(layout, plate_first=False):
    # the data plate at the observation only (Pyro's tutorials) or around the layer too
    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, 3), 1.0).to_event(2))
        with pyro.plate("data", 6) if plate_first else contextlib.nullcontext():
            h = _TOKENS[layout][0](x, w)
            with contextlib.nullcontext() if plate_first else pyro.plate("data", 6):
                pyro.sample("obs", dist.Normal(h, 1.0).to_event(1), obs=y)
    return model


@pytest.mark.parametrize("plate_first", [False, True], ids=["plate at obs", "plate around"])
@pytest.mark.parametrize("layout", sorted(_TOKENS))
@pytest.mark.parametrize("handler", HANDLERS)
def test_noise_for_rows_that_are_not_the_examples_is_reported(handler, layout, plate_first):
    # An example whose rows (its tokens) draw independent noise: an outside user's
    # Monte Carlo check measured the pooled output's variance 0.26 (tokens as rows) and
    # 0.72 (tokens first) of the exact one under local_reparam, with no word said.
    x, y = torch.randn(6, 4, 3), torch.randn(6, 2)
    model = _token_model(layout, plate_first)
    expected = _TOKENS[layout][1]
    if expected is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with handler(strict=True):
                model(x, y)
        return
    with pytest.raises(ValueError) as error:
        with handler(strict=True):
            model(x, y)
    message = str(error.value)
    assert _named_sites(message) == {"w"}
    assert f"'w': {expected}." in message
    assert message.startswith(f"{handler(strict=True).__class__.__name__}: 1 latent site(s) "
                              "got per-example noise for rows of their layer's input that "
                              "are not the examples the model observes:\n")
    assert message.endswith(
        "An observation that depends on several rows (e.g. tokens flattened into rows, "
        "x.reshape(-1, features), or a (tokens, batch, features) input) sees their "
        "independent noise, so the objective is not exact. Keep each example's rows on one "
        "leading dim, e.g. (batch, tokens, features), whose later dims share the example's "
        "noise; or leave these sites out of the handler's config: their ordinary sample is "
        "exact.")
    # once per handler instance without strict, as the other reports
    messenger = handler()
    with pytest.warns(UserWarning, match="not the examples the model observes"):
        with messenger:
            model(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with messenger:
            model(x, y)


@pytest.mark.parametrize("handler", HANDLERS)
def test_rows_are_counted_against_the_data_plates_alone(handler):
    # vectorized particles: the 5 particles' plate holds the weight too, so it counts no
    # examples (5 x 6 = 30 "examples" would hide the 24 rows)
    x, y = torch.randn(6, 4, 3), torch.randn(6, 2)
    model = _token_model("tokens as rows")
    guide = AutoNormal(model)
    elbo = Trace_ELBO(num_particles=5, vectorize_particles=True, max_plate_nesting=1)
    with pytest.raises(ValueError, match="'w': noise for 24 rows, the data plates observe 6 "):
        with handler(strict=True):
            elbo.differentiable_loss(model, guide, x, y)


@pytest.mark.parametrize("handler", HANDLERS)
def test_the_rows_report_names_every_site_and_count(handler):
    # two weights on tokens as rows (one a convolution's), observed in plates of 6 and 3
    x = torch.randn(6, 4, 3)

    def model(y=None, z=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, 3), 1.0).to_event(2))
        k = pyro.sample("k", dist.Normal(torch.zeros(2, 3, 1), 1.0).to_event(3))
        h = F.linear(x.reshape(-1, 3), w).unflatten(0, (6, 4)).mean(1)
        g = F.conv1d(x.reshape(24, 3, 1), k).unflatten(0, (6, 4)).mean((1, 3))
        with pyro.plate("data", 6):
            pyro.sample("y", dist.Normal(h + g, 1.0).to_event(1), obs=y)
        with pyro.plate("pairs", 3):
            pyro.sample("z", dist.Normal((h + g).reshape(3, 4), 1.0).to_event(1), obs=z)

    with pytest.raises(ValueError) as error:
        with handler(strict=True):
            model(torch.randn(6, 2), torch.randn(3, 4))
    assert ("got per-example noise for rows of their layer's input that are not the "
            "examples the model observes:\n"
            "  'w': noise for 24 rows, the data plates observe 3 or 6 examples;\n"
            "  'k': noise for 24 rows, the data plates observe 3 or 6 examples.\n") in str(
                error.value)


@pytest.mark.parametrize("handler", HANDLERS)
def test_particles_and_a_lone_example_are_no_rows_to_report(handler):
    # a second layer's input carries the particles' dim, which its weight lines up with
    # (2 particles: a dim of size 2 is a sample dim too); a 1-d input is one example
    x, y = torch.randn(6, 3), torch.randn(6, 2)

    def model(x, y=None):
        w1 = pyro.sample("w1", dist.Normal(torch.zeros(5, 3), 1.0).to_event(2))
        w2 = pyro.sample("w2", dist.Normal(torch.zeros(2, 5), 1.0).to_event(2))
        with pyro.plate("data", 6):
            pyro.sample("obs", dist.Normal(F.linear(torch.tanh(F.linear(x, w1)), w2), 1.0)
                        .to_event(1), obs=y)

    def lone(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, 3), 1.0).to_event(2))
        with pyro.plate("data", 1):
            pyro.sample("obs", dist.Normal(F.linear(x, w)[:1], 1.0), obs=y)

    elbo = Trace_ELBO(num_particles=2, vectorize_particles=True, max_plate_nesting=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with handler(strict=True):
            elbo.differentiable_loss(model, AutoNormal(model), x, y)
        with handler(strict=True):
            lone(x[0], y[0, :1])


@pytest.mark.parametrize("handler", HANDLERS)
def test_rows_shared_by_several_observations_are_not_reported(handler):
    # the observations are per token (24 of them in two plates) and the layer's rows the
    # 6 examples: each observation depends on one example's noise, which is exact; a
    # convolution's positions are one example's, and a Predictive's draws (observed
    # sites conditioned on the guide's draw) are not data
    x = torch.randn(6, 4, 3)

    def per_token(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, 3), 1.0).to_event(2))
        with pyro.plate("tokens", 4, dim=-1), pyro.plate("data", 6, dim=-2):
            pyro.sample("obs", dist.Normal(F.linear(x, w)[..., 0], 1.0), obs=y)

    def conv(x, y=None):
        k = pyro.sample("k", dist.Normal(torch.zeros(2, 4, 3), 1.0).to_event(3))
        with pyro.plate("data", 6):
            pyro.sample("obs", dist.Normal(F.conv1d(x, k).mean((-2, -1)), 1.0), obs=y)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with handler(strict=True):
            per_token(x, torch.randn(6, 4))
        with handler(strict=True):
            conv(x, torch.randn(6))
        guide = AutoNormal(conv)
        guide(x, torch.randn(6))
        with handler(strict=True):
            pyro.infer.Predictive(conv, guide=guide, num_samples=3, parallel=True)(x)

    # sites in plates of fewer elements than the 6 rows that observe no example: a
    # pyro.deterministic record, a pyro.factor term, a latent conditioned on the guide's
    # draw (Predictive without y); the data are one event (no plate: nothing to count)
    def recorded(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, 3), 1.0).to_event(2))
        with pyro.plate("groups", 3):
            c = pyro.sample("c", dist.Normal(0.0, 1.0))
        h = F.linear(x[:, 0], w) + c.sum()
        with pyro.plate("units", 2):
            pyro.deterministic("h_mean", h.mean(0))
            pyro.factor("penalty", -h.pow(2).mean(0))
        pyro.sample("obs", dist.Normal(h, 1.0).to_event(2), obs=y)

    guide = AutoNormal(recorded)
    guide(x, torch.randn(6, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with handler(strict=True):
            Trace_ELBO().loss(recorded, guide, x, torch.randn(6, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ('obs', drawn without y, is weight-like: named)
        warnings.filterwarnings("error", "(?s).*not the examples the model observes")
        with handler():  # (as Predictive runs them)
            draws = {name: site["value"] for name, site in
                     poutine.trace(guide).get_trace(x).nodes.items() if site["type"] == "sample"}
            poutine.condition(recorded, data=draws)(x)


@pytest.mark.parametrize("handler", HANDLERS)
def test_importance_weighted_objectives_keep_the_ordinary_samples(handler):
    # RenyiELBO's bound weighs whole-model samples log p(x, w_k) - log q(w_k): an outside
    # user measured its alpha=0 loss at 42.5 under local_reparam against 13.7, unreported
    x, y = torch.randn(20, 3), torch.randn(20)

    def model(x, y=None):
        w1 = pyro.sample("w1", dist.Normal(0.0, 1.0).expand([5, 3]).to_event(2))
        w2 = pyro.sample("w2", dist.Normal(0.0, 1.0).expand([1, 5]).to_event(2))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(F.linear(torch.tanh(F.linear(x, w1)), w2)
                                           .squeeze(-1), 0.3), obs=y)

    guide = AutoKTiedNormal(model, rank=1)
    guide(x, y)
    elbo = pyro.infer.RenyiELBO(alpha=0.0, num_particles=4)
    losses = []
    for h in (contextlib.nullcontext, handler):
        pyro.set_rng_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with h():
                losses.append(elbo.loss(model, guide, x, y))
    assert losses[0] == losses[1]  # the same draws: bit-identical
    assert len(caught) == 1
    message = str(caught[0].message)
    assert _named_sites(message) == {"w1", "w2"}
    assert ("'w1': the step's RenyiELBO weighs whole-model samples of the weights against "
            "each other, which per-example noise does not draw (its bound would not be the "
            "one asked for); the ordinary sample keeps it exact. Train with Trace_ELBO or "
            "TraceMeanField_ELBO under the handler;") in message
    with pytest.raises(ValueError, match="2 latent site"):
        with handler(strict=True):
            elbo.loss(model, guide, x, y)
    with warnings.catch_warnings():  # (Trace_ELBO under the same handler: noised)
        warnings.simplefilter("error")
        with handler(strict=True):
            Trace_ELBO().loss(model, guide, x, y)


@pytest.mark.parametrize("handler", HANDLERS)
def test_no_report_after_an_error(handler):
    # An exception in the body is not masked by the report.
    def model():
        pyro.sample("w", dist.Normal(torch.zeros(2, 4), 1.0).to_event(2))
        raise KeyError("inside")

    with pytest.raises(KeyError):
        with handler(strict=True):
            model()


@pytest.mark.parametrize("handler", HANDLERS)
def test_vectorized_particles_get_per_example_noise(handler):
    # Issue 23 item 2: vectorized particles run under the handlers, each particle with its
    # own per-example noise: two identical rows differ, within and across particles,
    # where ordinary sampling (vectorized_layers) gives them one output per particle.
    from pyro_vinit import vectorized_layers

    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    x[1] = x[0]
    model = BayesianClassifier(bayesianize(mlp((4, 8, 3))))
    guide = AutoNormal(model)
    guide(x, y)
    elbo = Trace_ELBO(num_particles=3, vectorize_particles=True, max_plate_nesting=1)
    logits = {}
    for h in (handler, vectorized_layers):
        with h():
            assert torch.isfinite(elbo.differentiable_loss(model, guide, x, y))
            trace, _ = elbo._get_vectorized_trace(model, guide, (x, y), {})
        logits[h] = trace.nodes["_RETURN"]["value"]
        assert logits[h].shape == (3, 8, 3)
    assert torch.equal(logits[vectorized_layers][:, 0], logits[vectorized_layers][:, 1])
    out = logits[handler]
    assert not torch.isclose(out[:, 0], out[:, 1]).any()
    assert not torch.isclose(out[0], out[1]).any()


@pytest.mark.parametrize("elbo", [Trace_ELBO, TraceMeanField_ELBO])
@pytest.mark.parametrize("handler", HANDLERS)
def test_compiled_loss_equals_eager(handler, elbo):
    # Issue 13: torch.compile of a loss under the handler crashed (a stride-0 stand-in
    # failed Dynamo's guard). The handler runs eagerly inside the compiled function, so
    # with the same seed the loss and its gradients are those of the eager run (the
    # first, compiling call may draw a deferred weight earlier: compared from the next).
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    model = BayesianClassifier(bayesianize(mlp((4, 8, 3))))
    guide = AutoKTiedNormal(model)
    guide(x, y)
    loss_fn = elbo().differentiable_loss

    def loss(x, y):
        with handler(strict=True):
            return loss_fn(model, guide, x, y)

    compiled = torch.compile(loss, backend="eager")
    compiled(x, y)
    results = []
    for fn in (compiled, loss):
        pyro.set_rng_seed(1)
        value = fn(x, y)
        grads = torch.autograd.grad(value, list(guide.parameters()))
        results.append((value, grads))
    (value, grads), (eager_value, eager_grads) = results
    assert torch.equal(value, eager_value)
    assert all(torch.equal(g, e) for g, e in zip(grads, eager_grads))


_HEAD = ("LocalReparamMessenger: 1 latent site(s) kept their ordinary sample, shared by the "
         "whole minibatch:\n  'w': ")
_WARN_END = "\nEach site is named once per handler. Pass strict=True to make this an error."
_STRICT_END = "\n(strict=True: pass strict=False to only warn about them.)"
_NOT_DISTINCT = ("its value is transformed (by __getitem__) before the layer call into one "
                 "whose elements are not distinct drawn elements; pass the sample to the layer "
                 "as drawn, or transposed, reshaped or sliced.")


def _gathered(x):
    w = pyro.sample("w", dist.Normal(torch.zeros(3, 4), 1.0).to_event(2))
    return F.linear(x, w[[0, 0, 1]])


@pytest.mark.parametrize("model, reason", [(_gathered, _NOT_DISTINCT)],
                         ids=["repeated elements"])
def test_fallback_reports_in_full(model, reason):
    # The complete text users see, as a warning and under strict=True as an error.
    from pyro_vinit import LocalReparamMessenger

    x = torch.randn(5, 4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with LocalReparamMessenger():
            model(x)
    assert [str(w.message) for w in record] == [_HEAD + reason + _WARN_END]
    # at the user's with statement, not in torch's torch.compiler.disable wrapper of __exit__
    assert record[0].filename == __file__
    with pytest.raises(ValueError) as error, LocalReparamMessenger(strict=True):
        model(x)
    assert str(error.value) == _HEAD + reason + _STRICT_END


def _shared_bias(x):
    # The first layer cannot be treated (its weight repeats elements): its bias b is used
    # as drawn there, so the second layer, which shares b, runs on the ordinary samples.
    w1 = pyro.sample("w1", dist.Normal(torch.zeros(3, 4), 1.0).to_event(2))
    w2 = pyro.sample("w2", dist.Normal(torch.zeros(3, 4), 1.0).to_event(2))
    b = pyro.sample("b", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    return F.linear(x, w1[[0, 0, 1]], b), F.linear(x, w2, b)


_SHARED_BIAS = (
    "LocalReparamMessenger: 3 latent site(s) kept their ordinary sample, shared by the "
    "whole minibatch:\n"
    "  'w1': " + _NOT_DISTINCT[:-1] + ";\n"
    "  'w2': its layer call also uses the sample of site 'b', which this run already used "
    "as drawn, so the call runs on the ordinary samples, which is exact. Give each layer its "
    "own sample sites for per-example noise;\n"
    "  'b': this sample was already used as drawn in this run, by an earlier layer call or "
    "matrix product (a shared or tied weight) or by the model's own arithmetic (e.g. "
    "w.norm(), w[index]); every use keeps the ordinary sample, which is exact. Give each "
    "layer its own sample site for per-example noise."
)


def test_a_layer_sharing_a_sample_used_as_drawn_names_all_its_sites():
    # Regression: w2 kept its ordinary sample (with b's) but was named nowhere.
    x = torch.randn(5, 4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with poutine.trace() as tr, LocalReparamMessenger():
            out1, out2 = _shared_bias(x)
    assert [str(w.message) for w in record] == [_SHARED_BIAS + _WARN_END]
    w1, w2, b = (tr.trace.nodes[name]["value"] * 1.0 for name in ("w1", "w2", "b"))
    assert torch.equal(out1, F.linear(x, w1[[0, 0, 1]], b))
    assert torch.equal(out2, F.linear(x, w2, b))
    with pytest.raises(ValueError) as error, LocalReparamMessenger(strict=True):
        _shared_bias(x)
    assert str(error.value) == _SHARED_BIAS + _STRICT_END


def _tied(x):
    w = pyro.sample("w", dist.Normal(torch.zeros(4, 4), 1.0).to_event(2))
    return F.linear(F.linear(x, w), w)


def _linear_then_mv(x):
    w = pyro.sample("w", dist.Normal(torch.zeros(4, 4), 1.0).to_event(2))
    return F.linear(x, w) + torch.mv(w, x[0])


def _linear_then_norm(x):
    # weight normalization written on the output (outside-user trial): the norm of the
    # draw used after its layer, which had per-example noise independent of it
    w = pyro.sample("w", dist.Normal(torch.zeros(4, 4), 1.0).to_event(2))
    return F.linear(x, w) / w.norm(dim=1)


def _chunk_then_norm(x):
    # a piece of the draw in a layer, then the whole draw's norm: the pieces share the
    # draw's record of uses
    w = pyro.sample("w", dist.Normal(torch.zeros(4, 4), 1.0).to_event(2))
    return F.linear(x, w.chunk(2)[0]).sum(-1, keepdim=True) / w.norm()


def _reused_message(handler_name, op):
    return (
        f"{handler_name}: the sample of site 'w' is used a second time (by {op}) in one run, "
        "after an earlier layer call gave it per-example noise (a shared or tied weight, "
        "e.g. a siamese net, or the model's own arithmetic on it after its layer, e.g. "
        "w.norm()): per-example noise drawn at each use is not jointly exact, "
        "and the ordinary sample at this use alone would bias the objective. Leave the "
        "site out of the handler (e.g. weight_noise(config=lambda msg: None if msg['name'] "
        "== 'w' else AutoWeightNoise())): every use then keeps the ordinary sample, which "
        "is exact; or give each use its own sample site"
    )


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("model, op", [(_tied, "linear"), (_linear_then_mv, "mv"),
                                       (_linear_then_norm, "norm"), (_chunk_then_norm, "norm")],
                         ids=["tied weight", "then mv", "then norm", "a piece, then norm"])
@pytest.mark.parametrize("handler_name", ["LocalReparamMessenger", "FlipoutMessenger"])
def test_second_use_of_a_noised_draw_is_refused(handler_name, model, op, strict):
    # Issue 23 item 6: raised at the second use (strict or not), the site named, and the
    # way out (the site left out of the config) works and is exact: the ordinary draw at
    # both uses.
    import pyro_vinit
    from pyro_vinit.poutine import AutoWeightNoise, weight_noise

    cls = getattr(pyro_vinit, handler_name)
    x = torch.randn(5, 4)
    with pytest.raises(ValueError) as error, cls(strict=strict):
        model(x)
    assert str(error.value) == _reused_message(handler_name, op)
    config = lambda msg: None if msg["name"] == "w" else AutoWeightNoise()  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace = poutine.trace(weight_noise(model, config=config, strict=True)).get_trace(x)
    w = trace.nodes["w"]["value"]
    assert torch.equal(trace.nodes["_RETURN"]["value"], _plain(model, x, w))


def _plain(model, x, w):
    return poutine.condition(model, {"w": w.detach().clone()})(x)


def _lookup_then_tied_layer(x):
    # a tied embedding written with indexing (outside-user trial): the draw's rows looked
    # up, then the draw as the output layer's weight
    w = pyro.sample("w", dist.Normal(torch.zeros(4, 4), 1.0).to_event(2))
    e = torch.tanh(w[torch.tensor([0, 1, 2, 1, 3])])
    return (e + x) @ w.T


@pytest.mark.parametrize("cls", ["LocalReparamMessenger", "FlipoutMessenger"])
def test_a_draw_used_as_drawn_before_its_layer_keeps_the_ordinary_sample(cls):
    # per-example noise at the layer would be independent of the values the lookup saw
    import pyro_vinit.poutine as handlers

    x = torch.randn(5, 4)
    with pytest.warns(UserWarning, match="'w': this sample was already used as drawn"):
        with poutine.trace() as tr, getattr(handlers, cls)():
            out = _lookup_then_tied_layer(x)
    w = tr.trace.nodes["w"]["value"]
    assert torch.equal(out, _plain(_lookup_then_tied_layer, x, w))
    # a shape query or metadata read is no use of the values: the layer gets its noise
    def shape_only(x):
        w = pyro.sample("w", dist.Normal(torch.zeros(4, 4), 1.0).to_event(2))
        assert w.shape == (4, 4) and not w.is_conj() and w.untyped_storage() is not None
        return F.linear(x, w)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with poutine.trace() as tr, getattr(handlers, cls)(strict=True):
            out = shape_only(x)
    assert not torch.equal(out, _plain(shape_only, x, tr.trace.nodes["w"]["value"]))


_JOINS = {  # the model's own concatenation of a draw, in the spellings torch takes
    "cat": lambda w, b: torch.cat([b, w.flatten()]),
    "stack": lambda w, b: torch.stack((w[0], b)),
    "cat by keyword": lambda w, b: torch.cat(tensors=[b, w[:, 0]], dim=-1),
}


def _joined(join, first):
    # a layer on w, and w joined with b before (first) or after it
    def model(x):
        w = pyro.sample("w", dist.Normal(torch.zeros(4, 4), 1.0).to_event(2))
        b = pyro.sample("b", dist.Normal(torch.zeros(4), 1.0).to_event(1))
        joined = _JOINS[join](w, b).sum() if first else None
        out = F.linear(x, w)
        return out * joined if first else out + _JOINS[join](w, b).sum()

    return model


@pytest.mark.parametrize("join", list(_JOINS))
@pytest.mark.parametrize("cls", ["LocalReparamMessenger", "FlipoutMessenger"])
def test_a_draw_joined_with_others_after_its_layer_is_refused(cls, join):
    # the draw inside a list of the model's call (torch.cat([b, w])) is a use as drawn:
    # after a layer that gave it per-example noise, not jointly exact with it
    import pyro_vinit

    op = "stack" if join == "stack" else "cat"
    with pytest.raises(ValueError) as error, getattr(pyro_vinit, cls)():
        _joined(join, first=False)(torch.randn(5, 4))
    assert str(error.value) == _reused_message(cls, op)


@pytest.mark.parametrize("join", list(_JOINS))
@pytest.mark.parametrize("cls", ["LocalReparamMessenger", "FlipoutMessenger"])
def test_a_draw_joined_with_others_before_its_layer_keeps_the_ordinary_sample(cls, join):
    # ... and before it, the layer then uses the same draw (the ordinary sample, exact)
    import pyro_vinit.poutine as handlers

    joined_first = _joined(join, first=True)
    x = torch.randn(5, 4)
    with pytest.warns(UserWarning, match="'w': this sample was already used as drawn"):
        with poutine.trace() as tr, getattr(handlers, cls)():
            out = joined_first(x)
    w = tr.trace.nodes["w"]["value"]
    b = tr.trace.nodes["b"]["value"].detach().clone()
    plain = poutine.condition(joined_first, {"w": w.detach().clone(), "b": b})(x)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("cls", ["LocalReparamMessenger", "FlipoutMessenger"])
def test_a_call_with_a_draw_at_the_top_and_others_in_a_list_uses_each(cls):
    # torch.rnn_tanh(input, hx, params): a latent initial state at the top level and the
    # weights in a list, each used as drawn; a later layer on the state keeps its sample
    import pyro_vinit.poutine as handlers

    def model(x):
        w_ih = pyro.sample("w_ih", dist.Normal(torch.zeros(3, 4), 1.0).to_event(2))
        w_hh = pyro.sample("w_hh", dist.Normal(torch.zeros(3, 3), 1.0).to_event(2))
        h0 = pyro.sample("h0", dist.Normal(torch.zeros(1, 3), 1.0).to_event(2))
        out, _ = torch.rnn_tanh(x, h0, [w_ih, w_hh], False, 1, 0.0, False, False, False)
        return F.linear(out, h0)

    x = torch.randn(5, 4)
    with pytest.warns(UserWarning, match="'h0': this sample was already used as drawn"):
        with poutine.trace() as tr, getattr(handlers, cls)():
            out = model(x)
    given = {k: tr.trace.nodes[k]["value"].detach().clone() for k in ("w_ih", "w_hh", "h0")}
    assert torch.equal(out, poutine.condition(model, given)(x))


@pytest.mark.parametrize("cls", ["LocalReparamMessenger", "FlipoutMessenger"])
def test_the_pieces_of_a_split_are_layers_of_the_draws_distribution(cls):
    # w.chunk(3) of an RNN cell's fused gates, drawn at once (Flipout) or deferred (LRT):
    # each piece a layer the handler treats, none reported
    import pyro_vinit.poutine as handlers

    def model(x):
        w = pyro.sample("w", dist.Normal(torch.zeros(6, 4), 1.0).to_event(2))
        gates = [F.linear(x, piece) for piece in w.chunk(3)]
        return torch.sigmoid(gates[0]) * torch.tanh(gates[1] + gates[2])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with getattr(handlers, cls)(strict=True):
            assert model(torch.randn(5, 4)).shape == (5, 2)


@pytest.mark.parametrize("read", ["tolist", "item"])
@pytest.mark.parametrize("cls", ["LocalReparamMessenger", "FlipoutMessenger"])
def test_a_draw_read_as_numbers_before_its_layer_keeps_the_ordinary_sample(cls, read):
    # w.tolist() (say, logged) reads the values as drawn: the layer after it must use them
    import pyro_vinit.poutine as handlers

    def model(x):
        w = pyro.sample("w", dist.Normal(torch.zeros(1, 4), 1.0).to_event(2))
        numbers = w.tolist() if read == "tolist" else w[0, 0].item()
        return F.linear(x, w), numbers

    x = torch.randn(5, 4)
    with pytest.warns(UserWarning, match="'w': this sample was already used as drawn"):
        with poutine.trace() as tr, getattr(handlers, cls)():
            out, numbers = model(x)
    w = tr.trace.nodes["w"]["value"].detach().clone()
    assert torch.equal(out, F.linear(x, w))
    assert numbers == (w.tolist() if read == "tolist" else w[0, 0].item())


def test_strict_must_be_a_bool():
    from pyro_vinit import FlipoutMessenger, LocalReparamMessenger

    for cls in (LocalReparamMessenger, FlipoutMessenger):
        with pytest.raises(TypeError) as error:
            cls(strict=1)
        assert str(error.value) == f"{cls.__name__}: strict must be a bool, got 1"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rademacher_signs_follow_like(dtype):
    from pyro_vinit.poutine.noise.flipout import rademacher

    like = torch.zeros(2, dtype=dtype)
    signs = rademacher((1000,), like)
    assert signs.dtype == dtype and signs.shape == (1000,)
    assert set(signs.unique().tolist()) == {-1.0, 1.0}
    assert abs(signs.mean().item()) < 0.15  # 1000 fair signs: sd of the mean 0.032
    meta = rademacher((3,), torch.zeros(2, dtype=dtype, device="meta"))
    assert meta.device.type == "meta" and meta.dtype == dtype


_OUTSIDE = ("its value was set by an effect handler outside this one (e.g. a guide trace "
            "replayed from outside it), so the distribution that drew it is unknown; apply "
            "the handler to the whole step (e.g. to svi.step), not to the model.")
_CUSTOM = ("it is used by mv, which the handler does not treat (it treats F.linear, "
           "F.conv1d/2d/3d and matrix products of an input and a 2-d weight: matmul, @, mm, "
           "addmm, einsum with one contracted index).")


def _linear(x):
    w = pyro.sample("w", dist.Normal(torch.zeros(3, 4), 1.0).to_event(2))
    return F.linear(x, w)


def _mv_then_linear(x):
    w = pyro.sample("w", dist.Normal(torch.zeros(3, 4), 1.0).to_event(2))
    return torch.mv(w, x[0]) + F.linear(x, w), w


@pytest.mark.parametrize("handler_name", ["LocalReparamMessenger", "FlipoutMessenger"])
def test_value_set_outside_the_handler_is_used_as_set(handler_name):
    # poutine.replay outside the handler overwrites the value the handler drew: the
    # layer then runs with the replayed value, and the report says why.
    import pyro_vinit

    cls = getattr(pyro_vinit, handler_name)
    head = _HEAD.replace("LocalReparamMessenger", handler_name)
    x = torch.randn(5, 4)
    trace = poutine.trace(_linear).get_trace(x)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with poutine.replay(trace=trace), cls():
            out = _linear(x)
    assert [str(w.message) for w in record] == [head + _OUTSIDE + _WARN_END]
    assert torch.equal(out, F.linear(x, trace.nodes["w"]["value"]))
    with pytest.raises(ValueError) as error:
        with poutine.replay(trace=trace), cls(strict=True):
            _linear(x)
    assert str(error.value) == head + _OUTSIDE + _STRICT_END
    # replayed inside the handler, the handler draws nothing: no site value, no report
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with cls():
            assert torch.equal(poutine.replay(_linear, trace=trace)(x), out)


def test_custom_op_use_makes_later_layer_calls_ordinary():
    # After torch.mv used the sample, F.linear must use the same sample, as drawn.
    from pyro_vinit import LocalReparamMessenger

    x = torch.randn(5, 4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with LocalReparamMessenger():
            out, w = _mv_then_linear(x)
    assert [str(r.message) for r in record] == [_HEAD + _CUSTOM + _WARN_END]
    w = w * 1.0  # the drawn value, as a plain tensor
    assert torch.equal(out, torch.mv(w, x[0]) + F.linear(x, w))
    with pytest.raises(ValueError) as error, LocalReparamMessenger(strict=True):
        _mv_then_linear(x)
    assert str(error.value) == _HEAD + _CUSTOM + _STRICT_END


def _unused(fn, plate_size=None):
    def model():
        if plate_size is None:
            pyro.sample("s", fn)
        else:
            with pyro.plate("p", plate_size):
                pyro.sample("s", fn)

    return model


_N = dist.Normal
_WEIGHT_LIKE = {
    "2-d real": (_unused(_N(torch.zeros(2, 3), 1.0).to_event(2)), True),
    "2-d real, batch dims": (_unused(_N(torch.zeros(2, 3), 1.0)), True),
    "3-d real": (_unused(_N(torch.zeros(2, 3, 2), 1.0).to_event(3)), True),
    "1-d real": (_unused(_N(torch.zeros(3), 1.0).to_event(1)), False),
    "scalar": (_unused(_N(0.0, 1.0)), False),
    "2-d positive": (_unused(dist.HalfNormal(torch.ones(2, 3)).to_event(2)), False),
    "2-d positive, batch dims": (_unused(dist.LogNormal(torch.zeros(2, 3), 1.0)), False),
    "plate x 1-d event": (_unused(_N(torch.zeros(3), 1.0).expand([4, 3]).to_event(1), 4), False),
    "plate x 2-d event": (_unused(_N(torch.zeros(2, 3), 1.0).expand([4, 2, 3]).to_event(2), 4),
                          True),
    "plate, no event": (_unused(_N(torch.zeros(4), 1.0), 4), False),
}


@pytest.mark.parametrize("case", sorted(_WEIGHT_LIKE))
@pytest.mark.parametrize("handler", HANDLERS)
def test_unreached_weight_like_sites_are_named(handler, case):
    # Weight-like: real-valued with two or more dims of its own (a plate's dim is not).
    model, named = _WEIGHT_LIKE[case]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with handler():
            model()
    messages = [str(w.message) for w in record]
    if named:
        assert len(messages) == 1 and _named_sites(messages[0]) == {"s"}
        assert "'s': " + _NEVER in messages[0]
    else:
        assert messages == []


_NEVER = ("it never reached a layer call the handler sees (F.linear, F.conv1d/2d/3d or a "
          "matrix product with one weight, e.g. nn.Linear, x @ w), or only as the operand of "
          "another operation first (tau * w: sample w from Normal(0, tau) instead); e.g. "
          "nn.MultiheadAttention uses its projection weights inside "
          "F.multi_head_attention_forward")


@pytest.mark.parametrize("handler", HANDLERS)
def test_latent_inputs_and_biases_of_plain_layers(handler):
    # A plain nn.Linear fed a latent input (a VAE's decoder) or given a latent bias only:
    # the layer call is seen (a site value takes part) and runs as written.
    decoder = nn.Linear(3, 4)

    def model():
        with pyro.plate("data", 5):
            z = pyro.sample("z", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        b = pyro.sample("b", dist.Normal(torch.zeros(4), 1.0).to_event(1))
        return decoder(z), F.linear(z, decoder.weight, b)

    with pyro.poutine.trace() as tr, warnings.catch_warnings():
        warnings.simplefilter("error")
        with handler(strict=True):
            out, out_bias = model()
    z, b = (tr.trace.nodes[name]["value"] * 1.0 for name in ("z", "b"))
    assert torch.equal(out, decoder(z))
    assert torch.equal(out_bias, F.linear(z, decoder.weight, b))
    # a dict config, which the handler reads the layer calls' sites for (a plain weight
    # has none): the same
    from pyro_vinit.poutine import LocalReparam, weight_noise

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a config naming a plain layer's bias is reported)
        with weight_noise(config={"b": LocalReparam()}):
            model()


def _index_from_the_draw(w):
    # rows 0-2 chosen by a value of row 3: the elements used depend on other elements
    idx = w[3].argmax()
    return w[:3][idx:idx + 1]


DEPENDENT_USES = {
    "expanded row": lambda w: w[:1].expand(2, 3),
    "slice bounds from the draw": _index_from_the_draw,
    "expanded, slice bounds from the draw": lambda w: _index_from_the_draw(w).expand(2, 3),
}


def test_the_programs_arithmetic_on_a_value_that_is_no_view_claims_the_whole_draw():
    # w[:1].expand(2, 3) repeats row 0 (no view of the draw); its use in the program's own
    # arithmetic claims every row, as a layer call on it would, so the layer on rows 1+
    # keeps the ordinary sample too
    x = torch.randn(50, 3)

    def model():
        w = pyro.sample("w", dist.Normal(torch.zeros(4, 3), 1.0).to_event(2))
        return w[:1].expand(2, 3).exp().sum() + F.linear(x, w[1:]).sum()

    with pytest.raises(ValueError, match="'w': this sample was already used as drawn"):
        with LocalReparamMessenger(strict=True):
            model()


@pytest.mark.parametrize("use", sorted(DEPENDENT_USES))
def test_a_use_that_is_no_view_claims_the_whole_draw(use):
    # A weight used through an op that is not a view of the draw (repeated elements, or
    # elements chosen by the draw's own values) runs with the ordinary sample, and so does
    # every later layer on the same draw: independent per-example noise for rows 3+ would
    # lose their correlation with the first use (here, through the row it chose).
    x = torch.randn(50, 3)

    def model():
        w = pyro.sample("w", dist.Normal(torch.zeros(4, 3), 1.0).to_event(2))
        return F.linear(x, DEPENDENT_USES[use](w)), F.linear(x, w[3:])

    # (where the draw's own values chose the slice, argmax used row 3 as drawn first)
    reason = "this sample was already used as drawn" if "slice" in use else "its value is tra"
    with pyro.poutine.trace() as tr, pytest.warns(UserWarning, match=f"'w': {reason}"):
        with LocalReparamMessenger():
            first, rest = model()
    w = tr.trace.nodes["w"]["value"] * 1.0
    assert torch.equal(first, F.linear(x, DEPENDENT_USES[use](w)))
    assert torch.equal(rest, F.linear(x, w[3:]))
