"""What machine a result came from: every saved result carries this description."""
from __future__ import annotations

import os
import platform
import sys
import threading
from importlib import metadata

import torch


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def describe(device: str) -> dict:
    """A JSON-able description of this machine for ``device`` ("cpu" or "cuda")."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = {
        "cpu": cpu_model(),
        "cpu_cores": cores,
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "versions": {name: _version(name) for name in ("torch", "triton", "transformers", "fusedce")},
    }
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    info["name"] = info.get("gpu") or f"{info['cpu']} ({cores} cores)"
    info["peak_gbps"] = peak_bandwidth_gbps(info.get("gpu", ""))
    info["cpu_bf16"] = cpu_capabilities()
    return info


def cpu_capabilities() -> dict:
    """``fusedce.core.bf16_products.cpu_bf16_capabilities()`` plus ``avx2`` / ``avx512f``: what the bf16 rows'
    times and the RL-precision figures depend on."""
    from fusedce.core.bf16_products import cpu_bf16_capabilities
    facts = {k: v for k, v in cpu_bf16_capabilities().items() if k != "cpu"}
    flags = _cpu_flags()
    return {**facts, "avx2": "avx2" in flags, "avx512f": "avx512f" in flags}


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def capabilities_text(machine: dict) -> str:
    """The CPU's vector units and bf16 GEMM mode in a few words (every table header names them), e.g.
    ``"AVX2 only (no AVX-512, no AMX); bf16 GEMM mode off"``; an old result without them says so."""
    caps = machine.get("cpu_bf16")
    if not caps:
        return "CPU capabilities not recorded"
    units = [name for name, key in (("AMX", "amx"), ("AVX512-BF16", "avx512_bf16")) if caps.get(key)]
    if not units:
        base = "AVX-512" if caps.get("avx512f") else "AVX2" if caps.get("avx2") else "no AVX2"
        units_text = f"{base} only (no AMX, no AVX512-BF16)"
    else:
        units_text = " + ".join(units) + ("" if caps.get("amx") else " (no AMX)")
    mode = "on: fp32 GEMMs of bf16 values run on the bf16 units" if caps.get("bf16_gemm_mode") else "off"
    return f"{units_text}; bf16 GEMM mode {mode}"


def header(device: str, machine: dict) -> str:
    """The machine line under every table title: device, name (cores), and on a CPU its capabilities."""
    text = f"{device}: {machine['name']}"
    if machine.get("gpu"):
        return text
    return f"{text}; {capabilities_text(machine)}"


# Memory bandwidth from the vendors' datasheets (GB/s), to put a kernel's GB/s in proportion.
# Matched by substring of the device name, most specific first; unknown devices get None.
PEAK_GBPS = (("H200", 4800), ("H100 PCIe", 2000), ("H100", 3350), ("A100-SXM4-80GB", 2039),
             ("A100 80GB PCIe", 1935), ("A100", 1555), ("L40S", 864), ("L4", 300),
             ("RTX 4090", 1008), ("RTX 3090", 936))


def peak_bandwidth_gbps(device_name: str):
    """Datasheet memory bandwidth of a GPU named ``device_name`` in GB/s, or None if unknown."""
    for key, gbps in PEAK_GBPS:
        if key in device_name:
            return gbps
    return None


def _load_1min():
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


class LoadSampler:
    """Samples the 1-minute load average every ``interval`` seconds on a daemon thread while the bench measures, so
    that its "busy machine" warning reports the worst load of the run, not the load at its end."""

    def __init__(self, interval: float = 5.0, read=_load_1min):
        self.interval, self._read = interval, read
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fusedce-load-sampler", daemon=True)

    def _sample(self) -> None:
        load = self._read()
        if load is not None:
            self.samples.append(round(float(load), 2))

    def _run(self) -> None:
        self._sample()
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()   # the load at the end, too

    def summary(self) -> dict:
        """``load_average_1min_max`` / ``_mean`` over the samples, their count and the interval."""
        n = len(self.samples)
        return {"load_average_1min_max": max(self.samples) if n else None,
                "load_average_1min_mean": round(sum(self.samples) / n, 2) if n else None,
                "load_samples": n, "load_sample_interval_s": self.interval}


def busy_warning(machine: dict):
    """The "machine was busy" sentence for a saved ``machine`` description, or None: the worst sampled
    load of the run (``LoadSampler``) if there is one, else the load at the end, against the cores."""
    cores = machine.get("cpu_cores")
    worst = machine.get("load_average_1min_max")
    load = worst if worst is not None else machine.get("load_average_1min")
    if not (load and cores and load > cores):
        return None
    if worst is None:
        return f"warning: the machine was busy (load average {load} on {cores} cores); times are noisy"
    return (f"warning: the machine was busy (1-minute load average up to {worst}, mean "
            f"{machine.get('load_average_1min_mean')}, on {cores} cores; sampled every "
            f"{machine.get('load_sample_interval_s'):g} s through the run); times are noisy")
