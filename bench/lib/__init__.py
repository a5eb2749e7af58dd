"""The benchmarks' library: workload, samples, presets, drivers, metrics, sweeps, plots and
the environment a result records. The scripts in bench/ are thin commands over it; engine
benchmarks here need nothing beyond torch and the standard library (a bare GPU machine)."""
