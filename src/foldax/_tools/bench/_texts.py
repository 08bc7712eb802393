"""The words of ``foldax bench``'s reports: each workload's title and note, and what a quick
run and the noise marks say."""

TITLES = {
    "seed": "The ragged logsumexp under vmap: per-segment logsumexp(f(theta, x)) - log(size), "
    "vmapped over 10 theta",
    "likelihood": "The same likelihood with a pair of row arrays: per-segment "
    "logsumexp(f(theta, x) - log_prior) - log(size), vmapped over 10 theta",
    "precomputed": "Precomputed data: segment logsumexp of float32 values",
    "graph": "A graph network's messages, float32: E edges reduced to V receiver nodes",
    "s4": "S4's Cauchy kernel, complex64 (forward k = cauchy(v, z, w); gradient of sum |k|^2)",
    "gaussian": "Gaussian kernel, D = 3, float32",
    "nearest": "Nearest neighbours: squared distance, D = 3, float32 (min, argmin, k-min)",
    "attention": "Exact attention, float32 (pairwise_reduce softmax vs jax.nn.dot_product_attention)",
    "packed": "Packed-sequence causal attention, float32: 16 documents in one sequence, one head",
    "overhead": "What a call costs beside its work: eager call, jitted call and compile time",
    "sharded": "The ragged logsumexp on 8 host CPU devices (rows split over a mesh), per-device "
    "memory",
    "keops_users": "What KeOps' users write, float32 on CPU: kernel matrix times V, k-NN, "
    "Chamfer with its gradient, and the machine's floor",
    "lm_loss": "A language model's loss from its hidden states and unembedding (linear "
    "cross-entropy), float32 and bfloat16, against the GEMM floor",
}


NOTES = {
    "seed": "Ways: `slicing loop` (materialize f, one dynamic slice + logsumexp per segment; "
    "left out at N x 10, where its 1230 slices take minutes to compile), `global-max "
    "segment_sum` (the usual stable way: one global max, then `jax.ops.segment_sum` of exp), "
    "`pad-and-scan` (pad every segment to the largest, `lax.scan` over segments with a masked "
    "logsumexp), `foldax` "
    "(`segment_logsumexp(x, sizes=..., fn=model)`). Gradient: of the per-segment sum with "
    "respect to theta.",
    "likelihood": "The rows come as two arrays, the features `x` (N, 5) and a per-row "
    "`log_prior` (N,), passed to foldax as one pytree: `segment_logsumexp((x, log_prior), "
    "sizes=..., fn=lambda rows: model(theta, rows[0]) - rows[1])`. Same model, sizes and "
    "ways as above, each way's calls timed in turns; the baseline is the pad-and-scan a "
    "user writes when the padded copy fits. Gradient: of the per-segment sum with respect "
    "to theta.",
    "precomputed": "The floor is `jnp.exp(x).sum()`: one pass over the data, no segments. "
    "torch runs on the same CPU with its default threads.",
    "graph": "Plain data (messages already computed) reduced by receiver: `unsorted ids` as "
    "edges come, `sorted ids` with `indices_are_sorted=True` on both sides, `sizes` for foldax "
    "against the same sorted ids with the hint for the peer. The peer is the program a user "
    "writes with `jax.ops` (for the softmax, jraph's `segment_softmax`: max, gather, exp, sum, "
    "gather, divide; for the log-softmax, `x - max` less the gathered log of that sum). "
    "Gradient: of the sum of the result times fixed random weights.",
    "gaussian": "`sum_j exp(-|x_i - y_j|^2)` and `logsumexp_j(-|x_i - y_j|^2)`. XLA fuses the dense "
    "sum into its reduction (0 B temp) but not the logsumexp; pykeops' memory is not XLA's.",
    "nearest": "`min_j |x_i - y_j|^2`, its `argmin` and the k nearest for k = 5 to 128 "
    "(`reduction=\"kmin\"`, pykeops' `Kmin_argKmin`), each reduction's two ways timed in "
    "turns. The error column of argmin and k-min is "
    "the fraction of indices that differ from NumPy's on float64 distances (near-ties may "
    "round either way in float32). foldax spreads each step's large fusions over XLA:CPU's "
    "threads, pykeops runs one loop per thread: on a shared 2-core virtual machine, where "
    "waking a thread sometimes costs far more than usual, foldax's times can double from one "
    "run to the next while pykeops' stay put; on one core (`taskset -c 0`) both are steady.",
    "packed": "`foldax.dot_product_attention(q, k, v, is_causal=True, segment_ids=ids)` (each "
    "token attends to the earlier tokens of its own document; blocks across documents are "
    "skipped, listed from each block's range of ids) against `jax.nn.dot_product_attention` "
    "with the same mask as an `(L, L)` boolean array built from the ids in the jitted function, "
    "and against foldax with the causal mask alone (what the documents save). Gradient: of "
    "the sum of the output, with respect to q, k and v.",
    "overhead": "Each case names the op a user would call without foldax (`without foldax`). "
    "`eager call`: the function called directly, as in a notebook or a Python loop (foldax runs "
    "a cached executable: the same shapes, static arguments and `fn` / `kernel` structure "
    "compile once). `jitted call`: `jax.jit` of the function, after its first call (dispatch "
    "and run). `compile`: trace, lower and compile a new `jax.jit` of it. Small calls are "
    "mostly overhead; the 100,000-row calls also show the work.",
    "keops_users": "Inputs standard normal (the 784-D k-NN: uniform pixels in [0, 1)), fixed "
    "seeds; foldax jitted, pykeops' `LazyTensor`s, each case's two ways timed in turns. Kernel "
    "matrix times V: `pairwise_reduce(lambda a, b: jnp.exp(-jnp.sum((a - b[0]) ** 2)) * b[1], "
    "x, (y, V))` against `K @ V` with `K = (-((x_i - y_j) ** 2).sum(-1)).exp()`; error: the "
    "largest error relative to the largest magnitude of its column (entries of a kernel matrix "
    'times random-signed vectors can be near 0). k-NN: `reduction="kmin", k=10` of '
    "`jnp.sum((a - b) ** 2)` against `Kmin_argKmin(10, 1)`; error: the fraction of indices that "
    'differ from `np.argsort(d, kind="stable")[:, :10]` on float64 distances. Chamfer: '
    "`mean(min_j |x_i - y_j|^2) + mean(min_i |x_i - y_j|^2)` per pair, foldax's "
    "`jax.jit(jax.vmap(jax.value_and_grad(chamfer, (0, 1))))` against pykeops' batched "
    "LazyTensors `(B, N, 1, 3)`, `(B, 1, M, 3)` with torch's autograd: KeOps does not "
    "differentiate a min reduction, so its users take `argmin` and gather the distances in "
    "torch; error: the loss of the first pair against float64. Floor: the rates of `exp` and "
    "of float32 multiply-adds (those of a matrix product: the vector units' peak) measured in the "
    "same run, timed in turns with foldax's Gaussian sum; the ratio of those rows is relative "
    "to the floor (foldax's time / the floor's).",
    "lm_loss": "`mean_t(logsumexp_v(h_t . w_v) - h_t . w_{label_t})` for hidden states `h` "
    "(T, D) standard normal, an unembedding `w` (V, D) normal with variance 1 / D (logits of unit "
    "scale) and labels uniform in [0, V), fixed seeds (bfloat16: the same values rounded). "
    '`plain (T x V logits)` is what a user writes: `z = jnp.einsum("td,vd->tv", h, w, '
    "preferred_element_type=jnp.float32)`, `jax.nn.logsumexp(z, -1)` less the label's logit by "
    "`take_along_axis`, averaged; against `foldax.linear_cross_entropy(h, w, labels)` and, "
    "where they import (both need jax >= 0.11), Tokamax's "
    '`linear_softmax_cross_entropy_loss(..., implementation="chunked_xla")` (its `w` is '
    "(D, V): passed in that layout, transposed before the timing) and jax-cce's "
    "`linear_cross_entropy`, each with its defaults. Forward: the jitted loss; gradient: the "
    "jitted `jax.value_and_grad(loss, (0, 1))`; each pass's ways timed in turns after a "
    "warm-up, medians of `lm_repeats` rounds (3 in a full run: a round of the largest case "
    "takes about a minute on 2 cores). Compile: the first call's trace, lower and compile. "
    "Errors against float64 NumPy on the same values: the loss; the gradients on 64 rows of "
    "`dh` and about 64 rows of `dw` (half of them rows of labels), each relative to its "
    "rows' largest magnitude. `GEMM floor`: one jitted float32 `h @ w.T` of the same shapes "
    "(writing its (T, V) product), timed in turns with the forward ways; the gradient's floor is "
    "3 of them (the plain gradient's three products: the logits, `dh` and `dw`). The last "
    "column but one is the floor's time over the way's (1: as fast as the products alone). "
    "Tokamax's `chunked_xla` pads V to a multiple of its 2048-row vocabulary block and counts the "
    "padding's zero logits in the log-sum-exp (a wrong loss for other V): every V here is such a "
    "multiple. On a CPU with bfloat16 matrix units (this one has AMX), XLA multiplies bfloat16 "
    "matrices faster than float32 ones: there the float32 floor is no floor for the bfloat16 "
    "rows.",
    "sharded": "One process with `XLA_FLAGS=--xla_force_host_platform_device_count=8`: the same "
    "program on one device and with the rows split over 8 (N padded to a multiple of 8, padding "
    "rows dropped by id). The 8 simulated devices share this machine's cores: the time ratio "
    "shows 8 device programs keeping the cores busy, not more hardware.",
}


#: What a quick run's text says of its sizes.
QUICK_NOTE = (
    "A quick run (`foldax bench --quick`): smaller sizes than a full run's (`foldax bench`), so "
    "these figures compare with each other, not with those of a full run."
)
#: What the README block says of the noise marks, where the results record them.
NOISE_NOTE = (
    "A ratio marked *within noise* compares two ways whose runs' ranges overlap (no measured "
    "difference); *busy machine*: measured while the load average exceeded the cores."
)
