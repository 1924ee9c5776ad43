"""Benchmarks that ship with the library (``llm-foundry bench``): ``attention`` measures the
kernels, ``memory`` holds the process isolation and peak-memory readings they rely on."""

# the benchmarks' reports state the CPU they ran on: machine.py holds that fact
from llm_foundry.machine import cpu_model  # noqa: E402, F401
