"""``foldax bench``: every headline number, side by side with each peer that is installed.

One run measures every workload (memory from XLA's compiled analysis, median times after a
warm-up, errors against float64 / complex128), writes ``results.json`` with every figure and
the machine, renders ``BENCHMARKS.md`` and the plots *from that JSON*, and, when the output
folder's ``README.md`` has the results markers, its "Results" block too. Ratios always compare
numbers measured in the same run.

The parts live in private modules, re-exported here: ``_config`` (workload names, sizes,
peers, the machine), ``_progress`` (the progress bar), ``_measure`` (the workloads'
measurements), ``_overhead`` (the ``overhead`` workload), ``_noise`` (each row's spread and
load, and the marks of figures that noise may explain), ``_render`` (BENCHMARKS.md, the README
block and terminal tables), ``_plots`` (the plots) and ``_run`` (``run``, ``write``,
``render``: ``render`` also draws the plots of saved results).
"""

from ._config import BASELINE as BASELINE
from ._config import FULL as FULL
from ._config import MATPLOTLIB as MATPLOTLIB
from ._config import PEERS as PEERS
from ._config import PLOT_DIR as PLOT_DIR
from ._config import QUICK as QUICK
from ._config import README_END as README_END
from ._config import README_START as README_START
from ._config import TINY as TINY
from ._config import TINY_ENV as TINY_ENV
from ._config import WORKLOADS as WORKLOADS
from ._config import Config as Config
from ._config import available as available
from ._config import machine as machine
from ._config import machine_line as machine_line
from ._plots import plots as plots
from ._progress import Progress as Progress
from ._render import headlines as headlines
from ._render import noise_summary as noise_summary
from ._render import readme_block_of as readme_block_of
from ._render import render_markdown as render_markdown
from ._render import render_readme_block as render_readme_block
from ._render import terminal_table as terminal_table
from ._render import workload_table as workload_table
from ._run import BENCHES as BENCHES
from ._run import _steps as _steps
from ._run import render as render
from ._run import run as run
from ._run import write as write
from ._texts import NOISE_NOTE as NOISE_NOTE
from ._texts import NOTES as NOTES
from ._texts import QUICK_NOTE as QUICK_NOTE
from ._texts import TITLES as TITLES
from ._tpu import TPU_FILE as TPU_FILE
from ._versions import VERSIONS_FILE as VERSIONS_FILE
from ._versions import compare as compare
from ._versions import moved as moved
