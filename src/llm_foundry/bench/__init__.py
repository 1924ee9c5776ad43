"""Benchmarks that ship with the library (``llm-foundry bench``): ``attention`` measures the
kernels, ``memory`` holds the process isolation and peak-memory readings they rely on."""
