"""The tools around the library: the ``foldax`` command line (:mod:`.cli`), the benchmarks
(:mod:`.bench`) and the workloads they and the examples run (:mod:`.workloads`, with its demo
data). The library never imports this package."""
