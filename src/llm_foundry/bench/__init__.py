"""Benchmarks that ship with the library (``llm-foundry bench``): ``attention`` measures the
kernels, ``memory`` holds the process isolation and peak-memory readings they rely on."""


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), which benchmark reports must state."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
