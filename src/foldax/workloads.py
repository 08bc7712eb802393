"""The workloads foldax was built for, ready to run: what ``foldax demo``, ``foldax bench`` and
the examples compute.

The ragged log-sum-exp of a gravitational-wave population analysis: ~1.16 M rows in 123
contiguous segments of unequal sizes (:func:`seed_sizes`), a model ``f(theta, x)``
(:func:`model`) evaluated per row for a batch of ``theta``, and per segment
``logsumexp(f) - log(size)``, vmapped over ``theta`` and differentiated. :func:`seed_problem`
builds the data; the ``way_*`` functions are ways to compute it (foldax's, and the usual
plain-JAX ones), each ``(theta, x) -> (S,)``; :func:`forward_and_grad` vmaps one over a batch
of ``theta``, with its gradient.

Run on 8 host devices (the distributed example): ``python -m foldax.workloads sharded REPEAT
REPEATS [SHRINK]`` prints the one- and eight-device measurements as JSON.

>>> from foldax import workloads
>>> problem = workloads.seed_problem(shrink=1000)
>>> fwd, grad = workloads.forward_and_grad(workloads.way_foldax(problem.sizes))
>>> fwd(problem.thetas, problem.x).shape
(10, 123)
"""

import sys

from ._tools.workloads import FEATURES as FEATURES
from ._tools.workloads import SeedProblem as SeedProblem
from ._tools.workloads import forward_and_grad as forward_and_grad
from ._tools.workloads import model as model
from ._tools.workloads import seed_problem as seed_problem
from ._tools.workloads import seed_sizes as seed_sizes
from ._tools.workloads import way_foldax as way_foldax
from ._tools.workloads import way_foldax_padded as way_foldax_padded
from ._tools.workloads import way_global_max as way_global_max
from ._tools.workloads import way_pad_scan as way_pad_scan
from ._tools.workloads import way_slicing_loop as way_slicing_loop

if __name__ == "__main__":
    from ._tools import workloads as _workloads

    sys.exit(_workloads.main(sys.argv[1:]))
