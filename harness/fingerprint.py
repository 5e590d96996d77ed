"""Platform and run fingerprints: what, besides the code, decides whether two runs can be bitwise
equal (CPU and its numerics-relevant instruction sets, OS, C library, Python; the frameworks'
versions, determinism switches and devices), and their readable differences."""
from __future__ import annotations

import json
import platform
import sys
from typing import Any

# instruction sets whose presence changes which kernels a framework picks (and so its rounding)
NUMERIC_CPU_FLAGS = ("sse2", "sse3", "pni", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f",
                     "avx512dq", "avx512bw", "avx512vl", "avx512cd", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                     "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2", "neon")


def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if ":" not in line:
                    if info:
                        break       # the first processor is enough
                    continue
                k, v = (x.strip() for x in line.split(":", 1))
                info.setdefault(k, v)
    except OSError:
        pass
    return info


def platform_fingerprint() -> dict[str, Any]:
    """What, besides the frameworks, decides whether two runs can be bitwise equal."""
    cpu = _cpuinfo()
    flags = set((cpu.get("flags") or cpu.get("Features") or "").split())
    libc = " ".join(x for x in platform.libc_ver() if x)
    return {"machine": platform.machine(), "system": platform.system(), "libc": libc or None,
            "python": platform.python_version(), "byteorder": sys.byteorder,
            "cpu_vendor": cpu.get("vendor_id") or cpu.get("CPU implementer") or None,
            "cpu_model": cpu.get("model name") or platform.processor() or None,
            "cpu_flags": sorted(f for f in NUMERIC_CPU_FLAGS if f in flags)}


def run_fingerprint(manifest: dict[str, Any]) -> dict[str, Any]:
    """The run's own part: framework versions, determinism switches, devices (from its manifest)."""
    return {"versions": manifest.get("versions") or {}, "determinism": manifest.get("determinism") or {},
            "devices": manifest.get("devices") or []}


def fingerprint_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Readable differences: '<framework> 2.21.0 -> 2.22.0', 'cpu_flags +avx512f', ..."""
    out = []
    for k in sorted(set(old) | set(new), key=str):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += fingerprint_changes(a, b, "" if k == "versions" else f"{prefix}{k}.")
        elif isinstance(a, list) and isinstance(b, list) and k == "cpu_flags":
            plus, minus = sorted(set(b) - set(a)), sorted(set(a) - set(b))
            out.append(f"{prefix}cpu_flags " + " ".join([f"+{x}" for x in plus] + [f"-{x}" for x in minus]))
        else:
            out.append(f"{prefix}{k} {_short(a)} -> {_short(b)}")
    return out


def _short(v: Any) -> str:
    s = "(none)" if v is None else (v if isinstance(v, str) else json.dumps(v, default=str))
    return s if len(s) <= 60 else s[:57] + "..."


def same_platform(base: dict[str, Any], manifest: dict[str, Any], platform_fp: dict[str, Any]) -> list[str]:
    """[] when a rerun must be bitwise equal to the baseline; else why not (the differences)."""
    return (fingerprint_changes(base.get("platform", {}), platform_fp)
            + fingerprint_changes(base.get("run", {}), run_fingerprint(manifest)))
