"""Stage ``env``: what machine the numbers come from (device, memory, SMs, peak and measured copy bandwidth) and the
versions of everything that ran (the lent machine's torch and Triton are not ours)."""

from __future__ import annotations

import importlib.metadata
import platform
import shutil
import subprocess

import torch

from .record import StageRecord
from .timing import bench

__all__ = ["PEAK_BANDWIDTH", "headline", "peak_bandwidth", "run"]

# Peak HBM bandwidth (bytes/s) by device name, for a torch that does not report the memory clock and bus width:
# the vendors' data sheets (SXM parts; PCIe H100 has 2.0 TB/s).
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100": 2.039e12, "L40S": 0.864e12}


def peak_bandwidth(device: torch.device) -> tuple[float | None, str]:
    """``(bytes/s, where it came from)``: torch's memory clock x bus width x 2 (DDR) when it reports them, else
    :data:`PEAK_BANDWIDTH` by name."""
    if device.type != "cuda":
        return None, "not a CUDA device"
    props = torch.cuda.get_device_properties(device)
    clock, bus = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
    if clock and bus:
        return 2 * clock * 1e3 * bus / 8, "memory clock x bus width (torch)"
    for name, value in PEAK_BANDWIDTH.items():  # the longest names first where they share a prefix
        if name in props.name:
            return value, f"data sheet ({name})"
    return None, f"unknown for {props.name}"


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    query = "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.memory,power.limit"
    try:
        return subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes`` (read + write counted), median of repeats: the practical
    ceiling a memory-bound kernel can approach."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    seconds = bench(lambda: dst.copy_(src), device).median_s
    return 2 * nbytes / seconds


def run(record: StageRecord, device: str, smoke: bool) -> None:
    dev = torch.device(device)
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **{name: _version(name) for name in ("triton", "transformers", "accelerate", "hf-kvcache", "numpy")},
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        peak, source = peak_bandwidth(dev)
        info |= {
            "device_name": props.name,
            "capability": f"sm_{props.major}{props.minor}",
            "memory_bytes": props.total_memory,
            "sms": props.multi_processor_count,
            "l2_bytes": getattr(props, "L2_cache_size", None),
            "peak_bandwidth": peak,
            "peak_bandwidth_source": source,
            "nvidia_smi": _nvidia_smi(),
        }
    else:
        info |= {"device_name": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    record.info |= info
    record.save()
    size = 2**26 if smoke or dev.type != "cuda" else 2**30
    record.add({"measure": "copy bandwidth", "bytes": size, "bytes_per_s": copy_bandwidth(dev, size)})


def headline(record: dict) -> list[str]:
    info = record.get("info", {})
    lines = [
        f"{info.get('device_name')} ({info.get('capability', '')}), torch {info.get('torch')}, "
        f"triton {info.get('triton')}, transformers {info.get('transformers')}"
    ]
    for item in record.get("items", []):
        peak = info.get("peak_bandwidth")
        share = f" = {item['bytes_per_s'] / peak:.0%} of peak" if isinstance(peak, (int, float)) and peak else ""
        lines.append(f"copy bandwidth {item['bytes_per_s'] / 1e9:.0f} GB/s{share}")
    return lines
