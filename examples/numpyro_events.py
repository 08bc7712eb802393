"""A numpyro population model whose likelihood is a per-event ``foldax.segment_logmeanexp``.

Each of ``E`` events (123 by default) comes with its own number of samples ``x`` (5 features),
``N`` = 1,159,351 rows in all, stored contiguously, events of very unequal sizes. The population
likelihood of the hyper-parameters ``theta = (mu, log_sigma)`` is, per event, the mean over that
event's samples of the population density ``p(x | theta)``, i.e. a ragged log-mean-exp:

    log L(theta) = sum_e [ logsumexp_{i in e} log p(x_i | theta) - log(n_e) ]

This script samples ``theta`` with NUTS, then prints the XLA temp memory of the gradient of the
model's potential (what NUTS evaluates at every leapfrog step), with foldax and with the usual
padded way (every event padded to the largest, a masked logsumexp), for one chain and for 4
chains ``vmap``-ed (numpyro's ``chain_method="vectorized"``).

    pip install -e '.[examples]'
    python examples/numpyro_events.py          # about 5 minutes on 2 CPU cores
    python examples/numpyro_events.py --smoke  # 1/100 of the rows, about 20 s
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS
from numpyro.infer.util import initialize_model

import foldax
from foldax.memory import format_bytes, report

FEATURES = 5
TRUE_MU = np.array([0.5, -0.3, 1.0, 0.0, -1.2], np.float32)
TRUE_SIGMA = np.array([1.0, 0.7, 1.5, 0.5, 1.2], np.float32)


def make_events(n_events=123, n_rows=1_159_351, seed=0):
    """Event sizes (unequal, summing to ``n_rows``) and the ``(N, 5)`` samples, event after event."""
    rng = np.random.default_rng(seed)
    weights = rng.lognormal(0.0, 1.0, n_events)
    sizes = np.maximum(1, np.floor(weights / weights.sum() * n_rows)).astype(int)
    sizes[np.argmax(sizes)] += n_rows - sizes.sum()
    centres = TRUE_MU + TRUE_SIGMA * rng.standard_normal((n_events, FEATURES))
    x = np.repeat(centres, sizes, axis=0) + 0.3 * rng.standard_normal((n_rows, FEATURES))
    return sizes.tolist(), jnp.asarray(x, jnp.float32)


def log_density(mu, log_sigma, x):
    """``log p(x | theta)`` of every row: ``(C, 5) -> (C,)``."""
    z = (x - mu) * jnp.exp(-log_sigma)
    return jnp.sum(-0.5 * z**2 - log_sigma, axis=-1) - 0.5 * FEATURES * np.log(2 * np.pi)


def model_foldax(x, sizes):
    """The population model, its likelihood streamed by foldax (no ``(N,)`` array of densities)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0).expand([FEATURES]).to_event(1))
    log_sigma = numpyro.sample("log_sigma", dist.Normal(0.0, 1.0).expand([FEATURES]).to_event(1))
    per_event = foldax.segment_logmeanexp(
        x, sizes=sizes, fn=lambda rows: log_density(mu, log_sigma, rows)
    )  # (E,)
    numpyro.factor("events", per_event.sum())


def pad_events(x, sizes):
    """The padded layout: ``(E, max size, 5)`` samples and an ``(E, max size)`` mask."""
    big, starts = max(sizes), np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rows = np.minimum(starts[:, None] + np.arange(big), sum(sizes) - 1)
    mask = np.arange(big) < np.asarray(sizes)[:, None]
    return jnp.asarray(x)[rows], jnp.asarray(mask)


def model_padded(x_padded, mask, log_n):
    """The same model, every event padded to the largest and a masked logsumexp."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0).expand([FEATURES]).to_event(1))
    log_sigma = numpyro.sample("log_sigma", dist.Normal(0.0, 1.0).expand([FEATURES]).to_event(1))
    logp = jnp.where(mask, log_density(mu, log_sigma, x_padded), -jnp.inf)  # (E, max size)
    numpyro.factor("events", (jax.nn.logsumexp(logp, axis=1) - log_n).sum())


def potential_grad_temp(model, *args, chains=1):
    """XLA temp bytes of the gradient of ``model``'s potential, ``vmap``-ed over ``chains``."""
    init, potential_fn, _, _ = initialize_model(
        jax.random.key(0), model, model_args=args, dynamic_args=True
    )
    grad = jax.grad(potential_fn(*args))
    params = init.z
    if chains > 1:
        params = jax.tree.map(lambda p: jnp.broadcast_to(p, (chains, *p.shape)), params)
        grad = jax.vmap(grad)
    return report(grad, params).temp_bytes


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--smoke", action="store_true", help="1/100 of the rows, about 20 s")
    parser.add_argument("--warmup", type=int, default=300, help="NUTS warm-up steps")
    parser.add_argument("--samples", type=int, default=300, help="NUTS samples kept")
    args = parser.parse_args(argv)
    n_rows, warmup, samples = 1_159_351, args.warmup, args.samples
    if args.smoke:
        n_rows, warmup, samples = 11_593, 50, 50
    sizes, x = make_events(n_rows=n_rows)
    print(
        f"{len(sizes)} events, N = {sum(sizes):,} samples in all "
        f"(smallest event {min(sizes):,}, largest {max(sizes):,})"
    )

    t0 = time.perf_counter()
    mcmc = MCMC(NUTS(model_foldax), num_warmup=warmup, num_samples=samples, progress_bar=False)
    mcmc.run(jax.random.key(1), x, sizes)
    post = jax.block_until_ready(mcmc.get_samples())
    print(f"NUTS, {warmup} warm-up + {samples} samples: {time.perf_counter() - t0:.0f} s")
    for name, truth in (("mu", TRUE_MU), ("sigma", TRUE_SIGMA)):
        est = post["mu"] if name == "mu" else jnp.exp(post["log_sigma"])
        print(f"  {name:5s} posterior mean {np.round(np.asarray(est.mean(0)), 2)}  (true {truth})")

    x_padded, mask = pad_events(x, sizes)
    log_n = jnp.log(jnp.asarray(sizes, jnp.float32))
    print(
        f"\nXLA temp memory of the potential's gradient (padded layout: {len(sizes)} x "
        f"{max(sizes):,} rows, {x_padded.size / x.size:.1f}x the data):"
    )
    for chains in (1, 4):
        fx = potential_grad_temp(model_foldax, x, sizes, chains=chains)
        pad = potential_grad_temp(model_padded, x_padded, mask, log_n, chains=chains)
        print(
            f"  {chains} chain(s): foldax.segment_logmeanexp {format_bytes(fx):>9s}   "
            f"padded + masked logsumexp {format_bytes(pad):>9s}   ({pad / max(fx, 1):.0f}x)"
        )


if __name__ == "__main__":
    main()
