"""rdq benchmark harness: ``python -m bench run --out bench/results`` (see BENCHMARKS.md)."""
