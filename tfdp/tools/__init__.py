"""Tools around training: the `tfdp` command line, the launcher, emulated hosts, benchmarks, the advisor."""
