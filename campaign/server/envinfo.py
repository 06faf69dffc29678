"""One-time capture of where a run happened: tool version and commit, machine, GPUs (via NVML)."""

from __future__ import annotations

import platform
import subprocess
from typing import Any

import psutil

from campaign import __version__
from campaign.server import gpu
from campaign.server.profiles import PROJECT_ROOT


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=5,  # noqa: S607
                             check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def tool_info() -> dict[str, Any]:
    status = _git("status", "--porcelain", "--", "campaign", "matrices", "launch_profiles")
    return {"name": "vllm-campaign", "version": __version__, "git_commit": _git("rev-parse", "HEAD"),
            "git_dirty": bool(status) if status is not None else None}


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine_info() -> dict[str, Any]:
    return {
        "hostname": platform.node(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": psutil.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": gpu.machine_facts(),  # None without NVML: no GPU here
    }
