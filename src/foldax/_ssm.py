"""Structured state-space (S4 / S4D) kernels as pairwise reductions: no ``(L, N)`` intermediate."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import _checks, _eager, _shard
from ._pairwise import _block_sizes, _monoid_for, pairwise
from ._reductions._base import promote

if TYPE_CHECKING:
    from jaxtyping import Array, ArrayLike


@jax.custom_jvp
def _cauchy_term(v, z, w):
    """``v / (z - w)``, differentiated with one reciprocal instead of three divisions."""
    return v / (z - w)


@_cauchy_term.defjvp
def _cauchy_term_jvp(primals, tangents):
    v, z, w = primals
    dv, dz, dw = tangents
    r = 1 / (z - w)
    k = v * r
    return k, dv * r + k * r * (dw - dz)


def _batched(name, kernel, rows, cols, batch, block_size, axes=()):
    """``pairwise(kernel, rows, cols)`` over the broadcast ``batch``: one ``vmap`` per batch
    dimension, each over only the arrays that have it (an array shared along a batch dimension,
    such as S4's nodes ``z`` for every channel, is neither copied nor given a cotangent per
    batch element). On a mesh, ``cols`` (the poles) are this device's share, split over
    ``axes``."""
    m = _checks.concrete_rows(name, "the L axis", jax.tree.leaves(rows)[0].shape[-1])
    n = _checks.concrete_rows(name, "the N axis (states)", jax.tree.leaves(cols)[0].shape[-1])
    block = _block_sizes(name, block_size, m, n)
    monoid = _monoid_for(name, "sum", None, n)
    nb = len(batch)

    def pad(a):  # leading batch dims as in ``batch`` (size 1 where broadcast)
        return a.reshape((1,) * (nb + 1 - a.ndim) + a.shape)

    def call(rows, cols, d):
        if d == nb:
            return pairwise(name, kernel, rows, cols, monoid, block, axes)

        def axis(a):
            return 0 if a.shape[0] > 1 else None

        squeeze = lambda t: jax.tree.map(lambda a: a if a.shape[0] > 1 else a[0], t)  # noqa: E731
        inner = lambda r, c: call(r, c, d + 1)  # noqa: E731
        spec = (jax.tree.map(axis, rows), jax.tree.map(axis, cols))
        if all(x is None for x in jax.tree.leaves(spec, is_leaf=lambda x: x is None)):
            out = inner(squeeze(rows), squeeze(cols))
            return jnp.broadcast_to(out, (batch[d], *out.shape))
        return jax.vmap(inner, in_axes=spec, axis_size=batch[d])(squeeze(rows), squeeze(cols))

    return call(jax.tree.map(pad, rows), jax.tree.map(pad, cols), 0)


def _distributed(name, local, arrays, kinds, batch, axis_name, reduced="pole"):
    """Run ``local(*arrays, axes)`` on one device, inside ``shard_map`` (``axis_name`` splits the
    ``reduced`` axis), or under ``jit`` with arrays on a mesh with Explicit axes: a
    ``shard_map`` over the axes that split the batch (independent), the kept axis (independent)
    and the ``reduced`` one (partial sums, one ``psum``): the poles ``N`` for the kernels
    ``(..., L)``, the nodes ``L`` for the transpose ``(..., N)``.

    ``kinds[i]`` is ``"pole"`` or ``"node"``: what the last axis of ``arrays[i]`` is.
    """
    axes = _shard.axis_tuple(name, axis_name)
    mesh = None if axes else _shard.mesh_of(arrays)
    explicit = _shard.explicit_axes(mesh) if mesh is not None else frozenset()
    if not explicit:
        return local(*arrays, axes)
    nb = len(batch)
    batch_spec, last = [None] * nb, {"pole": None, "node": None}
    for a, kind in zip(arrays, kinds, strict=True):
        spec = list(jax.typeof(a).sharding.spec) + [None] * a.ndim
        spec = [e if e in explicit or isinstance(e, tuple) else None for e in spec[: a.ndim]]
        for i, e in enumerate(spec[:-1]):
            pos = nb - (a.ndim - 1) + i
            if e is not None and batch_spec[pos] is None and a.shape[i] == batch[pos]:
                batch_spec[pos] = e
        if spec[-1] is not None and last[kind] is None:
            last[kind] = spec[-1]
    used = [_shard.spec_axes(e) for e in (*batch_spec, last["pole"], last["node"])]
    flat = [ax for u in used for ax in u]
    if len(flat) != len(set(flat)):
        raise ValueError(
            f"{name}: the batch, node and pole axes of the inputs are split over overlapping mesh "
            f"axes ({flat}); split each over its own mesh axes, or replicate some."
        )

    def spec_of(a, kind):
        lead = [
            batch_spec[nb - (a.ndim - 1) + i]
            if a.shape[i] == batch[nb - (a.ndim - 1) + i]
            else None
            for i in range(a.ndim - 1)
        ]
        return P(*lead, last[kind])

    specs = [spec_of(a, k) for a, k in zip(arrays, kinds, strict=True)]
    split = _shard.spec_axes(last[reduced])
    kept = "node" if reduced == "pole" else "pole"
    body = lambda *arrs: local(*arrs[:-1], split)  # noqa: E731  (no consts: the last argument)
    return _shard.run_replayed(body, mesh, flat, arrays, specs, [], P(*batch_spec, last[kept]))


def _batch_shape(name, **arrays):
    try:
        return jnp.broadcast_shapes(*(jnp.shape(a)[:-1] for a in arrays.values()))
    except ValueError:
        shapes = ", ".join(f"{k} {jnp.shape(a)}" for k, a in arrays.items())
        raise ValueError(
            f"{name}: the leading (batch) dimensions must broadcast, got {shapes}."
        ) from None


def _check_1d(name, **arrays):
    for k, a in arrays.items():
        if jnp.ndim(a) < 1:
            raise ValueError(f"{name}: {k} must have at least one dimension, got a scalar.")
        if not jnp.issubdtype(jnp.result_type(a), jnp.inexact):
            raise TypeError(
                f"{name}: {k} must be floating or complex, got {jnp.result_type(a)}; cast it first."
            )


def _check_poles(name, conjugate, **pair):
    """The two ``(..., N)`` arrays share ``N``; ``conjugate=True`` needs both complex."""
    (ka, a), (kb, b) = pair.items()
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(
            f"{name}: {ka} and {kb} must have the same last size N, got {a.shape} and {b.shape}."
        )
    if conjugate and not (jnp.iscomplexobj(a) and jnp.iscomplexobj(b)):
        raise TypeError(
            f"{name}: conjugate=True adds conjugate terms, meaningless for real {ka} "
            f"({a.dtype}) and {kb} ({b.dtype}); pass complex arrays or conjugate=False."
        )


@_eager.cached(dynamic=("v", "z", "w"))
def cauchy(
    v: ArrayLike,
    z: ArrayLike,
    w: ArrayLike,
    *,
    conjugate: bool = False,
    block_size: int | tuple[int, int] | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    """S4's Cauchy kernel ``k[l] = sum_n v[n] / (z[l] - w[n])`` without the ``(L, N)`` matrix.

    .. math:: k_l = \\sum_{n<N} \\frac{v_n}{z_l - w_n}
       \\;\\Big[ + \\frac{\\bar v_n}{z_l - \\bar w_n} \\text{ if conjugate} \\Big]

    Args:
      v: residues ``(..., N)``, real or complex.
      z: evaluation nodes ``(..., L)`` (e.g. S4's transformed roots of unity).
      w: poles ``(..., N)``. The leading dimensions of ``v``, ``z``, ``w`` broadcast (e.g. ``H``
        channels with a shared ``z``).
      conjugate: static; also add the conjugate-pole terms (S4 stores only ``N/2`` poles of
        conjugate pairs). Needs complex ``v`` and ``w``.
      block_size: static int or pair: ``(L, N)`` tile per batch element (default: planned
        from the memory budget over the whole batch, enclosing ``vmap`` s included).
      axis_name: inside ``jax.shard_map`` only: the mesh axis (or tuple) splitting the poles
        ``N`` (``v``, ``w`` hold this device's); the sums are ``psum``-ed. Under ``jax.jit``,
        inputs split over the batch, ``L`` or ``N`` are distributed without it.

    Returns:
      ``(*batch, L)``, the dtype of ``v / (z - w)``.

    Memory: ``O(tile + (L + N) * batch)`` temp, forward, backward and forward-mode (each a
    streamed fold recomputing the tiles); derivatives for ``v``, ``z`` and ``w``.

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> v = jnp.array([1.0 + 0j, 2.0]); w = jnp.array([-1.0 + 1j, -2.0]); z = jnp.array([0j, 1j])
      >>> k = foldax.cauchy(v, z, w)
      >>> bool(jnp.allclose(k, (v[None, :] / (z[:, None] - w[None, :])).sum(-1)))
      True
    """
    name = "foldax.cauchy"
    _check_1d(name, v=v, z=z, w=w)
    v, z, w = jnp.asarray(v), jnp.asarray(z), jnp.asarray(w)
    _check_poles(name, conjugate, v=v, w=w)
    batch = _batch_shape(name, v=v, z=z, w=w)
    dtype = promote(v.dtype, z.dtype, w.dtype)
    v, z, w = v.astype(dtype), z.astype(dtype), w.astype(dtype)

    def kernel(zl, vw):
        vn, wn = vw
        out = _cauchy_term(vn, zl, wn)
        if conjugate:
            out = out + _cauchy_term(jnp.conj(vn), zl, jnp.conj(wn))
        return out

    def local(v, w, z, axes):
        b = _batch_shape(name, v=v, z=z, w=w)
        return _batched(name, kernel, z, (v, w), b, block_size, axes)

    return _distributed(name, local, (v, w, z), ("pole", "pole", "node"), batch, axis_name)


@_eager.cached(dynamic=("v", "x"))
def vandermonde(
    v: ArrayLike,
    x: ArrayLike,
    length: int,
    *,
    conjugate: bool = False,
    block_size: int | tuple[int, int] | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    """S4D's Vandermonde kernel ``k[l] = sum_n v[n] * exp(x[n] * l)``, ``l = 0 .. length-1``.

    .. math:: k_l = \\sum_{n<N} v_n e^{x_n l}
       \\quad\\Big[\\text{conjugate: } 2\\,\\mathrm{Re} \\sum_n v_n e^{x_n l}\\Big]

    Args:
      v: coefficients ``(..., N)`` (e.g. ``C * (exp(dt A) - 1) / A``), real or complex.
      x: exponents ``(..., N)`` (e.g. ``dt * A``). Leading dimensions broadcast.
      length: static int ``L > 0``.
      conjugate: static; add the conjugate terms, giving the real ``2 Re(...)`` (S4D keeps
        ``N/2`` of each conjugate pair). Needs complex ``v`` and ``x``.
      block_size: static int or pair, as in :func:`cauchy`.
      axis_name: as in :func:`cauchy` (``v``, ``x`` hold this device's poles).

    Returns:
      ``(*batch, L)``: complex (real when ``conjugate=True``).

    Memory: ``O(tile + (L + N) * batch)`` temp, forward and backward; gradients for ``v`` and ``x``.

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> v = jnp.array([1.0 + 0j, 0.5j]); x = jnp.array([-0.5 + 1j, -0.1 + 0j])
      >>> k = foldax.vandermonde(v, x, 4)
      >>> l = jnp.arange(4).astype(x.dtype)[:, None]  # (L, 1)
      >>> bool(jnp.allclose(k, (v[None, :] * jnp.exp(x[None, :] * l)).sum(-1)))
      True
    """
    name = "foldax.vandermonde"
    _check_1d(name, v=v, x=x)
    v, x = jnp.asarray(v), jnp.asarray(x)
    length = _checks.static_int(name, "length", length, "pass the kernel length as an int")
    if length <= 0:
        raise ValueError(f"{name}: length must be positive, got {length}.")
    _check_poles(name, conjugate, v=v, x=x)
    batch = _batch_shape(name, v=v, x=x)
    dtype = promote(v.dtype, x.dtype)
    v, x = v.astype(dtype), x.astype(dtype)

    def kernel(step, vx):
        vn, xn = vx
        out = vn * jnp.exp(xn * step.astype(xn.dtype))
        return 2 * jnp.real(out) if conjugate else out

    def local(v, x, axes):
        ls = jnp.arange(length, dtype=jnp.finfo(dtype).dtype)
        return _batched(name, kernel, ls, (v, x), _batch_shape(name, v=v, x=x), block_size, axes)

    return _distributed(name, local, (v, x), ("pole", "pole"), batch, axis_name)


@_eager.cached(dynamic=("u", "v", "x"))
def vandermonde_transpose(
    u: ArrayLike,
    v: ArrayLike,
    x: ArrayLike,
    *,
    block_size: int | tuple[int, int] | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    """The transpose of S4D's Vandermonde kernel: ``out[n] = v[n] sum_l u[l] exp(x[n] l)``.

    .. math:: \\mathrm{out}_n = v_n \\sum_{l<L} u_l \\, e^{x_n l}

    What S4 uses to map an input sequence ``u`` to a state (the adjoint of
    :func:`vandermonde`, whose ``k[l] = sum_n v[n] exp(x[n] l)``): never the ``(L, N)`` matrix.

    Args:
      u: the sequence ``(..., L)``, real or complex.
      v: coefficients ``(..., N)``.
      x: exponents ``(..., N)`` (e.g. ``dt * A``). Leading dimensions of all three broadcast.
      block_size: static int or pair ``(bn, bl)``: states by steps per tile, per batch element
        (default: planned from the memory budget, see :func:`foldax.memory_budget`).
      axis_name: inside ``jax.shard_map`` only: the mesh axis (or tuple) splitting ``L``; ``u`` is
        this device's share of the sequence (in device order) and the partial sums are added.
        Under ``jax.jit`` arrays sharded on a mesh with Explicit axes are distributed without it.

    Returns:
      ``(*batch, N)`` in the result dtype of ``u``, ``v`` and ``x``.

    Memory: ``O(tile + (L + N) * batch)`` temp, forward and backward; gradients for ``u``, ``v``
    and ``x`` (the backward pass recomputes every tile; it saves the inputs only).

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> u = jnp.array([1.0, 2.0, 0.5]); v = jnp.array([1.0 + 0j, 0.5j])
      >>> x = jnp.array([-0.5 + 1j, -0.1 + 0j])
      >>> out = foldax.vandermonde_transpose(u, v, x)
      >>> e = jnp.exp(x[:, None] * jnp.arange(3).astype(x.dtype)[None, :])  # (N, L)
      >>> bool(jnp.allclose(out, v * (e @ u.astype(x.dtype))))
      True
    """
    name = "foldax.vandermonde_transpose"
    _check_1d(name, u=u, v=v, x=x)
    u, v, x = jnp.asarray(u), jnp.asarray(v), jnp.asarray(x)
    _check_poles(name, False, v=v, x=x)
    batch = _batch_shape(name, u=u, v=v, x=x)
    dtype = promote(u.dtype, v.dtype, x.dtype)
    v, x = v.astype(dtype), x.astype(dtype)  # u keeps its dtype: cast per tile, never whole

    def kernel(vx, step_u):
        (vn, xn), (step, ul) = vx, step_u
        return vn * ul.astype(dtype) * jnp.exp(xn * step.astype(xn.dtype))

    def local(u, v, x, axes):
        length = u.shape[-1]
        first = _shard.device_index(axes) * length if axes else 0
        ls = first + jnp.arange(length, dtype=jnp.int32)
        ls = ls.astype(jnp.finfo(dtype).dtype)
        return _batched(
            name, kernel, (v, x), (ls, u), _batch_shape(name, u=u, v=v, x=x), block_size, axes
        )

    return _distributed(name, local, (u, v, x), ("node", "pole", "pole"), batch, axis_name, "node")
